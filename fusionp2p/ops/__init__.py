"""Operating a swarm: a node's live state as a dashboard, ``/api`` JSON and Prometheus ``/metrics``.

``fusionp2p node --http ADDR`` and ``fusionp2p bootstrap --http ADDR`` run :func:`serve_ops` beside
their services. It reads the node's state (``ops/state.py``), never changes it, and serves it
read-only over HTTP (``ops/http.py``, hypercorn under trio). See docs/operations.md.

Layer: above ``swarm`` and ``jobs`` (it reads both), below ``cli``.
"""

from fusionp2p.ops.http import HttpConfig, parse_http_addr
from fusionp2p.ops.service import serve_ops
from fusionp2p.ops.state import JobSource, OpsLimits, OpsState

__all__ = ["HttpConfig", "JobSource", "OpsLimits", "OpsState", "parse_http_addr", "serve_ops"]
