"""A job's content is fetched within what the job itself declares (issue 15, item 8).

Before, every blob of a job (DAG, weights, manifest, each shard) could be up to 2 GiB, whatever the
spec and the DAG said. Now the DAG (without tensors) is bounded by its header's limit, the weight
manifest by its format's (issue 37; no weight piece is fetched at intake at all), each shard exactly
its size in the manifest, the dataset within the node's memory; a larger blob is refused by size
before any of it is transferred.
"""

from __future__ import annotations

import dataclasses

import pytest
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
from fusionp2p.wire.pieces import MAX_MANIFEST_BYTES

SEQ = 16


def test_a_weight_manifest_over_its_bound_is_never_transferred() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                pub_t, node_t = net.add_host(), net.add_host()
                torch.manual_seed(0)
                cfg = TrainConfig(steps=1, micro_batch=2, micro_batches=1)
                built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ)), None, BuiltinCorpus(seq_len=SEQ), cfg,
                                  publisher=pub_t.peer_id, sign=pub_t.sign, now=1.0, nonce=b"n" * 16)
                # a blob one byte over the manifest's bound, under its own hash, signed into the spec
                padded = b"\x00" * (MAX_MANIFEST_BYTES + 1)
                spec = dataclasses.replace(built.spec, weights_hash=sha256_hex(padded))
                pub = ContentService(pub_t, ContentStore())
                pub.install()
                for blob in [*built.blobs.values(), padded]:
                    pub.store.put(blob)
                intake = NodeJobs(ContentService(node_t, ContentStore()), TEST_PROFILE)
                with pytest.raises(FusionError):
                    await intake.accept(sign_spec(spec, pub_t.sign), peers=[pub_t.peer_id])
                assert pub.served == 1                       # the DAG only: the manifest was refused by size
                assert not intake.content.store.has(spec.weights_hash)

    trio.run(main)
