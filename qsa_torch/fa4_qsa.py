"""Route-sparse GQA on SM90 (H100/H200) through FlashAttention 4 (``flash_attn.cute``).

How a call runs:

1. :func:`_preprocess` (torch ops, ``torch.compile``'d on the first CUDA call,
   no host synchronisation) turns the routes into a uint8 membership table
   ``[B, S_q_pad, S_kv_pad]`` padded with zeros to whole 128 x 64 tiles, and
   classifies every tile (128 query rows x 64 keys) as absent, partial or full.
   The partial and full tiles become FA4 block-sparse lists: per 128-query block
   for the forward, per 64-key block (the transpose) for the backward.
2. FA4's ``flash_attn_func`` runs forward and backward (its own autograd) over
   the listed tiles only. Full tiles skip the mask; on partial tiles a CuTe mask
   callback reads the table through ``aux_tensors``.
3. Rows without routes are zeroed in the output (and their query rows before the
   kernel), so they have an exact zero output and zero ``dq`` and add nothing to
   ``dk``/``dv`` (their scores are all masked, so FA4's P is exactly 0 there).

The CuTe DSL and flash-attn-4 are imported by :func:`_load_fa4` on the first
CUDA call, never when this module is imported.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qsa_common._extras import installed
from qsa_common.errors import (
    BackendDeclined,
    DeterminismUnavailable,
    MissingRuntime,
    UnsupportedDevice,
    UnsupportedDtype,
    UnsupportedShape,
)

from ._nonfinite import confine_nonfinite
from .routes import ProblemDims, check_deterministic_backward, dtype_name, membership_table, needs_grad, validate_inputs
from .routes import available_device_bytes as _available_bytes

__all__ = ["fa4_sparse_gqa_attention", "supports"]

_INSTALL_HINT = "pip install flash-attn-4"


# looked up once, at import (dynamo traces supports() under torch.compile: no importlib there)
_HAS_RUNTIME = installed("flash_attn")

QUERY_BLOCK = 128  # query rows per tile: FA4's SM90 forward tile_m at head dim 256
KEY_BLOCK = 64  # keys per tile: the only sparse KV block FA4 accepts at head dim 256
HEAD_DIM = 256
# Bytes one FA4 call's membership table may hold. The mask callback indexes the
# table with 32-bit arithmetic, so larger problems are split into several FA4
# calls over disjoint query rows (each with its own table and lists).
_TABLE_LIMIT = 2**31 - 1

# CuTe DSL modules; bound by _load_fa4 and read by the mask callback at trace time.
cutlass = None
_fa_utils = None


def _route_mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """FA4 mask callback: keep score (q_idx, kv_idx) iff the membership byte is set.

    Arguments are FA4's: one-element index vectors (``head`` is unused: all heads
    share the routes), the sequence-length info (unused) and ``aux_tensors``,
    whose first entry is the padded uint8 table ``[B, S_q_pad, S_kv_pad]``.
    Compiled by ``cute.jit`` in :func:`_load_fa4`; FA4 caches kernels by this
    function's source, so it lives at module level and never changes.
    """
    table = aux_tensors[0]
    member = table[batch[0], q_idx[0], kv_idx[0]].to(cutlass.Int32)
    zero = cutlass.Int32(0)
    return _fa_utils.scalar_to_ssa(member, cutlass.Int32) != _fa_utils.scalar_to_ssa(
        zero, cutlass.Int32
    )


@functools.cache
def _load_fa4():
    """Cache FA4's entry points and the jitted mask callback (never tensors).

    Returns ``(flash_attn_func, BlockSparseTensorsTorch, mask_mod)``.

    Raises:
        ImportError: flash-attn-4 or the CuTe DSL is not importable.
    """
    global cutlass, _fa_utils
    try:
        import cutlass as cutlass_module
        import cutlass.cute as cute
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute import utils as fa_utils
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except ImportError as exc:
        raise MissingRuntime(
            "fa4_sparse_gqa_attention needs flash-attn-4 (the `flash_attn.cute` package and "
            "the CuTe DSL, nvidia-cutlass-dsl) on a CUDA machine with an SM90 GPU: "
            "pip install flash-attn-4"
        ) from exc
    cutlass, _fa_utils = cutlass_module, fa_utils
    # never traced: under an enclosing torch.compile the FA4 call stays an eager call
    return (
        torch.compiler.disable(flash_attn_func),
        BlockSparseTensorsTorch,
        cute.jit(_route_mask_mod),
    )


@functools.cache
def _compiled_preprocess():
    """:func:`_preprocess` under ``torch.compile`` (built on first use, CUDA only).

    Symbolic shapes from the start: one graph serves every (B, S_q, S_kv), with
    about one recompile (sizes that are whole tiles versus ragged ones).
    """
    return torch.compile(_preprocess, dynamic=True)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _block_kinds(membership: torch.Tensor, block_keys: int) -> torch.Tensor:
    """Classify tiles of 128 query rows x ``block_keys`` keys, without host sync.

    Args:
        membership: uint8 ``[B, S_q, S_kv]`` (1 = route), any sizes; the tiles
            at ragged edges are completed with zeros.
        block_keys: keys per tile.

    Returns:
        int32 ``[B, ceil(S_q/128), ceil(S_kv/block_keys)]``: 0 where the tile
        holds no route, 2 where every one of its 128 * block_keys entries is a
        route (so an edge tile that sticks out of the table is never full), 1
        otherwise.
    """
    b, s_q, s_kv = membership.shape
    rows, cols = _ceil_div(s_q, QUERY_BLOCK), _ceil_div(s_kv, block_keys)
    pad_q, pad_kv = rows * QUERY_BLOCK - s_q, cols * block_keys - s_kv
    if pad_q or pad_kv:
        membership = F.pad(membership, (0, pad_kv, 0, pad_q))
    count = membership.reshape(b, rows, QUERY_BLOCK, cols, block_keys).sum(
        dim=(2, 4), dtype=torch.int32
    )
    full = count == QUERY_BLOCK * block_keys
    return (count > 0).to(torch.int32) + full.to(torch.int32)


def _compact_blocks(kinds: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Left-packed, ascending lists of the partial and of the full columns of each row.

    Args:
        kinds: integer ``[B, rows, cols]`` with 0 (absent), 1 (partial), 2 (full).

    Returns:
        ``(partial_count, partial_index, full_count, full_index)``, all int32 and
        contiguous: counts ``[B, 1, rows]``, indices ``[B, 1, rows, cols]``. Row
        ``r``'s first ``count`` indices are its columns of that kind in
        ascending order (FA4's forward walks them from the end, so the edge tile,
        the highest column, comes first); the remaining entries are 0. The
        singleton dimension is the head dimension FA4 broadcasts.
    """
    cols = kinds.shape[-1]
    slots = torch.arange(cols, device=kinds.device)
    lists = []
    for kind in (1, 2):
        hit = kinds == kind
        count = hit.sum(dim=-1, dtype=torch.int32)
        # a stable sort of "not hit" puts the hit columns first, in ascending order
        order = torch.sort((~hit).to(torch.uint8), dim=-1, stable=True).indices
        index = torch.where(slots < count[..., None], order, torch.zeros_like(order))
        lists += [count[:, None].contiguous(), index.to(torch.int32)[:, None].contiguous()]
    return tuple(lists)


