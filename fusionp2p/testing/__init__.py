"""Public test kit: the in-memory transport, swarm fixtures, the network-namespace testbed."""
