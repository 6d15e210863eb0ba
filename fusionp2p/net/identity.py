"""Persistent Ed25519 node identities, signatures, and verification by peer id.

Key file layout (``<home>/identity.key``, mode 0600): the 8-byte magic ``FP2PKEY1`` followed by the
32-byte Ed25519 seed. The peer id is libp2p's (identity multihash of the public key), so a signature
can be checked from the peer id alone.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from fusionp2p.errors import ConfigError

MAGIC = b"FP2PKEY1"
KEY_FILE = "identity.key"


class Identity:
    """An Ed25519 key pair and its libp2p peer id."""

    __slots__ = ("_kp", "_peer_id", "seed")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ConfigError("an identity seed must be 32 bytes")
        self.seed = seed
        self._kp = create_new_key_pair(seed)
        self._peer_id = ID.from_pubkey(self._kp.public_key).to_base58()

    @classmethod
    def generate(cls) -> Identity:
        return cls(os.urandom(32))

    @classmethod
    def load_or_create(cls, home: str | os.PathLike[str]) -> Identity:
        """Load ``home/identity.key``, creating it (0600) on first use; one-line ConfigError if unusable."""
        path = Path(home) / KEY_FILE
        if path.exists():
            return cls.load(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create node home {path.parent}: {exc.strerror}; pass --home to a writable directory") from None
        ident = cls.generate()
        ident.save(path.parent)
        return ident

    def save(self, home: str | os.PathLike[str]) -> None:
        """Write ``home/identity.key`` (0600, replacing any there; ``home`` must exist)."""
        path = Path(home) / KEY_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + self.seed)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        path = Path(path)
        try:
            data = path.read_bytes()
            mode = path.stat().st_mode
        except OSError as exc:
            raise ConfigError(f"cannot read identity key {path}: {exc.strerror}") from None
        if len(data) != len(MAGIC) + 32 or not data.startswith(MAGIC):
            raise ConfigError(
                f"{path} is not a fusionp2p identity key (corrupt or foreign file); move it away to create a new identity"
            )
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            os.chmod(path, 0o600)
        return cls(data[len(MAGIC):])

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def key_pair(self) -> KeyPair:
        """The libp2p key pair (for the libp2p adapter only)."""
        return self._kp

    def sign(self, data: bytes) -> bytes:
        sig: bytes = self._kp.private_key.sign(data)
        return sig


MAX_PEER_ID = 64   # an Ed25519 peer id is 52 base58 characters ("12D3KooW..."); longer is not ours


@functools.lru_cache(maxsize=4096)
def _public_key(peer_id: str) -> object | None:
    # base58 decoding is quadratic in the length: a peer's 70 000-character "peer id" cost 2.5 s of CPU
    if len(peer_id) > MAX_PEER_ID:
        return None
    try:
        return ID.from_base58(peer_id).extract_public_key()
    except Exception:
        return None


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True when *signature* over *data* was made by the key behind *peer_id*. Never raises."""
    if not isinstance(peer_id, str) or not isinstance(signature, bytes | bytearray) or len(signature) != 64:
        return False
    pk = _public_key(peer_id)
    if pk is None:
        return False
    try:
        return bool(pk.verify(bytes(data), bytes(signature)))  # type: ignore[attr-defined]
    except Exception:
        return False


def is_valid_peer_id(peer_id: str) -> bool:
    return isinstance(peer_id, str) and _public_key(peer_id) is not None
