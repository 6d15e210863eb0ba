"""When a node's heavy start-up runs: torch's import, the job service's and the device benchmark (issue 40).

A node listens, joins and probes without them (the swarm layer imports no torch). They cost some 3.5
CPU-seconds a node (torch 2.2, the benchmark 0.8, the job service 0.5); run in the first seconds of a
swarm of 20 node processes on 2 cores, they were 68 CPU-seconds against the 30 two cores give in 15 s,
the probe streams did not open or answer within ``probe.ctrl_timeout`` and were tried again with backoff,
and the matrix took 80-207 s. So the start-up waits until the first of:

* a job request arrives (``early_job``: the JOB handler installed before the job service exists): the
  start-up runs at once, at normal priority, and the request is answered by the job service once it
  serves, the device profile measured first;
* the node's first probe round is done (``LinkProber.first_round``: its share of the matrix measured);
* ``StartupConfig.defer`` seconds after the node joined (a lone node, or peers it cannot measure), plus
  a random share of up to ``jitter`` times that: nodes started together (a benchmark's 20 processes) do not
  all import torch and benchmark their device in the same second, each starving the others' heartbeats.
  While its first round still measures links then (one more of them measured, by it or by the peer,
  within the last ``stall`` seconds), it waits on, up to ``patience`` seconds more: 20 node processes on 2
  cores (2026-11-30, idle) all reached the 15 s mark with 86 of the 190 pairs measured, their start-ups
  (~120 CPU-s together) then ran amid the probes, 26 pairs were measured in the next 40 s (260 probe
  streams timed out), and the last one 88 s after the last node listened; with the start-up's imports
  preloaded the probes alone took 23 s (issue 40).

In the last two cases torch's and the job service's imports run in a thread of their own at a lower CPU
priority (``nice``, 5 by default; Linux sets it per thread), so that other processes' probes go first
(a thread holding the GIL while descheduled also holds up its own event loop, for at most a scheduler
period: CFS runs every runnable thread once a period, whatever its weight). The device
benchmark itself runs at normal priority: it measures the rate stages will get. Its FLOP/s are never
guessed: the node re-publishes its signed record with them once measured, and a publisher offers a job to
a live member whose record has none yet all the same (jobs/publisher.py): the offer starts the start-up
here, the node answers once measured, and its accept carries the profile it measured, which the plan uses
(a job submitted moments after a 5-node cluster started had run on the one node that had measured). A
re-plan's leader offers the job to such a node the same way and plans it with the profile of its accept
(jobs/lead.py ``_offer_joiners``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from fusionp2p.errors import ConfigError

log = logging.getLogger(__name__)

JobHandler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, kw_only=True, slots=True)
class StartupConfig:
    defer: float = 15.0          # at most this many seconds after joining before the start-up runs anyway
    jitter: float = 0.5          # ... plus up to this share of defer, at random (spreads nodes started together)
    patience: float = 45.0       # ... plus at most this long while the first probe round still measures links (defer 0: none)
    stall: float = 5.0           # ... (it does while one more link was measured within this many seconds)
    # the imports' thread runs this much nicer than the process (0: as the process). Not more: on a host
    # busy with other work a thread at nice 19 all but stops (4 nodes of a benchmark run at nice 10, at
    # load 25 on 2 cores, 2026-11-29: no profile 100 s after their start-up began with 10 here)
    nice: int = 5
    # a job request that started the start-up waits this long for the job service (torch's import and
    # the benchmark take a few seconds idle; a node on a loaded machine is given room)
    on_demand_timeout: float = 120.0

    def __post_init__(self) -> None:
        if not self.defer >= 0:
            raise ConfigError("--defer-startup must be >= 0 seconds")
        if not (self.patience >= 0 and self.stall > 0):
            raise ConfigError("the start-up's patience must be >= 0 seconds, its stall positive")
        if not 0 <= self.jitter <= 1:
            raise ConfigError("the start-up's jitter must be in [0, 1]")
        if not 0 <= self.nice <= 19:
            raise ConfigError("--startup-nice must be in [0, 19]")
        if not self.on_demand_timeout > 0:
            raise ConfigError("on_demand_timeout must be positive")


class Startup:
    """The deferred start-up's trigger (``wanted``, with the ``reason``) and the job service's handler
    once it serves (``serving``). One per node process (``swarm/daemon.py``)."""

    def __init__(self, config: StartupConfig | None = None) -> None:
        self.config = config or StartupConfig()
        self.wanted = trio.Event()
        self.reason = ""
        self.on_demand = False        # wanted by a job request: no lower priority
        self.serving = trio.Event()
        self._handler: JobHandler | None = None
        self.prepare_cpu = 0.0        # CPU-seconds of run_prepare's thread (logged by swarm/daemon.py)

    def want(self, reason: str, *, on_demand: bool = False) -> None:
        if self.wanted.is_set():
            return
        self.reason, self.on_demand = reason, on_demand
        log.info("start-up (torch, job service, device benchmark) now: %s", reason)
        self.wanted.set()

    def serve(self, handler: JobHandler) -> None:
        """The job service serves now: requests that waited for it go to *handler*."""
        self._handler = handler
        self.serving.set()

    async def trigger(self, first_round: trio.Event | None, measured: Callable[[], int] | None = None) -> None:
        """Until the start-up is wanted: a job request, *first_round* set, or ``defer`` seconds passed (and
        then, while *measured*, our links measured so far, still grows, up to ``patience`` more)."""
        async with trio.open_nursery() as nursery:
            if first_round is not None:
                async def probed() -> None:
                    await first_round.wait()
                    self.want("the first probe round is done")
                nursery.start_soon(probed)
            progress = [0, -math.inf]   # links measured, and when that count last grew

            async def watch() -> None:
                assert measured is not None
                while True:
                    count = measured()
                    if count > progress[0]:
                        progress[:] = [count, trio.current_time()]
                    await trio.sleep(min(1.0, self.config.stall / 4))
            if measured is not None:
                nursery.start_soon(watch)

            async def deadline() -> None:
                cfg = self.config
                extra = cfg.defer * cfg.jitter * random.random()
                await trio.sleep(cfg.defer + extra)
                why = f"{cfg.defer:g} s after joining" + (f" (+{extra:.1f} s jitter)" if extra else "")
                waited_from = trio.current_time()
                while measured is not None and cfg.defer > 0 and trio.current_time() - progress[1] < cfg.stall:
                    if trio.current_time() - waited_from >= cfg.patience:
                        self.want(f"{why}, {cfg.patience:g} s more while the first probe round measured links")
                        return
                    await trio.sleep(min(1.0, cfg.stall / 4))
                waited = trio.current_time() - waited_from
                self.want(why + (f", {waited:.1f} s more until its probes stalled" if waited > 0 else ""))
            nursery.start_soon(deadline)
            await self.wanted.wait()
            nursery.cancel_scope.cancel()

    async def early_job(self, peer: str, req: dict[str, Any]) -> dict[str, Any]:
        """The JOB handler before the job service serves: the start-up now, then the service's answer."""
        self.want(f"a job request ({str(req.get('op'))[:16]}) from {peer[-8:]}", on_demand=True)
        with trio.move_on_after(self.config.on_demand_timeout):
            await self.serving.wait()
        if self._handler is None:
            return {"ok": False, "error": "this node's job service is still starting: ask again"}
        return await self._handler(peer, req)

    async def run_prepare(self, prepare: Callable[[], None]) -> None:
        """*prepare* (imports) in a thread of its own, niced unless a job request wants it; abandoned
        (the thread finishes on its own) when cancelled. Not in trio's thread cache: a thread's nice
        cannot be undone without privilege, and a cached thread would run a job's compute later."""
        nice = 0 if self.on_demand else self.config.nice
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        failure: list[BaseException] = []

        def body() -> None:
            c0 = time.thread_time()
            try:
                if nice:
                    lower_priority(nice)
                prepare()
            except BaseException as exc:
                failure.append(exc)
            finally:
                self.prepare_cpu = time.thread_time() - c0
                with contextlib.suppress(trio.RunFinishedError):   # the node ended while we imported
                    token.run_sync_soon(done.set)

        threading.Thread(target=body, name="fusionp2p-startup", daemon=True).start()
        await done.wait()
        if failure:
            raise failure[0]


def lower_priority(nice: int) -> None:
    """This thread *nice* steps nicer (Linux: a thread's own; elsewhere the call would nice the whole
    process, so nothing is done)."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:   # a sandbox may refuse it: the start-up then runs as the process does
        log.debug("start-up thread not niced: %s", exc)


__all__ = ["Startup", "StartupConfig", "lower_priority"]
