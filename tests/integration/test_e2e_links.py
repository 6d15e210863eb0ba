"""``Swarm.local(links=...)``: two emulated sites on one machine. The nodes measure the slow links with
their probes, the planner compresses the fence that crosses them, and ``compression="adatopk"``
trains differently from ``"none"`` (the same job otherwise)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.events import PlanChanged
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import LOCAL_PROFILE, Swarm, sites
from fusionp2p.train.config import CO2, AdaTopK, TrainConfig

SEQ = 32
SLOW = 2e6          # bytes/s between the sites (16 Mbit/s)
TIMEOUT = 240


def _model() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config.tiny(block_size=SEQ))


def test_slow_links_are_measured_planned_and_compressed(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    base = {"steps": 6, "micro_batch": 4, "micro_batches": 2, "lr": 3e-3, "replicas": 2, "averaging": CO2(tau=2),
            "seed": 1}
    # Nodes too small to hold the model (3 MiB each; it needs 6.2 MiB with its optimizer state): the planner
    # must cut it over all four, and the cut that crosses the sites is compressed. (With room for the whole
    # model it rightly keeps this 5 ms-a-step model on one site, where no fence is worth its bytes.)
    small = dataclasses.replace(LOCAL_PROFILE, memory_bytes=3 << 20)
    with Swarm.local(n_nodes=4, home=tmp_path, links=sites([2, 2], between=SLOW), profiles=[small] * 4) as sw:
        emb = sw.embedded
        assert emb is not None and emb.emulator is not None
        # every pair was measured by the nodes' probes: the slow ones near the emulated rate
        boot = emb.bootstrap
        peers = [n.peer_id for n in emb.nodes]
        for i, a in enumerate(peers):
            for j, b in enumerate(peers[i + 1:], i + 1):
                est = boot.bandwidth.direct(a, b)
                assert est is not None
                if (i < 2) != (j < 2):
                    assert 0.5 * SLOW < est.bandwidth < 1.5 * SLOW, (i, j, est.bandwidth)
                else:
                    assert est.bandwidth > 5 * SLOW, (i, j, est.bandwidth)
        jobs = {}
        for name, comp in (("adatopk", AdaTopK()), ("none", None)):
            job = sw.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ),
                             config=TrainConfig(compression=comp, **base))
            job.wait(timeout=TIMEOUT)
            jobs[name] = job
    plan = next(e for e in jobs["adatopk"].history if isinstance(e, PlanChanged))
    # the plan says per fence what it chose and why: a kept ratio below 1 on a slow link
    assert plan.rho and min(plan.rho) < 1.0, plan
    k = plan.rho.index(min(plan.rho))
    assert plan.link_bps[k] < 10 * SLOW and plan.fence_s[k] < plan.dense_s[k]
    assert "AdaTopK keeps" in plan.describe()
    dense = next(e for e in jobs["none"].history if isinstance(e, PlanChanged))
    assert all(r == 1.0 for r in dense.rho)
    a, n = jobs["adatopk"].losses, jobs["none"].losses
    assert sorted(a) == sorted(n) == list(range(6))
    assert any(abs(a[s] - n[s]) > 1e-6 for s in range(6)), "compression changed nothing"
