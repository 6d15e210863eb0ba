"""A dead deputy does not leave a verdict against the leader unjudged (issue 46): once the membership declares
it dead (its dead_timeout is the deadline), the next member in line judges (``suspects.judge_of`` with the
node's view), the checker sends the verdict there (``verified.to_judge``), and every node takes that ruling
only while the deputy is dead to it."""

from __future__ import annotations

import trio
import trio.testing

from fusionp2p.jobs.events import CheckerStruck
from fusionp2p.jobs.suspects import Suspects, judge_of
from fusionp2p.jobs.verified import to_judge
from fusionp2p.train.verify import encode_verdict
from tests.integration.test_struck_gossip import IDS, _plan, _verdict

A, B, C, D = "a", "b", "c", "d"   # a leads and is accused, b is its checker: c is the deputy, d next in line


def test_the_next_in_line_judges_when_the_deputy_is_dead() -> None:
    members = (A, B, C, D)
    assert judge_of(members, A, A, B) == C                                    # no view: the deputy
    assert judge_of(members, A, A, B, lambda p: True) == C
    assert judge_of(members, A, A, B, lambda p: p != C) == D                  # the deputy dead: the next in line
    assert judge_of(members, A, A, B, lambda p: p not in (C, D)) == ""        # all dead: nobody judges
    assert judge_of((A, B), A, A, B, lambda p: False) is None                 # nobody in line: the checker's word
    assert judge_of(members, A, C, B, lambda p: p != A) == A                  # the leader judges others as before


def test_a_ruling_of_the_next_in_line_counts_only_where_the_deputy_is_dead() -> None:
    leader, checker = IDS[0], IDS[1]
    plan = _plan(leader.peer_id, checker.peer_id, [IDS[2].peer_id, IDS[3].peer_id])
    deputy, next_in_line = sorted((IDS[2].peer_id, IDS[3].peer_id))
    ev = CheckerStruck(job="j", step=5, stage=0, peer=next_in_line, suspect=checker.peer_id,
                       evidence=encode_verdict(_verdict(leader, checker)))
    assert not Suspects().observe(next_in_line, ev, plan, leader.peer_id, lambda p: True)   # not its place
    s = Suspects()
    assert s.observe(next_in_line, ev, plan, leader.peer_id, lambda p: p != deputy) and not s.admits(checker.peer_id)


def test_the_checker_sends_to_the_next_in_line_after_the_deputy_is_declared_dead() -> None:
    dead: set[str] = set()
    sent: list[tuple[str, float]] = []

    async def send(to: str) -> bool:
        sent.append((to, trio.current_time()))
        return to != C                                     # the deputy is unreachable

    async def main() -> None:
        judge = lambda: judge_of((A, B, C, D), A, A, B, lambda p: p not in dead)  # noqa: E731
        assert not await send(C)                           # the checker's first try (EpochChecks._on_verdict)
        async with trio.open_nursery() as nursery:
            got: list[str | None] = []

            async def run() -> None:
                got.append(await to_judge(judge, send, tried={C}, me=B, deadline=60, poll=1))
            nursery.start_soon(run)
            await trio.sleep(10)                           # the membership's dead_timeout
            dead.add(C)
        assert got == [D]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [p for p, _ in sent] == [C, D] and 10 <= sent[1][1] <= 12


def test_nobody_to_judge_gives_up_at_the_deadline() -> None:
    async def main() -> None:
        sent: list[str] = []

        async def send(to: str) -> bool:
            sent.append(to)
            return False

        t0 = trio.current_time()
        assert await to_judge(lambda: "", send, tried=set(), me=B, deadline=30, poll=1) is None     # all dead
        assert sent == [] and trio.current_time() - t0 == 30
        assert await to_judge(lambda: B, send, tried=set(), me=B) is None      # it judges itself now: not sent
        assert await to_judge(lambda: D, send, tried=set(), me=B, deadline=5) is None   # refused: once only
        assert sent == [D]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
