"""The node daemon application: ``python -m node`` == ``fusionp2p node``."""
