"""Launching the ``qsa_triton`` kernels from JAX, and the route unions built that way.

:class:`JaxTritonLauncher` turns a :class:`qsa_triton.launch.Launch` into one
``jax_triton.triton_call`` (jax-triton 0.3.1): the array inputs, then the fp32 scalars
as ``np.float32`` (jax-triton types a Python float as fp64), positionally; the outputs,
which triton_call appends after them, as ``out_shape`` (``zeroed_outputs`` for the
accumulators); integers and constexprs as keyword metaparameters, which jax-triton
compiles in as constants (JAX's strides and sizes are static). jax_triton is imported
on first use only.

A launcher is any hashable callable ``launcher(launch, arrays) -> outputs by name`` with
an ``interpreted`` attribute (whether the kernels run in Triton's interpreter); tests
inject one that runs the same kernels in the interpreter.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from qsa_triton import launch as spec
from qsa_triton.plan import CutStep, SortStep, rank_recipe

__all__ = ["JaxTritonLauncher", "jax_triton", "install_gluon_compile", "sorted_unions", "rank_unions",
           "step_unions", "cut_unions", "operand"]


def jax_triton():
    """The ``jax_triton`` module.

    Raises:
        ImportError: jax-triton is not installed, or cannot load (it needs a CUDA build
            of jax).
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
        raise ImportError(
            "qsa_jax's implementation='triton' needs jax-triton 0.3.1 and a CUDA build of jax "
            f"(pip install 'jax-triton==0.3.1' 'jax[cuda12]'); importing it failed: {err}") from err
    finally:
        if saved is None:
            os.environ.pop(_CACHE_VARIABLE, None)
        else:
            os.environ[_CACHE_VARIABLE] = saved
    return module


_CACHE_VARIABLE = "TRITON_CACHE_DIR"


