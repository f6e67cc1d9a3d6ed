"""Token-gather QSA in Triton, launched through torch: work proportional to the routes.

The kernels, their tiling, their configuration table and the steps around their
launches live in the framework-neutral ``qsa_triton`` package (the algorithm:
docs/design-token-gather.md; the driver: ``qsa_triton.driver``); ``qsa_jax`` launches
the same kernels through the same driver. Query rows are grouped in tiles of T
consecutive rows (or, with ``flatten_heads``, programs of consecutive (row, head)
pairs); per tile the sorted union of its rows' routes and a per-ID bitmask of which rows
route there are built by small Triton kernels. One program per (tile, KV head, head
chunk) then walks that union in chunks of ``block_k`` IDs, gathers each K/V row once
for all of its matrix rows, and runs an fp32 online softmax (forward, saving the
log-sum-exp) or the fused backward (dQ in registers, dK/dV added to fp32 accumulators,
or, in deterministic mode, to int64 fixed-point sums: bitwise reproducible,
``qsa_triton.fixed_point``).

Triton is imported on the first call only. CUDA tensors are required, except that CPU
tensors are accepted when Triton's interpreter is on (``TRITON_INTERPRET=1`` in the
environment before this backend's first call), which is how CPU CI runs the kernels.
Nothing synchronises with the host.

Deterministic mode: ``torch.use_deterministic_algorithms(True)`` selects the fixed-point
backward, read when the backward runs; ``deterministic=True`` / ``False`` asks for one
backward whatever the flag says.

Module layout: this module is the public API and the residual form the op pair runs;
``_triton_autograd`` is the op pair (the one autograd path), ``_triton_launch`` the
torch adapter of ``qsa_triton.driver``.
"""

from __future__ import annotations

import torch

from qsa_common._extras import installed
from qsa_common.errors import BackendDeclined
from qsa_triton import driver
from qsa_triton import launch as spec
from qsa_triton.config import DEFAULT_BLOCK_SIZES, MAX_ROWS_PER_TILE, SAFE_BLOCK_SIZES, BlockSizes
from qsa_triton.config import default_block_sizes as _table
from qsa_triton.limits import decline, off_gpu
from qsa_triton.plan import Plan, default_plan, flat_span, make_plan

from . import _triton_autograd, _triton_launch
from .routes import validate_inputs, validate_routes

__all__ = [
    "BlockSizes",
    "DEFAULT_BLOCK_SIZES",
    "SAFE_BLOCK_SIZES",
    "TileUnions",
    "backward_from_residuals",
    "build_flat_unions",
    "build_tile_unions",
    "build_unions",
    "checked_attention",
    "default_block_sizes",
    "forward_from_unions",
    "forward_with_residuals",
    "residual_shapes",
    "route_unions",
    "supports",
    "triton_sparse_gqa_attention",
]

TileUnions = driver.Unions


# looked up once, at import: dynamo traces supports() inside a compiled "auto" dispatch
_HAS_TRITON = installed("triton")


def supports(query, key, value, selected_token_ids, *, softmax_scale=None,
             deterministic: bool | None = False) -> BackendDeclined | None:
    """The :class:`qsa_common.errors.BackendDeclined` this backend raises for these
    (contract-valid) inputs, or None: UnsupportedShape for D > 256, UnsupportedDtype for
    float64, MissingRuntime without triton, UnsupportedDevice off a CUDA GPU of compute
    capability 8.0+ (unless Triton's interpreter runs the kernels). Reads metadata only
    and imports nothing; the limits are ``qsa_triton.limits``' (``qsa_jax``'s too).
    ``softmax_scale`` and ``deterministic`` decline nothing: both backwards exist."""
    device = query.device
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    return decline(query.shape[-1], _triton_launch.dtype_name(query.dtype), runtime="triton",
                   runtime_present=_HAS_TRITON, device=device.type,
                   capability=capability, interpreted=spec.interprets())


