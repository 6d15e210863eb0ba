"""Networking: the narrow Transport interface, identities, and the libp2p adapter.

This is the only package that imports ``libp2p`` (enforced by tests/unit/test_import_rules.py).
"""

from fusionp2p.net.transport import GossipMessage, Stream, StreamHandler, Transport

__all__ = ["GossipMessage", "Stream", "StreamHandler", "Transport"]
