"""msgpack encoding with bounds. The only msgpack entry points of the project.

Decoding never executes code, never creates objects other than dict/list/str/bytes/int/float/bool/None,
and raises RemoteProtocolError for anything malformed or over the limits.
"""

from __future__ import annotations

from typing import Any

import msgpack

from fusionp2p.errors import LocalProtocolError, RemoteProtocolError
from fusionp2p.wire.check import as_float
from fusionp2p.wire.limits import DEFAULT_LIMITS, Limits


def packb(obj: Any) -> bytes:
    """Encode *obj* canonically (bin type for bytes, no ext types)."""
    try:
        out: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode message: {exc}") from exc
    return out


def unpackb(data: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_LIMITS, max_size: int | None = None) -> Any:
    """Decode one msgpack object, rejecting trailing bytes and anything over the limits."""
    bound = limits.max_control_frame if max_size is None else max_size
    if len(data) > bound:
        raise RemoteProtocolError(f"message of {len(data)} bytes exceeds the limit of {bound}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,
            max_str_len=limits.max_str,
            max_bin_len=bound,
            max_array_len=limits.max_msgpack_items,
            max_map_len=limits.max_msgpack_items,
            max_ext_len=0,
        )
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # msgpack raises a few internal types; never let a peer crash us
        raise RemoteProtocolError(f"malformed message: {type(exc).__name__}") from exc


def expect_map(obj: Any, what: str) -> dict[str, Any]:
    """Check that a decoded message is a map with string keys."""
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise RemoteProtocolError(f"{what}: expected a map with string keys, got {type(obj).__name__}")
    return obj


def typed_field(m: dict[str, Any], name: str, typ: type | tuple[type, ...], what: str) -> Any:
    """Fetch a required field of a given type, or raise RemoteProtocolError naming it.

    ``float`` accepts ints (as floats) and refuses NaN and infinities; ``int`` and ``float`` refuse
    bools. Ranges and lengths are the caller's: see :mod:`fusionp2p.wire.check` for bounded reads.
    (Not called ``field``: that would shadow ``dataclasses.field`` in every module that has both.)"""
    if name not in m:
        raise RemoteProtocolError(f"{what}: missing field {name!r}")
    v = m[name]
    if typ is float:
        return as_float(v, f"{what}: field {name!r}")
    if not isinstance(v, typ) or (isinstance(v, bool) and typ in (int, float)):
        raise RemoteProtocolError(f"{what}: field {name!r} has type {type(v).__name__}")
    return v
