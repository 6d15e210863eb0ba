"""A token file sharded a chunk at a time (data/file_shards.py): the same manifest and bytes as make_shards,
served from the file by the publisher's store, never held in memory (issue 38)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fusionp2p.data import TokenFile, make_shards
from fusionp2p.data.file_shards import FileRange, file_chunks, id_range
from fusionp2p.jobs.store import ContentStore, sha256_hex


@pytest.mark.parametrize(("name", "dtype", "vocab", "stored"), [
    ("t.txt", None, 0, True),             # text: the file's bytes are the shards'
    ("t.bin", "uint16", 300, True),       # uint16 beyond 256 ids: stored as is
    ("t.bin", "uint16", 200, False),      # ids below 256 in a uint16 file: converted to u8 (a temporary file)
    ("t.npy", ">u2", 1000, False),        # a big-endian .npy: converted
])
def test_file_shards_match_make_shards(tmp_path: Path, name: str, dtype: str | None, vocab: int, stored: bool) -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, vocab or 256, 5003)
    p = tmp_path / name
    if name.endswith(".txt"):
        p.write_bytes(toks.astype(np.uint8).tobytes())
    elif name.endswith(".bin"):
        toks.astype("<u2").tofile(p)
    else:
        np.save(p, toks.astype(dtype))
    tf = TokenFile(p, seq_len=8, dtype=dtype if name.endswith(".bin") else None, vocab_size=vocab)
    man, ranges = tf.shards(700)
    want, blobs = make_shards(toks, vocab_size=tf.vocab_size, shard_tokens=700)
    assert man == want
    assert {h: bytes(r) for h, r in ranges.items()} == blobs
    assert all(isinstance(r, FileRange) for r in ranges.values())
    assert tf.id_range() == (int(toks.min()), int(toks.max()))
    first = ranges[man.shards[0]]
    p.write_bytes(b"\x00" * p.stat().st_size)   # the user's file changes: a range of it changes too, a copy does not
    assert (bytes(first) == blobs[man.shards[0]]) is not stored


def test_id_range_leaves_out_the_ignored_id_chunk_by_chunk(tmp_path: Path) -> None:
    a = np.array([5, 0, 7, 0, 9, 0, 3], dtype="<u2")
    a.tofile(tmp_path / "a.bin")
    # views of one reused buffer: copied to keep
    chunks = [c.copy() for c in file_chunks(tmp_path / "a.bin", offset=0, dtype=np.dtype("<u2"), count=7, chunk_tokens=2)]
    assert [c.tolist() for c in chunks] == [[5, 0], [7, 0], [9, 0], [3]]
    assert id_range(iter(chunks)) == (0, 9)
    assert id_range(iter(chunks), ignore=0) == (3, 9)
    assert id_range(iter([np.zeros(3, dtype=np.uint16)]), ignore=0) is None
    tf = TokenFile(tmp_path / "a.bin", seq_len=2)
    assert (tf.id_range(), tf.id_range(ignore=0), tf.id_range(ignore=-100)) == ((0, 9), (3, 9), (0, 9))


def test_the_publishers_store_serves_a_range_a_part_at_a_time_and_checks_it(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(bytes(range(256)) * 40)
    man, ranges = TokenFile(p, seq_len=8).shards(1000)
    h = man.shards[3]
    store = ContentStore()
    store.put_range(h, ranges[h])
    assert store.has(h) and store.size(h) == 1000
    with store.reader(h) as f:
        parts = [f.read(300) for _ in range(4)]
    assert [len(x) for x in parts] == [300, 300, 300, 100]
    assert sha256_hex(b"".join(parts)) == h == sha256_hex(store.get(h))
    with p.open("r+b") as f:     # the user rewrote the file after publishing: not served as the old shard
        f.seek(3000)
        f.write(b"\xff" * 10)
    with pytest.raises(KeyError):
        store.get(h)
