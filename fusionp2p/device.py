"""The one place where training tensors cross between a stage's device and the host.

A stage computes on one device (``cpu``, ``cuda:N``; ``meta`` in tests). Everything that comes from a
peer arrives as host tensors (``wire/tensor.py`` decodes into host memory) and everything that goes to a
peer leaves as host bytes, so every boundary of a stage is one of these calls:

* :func:`to_device` — a received tensor onto the stage's device (CUDA: staged through pinned memory
  and copied ``non_blocking``, so the copy is queued on the stream before the kernels that read it);
* :func:`to_host` — tensors to send, back to host memory (CUDA: into pinned buffers, ``non_blocking``,
  then one stream synchronisation for the lot instead of one blocking ``.cpu()`` per tensor). The
  caller runs it in a worker thread (``trio.to_thread``), never on the event loop;
* :func:`check` — a tensor that must already be on the stage's device (a parameter's gradient, a
  mask, a tied copy): raises :class:`DeviceMismatch` otherwise. It is what makes a mix-up visible on a
  machine without a GPU: the tests run stages on the ``meta`` device, whose tensors hold no data and
  refuse to mix with host tensors in most kernels, as CUDA tensors do (in-place adds of a host tensor
  into a meta one are let through by torch, which is why sums check their parts here explicitly);
* :func:`sync` — wait for the device's queued work, so that a timing measures kernels, not launches.

Meta tensors hold no values: their host copy is zeros of the right shape and dtype (tests only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionp2p.errors import FusionError


class DeviceMismatch(FusionError, RuntimeError):
    """A tensor reached a stage on another device than the stage's: a bug here, never a peer's fault."""


def resolve(device: str | torch.device) -> torch.device:
    """*device* with the index CUDA would use made explicit (``cuda`` -> ``cuda:0``), so that it
    compares equal to the ``.device`` of the tensors created on it."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return dev


def same(a: torch.device, b: torch.device) -> bool:
    """Whether tensors on *a* and *b* may meet in one kernel (a missing CUDA index reads as 0)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def check(t: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """*t* itself when it is on *device*; :class:`DeviceMismatch` naming *what* otherwise."""
    if not same(t.device, device):
        raise DeviceMismatch(f"{what} is on {t.device}, but the stage computes on {device}")
    return t


def to_device(t: torch.Tensor, device: torch.device, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """*t* on *device* (and in *dtype* when given); *t* itself when nothing changes. A host tensor bound
    for CUDA is staged through pinned memory and copied without blocking the host thread."""
    dtype = t.dtype if dtype is None else dtype
    if same(t.device, device):
        return t if t.dtype == dtype else t.to(dtype)
    if device.type == "cuda" and t.device.type == "cpu":
        src = t if t.is_pinned() else t.pin_memory()
        return src.to(device, dtype=dtype, non_blocking=True)
    return t.to(device, dtype=dtype)


def to_host(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """*tensors* in host memory (host tensors pass as they are). Blocking: run it in a worker thread.
    CUDA tensors are copied into pinned buffers without blocking, then the streams are waited for once."""
    out: list[torch.Tensor] = []
    streams: dict[torch.device, torch.cuda.Stream] = {}
    for t in tensors:
        t = t.detach()
        if t.device.type == "cpu":
            out.append(t)
        elif t.device.type == "meta":   # no data (tests): zeros of its shape
            out.append(torch.zeros(t.shape, dtype=t.dtype))
        elif t.device.type == "cuda":
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            streams.setdefault(t.device, torch.cuda.current_stream(t.device))
            out.append(buf)
        else:
            out.append(t.cpu())
    for s in streams.values():
        s.synchronize()   # the pinned buffers are read (encoded) right after
    return tuple(out)


def sync(device: torch.device) -> None:
    """Wait for the work queued on *device* (CUDA); nothing on the host, whose ops finish when they return."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["DeviceMismatch", "check", "resolve", "same", "sync", "to_device", "to_host"]
