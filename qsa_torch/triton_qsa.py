"""Token-gather QSA in Triton, launched through torch: work proportional to the routes.

The kernels, their tiling and their configuration table live in the framework-neutral
``qsa_triton`` package (the algorithm: docs/design-token-gather.md); ``qsa_jax``
launches the same kernels. Query rows are grouped in tiles of T consecutive rows; per
tile the sorted union of its rows' routes and a per-ID bitmask of which rows route
there are built by two small Triton kernels around a ``torch.sort``. One program per
(tile, KV head, head chunk) then walks that union in chunks of ``block_k`` IDs,
gathers each K/V row once for all T * heads matrix rows, and runs an fp32 online
softmax (forward, saving the log-sum-exp) or the fused backward (dQ in registers, dK/dV
added to fp32 accumulators with one atomic add per union chunk, or, in deterministic mode,
to int64 fixed-point sums: bitwise reproducible, ``qsa_triton.fixed_point``). With ``flatten_heads``
(the default for 16-bit inputs at D > 128 on SM90+ GPUs with the shared memory for it)
a program takes consecutive (row, head) pairs instead of T rows x padded heads, forward
and backward alike; otherwise the backward's tiles may be shorter than the forward's,
their unions cut out of the forward's, not sorted again.

Triton is imported on the first call only. CUDA tensors are required, except that CPU
tensors are accepted when Triton's interpreter is on (``TRITON_INTERPRET=1`` in the
environment before this backend's first call), which is how CPU CI runs the kernels.
Nothing synchronises with the host.

Deterministic mode: ``torch.use_deterministic_algorithms(True)`` selects the fixed-point
backward, read when the backward runs (the flag's state at that moment counts, as for
torch's own backward kernels); ``deterministic=True`` / ``False`` asks for one backward
whatever the flag says.

Module layout: this module is the public API; ``_triton_unions`` builds the unions,
``_triton_launch`` launches kernels, ``_triton_autograd`` is the autograd glue.
"""

from __future__ import annotations

import torch

from qsa_triton.config import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, BlockSizes
from qsa_triton.config import default_block_sizes as _table
from qsa_triton.plan import Plan, default_plan, flat_span, make_plan

from . import _triton_launch
from ._triton_autograd import TritonQSA
from ._triton_unions import TileUnions, backward_unions, build_flat_unions, build_tile_unions, build_unions
from .routes import validate_inputs

__all__ = [
    "BlockSizes",
    "DEFAULT_BLOCK_SIZES",
    "SAFE_BLOCK_SIZES",
    "TileUnions",
    "backward_from_residuals",
    "build_flat_unions",
    "build_tile_unions",
    "default_block_sizes",
    "forward_from_unions",
    "forward_with_residuals",
    "residual_shapes",
    "route_unions",
    "triton_sparse_gqa_attention",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


def default_block_sizes(device: torch.device, head_dim: int, dtype: torch.dtype) -> BlockSizes:
    """The launch configuration used when ``block_sizes`` is None: the row of
    ``qsa_triton.config.default_block_sizes`` for ``device`` (its compute capability and
    the shared memory a block may opt into), ``head_dim`` and ``dtype``."""
    capability, shared_memory = None, None
    if device.type == "cuda":
        capability = tuple(torch.cuda.get_device_capability(device))
        shared_memory = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    return _table(capability, head_dim, _triton_launch.dtype_name(dtype), shared_memory)


def _default_plan(query: torch.Tensor, key: torch.Tensor) -> Plan:
    head_dim = query.shape[3]
    blocks = default_block_sizes(query.device, head_dim, query.dtype)
    return default_plan(query.shape[2] // key.shape[2], head_dim, blocks, query.shape[1])


def _setup(query, key, value, selected_token_ids, softmax_scale, block_sizes=None):
    """The contract's checks and this backend's own; returns ``(checked, plan)``."""
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale, dtypes=_DTYPES)
    dims = checked.dims
    if dims.head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"query head dim must be <= {_MAX_HEAD_DIM} for triton_qsa, got {dims.head_dim}")
    plan = _plan(query, key, block_sizes)
    if query.device.type != "cuda" and not _triton_launch.interpreted():
        raise ValueError(
            f"query is on {query.device}: triton_qsa needs CUDA tensors "
            "(CPU tensors only with TRITON_INTERPRET=1 set before triton is imported)"
        )
    return checked, plan


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
        key and value; dQ is bitwise reproducible, dK/dV in deterministic mode only.
        There a non-finite value met by the backward makes all of dK/dV NaN
        (``qsa_triton.fixed_point``). A non-finite K/V row that one row of a program
        routes to reaches that program's other rows (0 * NaN in P @ V); rows of other
        programs are unaffected.

    Raises:
        TypeError / ValueError: the contract's input checks; ValueError also for D >
            256 and for CPU tensors unless Triton's interpreter is on, TypeError for a
            ``deterministic`` that is neither a bool nor None.
        ImportError: triton is not installed.
    """
    checked, plan = _setup(query, key, value, selected_token_ids, softmax_scale, block_sizes)
    _check_deterministic(deterministic)
    unions = build_unions(selected_token_ids, checked.dims.kv_length, plan, padded=False)
    return TritonQSA.apply(query, key, value, unions.union, unions.count, unions.rowbits, checked.scale, plan,
                           selected_token_ids.shape[2], deterministic)


def _check_deterministic(deterministic) -> None:
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {deterministic!r}")


# ---------------------------------------------------------------- residual form
# For qsa_torch.api's custom ops: the forward hands back what the backward needs, so a
# backward through the op does not run the forward again; and for timing the pieces
# apart (route_unions, forward_from_unions). The default block sizes unless given.
_forward = _triton_launch.forward  # the forward kernel's launch (one name, so tests can count calls)


def _plan(query, key, block_sizes):
    if block_sizes is None:
        return _default_plan(query, key)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    return make_plan(query.shape[2] // key.shape[2], query.shape[3], block_sizes)


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
    :func:`backward_from_residuals` (shapes: :func:`residual_shapes`). No autograd."""
    checked, plan = _setup(query, key, value, selected_token_ids, softmax_scale, block_sizes)
    unions = build_unions(selected_token_ids, checked.dims.kv_length, plan)
    out, lse = _forward(query, key, value, unions, checked.scale, plan)
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
    unions = backward_unions(_unions_of(query, key, union, count, rowbits, top_k, plan), plan, top_k,
                             query.shape[1])
    return _triton_launch.backward(query, key, value, out, lse, grad_out, unions, softmax_scale, plan,
                                   deterministic=deterministic)


