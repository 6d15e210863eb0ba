"""A Hugging Face dataset in streaming mode, tokenised with the user's tokenizer into a streamed token file.

``HFTokens("json", data_files="corpus.jsonl", tokenizer=tok, seq_len=128)`` (or a hub name such as
``"HuggingFaceFW/fineweb"``) is what a user gives ``publish`` for a text dataset too large to hold: at
publish, :meth:`HFTokens.token_file` iterates ``datasets.load_dataset(..., streaming=True)`` one record at
a time, tokenises each record's ``text`` column with ``tokenizer.encode`` (an end-of-document id after
each, when the tokenizer has one), and appends the ids to a raw token file in the manifest's storage
dtype, a bounded buffer at a time. That file is then an ordinary :class:`~fusionp2p.data.TokenFile`:
hashed a shard at a time, its shards served as ranges of it (``data/file_shards.py``) and streamed by the
reading stages only (``jobs/data_shards.py``). Neither the publisher nor a node ever holds the dataset.

What is exact, and what is not:

* **Exact:** the job trains on the tokens the manifest's hashes pin, every node the same, sampled as any
  token file (``data/stream.py``: each window once an epoch across the replicas, through re-plans).
* **Deterministic, not pinned by us:** the token stream itself. Without ``.shuffle()`` a streaming dataset
  yields its data files in the listed order and each file's rows in order, so the same files give the same
  tokens; a hub dataset at a moving revision (pass ``revision=``) may give other tokens on another day, and
  so another manifest: a different job, never a mix. HF's streaming ``shuffle(buffer_size)`` is approximate
  and is not used: the window order is shuffled exactly by the sampler instead.
* **Not done here:** tokenising on the reading stages. A stream has no random access (a replica would read
  every earlier record to reach its own), no hash a node could check, and the tokenizer would have to
  travel to the nodes as code. The publisher tokenises once instead; the tokens (2 to 4 times smaller than
  the text) take its disk, not its memory.

Needs the optional extra ``pip install fusionp2p[hf]`` (``datasets``), imported only when used.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fusionp2p.data.shards import STORAGE_DTYPES, storage_dtype
from fusionp2p.data.tokens import TokenFile
from fusionp2p.errors import ConfigError

FLUSH_TOKENS = 1 << 20            # ids buffered before they are written
_ARRAY_NAMES = {"u8": "uint8", "u16": "uint16", "i32": "int32"}


class Tokenizer(Protocol):
    """What a tokenizer needs: ``encode(text) -> ids`` (a ``transformers`` tokenizer, ``tiktoken``, ...)."""

    def encode(self, text: str) -> list[int]: ...


def _vocab_of(tokenizer: Any) -> int:
    """len(tokenizer) (a transformers tokenizer with added tokens), else .vocab_size or .n_vocab (tiktoken)."""
    sized = [len(tokenizer)] if hasattr(tokenizer, "__len__") else []
    for n in [*sized, getattr(tokenizer, "vocab_size", None), getattr(tokenizer, "n_vocab", None)]:
        if isinstance(n, int) and n >= 2:
            return n
    raise ConfigError("cannot tell the tokenizer's vocabulary size; pass vocab_size=")


@dataclass(frozen=True, slots=True)
class HFTokens:
    """A Hugging Face dataset streamed and tokenised at publish (see the module docstring)."""

    path: str
    _: KW_ONLY
    tokenizer: Any
    seq_len: int = 128
    vocab_size: int = 0             # 0: the tokenizer's (len(tokenizer), .vocab_size or .n_vocab)
    split: str = "train"
    name: str | None = None         # the dataset's configuration
    data_files: Any = None          # local files, as load_dataset takes them
    revision: str | None = None
    text: str = "text"              # the column tokenised
    eos_id: int | None = -1         # after each record; -1: the tokenizer's eos_token_id (none if it has none)
    max_tokens: int | None = None   # stop once this many tokens are written (None: the whole split)
    out: str | os.PathLike[str] | None = None   # the token file (default: a temporary file, removed at exit)
    load_kwargs: Mapping[str, Any] = field(default_factory=dict)
    _file: list[TokenFile] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("HFTokens needs a dataset path: a hub name, or 'json'/'parquet'/'text' with data_files=")
        if not callable(getattr(self.tokenizer, "encode", None)):
            raise ConfigError("HFTokens needs a tokenizer with encode(text) -> list of ids")
        if self.vocab_size == 0:
            object.__setattr__(self, "vocab_size", _vocab_of(self.tokenizer))
        if self.vocab_size < 2 or self.vocab_size > 2**31 - 1:
            raise ConfigError(f"vocab_size must be in [2, 2**31), got {self.vocab_size}")
        if self.eos_id == -1:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            object.__setattr__(self, "eos_id", eos if isinstance(eos, int) else None)
        if self.max_tokens is not None and self.max_tokens < self.seq_len + 1:
            raise ConfigError("max_tokens must be at least seq_len + 1")

    @property
    def kind(self) -> str:
        return "bin"

    def records(self) -> Iterable[Mapping[str, Any]]:
        """The dataset in streaming mode (ConfigError when ``datasets`` is missing or the load fails)."""
        try:
            import datasets  # the optional `hf` extra
        except ImportError:
            raise ConfigError("HFTokens needs Hugging Face datasets: pip install 'fusionp2p[hf]'") from None
        try:
            ds = datasets.load_dataset(self.path, self.name, split=self.split, data_files=self.data_files,
                                       revision=self.revision, streaming=True, **dict(self.load_kwargs))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ConfigError(f"cannot stream dataset {self.path!r}: {exc}") from None
        return ds  # type: ignore[no-any-return]

    def token_file(self) -> TokenFile:
        """Tokenise the stream into the token file (once; cached) and return it as a :class:`TokenFile`."""
        if self._file:
            return self._file[0]
        dt = storage_dtype(self.vocab_size)
        if self.out is not None:
            path = Path(self.out)
        else:
            fd, name = tempfile.mkstemp(prefix="fusionp2p-hf-", suffix=".bin")
            os.close(fd)
            path = Path(name)
            atexit.register(path.unlink, missing_ok=True)   # kept while this process may publish from it
        written = self._write(path, STORAGE_DTYPES[dt])
        if written < self.seq_len + 1:
            raise ConfigError(f"dataset {self.path!r} gave {written} tokens, fewer than seq_len + 1 = {self.seq_len + 1}")
        tf = TokenFile(path, seq_len=self.seq_len, kind="bin", dtype=_ARRAY_NAMES[dt], vocab_size=self.vocab_size)
        self._file.append(tf)
        return tf

    def _write(self, path: Path, dtype: np.dtype[np.integer]) -> int:
        buf: list[int] = []
        written = 0
        limit = self.max_tokens
        i = -1
        with path.open("wb") as f:
            for i, rec in enumerate(self.records()):
                value = rec.get(self.text) if isinstance(rec, Mapping) else None
                if not isinstance(value, str):
                    raise ConfigError(f"record {i} of {self.path!r} has no text column {self.text!r} "
                                      f"(columns: {sorted(rec) if isinstance(rec, Mapping) else type(rec).__name__}); "
                                      "pass text=")
                buf.extend(self.tokenizer.encode(value))
                if self.eos_id is not None:
                    buf.append(self.eos_id)
                if len(buf) >= FLUSH_TOKENS or (limit is not None and written + len(buf) >= limit):
                    written += self._flush(f, buf, dtype, limit, written, i)
                    if limit is not None and written >= limit:
                        break
            written += self._flush(f, buf, dtype, limit, written, i)
        return written

    def _flush(self, f: Any, buf: list[int], dtype: np.dtype[np.integer], limit: int | None, written: int,
               record: int) -> int:
        if limit is not None:
            del buf[max(0, limit - written):]
        if not buf:
            return 0
        ids = np.asarray(buf, dtype=np.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ConfigError(f"the tokenizer gave id {int(ids.max()) if ids.max() >= self.vocab_size else int(ids.min())} "
                              f"(by record {record}), outside [0, {self.vocab_size}); pass the tokenizer's vocab_size=")
        f.write(ids.astype(dtype).tobytes())
        n = len(buf)
        buf.clear()
        return n


__all__ = ["HFTokens", "Tokenizer"]
