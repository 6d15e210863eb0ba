"""Activation recomputation through the job path (issue 37): four in-process nodes whose offer no layout
fits without recomputation. The job is planned with it, the stages over their node's offer recompute
(the others do not), it ends DONE, and its losses are bitwise those of the same job with every stage
recomputing: a stage's numbers do not depend on whether it recomputes."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import AcceptedJob, build_job, choose_plan, stage_programs
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.weights import stage_recompute
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.plan import InfeasiblePlanError
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.sdk import LOCAL_PROFILE, Swarm
from fusionp2p.train.config import TrainConfig
from tests.unit.test_recompute import smallest_offer

SEQ = 32
TIMEOUT = 300


def _smallest_offer(cfg: TrainConfig, peers: list[str]) -> int:
    """Just over the smallest offer with which four equal nodes get a plan (with recomputation)."""
    from fusionp2p.net.identity import Identity

    me = Identity.generate()
    torch.manual_seed(0)
    built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ)), None, BuiltinCorpus(seq_len=SEQ), cfg,
                      publisher=me.peer_id, sign=me.sign, now=1.0, nonce=b"q" * 16)
    return smallest_offer(built, peers)


@pytest.mark.slow
def test_a_job_that_fits_only_with_recomputation_trains_to_the_same_losses(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    torch.set_num_threads(1)
    caplog.set_level(logging.INFO, logger="fusionp2p.jobs.weights")
    cfg = TrainConfig(steps=3, micro_batch=8, micro_batches=8, lr=1e-3, replicas=1, averaging="none",
                      compression="none", schedule="1f1b", seed=1)
    offer = _smallest_offer(cfg, [f"n{i}" for i in range(4)])
    small = dataclasses.replace(LOCAL_PROFILE, memory_bytes=offer)
    losses = {}
    for mode in ("auto", "always"):
        c = dataclasses.replace(cfg, recompute=mode)
        with Swarm.local(n_nodes=4, home=tmp_path / mode, profiles=[small] * 4) as sw:
            torch.manual_seed(0)
            built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ)), None, BuiltinCorpus(seq_len=SEQ), c,
                              publisher=sw.publisher_id, sign=sw.sign, now=1.0, nonce=b"r" * 16)
            never = dataclasses.replace(built.spec, config=dataclasses.replace(c, recompute="never"))
            with pytest.raises(InfeasiblePlanError):
                choose_plan(never, built.dag, {f"n{i}": small for i in range(4)})   # nothing fits without it
            job = sw.publish_built(built)
            job.wait(timeout=TIMEOUT)
            assert job.state is JobState.DONE, job.error
            assert sw.embedded is not None
            runs = [n.jobs.jobs[built.spec.job_id] for n in sw.embedded.nodes]
            plan = next(r.plan for r in runs if r.plan is not None)
            assert plan is not None
            members = {p: small for st in plan.stages for p in st.replicas}
            snap = Snapshot(job=built.spec.job_id, epoch=plan.epoch, members=members, links={})
            acc = AcceptedJob(spec=built.spec, dag=built.dag, tokens=None)
            progs = stage_programs(built.dag, plan)
            chosen = [stage_recompute(acc, plan, snap, s, progs[s]) for s in range(len(plan.stages))]
            if mode == "auto":
                assert any(chosen) and not all(chosen)   # only the stages over their offer recompute
            else:
                assert all(chosen)
            losses[mode] = ([(st.start, st.end) for st in plan.stages], dict(job.losses))
    assert sum("(activation recomputation)" in r.getMessage() for r in caplog.records) >= 2
    assert losses["auto"][0] == losses["always"][0]      # the same plan: both were priced with recomputation
    assert len(losses["auto"][1]) == cfg.steps
    assert losses["auto"][1] == losses["always"][1]      # bitwise the same losses
