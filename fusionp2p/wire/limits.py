"""Size limits of every decoder, in one place (STYLE.md 3)."""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """Bounds applied before any allocation driven by a peer's bytes."""

    max_frame: int = 256 * MiB          # one framed message on a stream (tensor frames included)
    max_control_frame: int = 1 * MiB    # control messages (records, tickets, probes)
    max_gossip: int = 64 * KiB          # gossip payloads (LIBP2P_NOTES §5: keep them small)
    max_msgpack_items: int = 100_000    # array/map entries in one msgpack message
    max_str: int = 1 * MiB
    max_tensor_bytes: int = 4 * GiB
    max_tensor_dims: int = 8
    max_dag_nodes: int = 200_000
    max_dag_values: int = 400_000       # tensors all nodes of a DAG declare together (split/unbind outputs)
    max_dag_header: int = 4 * MiB       # a DAG's msgpack header (GPT-2 124M: 54 KB)
    max_dag_bytes: int = 1024 * GiB     # a DAG's declared tensors together; the job intake lowers it to the node's memory

    def __post_init__(self) -> None:
        for name in ("max_frame", "max_control_frame", "max_gossip", "max_msgpack_items", "max_str"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive")


DEFAULT_LIMITS = Limits()
