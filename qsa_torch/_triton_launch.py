"""The torch adapter of the Triton driver (``qsa_triton.driver``): launching with tensors.

:func:`run` allocates a :class:`qsa_triton.launch.Launch`'s outputs (zeroed ones with
zeros, the others uninitialised: the kernels write every element, and tests poison them
through :func:`new_buffer`) and launches its kernel with every argument by keyword, on
the tensors' CUDA device. :class:`TorchAdapter` adds the few tensor operations the driver
asks for; everything else (union recipe, kernel choice, retry, fixed-point steps) is the
driver's.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from qsa_triton import launch as spec
from qsa_triton.limits import INSTALL

from .routes import dense_aligned

__all__ = ["TorchAdapter", "adapter", "dtype_name", "hopper_backward", "hopper_forward", "input_maxima",
           "interpreted", "new_buffer", "run"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "int32": torch.int32, "int64": torch.int64}


@functools.cache
def interpreted() -> bool:
    """Import triton and the kernels once; whether Triton's interpreter runs them.

    Raises:
        MissingRuntime: triton is not installed.
    """
    try:
        import triton  # noqa: F401 - a clear error before the kernels' own import
    except ImportError as exc:  # pragma: no cover - exercised where triton is absent
        from qsa_common.errors import MissingRuntime

        raise MissingRuntime(f"the Triton backend needs the 'triton' package: {INSTALL['triton']}") from exc
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


def _shared_per_block(device: torch.device) -> int:
    """The shared memory a block on ``device`` may opt in to (0 where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


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


def input_maxima(query: torch.Tensor, grad_out: torch.Tensor, value: torch.Tensor,
                 lse: torch.Tensor) -> torch.Tensor:
    """MAXIMA of the deterministic backward (``qsa_triton.fixed_point``): fp32 ``[3]``,
    max|query| and max|grad_out| over the rows ``[b, i, h, :]`` whose (row, head) pair has
    routes (``lse`` ``[B, Hq, S_q]`` not +inf: the backward never reads the others) and
    whose own maximum is finite (a row holding NaN/inf is confined by the kernels and
    enters no sum), and max|value| over the rows ``[b, j, g, :]`` whose own maximum is
    finite. Maxima round nothing, so these are the bits ``qsa_jax`` computes too.
    Temporaries of one value per row and head only."""
    routed = (lse != float("inf")).transpose(1, 2)

    def row_maxima(x):
        lo, hi = torch.aminmax(x, dim=-1)
        return torch.maximum(-lo, hi)

    def largest(rows, keep):
        return torch.where(keep & torch.isfinite(rows), rows, torch.zeros_like(rows)).amax().float()

    return torch.stack([largest(row_maxima(query), routed), largest(row_maxima(grad_out), routed),
                        largest(row_maxima(value), True)])


@dataclass(frozen=True)
class TorchAdapter:
    """:class:`qsa_triton.driver.Adapter` for tensors on ``device`` (any strides)."""

    device: torch.device
    wide_keys = True

    @property
    def interpreted(self) -> bool:
        return interpreted()

    @property
    def hopper_forward(self) -> bool:
        return hopper_forward(self.device)

    @property
    def hopper_backward(self) -> bool:
        return hopper_backward(self.device)

    def launch(self, launch, arrays):
        return run(launch, arrays, self.device)

    def operand(self, x):
        return tuple(x.shape), tuple(x.stride())

    def dtype(self, x):
        return dtype_name(x.dtype)

    def aligned(self, *xs):
        return all(x.data_ptr() % 16 == 0 for x in xs)

    def dense(self, x):
        return dense_aligned(x)

    def sort(self, keys, chunk):
        if chunk >= keys.numel():
            return torch.sort(keys).values
        for start in range(0, keys.numel(), chunk):
            keys[start:start + chunk] = torch.sort(keys[start:start + chunk]).values
        return keys

    def concat(self, parts):
        return torch.cat(parts)

    def reshape(self, x, shape):
        return x.view(shape)

    def cast(self, x, like):
        return x.to(like.dtype)

    def maxima(self, q, do, v, lse):
        return input_maxima(q, do, v, lse)


def adapter(device: torch.device) -> TorchAdapter:
    """The adapter of tensors on ``device``."""
    return TorchAdapter(torch.device(device))
