"""The built-in demo corpus: text that ships with Python itself, tokenised at byte level.

Nothing is downloaded: ``pydoc`` is the help text of :mod:`pydoc_data.topics` (about 465 KB on
CPython 3.11), joined in sorted topic order; ``stdlib`` adds the docstrings of a fixed list of
standard-library modules for a larger corpus. Byte-level tokens mean a vocabulary of 256 and no
tokenizer to agree on.

The text depends on the Python version, so two nodes on different Pythons could hold different
corpora under the same name. That is why a dataset reference to a built-in corpus also carries the
sha256 of its bytes (:func:`corpus_hash`): a node whose local corpus hashes differently refuses the
job instead of training on other data.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging

import numpy as np
import numpy.typing as npt

from fusionp2p.errors import ConfigError

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
BUILTIN_NAMES = ("pydoc", "stdlib")

# Fixed and sorted so that the corpus is a pure function of the Python installation.
_STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
    "email", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "io", "itertools",
    "json", "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "zipfile",
)


def _pydoc_text() -> str:
    from pydoc_data import topics  # part of CPython's standard library

    return "\n\n".join(f"{key}\n{topics.topics[key]}" for key in sorted(topics.topics))


def _docstrings(module_name: str) -> list[str]:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:  # a stripped-down Python: skip, the corpus hash will tell the difference
        log.debug("stdlib module %s not importable; left out of the corpus", module_name)
        return []
    out = [inspect.getdoc(mod) or ""]
    for name in sorted(vars(mod)):
        obj = getattr(mod, name)
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        doc = inspect.getdoc(obj)
        if doc:
            out.append(f"{module_name}.{name}\n{doc}")
    return out


@functools.lru_cache(maxsize=4)
def corpus_bytes(name: str = "pydoc") -> bytes:
    """UTF-8 bytes of the built-in corpus *name* (cached; deterministic for one Python version)."""
    if name not in BUILTIN_NAMES:
        raise ConfigError(f"unknown built-in corpus {name!r}; use one of {', '.join(BUILTIN_NAMES)}")
    parts = [_pydoc_text()]
    if name == "stdlib":
        for mod in _STDLIB_MODULES:
            parts.extend(_docstrings(mod))
    return "\n\n".join(parts).encode("utf-8")


def corpus_tokens(name: str = "pydoc") -> npt.NDArray[np.uint8]:
    """The corpus as byte-level token ids (vocabulary 256), a read-only uint8 array."""
    arr = np.frombuffer(corpus_bytes(name), dtype=np.uint8)
    return arr  # frombuffer over bytes is already read-only


@functools.lru_cache(maxsize=4)
def corpus_hash(name: str = "pydoc") -> str:
    """Hex sha256 of :func:`corpus_bytes` (what a dataset reference pins)."""
    return hashlib.sha256(corpus_bytes(name)).hexdigest()


def decode_bytes(tokens: npt.ArrayLike) -> str:
    """Turn byte-level token ids back into text (invalid UTF-8 is replaced), for samples in demos."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ConfigError("byte-level tokens must lie in [0, 256)")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
