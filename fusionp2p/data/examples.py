"""Datasets of named tensors per example: ``input_ids``/``attention_mask``/``labels``, ``pixel_values``/``label``...

:class:`Examples` is what a user gives ``publish`` when the model takes more than a token window:
a mapping from field name to an array whose first dimension is the example (every field has the
same number of examples; the rest of each shape is fixed). A job feeds a micro-batch of examples to
the model by name (``model(**batch)``), or, with a loss function, the fields named in the loss
function's signature to it and the rest to the model.

A seeded random ``holdout`` share of the examples is kept out of training and evaluated (the held-out
loss): the publisher moves those examples to the end before sharding, so the split is part of the
content that the hash pins. It also shuffles each part once (seeded): a node streams whole shards, a run
of them a replica (``data/stream.py``, ``jobs/data_shards.py``), so examples given sorted are mixed here.

Sharding, content-addressed as token datasets are (``data/shards.py``): a shard holds examples
``[i*shard_examples, (i+1)*shard_examples)``, the raw little-endian bytes of each field in the
manifest's field order, one after the other. Its size is exact from the manifest, so a node bounds
every fetch, and it is checked against its sha256 before any byte is read as a tensor. The
:class:`ExampleManifest` (canonical msgpack) lists the fields (name, dtype, per-example shape), the
counts and the shard hashes; its own hash is what the job's dataset reference names.

Pure: no I/O except :meth:`Examples.load` (a user's file on the publisher).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb

#: dtypes a field may have (name on the wire -> numpy little-endian dtype)
FIELD_DTYPES: dict[str, np.dtype[Any]] = {
    "u8": np.dtype("<u1"), "i8": np.dtype("<i1"), "i16": np.dtype("<i2"), "i32": np.dtype("<i4"),
    "i64": np.dtype("<i8"), "f16": np.dtype("<f2"), "f32": np.dtype("<f4"), "f64": np.dtype("<f8"),
    "bool": np.dtype("?"),
}
_DTYPE_NAMES = {v: k for k, v in FIELD_DTYPES.items()}
MAX_FIELDS = 32
MAX_EXAMPLES = 1 << 31
MAX_SHARDS = 100_000
MAX_MANIFEST_BYTES = 8 << 20
DEFAULT_SHARD_BYTES = 4 << 20   # a reading stage holds a window of about 34 shards (jobs/data_shards.window_bytes): 136 MiB
_SEED_DOMAIN = 0x45584D50   # "EXMP"
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not set(name) <= _NAME_OK or name[0].isdigit():
        raise ConfigError(f"field name {name!r} must be a Python identifier of at most 64 characters")
    return name


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldSpec:
    """One field of every example: its name, dtype and per-example shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_name(self.name)
        if self.dtype not in FIELD_DTYPES:
            raise ConfigError(f"field {self.name}: dtype {self.dtype!r} is not one of {', '.join(FIELD_DTYPES)}")
        if len(self.shape) > 6 or not all(type(d) is int and 1 <= d <= 1 << 24 for d in self.shape):
            raise ConfigError(f"field {self.name}: per-example shape {self.shape} must be at most 6 positive dims")

    @property
    def example_bytes(self) -> int:
        return math.prod(self.shape) * FIELD_DTYPES[self.dtype].itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class ExampleManifest:
    """Fields, counts and ordered shard hashes of a dataset of examples (see the module docstring)."""

    fields: tuple[FieldSpec, ...]
    num_examples: int        # all of them, the held-out ones last
    num_train: int           # the first num_train train; the rest are held out
    shard_examples: int
    shards: tuple[str, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.fields) <= MAX_FIELDS or len({f.name for f in self.fields}) != len(self.fields):
            raise ConfigError(f"a dataset needs 1 to {MAX_FIELDS} fields with distinct names")
        if not 1 <= self.num_train <= self.num_examples <= MAX_EXAMPLES or self.shard_examples < 1:
            raise ConfigError("a dataset needs at least one training example and shard_examples >= 1")
        expected = -(-self.num_examples // self.shard_examples)
        if len(self.shards) != expected or expected > MAX_SHARDS:
            raise ConfigError(f"manifest lists {len(self.shards)} shards, expected {expected} (at most {MAX_SHARDS})")
        if not all(isinstance(h, str) and len(h) == 64 and set(h) <= set("0123456789abcdef") for h in self.shards):
            raise ConfigError("shard hashes must be lowercase hex sha256 digests")

    @property
    def example_bytes(self) -> int:
        return sum(f.example_bytes for f in self.fields)

    @property
    def num_holdout(self) -> int:
        return self.num_examples - self.num_train

    @property
    def total_bytes(self) -> int:
        return self.num_examples * self.example_bytes

    def shard_range(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self.shards):
            raise IndexError(f"shard {index} out of range")
        lo = index * self.shard_examples
        return lo, min(lo + self.shard_examples, self.num_examples)

    def shard_bytes(self, index: int) -> int:
        lo, hi = self.shard_range(index)
        return (hi - lo) * self.example_bytes

    def to_wire(self) -> dict[str, Any]:
        return {"fields": [[f.name, f.dtype, list(f.shape)] for f in self.fields], "num_examples": self.num_examples,
                "num_train": self.num_train, "shard_examples": self.shard_examples, "shards": list(self.shards)}

    def encode(self) -> bytes:
        return packb(self.to_wire())

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def decode(cls, data: bytes, *, expected_hash: str | None = None) -> ExampleManifest:
        """Parse a manifest from a peer; with *expected_hash*, check the bytes first."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise RemoteProtocolError(f"example manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        if expected_hash is not None and hashlib.sha256(data).hexdigest() != expected_hash:
            raise IntegrityError("example manifest does not match its content hash")
        what = "example manifest"
        m = expect_map(unpackb(bytes(data), max_size=MAX_MANIFEST_BYTES), what)
        raw = typed_field(m, "fields", list, what)
        try:
            fields = []
            for f in raw:
                if (not isinstance(f, list) or len(f) != 3 or not isinstance(f[0], str) or not isinstance(f[1], str)
                        or not isinstance(f[2], list)):
                    raise ConfigError("bad field entry")
                fields.append(FieldSpec(name=f[0], dtype=f[1], shape=tuple(f[2])))
            man = cls(fields=tuple(fields), num_examples=typed_field(m, "num_examples", int, what),
                      num_train=typed_field(m, "num_train", int, what), shard_examples=typed_field(m, "shard_examples", int, what),
                      shards=tuple(typed_field(m, "shards", list, what)))
        except ConfigError as exc:
            raise RemoteProtocolError(f"{what}: {exc}") from None
        if set(m) != {"fields", "num_examples", "num_train", "shard_examples", "shards"} or man.encode() != bytes(data):
            raise RemoteProtocolError(f"{what} is not canonically encoded")
        return man


class Examples:
    """A user's dataset of named tensors per example (see the module docstring).

    ``Examples({"input_ids": ids_NT, "labels": labels_NT}, holdout=0.1)``; arrays may be NumPy arrays
    or torch tensors (copied to NumPy). ``holdout`` is a share (``0 < h < 1``) or a count of examples
    kept out of training for the held-out loss (0: none). ``shard_bytes`` sizes the shards the examples
    travel in (a reading stage holds a window of them, ``jobs/data_shards.py``).
    """

    def __init__(self, fields: Mapping[str, Any], *, holdout: float | int = 0, seed: int = 0,
                 name: str = "examples", shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if not isinstance(fields, Mapping) or not fields:
            raise ConfigError("Examples needs a mapping of field name -> array, e.g. {'input_ids': ids, 'labels': y}")
        arrays: dict[str, npt.NDArray[Any]] = {}
        for k, v in fields.items():
            arr = _to_numpy(v, _check_name(k))
            if arr.ndim < 1 or arr.shape[0] < 1:
                raise ConfigError(f"field {k}: the first dimension counts the examples and must be >= 1")
            arrays[k] = arr
        counts = {k: int(a.shape[0]) for k, a in arrays.items()}
        if len(set(counts.values())) != 1:
            raise ConfigError(f"every field needs the same number of examples, got {counts}")
        n = next(iter(counts.values()))
        h = _holdout_count(holdout, n)
        self.arrays = arrays
        self.num_examples = n
        self.num_holdout = h
        self.seed = int(seed)
        self.name = str(name)[:256]
        if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
            raise ConfigError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
        self.shard_bytes = shard_bytes   # a shard holds as many whole examples as fit (at least one)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, holdout: float | int = 0, seed: int = 0,
             shard_bytes: int = DEFAULT_SHARD_BYTES) -> Examples:
        """Read the fields from a ``.npz`` (``np.savez``, no pickle) or a ``.safetensors`` file."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"dataset file {p} does not exist")
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                fields = {k: np.asarray(z[k]) for k in z.files}
        elif p.suffix == ".safetensors":
            from safetensors.numpy import load_file

            fields = dict(load_file(str(p)))
        else:
            raise ConfigError(f"{p}: give a .npz or .safetensors file of named arrays (one row per example)")
        return cls(fields, holdout=holdout, seed=seed, name=p.name, shard_bytes=shard_bytes)

    @classmethod
    def causal_lm(cls, tokens: Any, seq_len: int, *, shift: int = 0, names: tuple[str, str] = ("input_ids", "labels"),
                  holdout: float | int = 0, seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Examples:
        """Windows of ``seq_len`` tokens from a 1-D token array or a token source (``BuiltinCorpus``),
        as two fields named *names*: with ``shift=0`` the same ids twice (a Hugging Face causal LM
        shifts the labels itself), with ``shift=1`` the inputs and the next tokens (a model whose
        ``forward(idx, targets)`` compares them as they are, e.g. ``fusionp2p.models.GPT2`` with
        ``names=("idx_BT", "targets_BT")``)."""
        arr = np.asarray(tokens.tokens() if hasattr(tokens, "tokens") else tokens)
        if shift not in (0, 1) or len(names) != 2 or names[0] == names[1]:
            raise ConfigError("causal_lm takes shift 0 or 1 and two distinct field names")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or seq_len < 1 or arr.shape[0] < seq_len + shift:
            raise ConfigError("causal_lm needs a 1-D integer token array of at least seq_len tokens")
        w = (arr.shape[0] - shift) // seq_len
        ids = np.ascontiguousarray(arr[: w * seq_len].reshape(w, seq_len), dtype=np.int64)
        nxt = np.ascontiguousarray(arr[shift: shift + w * seq_len].reshape(w, seq_len), dtype=np.int64)
        return cls({names[0]: ids, names[1]: nxt}, holdout=holdout, seed=seed, name="causal-lm", shard_bytes=shard_bytes)

    @classmethod
    def from_hf(cls, dataset: Any, *, tokenizer: Any = None, text: str = "text", max_length: int = 128,
                labels: str | None = "label", columns: Mapping[str, str] | None = None,
                holdout: float | int = 0, seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Examples:
        """Examples from a Hugging Face ``datasets.Dataset`` (or any mapping of column name -> values).

        With a *tokenizer* (yours, e.g. ``AutoTokenizer.from_pretrained(...)``), column *text* becomes
        ``input_ids`` and ``attention_mask`` padded/truncated to *max_length*. *labels* names the
        column that becomes ``labels`` (``"input_ids"``: the ids themselves with padding as -100, for
        causal or masked LM; None: no labels). *columns* maps further dataset columns to field names.
        """
        fields: dict[str, Any] = {}
        if tokenizer is not None:
            if getattr(tokenizer, "pad_token", None) is None:
                raise ConfigError("the tokenizer has no pad token: set tokenizer.pad_token (e.g. to its eos token)")
            enc = tokenizer(list(dataset[text]), padding="max_length", truncation=True, max_length=max_length,
                            return_tensors="np")
            fields["input_ids"] = np.asarray(enc["input_ids"], dtype=np.int64)
            fields["attention_mask"] = np.asarray(enc["attention_mask"], dtype=np.int64)
        if labels == "input_ids":
            if "input_ids" not in fields:
                raise ConfigError("labels='input_ids' needs a tokenizer")
            fields["labels"] = np.where(fields["attention_mask"] == 1, fields["input_ids"], -100)
        elif labels is not None:
            fields["labels"] = np.asarray(dataset[labels])
        for col, name in (columns or {}).items():
            fields[name] = np.asarray(dataset[col])
        if not fields:
            raise ConfigError("from_hf: give a tokenizer, a labels column or columns to take")
        return cls(fields, holdout=holdout, seed=seed, name="hf-dataset", shard_bytes=shard_bytes)

    @property
    def field_specs(self) -> tuple[FieldSpec, ...]:
        return tuple(FieldSpec(name=k, dtype=_DTYPE_NAMES[a.dtype], shape=tuple(int(d) for d in a.shape[1:]))
                     for k, a in self.arrays.items())

    def order(self) -> npt.NDArray[np.int64]:
        """Example order as sharded: the training examples, then the seeded held-out choice, each in a seeded
        random order. A node reads whole shards, a run of them a replica (``data/stream.py``), so examples
        the user gave in some order (by class, by source) are mixed across shards here, once."""
        n, h = self.num_examples, self.num_holdout
        rng = np.random.Generator(np.random.PCG64([_SEED_DOMAIN, self.seed]))
        held = np.sort(rng.choice(n, size=h, replace=False)) if h else np.zeros(0, dtype=np.int64)
        keep = np.setdiff1d(np.arange(n, dtype=np.int64), held)
        return np.concatenate([rng.permutation(keep), rng.permutation(held)]).astype(np.int64)

    def batch(self, indices: npt.ArrayLike) -> dict[str, npt.NDArray[Any]]:
        """Rows *indices* of the sharded order (for the publisher's example micro-batch)."""
        rows = self.order()[np.asarray(indices, dtype=np.int64)]
        return {k: a[rows] for k, a in self.arrays.items()}

    def shards(self, *, shard_bytes: int | None = None) -> tuple[ExampleManifest, dict[str, bytes]]:
        """The manifest and ``{hash: bytes}`` of every distinct shard (of *shard_bytes*, default the dataset's)."""
        shard_bytes = self.shard_bytes if shard_bytes is None else shard_bytes
        specs = self.field_specs
        per = max(1, sum(f.example_bytes for f in specs))
        shard_examples = max(1, shard_bytes // per)
        order = self.order()
        blobs: dict[str, bytes] = {}
        hashes: list[str] = []
        for lo in range(0, self.num_examples, shard_examples):
            rows = order[lo:lo + shard_examples]
            data = b"".join(np.ascontiguousarray(self.arrays[f.name][rows]).tobytes() for f in specs)
            h = hashlib.sha256(data).hexdigest()
            blobs[h] = data
            hashes.append(h)
        man = ExampleManifest(fields=specs, num_examples=self.num_examples,
                              num_train=self.num_examples - self.num_holdout, shard_examples=shard_examples,
                              shards=tuple(hashes))
        return man, blobs


def _to_numpy(v: Any, name: str) -> npt.NDArray[Any]:
    if hasattr(v, "detach") and hasattr(v, "numpy"):   # a torch tensor, without importing torch here
        v = v.detach().cpu().numpy()
    arr = np.asarray(v)
    if arr.dtype.byteorder == ">" or arr.dtype.newbyteorder("<") not in _DTYPE_NAMES:
        if np.issubdtype(arr.dtype, np.integer) and arr.dtype.itemsize <= 8:
            arr = arr.astype(np.int64)
        else:
            raise ConfigError(f"field {name}: dtype {arr.dtype} is not supported; use integers, floats or bool")
    return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))


def _holdout_count(holdout: float | int, n: int) -> int:
    if isinstance(holdout, bool) or not isinstance(holdout, int | float) or holdout < 0:
        raise ConfigError(f"holdout must be a share in (0, 1) or a count of examples, got {holdout!r}")
    h = round(holdout * n) if isinstance(holdout, float) and holdout < 1 else int(holdout)
    if isinstance(holdout, float) and holdout < 1 and holdout > 0:
        h = max(1, h)
    if h >= n:
        raise ConfigError(f"holdout of {h} examples leaves none of the {n} to train on")
    return h


def decode_example_shard(m: ExampleManifest, index: int, data: bytes) -> dict[str, npt.NDArray[Any]]:
    """Shard *index*'s fields, checked against the manifest first (size, then hash): IntegrityError."""
    if len(data) != m.shard_bytes(index):
        raise IntegrityError(f"example shard {index} has {len(data)} bytes, expected {m.shard_bytes(index)}")
    if hashlib.sha256(data).hexdigest() != m.shards[index]:
        raise IntegrityError(f"example shard {index} does not match its hash in the manifest")
    lo, hi = m.shard_range(index)
    out: dict[str, npt.NDArray[Any]] = {}
    off = 0
    for f in m.fields:
        nb = (hi - lo) * f.example_bytes
        out[f.name] = np.frombuffer(data, dtype=FIELD_DTYPES[f.dtype], count=nb // FIELD_DTYPES[f.dtype].itemsize,
                                    offset=off).reshape((hi - lo, *f.shape))
        off += nb
    return out


def read_rows(manifest: ExampleManifest, shards: Mapping[int, Mapping[str, npt.NDArray[Any]]],
              indices: npt.ArrayLike) -> dict[str, npt.NDArray[Any]]:
    """Examples *indices* (in the sharded order) stacked per field, from decoded *shards*; KeyError if one is missing."""
    idx = np.asarray(indices, dtype=np.int64)
    per = manifest.shard_examples
    out = {f.name: np.empty((len(idx), *f.shape), dtype=FIELD_DTYPES[f.dtype]) for f in manifest.fields}
    for j, i in enumerate(idx.tolist()):
        shard = shards.get(i // per)
        if shard is None:
            raise KeyError(f"example shard {i // per} not loaded")
        for k, a in shard.items():
            out[k][j] = a[i % per]
    return out


class ShardedExamples:
    """The examples of a manifest on a node: verified shards, read by example index."""

    __slots__ = ("_shards", "manifest")

    def __init__(self, manifest: ExampleManifest) -> None:
        self.manifest = manifest
        self._shards: dict[int, dict[str, npt.NDArray[Any]]] = {}

    def add(self, index: int, data: bytes) -> None:
        """Check shard *index* against the manifest (size, then hash) and keep its fields."""
        self._shards[index] = decode_example_shard(self.manifest, index, data)

    def rows(self, indices: npt.ArrayLike) -> dict[str, npt.NDArray[Any]]:
        """Examples *indices* (in the sharded order) stacked per field."""
        return read_rows(self.manifest, self._shards, indices)


class ExampleSampler:
    """Which examples make up micro-batch ``(step, micro)``: drawn without replacement, epoch by epoch,
    from a permutation of ``[0, num)`` seeded by ``(seed, epoch)`` (as the token sampler draws windows),
    shifted by ``offset`` (the held-out examples follow the training ones). An in-memory order (any step
    may read any shard): a job streams its examples in ``data/stream.ExampleOrder``'s order instead."""

    __slots__ = ("_perm", "micro_batch", "micro_batches", "num", "offset", "seed")

    def __init__(self, *, num: int, micro_batch: int, micro_batches: int, seed: int, offset: int = 0) -> None:
        if num < 1 or micro_batch < 1 or micro_batches < 1:
            raise ConfigError("an example sampler needs num, micro_batch and micro_batches >= 1")
        self.num, self.micro_batch, self.micro_batches, self.seed, self.offset = num, micro_batch, micro_batches, seed, offset
        self._perm = functools.lru_cache(maxsize=2)(self._permutation)

    def _permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        return np.random.Generator(np.random.PCG64([_SEED_DOMAIN, self.seed, epoch])).permutation(self.num)

    def indices(self, step: int, micro: int) -> npt.NDArray[np.int64]:
        g0 = (step * self.micro_batches + micro) * self.micro_batch
        out = np.empty(self.micro_batch, dtype=np.int64)
        for b in range(self.micro_batch):
            epoch, pos = divmod(g0 + b, self.num)
            out[b] = self.offset + int(self._perm(epoch)[pos])
        return out


__all__ = ["ExampleManifest", "ExampleSampler", "Examples", "FieldSpec", "ShardedExamples", "decode_example_shard", "read_rows"]
