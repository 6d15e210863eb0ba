"""A job's content is fetched within what the job itself declares (issue 15, item 8).

Before, every blob of a job (DAG, weights, manifest, each shard) could be up to 2 GiB, whatever the
spec and the DAG said. Now the weights may be no larger than the DAG's own tensors (plus a header),
each shard exactly its size in the manifest, the DAG and the dataset within the node's memory; a
larger blob is refused by size before any of it is transferred.
"""

from __future__ import annotations

import dataclasses

import pytest
import safetensors.torch
import torch
import trio

from fusionp2p.data import BuiltinCorpus
from fusionp2p.errors import FusionError
from fusionp2p.jobs.build import NodeJobs, build_job
from fusionp2p.jobs.content import ContentService, ContentStore, sha256_hex
from fusionp2p.jobs.spec import sign_spec
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.net.memory import memory_network
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import TrainConfig

SEQ = 16


def test_weights_larger_than_the_dag_declares_are_never_transferred() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                pub_t, node_t = net.add_host(), net.add_host()
                torch.manual_seed(0)
                cfg = TrainConfig(steps=1, micro_batch=2, micro_batches=1)
                built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ)), None, BuiltinCorpus(seq_len=SEQ), cfg,
                                  publisher=pub_t.peer_id, sign=pub_t.sign, now=1.0, nonce=b"n" * 16)
                # the same tensors and 8 MiB of padding: a valid blob under its own hash, signed into the spec
                padded = safetensors.torch.save({**{k: v.contiguous() for k, v in built.dag.tensors.items()},
                                                 "pad": torch.zeros(8 << 20, dtype=torch.uint8)})
                spec = dataclasses.replace(built.spec, weights_hash=sha256_hex(padded))
                pub = ContentService(pub_t, ContentStore())
                pub.install()
                for blob in [*built.blobs.values(), padded]:
                    pub.store.put(blob)
                intake = NodeJobs(ContentService(node_t, ContentStore()), TEST_PROFILE)
                with pytest.raises(FusionError):
                    await intake.accept(sign_spec(spec, pub_t.sign), peers=[pub_t.peer_id])
                assert pub.served == 1                       # the DAG only: the weights were refused by size
                assert not intake.content.store.has(spec.weights_hash)

    trio.run(main)