def _preprocess(routes: torch.Tensor, kv_length: int) -> tuple[torch.Tensor, ...]:
    """Membership table and FA4 block lists of one call, without host sync.

    Args:
        routes: signed int32/int64 ``[B, S_q, K]``. IDs outside ``[0, kv_length)``
            (negative, past the end, huge int64) are dropped before any indexing;
            repeated IDs mark the same entry once.
        kv_length: S_kv > 0, the number of physical key/value rows.

    Returns:
        ``(table, row_has_route, *forward_lists, *backward_lists)``:

        * ``table``: uint8 ``[B, S_q_pad, S_kv_pad]``, 1 where the key is a route
          of the row, padded with zeros to whole tiles (``S_q_pad`` a multiple of
          128, ``S_kv_pad`` of 64) because the mask callback also reads the rows
          and keys of an edge tile that lie past the ends.
        * ``row_has_route``: bool ``[B, S_q]``.
        * forward lists (:func:`_compact_blocks` of the tile kinds): per 128-query
          block, the 64-key blocks, counts ``[B, 1, S_q_pad/128]``.
        * backward lists (of the transposed kinds): per 64-key block, the
          128-query blocks, counts ``[B, 1, S_kv_pad/64]``.
    """
    _, s_q, _ = routes.shape
    pad_q = _ceil_div(s_q, QUERY_BLOCK) * QUERY_BLOCK - s_q
    pad_kv = _ceil_div(kv_length, KEY_BLOCK) * KEY_BLOCK - kv_length
    table = F.pad(membership_table(routes, kv_length, dtype=torch.uint8), (0, pad_kv, 0, pad_q))
    row_has_route = table[:, :s_q].amax(dim=-1) != 0
    kinds = _block_kinds(table, KEY_BLOCK)
    return (table, row_has_route, *_compact_blocks(kinds), *_compact_blocks(kinds.transpose(1, 2)))


