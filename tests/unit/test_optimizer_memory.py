"""The stage optimizer's step holds no temporaries of its parameters' size (issue 37): measured in a fresh
process, the peak resident set of an AdamW step over a 32 MiB tensor (its state already allocated) rises by a
small part of that tensor. PyTorch's default per-tensor step built sqrt(v) and its quotient, two new tensors
of each parameter's size: a node's peak went 2x its largest tensor (the embedding) over the planner's figure."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_STEP = textwrap.dedent("""
    import torch
    from fusionp2p.train.config import TrainConfig
    from fusionp2p.train.optim import make_optimizer

    def status(key):
        return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key)) * 1024

    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(8 << 20)), torch.nn.Parameter(torch.randn(1000))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_optimizer(params, TrainConfig(steps=3, optimizer="adamw", lr=1e-3, weight_decay=0.1))
    opt.step()   # the first step allocates the state (priced: the planner's optimizer factor)
    rises = []
    for _ in range(2):
        open("/proc/self/clear_refs", "w").write("5")   # the peak from here on (Linux)
        before = status("VmRSS")
        opt.step()
        rises.append(status("VmHWM") - before)
    print(max(rises), params[0].numel() * 4)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_adamw_step_allocates_no_tensor_of_a_parameters_size() -> None:
    got = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, timeout=120, check=True)
    rise, largest = (int(x) for x in got.stdout.split())
    assert rise < largest // 4, f"an AdamW step's peak rose {rise >> 20} MiB over a {largest >> 20} MiB tensor"
