"""A publish on ``Swarm.local`` imports almost nothing (issue 40): the first trace imported ``torch.export``'s
tracer (torch._dynamo, sympy: ~1,200 modules) while the embedded nodes' thread ran, each file it opened waiting
for the GIL: 8.9 s of the 10.7 s from publish to RUNNING of swarm_scale's job on 8 of 30 nodes (load 21-26), for
1.5 CPU-s. ``Swarm.local`` imports them before its thread starts (``graph.trace.preload``)."""

from __future__ import annotations

import subprocess
import sys

# a fresh process (the test's own has imported the tracer already): the job's build after Swarm.local started
AFTER_LOCAL = """
import os, sys, time
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import build_job
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

model = GPT2(GPT2Config.tiny(block_size=32, n_layer=2, n_head=2, n_embd=32))
cfg = TrainConfig(steps=2, micro_batch=4, micro_batches=2, averaging=None)
me = Identity.generate()
with Swarm.local(n_nodes=1):
    before = set(sys.modules)
    build_job(model, None, BuiltinCorpus(seq_len=32), cfg, publisher=me.peer_id, sign=me.sign, now=time.time(),
              nonce=os.urandom(16))
    print(len(set(sys.modules) - before), sorted(m for m in set(sys.modules) - before if m.startswith("torch._dynamo"))[:3])
"""


def test_a_publish_on_a_local_swarm_imports_no_tracer_machinery() -> None:
    out = subprocess.run([sys.executable, "-c", AFTER_LOCAL], capture_output=True, text=True, timeout=180, check=True)
    count, dynamo = out.stdout.strip().split(" ", 1)
    assert dynamo == "[]", out.stdout + out.stderr[-2000:]
    assert int(count) < 100, out.stdout      # 12 after preload (torch 2.13), 1,212 before