def _chunks(batch: int, query_length: int, kv_length: int, limit: int | None = None):
    """Split a call so that each FA4 call's table has at most ``limit`` bytes.

    Returns a list of ``(batch_slice, row_slice)`` covering every (batch row,
    query row) once, batch-major. Whole batch rows are grouped when one row's
    table fits; otherwise each batch row is cut into runs of query rows that
    are multiples of 128.

    Raises:
        UnsupportedShape: a single 128-row tile row of the table exceeds ``limit``.
    """
    limit = _TABLE_LIMIT if limit is None else limit
    kv_pad = _ceil_div(kv_length, KEY_BLOCK) * KEY_BLOCK
    per_batch = _ceil_div(query_length, QUERY_BLOCK) * QUERY_BLOCK * kv_pad
    if per_batch <= limit:
        step = limit // per_batch
        rows_all = slice(0, query_length)
        return [(slice(b, min(b + step, batch)), rows_all) for b in range(0, batch, step)]
    rows = limit // kv_pad // QUERY_BLOCK * QUERY_BLOCK
    if rows == 0:
        raise UnsupportedShape(
            f"key length {kv_length} is too long for the FA4 backend: one 128-row slice of "
            f"its membership table would exceed {limit} bytes"
        )
    return [
        (slice(b, b + 1), slice(r, min(r + rows, query_length)))
        for b in range(batch)
        for r in range(0, query_length, rows)
    ]


def _memory_needed(dims: ProblemDims, needs_grad: bool) -> tuple[int, int]:
    """``(tables, peak)``: bytes of all the call's membership tables, and an upper
    estimate of the device memory its preprocessing needs at once.

    Each FA4 call of :func:`_chunks` has a uint8 table of ``rows * S_q_pad * S_kv_pad``
    bytes (query rows padded to 128, keys to 64). With gradients every call's table
    lives until the backward (FA4's mask callback reads it there); without, one at a
    time. While a table is built, the scatter buffer, its contiguous slice and the
    padded copy (three tables) and int64 copies of that call's routes also live.
    """
    kv_pad = _ceil_div(dims.kv_length, KEY_BLOCK) * KEY_BLOCK
    tables, routes = [], []
    for batch_rows, query_rows in _chunks(dims.batch, dims.query_length, dims.kv_length):
        n_batch, n_rows = batch_rows.stop - batch_rows.start, query_rows.stop - query_rows.start
        tables.append(n_batch * _ceil_div(n_rows, QUERY_BLOCK) * QUERY_BLOCK * kv_pad)
        routes.append(n_batch * n_rows * dims.routes_per_query * 3 * 8)
    kept = sum(tables) if needs_grad else 0
    return sum(tables), kept + 3 * max(tables) + max(routes)


def _check_memory(dims: ProblemDims, needs_grad: bool, available_bytes: int | None) -> None:
    """Raise ``torch.OutOfMemoryError`` (a RuntimeError) when the membership tables would
    not fit ``available_bytes`` (None: not checked)."""
    if available_bytes is None:
        return
    tables, need = _memory_needed(dims, needs_grad)
    if need > available_bytes:
        kept = "kept for the backward" if needs_grad else "built one FA4 call at a time"
        raise torch.OutOfMemoryError(
            "fa4_sparse_gqa_attention: the membership tables for selected_token_ids "
            f"[B={dims.batch}, S_q={dims.query_length}] over S_kv={dims.kv_length} keys take "
            f"{tables / 2**30:.2f} GiB (B*S_q*S_kv bytes padded to 128x64 tiles, {kept}), about "
            f"{need / 2**30:.2f} GiB with their construction, but only "
            f"{available_bytes / 2**30:.2f} GiB of device memory is free; use shorter sequences, "
            "fewer rows per call, or a token-gather backend"
        )


