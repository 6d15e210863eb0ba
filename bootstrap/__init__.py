"""The bootstrap application: ``python -m bootstrap`` == ``fusionp2p bootstrap``."""
