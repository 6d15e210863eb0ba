"""TokenFile: text, .npy and raw .bin files; a one-line ConfigError for every user mistake."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fusionp2p.data import TokenFile
from fusionp2p.errors import ConfigError


def test_text_file_is_byte_level(tmp_path: Path) -> None:
    p = tmp_path / "corpus.txt"
    p.write_text("héllo world, " * 20, encoding="utf-8")
    tf = TokenFile(p, seq_len=16)
    assert (tf.kind, tf.dtype, tf.vocab_size) == ("text", "uint8", 256)
    assert tf.tokens().tobytes() == p.read_bytes()
    assert tf.num_tokens == p.stat().st_size


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_npy_and_bin(tmp_path: Path, dtype: str) -> None:
    arr = (np.arange(500) * 7 % 200).astype(dtype)
    np.save(tmp_path / "t.npy", arr)
    arr.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp_path / "t.bin")
    a = TokenFile(tmp_path / "t.npy", seq_len=8)
    b = TokenFile(str(tmp_path / "t.bin"), seq_len=8, dtype=dtype)
    assert a.kind == "npy"
    assert b.kind == "bin"
    assert a.vocab_size == b.vocab_size == 200  # max id + 1
    np.testing.assert_array_equal(a.tokens(), arr)
    np.testing.assert_array_equal(b.tokens(), arr)
    assert TokenFile(tmp_path / "t.npy", seq_len=8, vocab_size=1000).vocab_size == 1000


def test_bin_defaults_to_uint16(tmp_path: Path) -> None:
    np.arange(100, dtype="<u2").tofile(tmp_path / "x.bin")
    tf = TokenFile(tmp_path / "x.bin", seq_len=4)
    assert tf.dtype == "uint16"
    assert tf.num_tokens == 100


def test_user_mistakes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        TokenFile(tmp_path / "missing.txt", seq_len=4)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match="is empty"):
        TokenFile(tmp_path / "empty.txt", seq_len=4)
    (tmp_path / "small.txt").write_bytes(b"abcd")
    with pytest.raises(ConfigError, match="seq_len \\+ 1 = 5"):
        TokenFile(tmp_path / "small.txt", seq_len=4)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="whole number"):
        TokenFile(tmp_path / "odd.bin", seq_len=1)
    with pytest.raises(ConfigError, match="dtype must be"):
        TokenFile(tmp_path / "odd.bin", seq_len=1, dtype="float32")
    np.save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(ConfigError, match="uint8, uint16 or int32"):
        TokenFile(tmp_path / "f.npy", seq_len=2)
    np.save(tmp_path / "m.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(ConfigError, match="1-D"):
        TokenFile(tmp_path / "m.npy", seq_len=2)
    np.save(tmp_path / "neg.npy", np.array([1, -1, 2], dtype=np.int32))
    with pytest.raises(ConfigError, match="negative"):
        TokenFile(tmp_path / "neg.npy", seq_len=1)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match="not a readable"):
        TokenFile(tmp_path / "obj.npy", seq_len=1)  # never unpickled
    np.save(tmp_path / "big.npy", np.array([0, 5, 9], dtype=np.int32))
    with pytest.raises(ConfigError, match="beyond vocab_size"):
        TokenFile(tmp_path / "big.npy", seq_len=1, vocab_size=5)
    with pytest.raises(ConfigError, match="kind"):
        TokenFile(tmp_path / "big.npy", seq_len=1, kind="parquet")
    with pytest.raises(ConfigError, match="not a regular file"):
        TokenFile(tmp_path, seq_len=1)
    assert all(isinstance(e, ValueError) for e in [ConfigError("x")])