def _device_declined(device: torch.device) -> UnsupportedDevice | None:
    """UnsupportedDevice off CUDA or on a GPU other than SM90, else None."""
    if device.type != "cuda":
        return UnsupportedDevice(f"the FA4 backend needs CUDA tensors on an SM90 (Hopper) GPU; query is on {device}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) != (9, 0):
        major, minor = capability
        return UnsupportedDevice(f"the FA4 backend needs an SM90 (Hopper) GPU (H100/H200); {device} is "
                                 f"sm_{major}{minor}")
    return None


def _check_device(device: torch.device) -> None:
    """Raise :func:`_device_declined`'s UnsupportedDevice (a RuntimeError), if any."""
    declined = _device_declined(device)
    if declined is not None:
        raise declined


def supports(query, key, value, selected_token_ids, *, softmax_scale=None,
             deterministic=False) -> BackendDeclined | None:
    """Why FA4 cannot take these (valid) inputs, or None, checked in this order without
    touching device data: not an SM90 GPU (UnsupportedDevice), not bf16
    (UnsupportedDtype), flash-attn-4 absent (MissingRuntime), ``deterministic`` with
    gradients wanted (DeterminismUnavailable: the backward uses fp32 atomics), head dim
    other than 256 (UnsupportedShape)."""
    del selected_token_ids, softmax_scale
    declined = _device_declined(query.device)
    if declined is not None:
        return declined
    if query.dtype != torch.bfloat16:
        return UnsupportedDtype(f"the FA4 backend computes in bfloat16 only; query is {dtype_name(query.dtype)}")
    if not _HAS_RUNTIME:
        return MissingRuntime(f"the FA4 backend needs flash-attn-4, which is not installed: {_INSTALL_HINT}")
    if deterministic and needs_grad(query, key, value):
        return DeterminismUnavailable("the FA4 backend's backward is not deterministic (fp32 atomics)")
    if query.shape[-1] != HEAD_DIM:
        return UnsupportedShape(f"the FA4 backend needs head dim {HEAD_DIM}, got {query.shape[-1]}")
    return None


class _MaskEmptyRows(torch.autograd.Function):
    """Zero the output rows without routes and their gradient; first order only.

    ``masked_fill`` (not a multiply) so that whatever FA4 left there, even NaN,
    becomes an exact 0, and the incoming gradient of those rows is dropped.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, row_has_route: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(row_has_route)
        return out.masked_fill(~row_has_route[:, :, None, None], 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fa4_sparse_gqa_attention supports first-order gradients only; "
                "backward with create_graph=True (higher-order gradients) is not available"
            )
        (row_has_route,) = ctx.saved_tensors
        return grad.masked_fill(~row_has_route[:, :, None, None], 0), None


def _fa4_kwargs(plan: tuple[torch.Tensor, ...], fa4) -> dict:
    """``flash_attn_func`` keyword arguments for one :func:`_preprocess` result."""
    _, sparse_tensors, mask_mod = fa4
    table, _, *lists = plan
    table.__leading_dim__ = 2  # FA4 keeps the stride-1 dimension of an aux tensor static
    names = ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx")
    tiles = (QUERY_BLOCK, KEY_BLOCK)
    return dict(
        mask_mod=mask_mod,
        aux_tensors=[table],
        block_sparse_tensors=sparse_tensors(**dict(zip(names, lists[:4])), block_size=tiles),
        block_sparse_tensors_bwd=sparse_tensors(**dict(zip(names, lists[4:])), block_size=tiles),
    )


def _attend(query, key, value, routes, scale, fa4, preprocess) -> torch.Tensor:
    """One FA4 call: preprocessing, the kernel, and the empty-row guards."""
    plan = preprocess(routes, key.shape[1])
    row_has_route = plan[1]
    # Rows without routes get a zero query: their scores are all masked anyway,
    # and masked_fill's backward gives them an exact zero dq.
    query = query.masked_fill(~row_has_route[:, :, None, None], 0)
    if query.stride(-1) != 1:
        query = query.contiguous()
    result = fa4[0](query, key, value, softmax_scale=scale, **_fa4_kwargs(plan, fa4))
    out = result[0] if isinstance(result, (tuple, list)) else result
    return _MaskEmptyRows.apply(out, row_has_route)


def fa4_sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Exact route-set GQA with FlashAttention 4 on an SM90 GPU.

    Query row ``i`` of batch row ``b`` attends to the set of valid IDs in
    ``selected_token_ids[b, i]`` and to nothing else: duplicates count once,
    IDs outside ``[0, S_kv)`` are padding, and no causal or other mask is added
    (routes carry causality, documents and padding). Works for right-padded
    batches, packed rows and context-parallel shards (local queries against the
    gathered global K/V, routes in global coordinates).

    Args:
        query: bf16 CUDA ``[B, S_q, Hq, 256]``; any strides (a non-unit last
            stride is copied).
        key: bf16 CUDA ``[B, S_kv, Hkv, 256]``, Hq a positive multiple of Hkv.
        value: like ``key``.
        selected_token_ids: signed int32/int64 ``[B, S_q, K]`` on the same
            device, any layout. All dimensions non-empty.
        softmax_scale: finite positive score multiplier, default ``1/sqrt(256)``.

    Returns:
        A new bf16 ``[B, S_q, Hq, 256]`` tensor. Rows without routes are exactly
        0, with exactly zero ``dq`` and no contribution to ``dk``/``dv``.
        A non-finite query or output-gradient row reaches only its own out/dq and
        the dk/dv of its routed keys (:mod:`qsa_torch._nonfinite`).
        Differentiable once in query, key and value through FA4's backward
        (not deterministic; fp32 accumulation).

    Memory: uint8 membership tables of ``B * S_q * S_kv`` bytes (padded to 128 x 64
    tiles; 64 GiB at S = 262144), all kept until the backward when gradients are
    needed; :func:`_memory_needed` adds what building them takes. A call that would
    not fit the free device memory is refused before anything is allocated.

    Raises:
        InvalidInput / InvalidDtype: the contract's checks.
        UnsupportedDtype: not bf16. UnsupportedShape: head dim not 256.
        DeterminismUnavailable: gradients are needed while
            ``torch.use_deterministic_algorithms(True)`` (only a warning in
            warn-only mode).
        UnsupportedDevice: not on an SM90 GPU.
        RuntimeError: backward with ``create_graph=True``.
        torch.OutOfMemoryError: (a RuntimeError) the membership tables would not
            fit the free device memory (checked before anything is allocated).
        MissingRuntime: (an ImportError) flash-attn-4 / the CuTe DSL is missing (first CUDA call).
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    dims = checked.dims
    if query.dtype != torch.bfloat16:
        raise UnsupportedDtype(f"the FA4 backend computes in bfloat16 only; query is {dtype_name(query.dtype)}")
    if dims.head_dim != HEAD_DIM:
        raise UnsupportedShape(f"the FA4 backend needs head dim {HEAD_DIM}, got {dims.head_dim}")
    check_deterministic_backward("FA4", query, key, value)
    _check_device(query.device)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    _check_memory(dims, needs_grad, _available_bytes(query.device))
    fa4 = _load_fa4()
    preprocess = _compiled_preprocess()
    # one memory layout for the compiled preprocessing (no stride-specialised recompiles)
    routes = selected_token_ids.contiguous()
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))

    def kernel(query, key, value):
        pieces: dict[int, list[torch.Tensor]] = {}
        for batch_rows, query_rows in _chunks(dims.batch, dims.query_length, dims.kv_length):
            out = _attend(query[batch_rows, query_rows], key[batch_rows], value[batch_rows],
                          routes[batch_rows, query_rows], checked.scale, fa4, preprocess)
            pieces.setdefault(batch_rows.start, []).append(out)
        if len(pieces) == 1 and len(pieces[0]) == 1:
            return pieces[0][0]
        return torch.cat([torch.cat(rows, dim=1) for _, rows in sorted(pieces.items())], dim=0)

    # FA4's backward multiplies whole tiles (0 * NaN across a tile's keys)
    return confine_nonfinite(kernel, query, key, value, routes)
