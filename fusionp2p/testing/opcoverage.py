"""The operator-coverage table of docs/operators.md, generated from the whitelist itself.

``python -m fusionp2p.testing.opcoverage > docs/operators.md`` rewrites the page: one row per
whitelisted operator (``graph/ops.py:WHITELIST``), with the reference and Hugging Face architectures
whose trace uses it (traced from tiny configs; the Hugging Face columns need ``transformers``).
``tests/unit/test_op_coverage.py`` checks that the page lists exactly the whitelist.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusionp2p.graph import trace
from fusionp2p.graph.ops import GETITEM, WHITELIST

HEADER = """# Operator coverage

Generated from the whitelist (`fusionp2p/graph/ops.py`) by `python -m fusionp2p.testing.opcoverage >
docs/operators.md`; `tests/unit/test_op_coverage.py` checks that this table lists exactly the
whitelisted operators. A node runs only these operators, each resolved to its own local
`torch.ops` overload (docs/security.md). Every one was reviewed for: no I/O and no effect beyond its
own outputs (no RNG seeding, no collectives), work bounded by its declared tensor shapes, and shape
inference on the `meta` device (how a node checks a peer's graph before running it; docs/graph.md).
`dropout` draws from the executing node's random generator.

The columns say which architectures' traces use the operator (tiny configs, training mode): the
reference models of `fusionp2p.models`, and Hugging Face transformers models as shipped
(docs/models.md). An operator no column marks is there for code these architectures do not
exercise (other CNN/MLP/transformer code, loss functions).

"""


def _archs() -> dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]]:
    from fusionp2p.models import GPT2, MLP, GPT2Config, MLPConfig, ResNet, ResNetConfig

    ids = torch.randint(0, 128, (2, 16))
    out: dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]] = {
        "GPT2 (ref)": lambda: (GPT2(GPT2Config.tiny(n_layer=1)), {"idx_BT": ids, "targets_BT": ids}),
        "ResNet (ref)": lambda: (_WithLoss(ResNet(ResNetConfig(widths=(8, 16), depths=(1, 1)))),
                                 {"x": torch.randn(2, 3, 16, 16), "y": torch.tensor([0, 1])}),
        "MLP (ref)": lambda: (_WithLoss(MLP(MLPConfig())), {"x": torch.randn(2, MLPConfig().in_features),
                                                           "y": torch.tensor([0, 1])}),
    }
    try:
        tf: Any = importlib.import_module("transformers")   # optional (dev extra); untyped on purpose
    except ImportError:
        return out
    small: dict[str, Any] = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "max_position_embeddings": 64}
    mask = torch.ones(2, 16, dtype=torch.long)
    out |= {
        "GPT-2": lambda: (tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=128)),
                          {"input_ids": ids, "labels": ids}),
        "Llama": lambda: (tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small)),
                          {"input_ids": ids, "labels": ids}),
        "Mistral": lambda: (tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, **small)),
                            {"input_ids": ids, "labels": ids}),
        "Qwen2": lambda: (tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **small)),
                          {"input_ids": ids, "labels": ids}),
        "BERT": lambda: (tf.BertForMaskedLM(tf.BertConfig(**small)),
                         {"input_ids": ids, "attention_mask": mask, "labels": ids}),
        "BERT-cls": lambda: (tf.BertForSequenceClassification(tf.BertConfig(num_labels=3, **small)),
                             {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}),
        "RoBERTa": lambda: (tf.RobertaForMaskedLM(tf.RobertaConfig(**small)),
                            {"input_ids": ids, "attention_mask": mask, "labels": ids}),
        "ViT": lambda: (tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=4, num_labels=5, **{
            k: v for k, v in small.items() if k not in ("vocab_size", "max_position_embeddings")})),
                        {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([1, 4])}),
    }
    return out


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(x), y)


def render() -> str:
    torch.manual_seed(0)
    used: dict[str, set[str]] = {}
    names = list(_archs().items())
    for arch, make in names:
        model, inputs = make()
        dag = trace(model, inputs, count_flops=False)
        used[arch] = {n.op for n in dag.nodes}
    cols = [a for a, _ in names]
    lines = [HEADER, "| operator | " + " | ".join(cols) + " |", "| --- |" + " :-: |" * len(cols)]
    for op in sorted(WHITELIST):
        shown = "getitem (element of a list result)" if op == GETITEM else op.removeprefix("aten.")
        lines.append(f"| `{shown}` | " + " | ".join("x" if op in used[a] else "" for a in cols) + " |")
    return "\n".join(lines) + "\n"


def listed(markdown: str) -> set[str]:
    """The operators a rendered page lists (the first column of its table)."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("| `"):
            cell = line.split("`")[1]
            out.add(GETITEM if cell.startswith("getitem") else f"aten.{cell}")
    return out


if __name__ == "__main__":
    sys.stdout.write(render())