@dataclass(frozen=True)
class JaxTritonLauncher:
    """Launches through ``jax_triton.triton_call`` (compiled kernels only); ``gluon``:
    whether Gluon kernels (``qsa_triton.forward_sm90``) launch too
    (:func:`install_gluon_compile`)."""

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
        ImportError: see :func:`jax_triton`.
        NotImplementedError: ``TRITON_INTERPRET=1`` made the kernels interpreted
            functions, which jax-triton cannot compile.
    """
    module = jax_triton()
    if spec.interpreted():
        raise NotImplementedError("TRITON_INTERPRET=1 is set: jax-triton launches compiled kernels only")
    return JaxTritonLauncher(gluon=install_gluon_compile(module.triton_lib))


def install_gluon_compile(triton_lib) -> bool:
    """Let jax-triton 0.3.1 (``triton_lib``: its ``jax_triton.triton_lib``) launch Gluon
    kernels; returns whether it can.

    jax-triton 0.3.1 builds every kernel from a Triton-language source and launches it
    with the warps it was asked for. A Gluon kernel needs Gluon's own source, and a
    warp-specialized one launches with the warps of all its partitions
    (``metadata.num_warps``: the default partition's ``num_warps`` plus the workers').
    The lowering looks up ``triton_lib.get_or_create_triton_kernel`` when it runs, so
    that function is wrapped: Gluon kernels are compiled here, with the same
    conventions (16-byte-aligned arrays, scalars equal to 1 and metaparameters compiled
    in), and everything else goes to jax-triton's own. False where this triton has no
    Gluon or the function is not 0.3.1's.
    """
    original = getattr(triton_lib, "get_or_create_triton_kernel", None)
    if original is None:
        return False
    if getattr(original, "qsa_gluon", False):
        return True
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return False
    import inspect

    expected = ["backend_init_func", "platform", "fn", "arg_dtypes", "scalar_args", "num_warps", "num_stages",
                "num_ctas", "compute_capability", "enable_fp_fusion", "metaparams", "dump"]
    if list(inspect.signature(original).parameters) != expected:
        return False
    compiled = {}

    @functools.wraps(original)
    def get_or_create_triton_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps,
                                    num_stages, num_ctas, compute_capability, enable_fp_fusion, metaparams, dump):
        if not isinstance(fn, GluonJITFunction) or platform != "cuda":
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, num_warps=num_warps,
                            num_stages=num_stages, num_ctas=num_ctas, compute_capability=compute_capability,
                            enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)
        calls = triton_lib.triton_kernel_call_lib
        if compute_capability is None:
            compute_capability = calls.get_compute_capability(0)
        scalars = {i for i, _, _ in scalar_args}
        attrs = {(i,): [] if i in scalars else [["tt.divisibility", 16]] for i in range(len(arg_dtypes))}
        signature = {fn.arg_names[i]: dtype for i, dtype in enumerate(arg_dtypes)}
        constants = dict(metaparams)
        constants.update({fn.arg_names[i]: 1 for i, _, value in scalar_args if value == 1})
        signature.update({name: "constexpr" for name in constants})
        key = (fn, tuple(signature.items()), tuple(constants.items()), num_warps, num_ctas, compute_capability,
               enable_fp_fusion)
        if key not in compiled:
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.experimental.gluon._runtime import GluonASTSource

            source = GluonASTSource(fn, signature, constants, {k: v for k, v in attrs.items() if v})
            # triton.compile needs Triton's file cache, which jax-triton 0.3.1 switches off
            # (TRITON_CACHE_DIR="") when it is imported first: Triton's default there
            emptied = os.environ.get(_CACHE_VARIABLE) == ""
            if emptied:
                del os.environ[_CACHE_VARIABLE]
            try:
                kernel = triton.compile(source, target=GPUTarget("cuda", compute_capability, 32),
                                        options={"num_warps": num_warps, "num_ctas": num_ctas,
                                                 "enable_fp_fusion": enable_fp_fusion})
            finally:
                if emptied:
                    os.environ[_CACHE_VARIABLE] = ""
            for scratch in ("global_scratch_size", "profile_scratch_size"):
                if getattr(kernel.metadata, scratch, 0):
                    raise NotImplementedError(f"{fn.__name__} needs a {scratch.split('_')[0]} scratch buffer, "
                                              "which jax-triton 0.3.1 cannot pass")
            compiled[key] = calls.TritonKernel(kernel.metadata.name, kernel.metadata.num_warps, num_ctas,
                                               kernel.metadata.shared, kernel.asm["ptx"], kernel.asm["ttgir"],
                                               compute_capability)
        return compiled[key], attrs

    get_or_create_triton_kernel.qsa_gluon = True
    triton_lib.get_or_create_triton_kernel = get_or_create_triton_kernel
    return True


def operand(x) -> spec.Operand:
    """Shape and (row-major) per-element strides of a JAX array."""
    return tuple(x.shape), spec.contiguous_strides(x.shape)


def sorted_unions(routes: jax.Array, kv_length: int, step: SortStep, max_grid_y: int, launcher):
    """``(union, count, rowbits)`` of ``step``'s groups: the keys kernel, a ``jnp.sort`` of each
    ``per_sort`` whole groups, the merge kernel (``qsa_torch``'s recipe)."""
    bsz, _, k = routes.shape
    keys = launcher(spec.keys_launch(step, operand(routes), kv_length, max_grid_y), {"ROUTES": routes})["KEYS"]
    chunk = step.keys.per_sort * step.rows * k
    n = keys.shape[0]
    # one 1-D sort per chunk of whole groups: XLA sorts a 1-D array with a radix sort, a
    # batched [sorts, chunk] one with a comparison sort
    keys = jnp.concatenate([jnp.sort(keys[start:start + chunk]) for start in range(0, n, chunk)])
    merged = launcher(spec.merge_launch(step, bsz, k, interpreted=launcher.interpreted), {"KEYS": keys})
    return merged["UNION"], merged["COUNT"], merged["ROWBITS"]


def rank_unions(routes: jax.Array, kv_length: int, step: SortStep, launcher, *, padded: bool = True):
    """:func:`sorted_unions` without the sort: the rank kernel (``qsa_triton.union_rank``),
    window by window (``qsa_torch``'s recipe; its scratch outputs are dropped). XLA may
    schedule several windows' scratch at once, so torch's bound on it (the sort keys'
    bytes) is not guaranteed here. ``padded`` False leaves the entries past each count
    unwritten."""
    bsz, _, k = routes.shape
    groups = bsz * step.n_groups
    window = spec.rank_window(step, bsz, k, kv_length)
    parts = []
    for first in range(0, groups, window):
        launch = spec.rank_launch(step, operand(routes), kv_length, first, min(window, groups - first),
                                  interpreted=launcher.interpreted, fill=padded)
        parts.append(launcher(launch, {"ROUTES": routes}))
    union, rowbits, count = (parts[0][name] if len(parts) == 1 else jnp.concatenate([p[name] for p in parts])
                             for name in ("UNION", "ROWBITS", "COUNT"))
    shape = (bsz, step.n_groups, step.width)
    return union.reshape(shape), count.reshape(shape[:2]), rowbits.reshape(shape)


def step_unions(routes: jax.Array, kv_length: int, step: SortStep, max_grid_y: int, launcher, *,
                padded: bool = True):
    """``step``'s unions by the recipe ``qsa_triton.plan.rank_recipe`` picks (the sort
    recipe's are always padded)."""
    if rank_recipe(step, routes.shape[2], kv_length):
        return rank_unions(routes, kv_length, step, launcher, padded=padded)
    return sorted_unions(routes, kv_length, step, max_grid_y, launcher)


def cut_unions(unions, step: CutStep, max_grid_y: int, launcher, *, padded: bool = True):
    """``step``'s sub-unions of ``unions`` = ``(union, count, rowbits)``, read up to their
    counts; ``padded`` False leaves the entries past each new count unwritten."""
    union, count, rowbits = unions
    launch = spec.cut_launch(step, tuple(union.shape), max_grid_y, interpreted=launcher.interpreted, fill=padded)
    cut = launcher(launch, {"UNION": union, "ROWBITS": rowbits, "COUNT": count})
    return cut["SUB_UNION"], cut["SUB_COUNT"], cut["SUB_ROWBITS"]
