"""Keep a non-finite query or output-gradient row inside its own routes around a tile kernel.

The contract: an entry outside a row's routes contributes exactly 0. A tile kernel's
backward (FlexAttention, FA4, cuDNN) multiplies whole tiles, ``dK = dS^T Q`` and
``dV = P^T dO``, so a NaN or inf in row i's query or output gradient reaches every key
of the tile through ``0 * NaN``, keys row i does not route included.

:func:`confine_nonfinite` runs such a kernel on rows it cannot poison and puts the
non-finite values back where the contract lets them go:

* forward: query rows ``(b, i, h)`` with a non-finite entry enter the kernel as zeros;
  their output becomes NaN where the row has a route (any softmax of a non-finite score
  row is NaN or open in the contract) and keeps the kernel's value (0) where it has none;
* backward: output-gradient rows with a non-finite entry enter the kernel's backward as
  zeros; then ``dq`` of every bad routed row (non-finite query or output gradient) is
  NaN, and ``dk`` / ``dv`` are NaN at each ``(b, key, h // G)`` that a bad row
  ``(b, i, h)`` routes (IDs outside ``[0, S_kv)`` ignored, duplicates fine).

Everything is device-side tensor work with static shapes: no host synchronisation, no
data-dependent branch, so it traces under ``torch.compile``. When every row is finite
the masks are all false and the kernel sees bitwise the inputs and output gradient it
would see without the wrapper: results are bitwise those of the bare kernel. The cost
is a few elementwise passes over query, output and their gradients, and one scatter of
a flag per route in the backward.

The bad-row flags travel from the output's backward node to the inputs' backward node
as the "gradient" of a float token that only these two nodes see.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["confine_nonfinite", "routed_key_flags"]

# flag writes held at once by routed_key_flags (int64 indices: 8 bytes each)
_CHUNK = 1 << 24


def _bad_rows(x: torch.Tensor) -> torch.Tensor:
    """bool ``[..., H]``: rows of ``x`` ``[..., H, D]`` with a non-finite entry."""
    return ~torch.isfinite(x).all(dim=-1)


def routed_key_flags(bad: torch.Tensor, routes: torch.Tensor, kv_length: int, kv_heads: int) -> torch.Tensor:
    """bool ``[B, S_kv, Hkv, 1]``: True at ``(b, key, g)`` when some ``bad[b, i, h]`` with
    ``h // G == g`` has ``key`` among ``routes[b, i]`` (IDs outside ``[0, S_kv)`` ignored).

    A constant-valued ``index_fill_`` over every route in chunks of query rows: duplicate
    writes store the same value (deterministic in any order), rows that are not bad write
    into a second plane that is thrown away, and invalid IDs into a spare key column.
    """
    bsz, s_q, hq = bad.shape
    width = routes.shape[-1]
    group = hq // kv_heads
    bad_kv = bad.reshape(bsz, s_q, kv_heads, group).any(dim=-1)  # [B, S_q, Hkv]
    cols = kv_length + 1
    plane = bsz * cols * kv_heads  # [plane 0: kept, plane 1: discarded][B][S_kv + 1][Hkv]
    flags = torch.zeros(2 * plane, dtype=torch.bool, device=bad.device)
    heads = torch.arange(kv_heads, device=bad.device)
    origin = torch.arange(bsz, device=bad.device)[:, None, None, None] * (cols * kv_heads)
    step = max(1, _CHUNK // max(1, bsz * width * kv_heads))
    for start in range(0, s_q, step):
        ids = routes[:, start : start + step]
        valid = (ids >= 0) & (ids < kv_length)
        key = torch.where(valid, ids, torch.full((), kv_length, dtype=ids.dtype, device=ids.device)).long()
        index = origin + key[..., None] * kv_heads + heads  # [B, r, K, Hkv]
        discard = ~bad_kv[:, start : start + step, None, :]
        index = index + discard.long() * plane
        flags.index_fill_(0, index.reshape(-1), True)
    return flags[:plane].view(bsz, cols, kv_heads)[:, :kv_length, :, None]


class _Enter(torch.autograd.Function):
    """Forward: non-finite query rows zeroed, key/value passed on, a zero token made.
    Backward: NaN into dq of the bad routed rows and dk/dv at their routed keys."""

    @staticmethod
    def forward(ctx, query, key, value, routes, query_bad):
        ctx.save_for_backward(routes)
        ctx.kv_shape = (key.shape[1], key.shape[2])
        token = query.new_zeros(query_bad.shape, dtype=torch.float32)
        outs = query.masked_fill(query_bad[..., None], 0), key.view_as(key), value.view_as(value)
        # the kernel computes no gradient that was not asked of the wrapper
        ctx.mark_non_differentiable(*(o for o, t in zip(outs, (query, key, value)) if not t.requires_grad))
        return (*outs, token)

    @staticmethod
    def backward(ctx, dq, dk, dv, token_grad):
        (routes,) = ctx.saved_tensors
        if token_grad is None:  # the token never reached _Leave: nothing to confine
            return dq, dk, dv, None, None
        bad = token_grad != 0  # bad rows with a route (set by _Leave.backward)
        nan = float("nan")
        if dq is not None:
            dq = dq.masked_fill(bad[..., None], nan)
        if dk is not None or dv is not None:
            keys = routed_key_flags(bad, routes, *ctx.kv_shape)
            dk = None if dk is None else dk.masked_fill(keys, nan)
            dv = None if dv is None else dv.masked_fill(keys, nan)
        return dq, dk, dv, None, None


class _Leave(torch.autograd.Function):
    """Forward: NaN into the output of routed rows whose query was non-finite.
    Backward: non-finite output-gradient rows (and those NaN rows) zeroed before the
    kernel's backward; the bad routed rows go to :class:`_Enter` as the token's gradient."""

    @staticmethod
    def forward(ctx, out, token, query_bad, has_route):
        ctx.save_for_backward(query_bad, has_route)
        return out.masked_fill((query_bad & has_route[..., None])[..., None], float("nan"))

    @staticmethod
    def backward(ctx, grad):
        query_bad, has_route = ctx.saved_tensors
        bad = query_bad | _bad_rows(grad)
        token_grad = (bad & has_route[..., None]).to(torch.float32)
        return grad.masked_fill(bad[..., None], 0), token_grad, None, None


def confine_nonfinite(
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    routes: torch.Tensor,
) -> torch.Tensor:
    """``kernel(query, key, value)`` with non-finite rows kept to their routes (module
    docstring); the kernel itself unchanged, its autograd included.

    Args:
        kernel: the backend on ``[B, S_q, Hq, D]`` / ``[B, S_kv, Hkv, D]`` tensors,
            returning ``[B, S_q, Hq, D]``; row-confined in its forward (each output row
            reads only its own query row and routed keys) and giving rows without a
            valid route an output of 0.
        routes: ``[B, S_q, K]`` signed integer IDs in key coordinates, as the kernel
            reads them.

    Without gradients wanted the kernel runs bare (no extra work).
    """
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))):
        return kernel(query, key, value)
    query_bad = _bad_rows(query.detach())
    has_route = ((routes >= 0) & (routes < key.shape[1])).any(dim=-1)
    q, k, v, token = _Enter.apply(query, key, value, routes, query_bad)
    return _Leave.apply(kernel(q, k, v), token, query_bad, has_route)