def _raise_declined(query, key, value, routes) -> None:
    reason = supports(query, key, value, routes)
    if reason is not None:
        raise reason


def default_block_sizes(device: torch.device, head_dim: int, dtype: torch.dtype) -> BlockSizes:
    """The launch configuration used when ``block_sizes`` is None: the row of
    ``qsa_triton.config.default_block_sizes`` for ``device`` (its compute capability and
    the shared memory a block may opt into), ``head_dim`` and ``dtype``."""
    capability, shared_memory = None, None
    if device.type == "cuda":
        capability = tuple(torch.cuda.get_device_capability(device))
        shared_memory = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    return _table(capability, head_dim, _triton_launch.dtype_name(dtype), shared_memory)


def _plan(query, key, block_sizes) -> Plan:
    if block_sizes is None:
        head_dim = query.shape[3]
        blocks = default_block_sizes(query.device, head_dim, query.dtype)
        return default_plan(query.shape[2] // key.shape[2], head_dim, blocks, query.shape[1])
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    return make_plan(query.shape[2] // key.shape[2], query.shape[3], block_sizes)


def _check_deterministic(deterministic) -> None:
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {deterministic!r}")


def triton_sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    block_sizes: BlockSizes | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Route-sparse GQA with token-gather Triton kernels (forward and backward).

    Args:
        query: ``[B, S_q, Hq, D]`` fp16/bf16/fp32 CUDA tensor (any strides), D <= 256.
        key, value: ``[B, S_kv, Hkv, D]``, same dtype and device; Hq % Hkv == 0.
            S_kv may differ from S_q (context-parallel shards).
        selected_token_ids: ``[B, S_q, K]`` signed int32/int64 IDs into ``[0, S_kv)``;
            anything else is padding and duplicates count once.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        block_sizes: launch configuration, default :func:`default_block_sizes`.
        deterministic: the backward's dK/dV: True for bitwise-reproducible int64
            fixed-point sums, False for fp32 atomics (faster, not reproducible), None
            (default) for ``torch.are_deterministic_algorithms_enabled()`` when the
            backward runs.

    Returns:
        ``[B, S_q, Hq, D]`` in query's dtype. Rows without routes are exactly 0 and
        add nothing to any gradient, whatever their query holds. Gradients reach query,
        key and value (through the ``qsa::triton_sparse_gqa_attention`` op pair); dQ is
        bitwise reproducible, dK/dV in deterministic mode only. There, as in the default
        mode, a non-finite value in a row's query or output gradient reaches dK/dV only at
        the keys that row routes (NaN there); any other non-finite value met by the
        backward (a routed key/value row, an overflow) makes all of dK/dV NaN
        (``qsa_triton.fixed_point``).

    Raises:
        InvalidInput / InvalidDtype: the contract's input checks; TypeError also for a
            ``deterministic`` that is neither a bool nor None.
        UnsupportedShape / UnsupportedDtype / UnsupportedDevice / MissingRuntime: what
            :func:`supports` returns.
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    _check_deterministic(deterministic)
    _raise_declined(query, key, value, selected_token_ids)
    return checked_attention(query, key, value, selected_token_ids, checked.scale, deterministic=deterministic,
                             block_sizes=block_sizes)


def checked_attention(query, key, value, selected_token_ids, softmax_scale: float, *,
                      deterministic: bool | None = None, block_sizes: BlockSizes | None = None) -> torch.Tensor:
    """:func:`triton_sparse_gqa_attention` on inputs a dispatcher has already checked
    (``softmax_scale`` resolved to a float): the op pair's output, no second validation.
    What :func:`supports` returns is raised inside the op."""
    return _triton_autograd.attention(query, key, value, selected_token_ids, softmax_scale,
                                      deterministic=deterministic, block_sizes=block_sizes)


# ---------------------------------------------------------------- residual form
# What the op pair runs: the forward hands back what the backward needs, so a backward
# through the op does not run the forward again; and for timing the pieces apart
# (route_unions, forward_from_unions). Inputs checked; default block sizes unless given.
def _forward(query, key, value, unions, scale: float, plan: Plan):
    """The forward kernel's launch (one name, so tests can count calls)."""
    return driver.forward(_triton_launch.adapter(query.device), query, key, value, unions, scale, plan)


def _unions_of(query, key, union, count, rowbits, top_k: int, plan: Plan) -> TileUnions:
    """The residual unions, checked against the shapes :func:`residual_shapes` announces."""
    want = _union_shapes(plan, query.shape[0], query.shape[1], top_k, key.shape[1])
    got = [(tuple(x.shape), x.dtype) for x in (union, count, rowbits)]
    if got != want:
        raise ValueError(f"unions of shapes {got} are not this plan's for K = {top_k}: {want}")
    return TileUnions(union, count, rowbits, plan.rows_per_tile)


def _union_shapes(plan: Plan, bsz, s_q, top_k: int, kv_length):
    """The unions' shapes as :func:`qsa_triton.plan.union_recipe` builds them, in arithmetic
    that stays symbolic under torch.compile (ceil-division and ``torch.sym_min`` only: the
    sort-key plan's bit lengths would pin S_q, S_kv and B to one value, so every new shape
    would compile again). Unions are ``T * K`` IDs wide at most (a flat program's, the
    rows it touches times K), and never wider than S_kv."""
    if plan.flat:
        n_tiles = -(-s_q * plan.group // plan.fwd_heads)
        rows = flat_span(plan.fwd_heads, plan.group)  # the most rows a program touches
    else:
        n_tiles, rows = -(-s_q // plan.rows_per_tile), plan.rows_per_tile
    width = torch.sym_min(rows * top_k, kv_length)
    return [((bsz, n_tiles, width), torch.int32), ((bsz, n_tiles), torch.int32), ((bsz, n_tiles, width), torch.int32)]


def forward_with_residuals(query, key, value, selected_token_ids, softmax_scale: float, *,
                           block_sizes: BlockSizes | None = None):
    """``(out, lse, union, count, rowbits)``: the output, its natural-log LSE
    ``[B, Hq, S_q]`` fp32 and the route unions, the residuals of
    :func:`backward_from_residuals` (shapes: :func:`residual_shapes`). No autograd;
    checked inputs (what :func:`supports` returns is raised)."""
    _raise_declined(query, key, value, selected_token_ids)
    plan = _plan(query, key, block_sizes)
    unions = driver.build_unions(_triton_launch.adapter(query.device), selected_token_ids, key.shape[1], plan)
    out, lse = _forward(query, key, value, unions, softmax_scale, plan)
    return out, lse, unions.union, unions.count, unions.rowbits


def residual_shapes(query, key, selected_token_ids, *,
                    block_sizes: BlockSizes | None = None) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of :func:`forward_with_residuals`'s results, from metadata only."""
    bsz, s_q, hq, _ = query.shape
    plan = _plan(query, key, block_sizes)
    return [(tuple(query.shape), query.dtype), ((bsz, hq, s_q), torch.float32),
            *_union_shapes(plan, bsz, s_q, selected_token_ids.shape[2], key.shape[1])]


def backward_from_residuals(grad_out, query, key, value, out, lse, union, count, rowbits,
                            softmax_scale: float, top_k: int, *, block_sizes: BlockSizes | None = None,
                            deterministic: bool | None = None):
    """``(dq, dk, dv)`` from :func:`forward_with_residuals`'s results (same inputs and
    block sizes; ``top_k``: K of their ``[B, S_q, K]`` routes). ``deterministic`` as
    :func:`triton_sparse_gqa_attention`'s: None reads
    ``torch.are_deterministic_algorithms_enabled()`` now."""
    _check_deterministic(deterministic)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    plan = _plan(query, key, block_sizes)
    ad = _triton_launch.adapter(query.device)
    unions = driver.backward_unions(ad, _unions_of(query, key, union, count, rowbits, top_k, plan), plan, top_k,
                                    query.shape[1])
    return driver.backward(ad, query, key, value, out, lse.contiguous(), grad_out, unions, softmax_scale, plan,
                           deterministic=deterministic)


def route_unions(query, key, selected_token_ids, *, block_sizes: BlockSizes | None = None):
    """``(union, count, rowbits)``: the route unions alone, as :func:`forward_with_residuals`
    builds them (``selected_token_ids`` checked as the contract says; ``query`` and ``key``
    give the sizes and the device)."""
    validate_inputs(query, key, key, selected_token_ids, 1.0)
    _raise_declined(query, key, key, selected_token_ids)
    plan = _plan(query, key, block_sizes)
    unions = driver.build_unions(_triton_launch.adapter(query.device), selected_token_ids, key.shape[1], plan)
    return unions.union, unions.count, unions.rowbits


def forward_from_unions(query, key, value, union, count, rowbits, softmax_scale: float, top_k: int, *,
                        block_sizes: BlockSizes | None = None):
    """``(out, lse)``: the forward kernel alone over :func:`route_unions`' results
    (``top_k``: K of the routes they came from)."""
    plan = _plan(query, key, block_sizes)
    unions = _unions_of(query, key, union, count, rowbits, top_k, plan)
    return _forward(query, key, value, unions, softmax_scale, plan)


# ---------------------------------------------------------------- route unions
def _check_routes(routes: torch.Tensor, kv_length: int, rows_per_tile: int) -> None:
    validate_routes(routes)
    if routes.dim() != 3:
        raise ValueError(f"routes must have rank 3 [B, S_q, K], got shape {tuple(routes.shape)}")
    if not 0 < kv_length < 2**31:
        raise ValueError(f"kv_length must be in [1, 2**31), got {kv_length}")
    if rows_per_tile < 1 or rows_per_tile > MAX_ROWS_PER_TILE or rows_per_tile & (rows_per_tile - 1):
        raise ValueError(f"rows_per_tile must be a power of two in [1, {MAX_ROWS_PER_TILE}], got {rows_per_tile}")
    if routes.device.type != "cuda" and not _triton_launch.interpreted():
        raise off_gpu(routes.device.type)


def build_tile_unions(routes: torch.Tensor, kv_length: int, rows_per_tile: int) -> TileUnions:
    """Unions of tiles of ``rows_per_tile`` (T, a power of two <= 32) consecutive rows.

    ``routes``: int32/int64 ``[B, S_q, K]``, any strides, CUDA tensors (CPU ones under
    Triton's interpreter). IDs outside ``[0, kv_length)`` are padding and repeated IDs
    count once. The last tile is padded with empty rows."""
    _check_routes(routes, kv_length, rows_per_tile)
    return driver.build_tile_unions(_triton_launch.adapter(routes.device), routes, kv_length, rows_per_tile)


def build_unions(routes: torch.Tensor, kv_length: int, plan: Plan, *, padded: bool = True) -> TileUnions:
    """The forward's unions of ``plan`` (``qsa_triton.driver.build_unions``); ``padded``
    False leaves the entries past each count unwritten."""
    _check_routes(routes, kv_length, plan.rows_per_tile)
    return driver.build_unions(_triton_launch.adapter(routes.device), routes, kv_length, plan, padded=padded)


def build_flat_unions(routes: torch.Tensor, kv_length: int, plan: Plan) -> TileUnions:
    """:func:`build_unions` for a flat plan."""
    if not plan.flat:
        raise ValueError("build_flat_unions takes a flat plan (BlockSizes(flatten_heads=True), G not a power of two)")
    return build_unions(routes, kv_length, plan)
