"""The signed job specification: what to train, on what data, how, and on which machines.

A :class:`JobSpec` names its large parts by content hash (the model's OP-DAG, the initial weights,
the dataset manifest or built-in corpus), so the spec itself stays small (a few hundred bytes) and
travels by gossip and DHT; the parts are fetched from any provider and checked against the hash
(:mod:`fusionp2p.jobs.content`).

Wire format (one home: ``encode``/``decode`` here, msgpack through :mod:`fusionp2p.wire.msg`)::

    envelope = {"v": 1, "spec": <canonical msgpack bytes of JobSpec.to_wire()>, "sig": <64 bytes>}
    sig      = Ed25519(publisher key, b"fusionp2p/jobspec/1\\0" + spec bytes)

``decode_signed`` checks, in order: size bound, envelope shape, spec fields (every one), canonical
encoding (re-encoding gives the same bytes, so the content hash is unique), then the signature
against the publisher's peer id. Malformed input raises :class:`RemoteProtocolError`; a missing,
forged or mismatched signature raises :class:`IntegrityError`.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from fusionp2p.data.examples import ExampleManifest, Examples
from fusionp2p.data.file_shards import FileRange
from fusionp2p.data.shards import ShardManifest, is_sha256_hex
from fusionp2p.data.tokens import BuiltinCorpus, TokenFile
from fusionp2p.data.url import TokenURL
from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError
from fusionp2p.net.identity import is_valid_peer_id, verify
from fusionp2p.train.config import CO2, AdaTopK, LRSchedule, TrainConfig
from fusionp2p.wire import codec
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb

__all__ = [
    "CO2", "AdaTopK", "DatasetRef", "JobSpec", "LRSchedule", "Resources", "TrainConfig",
    "decode_signed", "new_job_id", "prepare_dataset", "sign_spec",
]

SPEC_VERSION = 1
SIGN_DOMAIN = b"fusionp2p/jobspec/1\0"
MAX_SPEC_BYTES = 64 * 1024          # fits one gossip message (LIBP2P_NOTES §5)
DATASET_KINDS = ("builtin", "text", "npy", "bin", "examples", "url")
DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu")
_T = TypeVar("_T")
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def new_job_id(publisher: str, created: float, nonce: bytes) -> str:
    """A 16-hex-digit job id; *nonce* (e.g. ``os.urandom(16)``) is injected so tests stay deterministic."""
    h = hashlib.sha256(f"{publisher}\0{created!r}\0".encode() + nonce)
    return h.hexdigest()[:16]


def _check_hash(name: str, h: object) -> None:
    if not is_sha256_hex(h):
        raise ConfigError(f"{name} must be a lowercase hex sha256 digest, got {h!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetRef:
    """What to train on: a built-in corpus (``name``), a token shard manifest, or (kind ``examples``) an
    :class:`~fusionp2p.data.examples.ExampleManifest` of named tensors per example, pinned by hash.

    For ``examples``, ``num_tokens`` counts the examples (held-out ones included), ``seq_len`` is the
    tokens (or items) one example counts for in throughput figures, and ``vocab_size`` the largest
    integer id of the data plus one (2 when the data holds no ids).
    """

    kind: str = field(metadata={"wire": {"choices": DATASET_KINDS}})   # builtin | text | npy | bin
    content_hash: str = field(metadata={"wire": {"max_len": 64}})      # builtin: sha256 of the corpus bytes; files: of the ShardManifest
    seq_len: int = field(metadata={"wire": {"lo": 1, "hi": 1 << 31}})
    vocab_size: int = field(metadata={"wire": {"lo": 2, "hi": 1 << 31}})
    num_tokens: int = field(metadata={"wire": {"lo": 2, "hi": 1 << 48}})
    name: str = ""          # the built-in corpus name; a label for files

    def __post_init__(self) -> None:
        if self.kind not in DATASET_KINDS:
            raise ConfigError(f"dataset kind must be one of {', '.join(DATASET_KINDS)}, got {self.kind!r}")
        _check_hash("dataset content_hash", self.content_hash)
        for n in ("seq_len", "vocab_size", "num_tokens"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"dataset {n} must be a positive integer, got {v!r}")
        if self.vocab_size < 2 or (self.kind != "examples" and self.num_tokens < self.seq_len + 1):
            raise ConfigError("dataset needs vocab_size >= 2 and at least seq_len + 1 tokens")
        if self.kind == "builtin" and not self.name:
            raise ConfigError("a built-in dataset reference needs the corpus name")
        if not isinstance(self.name, str) or len(self.name) > 256:
            raise ConfigError("dataset name must be a string of at most 256 characters")

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    @classmethod
    def from_wire(cls, obj: Any) -> DatasetRef:
        return codec.from_wire(cls, obj, "dataset reference")


def prepare_dataset(
    src: BuiltinCorpus | TokenFile | Examples | TokenURL, *, shard_tokens: int = 1 << 20
) -> tuple[DatasetRef, ShardManifest | ExampleManifest | None, dict[str, bytes | FileRange]]:
    """The publisher's side: a dataset reference for *src*, plus (for files) the manifest and the
    blobs to publish — the manifest's encoding under its hash and every shard under its own (a token
    file's as :class:`~fusionp2p.data.file_shards.FileRange`: read from the file when served).

    A built-in corpus needs no blobs: every node rebuilds it and checks the pinned hash.
    """
    if isinstance(src, Examples):
        eman, eblobs = src.shards()
        ids = [a for a in src.arrays.values() if np.issubdtype(a.dtype, np.integer) and a.size]
        top = max([int(a.max()) for a in ids], default=0)
        per = max((int(np.prod(f.shape)) for f in eman.fields if f.name in ("input_ids", "pixel_values")), default=1)
        ref = DatasetRef(kind="examples", name=src.name, content_hash=eman.content_hash, seq_len=max(1, per),
                         vocab_size=max(2, top + 1), num_tokens=eman.num_examples)
        return ref, eman, {eman.content_hash: eman.encode(), **eblobs}
    if isinstance(src, BuiltinCorpus):
        ref = DatasetRef(kind="builtin", name=src.name, content_hash=src.content_hash, seq_len=src.seq_len,
                         vocab_size=src.vocab_size, num_tokens=len(src.tokens()))
        return ref, None, {}
    if isinstance(src, TokenURL):   # the nodes read the shards from the URL: only the manifest is published
        man = src.manifest()
        ref = DatasetRef(kind="url", name=src.url, content_hash=man.content_hash, seq_len=src.seq_len,
                         vocab_size=src.vocab_size, num_tokens=man.num_tokens)
        return ref, man, {man.content_hash: man.encode()}
    manifest, ranges = src.shards(shard_tokens)   # hashed a shard at a time, served from the file (issue 38)
    blobs: dict[str, bytes | FileRange] = {manifest.content_hash: manifest.encode(), **ranges}
    ref = DatasetRef(kind=src.kind, name=str(src.path)[-256:], content_hash=manifest.content_hash, seq_len=src.seq_len,
                     vocab_size=src.vocab_size, num_tokens=manifest.num_tokens)
    return ref, manifest, blobs


@dataclass(frozen=True, kw_only=True, slots=True)
class Resources:
    """What a node needs to accept the job. ``device_kinds=()`` accepts any device."""

    min_memory_bytes: int = field(default=0, metadata={"wire": {"lo": 0, "hi": 1 << 60}})
    device_kinds: tuple[str, ...] = field(default=(), metadata={"wire": {"max_len": len(DEVICE_KINDS), "item": {"max_len": 8}}})

    def __post_init__(self) -> None:
        if isinstance(self.min_memory_bytes, bool) or not isinstance(self.min_memory_bytes, int) or self.min_memory_bytes < 0:
            raise ConfigError("min_memory_bytes must be an integer >= 0")
        kinds = tuple(self.device_kinds)
        bad = [k for k in kinds if k not in DEVICE_KINDS]
        if bad:
            raise ConfigError(f"device kinds {bad} unknown; use some of {', '.join(DEVICE_KINDS)}")
        object.__setattr__(self, "device_kinds", tuple(sorted(set(kinds))))  # canonical order

    def fits(self, *, memory_bytes: int, device_kind: str) -> bool:
        """Whether a node with this much free memory and this device can take part."""
        return memory_bytes >= self.min_memory_bytes and (not self.device_kinds or device_kind in self.device_kinds)

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    @classmethod
    def from_wire(cls, obj: Any) -> Resources:
        return codec.from_wire(cls, obj, "resources")


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """Everything nodes need to decide on, plan and run a job. Large parts are named by hash."""

    job_id: str = field(metadata={"wire": {"max_len": 64}})
    publisher: str = field(metadata={"wire": {"max_len": 64}})     # peer id of the publisher; the signature must verify against it
    created: float = field(metadata={"wire": {"lo": 0.0}})         # publisher's wall clock (unix seconds), injected by the caller
    model_hash: str = field(metadata={"wire": {"max_len": 64}})    # sha256 of the encoded OP-DAG
    weights_hash: str = field(metadata={"wire": {"max_len": 64}})  # sha256 of the initial weights (safetensors bytes)
    dataset: DatasetRef
    config: TrainConfig
    resources: Resources = field(default_factory=Resources)
    name: str = ""          # a human label for CLIs and logs

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not _JOB_ID.fullmatch(self.job_id):
            raise ConfigError("job_id must be 1-64 characters of letters, digits, '.', '_' or '-'")
        if not is_valid_peer_id(self.publisher):
            raise ConfigError(f"publisher {self.publisher!r} is not a valid peer id")
        if isinstance(self.created, bool) or not isinstance(self.created, int | float) or not math.isfinite(self.created) or self.created < 0:
            raise ConfigError("created must be a finite, non-negative time in seconds")
        object.__setattr__(self, "created", float(self.created))
        _check_hash("model_hash", self.model_hash)
        _check_hash("weights_hash", self.weights_hash)
        for n, typ in (("dataset", DatasetRef), ("config", TrainConfig), ("resources", Resources)):
            if not isinstance(getattr(self, n), typ):
                raise ConfigError(f"{n} must be a {typ.__name__}")
        if not isinstance(self.name, str) or len(self.name) > 256:
            raise ConfigError("name must be a string of at most 256 characters")

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    def encode(self) -> bytes:
        """Canonical bytes (what is signed and hashed)."""
        return packb(self.to_wire())

    @property
    def content_hash(self) -> str:
        """sha256 of :meth:`encode`: the job's content address (DHT key, plan input)."""
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def from_wire(cls, obj: Any) -> JobSpec:
        return codec.from_wire(cls, obj, "job spec")


