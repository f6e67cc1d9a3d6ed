"""Launching the ``qsa_triton`` kernels through torch: one call site for every kernel.

A :class:`qsa_triton.launch.Launch` says what to pass; :func:`run` allocates its outputs
(zeroed ones with zeros, the others uninitialised: the kernels write every element, and
tests poison them through :func:`new_buffer`) and launches the kernel with every
argument by keyword, on the tensors' CUDA device. :func:`forward` and :func:`backward`
add the retry on a configuration that needs more shared memory than the device has.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from qsa_triton import launch as spec
from qsa_triton.plan import Plan

from .routes import dense_aligned

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "int32": torch.int32, "int64": torch.int64}

# (kernel, plan, dtype, head dim, 32-bit offsets, deterministic, device) -> the attempt that fit the device
_LAUNCH_FALLBACKS: dict[tuple, spec.Attempt] = {}


@functools.cache
def interpreted() -> bool:
    """Import triton and the kernels once; whether Triton's interpreter runs them.

    Raises:
        ImportError: triton is not installed.
    """
    try:
        import triton  # noqa: F401 - a clear error before the kernels' own import
    except ImportError as exc:  # pragma: no cover - exercised where triton is absent
        raise ImportError("the Triton QSA backend needs the 'triton' package (pip install triton)") from exc
    return spec.interpreted()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised memory a kernel overwrites completely (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device``."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def run(launch: spec.Launch, arrays: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Launch ``launch`` on ``arrays`` (its inputs by name); returns its outputs by name."""
    outputs = {}
    for out in launch.outputs:
        make = torch.zeros if out.zeroed else new_buffer
        outputs[out.name] = make(out.shape, dtype=_TORCH_DTYPES[out.dtype], device=device)
    kernel = spec.kernel(launch.kernel)
    with _on_device(device):
        kernel[launch.grid](**{name: arrays[name] for name in launch.inputs}, **dict(launch.scalars), **outputs,
                            **dict(launch.params), num_warps=launch.num_warps, num_stages=launch.num_stages)
    return outputs


def _run_fitting(build, plan: Plan, backward: bool, arrays, device: torch.device):
    """Run the launch ``build(attempt)`` describes, the plan's own attempt first; where a
    configuration needs more shared memory than the device has (Triton raises
    OutOfResources when loading it), the next of :func:`qsa_triton.launch.attempts`. The
    working attempt is remembered, so a failing compile is not repeated."""
    options = spec.attempts(plan, backward)
    first = build(options[0])
    params = dict(first.params)
    key = (first.kernel, plan, first.outputs[0].dtype, params["D"], params["OFFS32"], params.get("DETERMINISTIC"),
           str(device))
    if key in _LAUNCH_FALLBACKS:
        options = [_LAUNCH_FALLBACKS[key]]
    for i, attempt in enumerate(options):
        try:
            result = run(build(attempt), arrays, device)
        except Exception as exc:  # triton.runtime.errors.OutOfResources (triton is imported lazily)
            if type(exc).__name__ != "OutOfResources" or i == len(options) - 1:
                raise
            continue
        _LAUNCH_FALLBACKS[key] = attempt
        return result
    raise AssertionError("unreachable")  # pragma: no cover


def _operand(t: torch.Tensor) -> spec.Operand:
    return tuple(t.shape), tuple(t.stride())


def _shared_per_block(device: torch.device) -> int:
    """The shared memory a block on ``device`` may opt in to (0 where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every base address is 16-byte aligned (the Hopper kernels' copies)."""
    return all(x.data_ptr() % 16 == 0 for x in tensors)


@functools.cache
def hopper_forward(device: torch.device) -> bool:
    """Whether ``device`` runs the warp-specialized forward (``qsa_triton.forward_sm90``):
    compute capability 9.0, enough shared memory per block, and a triton with Gluon."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    if _shared_per_block(device) < spec.SM90_FORWARD_SHARED:
        return False
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def hopper_backward(device: torch.device) -> bool:
    """:func:`hopper_forward`, and room for the Hopper backward's shared memory."""
    return hopper_forward(device) and _shared_per_block(device) >= spec.SM90_BACKWARD_SHARED


