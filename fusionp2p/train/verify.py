"""Verified stages: spot-check recomputation of sampled micro-batches, and the evidence a mismatch makes.

Theory of operation. A stage's activations and gradients are finite, well-shaped and wrong when it lies
plausibly (a small bias on its activations, zeros for its backward); no bound on bytes catches that, a
recomputation does. Per micro-batch the stage signs a :class:`Claim`: digests of the parameters it says
it used (``params``, the stage's state at the step's start: it does not change within a step), of the
tensors it received (``inputs``, ``grad_outputs``), of those it sent (``outputs``, ``grad_inputs``), and of
the random state its forward drew dropout from. The claim binds the stage to everything a recomputation
needs; what its neighbours received is what the claim names (they hold it and can hash it).

Which micro-batches are checked must be unknown to the stage until its outputs are sent, or it would be
honest exactly there. The seed of step ``t`` is an Ed25519 signature over (job, epoch, step)
(:func:`challenge`): deterministic, so anyone can check the seed (:func:`challenge_ok`), and unpredictable
to everyone but its signer, who reveals it once the step's claims are out. The stage worker's checks
(``train/spot.py``) use the checker's own signature: the stage learns the seed when the checker asks, and
the checker cannot pick the micro-batches it pulls. Micro-batch ``m`` of replica ``r`` of stage ``s`` is checked when the hash of (seed,
s, r, m) falls below ``rate`` (:func:`sampled`).

A checker (another holder of the stage, or any node given the stage's program) takes the claimed
parameters and the micro-batch's transcript, checks both against the claim's digests (a bundle that
does not match is nobody's evidence: :class:`Unverifiable`), replays forward and backward with the same
random state (:func:`recompute`) and compares within a floating-point tolerance (:func:`mismatch`). A
mismatch is a :class:`Verdict`, signed by the checker, holding the stage's signed claim: evidence signed
by both parties, which any node verifies without the tensors (:meth:`Verdict.valid`) and the leader acts
on (``jobs/suspects.py``: the stage is excluded from the next plan). Since the recomputation is
deterministic, a verdict can be re-judged by whoever gets the bundle (:func:`arbitrate`): a checker that
frames an honest stage is named itself.

What the check proves, and not: that the stage's outputs are its program applied to the claimed
parameters and the received inputs. Not that the parameters are the ones honest training would have
(replicas' parameters are bounded by the robust averaging, ``average/robust.py``), nor anything about a
micro-batch that was not sampled: a stage lying on a fraction ``f`` of micro-batches, each checked with
probability ``p``, survives ``n`` of them with probability ``(1 - p*f)**n`` (:func:`p_catch`;
docs/security.md prices the rate).

Legend: ``named`` maps DAG names to tensors (a stage's boundary tensors or its state dict).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import blake3
import torch

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.graph.executor import StageExecutor
from fusionp2p.graph.program import StageProgram
from fusionp2p.net.identity import MAX_PEER_ID, verify
from fusionp2p.train.receipts import (
    Signer,
    Stamp,
    TensorDigests,
    decode_stamp,
    message_digest,
    tensor_bytes_digest,
)
from fusionp2p.types import short_peer
from fusionp2p.wire.check import as_bytes, as_int, as_list, as_str, malformed
from fusionp2p.wire.msg import packb, unpackb

_DOMAIN_SEED = b"fusionp2p/spot-seed/1"
_DOMAIN_CLAIM = b"fusionp2p/spot-claim/1"
_DOMAIN_VERDICT = b"fusionp2p/spot-verdict/1"
DIGEST = 32                 # bytes of every digest (BLAKE3: 2.1x SHA-256 with the CPU's SHA extensions, 4.6x blake2b)
MAX_REASON = 200            # characters of a verdict's reason
MAX_VERDICT = 4096          # bytes of an encoded verdict (a stamp adds at most ~700)


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyConfig:
    """How often micro-batches are recomputed, and how close a recomputation must come.

    ``rate``: the probability that any one micro-batch is checked (0: no checks). A tensor of ``n``
    elements matches when ``||claimed - recomputed|| <= atol * sqrt(n) + rtol * ||recomputed||``: the same
    program on the same kind of device is bit-exact; ``rtol`` leaves room for another device's kernels and
    a bf16 wire (which rounds each element by up to 2**-9 of it, a few thousandths of the norm)."""

    rate: float = 0.05
    rtol: float = 1e-2
    atol: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError(f"VerifyConfig.rate must be in [0, 1], got {self.rate}")
        if not (self.rtol >= 0.0 and self.atol >= 0.0 and math.isfinite(self.rtol) and math.isfinite(self.atol)):
            raise ConfigError("VerifyConfig.rtol and atol must be finite and >= 0")


def p_catch(p: float, f: float, n: int) -> float:
    """The probability that a stage lying on a fraction *f* of its micro-batches is caught within *n* of
    them when each is checked with probability *p* (independently): ``1 - (1 - p*f)**n``."""
    return 1.0 - (1.0 - p * f) ** n


# ------------------------------------------------------------------------------------------ sampling
def _seed_body(job: str, epoch: int, step: int) -> bytes:
    return _DOMAIN_SEED + packb([job, epoch, step])


def challenge(leader: Signer, job: str, epoch: int, step: int) -> bytes:
    """The seed of *step*'s sample: the leader's signature (Ed25519 is deterministic), revealed after
    the step's outputs are sent."""
    return leader.sign(_seed_body(job, epoch, step))


