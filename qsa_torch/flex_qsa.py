"""Route-sparse GQA through PyTorch FlexAttention (``flex_qsa``).

Every layout (right-padded batches, packed THD rows, context-parallel shards
with ``S_q != S_kv``) is the same problem here: query row ``(b, i)`` attends to
the set of its valid route IDs. The routes become a boolean membership table
``[B, S_q, S_kv]``; the table is reduced per 128x128 tile into a FlexAttention
``BlockMask`` (empty tiles are skipped, full tiles run without the mask
callback, partial tiles read the table), and FlexAttention computes the
attention without a dense score tensor. Rows without a valid route give exact
zeros and contribute nothing to any gradient.

Devices:

* CUDA: FlexAttention is compiled with ``torch.compile(fullgraph=True,
  dynamic=False)`` on the first CUDA call (never at import); forward and backward.
  A compiled function specialises on every shape it sees, so inputs are first
  padded to bucketed shapes (:func:`bucket_length`, :func:`bucket_batch`: S up to
  2048 to a multiple of 128, longer S to one of 8 lengths per octave, at most
  12.5% more; padding rows route nowhere and are cut off again). Each bucketed
  shape compiles once (the fresh mask callback of each call does not recompile),
  and a process compiles at most :data:`MAX_COMPILED_SHAPES` of them: the call
  that would need one more raises ``RuntimeError``. Uncompiled FlexAttention
  (which materialises the ``[B, Hq, S_q, S_kv]`` scores) never runs on CUDA:
  dynamo's recompile limit is raised for these calls only and a compile that
  fails raises (``fullgraph=True``, ``fail_on_recompile_limit_hit``, no
  ``suppress_errors``).
* CPU: the same code runs FlexAttention uncompiled and unpadded, forward only and
  for small shapes (that path materialises the scores). FlexAttention has no CPU
  backward; asking for gradients on CPU raises ``UnsupportedDevice``.

Memory: the membership table costs ``B * S_q * S_kv`` bytes of the bucketed
shape (2.25 GiB for one 49152-token sequence, 64 GiB at 262144), about twice that
while it is built; a CUDA call that would not fit raises ``torch.OutOfMemoryError``
before allocating anything.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qsa_common._extras import installed
from qsa_common.errors import BackendDeclined, MissingRuntime, UnsupportedDevice, UnsupportedDtype

from ._nonfinite import confine_nonfinite
from .routes import ProblemDims, dtype_name, membership_table, needs_grad, validate_inputs
from .routes import available_device_bytes as _available_bytes

__all__ = ["MAX_COMPILED_SHAPES", "NoCPUBackward", "bucket_batch", "bucket_length", "flex_sparse_gqa_attention",
           "supports"]


class NoCPUBackward(UnsupportedDevice, NotImplementedError):
    """Gradients asked of FlexAttention on CPU: a decline, and a ``NotImplementedError`` for
    callers that run a forward alone where a backward is not implemented (parity harness)."""


# looked up once, at import (dynamo traces supports() under torch.compile: no importlib there)
_RUNTIME = "torch.nn.attention.flex_attention"
_HAS_RUNTIME = installed(_RUNTIME)

# FlexAttention's sparse tile (query rows x key rows) of the BlockMask.
_TILE = 128
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Compiled specialisations (bucketed shape, dtype, device, grad mode, scale) one process
# may create; a training run over S in [128, 32768] at one batch size needs 48 per mode.
MAX_COMPILED_SHAPES = 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def bucket_length(n: int) -> int:
    """The padded length of a sequence of ``n`` rows: a multiple of 128 up to 2048,
    beyond that a multiple of ``next_pow2(n) / 16`` (8 lengths per octave, at most
    12.5% padding)."""
    step = max(_TILE, _next_pow2(n) // 16)
    return -(-int(n) // step) * step


def bucket_batch(b: int) -> int:
    """The padded batch size: exact up to 16, beyond that a multiple of
    ``next_pow2(b) / 16`` (8 sizes per octave, at most 12.5% padding)."""
    step = max(1, _next_pow2(b) // 16)
    return -(-int(b) // step) * step


def _compile_flex(compiler: Callable | None = None) -> Callable:
    """``torch.compile(flex_attention, fullgraph=True, dynamic=False)`` (or ``compiler``
    with those arguments); imports inductor only when first called."""
    from torch.nn.attention.flex_attention import flex_attention

    return (compiler or torch.compile)(flex_attention, fullgraph=True, dynamic=False)


def _dynamo_limits(shapes: int) -> dict:
    """Dynamo settings for a compiled FlexAttention call: room for ``shapes``
    specialisations, and a hard error (never an uncompiled run) past them or on any
    compile failure. Options this torch does not have are left out."""
    config = torch._dynamo.config
    wanted = dict(
        recompile_limit=max(config.recompile_limit, shapes),
        accumulated_recompile_limit=max(config.accumulated_recompile_limit, 2 * shapes),
        fail_on_recompile_limit_hit=True,
        suppress_errors=False,
    )
    return {name: value for name, value in wanted.items() if hasattr(config, name)}


class _CompiledFlex:
    """Compiled FlexAttention and the bucketed shapes it has been specialised to.

    ``compiler`` replaces ``torch.compile`` (tests count compilations with it).
    """

    def __init__(self, compiler: Callable | None = None):
        self._compiler = compiler
        self._function: Callable | None = None
        self.shapes: set[tuple] = set()

    def __call__(self, q, k, v, block_mask, scale: float) -> torch.Tensor:
        """FlexAttention on ``[B, H, S, D]`` tensors of a bucketed shape."""
        key = (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), torch.is_grad_enabled(),
               tuple(t.requires_grad for t in (q, k, v)), float(scale))
        if key not in self.shapes and len(self.shapes) >= MAX_COMPILED_SHAPES:
            raise RuntimeError(
                f"flex_sparse_gqa_attention: compiled FlexAttention already holds "
                f"{len(self.shapes)} specialisations in this process (MAX_COMPILED_SHAPES), "
                f"and query {tuple(q.shape)} / key {tuple(k.shape)} ({q.dtype}) would need "
                "another; it does not fall back to uncompiled FlexAttention (O(S^2) memory). "
                "Use a token-gather backend (triton) for inputs of this many shapes."
            )
        if self._function is None:
            self._function = _compile_flex(self._compiler)
        from torch._dynamo import exc as dynamo_errors

        limit_hit = getattr(dynamo_errors, "FailOnRecompileLimitHit", ())  # () catches nothing
        with torch._dynamo.config.patch(**_dynamo_limits(MAX_COMPILED_SHAPES + 8)):
            try:
                out = self._function(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
            except limit_hit as err:
                raise RuntimeError(
                    "flex_sparse_gqa_attention: torch.compile refused to specialise "
                    f"FlexAttention for query {tuple(q.shape)} / key {tuple(k.shape)} "
                    f"(dynamo's recompile limit); it does not run uncompiled: {err}"
                ) from err
        self.shapes.add(key)
        return out


_COMPILED = _CompiledFlex()


def _membership_flat_offset(
    batch_idx: torch.Tensor,
    query_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    query_length: int,
    kv_length: int,
) -> torch.Tensor:
    """int64 offset of ``[batch_idx, query_idx, kv_idx]`` in a flattened
    ``[B, query_length, kv_length]`` table.

    FlexAttention hands the mask callback int32 coordinates and inlines the
    callback into its kernels, so ``query_idx * kv_length`` in int32 wraps as
    soon as the table has more than 2**31 entries (one square sequence of
    46341 tokens): the last query rows then read another row's mask, or fault.
    Widening every operand first keeps the generated address arithmetic int64.
    Coordinates must already be in range.
    """
    b = batch_idx.to(torch.int64)
    q = query_idx.to(torch.int64)
    kv = kv_idx.to(torch.int64)
    return (b * query_length + q) * kv_length + kv


def _routes_to_membership(
    selected_token_ids: torch.Tensor, kv_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, has_route)`` of ``[B, S_q, K]`` routes (IDs outside ``[0, kv_length)``
    are padding): contiguous bool ``[B, S_q, kv_length]``, True where the key is a route
    of the row (contiguous: the mask callback addresses it as one flat buffer through
    :func:`_membership_flat_offset`), and bool ``[B, S_q]``, True where a row has one."""
    table = membership_table(selected_token_ids, kv_length)
    ids = selected_token_ids
    # from the routes (K per row), not from the table (S_kv per row)
    has_route = ((ids >= 0) & (ids < kv_length)).any(dim=-1)
    return table, has_route


