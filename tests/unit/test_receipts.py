"""Signed boundary messages (train/receipts.py): every act and grad carries its sender's stamp over what it
encoded, the receiver refuses one without a valid stamp, both ends keep the link's stamps, and a claim that
contradicts them is a verdict anyone re-judges (train/verify.py: stamp_mismatch, arbitrate)."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
import torch
import trio

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.identity import Identity
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train.receipts import (
    SIG,
    Stamp,
    StampBook,
    StampedChannel,
    TensorDigests,
    message_digest,
    tensor_bytes_digest,
)
from fusionp2p.train.verify import (
    Transcript,
    Verdict,
    VerifyConfig,
    arbitrate,
    claim,
    decode_verdict,
    digest,
    encode_verdict,
    stamp_mismatch,
)

A, B, C = (Identity(bytes([k]) * 32) for k in (1, 2, 3))   # stage 0, stage 1, a checker (another replica of 0)


def _plan() -> Plan:
    return Plan(job="j", epoch=0, snapshot_hash="h", algorithm="test", seed=0, n_units=2, micro_batches=1,
                stages=(Stage(start=0, end=1, replicas=tuple(sorted((A.peer_id, C.peer_id)))),
                        Stage(start=1, end=2, replicas=(B.peer_id,))),
                fences=(Fence(index=0, unit=1, dense_bytes=1.0, rho=1.0),))


def _msg(kind: str = "act", x: torch.Tensor | None = None, **kw: object) -> TensorMessage:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) if x is None else x
    return TensorMessage(job="j", kind=kind, stage=1 if kind == "act" else 0, step=5, micro=1, name="h",
                         tensors=(x,), **kw)  # type: ignore[arg-type]


def test_a_stamped_message_arrives_unchanged_and_both_ends_keep_its_stamp() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            a_raw, b_raw = memory_channel_pair(A.peer_id, B.peer_id)
            ba, bb = StampBook(), StampBook()
            a, b = StampedChannel(a_raw, A, epoch=0, book=ba), StampedChannel(b_raw, B, epoch=0, book=bb)
            sent = _msg()
            await a.send(sent)
            got = await b.receive()
            assert got.meta == {} and torch.equal(got.tensors[0], sent.tensors[0])   # the signature taken off
            await a.send(dataclasses.replace(sent, kind="eval"))                    # other kinds pass unstamped
            assert (await b.receive()).kind == "eval"
            coded = _msg(meta={"codec": "topk", "k": 3})
            await a.send(coded)
            assert (await b.receive()).meta == {"codec": "topk", "k": 3}
            (s1, s2), (r1, r2) = ba.of(B.peer_id, 5, 1), bb.of(A.peer_id, 5, 1)
            assert s1 == r1 and s2 == r2 and s1.valid() and s1.signer == A.peer_id and not s1.coded and s2.coded
            assert s1.digest == message_digest("act", "h", {}, sent.tensors)
            assert ba.of(C.peer_id, 5, 1) == [] and ba.of(B.peer_id, 5, 0) == []
            # the reply goes the other way, signed by B
            await b.send(_msg("grad"))
            await a.receive()
            assert [s.signer for s in ba.of(B.peer_id, 5, 1)] == [A.peer_id, A.peer_id, B.peer_id]
    trio.run(main)


@pytest.mark.parametrize("bad", ["unsigned", "tampered", "another signer", "garbage"])
def test_a_message_without_its_senders_stamp_is_a_protocol_error(bad: str) -> None:
    async def main() -> None:
        with trio.fail_after(10):
            a_raw, b_raw = memory_channel_pair(A.peer_id, B.peer_id)
            b = StampedChannel(b_raw, B, epoch=0, book=StampBook())
            msg = _msg()
            s = Stamp(job="j", epoch=0, kind="act", step=5, micro=1, name="h", dst=1, coded=False,
                      digest=message_digest("act", "h", {}, msg.tensors), signer=A.peer_id)
            sig = {"unsigned": None, "tampered": A.sign(s.body()), "another signer": C.sign(s.body()),
                   "garbage": "x"}[bad]
            if bad == "tampered":   # the signature of the honest tensor, with other bytes
                msg = dataclasses.replace(msg, tensors=(msg.tensors[0] + 1,))
            await a_raw.send(msg if sig is None else dataclasses.replace(msg, meta={SIG: sig}))
            with pytest.raises(RemoteProtocolError, match="stamp"):
                await b.receive()
    trio.run(main)


def test_a_node_digests_each_boundary_tensor_once_and_sees_in_place_changes() -> None:
    memo = TensorDigests(size=2)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert memo.of(x) == tensor_bytes_digest(x) and memo.of(x.detach()) == memo.of(x)    # a view of the same bytes
    assert message_digest("act", "h", {}, (x,), memo=memo) == message_digest("act", "h", {}, (x,))
    before = memo.of(x)
    x.add_(1)                                            # in place: its version counter moves
    assert memo.of(x) == tensor_bytes_digest(x) != before
    assert memo.of(x[:, :2]) == tensor_bytes_digest(x[:, :2].contiguous())              # a strided view
    for k in range(5):
        memo.of(torch.full((3,), float(k)))
    assert len(memo._memo) == 2                          # bounded


def test_the_book_forgets_old_steps() -> None:
    book = StampBook(keep=2)
    for step in range(4):
        book.add(B.peer_id, Stamp(job="j", epoch=0, kind="act", step=step, micro=0, name="h", dst=1, coded=False,
                                  digest=b"\0" * 32, signer=A.peer_id))
    assert [bool(book.of(B.peer_id, s, 0)) for s in range(4)] == [False, False, True, True]


def _stamp(who: Identity, kind: str, t: torch.Tensor, *, dst: int, micro: int = 0) -> Stamp:
    s = Stamp(job="j", epoch=0, kind=kind, step=0, micro=micro, name="h", dst=dst, coded=False,
              digest=message_digest(kind, "h", {}, (t,)), signer=who.peer_id)
    return dataclasses.replace(s, signature=who.sign(s.body()))


def test_a_claim_that_contradicts_the_stamps_is_evidence() -> None:
    honest, lie = torch.ones(2, 3), torch.ones(2, 3) * 1.05
    g_in = torch.full((2, 3), 0.5)
    t = Transcript(step=0, micro=0, inputs={"x": torch.zeros(2, 3)}, outputs={"h": honest},
                   rng=torch.zeros(1, dtype=torch.uint8), grad_outputs={"h": g_in}, grad_inputs={})
    c = claim(A, job="j", epoch=0, stage=0, replica=0, params=digest({}), t=t)
    # what crossed the links as the claim says: no reason
    assert stamp_mismatch(c, t, [_stamp(A, "act", honest, dst=1), _stamp(B, "grad", g_in, dst=0)]) == ("", None)
    # A sent the lie (its own stamp) and claims the honest output
    out = _stamp(A, "act", lie, dst=1)
    reason, s = stamp_mismatch(c, t, [out])
    assert s == out and "sent act 'h' (to stage 1) other than the output it claims" in reason
    # B sent A other gradients than A claims to have received
    into = _stamp(B, "grad", g_in * 0, dst=0)
    assert "was sent grad 'h'" in stamp_mismatch(c, t, [into])[0]
    # stamps of another micro-batch, not signed by their signer, of a compressed link, or of a link that is
    # not A's, are passed over
    passed = [_stamp(A, "act", lie, dst=1, micro=1), dataclasses.replace(out, signature=b"x" * 64),
              dataclasses.replace(out, coded=True, signature=A.sign(dataclasses.replace(out, coded=True).body())),
              _stamp(B, "act", lie, dst=2)]
    assert stamp_mismatch(c, t, passed) == ("", None)
    # the verdict carries the stamp: anyone verifies it, it travels, a bundle re-judges it
    v = Verdict(claim=c, checker=C.peer_id, reason=reason, stamp=out)
    v = dataclasses.replace(v, signature=C.sign(v.body()))
    assert v.valid() and decode_verdict(encode_verdict(v)) == v
    assert arbitrate(v, None, {}, t, VerifyConfig()) == A.peer_id     # type: ignore[arg-type]
    assert not dataclasses.replace(v, stamp=_stamp(A, "act", lie, dst=1, micro=1)).valid()   # another micro-batch
    s_ok = Suspects()
    assert s_ok.convict(v, _plan()) and s_ok.excluded == {A.peer_id}
    # a stamp signed by a node outside the plan is no evidence
    stranger = Identity(bytes([9]) * 32)
    fake = _stamp(stranger, "grad", g_in * 0, dst=0)
    vf = Verdict(claim=c, checker=C.peer_id, reason="r", stamp=fake)
    vf = dataclasses.replace(vf, signature=C.sign(vf.body()))
    assert vf.valid() and not Suspects().convict(vf, _plan())
    # a checker that attaches a stamp the transcript agrees with framed the stage
    framed = Verdict(claim=c, checker=C.peer_id, reason="r", stamp=_stamp(A, "act", honest, dst=1))
    framed = dataclasses.replace(framed, signature=C.sign(framed.body()))
    assert arbitrate(framed, None, {}, t, VerifyConfig()) == C.peer_id   # type: ignore[arg-type]


def test_malformed_stamps_in_verdicts_raise_remote_protocol_error() -> None:
    t = Transcript(step=0, micro=0, inputs={}, outputs={}, rng=torch.zeros(1, dtype=torch.uint8))
    c = claim(A, job="j", epoch=0, stage=0, replica=0, params=b"\0" * 32, t=t)
    good = encode_verdict(Verdict(claim=c, checker=C.peer_id, reason="r", signature=b"s" * 64,
                                  stamp=_stamp(A, "act", torch.ones(2), dst=1)))
    rnd = random.Random(4)
    for k in range(300):
        b = bytearray(good)
        for _ in range(1 + k % 4):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        with contextlib.suppress(RemoteProtocolError):    # decodes, or RemoteProtocolError, nothing else
            decode_verdict(bytes(b))
