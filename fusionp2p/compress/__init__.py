"""Tensor compression: codecs (tensor → (payload, meta) → tensor) and the AdaTopK ratio policy.

Pure (no trio, sockets or clock). See docs/dataplane.md.
"""

from fusionp2p.compress.adatopk import ErrorFeedback, TopKLink, boundary
from fusionp2p.compress.codec import (
    CastCodec,
    Codec,
    IdentityCodec,
    TopKCodec,
    decode,
    index_dtype,
    kept_mask,
    sparse_bytes,
    uses_bitmap,
)
from fusionp2p.compress.policy import LinkCost, RatioEstimator, choose_ratio, plan_ratios
from fusionp2p.compress.select import approx_topk_indices, exact_topk_indices, k_for, select_topk

__all__ = [
    "CastCodec",
    "Codec",
    "ErrorFeedback",
    "IdentityCodec",
    "LinkCost",
    "RatioEstimator",
    "TopKCodec",
    "TopKLink",
    "approx_topk_indices",
    "boundary",
    "choose_ratio",
    "decode",
    "exact_topk_indices",
    "index_dtype",
    "k_for",
    "kept_mask",
    "plan_ratios",
    "select_topk",
    "sparse_bytes",
    "uses_bitmap",
]
