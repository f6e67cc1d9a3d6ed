"""Route-sparse GQA through cuDNN Frontend's indexed QSA kernels (Blackwell only).

The kernels are ``cudnn.ops.qsa_indexed_forward`` and ``cudnn.ops.qsa_indexed_backward``
of nvidia-cudnn-frontend >= 1.32 (``pip install 'nvidia-cudnn-frontend[cutedsl]>=1.32'``).
This module adapts the contract's ``[B, S, Hq, D]`` call to them:

* The kernels see one packed token axis ``T = B * S``; :func:`_pack_indices` moves every
  batch-local route ID ``r`` of batch row ``b`` to the packed coordinate ``b * S + r``.
* One kernel call serves one head group of 12 query heads sharing 1 KV head, so
  ``(Hq, Hkv) = (12, 1)`` is one :class:`_CudnnQSA` call and ``(24, 2)`` two independent ones.
* The forward returns the BF16 output plus the FP32 output and natural-log LSE that the
  backward needs; :class:`_CudnnQSA` keeps those two (a BF16 output cast back to FP32 would
  not do).

What the calls look like was taken from the cuDNN Frontend documentation page
"Indexed QSA training" (docs.nvidia.com/cudnn/operations/sparse_attention/qsa/qsa_indexed),
the FlashInfer page of the same kernels (docs.flashinfer.ai/generated/
flashinfer.qsa.qsa_indexed_forward.html) and what the H200 host shows of them (they raise
NotImplementedError there: docs/benchmarks.md); ``scripts/gpu/check_cudnn.py`` records the installed
signatures there. The kernels run only on SM100/SM103; nothing else in the project's
hardware can run them, so their numerics are unverified here: every process's first
call warns so (:class:`qsa_torch.routes.UnverifiedBackendWarning`), and
``qsa_torch.sparse_gqa_attention(backend="auto")`` tries this backend only after the
portable ones.

The runtime is imported on first use (:func:`_load_cudnn`), never when ``qsa_torch`` is.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from qsa_common._extras import installed
from qsa_common.errors import (
    BackendDeclined,
    DeterminismUnavailable,
    InvalidInput,
    MissingRuntime,
    UnsupportedDevice,
    UnsupportedDtype,
    UnsupportedShape,
)

from ._nonfinite import confine_nonfinite
from .routes import (
    ProblemDims,
    check_deterministic_backward,
    dense_aligned,
    dtype_name,
    needs_grad,
    refuse_nondeterministic_backward,
    validate_inputs,
    validate_routes,
    warn_unverified,
)

__all__ = ["ROUTE_FORMAT", "cudnn_sparse_gqa_attention", "supports"]

# The route format this backend needs (CONTRACT.md's QSA format): "auto" considers it
# only when the caller promises it (``route_format="qsa"``); other route sets give
# wrong answers here, not errors.
ROUTE_FORMAT = "qsa"

_SUPPORTED_HEADS = ((24, 2), (12, 1))
_GROUP_QUERY_HEADS = 12
_HEAD_DIM = 256
_MAX_WIDTH = 2052
_SUPPORTED_CAPABILITIES = {(10, 0): "SM100", (10, 3): "SM103"}
_GPU_REQUIREMENT = "an NVIDIA Blackwell SM100/SM103 GPU (B200, B300, GB200, GB300)"
_INSTALL_HINT = "pip install 'nvidia-cudnn-frontend[cutedsl]>=1.32'"


# looked up once, at import (dynamo traces supports() under torch.compile: no importlib there)
_HAS_RUNTIME = installed("cudnn")


def _load_cudnn() -> tuple[Callable, Callable]:
    """Return ``(qsa_indexed_forward, qsa_indexed_backward)`` from ``cudnn.ops``.

    Imports on every call (Python caches the module) and keeps nothing else: no tensors,
    no handles, no compiled plans.

    Raises:
        ImportError: cuDNN Frontend is not installed, or is older than 1.32 and has no
            indexed QSA entry points, or their optional dependencies (CuTe DSL) are absent.
    """
    try:
        ops = importlib.import_module("cudnn.ops")
        forward = ops.qsa_indexed_forward
        backward = ops.qsa_indexed_backward
    except (ImportError, AttributeError, OSError) as error:
        raise MissingRuntime(
            "cudnn_sparse_gqa_attention needs the cuDNN Frontend indexed QSA runtime "
            "(cudnn.ops.qsa_indexed_forward / qsa_indexed_backward, nvidia-cudnn-frontend "
            f">= 1.32 with the CuTe DSL): {_INSTALL_HINT}. Import failed with: {error!r}"
        ) from error
    return forward, backward


def _pack_indices(routes: torch.Tensor, sequence_length: int) -> torch.Tensor:
    """Batch-local route IDs ``[B, S, W]`` to packed token coordinates ``[B*S, ceil(W/4)*4]``.

    Row ``b * S + i`` of the result is routes ``[b, i]`` with each valid ID ``r``
    (``0 <= r < sequence_length``) replaced by ``b * S + r`` and every other value
    (negative, ``>= S``, huge int64) replaced by -1; then -1 columns are appended up to a
    multiple of four. Slot order and duplicates are kept: the selection is not changed,
    only re-addressed. A new contiguous int32 tensor on the routes' device; no host
    synchronisation.

    Args:
        routes: signed int32/int64 ``[batch, sequence, width]``, batch-local IDs.
        sequence_length: S, the physical sequence length shared by query and K/V; must
            equal ``routes.shape[1]``.

    Raises:
        InvalidDtype: routes not a signed int32/int64 tensor.
        InvalidInput: routes not of rank 3, ``sequence_length`` not its second size, or
            ``batch * sequence`` past the int32 range of packed coordinates.
    """
    validate_routes(routes)
    if routes.dim() != 3:
        raise InvalidInput(
            f"selected_token_ids must have rank 3 [B, S, W], got shape {tuple(routes.shape)}"
        )
    batch, rows, width = (int(d) for d in routes.shape)
    if int(sequence_length) != rows:
        raise InvalidInput(
            f"sequence_length {sequence_length} differs from selected_token_ids' "
            f"sequence size {rows}"
        )
    tokens = batch * rows
    if tokens >= 2**31:
        raise InvalidInput(
            f"batch * sequence = {tokens} packed tokens exceed the int32 index range of "
            "the cuDNN indexed QSA kernels"
        )
    # Compare in the input dtype: casting huge int64 IDs to int32 first would wrap them.
    valid = (routes >= 0) & (routes < rows)
    local = torch.where(valid, routes, torch.full_like(routes, -1)).to(torch.int32)
    origin = torch.arange(batch, dtype=torch.int32, device=routes.device).mul_(rows)
    packed = torch.where(valid, local + origin.view(batch, 1, 1), local)
    padded_width = -(-width // 4) * 4
    out = torch.full((tokens, padded_width), -1, dtype=torch.int32, device=routes.device)
    out[:, :width] = packed.reshape(tokens, width)
    return out


def _shape_declined(dims: ProblemDims) -> UnsupportedShape | None:
    """UnsupportedShape for sizes the indexed kernels do not cover (heads, D, width, CP)."""
    if dims.query_length != dims.kv_length:
        return UnsupportedShape(
            "cudnn_sparse_gqa_attention needs query and key/value of one sequence length "
            f"(S_q == S_kv); got S_q={dims.query_length}, S_kv={dims.kv_length}. Context "
            "parallelism (local queries against gathered global K/V) is not supported by "
            "this backend"
        )
    heads = (dims.query_heads, dims.kv_heads)
    if heads not in _SUPPORTED_HEADS:
        return UnsupportedShape(
            f"cudnn_sparse_gqa_attention supports (query heads, key/value heads) in "
            f"{_SUPPORTED_HEADS}; query and key have {heads}"
        )
    if dims.head_dim != _HEAD_DIM:
        return UnsupportedShape(
            f"cudnn_sparse_gqa_attention needs head dim {_HEAD_DIM} in query/key/value, "
            f"got {dims.head_dim}"
        )
    if not 1 <= dims.routes_per_query <= _MAX_WIDTH:
        return UnsupportedShape(
            f"selected_token_ids width must be in [1, {_MAX_WIDTH}] for the cuDNN indexed "
            f"QSA kernels, got {dims.routes_per_query}"
        )
    return None


def _check_supported(dims: ProblemDims) -> None:
    """Raise :func:`_shape_declined`'s UnsupportedShape (a ValueError), if any."""
    declined = _shape_declined(dims)
    if declined is not None:
        raise declined


