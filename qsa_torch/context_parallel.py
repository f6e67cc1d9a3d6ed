"""Context parallelism for QSA in PyTorch over ``torch.distributed``.

Each rank holds a contiguous slice of the query rows and the matching slice of
the key/value rows. K and V are all-gathered (one collective for both) into the
global sequence, and each rank attends its local queries to the global K/V with
routes in global coordinates (docs/contract.md layout 3). The gather is an autograd
function whose backward reduce-scatters dK/dV, so every rank receives the
gradient of exactly its own K/V slice, summed over all ranks' queries.

The attention itself is :func:`qsa_torch.sparse_gqa_attention` with ``backend``
(``"auto"`` by default: the fastest verified backend that takes ``S_q != S_kv``;
its backward runs the backend its forward ran), or any function with the
contract's signature (``attention_fn``): it sees ``S_q`` local rows and ``S_kv``
global rows.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from qsa_common.errors import InvalidInput

from .api import sparse_gqa_attention
from .routes import validate_inputs

__all__ = ["context_parallel_sparse_gqa_attention", "gather_sequence"]


def _tensor_collectives(tensor: torch.Tensor, group) -> bool:
    """NCCL has the flat-tensor collectives (reduce_scatter_tensor, all_gather_into_tensor);
    gloo may not, so it gets list all_gather and all_reduce + slice instead."""
    return tensor.is_cuda and "nccl" in str(dist.get_backend(group)).lower()


def _all_gather_stacked(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``local`` (contiguous, the same shape everywhere), stacked in rank order:
    ``[world, *local.shape]``."""
    stacked = local.new_empty((dist.get_world_size(group),) + tuple(local.shape))
    if _tensor_collectives(local, group):
        dist.all_gather_into_tensor(stacked, local, group=group)
    else:
        dist.all_gather(list(stacked.unbind(0)), local, group=group)
    return stacked


_SIGNATURE_DIMS = 8  # dimensions of each tensor compared across ranks (more are refused)


def _signature(tensors) -> list[int]:
    """Fixed-length ints describing ``tensors``: per tensor its ndim, dtype (a CRC of its
    name, the same in every process), whether it is on a CUDA device, and its shape
    (zeros for non-tensors)."""
    out: list[int] = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            out += [0] * (3 + _SIGNATURE_DIMS)
            continue
        shape = list(t.shape)
        out += [len(shape), zlib.crc32(str(t.dtype).encode()), int(t.is_cuda)]
        out += (shape + [0] * _SIGNATURE_DIMS)[:_SIGNATURE_DIMS]
    return out


