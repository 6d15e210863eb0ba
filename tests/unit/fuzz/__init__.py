"""A small fuzzer for the decoders that take a peer's bytes (no Hypothesis: a seeded ``random.Random``).

Contract checked for every case (issue 15): the decoder returns, or raises
:class:`~fusionp2p.errors.RemoteProtocolError` (``IntegrityError`` is one); no other exception, no hang
(each case within ``case_timeout`` seconds), and memory bounded: for a sampled case, both the peak
that ``tracemalloc`` sees (Python objects) and the rise of the process's peak resident memory (VmHWM,
reset before the case through ``/proc/self/clear_refs``: where torch's CPU allocator puts tensors,
which ``tracemalloc`` does not see: 80 bytes for a 40 MB ``torch.zeros``) stay under the decoder's
stated bound. The harness's own refusals (:class:`HarnessSkip`: input the harness cannot hand to the
decoder) are counted apart from the decoder's.

Mutations start from valid encodings (the seeds):

* *structured*: the seed is decoded as msgpack (nested msgpack in ``bytes`` fields too, so that a
  signed envelope's body is reached), one node of the tree is replaced by a hostile value (wrong type,
  huge or negative int, inf / nan / 1e39 float, long string, long list, deep nesting), a map key is
  dropped, added or retyped, a list is cut or grown; then it is packed again;
* *bytes*: bit flips, random bytes inserted or overwritten, ranges cut or repeated, truncation,
  length prefixes set to 0xff.., concatenation of two seeds.
"""

from __future__ import annotations

import math
import random
import re
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from fusionp2p.errors import RemoteProtocolError

Decoder = Callable[[bytes], object]


class HarnessSkip(Exception):
    """Raised by a target's harness for input it cannot hand to the decoder (counted as ``skipped``)."""


