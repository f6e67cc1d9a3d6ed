"""The Triton backend's one autograd path: the ``torch.library`` op pair.

``qsa::triton_sparse_gqa_attention`` returns the output with the kernels' residuals (LSE
and the route unions); its autograd formula calls ``qsa::triton_sparse_gqa_attention_backward``
on them, so forward+backward runs the forward kernel once. Both are opaque custom ops
with fake implementations: they run under ``torch.compile(fullgraph=True)`` without
breaking the graph. ``deterministic`` (None: ``torch.are_deterministic_algorithms_enabled()``
read when the backward runs) and the block sizes (:func:`encode_block_sizes`: an op takes
no dataclass) travel with the op's arguments. The inputs arrive checked
(``qsa_torch.triton_qsa`` or the dispatcher validated them).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from qsa_triton.config import BlockSizes

__all__ = ["attention", "decode_block_sizes", "encode_block_sizes"]

logger = logging.getLogger("qsa_torch")
_FIELDS = tuple(f.name for f in dataclasses.fields(BlockSizes))


def encode_block_sizes(blocks: BlockSizes | None) -> list[int] | None:
    """``blocks`` as the op's ``int[]?`` argument: every field in order, None as 0 (no
    field takes 0 otherwise), booleans as 0 / 1."""
    if blocks is None:
        return None
    if not isinstance(blocks, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(blocks).__name__}")
    return [int(getattr(blocks, name) or 0) for name in _FIELDS]


def decode_block_sizes(values: list[int] | None) -> BlockSizes | None:
    if values is None:
        return None
    fields = dict(zip(_FIELDS, values))
    fields["backward_rows_per_tile"] = fields["backward_rows_per_tile"] or None
    fields["flatten_heads"] = bool(fields["flatten_heads"])
    return BlockSizes(**fields)


@torch.library.custom_op("qsa::triton_sparse_gqa_attention", mutates_args=())
def _forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float,
    deterministic: bool | None = None,
    block_sizes: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, union, count, rowbits)``; ``deterministic`` is the backward's."""
    from . import triton_qsa

    result = triton_qsa.forward_with_residuals(query, key, value, selected_token_ids, softmax_scale,
                                               block_sizes=decode_block_sizes(block_sizes))
    logger.debug("sparse_gqa_attention: ran backend %r", "triton")
    return result


@_forward_op.register_fake
def _forward_fake(query, key, value, selected_token_ids, softmax_scale, deterministic=None, block_sizes=None):
    from . import triton_qsa

    shapes = triton_qsa.residual_shapes(query, key, selected_token_ids, block_sizes=decode_block_sizes(block_sizes))
    return tuple(query.new_empty(shape, dtype=dtype) for shape, dtype in shapes)


@torch.library.custom_op("qsa::triton_sparse_gqa_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    union: torch.Tensor,
    count: torch.Tensor,
    rowbits: torch.Tensor,
    softmax_scale: float,
    top_k: int,
    deterministic: bool | None = None,
    block_sizes: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import triton_qsa

    grads = triton_qsa.backward_from_residuals(grad_out, query, key, value, out, lse, union, count, rowbits,
                                               softmax_scale, top_k, block_sizes=decode_block_sizes(block_sizes),
                                               deterministic=deterministic)
    return tuple(g.contiguous() for g in grads)


@_backward_op.register_fake
def _backward_fake(grad_out, query, key, value, out, lse, union, count, rowbits, softmax_scale, top_k,
                   deterministic=None, block_sizes=None):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, routes, scale, deterministic, block_sizes = inputs
    out, lse, union, count, rowbits = output
    ctx.mark_non_differentiable(lse, union, count, rowbits)
    ctx.save_for_backward(query, key, value, out, lse, union, count, rowbits)
    ctx.scale, ctx.top_k, ctx.deterministic, ctx.block_sizes = scale, routes.shape[2], deterministic, block_sizes


def _backward(ctx, grad_out, *_unused):
    query, key, value, out, lse, union, count, rowbits = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, query, key, value, out, lse, union, count, rowbits, ctx.scale, ctx.top_k,
                              ctx.deterministic, ctx.block_sizes)
    return dq, dk, dv, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def attention(query, key, value, selected_token_ids, softmax_scale: float, *, deterministic: bool | None = None,
              block_sizes: BlockSizes | None = None) -> torch.Tensor:
    """The op pair's output (differentiable in query, key and value); checked inputs."""
    return _forward_op(query, key, value, selected_token_ids, softmax_scale, deterministic,
                       encode_block_sizes(block_sizes))[0]