def _agree_across_ranks(tensors, what: str, error: Exception | None, group) -> None:
    """Before any data moves: one small all-gather of every rank's ``_signature(tensors)``
    and of whether its own inputs were refused (``error``). Raises on every rank alike, so
    that no rank waits alone in the collectives that follow: ``error`` on the rank that
    had it, ValueError on the others; ValueError everywhere where the signatures differ.
    On NCCL groups the gather runs on the inputs' CUDA device and is read on the host
    (one synchronisation per call, which also keeps the call out of CUDA graphs)."""
    if error is None:
        deep = [t.dim() for t in tensors if isinstance(t, torch.Tensor) and t.dim() > _SIGNATURE_DIMS]
        if deep:
            error = ValueError(f"{what}: tensors of more than {_SIGNATURE_DIMS} dimensions are not supported, "
                               f"got {deep[0]}")
    world = dist.get_world_size(group)
    if world < 1:
        raise ValueError("this process is not a member of the process group it passed")
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    cuda = [t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
    if not nccl:
        device = torch.device("cpu")
    else:  # the inputs' own GPU, as the data collectives use (the current one for garbage inputs)
        device = cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([int(error is not None)] + _signature(tensors), dtype=torch.int64, device=device)
    every = _all_gather_stacked(mine, group).cpu()
    if error is not None:
        raise error
    refused = [r for r in range(world) if every[r, 0]]
    if refused:
        raise ValueError(f"{what}: the inputs of rank(s) {refused} of the group were refused (see their errors)")
    differ = [r for r in range(world) if not torch.equal(every[r, 1:], every[0, 1:])]
    if differ:
        raise ValueError(f"{what}: every rank must pass the same shapes, dtypes and device types; rank(s) "
                         f"{differ} differ from rank 0 (per tensor: ndim, dtype code, on CUDA, shape) "
                         f"{every[0, 1:].tolist()} vs "
                         f"{[every[r, 1:].tolist() for r in differ]}")


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; backward reduce-scatters the gradient along ``dim``."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        stacked = _all_gather_stacked(local.contiguous(), group)
        return torch.cat(stacked.unbind(0), dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, world = ctx.group, dist.get_world_size(ctx.group)
        parts = torch.stack(grad.chunk(world, dim=ctx.dim))  # [world, *local shape]
        if _tensor_collectives(parts, group):
            local = parts.new_empty(parts.shape[1:])
            dist.reduce_scatter_tensor(local, parts, op=dist.ReduceOp.SUM, group=group)
        else:
            dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=group)
            local = parts[dist.get_rank(group)].clone()  # do not pin the world-sized buffer
        return local, None, None


def gather_sequence(local: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Concatenate every rank's ``local`` along ``dim`` (rank order), differentiably.

    All ranks must pass the same shape and dtype (checked first, with one small
    collective: a mismatch raises ValueError on every rank). The gradient each rank gets
    back is the sum over ranks of the gradient flowing into its own slice.
    """
    _agree_across_ranks([local], "gather_sequence", None, group)
    return _GatherSequence.apply(local, dim, group)


def context_parallel_sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    group=None,
    backend: str | None = "auto",
    deterministic: bool | None = None,
    attention_fn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Route-sparse GQA with the sequence split over the ranks of ``group``.

    The arguments are named and ordered as ``qsa_jax.context_parallel_sparse_gqa_attention``'s
    (docs/api-names.md): the four arrays, the scale, then where the sequence is split
    (``group`` here, ``mesh``/``axis_name`` there), the backend, ``deterministic``, and
    each framework's extras. Unlike JAX's global arrays, each rank passes its local slices.

    Args:
        query: ``[B, S_q_local, Hq, D]``, this rank's query rows.
        key, value: ``[B, S_kv_local, Hkv, D]``, this rank's K/V rows;
            the same shape on every rank; rank r holds global rows
            ``r * S_kv_local .. (r+1) * S_kv_local - 1``.
        selected_token_ids: ``[B, S_q_local, K]`` routes of the local rows
            in global K/V coordinates ``[0, world * S_kv_local)``.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        group: process group (default: the world).
        backend: the :func:`qsa_torch.sparse_gqa_attention` backend, ``"auto"`` (or
            None) by default (resolved once, in the forward; the backward uses the same one).
        deterministic: :func:`qsa_torch.sparse_gqa_attention`'s.
        attention_fn: ``fn(query, key, value, routes, scale)`` accepting
            ``S_q != S_kv``, used instead of ``sparse_gqa_attention``; then
            ``backend`` must stay ``"auto"`` and ``deterministic`` None.

    Returns:
        ``[B, S_q_local, Hq, D]`` local output. Gradients reach ``query``,
        ``key`` and ``value`` (dK/dV reduce-scattered across ranks).

    Every rank's inputs are checked before any data moves, in one small collective (on
    NCCL, read on the host: one synchronisation per call): where one rank's inputs break
    the contract, or ranks pass K/V of different shapes or dtypes, every rank raises (the
    offending rank its own error, the others ValueError), so no rank waits alone.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: local inputs that break the contract (on any rank), K/V shapes or
            dtypes that differ across ranks, a process not in ``group``, or both
            ``backend`` and ``attention_fn`` given.
        TypeError: local inputs that break the contract.
    """
    if attention_fn is not None and (backend not in ("auto", None) or deterministic is not None):
        raise InvalidInput(f"pass backend ({backend!r}) / deterministic ({deterministic!r}) or attention_fn, "
                           "not both")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel_sparse_gqa_attention needs an initialised torch.distributed")
    try:
        validate_inputs(query, key, value, selected_token_ids, softmax_scale)
        error = None
    except (TypeError, ValueError) as err:
        error = err
    _agree_across_ranks([key, value], "context_parallel_sparse_gqa_attention", error, group)
    kv = _GatherSequence.apply(torch.stack([key, value]), 2, group)
    if attention_fn is not None:
        return attention_fn(query, kv[0], kv[1], selected_token_ids, softmax_scale)
    return sparse_gqa_attention(query, kv[0], kv[1], selected_token_ids, softmax_scale, backend=backend,
                                deterministic=deterministic)
