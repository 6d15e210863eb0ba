"""A shadow copy's bytes over the encrypted TCP data plane (jobs/shadow.py's send path).

Why: a keeper used to fetch each copy with the content protocol, over a libp2p stream (Noise and yamux in
Python): 12.8-15.1 s for a middle stage's copy at 16-23 MB/s against a 5 s step, and py-spy put about 28% of
that node's CPU in it (benchmarks/model_scale.py, 4 CLI nodes). The data plane's channels (``net/bulk.py``:
AES-GCM records sealed and opened by OS threads, the activations' path) move the same bytes at a small part
of that CPU.

How. The holder names a link in its ``keep`` request (``link``, ``size``) and pushes the stage file over a
:func:`~fusionp2p.net.resilient.open_resilient_channel` of that name, :data:`CHUNK` bytes a message, read
from its content store's file a chunk at a time (never whole in memory); the keeper claims the channel
(``NodeJobService.claim``: a member of the job, this epoch), writes each chunk to a temporary file as it
comes, hashes it, and adopts the file under the announced hash only if every byte matches. A window of
:data:`WINDOW` messages bounds what either side holds (a few MiB, whatever the stage's size). Anything a
peer sends out of shape (another kind, dtype or rank, more bytes than announced, bytes that do not hash to
the name) is a :class:`~fusionp2p.errors.RemoteProtocolError`; a link that fails or stalls leaves the
keeper to fetch the copy the old way (the holder still serves it), so a node of the previous version, or
one whose data-plane port cannot be reached, still keeps copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import trio

from fusionp2p.errors import IntegrityError, RemoteProtocolError
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.resilient import open_resilient_channel

if TYPE_CHECKING:
    from fusionp2p.jobs.host import JobHost

log = logging.getLogger(__name__)

CHUNK = 1 << 20     # bytes a message: large enough for the data plane's threads, small beside any stage
WINDOW = 4          # messages in flight on a copy's link: what the keeper may hold unwritten, and the holder unacked
KIND = "shadow"     # the one message kind of a copy's link
STALL = 30.0        # seconds the keeper waits for the link, and for each message on it, before it fetches instead


def link_name(epoch: int, stage: int, step: int) -> str:
    """The channel name of the copy of *stage* at *step* (``e<epoch>/...``: the router's epoch check)."""
    return f"e{epoch}/shadow{stage}@{step}"


async def send_copy(svc: JobHost, job: str, keeper: str, name: str, h: str) -> int:
    """Push blob *h* of the content store to *keeper* on the link *name*; the bytes sent. Raises
    PeerUnavailable when the link fails (the keeper then fetches the copy over the content protocol)."""
    cfg = dataclasses.replace(svc.config.channels(), window=WINDOW, copy_on_send=False)
    sent = 0
    async with open_resilient_channel(svc.data_plane, keeper, name=f"{job}/{name}", config=cfg,
                                      peer_gone=svc.peer_gone) as ch:
        with svc.content.store.reader(h) as f:
            while part := await trio.to_thread.run_sync(f.read, CHUNK):
                # a fresh buffer a message: a sent tensor is kept by reference until the keeper acks it
                t = torch.frombuffer(bytearray(part), dtype=torch.uint8)
                await ch.send(TensorMessage(job=job, kind=KIND, step=sent // CHUNK, tensors=(t,)))
                sent += len(part)
    return sent


async def receive_copy(svc: JobHost, job: str, holder: str, name: str, h: str, size: int, *,
                       alive: Callable[[str], bool]) -> None:
    """Take the copy *h* (*size* bytes) that *holder* pushes on the link *name* into the content store,
    checked byte for byte against its hash before it is adopted. RemoteProtocolError for bytes out of
    shape, IntegrityError for bytes that do not match; PeerUnavailable when the link fails."""
    store = svc.content.store
    if store.has(h):
        return
    with trio.fail_after(STALL):
        ch = await svc.claim(job, name, holder, alive=alive)
    digest = hashlib.sha256()
    got = 0
    tmp = store.temp_path() if store.on_disk else None
    mem = bytearray()
    try:
        with open(tmp, "wb") if tmp is not None else contextlib.nullcontext() as f:  # noqa: ASYNC230 - chunk-sized writes
            while got < size:
                with trio.fail_after(STALL):
                    msg = await ch.receive()
                t = msg.tensors[0] if len(msg.tensors) == 1 else None
                if msg.kind != KIND or msg.step != got // CHUNK or got % CHUNK or t is None or t.dtype != torch.uint8 or t.dim() != 1:
                    raise RemoteProtocolError(f"shadow copy from {holder[:16]}: a message out of shape")
                if got + t.numel() > size or t.numel() > CHUNK:
                    raise RemoteProtocolError(f"shadow copy from {holder[:16]}: more than the {size} bytes announced")
                view = memoryview(t.contiguous().numpy().data).cast("B")
                digest.update(view)
                if f is not None:
                    f.write(view)
                else:
                    mem += view
                got += t.numel()
        if digest.hexdigest() != h:
            raise IntegrityError(f"shadow copy from {holder[:16]} does not match {h[:16]}…")
        if tmp is not None:
            store.adopt((tmp, h))
            tmp = None
        else:
            store.put_verified(h, mem)
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        with trio.CancelScope(shield=True):
            await ch.aclose()


__all__ = ["CHUNK", "WINDOW", "link_name", "receive_copy", "send_copy"]