def sign_spec(spec: JobSpec, sign: Callable[[bytes], bytes]) -> bytes:
    """The signed envelope of *spec*; *sign* is ``transport.sign`` or ``Identity.sign`` of the publisher.

    Raises ConfigError if the signature does not verify against ``spec.publisher`` (signed with
    another node's key), so a bad envelope never leaves this node.
    """
    body = spec.encode()
    sig = sign(SIGN_DOMAIN + body)
    if not verify(spec.publisher, SIGN_DOMAIN + body, sig):
        raise ConfigError("the signing key is not the publisher's: set publisher to the signer's peer id")
    envelope = packb({"v": SPEC_VERSION, "spec": body, "sig": sig})
    if len(envelope) > MAX_SPEC_BYTES:
        raise ConfigError(f"job spec is {len(envelope)} bytes, over {MAX_SPEC_BYTES}; shorten its name")
    return envelope


def decode_signed(data: bytes | bytearray | memoryview, *, max_size: int = MAX_SPEC_BYTES) -> JobSpec:
    """Parse and verify a signed job spec from a peer (see the module docstring for the checks)."""
    if len(data) > max_size:
        raise RemoteProtocolError(f"job spec of {len(data)} bytes exceeds the limit of {max_size}")
    env = expect_map(unpackb(bytes(data), max_size=max_size), "job envelope")
    if env.get("v") != SPEC_VERSION:
        raise RemoteProtocolError(f"job envelope version {env.get('v')!r} is not supported (want {SPEC_VERSION})")
    body = typed_field(env, "spec", bytes, "job envelope")
    sig = env.get("sig")
    if sig is None or sig == b"":
        raise IntegrityError("job spec is unsigned")
    if not isinstance(sig, bytes):
        raise RemoteProtocolError("job envelope: signature must be bytes")
    spec = JobSpec.from_wire(unpackb(body, max_size=max_size))
    if spec.encode() != body:
        raise RemoteProtocolError("job spec is not canonically encoded")
    if not verify(spec.publisher, SIGN_DOMAIN + body, sig):
        raise IntegrityError(f"job spec {spec.job_id} signature does not verify against publisher {spec.publisher}")
    return spec
