"""Persistent identities: same home -> same peer id, 0600, corrupt files -> ConfigError."""

import os
import stat
from pathlib import Path

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.net.identity import Identity, verify


def test_same_home_same_peer_id(tmp_path: Path) -> None:
    a = Identity.load_or_create(tmp_path)
    b = Identity.load_or_create(tmp_path)
    assert a.peer_id == b.peer_id
    assert stat.S_IMODE(os.stat(tmp_path / "identity.key").st_mode) == 0o600


@pytest.mark.parametrize("content", [b"", b"garbage", b"FP2PKEY1" + b"\x00" * 31, b"-----BEGIN PRIVATE KEY-----\n"])
def test_corrupt_or_foreign_key_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "identity.key").write_bytes(content)
    with pytest.raises(ConfigError, match="identity"):
        Identity.load_or_create(tmp_path)


def test_sign_verify() -> None:
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"data")
    assert verify(a.peer_id, b"data", sig)
    assert not verify(b.peer_id, b"data", sig)
    assert not verify(a.peer_id, b"datb", sig)
    assert not verify("not-a-peer", b"data", sig)
    assert not verify(a.peer_id, b"data", b"short")
