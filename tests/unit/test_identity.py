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


def test_an_overlong_peer_id_is_refused_before_base58_decoding() -> None:
    """base58 decoding is quadratic: a 70 000-character "peer id" in a job spec cost 2.5 s of CPU to refuse."""
    from fusionp2p.net.identity import MAX_PEER_ID, is_valid_peer_id, verify

    assert len(Identity.generate().peer_id) <= MAX_PEER_ID
    assert not is_valid_peer_id("1" + "z" * 70_000)
    assert not verify("1" + "z" * 70_000, b"data", bytes(64))
