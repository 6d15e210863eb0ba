"""The streamed order of examples (data/stream.py ExampleOrder): exact per epoch across re-plans, local per
replica, the held-out examples never trained on, and the feed's memory bound for examples (issue 38)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.data import Examples
from fusionp2p.data.stream import ExampleOrder, OrderConfig, held_out_indices, next_history
from fusionp2p.errors import ConfigError
from fusionp2p.jobs.data_shards import window_bytes

M, B = 2, 3
EX_BYTES = 4 * 8 + 8      # a row of four int64 ids and one int64 label


def _data(n: int = 203, holdout: int = 17, per_shard: int = 10) -> Examples:
    rng = np.random.default_rng(2)
    return Examples({"input_ids": rng.integers(0, 50, (n, 4)), "labels": np.arange(n)}, holdout=holdout, seed=3,
                    shard_bytes=per_shard * EX_BYTES)


def _order(history: tuple[tuple[int, int], ...], **kw: int) -> ExampleOrder:
    man, _ = _data(**kw).shards()
    return ExampleOrder(man, OrderConfig(micro_batch=B, micro_batches=M, seed=7), history)


def _trained(order: ExampleOrder, steps: int) -> np.ndarray:
    return np.concatenate([order.windows(order.samples(s, 0, order.slots(s))) for s in range(steps)])


def _check_exact(got: np.ndarray, n: int) -> None:
    for e in range(len(got) // n):   # every whole epoch: every training example once, none twice, none skipped
        assert np.array_equal(np.sort(got[e * n:(e + 1) * n]), np.arange(n))
    tail = got[len(got) // n * n:]
    assert len(np.unique(tail)) == len(tail)


def test_training_examples_only_each_once_an_epoch_and_seeded() -> None:
    order = _order(((0, 2 * M),))
    man = order.manifest
    assert (man.num_train, man.num_holdout, man.shard_examples, len(man.shards)) == (186, 17, 10, 21)
    assert order.num_windows == man.num_train          # the held-out examples are no items of the order
    steps = 3 * order.num_windows // (2 * M * B) + 1
    got = _trained(order, steps)
    _check_exact(got, man.num_train)
    assert got.max() < man.num_train                    # never a held-out example
    assert np.array_equal(got, _trained(_order(((0, 2 * M),)), steps))
    # the worker's (sampler step, micro) of replica r: step * R + r
    assert np.array_equal(order.indices(2 * 5 + 1, 1, replicas=2), order.windows(order.samples(5, M + 1, 1)))


def test_a_kill_a_rollback_and_a_joiner_keep_every_epoch_exact() -> None:
    """Two replicas to step 12, one dies: resumed at step 10 with one; a joiner at step 25 makes three."""
    h = next_history(next_history(next_history((), 0, 2 * M), 10, M), 25, 3 * M)
    order = _order(h)
    got = _trained(order, 70)
    assert len(got) > 2 * order.num_windows
    _check_exact(got, order.num_windows)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=4), st.integers(1, 4))
def test_any_history_is_exact(cuts: list[tuple[int, int]], r0: int) -> None:
    h = next_history((), 0, r0 * M)
    step = 0
    for gap, r in cuts:
        step = max(1, step + gap - 2)
        h = next_history(h, step, r * M)
    order = _order(h, n=67, holdout=5, per_shard=7)
    _check_exact(_trained(order, step + 20), order.num_windows)


def test_each_replica_reads_a_run_of_shards_of_its_own() -> None:
    order = _order(((0, 2 * M),), n=1210, holdout=10, per_shard=10)
    steps = order.num_windows // (2 * M * B)
    seen = []
    for k in range(2):
        ids = np.concatenate([order.windows(order.samples(s, k * M, M)) for s in range(steps)])
        seen.append(set((ids // 10).tolist()))
        assert len(seen[-1]) * 10 / len(ids) <= 1.1    # fetched over read
    assert len(seen[0] & seen[1]) <= 1


def test_held_out_micro_batches_are_a_contiguous_run_of_held_out_examples() -> None:
    data = _data()
    man, _ = data.shards()
    idx = np.concatenate([held_out_indices(man, B, mu) for mu in range(M)])
    assert np.array_equal(idx, man.num_train + np.arange(M * B))
    assert np.array_equal(held_out_indices(man, 10, 1), man.num_train + np.arange(10, 20) % 17)   # wraps
    assert len(set((idx // man.shard_examples).tolist())) <= 2
    # the publisher put the held-out examples in a seeded random order, not the user's
    labels = data.batch(idx)["labels"]
    assert not np.array_equal(labels, np.sort(labels))
    with pytest.raises(ConfigError, match="no held-out"):
        held_out_indices(_data(holdout=0).shards()[0], B, 0)


def test_a_feed_holds_a_window_of_shards_not_the_dataset() -> None:
    man, _ = _data(n=20_000, holdout=100, per_shard=10).shards()
    w = window_bytes(man, micro_batch=B, micro_batches=M)
    assert w == (32 + 2) * 10 * EX_BYTES          # 32 shards of the window, the held-out ones' (one, or two at an edge)
    assert w < man.total_bytes / 50
