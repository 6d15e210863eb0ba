"""Reference models: shapes, losses, configuration checks, GPT-2 small's parameter count."""

from __future__ import annotations

import pytest
import torch

from fusionp2p.errors import ConfigError
from fusionp2p.models import GPT2, MLP, GPT2Config, MLPConfig, ResNet, ResNetConfig


def test_gpt2_logits_and_loss() -> None:
    torch.manual_seed(0)
    cfg = GPT2Config.tiny()
    m = GPT2(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 10))
    logits = m(idx)
    assert isinstance(logits, torch.Tensor)
    assert logits.shape == (3, 10, cfg.vocab_size)
    out = m(idx, idx)
    assert isinstance(out, tuple)
    # an untrained model predicts near-uniformly: loss close to log(V)
    assert abs(out[1].item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5
    assert isinstance(m.blocks, torch.nn.ModuleList)
    assert len(m.blocks) == cfg.n_layer
    assert hasattr(m, "embed")
    assert hasattr(m, "head")


def test_gpt2_is_causal() -> None:
    torch.manual_seed(0)
    m = GPT2(GPT2Config.tiny())
    idx = torch.randint(0, 256, (1, 12))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    a, b = m(idx), m(changed)
    assert isinstance(a, torch.Tensor)
    assert isinstance(b, torch.Tensor)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_gpt2_small_parameter_count() -> None:
    # GPT-2 small is 124,439,808 parameters with the LM head tied to the token embedding
    with torch.device("meta"):
        m = GPT2(GPT2Config(tie_weights=True))
    assert m.num_params() == 124_439_808


@pytest.mark.parametrize("kwargs", [{"n_embd": 65, "n_head": 2}, {"n_layer": 0}, {"dropout": 1.0}])
def test_gpt2_config_rejects(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        GPT2Config(**kwargs)  # type: ignore[arg-type]


def test_gpt2_rejects_long_sequence() -> None:
    m = GPT2(GPT2Config.tiny(block_size=8))
    with pytest.raises(ConfigError):
        m(torch.zeros(1, 9, dtype=torch.long))


def test_resnet_shapes_and_residual_projection() -> None:
    torch.manual_seed(0)
    m = ResNet(ResNetConfig(widths=(8, 16), depths=(2, 1), num_classes=5))
    assert m(torch.randn(2, 3, 16, 16)).shape == (2, 5)
    # the first block of the second stage changes width and stride, so it has a projection shortcut
    assert not isinstance(m.blocks[2].shortcut, torch.nn.Identity)
    assert isinstance(m.blocks[0].shortcut, torch.nn.Identity)
    with pytest.raises(ConfigError):
        ResNetConfig(widths=(8,), depths=(1, 1))


def test_mlp_shapes() -> None:
    m = MLP(MLPConfig(in_features=7, hidden=(5, 6), out_features=3))
    assert m(torch.randn(4, 7)).shape == (4, 3)
    assert len(m.layers) == 2
    with pytest.raises(ConfigError):
        MLPConfig(hidden=(0,))