def route_unions(query, key, selected_token_ids, *, block_sizes: BlockSizes | None = None):
    """``(union, count, rowbits)``: the route unions alone, as :func:`forward_with_residuals`
    builds them (``selected_token_ids`` checked as the contract says; ``query`` and ``key``
    give the sizes and the device)."""
    _, plan = _setup(query, key, key, selected_token_ids, 1.0, block_sizes)
    unions = build_unions(selected_token_ids, key.shape[1], plan)
    return unions.union, unions.count, unions.rowbits


def forward_from_unions(query, key, value, union, count, rowbits, softmax_scale: float, top_k: int, *,
                        block_sizes: BlockSizes | None = None):
    """``(out, lse)``: the forward kernel alone over :func:`route_unions`' results
    (``top_k``: K of the routes they came from)."""
    plan = _plan(query, key, block_sizes)
    unions = _unions_of(query, key, union, count, rowbits, top_k, plan)
    return _forward(query, key, value, unions, softmax_scale, plan)


from qsa_common.errors import MissingRuntime, UnsupportedDevice, UnsupportedDtype, UnsupportedShape  # noqa: E402
from qsa_triton.launch import interprets  # noqa: E402


def supports(query, key, value, selected_token_ids, *, softmax_scale=None, deterministic=False):
    """Why the Triton kernels cannot take these (valid) inputs, or None: off CUDA unless
    its kernels are interpreted (UnsupportedDevice), fp64 (UnsupportedDtype), triton
    absent (MissingRuntime), head dim > 256 (UnsupportedShape). Deterministic gradients
    are available (int64 fixed-point dK/dV)."""
    del key, value, selected_token_ids, softmax_scale, deterministic
    device = query.device
    if device.type != "cuda" and not (device.type == "cpu" and interprets()):
        return UnsupportedDevice("the Triton backend needs a CUDA device (or TRITON_INTERPRET=1 set before its "
                                 f"kernels are imported); query is on {device}")
    if query.dtype not in _DTYPES:
        return UnsupportedDtype(f"the Triton kernels take float16, bfloat16, float32, not "
                                f"{str(query.dtype).removeprefix('torch.')}")
    if not _HAS_TRITON:
        return MissingRuntime("optional runtime 'triton' is not installed")
    if query.shape[-1] > _MAX_HEAD_DIM:
        return UnsupportedShape(f"the Triton kernels support head dim <= {_MAX_HEAD_DIM}, got {query.shape[-1]}")
    return None


def _find_triton() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_HAS_TRITON = _find_triton()  # at import: dynamo traces supports() under torch.compile
