"""One job path: the same checks against the embedded swarm (``Swarm.local``: the node job service over
the in-memory transport in this process) and a real one (a bootstrap and ``fusionp2p node`` processes
over libp2p, reached with ``Swarm.connect``). Both run ``NodeJobService``/``JobRun`` on the nodes and
``Publisher`` on the client; what differs is only the transport and the process boundary."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import trio

from fusionp2p.cli.cluster import LocalCluster, wait_until
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.events import EvalProgress, JobStateChanged, PlanChanged, StepProgress
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.testing.evaluation import final_eval_loss
from fusionp2p.train.config import TrainConfig

pytestmark = pytest.mark.system

SEQ = 32
TIMEOUT = 300


def _model(seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config.tiny(block_size=SEQ))


class _Kind:
    """A swarm of 4 nodes either way, and how to kill one of its nodes without a goodbye."""

    def __init__(self, swarm: Swarm, cluster: LocalCluster | None) -> None:
        self.swarm, self.cluster = swarm, cluster

    def kill(self, peer: str) -> None:
        if self.cluster is not None:
            name = next(n for n in self.cluster.procs if n.startswith("node") and self.cluster.peer_id(n) == peer)
            self.cluster.kill(name)
            return
        emb = self.swarm.embedded
        assert emb is not None and self.swarm._token is not None
        node = next(n for n in emb.nodes if n.peer_id == peer)
        trio.from_thread.run_sync(emb.kill, node, trio_token=self.swarm._token)


@pytest.fixture(params=["embedded", "processes"], scope="module")
def kind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Kind]:
    torch.set_num_threads(1)
    if request.param == "embedded":
        with Swarm.local(n_nodes=4, home=tmp_path_factory.mktemp("embedded")) as sw:
            yield _Kind(sw, None)
        return
    # progress_interval 0: a test that kills a member at a step hears of every step as it ends
    with LocalCluster(4, tmp_path_factory.mktemp("cluster"), dead_timeout=5.0, progress_interval=0.0) as cluster, \
            Swarm.connect([cluster.bootstrap], home=tmp_path_factory.mktemp("client"),
                          listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= 4, timeout=90, interval=0.5, what="4 nodes in the bootstrap's view")
        yield _Kind(sw, cluster)


def test_two_by_two_trains_downloads_and_reloads_strictly(kind: _Kind, tmp_path: Path) -> None:
    cfg = TrainConfig(steps=30, micro_batch=4, micro_batches=2, lr=3e-3, replicas=2, averaging="co2",
                      compression="adatopk", checkpoint_every=10, seed=1)
    job = kind.swarm.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg)
    events = list(job.events(timeout=TIMEOUT))
    job.wait(timeout=1)
    # replicas=2 is the planner's hint and bound (plan/joint.py): embedded (no measured links) it keeps
    # 2 x 2; on real processes it plans from the probed loopback figures and has chosen 2 x 1 or 1 x 2 there
    sizes = next(e for e in events if isinstance(e, PlanChanged)).stage_sizes
    assert len(set(sizes)) == 1 and sizes[0] <= 2, sizes
    # on real processes the election may run before every link is probed; a leader may then take the
    # standbys in once the figures show a plan with more nodes predicted faster (a re-plan: more
    # planned/running pairs, each for joiners), never anything else
    states = [e.state for e in events if isinstance(e, JobStateChanged)]
    assert states[:2] == ["planned", "running"] and states[-1] == "done" and set(states) == {"planned", "running",
                                                                                             "done"}, states
    if kind.cluster is None:
        assert states == ["planned", "running", "done"]
    steps = [e for e in events if isinstance(e, StepProgress) and e.step < cfg.steps]
    assert len(steps) >= cfg.steps - 2          # progress rides on gossip; a lost message is tolerated
    first = float(np.mean([e.loss for e in steps[:3]]))
    last = float(np.mean([e.loss for e in steps[-3:]]))
    assert last < first - 1.0, (first, last)
    # the stage files fetched by hash assemble into the module's exact state_dict and reproduce the
    # final (evaluation) loss the job reported
    path = job.download(tmp_path)
    fresh = _model(seed=123)
    fresh.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
    assert job.final_loss is not None
    # the evaluation batches depend on the replicas of the plan that finished (the planner chooses them)
    last_sizes = [e for e in events if isinstance(e, PlanChanged)][-1].stage_sizes
    assert abs(final_eval_loss(fresh, cfg, seq_len=SEQ, replicas=last_sizes[-1]) - job.final_loss) < 1e-4


def test_a_member_killed_mid_training_the_job_replans_and_ends_done(kind: _Kind, tmp_path: Path) -> None:
    # One pipeline (replicas=1): a dead member stalls it, so the job must re-plan to go on. With 2 replicas
    # the planner may choose one stage x 2, whose survivor trains on alone; twice in CI (2026-11-27, at 60
    # and at 240 steps) it finished before the death was detected and the job ended DONE on epoch 0
    cfg = TrainConfig(steps=60, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="co2",
                      compression="none", checkpoint_every=20, seed=2)
    job = kind.swarm.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg)
    killed = ""
    plans: list[PlanChanged] = []
    for ev in job.events(timeout=TIMEOUT):
        if isinstance(ev, PlanChanged):
            plans.append(ev)
        if isinstance(ev, StepProgress) and ev.step >= 10 and not killed:
            # not the lowest id, which leads the job; but when the planner gave the plan one member (it has on
            # loaded loopback, from the probed figures) that one dies, and a standby must carry the job on
            killed = max(plans[0].members)
            kind.kill(killed)
    job.wait(timeout=10)
    assert plans[-1].epoch >= 1 and killed not in plans[-1].members
    steps = {e.step for e in job.history if isinstance(e, StepProgress) and e.loss is not None}
    assert set(range(cfg.steps)) <= steps and job.final_loss is not None   # every step, and the final evaluation
    assert any(isinstance(e, EvalProgress) and e.step == cfg.steps and not e.peer for e in job.history)
    fresh = _model(seed=7)
    fresh.load_state_dict(safetensors.torch.load_file(str(job.download(tmp_path))), strict=True)
