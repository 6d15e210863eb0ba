"""The streamed sample order (data/stream.py): exact per epoch across re-plans, local per replica."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.data import make_shards
from fusionp2p.data.stream import StreamConfig, StreamOrder, check_history, next_history
from fusionp2p.errors import ConfigError

M, B, T = 2, 4, 8


def _manifest(shards: int = 12, per: int = 10, extra: int = 3):
    # shards of per * T + extra tokens: `per` windows each (the extra tokens are the target and slack)
    toks = np.random.default_rng(1).integers(0, 256, size=shards * (per * T + extra)).astype(np.int64)
    return make_shards(toks, vocab_size=256, shard_tokens=per * T + extra)[0]


def _order(history, **kw):
    return StreamOrder(_manifest(**kw), StreamConfig(seq_len=T, micro_batch=B, micro_batches=M, seed=7), history)


def _trained(order: StreamOrder, steps: int) -> np.ndarray:
    """Windows of every sample of steps [0, steps) (every slot of every step)."""
    return np.concatenate([order.windows(order.samples(s, 0, order.slots(s))) for s in range(steps)])


def _check_exact(wids: np.ndarray, w: int) -> None:
    for e in range(len(wids) // w):   # every whole epoch holds every window once
        assert np.array_equal(np.sort(wids[e * w:(e + 1) * w]), np.arange(w))
    tail = wids[len(wids) // w * w:]
    assert len(np.unique(tail)) == len(tail)


def test_windows_stay_inside_shards_and_read_the_right_tokens() -> None:
    order = _order(((0, M),))
    assert order.num_windows == 12 * 10
    wids = np.arange(order.num_windows)
    starts = order.starts(wids)
    shard = order.shard_of(wids)
    lo = shard * order.manifest.shard_tokens
    assert np.all(starts >= lo) and np.all(starts + T + 1 <= lo + order.manifest.shard_tokens)


def test_one_plan_every_epoch_exact_and_seeded() -> None:
    order = _order(((0, 2 * M),))
    steps = 3 * order.num_windows // (2 * M * B) + 2
    got = _trained(order, steps)
    _check_exact(got, order.num_windows)
    assert np.array_equal(got, _trained(_order(((0, 2 * M),)), steps))      # deterministic
    other = StreamOrder(order.manifest, StreamConfig(seq_len=T, micro_batch=B, micro_batches=M, seed=8), ((0, 2 * M),))
    assert not np.array_equal(got, _trained(other, steps))


def test_a_kill_a_rollback_and_a_joiner_keep_every_epoch_exact() -> None:
    """Two replicas to step 12, one dies: the re-plan resumes at step 10 (steps 10, 11 thrown away) with
    one replica; at step 25 a joiner makes it three. Only the kept steps count."""
    h = next_history((), 0, 2 * M)
    ran_then_lost = StreamOrder(_manifest(), StreamConfig(seq_len=T, micro_batch=B, micro_batches=M, seed=7), h)
    lost = {int(x) for x in ran_then_lost.windows(ran_then_lost.samples(11, 0, 2 * M))}
    h = next_history(h, 10, M)
    assert h == ((0, 2 * M), (10, M))
    h = next_history(h, 25, 3 * M)
    order = _order(h)
    steps = 60     # 60 steps of these sizes cross three epochs
    got = _trained(order, steps)
    _check_exact(got, order.num_windows)
    assert order.base(10) == 10 * 2 * M * B and order.base(26) == order.base(25) + 3 * M * B
    assert lost   # the thrown-away steps' samples are trained on later in the epoch, once
    first_epoch = got[:order.num_windows]
    assert all(int((first_epoch == x).sum()) == 1 for x in lost)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=5), st.integers(1, 4))
def test_any_history_is_exact(cuts: list[tuple[int, int]], r0: int) -> None:
    h = next_history((), 0, r0 * M)
    step = 0
    for gap, r in cuts:      # re-plans, some throwing steps away (resume before the end of the last segment)
        step = max(1, step + gap - 2)
        h = next_history(h, step, r * M)
    order = _order(h, shards=5, per=6)
    _check_exact(_trained(order, step + 40), order.num_windows)


def test_each_replica_reads_its_own_shards() -> None:
    """Two replicas: each reads a contiguous run of shards; at most the edge shard is shared, so the bytes
    each fetches are about what it consumes."""
    order = _order(((0, 2 * M),), shards=40, per=10)
    steps = order.num_windows // (2 * M * B)
    per_replica = []
    for k in range(2):
        wids = np.concatenate([order.windows(order.samples(s, k * M, M)) for s in range(steps)])
        per_replica.append(set(order.shard_of(wids).tolist()))
        fetched = len(per_replica[-1]) * 10
        assert fetched / len(wids) <= 1.1
    assert len(per_replica[0] & per_replica[1]) <= 1


def test_histories_are_checked() -> None:
    with pytest.raises(ValueError, match="step 0"):
        check_history(((1, 2),))
    with pytest.raises(ValueError, match="increasing"):
        check_history(((0, 2), (3, 2), (3, 4)))
    with pytest.raises(ConfigError):
        next_history((), 2, 0)
    assert next_history(((0, 4),), 5, 4) == ((0, 4),)
    assert next_history((), 5, 4) == ((0, 4),)     # no history known: as if one plan from step 0
    with pytest.raises(ConfigError, match="fewer than micro_batch"):
        StreamOrder(_manifest(shards=1, per=2), StreamConfig(seq_len=T, micro_batch=B, micro_batches=M), ((0, M),))


def test_a_resume_carries_the_data_history_and_refuses_a_bad_one() -> None:
    from fusionp2p.errors import RemoteProtocolError
    from fusionp2p.jobs.replan import Resume

    r = Resume(step=10, sources=(), data=((0, 4), (6, 2)))
    assert Resume.from_wire(r.to_wire()) == r
    assert "data" not in Resume(step=3, sources=()).to_wire()     # as before: an older leader's resume
    for bad in ([[1, 4]], [[0, 4], [0, 2]], [[0, 0]], [[0]], "x", [[0, 4]] * 5000):
        with pytest.raises(RemoteProtocolError):
            Resume.from_wire({**Resume(step=1, sources=()).to_wire(), "data": bad})


def test_a_late_shard_event_travels_and_reads() -> None:
    from fusionp2p.jobs.events import DataLate, decode_event, encode_event

    ev = DataLate(job="j1", step=7, stage=0, peer="12D3KooWabcdefgh", shard=41, waited_s=2.5, at=1.0)
    assert decode_event(encode_event(ev)) == ev
    assert str(ev) == "job j1 step 7: waiting 2.5 s for data shard 41 [stage 0 on abcdefgh]"
