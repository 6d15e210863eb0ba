"""Events print as one readable line (``str(event)``), peers by the same short form everywhere, and a
gossiped report of several steps expands into steps with their own throughput and time (issue #44)."""

from __future__ import annotations

from fusionp2p.jobs.events import (
    AveragingOutlier,
    CheckerStruck,
    CheckpointSaved,
    EvalProgress,
    JobStateChanged,
    LinksUp,
    MembersChanged,
    PlanChanged,
    StageConvicted,
    StepProgress,
    StepSkipped,
    expand_steps,
)
from fusionp2p.jobs.progress import ProgressBook
from fusionp2p.types import short_peer

A = "12D3KooWSbwQgywwmoPLxhPLtDR812UAqTa6w6798Q6z9H8u1xWS"
B = "12D3KooWF1imgEreSxMGxYKRvJm7Z2d19QyYFfUPeHG6MjaB4JeV"
C = "12D3KooWLK6ngBJz8BZrs3HnzCXQJdQbadX7z2iqbp7crfMrrrTT"
D = "12D3KooWQ8fNYcVQ7ZuS4n1yF7rMKEXAMPLEpeerid00000000AB"


def test_short_peer_is_the_suffix() -> None:
    assert short_peer(A) == "9H8u1xWS" and short_peer("abc") == "abc"


def test_every_event_is_one_short_line() -> None:
    evs = [
        StepProgress(job="j1", step=12, stage=1, peer=A, loss=4.2134, tokens_per_s=1450.4, compute_util=0.85),
        PlanChanged(job="j1", epoch=0, plan_hash="ab" * 32, stage_sizes=(2, 2), members=(A, B, C, D), step_s=0.87,
                    how="pipeline", rho=(1.0,), link_bps=(4e6,), fence_s=(0.1,), dense_s=(0.1,)),
        JobStateChanged(job="j1", state="planned", reason="cd" * 32),
        MembersChanged(job="j1", epoch=1, joined=(C,), left=(D,)),
        CheckpointSaved(job="j1", step=20, stage=0, peer=B, hash="ef" * 32),
        StepSkipped(job="j1", step=3, stage=0, peer=A, reason="non-finite gradients"),
        EvalProgress(job="j1", step=20, loss=3.9),
        LinksUp(job="j1", epoch=0, stage=0, peer=A, links=(f"{B}=direct", f"{C}=libp2p")),
        AveragingOutlier(job="j1", step=9, stage=1, peer=A, suspect=B),
        StageConvicted(job="j1", step=9, stage=1, peer=A, suspect=B, evidence=b"x" * 400),
        CheckerStruck(job="j1", step=9, stage=1, peer=A, suspect=C, evidence=b"x" * 400),
    ]
    for ev in evs:
        s = str(ev)
        assert "\n" not in s and len(s) < 200 and s.startswith("job j1"), s
        assert "(" not in s.split(" ", 2)[1], s           # not the dataclass repr
        for p in (A, B, C, D):
            assert p not in s, s                           # long ids never; short_peer instead
    assert str(evs[0]) == "job j1 step 12 (epoch 0): loss 4.2134, 1,450 tokens/s, compute 85% [stage 1 on 9H8u1xWS]"
    assert str(evs[1]) == ("job j1 plan abababab (epoch 0): 2 stages x replicas (2, 2) on 4 nodes "
                           "[9H8u1xWS, MjaB4JeV | rfMrrrTT, 000000AB], predicted 0.87 s/step (pipeline); fences dense")
    assert str(evs[2]) == "job j1 planned: plan cdcdcdcd"
    assert str(evs[3]) == "job j1 members (epoch 1): joined rfMrrrTT; left 000000AB"
    assert str(evs[6]) == "job j1 held-out loss 3.9000 after step 20 (epoch 0)"
    assert str(evs[7]) == "job j1 links up (epoch 0) [stage 0 on 9H8u1xWS]: MjaB4JeV direct, rfMrrrTT libp2p"
    assert str(evs[8]) == ("job j1 step 9: replica MjaB4JeV of stage 1 sent outlying averaging parts too often; "
                           "averaging without it [stage 1 on 9H8u1xWS]")
    assert str(evs[9]) == ("job j1 step 9: replica MjaB4JeV of stage 1 sent outputs its parameters do not make "
                           "(spot-check by 9H8u1xWS); left out of the next plan")
    assert str(evs[10]) == ("job j1 step 9: checker rfMrrrTT accused a replica of stage 1 falsely (9H8u1xWS's "
                            "recomputation); left out of the next plan")


def test_earlier_steps_keep_their_own_throughput_and_time() -> None:
    ev = StepProgress(job="j", step=5, peer=A, loss=1.0, tokens_per_s=300.0, at=105.0, earlier=(3.0, 2.0),
                      earlier_tokens_per_s=(100.0, 200.0), earlier_at=(101.0, 103.0))
    steps = expand_steps(ev)
    assert [(e.step, e.loss, e.tokens_per_s, e.at) for e in steps] == [
        (3, 3.0, 100.0, 101.0), (4, 2.0, 200.0, 103.0), (5, 1.0, 300.0, 105.0)]
    old = StepProgress(job="j", step=5, peer=A, loss=1.0, tokens_per_s=300.0, at=105.0, earlier=(3.0,))
    first, last = expand_steps(old)
    assert (first.tokens_per_s, first.compute_util) == (0.0, None) and last.tokens_per_s == 300.0  # not a copy


def test_aggregated_steps_name_their_replicas_and_end_time() -> None:
    book = ProgressBook(job="j", steps=10)
    book.set_plan(0, 1, [A, B])
    assert book.add(A, StepProgress(job="j", step=0, stage=1, peer=A, loss=2.0, tokens_per_s=10.0, at=50.0), now=99.0) == []
    (ev,) = book.add(B, StepProgress(job="j", step=0, stage=1, peer=B, loss=4.0, tokens_per_s=20.0, at=51.0), now=99.0)
    assert (ev.peer, ev.loss, ev.tokens_per_s, ev.at) == (",".join(sorted([A, B])), 3.0, 30.0, 51.0)
    assert str(ev).endswith("[stage 1 on MjaB4JeV, 9H8u1xWS]")


def test_idle_nodes_are_named_with_the_reason() -> None:
    from types import SimpleNamespace

    from fusionp2p.jobs.events import idle_reason
    from fusionp2p.plan.plan import Candidate

    ev = PlanChanged(job="j1", epoch=0, plan_hash="ab" * 32, stage_sizes=(1, 1), members=(A, B), step_s=0.5,
                     idle=(C,), idle_why="standby: replicas=1 caps the replicas per stage")
    assert str(ev).endswith("s/step; idle rfMrrrTT (standby: replicas=1 caps the replicas per stage)")
    plan: object = SimpleNamespace(considered=(Candidate(replicas=1, stages=2, how="pipeline", step_time_s=0.5),
                                               Candidate(replicas=1, stages=3, how="pipeline", step_time_s=0.9)))
    assert idle_reason(plan, 2, 2) == ("standby: the best plan with more nodes, 3 stage(s) x 1 replica(s), was "  # type: ignore[arg-type]
                                       "predicted at 0.9 s/step")
    lone: object = SimpleNamespace(considered=(Candidate(replicas=2, stages=1, how="replicas", step_time_s=0.5),))
    assert "replicas=2 caps" in idle_reason(lone, 2, 2)  # type: ignore[arg-type]
