"""The deferred start-up's trigger (swarm/startup.py): past ``defer`` it waits on while the node's first
probe round still measures links, until they stall or ``patience`` runs out. 20 node processes on 2 cores
all ran their start-ups at the 15 s mark with 86 of 190 pairs measured, and the rest took until 88 s
(issue 40). Trio's mock clock: no network, no sleeps."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from fusionp2p.errors import ConfigError
from fusionp2p.swarm.startup import Startup, StartupConfig

CFG = StartupConfig(defer=15.0, jitter=0.0, patience=45.0, stall=5.0)


def _wanted_at(measured: Callable[[float], int] | None, first_round_at: float | None = None,
               cfg: StartupConfig = CFG) -> tuple[float, str]:
    """When (mock seconds after joining) the start-up is wanted, and why; *measured* maps the time to the
    node's links measured then."""
    startup = Startup(cfg)

    async def main() -> float:
        t0 = trio.current_time()
        first_round = trio.Event()
        with trio.fail_after(1000):
            async with trio.open_nursery() as nursery:
                if first_round_at is not None:
                    async def done() -> None:
                        await trio.sleep(first_round_at)
                        first_round.set()
                    nursery.start_soon(done)
                count = None if measured is None else (lambda: measured(trio.current_time() - t0))
                await startup.trigger(first_round, count)
                nursery.cancel_scope.cancel()
        return trio.current_time() - t0

    at = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return at, startup.reason


def test_a_round_still_measuring_at_the_deadline_holds_the_start_up_until_it_is_done() -> None:
    # a link measured every 2 s, the last of 19 at 38 s: the first round is done at 38 s, not cut at 15
    at, why = _wanted_at(lambda t: min(19, int(t // 2)), first_round_at=38.0)
    assert at == pytest.approx(38.0) and why == "the first probe round is done", (at, why)


def test_a_round_that_stalls_lets_the_start_up_run() -> None:
    # links measured until 20 s, then none: the start-up runs ~stall seconds after the last one
    at, why = _wanted_at(lambda t: min(10, int(t // 2)))
    assert 24.0 <= at <= 26.5 and "until its probes stalled" in why, (at, why)


def test_no_progress_since_joining_starts_up_at_the_deadline() -> None:
    at, why = _wanted_at(lambda t: 0)
    assert at == pytest.approx(15.0) and why == "15 s after joining", (at, why)
    at, why = _wanted_at(None)   # a node that does not probe
    assert at == pytest.approx(15.0) and why == "15 s after joining", (at, why)


def test_no_deferral_asked_starts_up_at_once_however_the_probes_progress() -> None:
    at, why = _wanted_at(lambda t: 1 + int(t), cfg=StartupConfig(defer=0.0, jitter=0.0))
    assert at == 0.0 and why == "0 s after joining", (at, why)


def test_patience_bounds_the_wait() -> None:
    at, why = _wanted_at(lambda t: int(t))   # one more link every second, forever
    assert at == pytest.approx(15.0 + 45.0, abs=1.0) and "45 s more" in why, (at, why)


def test_patience_and_stall_are_checked() -> None:
    for bad in ({"patience": -1.0}, {"stall": 0.0}):
        with pytest.raises(ConfigError):
            StartupConfig(**bad)  # type: ignore[arg-type]
