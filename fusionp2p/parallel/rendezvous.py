"""Starting ``torch.distributed`` for the devices of one cluster.

The node runtime exchanges the rendezvous details (master address and port, each process's rank,
the world size) over the swarm and hands them to :func:`init_distributed`; the distributed engine
itself is ``torch.distributed`` (gloo on CPU, NCCL on CUDA). :func:`launch_local` starts ``world``
local processes on one machine (tests, benchmarks, co-located nodes).

torch.multiprocessing pickles the worker function and its arguments to start the children; it is
local process start-up only, never reachable by a peer.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusionp2p.errors import ConfigError

log = logging.getLogger(__name__)

Backend = Literal["auto", "gloo", "nccl"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousSpec:
    """Where and how one process joins a cluster's process group."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    backend: Backend = "auto"
    timeout_s: float = 60.0
    local_rank: int | None = None       # device index on this machine (defaults to rank)

    def __post_init__(self) -> None:
        if not self.master_addr:
            raise ConfigError("RendezvousSpec.master_addr is empty")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"RendezvousSpec.master_port {self.master_port} is not a TCP port")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} must be in [0, world_size={self.world_size})")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend {self.backend!r}: use 'auto', 'gloo' or 'nccl'")
        if self.timeout_s <= 0:
            raise ConfigError("RendezvousSpec.timeout_s must be positive")

    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend


def select_device(backend: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank mod #devices>`` for NCCL, else the CPU."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
        idx = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def init_distributed(spec: RendezvousSpec) -> torch.device:
    """Initialise the default process group from ``spec``; returns this process's device.

    Raises :class:`~fusionp2p.errors.ConfigError` when a group is already initialised. A peer
    that does not show up within ``timeout_s`` makes torch raise (``DistBackendError`` / timeout).
    """
    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised in this process")
    backend = spec.resolved_backend()
    device = select_device(backend, spec.rank if spec.local_rank is None else spec.local_rank)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
                            rank=spec.rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout_s), **kwargs)
    log.info("joined process group rank %d/%d (%s) on %s", spec.rank, spec.world_size, backend, device)
    return device


def shutdown() -> None:
    """Destroy the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for local launches)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, threads: int, backend: Backend,
           timeout_s: float, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    init_distributed(RendezvousSpec(master_addr="127.0.0.1", master_port=port, rank=rank, world_size=world,
                                    backend=backend, timeout_s=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        shutdown()


def launch_local(fn: Callable[..., None], world: int, *args: Any, threads: int = 1, backend: Backend = "gloo",
                 start_method: Literal["spawn", "fork", "forkserver"] = "forkserver", timeout_s: float = 60.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` local processes joined in one process group.

    ``fn`` must be importable (module level) for "spawn"/"forkserver". The default "forkserver"
    imports torch once in the server and forks the workers from it: much faster than "spawn" on a
    small machine, and safer than "fork" from a process whose thread pools are already running.
    Blocks until all exit; the first failure terminates the others and is re-raised
    (``torch.multiprocessing.ProcessRaisedException``).
    """
    if world < 1:
        raise ConfigError("world must be >= 1")
    if start_method == "forkserver":
        # Only effective before the (process-wide) fork server starts; harmless afterwards.
        mp.set_forkserver_preload(["torch", "fusionp2p.parallel"])
    port = free_port()
    mp.start_processes(  # type: ignore[attr-defined, no-untyped-call]
        _entry, args=(fn, world, port, threads, backend, timeout_s, args), nprocs=world,
        join=True, start_method=start_method)
