"""Small reference models (GPT-2 family, ResNet family, MLP) for demos, tests and benchmarks."""

from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.models.mlp import MLP, MLPConfig
from fusionp2p.models.resnet import ResNet, ResNetConfig

__all__ = ["GPT2", "MLP", "GPT2Config", "MLPConfig", "ResNet", "ResNetConfig"]
