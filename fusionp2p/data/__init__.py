"""Datasets: the built-in corpus, user token files, content-addressed shards and the batch sampler.

``fp.data.TokenFile("corpus.bin", seq_len=128)`` and ``fp.data.BuiltinCorpus("pydoc", seq_len=128)``
are what the SDK takes; the rest is used by the job runtime.
"""

from fusionp2p.data.corpus import VOCAB_SIZE, corpus_bytes, corpus_hash, corpus_tokens, decode_bytes
from fusionp2p.data.examples import ExampleManifest, Examples, ExampleSampler, ShardedExamples
from fusionp2p.data.hf import HFTokens
from fusionp2p.data.sampler import BatchSampler, SamplerConfig
from fusionp2p.data.shards import ShardedTokens, ShardManifest, decode_shard, make_shards
from fusionp2p.data.tokens import BuiltinCorpus, TokenFile, TokenSource
from fusionp2p.data.url import TokenURL

__all__ = [
    "VOCAB_SIZE",
    "BatchSampler",
    "BuiltinCorpus",
    "ExampleManifest",
    "ExampleSampler",
    "Examples",
    "HFTokens",
    "SamplerConfig",
    "ShardManifest",
    "ShardedExamples",
    "ShardedTokens",
    "TokenFile",
    "TokenSource",
    "TokenURL",
    "corpus_bytes",
    "corpus_hash",
    "corpus_tokens",
    "decode_bytes",
    "decode_shard",
    "make_shards",
]