def reset_peak_rss() -> int | None:
    """Reset this process's peak RSS (VmHWM) to its current RSS, and return that (bytes); None where
    Linux's ``clear_refs`` is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return None


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    return int(m.group(1)) * 1024 if m else 0


try:
    import os as _os

    _PAGE = _os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):   # pragma: no cover
    _PAGE = 4096

_HUGE_INTS = (2**63 - 1, 2**64 - 1, -(2**63), 2**31, -(2**31) - 1, 2**53 + 1, 10**18, -1, 0, 1, 255, 65536)
_FLOATS = (math.inf, -math.inf, math.nan, 1e39, -1e39, 1e300, 5e-324, -0.0, 1.5, 2.0**64, -1.0)


def _like(v: Any, rng: random.Random) -> Any:
    """A hostile value of the same kind as *v* (a number stays a number, ...): what slips past a type check."""
    if isinstance(v, bool):
        return rng.choice((0, 1, None, not v))
    if isinstance(v, int):
        return rng.choice((*_HUGE_INTS, *_FLOATS, v + 1, v - 1, -v))
    if isinstance(v, float):
        return rng.choice((*_FLOATS, 2**63, 2**64 - 1, -1, 0))
    if isinstance(v, str):
        return rng.choice(("", v * rng.choice((2, 40, 1000)), v[:-1], v.upper(), "\x00" + v, "a" * 64, "0" * 64, "../" + v,
                               v + "\u00b2", "\u0663" + v))   # digits str.isdigit() accepts and int() refuses / reads
    if isinstance(v, bytes):
        return rng.choice((b"", v[:-1], v + b"\x00", v * 2, bytes(len(v))))
    if isinstance(v, list):
        return rng.choice(([], v[:-1], v + v, [*v, None], v * 200, [v]))
    if isinstance(v, dict):
        return rng.choice(({}, {**v, "extra": 1}, dict(list(v.items())[:-1]), [v]))
    return hostile_value(rng)


def _deep(n: int) -> Any:
    v: Any = 0
    for i in range(n):
        v = [v] if i % 2 else {"k": v}
    return v


def hostile_value(rng: random.Random) -> Any:
    """One value a hostile peer might put anywhere in a message."""
    k = rng.randrange(16)
    if k == 0:
        return rng.choice(_HUGE_INTS)
    if k == 1:
        return rng.choice(_FLOATS)
    if k == 2:
        return None
    if k == 3:
        return rng.choice((True, False))
    if k == 4:
        return rng.choice(("", "x" * rng.choice((1, 65, 257, 4097, 70_000)), "\u0000\udfff"[:1], "../../etc", "é" * 300))
    if k == 5:
        return rng.choice((b"", b"\x00" * rng.choice((1, 16, 32, 64, 65, 5000)), bytes(rng.randrange(256) for _ in range(40))))
    if k == 6:
        return []
    if k == 7:
        return {}
    if k == 8:
        return _deep(rng.choice((8, 60, 200, 400)))
    if k == 9:
        return [rng.choice((0, 1, 2**40, "a", 1.5, None))] * rng.choice((2, 100, 5000, 70_000))
    if k == 10:
        return {f"k{i}": i for i in range(rng.choice((1, 50, 3000)))}
    if k == 11:
        return [rng.choice(_HUGE_INTS) for _ in range(rng.randrange(1, 6))]
    if k == 12:
        return [rng.choice(_FLOATS) for _ in range(rng.randrange(1, 6))]
    if k == 13:
        return {1: 2, b"k": "v", None: []}
    if k == 14:
        return rng.randrange(-(2**20), 2**20)
    return rng.choice(("cpu", "cuda", "float32", "int64", "bool", "node", "bootstrap", "get", "offer", "hello", "a" * 64))


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_CONTAINER_START = frozenset((*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF))   # msgpack map / array first bytes
_MAX_DEPTH = 24   # the mutator walks no deeper (a hostile value may be deeper: it is a leaf to the walk)


def _expand(obj: Any, depth: int = 0) -> Any:
    """Decode nested msgpack inside bytes values, marked so that :func:`_collapse` packs them again."""
    if depth > _MAX_DEPTH:
        return obj
    if isinstance(obj, dict):
        return {k: _expand(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_expand(v, depth + 1) for v in obj]
    if isinstance(obj, bytes) and len(obj) > 1 and obj[0] in _CONTAINER_START:
        try:
            inner = _unpack(obj)
        except Exception:
            return obj
        return _Packed(_expand(inner, depth + 1))
    return obj


@dataclass
class _Packed:
    value: Any


def _collapse(obj: Any, depth: int = 0) -> Any:
    if depth > 2 * _MAX_DEPTH + 2:
        return obj
    if isinstance(obj, _Packed):
        return _pack(_collapse(obj.value, depth + 1))
    if isinstance(obj, dict):
        return {k: _collapse(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_collapse(v, depth + 1) for v in obj]
    return obj


def _tree_nodes(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    out = [(path, obj)]
    if len(path) > _MAX_DEPTH:
        return out
    if isinstance(obj, _Packed):
        out.extend(_tree_nodes(obj.value, (*path, _VALUE)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(_tree_nodes(v, (*path, k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.extend(_tree_nodes(v, (*path, i)))
    return out


_VALUE = object()   # path step into a _Packed


def _resolve(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj.value if p is _VALUE else obj[p]
    return obj


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = _resolve(obj, path[:-1])
    if path[-1] is _VALUE:
        parent.value = value
    else:
        parent[path[-1]] = value
    return obj


def mutate_structured(seed: bytes, rng: random.Random) -> bytes | None:
    """A structured mutation of *seed* (None if it is not msgpack)."""
    try:
        tree = _expand(_unpack(seed))
    except Exception:
        return None
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        nodes = _tree_nodes(tree)
        path, node = rng.choice(nodes)
        target = node.value if isinstance(node, _Packed) else node
        op = rng.randrange(8)
        if op <= 2 or not isinstance(target, dict | list):
            value = _like(target, rng) if rng.random() < 0.6 else hostile_value(rng)
            tree = _replace(tree, path, value)
        elif isinstance(target, dict):
            keys = list(target)
            if op == 3 and keys:
                del target[rng.choice(keys)]
            elif op == 4:
                target[rng.choice(("extra", "v", "t", "op", "type", "peer", "x" * 70))] = hostile_value(rng)
            elif op == 5 and keys:
                k = rng.choice(keys)
                target[rng.choice((1, b"k", None, f"{k}_"))] = target.pop(k)
            elif op == 6 and keys:
                k = rng.choice(keys)
                target[k] = [target[k]] if rng.random() < 0.5 else {"v": target[k]}
            else:
                tree = _replace(tree, path, hostile_value(rng))
        else:
            if op == 3 and target:
                del target[rng.randrange(len(target)):]
            elif op == 4 and target:
                target.extend([target[-1]] * rng.choice((1, 3, 500)))
            elif op == 5:
                target.append(hostile_value(rng))
            elif op == 6 and target:
                i = rng.randrange(len(target))
                target[i] = [target[i]]
            else:
                tree = _replace(tree, path, hostile_value(rng))
    try:
        return _pack(_collapse(tree))
    except Exception:
        return None


def mutate_bytes(seed: bytes, rng: random.Random, others: Sequence[bytes] = ()) -> bytes:
    """A byte-level mutation of *seed*."""
    b = bytearray(seed)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        n = len(b)
        op = rng.randrange(9)
        if op == 0 and n:
            i = rng.randrange(n)
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            i = rng.randrange(n)
            b[i] = rng.choice((0x00, 0xFF, 0x7F, 0x80, 0xC1, 0xCB, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF, 0xC4, 0xC6, rng.randrange(256)))
        elif op == 2:
            i = rng.randrange(n + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 3 and n:
            i = rng.randrange(n)
            del b[i : i + rng.randrange(1, 17)]
        elif op == 4 and n:
            del b[rng.randrange(n):]
        elif op == 5 and n:
            i = rng.randrange(n)
            j = min(n, i + rng.randrange(1, 33))
            b[i:i] = b[i:j] * rng.choice((1, 2, 16))
        elif op == 6 and n >= 4:
            i = rng.randrange(n - 3)
            b[i : i + 4] = rng.choice((b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\x00\x00", b"\x80\x00\x00\x00"))
        elif op == 7 and others:
            b += rng.choice(others)[: rng.randrange(1, 64)]
        else:
            b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    return bytes(b)


@dataclass
class FuzzReport:
    name: str
    cases: int = 0
    decoded: int = 0
    refused: int = 0
    skipped: int = 0              # input the harness could not hand to the decoder (HarnessSkip)
    seconds: float = 0.0
    slowest: float = 0.0
    peak_bytes: int = 0           # the largest tracemalloc peak of a sampled case
    peak_rss: int = 0             # the largest rise of peak resident memory over a sampled case
    failures: list[str] = field(default_factory=list)


def fuzz(name: str, decode: Decoder, seeds: Sequence[bytes], *, cases: int, seed: int = 0,
         case_timeout: float = 2.0, memory_bound: int = 64 << 20, memory_every: int = 50) -> FuzzReport:
    """Run *cases* mutated inputs through *decode*; the report lists every contract violation."""
    rng = random.Random(f"{name}/{seed}")
    rep = FuzzReport(name)
    # the seeds themselves must decode: otherwise the mutations start from refused bytes and reach nothing
    for s in seeds:
        decode(s)
    t_all = time.perf_counter()
    for i in range(cases):
        s = rng.choice(seeds)
        data = mutate_structured(s, rng) if rng.random() < 0.6 else None
        if data is None:
            data = mutate_bytes(s, rng, seeds)
        trace = i % memory_every == 0
        rss0 = None
        if trace:
            rss0 = reset_peak_rss()
            tracemalloc.start()
        t0 = time.perf_counter()
        try:
            decode(data)
            rep.decoded += 1
        except RemoteProtocolError:
            rep.refused += 1
        except HarnessSkip:
            rep.skipped += 1
        except Exception as exc:
            rep.failures.append(f"{type(exc).__name__}: {str(exc)[:200]} on {data[:300].hex()}")
        dt = time.perf_counter() - t0
        if trace:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            rep.peak_bytes = max(rep.peak_bytes, peak)
            if peak > memory_bound:
                rep.failures.append(f"peak of {peak} bytes on {data[:300].hex()}")
            if rss0 is not None:
                rise = peak_rss() - rss0
                rep.peak_rss = max(rep.peak_rss, rise)
                if rise > memory_bound:
                    rep.failures.append(f"peak resident memory rose {rise} bytes on {data[:300].hex()}")
        rep.slowest = max(rep.slowest, dt)
        if dt > case_timeout:
            rep.failures.append(f"took {dt:.1f} s on {data[:300].hex()}")
        rep.cases += 1
    rep.seconds = time.perf_counter() - t_all
    return rep
