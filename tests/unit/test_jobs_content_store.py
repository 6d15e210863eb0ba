"""The local content store: blobs by sha256, in memory and on disk."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fusionp2p.errors import ConfigError, IntegrityError
from fusionp2p.jobs.content import ContentConfig, ContentStore


@pytest.mark.parametrize("on_disk", [False, True])
def test_put_get_has(tmp_path: Path, on_disk: bool) -> None:
    store = ContentStore(tmp_path if on_disk else None)
    h = store.put(b"hello")
    assert h == hashlib.sha256(b"hello").hexdigest()
    assert store.has(h)
    assert store.get(h) == b"hello"
    assert store.size(h) == 5
    assert store.put(b"hello") == h
    assert not store.has("0" * 64)
    with pytest.raises(KeyError):
        store.get("0" * 64)
    with pytest.raises(IntegrityError):
        store.put_verified("0" * 64, b"x")
    if on_disk:
        again = ContentStore(tmp_path)  # a restarted node finds its blobs
        assert again.get(h) == b"hello"
        (tmp_path / h[:2] / h).write_bytes(b"HELLO")
        with pytest.raises(IntegrityError, match="corrupted"):
            ContentStore(tmp_path).get(h)
        assert not ContentStore(tmp_path).has("../../etc/passwd")


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        ContentConfig(chunk_bytes=10)
    with pytest.raises(ConfigError):
        ContentConfig(fetch_timeout=0)
