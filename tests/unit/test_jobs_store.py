"""The content store's caps (issue 42): pinned blobs stay, cached ones go oldest first, memory only for pins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from fusionp2p.errors import ConfigError
from fusionp2p.jobs.store import ContentStore, StoreConfig, StoreFull, sha256_hex
from fusionp2p.sizes import parse_size


def _blob(i: int, n: int = 100) -> bytes:
    return bytes([i]) * n


@pytest.mark.parametrize("on_disk", [False, True])
def test_cached_blobs_go_oldest_first_and_pinned_ones_never(tmp_path: Path, on_disk: bool) -> None:
    store = ContentStore(tmp_path if on_disk else None, StoreConfig(disk_bytes=350))
    with store.pinned_to("job"):
        pinned = store.put(_blob(0))
    old, new = store.put(_blob(1)), store.put(_blob(2))
    store.get(old)                       # used again: now newer than *new*
    third = store.put(_blob(3))          # 400 bytes: one cached blob must go, the least recently used
    assert store.has(pinned) and store.has(old) and store.has(third)
    assert not store.has(new)
    assert store.stats()["held_bytes"] <= 350 and store.evicted == 1
    if on_disk:
        assert not (tmp_path / new[:2] / new).exists()
    store.put(_blob(4))
    store.put(_blob(5))
    assert store.has(pinned)             # every put evicted around it
    assert store.stats()["held_bytes"] <= 350


def test_pins_that_fill_the_cap_refuse_the_next_blob_and_release_makes_room(tmp_path: Path) -> None:
    store = ContentStore(tmp_path, StoreConfig(disk_bytes=250))
    cached = store.put(_blob(9))
    with store.pinned_to("a"):
        a = store.put(_blob(0))
    with store.pinned_to("b"):
        b = store.put(_blob(1))          # evicts the cached blob to fit
        with pytest.raises(StoreFull, match="--disk"):
            store.put(_blob(2))
    assert not store.has(cached) and store.has(a) and store.has(b)
    assert store.stats()["held_bytes"] == store.stats()["pinned_bytes"] == 200
    store.release("a")
    store.put(_blob(2))                  # a's blob is cache now: it goes
    assert not store.has(a) and store.has(b)


def test_memory_holds_only_pinned_blobs_within_its_cap(tmp_path: Path) -> None:
    store = ContentStore(tmp_path, StoreConfig(disk_bytes=10_000, memory_bytes=250))
    cached = store.put(_blob(7))
    assert store.stats()["memory_bytes"] == 0                  # nobody uses it: on disk only
    assert store.get(cached) == _blob(7)                       # read from disk, not kept in memory
    assert store.stats()["memory_bytes"] == 0
    with store.pinned_to("job"):
        hs = [store.put(_blob(i)) for i in range(3)]           # 300 bytes pinned, 250 of memory
        big = store.put(_blob(5, 1000))                        # larger than the memory cap: never in memory
        assert store.get(big) == _blob(5, 1000)
    assert store.stats()["memory_bytes"] == 200               # the two newest; the oldest was pushed out
    assert store.get(hs[0]) == _blob(0)                        # from disk, back in memory
    assert store.stats()["pinned_blobs"] == 4                  # what the scope put; the cached blob was read outside it
    store.release("job")
    assert store.stats() | {"held_bytes": 0, "blobs": 0} == {"held_bytes": 0, "memory_bytes": 0, "pinned_bytes": 0,
                                                              "blobs": 0, "pinned_blobs": 0, "owners": 0, "evicted": 0}
    assert all(store.has(h) for h in [*hs, big, cached])       # still served from disk


def test_an_offers_pins_move_to_its_job_and_shared_blobs_stay_until_the_last_owner_lets_go() -> None:
    store = ContentStore(None, StoreConfig(disk_bytes=300))
    with store.pinned_to("offer/1"):
        shared = store.put(_blob(0))
    store.transfer("offer/1", "job1")
    assert store.pinned_by("offer/1") == frozenset() and store.pinned_by("job1") == {shared}
    with store.pinned_to("job2"):
        assert store.get(shared) == _blob(0)
    store.release("job1")
    first = store.put(_blob(1))
    store.put(_blob(2))
    store.put(_blob(3))
    assert store.has(shared) and not store.has(first)   # job2 still pins the shared blob
    store.release("job2")
    store.put(_blob(4))
    assert store.has(shared)             # released last: the newest cache, not the first to go
    assert store.stats()["pinned_bytes"] == 0 and store.stats()["held_bytes"] <= 300


def test_the_pin_scope_reaches_tasks_started_inside_it() -> None:
    store = ContentStore(None)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            with store.pinned_to("job"):
                nursery.start_soon(lambda: trio.to_thread.run_sync(lambda: None))   # unrelated work
                nursery.start_soon(_put, b"in a child task")
            nursery.start_soon(_put, b"outside")

    async def _put(data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        store.put(data)

    trio.run(main)
    assert store.stats()["pinned_blobs"] == 1 and store.stats()["blobs"] == 2


def test_a_restarted_node_evicts_down_to_a_smaller_cap_oldest_first(tmp_path: Path) -> None:
    first = ContentStore(tmp_path, StoreConfig(disk_bytes=10_000))
    hs = [first.put(_blob(i)) for i in range(5)]
    for age, h in enumerate(hs):
        os.utime(tmp_path / h[:2] / h, (1000 + age, 1000 + age))
    (tmp_path / hs[0][:2] / (hs[0] + ".tmp")).write_bytes(b"cut short")
    again = ContentStore(tmp_path, StoreConfig(disk_bytes=250))
    assert [again.has(h) for h in hs] == [False, False, False, True, True]
    assert not (tmp_path / hs[0][:2] / (hs[0] + ".tmp")).exists()
    assert again.get(hs[4]) == _blob(4)


def test_sizes_and_config() -> None:
    assert parse_size("20G", "--disk") == 20 << 30
    assert parse_size("512MiB", "--disk") == 512 << 20
    assert parse_size("1.5t", "--disk") == int(1.5 * (1 << 40))
    assert parse_size("4096", "--disk") == 4096
    for bad in ("", "G", "-1G", "ten", "nan", "1e30"):
        with pytest.raises(ConfigError, match="--disk"):
            parse_size(bad, "--disk")
    with pytest.raises(ConfigError):
        StoreConfig(disk_bytes=0)
    assert ContentStore().config.disk_bytes is None                     # a publisher's store: no cap
    assert ContentStore(Path("/nonexistent")).config == StoreConfig()   # a node's: the defaults


@pytest.mark.parametrize("on_disk", [False, True])
def test_put_chunks_stores_the_joined_parts_under_their_hash_without_a_memory_copy(tmp_path: Path, on_disk: bool) -> None:
    store = ContentStore(tmp_path if on_disk else None, StoreConfig(disk_bytes=1000, memory_bytes=1000))
    parts: list[bytes | memoryview] = [memoryview(_blob(1, 300)), _blob(2, 200), memoryview(_blob(3, 100))[10:]]
    whole = b"".join(parts)
    with store.pinned_to("job"):
        h = store.put_chunks(parts, len(whole))
    assert h == sha256_hex(whole) and store.get(h) == whole and store.pinned_by("job") == {h}
    assert store.put_chunks(parts, len(whole)) == h and store.stats()["held_bytes"] == len(whole)   # idempotent
    if on_disk:
        assert (tmp_path / h[:2] / h).read_bytes() == whole
        assert not list(tmp_path.glob("*.tmp"))                         # the temporary file became the blob
        with pytest.raises(ValueError, match="announced"):
            store.put_chunks(parts, len(whole) + 1)
        assert not list(tmp_path.glob("*.tmp"))
        with pytest.raises(StoreFull):
            store.put_chunks([_blob(4, 600)], 600)                      # what is pinned leaves no room
        assert not list(tmp_path.glob("*.tmp"))


def test_a_publishers_pieces_are_views_of_its_tensors_and_not_served_once_they_changed() -> None:
    import torch

    from fusionp2p.wire.pieces import make_manifest

    w = torch.randn(64, 16)
    man, pieces = make_manifest({"w": w}, 1024, copy=False)
    store = ContentStore()
    for h, view in pieces.items():
        assert isinstance(view, memoryview)
        store.put_view(h, view)
    first = man.tensors[0].pieces[0]
    with store.reader(first) as f:
        assert f.read(10) + f.read() == bytes(pieces[first]) and store.get(first) == bytes(pieces[first])
    w[0, 0] += 1.0                                         # the module trained on: its first piece changed
    with pytest.raises(KeyError), store.reader(first):
        pass
    with pytest.raises(KeyError):
        store.get(first)
    last = man.tensors[0].pieces[-1]
    with store.reader(last) as f:                          # the others are still what was published
        assert sha256_hex(f.read()) == last
