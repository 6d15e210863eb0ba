"""One replica of four lies in CO2 averaging, and one stage lies in its pipeline: held-out loss with the
defences on, and off.

Replicas. Four replicas of the GPT-2 reference of benchmarks.convergence (1 stage, ``R = 4``) train in one
process (one trio loop, each replica's local steps in a worker thread) and average with the product's
``ReplicaAverager`` over the in-memory channel pair (real wire encoding, the bf16 wire), streaming CO2
with ``CO2()``'s defaults (tau 4, one fragment per step, applied one step late). Each replica draws its own
micro-batch of 8 (``step * R + r``) a step from the pydoc corpus's first 90%; AdamW at ``LR`` (``--lr``: the
honest run's best at 40 steps; at convergence's 2e-3 the honest run is under-stepped and every lie that adds
movement lowered the loss); the held-out loss is taken on its last 10% with the consensus weights after
``finalize``. Replica 3 is a ``LyingAverager`` (``fusionp2p.testing.byzantine``) for each attack: ``scale``
(10x its update; ``--scale``), ``signflip``, ``noise`` (at its update's norm), ``stale`` (the average of 4
rounds before). Runs:

* ``honest`` (defence on) and ``honest-plain`` (defence off, the mean as before): the baselines, and the
  defence's cost on an honest run: wall seconds and process CPU seconds per step, robust over plain (two
  runs each); and the reduction alone (``reduce_cost``: one owned shard, robust against plain, over a
  replica's CPU seconds per step), the figure the machine's load moves least;
* per attack, defence on and off: the held-out loss, the step at which each honest replica dropped the liar
  from its averaging, and the rounds in which a majority of owners clipped it (``liar_clipped_rounds``).

Stages (``benchmarks.spot_check.stage_attacks``; ``--stage-steps 0``: none): the same GPT-2 cut in two
stages, one holder each, spot-checked by a second holder at ``--stage-rate``; stage 0 adds
``--stage-bias`` standard deviations to its activations (``bias``), or stage 1 sends zeros for its backward
(``zeros``), on ``--stage-lie-rate`` of its micro-batches: the step of conviction, and the held-out loss with
the checks on and off over the honest run's. A checked run, once the liar is convicted, goes back to its newest
checkpoint at or before the conviction (every ``--stage-checkpoint-every`` steps) and trains on to the same
step count with an honest holder, as a job's leader rolls back (``jobs/verified.py:rollback``).

Combined (``--combined-steps``, default the replica runs' steps; 0: none): the issue's job, a lying replica
and a lying stage in the same run. The same four replicas and averaging, each replica the GPT-2 reference cut
in two stages (``PipeReplica``: a ``LocalPipeline``, AdamW over both stages); replica r3 lies in the averaging
(``--combined-replica-attack``, default ``scale``) and replica r1's stage in its pipeline
(``--combined-stage-attack``: ``bias`` on stage 0, ``--stage-bias`` standard deviations, or ``zeros`` from
stage 1, on every micro-batch). Defences on: the robust reduction, and every stage replica spot-checked at
``--combined-rate``; a conviction rolls the job back to its newest checkpoint (``--stage-checkpoint-every``)
at or before the convicted step, as its leader does, replayed deterministically (``combined``). Runs: honest
(defences on), attacked with the defences on (and its replay from the roll-back), and off: the held-out loss
of replica r0 over the honest run's, the step the replica liar was dropped and the stage liar convicted, the
roll-back's step, and any honest replica convicted (none expected).

Headline: the worst, over the replica, stage and combined attacks, of the held-out loss with the defences on
over the honest run's (target <= 1.02). Beside it: the same ratio with the defences off (it should be visibly worse:
the attack is real), the step at which the liar was dropped or convicted, and the cost.

``python -m benchmarks.byzantine`` (``--quick``: 40 replica steps instead of 300, 30 stage steps instead of
200; ``--replicas-from results.json``: the stage runs only, the replica runs taken from an earlier run).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

from benchmarks._common import headline, parser, write
from benchmarks.convergence import SEQ, base_config, heldout_loss, make_model
from benchmarks.spot_check import CHECKPOINT_EVERY, stage_attacks
from fusionp2p.average.outer import OuterConfig
from fusionp2p.average.robust import RobustConfig, robust_mean
from fusionp2p.average.shard import weighted_mean
from fusionp2p.data import BatchSampler, SamplerConfig, corpus_tokens
from fusionp2p.graph import OpDAG, coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.executor import StageExecutor
from fusionp2p.graph.local import LocalPipeline
from fusionp2p.graph.program import StageProgram
from fusionp2p.graph.trace import load_into
from fusionp2p.net.channel import TensorChannel
from fusionp2p.net.identity import Identity
from fusionp2p.testing.byzantine import ATTACKS, SCALE, LyingAverager
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.testing.lying_stages import LyingStage
from fusionp2p.train.averager import AveragerConfig, load_anchor_, open_replica_averager
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.verify import VerifyConfig, challenge, check, claim, digest, sampled

R = 4
LIAR = R - 1
# the honest run's best learning rate at 40 steps (AdamW, cosine; the held-out loss of the honest run at 2e-3 /
# 6e-3 / 1.2e-2: 3.256 / 3.121 / 3.207). At benchmarks.convergence's 2e-3 the honest run is under-stepped in 40
# steps, so any lie that adds movement (a scaled update, noise, fewer replicas in the average) lowered the loss
LR = 6e-3
# the stage attacks (benchmarks.spot_check): checks at p = 0.05; each liar lies on every micro-batch (a stage
# that skips its backward saves all of it) and the bias is a whole standard deviation of its activations (at
# 5% on half the micro-batches GPT-2's held-out loss did not move: 0.999x)
STAGE_RATE, STAGE_LIE_RATE, STAGE_BIAS = 0.05, 1.0, 1.0
# the combined job: replica r3 lies in the averaging and replica r1's stage in its pipeline. One micro-batch a
# replica a step (two stages each) and 40 steps with --quick: at p = 0.05 a liar on every micro-batch goes
# unchecked for 20 steps on average, half the run; at 0.1, 10 (P(caught by step 40) = 0.985)
STAGE_LIAR, COMBINED_RATE = 1, 0.1


class Replica:
    def __init__(self, rank: int, cfg: TrainConfig, train: np.ndarray) -> None:
        self.rank, self.cfg, self.train = rank, cfg, train
        self.model = make_model("gpt2")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                     weight_decay=cfg.weight_decay)
        self.sampler = BatchSampler(SamplerConfig(num_tokens=len(train), seq_len=SEQ, micro_batch=cfg.micro_batch,
                                                  micro_batches=cfg.micro_batches, seed=cfg.seed))

    def step(self, step: int) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.lr_at(step)
        for mu in range(self.cfg.micro_batches):
            b = step * R + self.rank
            _, loss = self.model(torch.from_numpy(self.sampler.inputs(self.train, b, mu)),
                                 torch.from_numpy(self.sampler.targets(self.train, b, mu)))
            (loss / self.cfg.micro_batches).backward()
        self.opt.step()
        self.opt.zero_grad()


class UntilLiar(LyingStage):
    """A lying stage that lies only before step ``until`` (None: always): the replay of a roll-back."""

    until: int | None = None

    def _lies(self, micro: int) -> bool:
        return (self.until is None or self.step < self.until) and super()._lies(micro)


class PipeReplica:
    """A replica of the combined job: the GPT-2 reference cut in two stages (a ``LocalPipeline`` of
    ``LyingStage`` s; stage *stage* lies with *attack* when it is given), AdamW over both stages' parameters, and
    with *rate* > 0 every stage's micro-batches spot-checked as a checker does (``train/verify.py``: the state
    at the step's start, the stage's signed claim, a recomputation by the checker's own copy of the stage). A
    conviction ends the lie from the next step (an honest holder takes the stage over from its live state: the
    re-plan's resume when no checkpoint predates the lie, ``jobs/verified.py``); ``convicted_at``: its step.
    *until*: the liar lies only before that step (:func:`combined` replays a roll-back with it)."""

    def __init__(self, rank: int, cfg: TrainConfig, train: np.ndarray, programs: list[StageProgram], dag: OpDAG, *,
                 attack: str | None = None, stage: int = 0, rate: float = 0.0, bias: float = STAGE_BIAS,
                 until: int | None = None) -> None:
        self.rank, self.cfg, self.train, self.programs, self.dag = rank, cfg, train, programs, dag
        self.execs = [UntilLiar(p, attack=attack if s == stage else None, lie_rate=1.0, seed=rank, bias=bias)
                      for s, p in enumerate(programs)]
        for ex in self.execs:
            ex.until = until
        self.pipe = LocalPipeline(programs)
        self.pipe.executors = list(self.execs)
        self.params = self.pipe.all_parameters()   # tied copies too: each gets the summed gradient
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.sampler = BatchSampler(SamplerConfig(num_tokens=len(train), seq_len=SEQ, micro_batch=cfg.micro_batch,
                                                  micro_batches=cfg.micro_batches, seed=cfg.seed))
        self.vcfg = VerifyConfig(rate=rate)
        self.ids = [Identity(bytes([16 * rank + s + 1]) * 32) for s in range(len(programs))]
        self.checker = Identity(bytes([16 * rank + 15]) * 32)
        self.checking = [StageExecutor(p) for p in programs] if rate > 0 else []
        self.convicted_at: int | None = None
        self.checks = 0

    def step(self, step: int) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.lr_at(step)
        states = [{k: v.detach().clone() for k, v in ex.state_dict().items()} for ex in self.execs] if self.checking else []
        for ex in self.execs:
            ex.step = step
        b = step * R + self.rank
        batches = [dict(zip(self.dag.data_inputs, (torch.from_numpy(self.sampler.inputs(self.train, b, mu)),
                                                   torch.from_numpy(self.sampler.targets(self.train, b, mu)))))
                   for mu in range(self.cfg.micro_batches)]
        self.pipe.zero_grad()
        self.pipe.step(batches)
        self.opt.step()
        if not self.checking:
            return
        seed = challenge(self.checker, "combined", self.rank, step)
        for s, ex in enumerate(self.execs):
            for m in range(len(batches)):
                t = ex.tap.take(step, m)
                if t is None or not sampled(seed, s, 0, m, self.vcfg.rate):
                    continue
                c = claim(self.ids[s], job="combined", epoch=0, stage=s, replica=self.rank, params=digest(states[s]), t=t)
                self.checks += 1
                if check(c, self.programs[s], states[s], t, self.vcfg, self.checker, executor=self.checking[s]) is None:
                    continue
                if self.convicted_at is None:
                    self.convicted_at = step
                ex.attack = None   # convicted: an honest holder takes the stage over

    def module(self) -> torch.nn.Module:
        m = make_model("gpt2")
        load_into(m, self.dag, {k: v for ex in reversed(self.execs) for k, v in ex.state_dict().items()})
        return m


async def run(cfg: TrainConfig, train: np.ndarray, held: np.ndarray, *, attack: str | None, robust: bool,
              scale: float = SCALE, pipe: Callable[[int], PipeReplica] | None = None) -> dict[str, Any]:
    """One run of R replicas (*pipe*: rank -> the replica, the combined job's; else the 1-stage reference)."""
    co2 = CO2()
    outer = OuterConfig(tau=co2.tau, outer_lr=co2.outer_lr, outer_momentum=co2.outer_momentum, sync=co2.sync,
                        stream=co2.stream)
    peers = [f"r{i}" for i in range(R)]
    mesh: dict[str, dict[str, TensorChannel]] = {p: {} for p in peers}
    for i, a in enumerate(peers):
        for b in peers[i + 1:]:
            mesh[a][b], mesh[b][a] = memory_channel_pair(a, b, window=16)
    reps: list[Any] = [pipe(r) if pipe is not None else Replica(r, cfg, train) for r in range(R)]
    dropped_at: dict[str, int] = {}
    clipped: dict[str, int] = {}   # per honest replica: rounds in which a majority of owners clipped the liar
    clipped_all: dict[str, int] = {}
    honest_done = [trio.Event() for _ in range(LIAR)]

    async def one(rank: int) -> None:
        me, rep = peers[rank], reps[rank]
        params = list(rep.params) if pipe is not None else list(rep.model.parameters())
        acfg = AveragerConfig(outer=outer, job="bench", round_timeout=120.0, wire=co2.wire,
                              robust=RobustConfig() if robust else None)
        async with open_replica_averager(acfg, peers=peers, me=me, channels=mesh[me], initial=params,
                                         cls=LyingAverager) as avg:
            assert isinstance(avg, LyingAverager)
            avg.attack, avg.seed, avg.scale = (attack if rank == LIAR else None), rank, scale
            for s in range(cfg.steps):
                await trio.to_thread.run_sync(rep.step, s)
                res = await (avg.round_boundary(params) if s + 1 < cfg.steps else avg.finalize(params))
                if res is not None and res.anchor is not None:
                    load_anchor_(params, res.anchor, res.ranges)
                if avg.dropped_outliers and me not in dropped_at:
                    dropped_at[me] = s
            if avg.clips is not None:
                clipped[me] = avg.clips.clipped.get(peers[LIAR], 0)
                if rank == 0:   # an honest replica's count of every peer (an honest one clipped: a false alarm)
                    clipped_all.update(avg.clips.clipped)
        if rank < LIAR:
            honest_done[rank].set()

    t0, c0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as n:
        n.start_soon(one, LIAR)
        async with trio.open_nursery() as h:
            for r in range(LIAR):
                h.start_soon(one, r)
        n.cancel_scope.cancel()   # the liar, dropped by the others, would wait for them until its deadline
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finals = [torch.cat([p.detach().reshape(-1) for p in (reps[r].params if pipe is not None else
                                                          reps[r].model.parameters())]) for r in range(LIAR)]
    agree = max(float((f - finals[0]).abs().max()) for f in finals)
    extra = ({"stage_convicted_at_step": {peers[r]: rep.convicted_at for r, rep in enumerate(reps)
                                          if rep.convicted_at is not None},
              "stage_checks": sum(rep.checks for rep in reps)} if pipe is not None else {})
    model = reps[0].module() if pipe is not None else reps[0].model
    return {"attack": attack or "none", "robust": robust, "heldout_loss": heldout_loss(model, held, cfg), **extra,
            "honest_replicas_max_diff": agree, "dropped_liar_at_step": {p: dropped_at[p] for p in sorted(dropped_at)},
            "liar_clipped_rounds": {p: clipped[p] for p in sorted(clipped) if p != peers[LIAR]},
            "clipped_rounds_seen_by_r0": {p: clipped_all[p] for p in sorted(clipped_all)},
            "step_s": wall / cfg.steps, "cpu_step_s": cpu / cfg.steps}


def reduce_cost(n_elems: int, *, reps: int = 30) -> dict[str, float]:
    """Seconds of one shard's reduction, plain mean and robust (honest parts: the exact-mean path), for the
    shard a replica owns in one streaming round (``n_elems / tau / R`` floats): a cost figure that the load on
    a shared machine moves far less than it moves step times."""
    shard = n_elems // CO2().tau // R
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shard, generator=g)    # the last average: the test of direction runs too
    step = 0.05 * torch.randn(shard, generator=g)
    parts = [base + step + 0.1 * torch.randn(shard, generator=g) for _ in range(R)]

    def plain() -> torch.Tensor:
        return weighted_mean(parts, [1.0] * R)

    def robust() -> torch.Tensor:
        got = robust_mean(parts, [1.0] * R, RobustConfig(), reference=base)
        assert not got.clipped    # honest: the exact-mean path
        return got.mean

    out = {}
    for name, fn in (("plain", plain), ("robust", robust)):
        fn()
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        out[f"{name}_s"] = (time.process_time() - t0) / reps
    out["shard_elems"] = float(shard)
    return out


def replica_attacks(steps: int, lr: float, scale: float, attacks: list[str]) -> dict[str, Any]:
    """The replica runs of the module docstring: the honest baselines and the cost, and each attack on and off."""
    # one micro-batch of 8 a step per replica (benchmarks.convergence's step has 4): four replicas share the
    # process, and on the 2-core VM four of its steps took 3.4 s
    cfg = dataclasses.replace(base_config(steps), micro_batches=1, lr=lr)
    tokens = corpus_tokens("pydoc")
    cut = int(len(tokens) * 0.9)
    train, held = tokens[:cut], tokens[cut:]
    runs: list[dict[str, Any]] = []

    def go(attack: str | None, robust: bool) -> dict[str, Any]:
        out = trio.run(lambda: run(cfg, train, held, attack=attack, robust=robust, scale=scale))
        runs.append(out)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}, flush=True)
        return out

    # the cost pair first and last-in-first-out (plain, robust, robust, plain) so that a drift of the load
    # over the run falls on both sides alike
    plain = [go(None, False)]
    honest = [go(None, True), go(None, True)]
    plain.append(go(None, False))
    base = honest[0]["heldout_loss"]
    per: dict[str, Any] = {}
    for attack in attacks:
        on, off = go(attack, True), go(attack, False)
        per[attack] = {"defended_over_honest": on["heldout_loss"] / base, "undefended_over_honest": off["heldout_loss"] / base,
                       "dropped_liar_at_step": on["dropped_liar_at_step"],
                       "liar_clipped_rounds": on["liar_clipped_rounds"]}
    red = reduce_cost(sum(p.numel() for p in make_model("gpt2").parameters()))
    # each replica reduces one shard per step: the robust reduction's extra CPU over a replica's CPU per step
    cost_reduce = (red["robust_s"] - red["plain_s"]) / (sum(r["cpu_step_s"] for r in plain) / len(plain) / R)
    cost_wall = sum(r["step_s"] for r in honest) / sum(r["step_s"] for r in plain)
    cost_cpu = sum(r["cpu_step_s"] for r in honest) / sum(r["cpu_step_s"] for r in plain)
    return {"steps": steps, "replicas": R, "scale": scale, "lr": lr, "liar": f"r{LIAR}", "per_attack": per,
            "runs": runs, "honest_heldout": base, "honest_plain_heldout": [r["heldout_loss"] for r in plain],
            "cost_step_wall_robust_over_plain": cost_wall, "cost_step_cpu_robust_over_plain": cost_cpu,
            "reduce": red, "cost_reduce_over_replica_step_cpu": cost_reduce}