def _device_declined(device: torch.device) -> UnsupportedDevice | None:
    """UnsupportedDevice unless ``device`` is an SM100/SM103 GPU (no cuDNN import)."""
    if device.type != "cuda":
        return UnsupportedDevice(
            f"cudnn_sparse_gqa_attention needs CUDA tensors on {_GPU_REQUIREMENT}; "
            f"query is on {device}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) not in _SUPPORTED_CAPABILITIES:
        name = torch.cuda.get_device_name(device)
        return UnsupportedDevice(
            f"cudnn_sparse_gqa_attention requires {_GPU_REQUIREMENT}: the cuDNN indexed QSA "
            f"kernels run on compute capability 10.0 (SM100) or 10.3 (SM103) only; {device} "
            f"is {name} with compute capability {major}.{minor} (SM{major}{minor})"
        )
    return None


def _check_gpu(device: torch.device) -> None:
    """The tensors must live on an SM100/SM103 GPU; checked before cuDNN is imported.

    Raises:
        UnsupportedDevice: (a RuntimeError) not a CUDA device, or not SM100/SM103.
    """
    declined = _device_declined(device)
    if declined is not None:
        raise declined


def supports(query, key, value, selected_token_ids, *, softmax_scale=None,
             deterministic=False) -> BackendDeclined | None:
    """Why the cuDNN indexed kernels cannot take these (valid) inputs, or None, in this
    order without touching device data: not an SM100/SM103 GPU (UnsupportedDevice), not
    bf16 (UnsupportedDtype), cuDNN Frontend absent (MissingRuntime), ``deterministic``
    with gradients wanted (DeterminismUnavailable: fp32 atomics), heads, head dim, width
    or S_q != S_kv outside the kernels (UnsupportedShape). The route format is the
    caller's promise (:data:`ROUTE_FORMAT`), not checked here."""
    del softmax_scale
    declined = _device_declined(query.device)
    if declined is not None:
        return declined
    if query.dtype != torch.bfloat16:
        return UnsupportedDtype(
            f"the cuDNN indexed kernels compute in bfloat16 only; query is {dtype_name(query.dtype)}")
    if not _HAS_RUNTIME:
        return MissingRuntime(f"the cuDNN backend needs cuDNN Frontend, which is not installed: {_INSTALL_HINT}")
    if deterministic and needs_grad(query, key, value):
        return DeterminismUnavailable("the cuDNN backend's backward is not deterministic (fp32 atomics)")
    b, s_q, hq, d = query.shape
    dims = ProblemDims(b, s_q, key.shape[1], hq, key.shape[2], d, selected_token_ids.shape[-1])
    return _shape_declined(dims)


class _CudnnQSA(torch.autograd.Function):
    """One 12:1 head group through the indexed kernels; keeps their FP32 output and LSE."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of packed query ``q`` over its routed keys/values.

        Args:
            ctx: the autograd context.
            q: BF16 CUDA ``[T, 12, 256]``; may be strided (copied to a contiguous buffer).
            k: BF16 CUDA ``[T, 1, 256]``; may be strided.
            v: BF16 CUDA ``[T, 1, 256]``; may be strided.
            indices: contiguous int32 CUDA ``[T, W]``, W a multiple of 4 in [4, 2052], in
                packed token coordinates (:func:`_pack_indices`), QSA route format.
            scale: finite positive score multiplier.

        Returns:
            A new BF16 ``[T, 12, 256]`` output. The contiguous inputs, the indices and the
            kernel's FP32 output ``[T, 12, 256]`` and FP32 natural-log LSE ``[12, T]`` are
            saved for :meth:`backward`.
        """
        forward, _ = _load_cudnn()
        q, k, v = dense_aligned(q), dense_aligned(k), dense_aligned(v)
        out, out_fp32, lse = forward(q, k, v, indices, scale)
        ctx.save_for_backward(q, k, v, indices, out_fp32, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """BF16 dQ ``[T, 12, 256]``, dK and dV ``[T, 1, 256]``, then None, None.

        ``grad_output`` is the BF16 ``[T, 12, 256]`` upstream gradient, possibly strided.
        The indices and the scale are discrete/constant and get no gradient. The kernel
        accumulates dK/dV with FP32 atomics: results are not bitwise repeatable.

        Raises:
            RuntimeError: deterministic algorithms were switched on after the forward.
        """
        refuse_nondeterministic_backward("cudnn_qsa")
        _, backward = _load_cudnn()
        q, k, v, indices, out_fp32, lse = ctx.saved_tensors
        dq, dk, dv = backward(
            dense_aligned(grad_output.to(q.dtype)), q, k, v, out_fp32, lse, indices, ctx.scale,
            selection_mode="general",
        )
        return dq, dk, dv, None, None


def cudnn_sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Route-sparse GQA on Blackwell through cuDNN Frontend's indexed QSA kernels.

    Computes the contract's function (docs/contract.md) for routes in the QSA format emitted by
    the model's ratio-four indexer. The routes are used as given: this backend runs no
    indexer, and neither checks nor repairs the route values below (checking them would
    copy device data to the host on every call). Routes that break them give a wrong
    answer, not an error. Per batch row ``b`` and query ``i`` of a document starting at
    row position ``d`` (``d = 0`` in a right-padded batch), slots ``4j .. 4j+3`` form
    group ``j`` (a last, partial group is padded with -1), and each group is one of

    * a complete block ``d+4m, d+4m+1, d+4m+2, d+4m+3`` (in this order) with
      ``d+4m+3 <= i``;
    * the causal tail ``d+4*((i-d+1)//4) .. i`` (0 to 3 IDs, ascending) then -1;
    * padding only: IDs ``< 0`` or ``>= S`` (any such value, huge int64 included).

    No two groups name the same block; every ID lies in the query's own document. The
    kernel reads a group's first slot as the block start and takes the consecutive
    tokens from there up to the query's own position, so duplicate, unaligned or
    arbitrary token sets (which other backends accept) are not supported here. Blocks
    restart at each packed document's start; the IDs stay absolute within the row.

    Supported: ``(Hq, Hkv)`` in ``{(24, 2), (12, 1)}`` (one kernel call per 12:1 head
    group), D = 256, BF16, width 1..2052, right-padded and packed layouts with
    ``S_q == S_kv``. Context parallelism (local queries against gathered global K/V) is
    not. Strided Q/K/V are accepted and copied to contiguous per-KV-head buffers. The
    backward accumulates with FP32 atomics and is not bitwise deterministic; the cuDNN
    documentation says the same of the forward's internal index compaction order.

    Checks run in this order, so that all but the last two work without a GPU: types
    and shapes (:func:`qsa_torch.validate_inputs`), this backend's shape limits, the
    deterministic-algorithms flag, the device, the cuDNN import.

    Args:
        query: BF16 CUDA ``[B, S, Hq, 256]``.
        key: BF16 CUDA ``[B, S, Hkv, 256]``, on query's device.
        value: BF16 CUDA tensor of key's shape, on query's device.
        selected_token_ids: signed int32/int64 CUDA ``[B, S, W]``, 1 <= W <= 2052, IDs
            into ``[0, S)`` of the same batch row (QSA format above); other values are
            padding.
        softmax_scale: finite positive host scalar; default ``1/sqrt(256) = 1/16``.

    Returns:
        A new BF16 CUDA ``[B, S, Hq, 256]`` tensor; rows with no valid route are zero.
        A non-finite query or output-gradient row reaches only its own out/dq and
        the dk/dv of its routed keys (:mod:`qsa_torch._nonfinite`).

    Raises:
        InvalidInput / InvalidDtype: the contract's checks.
        UnsupportedDtype: compute tensors that are not BF16.
        UnsupportedShape: (a ValueError) head counts, D != 256, W > 2052, S_q != S_kv.
        DeterminismUnavailable: (a RuntimeError) a backward requested under
            ``torch.use_deterministic_algorithms(True)``.
        UnsupportedDevice: (a RuntimeError) not CUDA, or a GPU other than SM100/SM103
            (checked before cuDNN is called).
        MissingRuntime: (an ImportError) cuDNN Frontend >= 1.32 with its QSA runtime is
            not installed.

    Warns:
        UnverifiedBackendWarning: once per process; no recorded run has checked this
            backend's numerics on any GPU.
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale)
    if query.dtype != torch.bfloat16:
        raise UnsupportedDtype(
            f"the cuDNN indexed kernels compute in bfloat16 only; query is {dtype_name(query.dtype)}")
    dims = checked.dims
    _check_supported(dims)
    check_deterministic_backward("cudnn_qsa", query, key, value)
    _check_gpu(query.device)
    _load_cudnn()
    warn_unverified("cudnn", "sm100")

    indices = _pack_indices(selected_token_ids, dims.kv_length)
    tokens = dims.batch * dims.query_length
    # Rows without routes: masked_fill (not a multiply) on the way in and out, so
    # their output and dq are exact zeros whatever the kernel computes for them.
    routes = selected_token_ids
    empty = ~((routes >= 0) & (routes < dims.kv_length)).any(dim=-1)[:, :, None, None]

    def kernel(query, key, value):
        q = query.masked_fill(empty, 0).reshape(tokens, dims.query_heads, _HEAD_DIM)
        k = key.reshape(tokens, dims.kv_heads, _HEAD_DIM)
        v = value.reshape(tokens, dims.kv_heads, _HEAD_DIM)
        outputs = []
        for group in range(dims.kv_heads):
            heads = slice(group * _GROUP_QUERY_HEADS, (group + 1) * _GROUP_QUERY_HEADS)
            outputs.append(_CudnnQSA.apply(q[:, heads], k[:, group : group + 1], v[:, group : group + 1],
                                           indices, checked.scale))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        out = out.reshape(dims.batch, dims.query_length, dims.query_heads, _HEAD_DIM)
        return out.masked_fill(empty, 0)

    # the indexed backward sums whole tiles (0 * NaN across a tile's keys, presumably
    # as FA4's and FlexAttention's do)
    return confine_nonfinite(kernel, query, key, value, routes)
