"""What a node measured about its device; published in its signed NodeRecord."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    device: str                 # "cpu", "cuda:0", ...
    kind: str                   # "cpu" | "cuda"
    name: str                   # e.g. "x86_64 (2 threads)" or "NVIDIA H100 80GB HBM3"
    flops_fp32: float           # measured matmul FLOP/s
    flops_bf16: float           # measured, 0.0 where unsupported
    memory_bytes: int           # memory usable for training
    threads: int = 1
    versions: tuple[tuple[str, str], ...] = ()   # (("torch", "2.13.0"), ("python", "3.11.7"), ...)

    def __post_init__(self) -> None:
        if self.flops_fp32 <= 0:
            raise ValueError("flops_fp32 must be positive")
        if self.memory_bytes <= 0:
            raise ValueError("memory_bytes must be positive")

    def to_wire(self) -> dict[str, Any]:
        return {
            "device": self.device, "kind": self.kind, "name": self.name,
            "flops_fp32": float(self.flops_fp32), "flops_bf16": float(self.flops_bf16),
            "memory_bytes": int(self.memory_bytes), "threads": int(self.threads),
            "versions": [list(v) for v in self.versions],
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> DeviceProfile:
        """Build from a decoded map; raises ValueError/TypeError/KeyError on bad input (callers wrap)."""
        versions = tuple((str(a), str(b)) for a, b in m.get("versions", []))
        return cls(
            device=str(m["device"]), kind=str(m["kind"]), name=str(m["name"]),
            flops_fp32=float(m["flops_fp32"]), flops_bf16=float(m["flops_bf16"]),
            memory_bytes=int(m["memory_bytes"]), threads=int(m.get("threads", 1)), versions=versions,
        )
