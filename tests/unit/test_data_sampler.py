"""Shards and the batch sampler: content addressing, cross-node alignment, epochs without repeats."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.data import (
    BatchSampler,
    SamplerConfig,
    ShardedTokens,
    ShardManifest,
    decode_shard,
    make_shards,
)
from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError


def tokens(n: int, vocab: int = 256, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int64)


def test_shards_are_content_addressed_and_round_trip() -> None:
    t = tokens(10_000, vocab=1000)
    man, blobs = make_shards(t, vocab_size=1000, shard_tokens=3000)
    assert man.dtype == "u16"
    assert len(man.shards) == 4  # 3000 * 3 + 1000
    assert all(hashlib.sha256(blobs[h]).hexdigest() == h for h in man.shards)
    again, _ = make_shards(t.copy(), vocab_size=1000, shard_tokens=3000)
    assert again.content_hash == man.content_hash
    assert ShardManifest.decode(man.encode(), expected_hash=man.content_hash) == man
    full = np.concatenate([decode_shard(man, i, blobs[h]) for i, h in enumerate(man.shards)])
    np.testing.assert_array_equal(full, t)
    assert man.shards_for(2999, 2) == range(0, 2)
    assert man.shards_for(9000, 1000) == range(3, 4)


def test_shard_and_manifest_rejections() -> None:
    man, blobs = make_shards(tokens(100), vocab_size=256, shard_tokens=40)
    good = blobs[man.shards[0]]
    with pytest.raises(IntegrityError):
        decode_shard(man, 0, bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(IntegrityError):
        decode_shard(man, 0, good[:-1])
    with pytest.raises(IntegrityError):
        ShardManifest.decode(man.encode(), expected_hash="0" * 64)
    with pytest.raises(RemoteProtocolError):
        ShardManifest.decode(b"\x93\x01\x02\x03")
    bad = man.to_wire() | {"num_tokens": 1000}
    from fusionp2p.wire.msg import packb

    with pytest.raises(RemoteProtocolError, match="expected"):
        ShardManifest.decode(packb(bad))
    with pytest.raises(ConfigError, match="token ids"):
        make_shards(np.array([1, 2, 300]), vocab_size=256)


def test_sharded_reader_needs_its_shards() -> None:
    t = tokens(1000)
    man, blobs = make_shards(t, vocab_size=256, shard_tokens=100)
    st_ = ShardedTokens(man)
    st_.add(2, blobs[man.shards[2]])
    st_.add(3, blobs[man.shards[3]])
    np.testing.assert_array_equal(st_.window(250, 100), t[250:350])
    with pytest.raises(KeyError, match="shard 4"):
        st_.window(350, 100)
    assert st_.missing(range(1, 5)) == [1, 4]
    with pytest.raises(IntegrityError):
        st_.add(0, blobs[man.shards[1]])


def test_first_and_last_stage_align_across_nodes() -> None:
    """Two independent samplers (two nodes) and two data sources draw the same (inputs, targets)."""
    t = tokens(50_000)
    cfg = SamplerConfig(num_tokens=len(t), seq_len=32, micro_batch=4, micro_batches=3, seed=7)
    first, last = BatchSampler(cfg), BatchSampler(cfg)
    man, blobs = make_shards(t, vocab_size=256, shard_tokens=4096)
    for step in range(5):
        for micro in range(3):
            # the last stage holds only the shards this micro-batch touches
            reader = ShardedTokens(man)
            for i in last.shards_for(man, step, micro):
                reader.add(i, blobs[man.shards[i]])
            x = first.inputs(t, step, micro)
            y = last.targets(reader, step, micro)
            assert x.shape == y.shape == (4, 32)
            starts = first.starts(step, micro)
            for b, s in enumerate(starts):
                np.testing.assert_array_equal(x[b], t[s : s + 32])
                np.testing.assert_array_equal(y[b], t[s + 1 : s + 33])
    other_seed = BatchSampler(SamplerConfig(num_tokens=len(t), seq_len=32, micro_batch=4, micro_batches=3, seed=8))
    assert not np.array_equal(other_seed.windows(0, 0), first.windows(0, 0))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(17, 3000), seq=st.integers(1, 16), mb=st.integers(1, 8), mbs=st.integers(1, 4), seed=st.integers(0, 2**40)
)
def test_each_epoch_visits_every_window_once(n: int, seq: int, mb: int, mbs: int, seed: int) -> None:
    cfg = SamplerConfig(num_tokens=n, seq_len=seq, micro_batch=mb, micro_batches=mbs, seed=seed)
    s = BatchSampler(cfg)
    w = cfg.num_windows
    per_step = mb * mbs
    steps = -(-2 * w // per_step)  # two epochs' worth
    drawn = np.concatenate([s.windows(k, m) for k in range(steps) for m in range(mbs)])
    assert drawn.min() >= 0
    assert drawn.max() < w
    assert sorted(drawn[:w].tolist()) == list(range(w))
    if len(drawn) >= 2 * w:
        assert sorted(drawn[w : 2 * w].tolist()) == list(range(w))
    # every target window stays inside the stream
    assert (s.starts(steps - 1, mbs - 1) + seq + 1 <= n).all()


def test_sampler_config_errors() -> None:
    with pytest.raises(ConfigError, match="use more data"):
        SamplerConfig(num_tokens=10, seq_len=10, micro_batch=1, micro_batches=1)
    with pytest.raises(ConfigError, match="micro_batch"):
        SamplerConfig(num_tokens=100, seq_len=10, micro_batch=0, micro_batches=1)
    s = BatchSampler(SamplerConfig(num_tokens=100, seq_len=10, micro_batch=1, micro_batches=2))
    with pytest.raises(IndexError):
        s.windows(0, 2)
