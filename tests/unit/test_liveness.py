"""Death probes (jobs/liveness.py): a lost link's peer is asked directly; a refusal confirms its death
and starts the re-plan (issue 41), an answer never does."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from fusionp2p.errors import ConfigError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.liveness import DeathProbes, ProbeConfig
from fusionp2p.net.memory import memory_network
from fusionp2p.wire.protocols import JOB


def test_a_death_probe_confirms_a_refused_peer_once_and_never_one_that_answers() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net, trio.open_nursery() as nursery:
                me, live, dead = net.add_host(), net.add_host(), net.add_host()

                async def answer(peer: str, req: dict[str, Any]) -> dict[str, Any]:
                    return {"ok": False, "state": "", "reason": "unknown job"}

                for h in (live, dead):
                    h.set_stream_handler(JOB, job_proto.serve(answer))
                    await me.connect(h.listen_addrs()[0])
                net.kill(dead.peer_id)
                told: list[str] = []
                probes = DeathProbes(me, ProbeConfig(timeout=2.0, every=0.01), on_dead=told.append)
                await nursery.start(probes.serve)
                probes.suspect(dead.peer_id)
                probes.suspect(live.peer_id)
                assert not probes.confirmed(dead.peer_id)   # asked, not answered yet
                await probes.ask(dead.peer_id)   # with serve()'s own question: one refusal is told, not two
                await probes.ask(live.peer_id)
                assert probes.confirmed(dead.peer_id) and not probes.confirmed(live.peer_id)
                assert told == [dead.peer_id]
                probes.forget(dead.peer_id)   # the view saw it again (a restart with its identity)
                assert not probes.confirmed(dead.peer_id)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_disabled_probes_ask_nobody_and_deadlines_are_checked() -> None:
    async def main() -> None:
        probes = DeathProbes(None, ProbeConfig(enabled=False))   # type: ignore[arg-type]
        probes.suspect("peer")
        with pytest.raises(trio.WouldBlock):
            probes._recv.receive_nowait()

    trio.run(main)
    with pytest.raises(ConfigError):
        ProbeConfig(timeout=0)
