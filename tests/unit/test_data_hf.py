"""A Hugging Face dataset in streaming mode (data/hf.py), from local files in HF's formats (no network):
tokenised at publish with the user's tokenizer into a token file, records in order, then sharded and
served as any token file (issue 38)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fusionp2p.data import HFTokens, ShardManifest, make_shards
from fusionp2p.data.file_shards import FileRange
from fusionp2p.errors import ConfigError
from fusionp2p.jobs.build import build_job
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.train.config import TrainConfig

pytest.importorskip("datasets")


class ByteTokenizer:
    """Byte-level ids 0..255 and an end-of-document id 256 (vocabulary 257: stored as u16)."""

    eos_token_id = 256

    def __len__(self) -> int:
        return 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def _docs(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{int(x)}" for x in rng.integers(0, 999, int(rng.integers(3, 30)))) for _ in range(n)]


def _expected(docs: Iterable[str]) -> np.ndarray:
    return np.array([t for d in docs for t in [*d.encode(), 256]], dtype=np.int64)


def test_a_streamed_hf_dataset_is_tokenised_in_order_and_published_as_a_token_file(tmp_path: Path) -> None:
    parts = [_docs(40, 1), _docs(30, 2)]
    files = []
    for k, docs in enumerate(parts):
        files.append(str(tmp_path / f"part{k}.jsonl"))
        Path(files[-1]).write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    src = HFTokens("json", data_files=files, tokenizer=ByteTokenizer(), seq_len=16, out=tmp_path / "tokens.bin")
    assert (src.vocab_size, src.eos_id) == (257, 256)
    me = Identity.generate()
    torch.manual_seed(0)
    built = build_job(GPT2(GPT2Config.tiny(block_size=16, vocab_size=257, n_layer=1)), None, src,
                      TrainConfig(steps=2, micro_batch=2, micro_batches=1), publisher=me.peer_id, sign=me.sign,
                      now=1.0, nonce=b"h" * 16, shard_tokens=500)
    want = _expected([*parts[0], *parts[1]])          # the files in the order given, each file's records in order
    np.testing.assert_array_equal(np.fromfile(tmp_path / "tokens.bin", dtype="<u2"), want)
    ref = built.spec.dataset
    man = ShardManifest.decode(bytes(built.blobs[ref.content_hash]), expected_hash=ref.content_hash)
    same, blobs = make_shards(want, vocab_size=257, shard_tokens=500)
    assert man == same and (ref.kind, ref.num_tokens, ref.vocab_size) == ("bin", len(want), 257)
    assert all(isinstance(built.blobs[h], FileRange) and bytes(built.blobs[h]) == blobs[h] for h in man.shards)


@dataclass(frozen=True, slots=True)
class _Records(HFTokens):
    """HFTokens over given records (no `datasets`): the checks around the stream."""

    recs: tuple[Any, ...] = ()

    def records(self) -> Iterable[Mapping[str, Any]]:
        return self.recs


def test_hf_tokens_says_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="encode"):
        HFTokens("json", tokenizer=object())
    with pytest.raises(ConfigError, match="vocab_size"):
        HFTokens("json", tokenizer=type("T", (), {"encode": lambda self, s: [1]})())
    with pytest.raises(ConfigError, match="text column 'text'"):
        _Records("x", tokenizer=ByteTokenizer(), seq_len=4, recs=({"body": "abc"},)).token_file()
    with pytest.raises(ConfigError, match="outside"):
        _Records("x", tokenizer=ByteTokenizer(), vocab_size=200, seq_len=4, recs=({"text": "\u0800" * 3},)).token_file()
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        _Records("x", tokenizer=ByteTokenizer(), seq_len=40, recs=({"text": "short"},)).token_file()
    cut = _Records("x", tokenizer=ByteTokenizer(), seq_len=4, max_tokens=7, eos_id=None,
                   recs=({"text": "abcd"}, {"text": "efgh"}, {"text": "ijkl"})).token_file()
    assert bytes(cut.tokens()[:].astype(np.uint8)) == b"abcdefg"
