"""The one shared polling helper for tests that watch *other processes* (which cannot send us events)."""

from fusionp2p.cli.cluster import wait_until

__all__ = ["wait_until"]
