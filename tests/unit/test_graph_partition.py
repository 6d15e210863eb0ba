"""Remote autodiff across 2-4 stages in one process: exact gradients, any arrival order."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fusionp2p.errors import ConfigError
from fusionp2p.graph import (
    DATA,
    LocalPipeline,
    OpDAG,
    coarsen,
    partition,
    stages_from_fences,
    trace,
)
from fusionp2p.models import GPT2, GPT2Config

torch.set_num_threads(1)


class SkipNet(nn.Module):
    """h0 feeds layer 1 *and* the final add: a skip that crosses every middle stage (fan-out + fan-in)."""

    def __init__(self, width: int = 12, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h0 = self.layers[0](x)
        h = h0
        for layer in self.layers[1:]:
            h = layer(h)
        return F.cross_entropy(self.head(h + h0), y)   # units: layers.0-3, top (add), head, top@1 (loss)


def max_rel_err(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> float:
    assert set(got) == set(ref)
    return max((got[k] - r).abs().max().item() / max(r.abs().max().item(), 1e-12) for k, r in ref.items())


def reference(model: nn.Module, micro: list[dict[str, torch.Tensor]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model.zero_grad()
    losses = []
    for mb in micro:
        loss = model(*mb.values())
        if isinstance(loss, tuple):
            loss = loss[1]
        (loss / len(micro)).backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def skipnet() -> tuple[SkipNet, OpDAG, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    m = SkipNet()
    micro = [{"x": torch.randn(3, 12), "y": torch.randint(0, 5, (3,))} for _ in range(4)]
    return m, trace(m, tuple(micro[0].values())), micro


@pytest.mark.parametrize("fences", [[3], [2, 4], [1, 2, 3]])
def test_skipnet_stages_exact(skipnet: tuple[SkipNet, OpDAG, list[dict[str, torch.Tensor]]],
                              fences: list[int]) -> None:
    m, dag, micro = skipnet
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), fences))
    assert len(programs) == len(fences) + 1
    ref_losses, ref = reference(m, micro)
    pipe = LocalPipeline(programs)
    losses = pipe.step(micro)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    got = {n: p.grad for n, p in pipe.parameters().items()}
    assert max_rel_err(got, ref) <= 1e-6  # type: ignore[arg-type]


def test_skip_crosses_two_boundaries_and_arrival_order_does_not_matter(
        skipnet: tuple[SkipNet, OpDAG, list[dict[str, torch.Tensor]]]) -> None:
    m, dag, micro = skipnet
    coarse = coarsen(dag)
    assert [u.name for u in coarse.units] == ["layers.0", "layers.1", "layers.2", "layers.3", "top", "head", "top@1"]
    programs = partition(coarse, stages_from_fences(len(coarse.units), [1, 2, 3]))
    # the producer of h0 (stage 0) sends it straight to stage 1 and, past stages 1 and 2, to stage 3
    assert [o.dsts for o in programs[0].send] == [(1, 3)]
    assert sorted(r.src for r in programs[3].recv) == [-1, 0, 2]
    _, ref = reference(m, micro)
    results = []
    for seed in range(3):
        pipe = LocalPipeline(programs)
        pipe.step(micro, rng=random.Random(seed))
        got = {n: p.grad.clone() for n, p in pipe.parameters().items()}  # type: ignore[union-attr]
        assert max_rel_err(got, ref) <= 1e-6
        results.append(got)
    for other in results[1:]:
        assert max_rel_err(other, results[0]) <= 1e-6


@pytest.mark.parametrize("fences", [[3], [2, 4], [1, 3, 5]])
def test_gpt2_stages_exact(fences: list[int]) -> None:
    torch.manual_seed(1)
    m = GPT2(GPT2Config.tiny(n_layer=4, n_embd=32))
    micro = [{"idx": torch.randint(0, 256, (2, 8)), "tgt": torch.randint(0, 256, (2, 8))} for _ in range(3)]
    dag = trace(m, tuple(micro[0].values()), count_flops=False)
    micro = [dict(zip(dag.data_inputs, mb.values())) for mb in micro]
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), fences))
    # token ids go to the first stage only, targets to the last only
    assert [r.name for r in programs[0].recv if r.src == DATA] == ["idx_BT"]
    assert [r.name for r in programs[-1].recv if r.src == DATA] == ["targets_BT"]
    assert programs[-1].loss is not None
    ref_losses, ref = reference(m, micro)
    pipe = LocalPipeline(programs)
    assert pipe.step(micro, rng=random.Random(7)) == pytest.approx(ref_losses, rel=1e-6)
    assert max_rel_err({n: p.grad for n, p in pipe.parameters().items()}, ref) <= 1e-6  # type: ignore[misc]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_partition_covers_every_op_once(skipnet: tuple[SkipNet, OpDAG, list[dict[str, torch.Tensor]]],
                                        data: st.DataObject) -> None:
    _, dag, _ = skipnet
    coarse = coarsen(dag)
    n = len(coarse.units)
    fences = data.draw(st.lists(st.integers(1, n - 1), unique=True, max_size=min(4, n - 1)).map(sorted))
    programs = partition(coarse, stages_from_fences(n, fences))
    placed = [node.name for p in programs for node in p.nodes]
    assert sorted(placed) == sorted(x.name for x in dag.nodes)   # nothing here is replicated
    order = {x.name: i for i, x in enumerate(dag.nodes)}
    for p in programs:
        idx = [order[x.name] for x in p.nodes]
        assert idx == sorted(idx)
        for r in p.recv:
            assert r.src == DATA or r.src < p.stage
        others = {name for q in programs if q is not p for name in q.param_names}
        assert set(p.param_names).isdisjoint(others)


def test_backward_assignment_is_rejected(skipnet: tuple[SkipNet, OpDAG, list[dict[str, torch.Tensor]]]) -> None:
    _, dag, _ = skipnet
    n = len(coarsen(dag).units)
    with pytest.raises(ConfigError, match="later stage"):
        partition(dag, [1] + [0] * (n - 1))
    with pytest.raises(ConfigError, match="no operators"):
        partition(dag, [0] * (n - 1) + [2])
    with pytest.raises(ConfigError):
        stages_from_fences(n, [0])


@pytest.mark.parametrize("fences", [[2], [1, 3]])
def test_tied_weights_across_stages_train_as_one_parameter(fences: list[int]) -> None:
    """GPT-2's tied wte/lm_head on the first and last stage: each holds a copy, the copies' gradients
    are summed, and five SGD steps of the pipeline equal five of the single-process model."""
    torch.manual_seed(3)
    m = GPT2(GPT2Config.tiny(n_layer=2, n_embd=32))
    m.head.lm_head.weight = m.embed.wte.weight
    micro = [{"idx": torch.randint(0, 256, (2, 8)), "tgt": torch.randint(0, 256, (2, 8))} for _ in range(3)]
    dag = trace(m, tuple(micro[0].values()), count_flops=False)
    micro = [dict(zip(dag.data_inputs, mb.values())) for mb in micro]
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), fences))
    (tied,) = {t for p in programs for t in p.tied}
    assert tied.stages == (0, len(programs) - 1)
    assert all(tied.name in programs[s].param_names for s in tied.stages)
    assert programs[-1].peer_stages[0] == 0 or 0 in programs[-1].peer_stages
    own = dict(m.named_parameters())

    def by_model_name(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {next(a for a in dag.module_names[k] if a in own): v for k, v in values.items()}

    pipe = LocalPipeline(programs)
    opt = torch.optim.SGD(pipe.all_parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    for _ in range(5):
        ref_losses, ref = reference(m, micro)
        pipe.zero_grad()
        losses = pipe.step(micro)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert max_rel_err(by_model_name({n: p.grad for n, p in pipe.parameters().items() if p.grad is not None}), ref) <= 1e-5  # type: ignore[misc]
        opt.step()
        ref_opt.step()
    copies = [pipe.executors[s].parameters()[tied.name] for s in tied.stages]
    assert torch.equal(copies[0], copies[1])     # the copies never drift apart
    final = by_model_name({n: p.detach() for n, p in pipe.parameters().items()})
    assert max_rel_err(final, {n: p.detach() for n, p in own.items()}) <= 1e-5
    assert torch.allclose(copies[0], m.embed.wte.weight, rtol=1e-5, atol=1e-6)


def test_inbox_and_executor_guard_boundary_messages(
        skipnet: tuple[SkipNet, OpDAG, list[dict[str, torch.Tensor]]]) -> None:
    from fusionp2p.errors import RemoteProtocolError
    from fusionp2p.graph import Inbox, StageExecutor

    _, dag, micro = skipnet
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), [1, 2, 3]))
    first, last = programs[0], programs[3]
    box = Inbox(last)
    with pytest.raises(RemoteProtocolError):
        box.put_activation(0, "no_such_tensor", torch.zeros(1))
    names = [r.name for r in last.recv]
    x = {r.name: torch.randn(r.meta.shape) if r.meta.dtype.is_floating_point else micro[0]["y"] for r in last.recv}
    assert box.put_activation(0, names[0], x[names[0]]) is None
    assert box.put_activation(0, names[0], x[names[0]] + 1) is None      # a duplicate is ignored
    assert all(box.put_activation(0, n, x[n]) is None for n in names[1:-1])
    ready = box.put_activation(0, names[-1], x[names[-1]])
    assert ready is not None
    assert torch.equal(ready[names[0]], x[names[0]])
    ex = StageExecutor(first)
    with pytest.raises(RemoteProtocolError, match="expected"):
        ex.forward(0, {"x": torch.zeros(2, 12)})
    with pytest.raises(RemoteProtocolError, match="missing"):
        ex.forward(0, {})
    # gradients of a fanned-out tensor are summed in stage order, whatever the arrival order
    g1, g3 = torch.randn(3, 12), torch.randn(3, 12)
    (name,) = [o.name for o in first.send]
    a, b = Inbox(first), Inbox(first)
    assert a.put_grad(0, name, 3, g3) is None
    got_a = a.put_grad(0, name, 1, g1)
    assert b.put_grad(0, name, 1, g1) is None
    got_b = b.put_grad(0, name, 3, g3)
    assert got_a is not None
    assert got_b is not None
    assert torch.equal(got_a[name], got_b[name])
    torch.testing.assert_close(got_a[name], g1 + g3)
