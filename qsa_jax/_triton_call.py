"""The JAX adapter of the Triton driver (``qsa_triton.driver``): launching through jax-triton.

:class:`JaxTritonLauncher` turns a :class:`qsa_triton.launch.Launch` into one
``jax_triton.triton_call`` (jax-triton 0.3.1): the array inputs, then the fp32 scalars
as ``np.float32`` (jax-triton types a Python float as fp64), positionally; the outputs,
which triton_call appends after them, as ``out_shape`` (``zeroed_outputs`` for the
accumulators); integers and constexprs as keyword metaparameters, which jax-triton
compiles in as constants (JAX's strides and sizes are static). jax_triton is imported
on first use only.

A launcher is any hashable callable ``launcher(launch, arrays) -> outputs by name`` with
an ``interpreted`` attribute (whether the kernels run in Triton's interpreter); tests
inject one that runs the same kernels in the interpreter. :class:`JaxAdapter` wraps a
launcher with the few array operations the driver asks for.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from qsa_common.errors import MissingRuntime, UnsupportedDevice
from qsa_triton import launch as spec
from qsa_triton.limits import INSTALL

from ._jax_triton_patch import install_gluon_compile

__all__ = ["JaxAdapter", "JaxTritonLauncher", "default_launcher", "input_maxima", "jax_triton", "operand"]

_CACHE_VARIABLE = "TRITON_CACHE_DIR"


def jax_triton():
    """The ``jax_triton`` module.

    Raises:
        MissingRuntime: jax-triton is not installed, or cannot load (it needs a CUDA
            build of jax).
    """
    # jax-triton 0.3.1 sets TRITON_CACHE_DIR to "" when it is imported, which leaves Triton's
    # own file cache without a directory: every later triton.jit compile in the process (a
    # torch Triton kernel beside JAX, in parity runs or mixed programs) then fails with
    # "Could not create or locate cache dir". Its own compile path never reads that
    # variable, so the caller's value is put back.
    saved = os.environ.get(_CACHE_VARIABLE)
    try:
        import jax_triton as module
    except ImportError as err:
        raise MissingRuntime(f"the Triton backend needs the 'jax_triton' package: {INSTALL['jax_triton']}; "
                             f"importing it failed: {err}") from err
    finally:
        if saved is None:
            os.environ.pop(_CACHE_VARIABLE, None)
        else:
            os.environ[_CACHE_VARIABLE] = saved
    return module


@dataclass(frozen=True)
class JaxTritonLauncher:
    """Launches through ``jax_triton.triton_call`` (compiled kernels only); ``gluon``:
    whether Gluon kernels (``qsa_triton.forward_sm90``) launch too
    (:func:`qsa_jax._jax_triton_patch.install_gluon_compile`)."""

    interpreted: bool = False
    gluon: bool = False

    def __call__(self, launch: spec.Launch, arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        jt = jax_triton()
        args = [arrays[name] for name in launch.inputs] + [np.float32(value) for _, value in launch.scalars]
        out_shape = [jax.ShapeDtypeStruct(out.shape, jnp.dtype(out.dtype)) for out in launch.outputs]
        zeroed = tuple(i for i, out in enumerate(launch.outputs) if out.zeroed)
        outputs = jt.triton_call(*args, kernel=spec.kernel(launch.kernel), out_shape=out_shape, grid=launch.grid,
                                 name=f"qsa_{launch.kernel}", num_warps=launch.num_warps,
                                 num_stages=launch.num_stages, zeroed_outputs=zeroed, **dict(launch.params))
        return {out.name: x for out, x in zip(launch.outputs, outputs)}


@functools.cache
def default_launcher() -> JaxTritonLauncher:
    """The jax-triton launcher (imports jax_triton).

    Raises:
        MissingRuntime: see :func:`jax_triton`.
        UnsupportedDevice: ``TRITON_INTERPRET=1`` made the kernels interpreted functions,
            which jax-triton cannot compile.
    """
    module = jax_triton()
    if spec.interpreted():
        raise UnsupportedDevice("TRITON_INTERPRET=1 is set: jax-triton launches compiled kernels only")
    return JaxTritonLauncher(gluon=install_gluon_compile(module.triton_lib))


def operand(x) -> spec.Operand:
    """Shape and (row-major) per-element strides of a JAX array."""
    return tuple(x.shape), spec.contiguous_strides(x.shape)


def input_maxima(q, do, v, lse):
    """MAXIMA of the deterministic backward (``qsa_triton.fixed_point``): f32 ``[3]``,
    max|q| and max|do| over the rows ``[b, i, h, :]`` whose (row, head) pair has routes
    (``lse`` ``[B, Hq, S_q]`` not +inf: the backward never reads the others) and whose own
    maximum is finite (a row holding NaN/inf is confined by the kernels and enters no
    sum), max|v| over the rows ``[b, j, g, :]`` whose own maximum is finite (``qsa_torch``
    computes the same bits: maxima round nothing)."""
    routed = (lse != jnp.inf).transpose(0, 2, 1)

    def largest(x, keep):
        rows = jnp.max(jnp.abs(x), axis=-1)
        return jnp.max(jnp.where(keep & jnp.isfinite(rows), rows, jnp.zeros_like(rows))).astype(jnp.float32)

    return jnp.stack([largest(q, routed), largest(do, routed), largest(v, True)])


@dataclass(frozen=True)
class JaxAdapter:
    """:class:`qsa_triton.driver.Adapter` for JAX arrays (row-major, aligned) launched by
    ``launcher``. ``hopper``: the launcher launches compiled Gluon kernels on an sm_90
    GPU, decided once from the inputs' device (a backward rule may be traced where the
    default device differs). ``wide_keys``: x64 was on when the call began."""

    launcher: object
    hopper: bool = False
    wide_keys: bool = False

    @property
    def interpreted(self) -> bool:
        return self.launcher.interpreted

    @property
    def hopper_forward(self) -> bool:
        return self.hopper

    hopper_backward = hopper_forward

    def launch(self, launch, arrays):
        return self.launcher(launch, arrays)

    def operand(self, x):
        return operand(x)

    def dtype(self, x):
        return jnp.dtype(x.dtype).name

    def aligned(self, *xs):
        return True

    def dense(self, x):
        return x

    def sort(self, keys, chunk):
        # one 1-D sort per chunk of whole groups: XLA sorts a 1-D array with a radix sort, a
        # batched [sorts, chunk] one with a comparison sort
        return jnp.concatenate([jnp.sort(keys[start:start + chunk]) for start in range(0, keys.shape[0], chunk)])

    def concat(self, parts):
        return jnp.concatenate(parts)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def cast(self, x, like):
        return x.astype(like.dtype)

    def maxima(self, q, do, v, lse):
        return input_maxima(q, do, v, lse)
