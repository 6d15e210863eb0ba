"""The generic codec between frozen dataclasses and strict msgpack maps (wire/codec.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.wire import codec
from fusionp2p.wire.msg import unpackb


@dataclass(frozen=True, slots=True, kw_only=True)
class Inner:
    n: int = field(metadata={"wire": {"lo": 0, "hi": 10}})
    tag: str = "x"


@dataclass(frozen=True, slots=True, kw_only=True)
class Outer:
    name: str = field(metadata={"wire": {"max_len": 8}})
    rate: float = field(metadata={"wire": {"lo": 0.0}})
    inner: Inner
    pair: tuple[float, float] = (0.5, 1.5)
    peers: tuple[str, ...] = field(default=(), metadata={"wire": {"max_len": 3, "item": {"max_len": 4}}})
    blob: bytes | None = None
    period: float = field(default=0.0, metadata={"wire": {"name": "hb", "optional": True}})
    loss: float | None = field(default=None, metadata={"wire": {"finite": False}})

    def __post_init__(self) -> None:
        if self.name == "bad":
            raise ConfigError("name must not be bad")


VALUE = Outer(name="a", rate=2.0, inner=Inner(n=3), peers=("p1", "p2"), blob=b"\x00\x01", period=1.0)


def test_round_trip_in_field_order_with_renamed_keys() -> None:
    m = codec.to_wire(VALUE)
    assert list(m) == ["name", "rate", "inner", "pair", "peers", "blob", "hb", "loss"]
    assert m["inner"] == {"n": 3, "tag": "x"} and m["pair"] == [0.5, 1.5] and m["peers"] == ["p1", "p2"]
    assert codec.from_wire(Outer, m) == VALUE
    assert codec.decode(Outer, codec.encode(VALUE), max_size=1024) == VALUE
    assert unpackb(codec.encode(VALUE)) == m


def _bad(**over: object) -> dict[str, object]:
    return {**codec.to_wire(VALUE), **over}


@pytest.mark.parametrize(("m", "match"), [
    ({**codec.to_wire(VALUE), "extra": 1}, "unknown"),
    ({k: v for k, v in codec.to_wire(VALUE).items() if k != "rate"}, "missing"),
    (_bad(name="x" * 9), "length"),
    (_bad(rate=-1.0), "outside"),
    (_bad(rate=math.inf), "infinity"),
    (_bad(rate=True), "number"),
    (_bad(inner={"n": 11, "tag": "x"}), "outside"),
    (_bad(inner={"n": 1.0, "tag": "x"}), "integer"),
    (_bad(inner=[3, "x"]), "map"),
    (_bad(pair=[1.0]), "list"),
    (_bad(peers=["a", "b", "c", "d"]), "list"),
    (_bad(peers=["toolong"]), "length"),
    (_bad(blob="text"), "bytes"),
    (_bad(name="bad"), "must not be bad"),
    ([1, 2], "map"),
])
def test_refusals(m: object, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        codec.from_wire(Outer, m)


def test_optional_fields_and_nan_where_allowed() -> None:
    m = {k: v for k, v in codec.to_wire(VALUE).items() if k != "hb"}
    assert codec.from_wire(Outer, m).period == 0.0          # "optional": older senders leave it out
    assert math.isnan(codec.from_wire(Outer, _bad(loss=math.nan)).loss)  # type: ignore[arg-type]
    partial = {"name": "a", "rate": 1.0, "inner": {"n": 1}}
    with pytest.raises(RemoteProtocolError, match="missing"):
        codec.from_wire(Outer, partial)
    assert codec.from_wire(Outer, partial, defaults_optional=True).inner == Inner(n=1)
