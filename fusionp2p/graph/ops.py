"""The operator whitelist: the only operators a stage program may contain.

A node of an OpDAG names its operator as a string (``"aten.linear.default"``), never as code. Before
anything is built from a peer's description, every name is checked against :data:`WHITELIST`;
:func:`resolve` then maps the name to the local ``torch.ops`` overload. This is the security boundary
of the project (ALGORITHMS.md §1.1): a node only ever runs operators of its own, local framework.

The list covers what ``torch.export`` (training IR) emits for the reference models, for Hugging Face
GPT-2 and for common CNN/MLP/transformer code. Extending it is a reviewed code change, not a runtime
option. Operators with side effects beyond their own inputs (I/O, RNG state seeding, collectives)
are never listed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

#: pseudo-operator for picking one element of a list-returning operator (``split``, ``max.dim``...)
GETITEM = "getitem"

_ATEN = """
    abs.default adaptive_avg_pool1d.default adaptive_avg_pool2d.default add.Scalar add.Tensor
    add_.Tensor addmm.default alias.default all.default amax.default any.default arange.default
    arange.start arange.start_step argmax.default avg_pool1d.default avg_pool2d.default
    baddbmm.default batch_norm.default bitwise_and.Tensor bitwise_not.default bitwise_or.Tensor
    bmm.default cat.default chunk.default clamp.default clamp_min.default clone.default
    contiguous.default conv1d.default conv2d.default cos.default cross_entropy_loss.default
    cumsum.default detach.default diff.default div.Scalar div.Tensor div.Tensor_mode dropout.default
    einsum.default elu.default embedding.default eq.Scalar eq.Tensor erf.default exp.default
    expand.default flatten.using_ints full.default full_like.default gather.default ge.Scalar ge.Tensor gelu.default
    group_norm.default gt.Scalar gt.Tensor hardtanh.default index.Tensor index_select.default
    layer_norm.default le.Scalar le.Tensor leaky_relu.default lift_fresh_copy.default linear.default log.default
    log_softmax.int logical_and.default logical_not.default lt.Scalar lt.Tensor masked_fill.Scalar
    masked_fill.Tensor matmul.default max.dim max_pool2d.default maximum.default mean.default
    mean.dim minimum.default mm.default mse_loss.default mul.Scalar mul.Tensor native_layer_norm.default
    ne.Scalar ne.Tensor neg.default new_ones.default new_zeros.default nll_loss.default ones.default
    ones_like.default pad.default permute.default pow.Scalar pow.Tensor_Scalar pow.Tensor_Tensor
    relu.default relu_.default repeat.default reshape.default rsqrt.default scaled_dot_product_attention.default
    select.int sigmoid.default silu.default sin.default slice.Tensor softmax.int split.Tensor
    split_with_sizes.default sqrt.default squeeze.dim squeeze.default sub.Scalar sub.Tensor sum.default
    sum.dim_IntList t.default tanh.default to.dtype to.dtype_layout to.device transpose.int tril.default
    triu.default type_as.default unbind.int unflatten.int unsqueeze.default var.correction view.default
    where.ScalarOther where.ScalarSelf where.self zeros.default zeros_like.default __and__.Tensor
    __or__.Tensor
"""

WHITELIST: frozenset[str] = frozenset({GETITEM} | {f"aten.{name}" for name in _ATEN.split()})

#: operators dropped at trace time: runtime assertions that carry no data
DROPPED: frozenset[str] = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"})

#: operators whose result depends on a random number generator (stage results are then not bitwise
#: reproducible against eager PyTorch unless their probability is 0)
RANDOM: frozenset[str] = frozenset({"aten.dropout.default"})


def op_name(target: Any) -> str:
    """The whitelist name of an FX call target (``torch.ops.aten.linear.default`` -> ``aten.linear.default``)."""
    if target is operator.getitem:
        return GETITEM
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::', 1)[-1]}.{target._overloadname}"
    return getattr(target, "__name__", repr(target))


def resolve(name: str) -> Callable[..., Any]:
    """The local callable for a whitelisted operator name. KeyError if *name* is not whitelisted.

    Callers validate names first (and raise their own error type); this is the last line of defence.
    """
    if name not in WHITELIST:
        raise KeyError(name)
    if name == GETITEM:
        return operator.getitem
    ns, op, overload = name.split(".")
    fn: Callable[..., Any] = getattr(getattr(getattr(torch.ops, ns), op), overload)
    return fn
