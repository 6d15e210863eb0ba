"""The ``fusionp2p`` command: node, bootstrap, status, job …, demo, testbed (entry point in ``main``)."""

from fusionp2p.cli.main import main

__all__ = ["main"]
