"""Datasets of named tensors per example: manifest, shards, held-out split, sampler, publish checks."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fusionp2p.data import ExampleManifest, Examples, ExampleSampler, ShardedExamples
from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError
from fusionp2p.jobs.build import as_dataset, check_vocab, trace_job
from fusionp2p.jobs.spec import prepare_dataset
from fusionp2p.train.config import TrainConfig


def _data(n: int = 50, holdout: float | int = 0) -> Examples:
    rng = np.random.default_rng(0)
    return Examples({"input_ids": rng.integers(0, 100, (n, 6)), "mask": np.ones((n, 6), dtype=np.bool_),
                     "x": rng.standard_normal((n, 2, 3)).astype(np.float32)}, holdout=holdout)


def test_shards_round_trip_and_are_checked() -> None:
    data = _data()
    man, blobs = data.shards(shard_bytes=200)
    assert len(man.shards) > 3
    back = ExampleManifest.decode(man.encode(), expected_hash=man.content_hash)
    assert back == man
    store = ShardedExamples(back)
    for i, h in enumerate(man.shards):
        store.add(i, blobs[h])
    rows = store.rows([0, 7, 49])
    want = data.batch([0, 7, 49])
    for k in want:
        assert np.array_equal(rows[k], want[k]) and rows[k].dtype == want[k].dtype
    bad = bytearray(blobs[man.shards[0]])
    bad[0] ^= 1
    with pytest.raises(IntegrityError):
        ShardedExamples(man).add(0, bytes(bad))
    with pytest.raises(IntegrityError):
        ShardedExamples(man).add(0, blobs[man.shards[0]] + b"x")
    with pytest.raises(IntegrityError):
        ExampleManifest.decode(man.encode(), expected_hash="0" * 64)
    with pytest.raises(RemoteProtocolError):
        ExampleManifest.decode(b"\x93\x01\x02\x03")


def test_held_out_examples_go_last_and_are_seeded() -> None:
    data = _data(holdout=0.2)
    assert data.num_holdout == 10
    order = data.order()
    assert sorted(order.tolist()) == list(range(50))
    assert np.array_equal(order, _data(holdout=0.2).order())
    man, _ = data.shards()
    assert (man.num_train, man.num_holdout) == (40, 10)
    with pytest.raises(ConfigError, match="leaves none"):
        _data(n=4, holdout=4)


def test_sampler_draws_each_example_once_per_epoch() -> None:
    s = ExampleSampler(num=12, micro_batch=2, micro_batches=3, seed=5, offset=100)
    epoch = np.concatenate([s.indices(step, mu) for step in range(2) for mu in range(3)])
    assert sorted(epoch.tolist()) == list(range(100, 112))
    assert np.array_equal(s.indices(3, 1), ExampleSampler(num=12, micro_batch=2, micro_batches=3, seed=5,
                                                          offset=100).indices(3, 1))


def test_dataset_reference_and_paths(tmp_path: Path) -> None:
    ref, man, blobs = prepare_dataset(_data(holdout=5))
    assert ref.kind == "examples" and ref.num_tokens == 50 and ref.vocab_size == 100
    assert isinstance(man, ExampleManifest) and ref.content_hash in blobs
    np.savez(tmp_path / "d.npz", input_ids=np.zeros((4, 3), dtype=np.int64), labels=np.zeros(4, dtype=np.int64))
    ds = as_dataset(str(tmp_path / "d.npz"))
    assert isinstance(ds, Examples) and set(ds.arrays) == {"input_ids", "labels"}
    with pytest.raises(ConfigError, match=r"\.npz or \.safetensors"):
        as_dataset(str(tmp_path / "corpus.txt"))
    with pytest.raises(ConfigError, match="same number of examples"):
        Examples({"a": np.zeros(3), "b": np.zeros(4)})


class _Classifier(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids).mean(1))


def test_fields_go_to_model_and_loss_by_name_and_ids_must_fit_the_vocabulary() -> None:
    rng = np.random.default_rng(1)
    data = Examples({"input_ids": rng.integers(0, 20, (16, 5)), "label": rng.integers(0, 3, 16)})
    cfg = TrainConfig(steps=1, micro_batch=4, micro_batches=1)

    def loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, label)

    dag = trace_job(_Classifier(20), loss, data, cfg)
    assert dag.data_inputs == ("input_ids", "label")
    check_vocab(dag, data)
    with pytest.raises(ConfigError, match=r"input_ids holds token ids in \[0, 19\].*10 rows"):
        trace_job(_Classifier(10), loss, data, cfg)


def test_export_failure_names_the_users_line() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if h.sum() > 0:   # data-dependent control flow
                h = h * 2
            return ((h - y) ** 2).mean()

    from fusionp2p.graph import trace

    with pytest.raises(ConfigError) as info:
        trace(Branchy(), (torch.randn(2, 4), torch.randn(2, 4)))
    msg = str(info.value)
    assert "test_data_examples.py" in msg and "if h.sum() > 0" in msg and len(msg) < 1000


def test_on_nonfinite_travels_in_the_config() -> None:
    cfg = TrainConfig(steps=2, on_nonfinite="skip")
    assert TrainConfig.from_wire(cfg.to_wire()) == cfg
    with pytest.raises(ConfigError, match="on_nonfinite"):
        TrainConfig(steps=2, on_nonfinite="ignore")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_manifest_decoder_raises_only_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        ExampleManifest.decode(data)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mutated_manifest_decodes_or_raises_remote_protocol_error(data: st.DataObject) -> None:
    blob = bytearray(_data(n=9).shards(shard_bytes=100)[0].encode())
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        man = ExampleManifest.decode(bytes(blob))
    except RemoteProtocolError:
        return
    assert man.encode() == bytes(blob)


def test_labels_outside_the_models_classes_are_refused_before_training() -> None:
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 20, (16, 5))
    cfg = TrainConfig(steps=1, micro_batch=4, micro_batches=1)

    def loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, label)

    labels = np.zeros(16, dtype=np.int64)
    labels[9] = 7      # not in the first micro-batch: only a check of the whole dataset finds it
    with pytest.raises(ConfigError, match=r"label holds labels in \[0, 7\].*3 classes"):
        trace_job(_Classifier(20), loss, Examples({"input_ids": ids, "label": labels}), cfg)
    labels[9] = -100   # ignore_index is fine
    trace_job(_Classifier(20), loss, Examples({"input_ids": ids, "label": labels}), cfg)
