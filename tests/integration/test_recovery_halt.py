"""Issue 41: a halt ends an epoch without waiting for its links' sockets to close.

On real node processes a link's graceful close (``net/bulk_channel.py``) waits, shielded, up to
``dead_after`` (3 s) for the peer to read what was sent; after a halt the peer reads no more, and every
re-plan of benchmarks.churn waited those 3 s in the member that dialed the link (its halt answered 3.0 s
after the others). Here each dialed channel's close lingers ``LINGER`` seconds, shielded, as such a link
does; a member's death still halts every survivor well within that time, since an epoch ends when its
channels said goodbye, not when their links finished closing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from fusionp2p.jobs.events import PlanChanged, ProgressEvent, StepProgress
from fusionp2p.net.resilient import open_resilient_channel
from fusionp2p.train.config import CO2, TrainConfig
from tests.integration.test_elastic import _built, _check_done, _node, _publish, _stage_peers, _swarm

LINGER = 6.0   # seconds a dialed channel's link takes to close, shielded
KILL_AT = 8


@pytest.mark.slow
def test_a_halt_does_not_wait_for_the_links_to_close(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="fusionp2p.jobs")
    torch.set_num_threads(1)
    @asynccontextmanager
    async def lingering(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with open_resilient_channel(*args, **kwargs) as ch:
            try:
                yield ch
            finally:
                with trio.CancelScope(shield=True):
                    await trio.sleep(LINGER)

    monkeypatch.setattr("fusionp2p.jobs.links.open_resilient_channel", lingering)
    cfg = TrainConfig(steps=16, micro_batch=2, micro_batches=2, lr=3e-3, replicas=2, averaging=CO2(tau=2),
                      compression="none", checkpoint_every=0, seed=1)
    killed: list[str] = []

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(4, tmp_path) as (emb, pub, client):
                built = await _built(client, cfg, b"h")
                plan0: list[PlanChanged] = []

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and not plan0:
                        plan0.append(ev)
                    if isinstance(ev, StepProgress) and ev.step == KILL_AT and not killed:
                        victim = _stage_peers(plan0[0], 1)[1]
                        killed.append(victim)
                        emb.kill(_node(emb, victim))

                return await _publish(pub, built, tmp_path, on_event)

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert plans[0].stage_sizes == (2, 2) and killed and plans[-1].epoch >= 1
    led = [r.created for r in caplog.records if "leading a re-plan from epoch 0" in r.getMessage()]
    halted = [r.created for r in caplog.records if "epoch 0 halted at step" in r.getMessage()
              or "epoch 0: pipeline broken" in r.getMessage()]
    assert led and len(halted) >= 3, (led, halted)   # the three survivors
    slowest = max(halted) - led[0]
    assert slowest < LINGER - 1.0, slowest   # each waited LINGER for its dialed links before the fix
