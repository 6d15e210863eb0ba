"""The long-running processes: ``fusionp2p node`` and ``fusionp2p bootstrap``.

Both load (or create) a persistent identity in their home directory, start a libp2p transport,
run the swarm service, print their full multiaddrs once listening, and leave cleanly on SIGINT or
SIGTERM (announce departure, close streams, exit 0).
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio

from fusionp2p.errors import ConfigError
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport, parse_peer_addr
from fusionp2p.net.relay import RelayLimits
from fusionp2p.net.transport import StreamHandler
from fusionp2p.swarm.gcfreeze import watch_collections
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.startup import Startup
from fusionp2p.threads import run_abandonable
from fusionp2p.types import DeviceProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonConfig:
    role: str
    home: Path
    listen: tuple[str, ...]
    bootstrap: tuple[str, ...] = ()
    announce: tuple[str, ...] = ()
    device: str = "cpu"
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    relay: RelayLimits | None = None   # offer circuit relay v2 within these limits (net/relay.py)
    hole_punch: bool = False           # try DCUtR on relayed connections (experimental)
    # emulation of a slower accelerator (--emulate-slowdown): the device benchmark's rates divided by it
    # (the job service sleeps the compute to match: NodeJobConfig.compute_slowdown)
    compute_slowdown: float = 1.0
    # the memory this node offers, in bytes (--memory; in its signed profile: the planner keeps its stage
    # within it and the node refuses a stage over it); None: measured as available, less a headroom
    memory: int | None = None

    def __post_init__(self) -> None:
        if self.memory is not None and self.memory < 1:
            raise ConfigError("--memory must be positive")
        for b in self.bootstrap:
            parse_peer_addr(b)
        if self.role == "node":
            from fusionp2p.swarm.device import check_device, check_slowdown

            check_device(self.device)
            check_slowdown(self.compute_slowdown)
        Libp2pConfig(listen=self.listen, announce=self.announce)  # validates the addresses


async def run_daemon(cfg: DaemonConfig, *, on_ready: Callable[[Sequence[str]], None],
                     extra_services: Callable[[SwarmNode, trio.Nursery], None] | None = None,
                     prepare: Callable[[], None] | None = None, startup: Startup | None = None,
                     early_handlers: Sequence[tuple[str, StreamHandler]] = ()) -> None:
    """Run until SIGINT/SIGTERM; *on_ready* receives the listen addresses once we listen.

    A node listens, joins and probes first; its heavy start-up (*prepare*: the CLI's torch and job
    service imports, then its device benchmark) waits until *startup* wants it (swarm/startup.py: a job
    request, its first probe round done, or a bounded delay), and the node announces its profile with
    its next record. Run in the first seconds, torch's import and the benchmark held up the probes of 20
    processes starting at once on 2 cores (issue 40). No planner guesses a profile: a publisher offers
    the job to a member without one and plans with the profile its accept carries (jobs/publisher.py), a
    re-plan's leader waits for its record (jobs/lead.py); until the job service serves, a JOB request starts
    the start-up and waits for it (``Startup.early_job``, installed by the caller in *early_handlers*
    before the node listens). A signal is answered at once, even while the
    start-up still runs (the process does not wait for it)."""
    identity = Identity.load_or_create(cfg.home)
    startup = startup if startup is not None else Startup()
    watch_collections()   # full collections over 20 ms logged (swarm/gcfreeze.py; a freeze after the start-up was tried, not adopted)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_libp2p_transport(identity, Libp2pConfig(listen=cfg.listen, announce=cfg.announce,
                                                                    relay=cfg.relay, hole_punch=cfg.hole_punch)) as t:
            for protocol, handler in early_handlers:
                # e.g. the CLI's JOB handler that starts the start-up on demand (``Startup.early_job``), replaced
                # by the job service's own once it runs (jobs/node.py); the jobs layer is above this one
                t.set_stream_handler(protocol, handler)
            on_ready(t.listen_addrs())
            swarm = SwarmNode(t, replace(cfg.swarm, role=cfg.role), None)   # the bootstrap never has a profile
            async with trio.open_nursery() as nursery:
                await nursery.start(swarm.run, list(cfg.bootstrap))
                nursery.start_soon(_serve, cfg, swarm, nursery, extra_services, prepare, startup)
                async for signum in signals:
                    log.info("signal %s: leaving", signal.Signals(signum).name)
                    break
                await swarm.leave()
                nursery.cancel_scope.cancel()


async def _serve(cfg: DaemonConfig, swarm: SwarmNode, nursery: trio.Nursery,
                 extra_services: Callable[[SwarmNode, trio.Nursery], None] | None,
                 prepare: Callable[[], None] | None, startup: Startup) -> None:
    """A node's start-up once wanted (imports in a niced thread, the benchmark in a worker thread, both
    abandoned on a signal), its profile announced at once; then *extra_services*."""
    if cfg.role == "node":
        probing = swarm.config.probing
        await startup.trigger(swarm.prober.first_round if probing else None,
                              swarm.prober.links_measured if probing else None)
        c0 = time.process_time()
        if prepare is not None:
            await startup.run_prepare(prepare)
        # a stop abandons the benchmark (torch) to its thread; the process's exit waits for it (fusionp2p/threads.py)
        swarm.profile, bench_cpu = await run_abandonable(functools.partial(_node_profile, cfg))
        swarm.beat_soon()
        # what the start-up cost (issue 40: ~6 CPU-s a node among 20 starting on 2 cores), the threads' own
        # CPU and the whole process's meanwhile (its event loop's probes and gossip included)
        log.info("start-up done: imports %.2f CPU-s, device benchmark %.2f CPU-s (their threads), %.2f CPU-s the "
                 "process's meanwhile", startup.prepare_cpu, bench_cpu, time.process_time() - c0)
    if extra_services is not None:
        extra_services(swarm, nursery)
    log.info("%s %s joined; %d members", cfg.role, swarm.peer_id, len(swarm.members()))


def _node_profile(cfg: DaemonConfig) -> tuple[DeviceProfile, float]:
    """(worker thread, normal priority: it measures the rate stages will get) the device benchmark,
    slowed by the emulated slowdown; its memory is ``--memory`` where the user gave one. With the
    CPU-seconds this thread spent on it."""
    from fusionp2p.swarm.device import enable_tf32, measure_profile, resident, stage_memory_of

    c0 = time.thread_time()

    enable_tf32(cfg.device)   # before the benchmark: the fp32 rate it announces is the one stages get
    profile = measure_profile(cfg.device).slowed(cfg.compute_slowdown)
    if cfg.memory is not None:
        if cfg.memory > profile.memory_bytes:
            log.warning("--memory %d bytes is more than this node measures free less its headroom (%d)",
                        cfg.memory, profile.memory_bytes)
        # on a GPU the offer is the device's memory, which the process's resident (host) size does not use
        own = resident()[0] if cfg.device == "cpu" else 0
        profile = replace(profile, memory_bytes=stage_memory_of(cfg.memory, own))
    return profile, time.thread_time() - c0


def check_home(home: str | None, default: Path) -> Path:
    p = Path(home) if home else default
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--home {p} is not a directory")
    return p




__all__ = ["DaemonConfig", "check_home", "run_daemon"]
