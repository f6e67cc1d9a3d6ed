"""Autograd glue of the Triton backend: query/key/value -> out, residuals kept for the backward."""

from __future__ import annotations

import torch

from . import _triton_launch as launcher
from ._triton_unions import TileUnions, backward_unions


class TritonQSA(torch.autograd.Function):
    """The tile unions and the plan are non-differentiable inputs; the forward's output,
    LSE and unions are what the backward reads (nothing is recomputed).

    ``deterministic``: True / False, or None for ``torch.are_deterministic_algorithms_enabled()``
    read when the backward runs."""

    @staticmethod
    def forward(ctx, query, key, value, union, count, rowbits, scale, plan, top_k, deterministic):
        unions = TileUnions(union, count, rowbits, plan.rows_per_tile)
        out, lse = launcher.forward(query, key, value, unions, scale, plan)
        ctx.save_for_backward(query, key, value, out, lse, union, count, rowbits)
        ctx.scale, ctx.plan, ctx.top_k, ctx.deterministic = scale, plan, top_k, deterministic
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse, union, count, rowbits = ctx.saved_tensors
        unions = backward_unions(TileUnions(union, count, rowbits, ctx.plan.rows_per_tile), ctx.plan, ctx.top_k,
                                 query.shape[1])
        deterministic = ctx.deterministic
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        dq, dk, dv = launcher.backward(query, key, value, out, lse, grad_out, unions, ctx.scale, ctx.plan,
                                       deterministic=deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None
