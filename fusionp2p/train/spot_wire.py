"""The bytes of verified stages between nodes (``jobs/verified.py``): a step's claims, a micro-batch's stamps,
and the bundle a stage serves its checker.

Claims and stamps are small msgpack lists that ride in one JOB message; a bundle (the stage's state at the
step's start and the micro-batch's transcript) is as large as the stage, so it goes through the content store
(the checker fetches it by hash, bounded by the job's ``max_state_bytes``). A bundle is a safetensors file:
the state under ``state/``, the transcript's tensors under ``in/``, ``out/``, ``gout/``, ``gin/`` and ``rng``,
its step, micro-batch and loss scale in the metadata. Every decoder here is bounded and raises
:class:`~fusionp2p.errors.RemoteProtocolError` for anything malformed: what it returns is only as good as the
claim it is then checked against (``verify.check``: a bundle whose digests do not match is no evidence).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.train.receipts import Stamp, decode_stamp
from fusionp2p.train.spot import Bundle
from fusionp2p.train.verify import Claim, Transcript, claim_wire, decode_claim
from fusionp2p.wire.check import as_float, as_int, as_list, malformed
from fusionp2p.wire.msg import packb, unpackb

MAX_CLAIMS = 1024          # claims of one step (one a micro-batch; TrainConfig bounds micro_batches lower)
MAX_STAMPS = 256           # stamps of one micro-batch on one link (both directions, every boundary tensor)
MAX_LIST_BYTES = 1 << 20   # an encoded list of claims or stamps
MAX_TENSORS = 65536        # tensors in one bundle
_FORMAT = "fusionp2p/spot-bundle/1"
_PARTS = ("state/", "in/", "out/", "gout/", "gin/")
_RNG_BYTES = torch.get_rng_state().numel()   # the CPU generator's state (torch.set_rng_state refuses another size)


def encode_claims(claims: Sequence[Claim]) -> bytes:
    return packb([claim_wire(c) for c in claims])


def decode_claims(data: bytes) -> list[Claim]:
    """A step's claims from a peer (signatures unchecked: ``Claim.valid``); RemoteProtocolError."""
    raw = as_list(unpackb(data, max_size=MAX_LIST_BYTES), "spot-check claims", max_len=MAX_CLAIMS)
    return [decode_claim(f) for f in raw]


def encode_stamps(stamps: Sequence[Stamp]) -> bytes:
    return packb([s.wire() for s in stamps])


def decode_stamps(data: bytes) -> list[Stamp]:
    """A micro-batch's stamps from a neighbour (signatures unchecked: ``Stamp.valid``); RemoteProtocolError."""
    raw = as_list(unpackb(data, max_size=MAX_LIST_BYTES), "spot-check stamps", max_len=MAX_STAMPS)
    return [decode_stamp(f) for f in raw]


def encode_bundle(b: Bundle) -> bytes:
    state, t = b
    named = {**{f"state/{k}": v for k, v in state.items()}, **{f"in/{k}": v for k, v in t.inputs.items()},
             **{f"out/{k}": v for k, v in t.outputs.items()}, **{f"gout/{k}": v for k, v in t.grad_outputs.items()},
             **{f"gin/{k}": v for k, v in t.grad_inputs.items()}, "rng": t.rng}
    meta = {"format": _FORMAT, "step": str(t.step), "micro": str(t.micro), "loss_scale": repr(float(t.loss_scale))}
    return save_bytes({k: v.detach().cpu().contiguous() for k, v in named.items()}, metadata=meta)


def decode_bundle(data: bytes, *, max_size: int) -> Bundle:
    """A bundle from a peer's bytes, at most *max_size* of them; RemoteProtocolError for anything malformed."""
    what = "spot-check bundle"
    if len(data) > max_size:
        raise RemoteProtocolError(f"{what} of {len(data)} bytes exceeds {max_size}")
    try:
        n = int.from_bytes(data[:8], "little")
        if not 0 < n <= min(len(data) - 8, 16 << 20):
            raise ValueError("header size out of range")
        header = json.loads(data[8:8 + n])
        if not isinstance(header, dict) or len(header) > MAX_TENSORS + 1:
            raise ValueError("header is not a map of at most MAX_TENSORS tensors")
        tensors = load_bytes(data)
    except (SafetensorError, ValueError, OverflowError, RuntimeError) as exc:
        raise RemoteProtocolError(f"{what}: not a safetensors file: {str(exc)[:200]}") from None
    meta = header.get("__metadata__")
    with malformed(what):
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise RemoteProtocolError(f"{what}: metadata is not {_FORMAT}'s")
        step = as_int(_number(meta.get("step"), int), f"{what} step", lo=0, hi=2**31)
        micro = as_int(_number(meta.get("micro"), int), f"{what} micro", lo=0, hi=2**31)
        scale = as_float(_number(meta.get("loss_scale"), float), f"{what} loss scale", lo=0.0)
    parts: dict[str, dict[str, torch.Tensor]] = {p: {} for p in _PARTS}
    rng = tensors.pop("rng", None)
    if rng is None or rng.dtype != torch.uint8 or tuple(rng.shape) != (_RNG_BYTES,):
        raise RemoteProtocolError(f"{what}: its random state is not a generator's")
    for k, v in tensors.items():
        prefix = next((p for p in _PARTS if k.startswith(p)), None)
        if prefix is None or len(k) == len(prefix):
            raise RemoteProtocolError(f"{what}: unexpected tensor {k[:100]!r}")
        parts[prefix][k[len(prefix):]] = v
    t = Transcript(step=step, micro=micro, inputs=parts["in/"], outputs=parts["out/"], rng=rng,
                   grad_outputs=parts["gout/"], grad_inputs=parts["gin/"], loss_scale=scale)
    return parts["state/"], t


def _number(v: object, kind: type[int] | type[float]) -> int | float:
    if not isinstance(v, str) or len(v) > 32:
        raise RemoteProtocolError("spot-check bundle: a metadata number is not a short string")
    try:
        out = kind(v)
    except ValueError:
        raise RemoteProtocolError(f"spot-check bundle: {v!r} is not a number") from None
    if isinstance(out, float) and not math.isfinite(out):
        raise RemoteProtocolError("spot-check bundle: the loss scale is not finite")
    return out


__all__ = ["MAX_CLAIMS", "MAX_STAMPS", "decode_bundle", "decode_claims", "decode_stamps", "encode_bundle",
           "encode_claims", "encode_stamps"]
