"""User-facing token sources: a built-in corpus, a text file, or a pre-tokenised array file.

Every source is a 1-D integer token array plus ``seq_len`` and ``vocab_size``. Files are checked
when the source is created (missing, empty, too small for one sample, wrong dtype), so a user
mistake surfaces at ``publish`` time as a one-line :class:`~fusionp2p.errors.ConfigError` rather
than on a remote node hours later. Arrays are memory-mapped, never loaded with pickle.

Kinds of :class:`TokenFile`:

* ``text`` — any file read as bytes; byte-level tokens, vocabulary 256.
* ``npy`` — a NumPy ``.npy`` file holding a 1-D ``uint8``/``uint16``/``int32`` array
  (``allow_pickle=False``).
* ``bin`` — raw little-endian tokens with the dtype given (``uint16`` by default, as in nanoGPT).

``kind="auto"`` picks ``npy`` for ``*.npy``, ``bin`` for ``*.bin`` and ``text`` otherwise.
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from fusionp2p.data.corpus import BUILTIN_NAMES, VOCAB_SIZE, corpus_hash, corpus_tokens
from fusionp2p.data.file_shards import FileRange, file_chunks, id_range, shard_file
from fusionp2p.data.shards import ShardManifest, TokenArray
from fusionp2p.errors import ConfigError

KINDS = ("auto", "text", "npy", "bin")
ARRAY_DTYPES: dict[str, np.dtype[np.integer]] = {
    "uint8": np.dtype("<u1"),
    "uint16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
}


class TokenSource(Protocol):
    """What the sampler and the job publisher need from a dataset."""

    @property
    def seq_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def tokens(self) -> TokenArray:
        """The whole token stream, 1-D (possibly a read-only memory map)."""
        ...


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")


def _check_enough(n_tokens: int, seq_len: int, what: str) -> None:
    # One sample needs seq_len inputs plus the shifted-by-one target after them.
    if n_tokens < seq_len + 1:
        raise ConfigError(
            f"{what} holds {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use a larger file or a smaller seq_len"
        )


@dataclass(frozen=True, slots=True)
class BuiltinCorpus:
    """A corpus that ships with Python (see :mod:`fusionp2p.data.corpus`): nothing to download."""

    name: str = "pydoc"
    _: KW_ONLY
    seq_len: int = 128

    def __post_init__(self) -> None:
        if self.name not in BUILTIN_NAMES:
            raise ConfigError(f"unknown built-in corpus {self.name!r}; use one of {', '.join(BUILTIN_NAMES)}")
        _check_seq_len(self.seq_len)
        _check_enough(len(corpus_tokens(self.name)), self.seq_len, f"built-in corpus {self.name!r}")

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def content_hash(self) -> str:
        """sha256 of the corpus bytes on this Python (pinned in the job's dataset reference)."""
        return corpus_hash(self.name)

    def tokens(self) -> TokenArray:
        return corpus_tokens(self.name)


@dataclass(frozen=True, slots=True)
class TokenFile:
    """A user's dataset file: ``TokenFile("corpus.txt", seq_len=128)`` or ``TokenFile("t.bin", seq_len=128)``.

    ``vocab_size`` defaults to 256 for text and to ``max(token) + 1`` for arrays (computed once, at
    construction); pass it to match the model's embedding size.
    """

    path: str | os.PathLike[str]
    _: KW_ONLY
    seq_len: int = 128
    kind: str = "auto"
    dtype: str | None = None
    vocab_size: int = 0  # 0: infer (see class docstring)
    _num_tokens: int = field(default=0, init=False, repr=False, compare=False)
    _offset: int = field(default=0, init=False, repr=False, compare=False)        # of the tokens in the file
    _range: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)   # ids, once scanned

    def __post_init__(self) -> None:
        _check_seq_len(self.seq_len)
        if self.kind not in KINDS:
            raise ConfigError(f"TokenFile kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        p = Path(self.path)
        kind = self.kind
        if kind == "auto":
            kind = {".npy": "npy", ".bin": "bin"}.get(p.suffix.lower(), "text")
        object.__setattr__(self, "kind", kind)
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise ConfigError(f"dataset file {p} does not exist; check the path") from None
        except OSError as exc:
            raise ConfigError(f"cannot read dataset file {p}: {exc.strerror}") from None
        if not p.is_file():
            raise ConfigError(f"dataset path {p} is not a regular file")
        if size == 0:
            raise ConfigError(f"dataset file {p} is empty; give a file with at least seq_len + 1 tokens")
        if kind == "text":
            if self.dtype not in (None, "uint8"):
                raise ConfigError("a text TokenFile is byte-level (uint8); drop the dtype argument")
            object.__setattr__(self, "dtype", "uint8")
        elif kind == "bin":
            dt = self.dtype or "uint16"
            if dt not in ARRAY_DTYPES:
                raise ConfigError(f"raw .bin token dtype must be one of {', '.join(ARRAY_DTYPES)}, got {dt!r}")
            if size % ARRAY_DTYPES[dt].itemsize:
                raise ConfigError(f"{p} has {size} bytes, not a whole number of {dt} tokens; pass the right dtype=")
            object.__setattr__(self, "dtype", dt)
        arr = self._load()
        if kind == "npy":
            object.__setattr__(self, "dtype", str(arr.dtype))
        _check_enough(int(arr.shape[0]), self.seq_len, f"dataset file {p}")
        object.__setattr__(self, "_num_tokens", int(arr.shape[0]))
        object.__setattr__(self, "_offset", int(getattr(arr, "offset", 0)))
        if kind == "text":
            inferred = VOCAB_SIZE
        else:
            lo, hi = self.id_range()    # one streamed pass (file_shards.py): never the whole file in memory
            if lo < 0:
                raise ConfigError(f"{p} holds negative token ids; token ids must be >= 0")
            inferred = hi + 1
        if self.vocab_size == 0:
            object.__setattr__(self, "vocab_size", inferred)
        elif self.vocab_size < inferred:
            raise ConfigError(f"{p} holds token id {inferred - 1}, beyond vocab_size={self.vocab_size}; raise vocab_size")

    def _load(self) -> TokenArray:
        p = Path(self.path)
        if self.kind == "text":
            return np.memmap(p, dtype=np.uint8, mode="r")
        if self.kind == "bin":
            assert self.dtype is not None
            return np.memmap(p, dtype=ARRAY_DTYPES[self.dtype], mode="r")
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ConfigError(f"{p} is not a readable .npy array ({exc}); save it with numpy.save") from None
        if not isinstance(arr, np.ndarray) or arr.ndim != 1:
            raise ConfigError(f"{p} must hold a 1-D token array; flatten it before saving")
        if arr.dtype.newbyteorder("<") not in ARRAY_DTYPES.values() and arr.dtype not in ARRAY_DTYPES.values():
            raise ConfigError(f"{p} has dtype {arr.dtype}; token arrays must be uint8, uint16 or int32")
        return arr

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def tokens(self) -> TokenArray:
        return self._load()

    def _dtype(self) -> np.dtype[np.integer]:
        return np.dtype(np.uint8) if self.dtype is None else ARRAY_DTYPES.get(self.dtype, np.dtype(self.dtype))

    def id_range(self, ignore: int | None = None) -> tuple[int, int]:
        """(smallest, largest) token id, read a chunk at a time (cached); with *ignore*, that id left out
        (a loss's ``ignore_index``; (0, -1) when every token is it)."""
        if self._range is None:
            found = id_range(file_chunks(self.path, offset=self._offset, dtype=self._dtype(), count=self._num_tokens))
            assert found is not None    # a TokenFile holds at least seq_len + 1 tokens
            object.__setattr__(self, "_range", found)
        assert self._range is not None
        if ignore is None or not self._range[0] <= ignore <= self._range[1]:
            return self._range
        kept = id_range(file_chunks(self.path, offset=self._offset, dtype=self._dtype(), count=self._num_tokens),
                        ignore=ignore)
        return (0, -1) if kept is None else kept

    def shards(self, shard_tokens: int) -> tuple[ShardManifest, dict[str, FileRange]]:
        """The manifest and each distinct shard as a range of a file (``data/file_shards.py``): hashed a
        shard at a time, served from disk, never the whole file in memory."""
        return shard_file(self.path, offset=self._offset, dtype=self._dtype(), num_tokens=self._num_tokens,
                          vocab_size=self.vocab_size, shard_tokens=shard_tokens)
