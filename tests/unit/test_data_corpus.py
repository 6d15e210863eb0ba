"""The built-in corpus: deterministic, byte-level, pinned by hash."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fusionp2p.data import BuiltinCorpus, corpus_bytes, corpus_hash, corpus_tokens, decode_bytes
from fusionp2p.errors import ConfigError


@pytest.mark.parametrize("name", ["pydoc", "stdlib"])
def test_corpus_is_deterministic_bytes(name: str) -> None:
    data = corpus_bytes(name)
    assert len(data) > 200_000  # enough text for a demo of a few minutes
    corpus_bytes.cache_clear()
    assert corpus_bytes(name) == data  # rebuilt from scratch, same bytes
    assert corpus_hash(name) == hashlib.sha256(data).hexdigest()
    toks = corpus_tokens(name)
    assert toks.dtype == np.uint8
    assert toks.tobytes() == data
    assert not toks.flags.writeable


def test_stdlib_extends_pydoc() -> None:
    assert corpus_bytes("stdlib").startswith(corpus_bytes("pydoc"))
    assert len(corpus_bytes("stdlib")) > len(corpus_bytes("pydoc"))
    assert corpus_hash("stdlib") != corpus_hash("pydoc")


def test_decode_round_trip_and_errors() -> None:
    assert decode_bytes(np.frombuffer(b"hello", dtype=np.uint8)) == "hello"
    with pytest.raises(ConfigError):
        decode_bytes([300])
    with pytest.raises(ConfigError, match="unknown built-in corpus"):
        corpus_bytes("wikipedia")


def test_builtin_source() -> None:
    src = BuiltinCorpus("pydoc", seq_len=64)
    assert src.vocab_size == 256
    assert src.content_hash == corpus_hash("pydoc")
    assert len(src.tokens()) == len(corpus_bytes("pydoc"))
    with pytest.raises(ConfigError, match="seq_len"):
        BuiltinCorpus("pydoc", seq_len=0)
    with pytest.raises(ConfigError, match="fewer than"):
        BuiltinCorpus("pydoc", seq_len=10**7)