def _tile_counts(table: torch.Tensor) -> torch.Tensor:
    """Member cells per ``_TILE x _TILE`` tile: int32 ``[B, ceil(S_q/T), ceil(S_kv/T)]``.

    Two reductions over views of the table (along keys, then along query rows);
    the ragged last tiles are summed over their in-range cells only.
    """
    bsz, s_q, s_kv = table.shape
    n_q, n_kv = -(-s_q // _TILE), -(-s_kv // _TILE)
    whole = s_kv // _TILE
    # The first reduction reads the table as uint8 and sums into uint8 (at most
    # _TILE = 128 per row and tile): any wider dtype would make torch cast the
    # whole table first, a temporary several times the table's size.
    cells = table.view(torch.uint8)
    per_row = torch.zeros(bsz, s_q, n_kv, dtype=torch.uint8, device=table.device)
    if whole:
        per_row[..., :whole] = (
            cells[..., : whole * _TILE].unflatten(-1, (whole, _TILE)).sum(-1, dtype=torch.uint8)
        )
    if whole < n_kv:
        per_row[..., whole] = cells[..., whole * _TILE :].sum(-1, dtype=torch.uint8)
    per_row = torch.nn.functional.pad(per_row.to(torch.int32), (0, 0, 0, n_q * _TILE - s_q))
    return per_row.view(bsz, n_q, _TILE, n_kv).sum(2, dtype=torch.int32)


def _block_lists(present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[B, n_q, n_kv]`` -> counts int32 ``[B, 1, n_q]`` and ascending
    column indices int32 ``[B, 1, n_q, n_kv]`` (entries past the count are
    the absent columns, which FlexAttention never reads)."""
    counts = present.sum(-1, dtype=torch.int32)
    order = torch.argsort(present.to(torch.uint8), dim=-1, descending=True, stable=True)
    return counts[:, None].contiguous(), order.to(torch.int32)[:, None].contiguous()


def _tile_kinds(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[B, n_q, n_kv]`` partial and full tiles of the table.

    A tile is full when all ``_TILE * _TILE`` of its cells are members, which
    only an in-range tile can be; ragged edge tiles are at most partial, so the
    callback always sees them. A tile with no member is neither.
    """
    counts = _tile_counts(table)
    full = counts == _TILE * _TILE
    return (counts > 0) & ~full, full


def _membership_mask_mod(table: torch.Tensor):
    """FlexAttention ``mask_mod`` reading ``table`` ``[B, S_q, S_kv]`` (contiguous)."""
    _, query_length, kv_length = table.shape
    flat = table.view(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        # FlexAttention keeps ragged-edge coordinates in range itself; the clamp
        # makes any out-of-range coordinate read a real cell, never stray memory.
        q = q_idx.clamp(0, query_length - 1)
        kv = kv_idx.clamp(0, kv_length - 1)
        return flat[_membership_flat_offset(b, q, kv, query_length, kv_length)]

    return mask_mod


def _block_mask_from_table(table: torch.Tensor):
    """The FlexAttention ``BlockMask`` of ``table`` (one head, broadcast to all)."""
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = _tile_kinds(table)
    kv_num_blocks, kv_indices = _block_lists(partial)
    full_kv_num_blocks, full_kv_indices = _block_lists(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks=kv_num_blocks,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num_blocks,
        full_kv_indices=full_kv_indices,
        BLOCK_SIZE=_TILE,
        mask_mod=_membership_mask_mod(table),
        seq_lengths=(table.shape[1], table.shape[2]),
    )


def _run_flex(query, key, value, block_mask, scale: float, compiled: _CompiledFlex | None = None
              ) -> torch.Tensor:
    """FlexAttention on ``[B, S, H, D]`` tensors, as it is: no empty-row fix.

    ``compiled``: run through it (bucketed shapes); else FlexAttention as a plain
    call: traced by an enclosing ``torch.compile``, or eager and unfused on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if compiled is not None:
        out = compiled(q, k, v, block_mask, scale)
    elif torch.compiler.is_compiling():
        out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    else:
        # FlexAttention refuses CPU inputs that require grad even under no_grad
        q, k, v = (t.detach() for t in (q, k, v))
        with warnings.catch_warnings():
            # the unfused CPU path is intended here (small forward-only shapes)
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _bucketed(dims: ProblemDims) -> ProblemDims:
    """``dims`` with B, S_q and S_kv padded to their buckets."""
    return ProblemDims(bucket_batch(dims.batch), bucket_length(dims.query_length),
                       bucket_length(dims.kv_length), dims.query_heads, dims.kv_heads,
                       dims.head_dim, dims.routes_per_query)


def _pad_rows(x: torch.Tensor, batch: int, rows: int, value=0) -> torch.Tensor:
    """``x`` ``[B, S, ...]`` padded with ``value`` to ``[batch, rows, ...]``; always a
    contiguous tensor (the compiled function specialises on strides too)."""
    extra = (0, 0) * (x.dim() - 2) + (0, rows - x.shape[1], 0, batch - x.shape[0])
    if not any(extra):
        return x.contiguous()
    return F.pad(x, extra, value=value)


def _attend_bucketed(query, key, value, routes, dims: ProblemDims, scale: float,
                     compiled: _CompiledFlex) -> torch.Tensor:
    """The compiled path: inputs padded to the bucketed shape, padding rows routing
    nowhere (route IDs are cut to the true S_kv first), the result cut back."""
    padded = _bucketed(dims)
    available = _available_bytes(query.device)
    if available is not None:
        _check_table_fits(padded, available)
    valid = (routes >= 0) & (routes < dims.kv_length)
    has_route = valid.any(dim=-1)
    routes = torch.where(valid, routes, torch.full((), -1, dtype=routes.dtype, device=routes.device))
    routes = _pad_rows(routes, padded.batch, padded.query_length, -1)
    q = _pad_rows(query, padded.batch, padded.query_length)
    k, v = (_pad_rows(t, padded.batch, padded.kv_length) for t in (key, value))
    block_mask = _block_mask_from_table(membership_table(routes, padded.kv_length))
    out = _run_flex(q, k, v, block_mask, scale, compiled)[: dims.batch, : dims.query_length]
    return torch.where(has_route[:, :, None, None], out, out.new_zeros(()))


def _table_build_bytes(dims: ProblemDims) -> int:
    """Device bytes to build the table and its tile lists (an upper estimate).

    The table itself is ``B * S_q * S_kv`` bytes; while it is built a padded
    scatter buffer of the same size also lives, plus int64 copies of the routes
    and the per-row tile counts.
    """
    rows = dims.batch * dims.query_length
    table = rows * dims.kv_length
    scatter = rows * (dims.kv_length + 1)
    routes = rows * dims.routes_per_query * (3 * 8 + 2)
    per_row_tiles = rows * math.ceil(dims.kv_length / _TILE) * 4
    return table + scatter + routes + per_row_tiles


def _check_table_fits(dims: ProblemDims, available_bytes: int) -> None:
    """Raise ``torch.OutOfMemoryError`` (a RuntimeError) unless the table fits."""
    need = _table_build_bytes(dims)
    if need > available_bytes:
        table = dims.batch * dims.query_length * dims.kv_length
        raise torch.OutOfMemoryError(
            "flex_sparse_gqa_attention: the membership table for selected_token_ids "
            f"[B={dims.batch}, S_q={dims.query_length}] over S_kv={dims.kv_length} keys "
            f"takes {table / 2**30:.2f} GiB (B*S_q*S_kv bytes), about {need / 2**30:.2f} GiB "
            f"while it is built, but only {available_bytes / 2**30:.2f} GiB of device memory "
            "is free; use shorter sequences, fewer rows per call, or a token-gather backend"
        )


def flex_sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Route-sparse GQA computed by FlexAttention.

    Args:
        query: ``[B, S_q, Hq, D]``, bf16, fp16 or fp32 (bf16 is the fast path).
        key: ``[B, S_kv, Hkv, D]``, query's dtype and device; Hq % Hkv == 0.
            S_kv may differ from S_q (a context-parallel shard against the
            gathered global K/V).
        value: key's shape, dtype and device.
        selected_token_ids: ``[B, S_q, K]`` signed int32/int64 route IDs in K/V
            coordinates; negative, ``>= S_kv`` and huge IDs are padding,
            duplicates count once. No other mask is added.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype. Rows without a valid route are
        exactly 0, with exactly zero dq and no contribution to dk/dv. A non-finite
        query or output-gradient row reaches only its own out/dq and the dk/dv of
        its routed keys (:func:`qsa_torch._nonfinite.confine_nonfinite`).

    Device and gradients: on CUDA, forward and backward through the compiled
    kernel, on inputs padded to the bucketed shape (module docstring). On CPU,
    forward only (uncompiled, small shapes): if autograd is on
    (``torch.is_grad_enabled()``) and any of query/key/value requires grad,
    :class:`~qsa_common.errors.UnsupportedDevice` is raised before any work; call it under
    ``torch.no_grad()`` or with detached inputs for a CPU forward. Inside an
    enclosing ``torch.compile`` the call is traced into that graph instead.

    Memory: the membership table takes ``B * S_q * S_kv`` bytes of the bucketed
    shape (about twice that while built). On CUDA the call first checks that this
    fits the free device memory and otherwise raises ``torch.OutOfMemoryError``.

    Raises:
        InvalidInput / InvalidDtype: the contract's checks.
        BackendDeclined: what :func:`supports` returns (UnsupportedDtype: fp64;
            UnsupportedDevice: a device other than CUDA or CPU, or gradients requested
            on CPU; MissingRuntime: no FlexAttention in this torch).
        torch.OutOfMemoryError: (a RuntimeError) the table does not fit on the GPU.
        RuntimeError: the bucketed shape would be compiled specialisation number
            :data:`MAX_COMPILED_SHAPES` + 1, or torch.compile refuses it.
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    declined = supports(query, key, value, selected_token_ids)
    if declined is not None:
        raise declined
    dims, routes = checked.dims, selected_token_ids

    def kernel(query, key, value):
        if query.device.type == "cuda" and not torch.compiler.is_compiling():
            return _attend_bucketed(query, key, value, routes, dims, checked.scale, _COMPILED)
        table, has_route = _routes_to_membership(routes, dims.kv_length)
        out = _run_flex(query, key, value, _block_mask_from_table(table), checked.scale)
        # where(), not a multiply: exact zeros even if the kernel left NaN there,
        # and its backward passes a zero gradient into the kernel for those rows.
        return torch.where(has_route[:, :, None, None], out, out.new_zeros(()))

    # FlexAttention's backward multiplies whole tiles (0 * NaN across a tile's keys)
    return confine_nonfinite(kernel, query, key, value, routes)


def supports(query, key, value, selected_token_ids, *, softmax_scale=None,
             deterministic=False) -> BackendDeclined | None:
    """Why FlexAttention cannot take these (valid) inputs, or None: fp64
    (UnsupportedDtype), a device other than CUDA or CPU, or gradients wanted on CPU
    (UnsupportedDevice: FlexAttention has no CPU backward), no FlexAttention in this
    torch (MissingRuntime). Its backward is deterministic."""
    del selected_token_ids, softmax_scale, deterministic
    if query.dtype not in _DTYPES:
        return UnsupportedDtype(f"FlexAttention computes in {', '.join(dtype_name(d) for d in _DTYPES)} only; query is "
                                f"{dtype_name(query.dtype)}")
    if query.device.type not in ("cuda", "cpu"):
        return UnsupportedDevice(f"query is on {query.device}; flex_sparse_gqa_attention runs on CUDA or CPU only")
    if query.device.type == "cpu" and needs_grad(query, key, value):
        return NoCPUBackward("flex_sparse_gqa_attention: gradients need a CUDA device; FlexAttention has no CPU "
                             "backward. On CPU call it under torch.no_grad() or with inputs that do not require "
                             "grad (forward only).")
    if not _HAS_RUNTIME:
        return MissingRuntime(f"optional runtime {_RUNTIME!r} is not installed")
    return None