def combined(steps: int, lr: float, scale: float, *, replica_attack: str, stage_attack: str, rate: float,
             bias: float, checkpoint_every: int = CHECKPOINT_EVERY) -> dict[str, Any]:
    """The combined job of the module docstring: the honest run (defences on), and the attacked run with the
    defences on and off. A conviction in the defended run rolls the job back, as its leader does, to the newest
    checkpoint (every *checkpoint_every* steps) at or before the convicted step, and the job trains on from
    there to the same step count: run here as a replay (``defended-replay``) in which the stage lies only before
    that checkpoint's step. The runs are deterministic (the honest run repeats to the bit), so the replay holds
    at the checkpoint's step exactly the state the defended run checkpointed there, lies before it included."""
    cfg = dataclasses.replace(base_config(steps), micro_batches=1, lr=lr)
    tokens = corpus_tokens("pydoc")
    cut = int(len(tokens) * 0.9)
    train, held = tokens[:cut], tokens[cut:]
    sampler = BatchSampler(SamplerConfig(num_tokens=len(train), seq_len=SEQ, micro_batch=cfg.micro_batch,
                                         micro_batches=1, seed=cfg.seed))
    dag = trace(make_model("gpt2"), (torch.from_numpy(sampler.inputs(train, 0, 0)),
                                     torch.from_numpy(sampler.targets(train, 0, 0))), count_flops=False)
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), [len(coarse.units) // 2]))
    stage = 0 if stage_attack.startswith("bias") else 1   # the loss stage sends no activations to bias
    runs: dict[str, dict[str, Any]] = {}

    def go(name: str, attacked: bool, defended: bool, until: int | None = None) -> dict[str, Any]:
        def make(rank: int) -> PipeReplica:
            return PipeReplica(rank, cfg, train, programs, dag, rate=rate if defended else 0.0, bias=bias,
                               attack=stage_attack if attacked and rank == STAGE_LIAR else None, stage=stage,
                               until=until)
        c0 = time.process_time()
        out = trio.run(lambda: run(cfg, train, held, attack=replica_attack if attacked else None, robust=defended,
                                   scale=scale, pipe=make))
        out = {"run": name, **out, "cpu_s": time.process_time() - c0}
        runs[name] = out
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}, flush=True)
        return out

    honest, on, off = go("honest", False, True), go("attacked-defended", True, True), go("attacked-undefended", True, False)
    convicted = on["stage_convicted_at_step"].get(f"r{STAGE_LIAR}")
    back = None
    if convicted is not None and checkpoint_every > 0:
        back = convicted // checkpoint_every * checkpoint_every
        on = go("attacked-defended-replay", True, True, until=back)
    base = honest["heldout_loss"]
    return {"steps": steps, "replicas": R, "stages": len(programs), "replica_liar": f"r{LIAR}",
            "replica_attack": replica_attack, "stage_liar": f"r{STAGE_LIAR} stage {stage}", "stage_attack": stage_attack,
            "rate": rate, "bias": bias, "honest_heldout": base,
            "defended_over_honest": on["heldout_loss"] / base, "undefended_over_honest": off["heldout_loss"] / base,
            "replica_liar_dropped_at_step": on["dropped_liar_at_step"],
            "stage_liar_convicted_at_step": convicted, "rolled_back_to": back, "checkpoint_every": checkpoint_every,
            "honest_false_convictions": honest["stage_convicted_at_step"], "runs": list(runs.values())}