def forward(q, k, v, unions, scale: float, plan: Plan):
    """Forward kernel over the forward's unions (``TileUnions``): out ``[B,S_q,Hq,D]``
    (q's dtype) and the natural-log LSE ``[B,Hq,S_q]`` fp32. On Hopper, operands in its
    scope take the warp-specialized kernel (``qsa_triton.launch.forward_sm90_launch``)."""
    interpret = interpreted()
    dtype = dtype_name(q.dtype)
    arrays = dict(Q=q, K=k, V=v, UNION=unions.union, COUNT=unions.count, ROWBITS=unions.rowbits)
    if not interpret and hopper_forward(q.device):
        launch = spec.forward_sm90_launch(plan, _operand(q), _operand(k), _operand(v), tuple(unions.union.shape),
                                          scale, dtype)
        if launch is not None and _aligned(q, k, v):
            outputs = run(launch, arrays, q.device)
            return outputs["O"], outputs["LSE"]

    def build(attempt):
        return spec.forward_launch(plan, _operand(q), _operand(k), _operand(v), tuple(unions.union.shape), scale,
                                   dtype, interpreted=interpret, attempt=attempt)

    outputs = _run_fitting(build, plan, False, arrays, q.device)
    return outputs["O"], outputs["LSE"]


def input_maxima(query: torch.Tensor, grad_out: torch.Tensor, value: torch.Tensor,
                 lse: torch.Tensor) -> torch.Tensor:
    """MAXIMA of the deterministic backward: fp32 ``[3]``, max|query| and max|grad_out| over
    the (row, head) pairs with routes (``lse`` ``[B, Hq, S_q]`` not +inf: the backward never
    reads the others; NaN/inf if a routed one holds one), and max|value| over the rows
    ``[b, j, g, :]`` whose own maximum is finite. Maxima round nothing, so these are the
    bits ``qsa_jax`` computes too. Temporaries of one value per row and head only."""
    routed = (lse != float("inf")).transpose(1, 2)

    def row_maxima(x):
        lo, hi = torch.aminmax(x, dim=-1)
        return torch.maximum(-lo, hi)

    def largest_routed(x):
        rows = row_maxima(x)
        return torch.where(routed, rows, torch.zeros_like(rows)).amax().float()

    rows = row_maxima(value)
    finite_rows = torch.where(torch.isfinite(rows), rows, torch.zeros_like(rows))
    return torch.stack([largest_routed(query), largest_routed(grad_out), finite_rows.amax().float()])


def backward(q, k, v, out, lse, grad_out, unions, scale: float, plan: Plan, *, deterministic: bool = False):
    """Backward kernel over the backward's unions: dq (q's dtype) and dk, dv (k's dtype)
    from fp32 atomic accumulators, or (``deterministic``) from int64 fixed-point sums
    converted by ``qsa_triton.fixed_point``'s kernel: bitwise reproducible."""
    interpret = interpreted()
    dtype = dtype_name(q.dtype)

    def build(attempt):
        return spec.backward_launch(plan, _operand(q), _operand(k), _operand(v), _operand(out), _operand(grad_out),
                                    tuple(unions.union.shape), scale, dtype, interpreted=interpret,
                                    attempt=attempt, deterministic=deterministic)

    lse = lse.contiguous()
    hopper = not interpret and hopper_backward(q.device)
    if hopper and deterministic:
        # the kernel must follow from shapes, dtype and device alone, as in JAX (dense
        # arrays): the fixed-point gradients are then bitwise equal across operand layouts
        # (an expanded grad_out from out.sum()) and across the two frameworks
        q, k, v, out, grad_out = (dense_aligned(x) for x in (q, k, v, out, grad_out))
    # MAXIMA is read by the deterministic kernels only (LSE stands in for it otherwise)
    maxima = input_maxima(q, grad_out, v, lse) if deterministic else lse
    arrays = dict(Q=q, K=k, V=v, O=out, DO=grad_out, LSE=lse, UNION=unions.union, COUNT=unions.count,
                  ROWBITS=unions.rowbits, MAXIMA=maxima)
    outputs = None
    if hopper:
        launch = spec.backward_sm90_launch(plan, _operand(q), _operand(k), _operand(v), _operand(out),
                                           _operand(grad_out), tuple(unions.union.shape), scale, dtype,
                                           deterministic=deterministic)
        if launch is not None and _aligned(q, k, v, out, grad_out):
            outputs = run(launch, arrays, q.device)
    if outputs is None:
        outputs = _run_fitting(build, plan, True, arrays, q.device)
    if not deterministic:
        return outputs["DQ"], outputs["DK"].to(k.dtype), outputs["DV"].to(v.dtype)
    convert = spec.fixed_point_launch(tuple(k.shape), dtype_name(k.dtype), scale, q.shape[1] * plan.group,
                                      interpreted=interpret)
    grads = run(convert, dict(DK_FIXED=outputs["DK"], DV_FIXED=outputs["DV"], MAXIMA=maxima, FLAG=outputs["FLAG"]),
                q.device)
    return outputs["DQ"], grads["DK"], grads["DV"]
