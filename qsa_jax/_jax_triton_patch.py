"""The one patch of a jax-triton internal: launching Gluon kernels through it.

Supported: jax-triton 0.3.1 (the version ``qsa[cuda12]`` pins; the range
``>=0.3.1,<0.4`` as long as :data:`EXPECTED_PARAMETERS` still names the patched
function's parameters). The patched function is ``jax_triton.triton_lib.
get_or_create_triton_kernel``, a private helper that jax-triton's lowering looks up when
it runs. Where its parameters differ from :data:`EXPECTED_PARAMETERS` nothing is patched
and Gluon kernels are not launched (the portable kernels run instead);
``tests/test_jax_triton.py`` fails when the installed version's signature changes.
"""

from __future__ import annotations

import functools
import inspect
import os

from qsa_common.errors import UnsupportedDevice

__all__ = ["EXPECTED_PARAMETERS", "SUPPORTED_VERSIONS", "install_gluon_compile", "signature_matches"]

SUPPORTED_VERSIONS = ">=0.3.1,<0.4"
# the parameters of jax_triton.triton_lib.get_or_create_triton_kernel in jax-triton 0.3.1, in order
EXPECTED_PARAMETERS = ("backend_init_func", "platform", "fn", "arg_dtypes", "scalar_args", "num_warps",
                       "num_stages", "num_ctas", "compute_capability", "enable_fp_fusion", "metaparams", "dump")
_CACHE_VARIABLE = "TRITON_CACHE_DIR"


def signature_matches(function) -> bool:
    """Whether ``function`` takes :data:`EXPECTED_PARAMETERS`, in order (what the patch
    passes on to it)."""
    try:
        return tuple(inspect.signature(function).parameters) == EXPECTED_PARAMETERS
    except (TypeError, ValueError):
        return False


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
    if not signature_matches(original):
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
                    raise UnsupportedDevice(f"{fn.__name__} needs a {scratch.split('_')[0]} scratch buffer, "
                                            "which jax-triton 0.3.1 cannot pass")
            compiled[key] = calls.TritonKernel(kernel.metadata.name, kernel.metadata.num_warps, num_ctas,
                                               kernel.metadata.shared, kernel.asm["ptx"], kernel.asm["ttgir"],
                                               compute_capability)
        return compiled[key], attrs

    get_or_create_triton_kernel.qsa_gluon = True
    triton_lib.get_or_create_triton_kernel = get_or_create_triton_kernel
    return True