def main() -> None:
    ap = parser("byzantine", __doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="the replica attacks ('': none)")
    ap.add_argument("--scale", type=float, default=SCALE, help="the factor of the scale attack")
    ap.add_argument("--lr", type=float, default=LR, help="the replicas' AdamW learning rate (peak of the cosine)")
    ap.add_argument("--stage-steps", type=int, default=None,
                    help="steps of the stage runs (default: 30 with --quick, else 200; 0: no stage runs)")
    ap.add_argument("--stage-rate", type=float, default=STAGE_RATE, help="the spot checks' sampling rate p")
    ap.add_argument("--stage-lie-rate", type=float, default=STAGE_LIE_RATE,
                    help="the fraction of its micro-batches a lying stage lies on")
    ap.add_argument("--stage-bias", type=float, default=STAGE_BIAS,
                    help="the bias attack's strength, in its activations' standard deviations")
    ap.add_argument("--stage-checkpoint-every", type=int, default=CHECKPOINT_EVERY,
                    help="the stage runs' checkpoint cadence: a conviction rolls back to the newest checkpoint at or "
                         "before it, as a job's leader does (0: no roll-back)")
    ap.add_argument("--replicas-from", type=Path, default=None,
                    help="a results JSON of this benchmark: its replica runs are taken (marked with where they came "
                         "from) instead of run again")
    ap.add_argument("--combined-steps", type=int, default=None,
                    help="steps of the combined job (a lying replica and a lying stage in one run; default: the "
                         "replica runs' steps; 0: none)")
    ap.add_argument("--combined-replica-attack", default="scale", choices=ATTACKS)
    ap.add_argument("--combined-stage-attack", default="bias", choices=("bias", "zeros"))
    ap.add_argument("--combined-rate", type=float, default=COMBINED_RATE, help="the combined job's spot-check rate")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps = 40 if args.quick else args.steps
    if args.replicas_from is not None:
        doc = json.loads(args.replicas_from.read_text())
        results = {**doc["results"], "replicas_from": f"{args.replicas_from} ({doc.get('time', '?')})"}
        results.pop("stages", None)
    else:
        results = replica_attacks(steps, args.lr, args.scale, [a for a in args.attacks.split(",") if a])
    stage_steps = (30 if args.quick else 200) if args.stage_steps is None else args.stage_steps
    if stage_steps:
        results["stages"] = stage_attacks(stage_steps, rate=args.stage_rate, lie_rate=args.stage_lie_rate,
                                          bias=args.stage_bias, checkpoint_every=args.stage_checkpoint_every)
    combined_steps = steps if args.combined_steps is None else args.combined_steps
    if combined_steps:
        results["combined"] = combined(combined_steps, args.lr, args.scale, replica_attack=args.combined_replica_attack,
                                       stage_attack=args.combined_stage_attack, rate=args.combined_rate,
                                       bias=args.stage_bias, checkpoint_every=args.stage_checkpoint_every)
    print({k: v for k, v in results.items() if k != "runs"})
    ratios = [v["defended_over_honest"] for v in results["per_attack"].values()]
    ratios += [results["combined"]["defended_over_honest"]] if "combined" in results else []
    ratios += [v["checked_over_honest"] for v in results.get("stages", {}).get("per_attack", {}).values()]
    write("byzantine", args.out, results,
          headline("attacked (defended) over honest held-out loss, worst attack", max(ratios, default=1.0), "x",
                   1.02, "lower", "honest run with the defences on, same process"), quick=args.quick)


if __name__ == "__main__":
    main()
