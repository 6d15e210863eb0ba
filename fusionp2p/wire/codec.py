"""One generic codec between frozen dataclasses and strict msgpack maps.

``to_wire(obj)`` turns a dataclass into a map, in field order (so the bytes are canonical: the same
value always packs to the same bytes, which signatures and content hashes rely on);
``from_wire(cls, obj)`` builds one back from a peer's decoded map, and refuses anything else with
:class:`~fusionp2p.errors.RemoteProtocolError`:

* a key that is not a field (unknown) or a field that is absent (missing; a field declared
  ``optional`` may be absent and takes its default);
* a value of the wrong type (``bool`` is never a number; an int is accepted for a float);
* a value outside its limits: ints in ``[lo, hi]`` (default int64), floats finite and in
  ``[lo, hi]``, strings, bytes and lists at most ``max_len`` long (defaults below), ``choices``;
* and whatever the class's own ``__post_init__`` refuses (its ConfigError is the peer's fault here).

Limits live beside the fields, as plain metadata that needs no import from this package (so the
leaf module ``fusionp2p.types`` can declare them)::

    memory_bytes: int = field(metadata={"wire": {"lo": 1, "hi": 1 << 60}})
    period: float = field(default=0.0, metadata={"wire": {"name": "hb", "hi": 3600.0, "optional": True}})

Keys of ``"wire"``: ``name`` (the map key, default the field name), ``lo``/``hi``, ``finite``
(default True), ``min_len``/``max_len``, ``choices``, ``optional``, ``omit_default`` (implies
``optional``: the key is left out of the map while the value equals the default, so a field added
later leaves the bytes, hashes and signatures of every older value unchanged), ``type`` (the wire type when
the Python annotation is wider, e.g. ``LRSchedule | None`` for a field that also accepts a
shorthand string from users), and ``item`` (the same keys for the items of a ``tuple[T, ...]``).

Supported types: ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``X | None``, ``tuple[T, ...]``
and fixed ``tuple[A, B]`` (msgpack arrays), and nested dataclasses (maps). The formats that are
rows (lists) rather than maps keep their own code; docs/wire.md lists them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fusionp2p.wire.check import as_bool, as_bytes, as_float, as_int, as_list, as_map, as_str, malformed
from fusionp2p.wire.msg import packb, unpackb

T = TypeVar("T")

MAX_STR = 256           # default length of a string field
MAX_BYTES = 1 << 20     # default length of a bytes field
MAX_LIST = 4096         # default length of a tuple field


@dataclass(frozen=True, slots=True)
class _Field:
    attr: str                   # the dataclass attribute
    key: str                    # the map key
    tp: Any                     # the wire type
    bounds: Mapping[str, Any]
    required: bool              # absent from a map: refused (unless ``defaults_optional`` and it has a default)
    has_default: bool
    omit: bool = False          # left out of the map while equal to ``default``
    default: Any = None


_PLANS: dict[type, tuple[_Field, ...]] = {}


def _plan(cls: type) -> tuple[_Field, ...]:
    """The wire fields of *cls*, in order (computed once per class)."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _make_plan(cls)
    return plan


def _make_plan(cls: type) -> tuple[_Field, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        b = dict(f.metadata.get("wire", {}))
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        omit = bool(b.pop("omit_default", False))
        if omit and f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: omit_default needs a plain default")
        optional = bool(b.pop("optional", False)) or omit
        out.append(_Field(attr=f.name, key=b.pop("name", f.name), tp=b.pop("type", hints[f.name]), bounds=b,
                          required=not (optional and has_default), has_default=has_default, omit=omit,
                          default=f.default if omit else None))
    return tuple(out)


# ------------------------------------------------------------------------------------------ encode
def to_wire(obj: Any) -> dict[str, Any]:
    """The map of dataclass *obj* (field order; tuples as lists; nested dataclasses as maps)."""
    out: dict[str, Any] = {}
    for f in _plan(type(obj)):
        v = getattr(obj, f.attr)
        if f.omit and v == f.default:
            continue
        out[f.key] = _enc(v, f.tp)
    return out


def _enc(v: Any, tp: Any) -> Any:
    if v is None:
        return None
    if dataclasses.is_dataclass(v):
        return to_wire(v)
    if isinstance(v, tuple):
        args = typing.get_args(_strip_none(tp))
        if len(args) == 2 and args[1] is Ellipsis:
            return [_enc(x, args[0]) for x in v]
        return [_enc(x, a) for x, a in zip(v, args or (Any,) * len(v))]
    if isinstance(v, bool):
        return v
    base = _strip_none(tp)
    if base is float:
        return float(v)
    if base is int:
        return int(v)
    return v


def encode(obj: Any) -> bytes:
    """Canonical msgpack bytes of dataclass *obj*."""
    return packb(to_wire(obj))


# ------------------------------------------------------------------------------------------ decode
def from_wire(cls: type[T], obj: Any, what: str | None = None, *, defaults_optional: bool = False) -> T:
    """A *cls* built from a peer's decoded map; RemoteProtocolError on anything the module docstring lists.

    *defaults_optional*: every field with a default may be absent (small messages whose senders omit
    what they do not know, such as progress events)."""
    what = what or cls.__name__
    plan = _plan(cls)
    required = [f.key for f in plan if f.required and not (defaults_optional and f.has_default)]
    m = as_map(obj, what, required=required, optional=[f.key for f in plan if f.key not in required], max_len=len(plan))
    kwargs = {f.attr: _dec(m[f.key], f.tp, f.bounds, f"{what}.{f.key}", defaults_optional) for f in plan if f.key in m}
    with malformed(what):
        return cls(**kwargs)


def decode(cls: type[T], data: bytes | bytearray | memoryview, *, max_size: int, what: str | None = None) -> T:
    """Unpack *data* (at most *max_size* bytes) and :func:`from_wire` it."""
    return from_wire(cls, unpackb(data, max_size=max_size), what)


def _strip_none(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _dec(v: Any, tp: Any, b: Mapping[str, Any], what: str, partial: bool = False) -> Any:
    base = _strip_none(tp)
    if base is not tp and v is None:        # X | None
        return None
    if base is bool:
        return as_bool(v, what)
    if base is int:
        return as_int(v, what, lo=b.get("lo", -(2**63)), hi=b.get("hi", 2**63 - 1))
    if base is float:
        return as_float(v, what, lo=b.get("lo", -math.inf), hi=b.get("hi", math.inf), finite=b.get("finite", True))
    if base is str:
        return as_str(v, what, max_len=b.get("max_len", MAX_STR), min_len=b.get("min_len", 0), choices=b.get("choices"))
    if base is bytes:
        return as_bytes(v, what, max_len=b.get("max_len", MAX_BYTES), min_len=b.get("min_len", 0))
    if typing.get_origin(base) is tuple:
        args = typing.get_args(base)
        item = b.get("item", {})
        if len(args) == 2 and args[1] is Ellipsis:
            items = as_list(v, what, max_len=b.get("max_len", MAX_LIST), min_len=b.get("min_len", 0))
            return tuple(_dec(x, args[0], item, f"{what}[]", partial) for x in items)
        items = as_list(v, what, min_len=len(args), max_len=len(args))
        return tuple(_dec(x, a, item, f"{what}[{i}]", partial) for i, (x, a) in enumerate(zip(items, args)))
    if isinstance(base, type) and dataclasses.is_dataclass(base):
        return from_wire(base, v, what, defaults_optional=partial)
    raise TypeError(f"{what}: the codec does not handle {tp!r}")   # a declaration bug of ours, at the first use


__all__ = ["decode", "encode", "from_wire", "to_wire"]