def challenge_ok(leader: str, job: str, epoch: int, step: int, seed: bytes) -> bool:
    """Whether *seed* is *leader*'s seed of *step* (so nobody else chose the sample)."""
    return verify(leader, _seed_body(job, epoch, step), seed)


def sampled(seed: bytes, stage: int, replica: int, micro: int, rate: float) -> bool:
    """Whether micro-batch *micro* of replica *replica* of *stage* is checked at the step of *seed*."""
    h = hashlib.blake2b(seed + packb([stage, replica, micro]), digest_size=8).digest()
    return int.from_bytes(h, "big") < rate * 2.0**64


class Unverifiable(ValueError):
    """The bundle given to a checker does not match the claim (parameters or tensors): no evidence
    against the stage (whoever supplied the bundle may be the one at fault)."""


# ------------------------------------------------------------------------------------------ digests
def digest(named: Mapping[str, torch.Tensor], memo: TensorDigests | None = None) -> bytes:
    """A digest of named tensors: names, dtypes, shapes and each one's bytes' digest (order-free; BLAKE3,
    one thread; *memo*: the node's digests of tensors its stamps already read)."""
    h = blake3.blake3()
    for name in sorted(named):
        t = named[name]
        h.update(packb([name, str(t.dtype), list(t.shape)]))
        h.update(memo.of(t) if memo is not None else tensor_bytes_digest(t))
    return h.digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Transcript:
    """One micro-batch of a stage as it crossed the wire: what it received and sent, the random state its
    forward started from (dropout) and the loss scale of its backward (loss stage)."""

    step: int
    micro: int
    inputs: Mapping[str, torch.Tensor]
    outputs: Mapping[str, torch.Tensor]
    rng: torch.Tensor                                      # torch.get_rng_state() before the forward
    grad_outputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    grad_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    loss_scale: float = 1.0

    def digests(self, memo: TensorDigests | None = None) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        return (digest(self.inputs, memo), digest(self.outputs, memo), digest(self.grad_outputs, memo),
                digest(self.grad_inputs, memo),
                digest({"rng": self.rng, "loss_scale": torch.tensor(self.loss_scale, dtype=torch.float64)}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """A stage replica's signed statement of one micro-batch (see the module docstring)."""

    job: str
    epoch: int
    stage: int
    replica: int
    peer: str                  # the stage replica's node (the signer)
    step: int
    micro: int
    params: bytes              # digest of the stage's state dict at the step's start
    transcript: tuple[bytes, bytes, bytes, bytes, bytes]   # Transcript.digests()
    signature: bytes = b""

    def body(self) -> bytes:
        return _DOMAIN_CLAIM + packb([self.job, self.epoch, self.stage, self.replica, self.peer, self.step,
                                      self.micro, self.params, list(self.transcript)])

    def valid(self) -> bool:
        return verify(self.peer, self.body(), self.signature)


def claim(me: Signer, *, job: str, epoch: int, stage: int, replica: int, params: bytes, t: Transcript,
          memo: TensorDigests | None = None) -> Claim:
    """*me*'s signed claim of transcript *t* computed with the state of digest *params* (*memo*: see
    :func:`digest`)."""
    c = Claim(job=job, epoch=epoch, stage=stage, replica=replica, peer=me.peer_id, step=t.step, micro=t.micro,
              params=params, transcript=t.digests(memo))
    return dataclasses.replace(c, signature=me.sign(c.body()))


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """A checker's signed finding that a claim's outputs are not its program's on its parameters and
    inputs: evidence signed by both parties."""

    claim: Claim
    checker: str
    reason: str
    # the boundary message the claim contradicts (train/receipts.py): signed by the stage for what it sent,
    # by its neighbour for what it was sent; None for a recomputation that disagrees
    stamp: Stamp | None = None
    signature: bytes = b""

    def body(self) -> bytes:
        return _DOMAIN_VERDICT + packb([self.claim.body(), self.claim.signature, self.checker, self.reason]
                                       + ([self.stamp.wire()] if self.stamp is not None else []))

    def valid(self) -> bool:
        """Both (with a stamp: all three) signatures hold, the checker is not the stage itself, and the stamp
        is of the claim's micro-batch, sent by or to its stage."""
        c, s = self.claim, self.stamp
        if s is not None and not ((s.job, s.epoch, s.step, s.micro) == (c.job, c.epoch, c.step, c.micro)
                                  and (s.signer == c.peer) != (s.dst == c.stage) and s.valid()):
            return False
        return self.checker != c.peer and c.valid() and verify(self.checker, self.body(), self.signature)


class Tap:
    """The transcripts of a stage's recent micro-batches, kept until their step's seed says which are
    checked (the stage's own record of what crossed the wire; its neighbours hold the same tensors).
    Steps before ``keep`` steps ago are forgotten."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._fwd: dict[tuple[int, int], Transcript] = {}

    def forward(self, step: int, micro: int, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                rng: torch.Tensor) -> None:
        for k in [k for k in self._fwd if k[0] <= step - self.keep]:
            del self._fwd[k]
        self._fwd[step, micro] = Transcript(step=step, micro=micro, inputs=dict(inputs), outputs=dict(outputs),
                                            rng=rng)

    def backward(self, step: int, micro: int, grad_outputs: Mapping[str, torch.Tensor],
                 grad_inputs: Mapping[str, torch.Tensor], loss_scale: float) -> None:
        t = self._fwd.get((step, micro))
        if t is not None:
            self._fwd[step, micro] = dataclasses.replace(t, grad_outputs=dict(grad_outputs),
                                                         grad_inputs=dict(grad_inputs), loss_scale=loss_scale)

    def take(self, step: int, micro: int) -> Transcript | None:
        return self._fwd.get((step, micro))

    def of(self, step: int) -> list[Transcript]:
        """*step*'s transcripts, by micro-batch."""
        return [t for (s, _), t in sorted(self._fwd.items(), key=lambda kv: kv[0]) if s == step]


# ------------------------------------------------------------------------------------------ checking
def recompute(program: StageProgram, state: Mapping[str, torch.Tensor], t: Transcript, *,
              executor: StageExecutor | None = None) -> Transcript:
    """*t* as an honest stage computes it: *program* on parameters and buffers *state*, from *t*'s inputs,
    random state and received gradients (forward, then backward when *t* has gradients). *executor*: a
    checker's own executor of *program* to load *state* into and reuse (building one costs more than a
    micro-batch of a small stage)."""
    if executor is None:
        ex = StageExecutor(dataclasses.replace(program, tensors={**program.tensors, **state}))
    else:
        ex = executor
        own = {**ex.parameters(), **ex.buffers()}
        if set(own) != set(state):
            raise Unverifiable("the state given does not name the stage's parameters and buffers")
        with torch.no_grad():
            for k, v in own.items():
                v.copy_(state[k])
        ex.zero_grad()
        for m in ex.in_flight:
            ex.drop(m)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(t.rng)
        outputs = ex.forward(t.micro, t.inputs)
    grad_inputs: dict[str, torch.Tensor] = {}
    if t.grad_outputs or t.grad_inputs:
        grad_inputs = ex.backward(t.micro, t.grad_outputs, loss_scale=t.loss_scale)
    else:
        ex.drop(t.micro)
    return dataclasses.replace(t, outputs=outputs, grad_inputs=grad_inputs)


def mismatch(claimed: Transcript, honest: Transcript, cfg: VerifyConfig) -> str:
    """Why *claimed*'s outputs and input gradients are not *honest*'s ('' when they match)."""
    for what, got, want in (("output", claimed.outputs, honest.outputs),
                            ("input gradient", claimed.grad_inputs, honest.grad_inputs)):
        if set(got) != set(want):
            return f"{what}s {sorted(got)} where the program makes {sorted(want)}"
        for name, w in want.items():
            g = got[name]
            if g.shape != w.shape:
                return f"{what} {name!r} has shape {tuple(g.shape)}, recomputed {tuple(w.shape)}"
            wf, gf = w.detach().double().cpu(), g.detach().double().cpu()
            err, scale = float(torch.linalg.vector_norm(gf - wf)), float(torch.linalg.vector_norm(wf))
            if not err <= cfg.atol * math.sqrt(wf.numel()) + cfg.rtol * scale:     # NaN fails too
                return f"{what} {name!r} differs by {err / max(scale, 1e-30):.3g} of its norm"
    return ""


def stamp_mismatch(c: Claim, t: Transcript, stamps: Sequence[Stamp]) -> tuple[str, Stamp | None]:
    """Why transcript *t* of claim *c* is not what its neighbours' *stamps* say crossed its links ('' when
    it is; train/receipts.py): a message the stage signed must be its claimed output (``act``) or input
    gradient (``grad``), a message signed to it its claimed input or received gradient. Stamps of another
    micro-batch, not valid, or of a compressed link are passed over, and so is a gradient summed from
    several receivers."""
    ok = [s for s in stamps if (s.job, s.epoch, s.step, s.micro) == (c.job, c.epoch, c.step, c.micro)
          and (s.signer == c.peer) != (s.dst == c.stage) and not s.coded and s.valid()]
    into = [(s.kind, s.name) for s in ok if s.dst == c.stage]
    for s in ok:
        out = s.signer == c.peer
        if not out and s.kind == "grad" and into.count((s.kind, s.name)) > 1:
            continue
        what = (("output", t.outputs) if s.kind == "act" else ("input gradient", t.grad_inputs)) if out else (
            ("input", t.inputs) if s.kind == "act" else ("output gradient", t.grad_outputs))
        got = what[1].get(s.name)
        link = f"to stage {s.dst}" if out else f"from {short_peer(s.signer)}"
        if got is None:
            return f"{'sent' if out else 'was sent'} {s.kind} {s.name!r} ({link}) that its claim has no {what[0]} of", s
        if message_digest(s.kind, s.name, {}, (got,)) != s.digest:
            return (f"{'sent' if out else 'was sent'} {s.kind} {s.name!r} ({link}) other than the {what[0]} it "
                    "claims"), s
    return "", None


def check(c: Claim, program: StageProgram, state: Mapping[str, torch.Tensor], t: Transcript, cfg: VerifyConfig,
          me: Signer, *, executor: StageExecutor | None = None, stamps: Sequence[Stamp] = ()) -> Verdict | None:
    """Recompute the micro-batch of claim *c* from its bundle (*state*, *t*) and compare its transcript
    with the neighbours' *stamps* of it (:func:`stamp_mismatch`): None when the stage's outputs hold, else
    *me*'s signed verdict. :class:`Unverifiable` when *c* is not signed by its stage or the bundle does not
    match its digests."""
    if not c.valid():
        raise Unverifiable("the claim is not signed by its stage")
    if digest(state) != c.params:
        raise Unverifiable("the parameters given are not those the stage claims")
    if t.digests() != c.transcript or (t.step, t.micro) != (c.step, c.micro):
        raise Unverifiable("the transcript given is not the one the stage claims")
    reason, stamp = stamp_mismatch(c, t, stamps)
    if not reason:
        reason = mismatch(t, recompute(program, state, t, executor=executor), cfg)
    if not reason:
        return None
    v = Verdict(claim=c, checker=me.peer_id, reason=f"step {c.step} micro {c.micro}: {reason}"[:MAX_REASON],
                stamp=stamp)
    return dataclasses.replace(v, signature=me.sign(v.body()))


def arbitrate(v: Verdict, program: StageProgram, state: Mapping[str, torch.Tensor], t: Transcript,
              cfg: VerifyConfig) -> str:
    """Re-judge verdict *v* from the bundle: the peer that lied (the stage when the recomputation
    disagrees with its claim, else the checker that framed it). :class:`Unverifiable` as for :func:`check`."""
    if not v.valid():
        raise Unverifiable("the verdict is not signed by both parties")
    c = v.claim
    if digest(state) != c.params or t.digests() != c.transcript:
        raise Unverifiable("the bundle is not the one the stage claims")
    if v.stamp is not None:
        return c.peer if stamp_mismatch(c, t, [v.stamp])[0] else v.checker
    return c.peer if mismatch(t, recompute(program, state, t), cfg) else v.checker


# ------------------------------------------------------------------------------------------ wire
def claim_wire(c: Claim) -> list[object]:
    return [c.job, c.epoch, c.stage, c.replica, c.peer, c.step, c.micro, c.params, list(c.transcript), c.signature]


def decode_claim(f: object, what: str = "spot-check claim") -> Claim:
    """A claim from its :func:`claim_wire` list (a peer's; signature unchecked); RemoteProtocolError."""
    with malformed(what):
        f = as_list(f, what, min_len=10, max_len=10)
        digests = as_list(f[8], f"{what} digests", min_len=5, max_len=5)
        return Claim(job=as_str(f[0], f"{what} job"), epoch=as_int(f[1], f"{what} epoch", lo=0),
                     stage=as_int(f[2], f"{what} stage", lo=0), replica=as_int(f[3], f"{what} replica", lo=0),
                     peer=as_str(f[4], f"{what} peer", max_len=MAX_PEER_ID), step=as_int(f[5], f"{what} step", lo=0),
                     micro=as_int(f[6], f"{what} micro", lo=0),
                     params=as_bytes(f[7], f"{what} params", min_len=DIGEST, max_len=DIGEST),
                     transcript=tuple(as_bytes(d, f"{what} digest", min_len=DIGEST, max_len=DIGEST)
                                      for d in digests),  # type: ignore[arg-type]
                     signature=as_bytes(f[9], f"{what} signature", max_len=64))


def encode_verdict(v: Verdict) -> bytes:
    return packb({"c": claim_wire(v.claim), "k": v.checker, "r": v.reason, "s": v.signature,
                  **({"t": v.stamp.wire()} if v.stamp else {})})


def decode_verdict(data: bytes) -> Verdict:
    """A verdict from a peer's bytes (signatures unchecked: :meth:`Verdict.valid`); RemoteProtocolError
    for anything malformed."""
    what = "spot-check verdict"
    m = unpackb(data, max_size=MAX_VERDICT)
    with malformed(what):
        if not isinstance(m, dict) or not {"c", "k", "r", "s"} <= set(m) <= {"c", "k", "r", "s", "t"}:
            raise RemoteProtocolError(f"{what}: expected the fields c, k, r, s (and t)")
        c = decode_claim(m["c"], f"{what} claim")
        return Verdict(claim=c, checker=as_str(m["k"], f"{what} checker", max_len=MAX_PEER_ID),
                       reason=as_str(m["r"], f"{what} reason", max_len=MAX_REASON),
                       stamp=decode_stamp(m["t"], f"{what} stamp") if "t" in m else None,
                       signature=as_bytes(m["s"], f"{what} signature", max_len=64))


__all__ = ["Claim", "claim_wire", "decode_claim", "Tap", "Transcript", "Unverifiable", "Verdict", "VerifyConfig", "arbitrate", "challenge",
           "challenge_ok", "check", "claim", "decode_verdict", "digest", "encode_verdict", "mismatch", "p_catch",
           "recompute", "sampled", "stamp_mismatch"]
