"""What the Triton kernels take, written once for every framework that launches them.

:func:`decline` turns the facts a launcher knows about its inputs (head dim, dtype name,
where they live, whether the runtime is installed) into the
:class:`qsa_common.errors.BackendDeclined` the backend raises, or None; ``qsa_torch``
and ``qsa_jax`` both ask it, so the two frameworks decline the same inputs with the
same classes and messages. Pure Python: imports neither triton nor a framework.
"""

from __future__ import annotations

from qsa_common.errors import BackendDeclined, MissingRuntime, UnsupportedDevice, UnsupportedDtype, UnsupportedShape

__all__ = ["DTYPES", "MAX_HEAD_DIM", "MIN_CAPABILITY", "INSTALL", "decline", "off_gpu"]

MAX_HEAD_DIM = 256  # D_PAD = 256 is the widest tile the kernels hold in registers and shared memory
DTYPES = ("float16", "bfloat16", "float32")
# Triton builds for NVIDIA GPUs of compute capability 8.0 and newer; the kernels' bf16
# dots need it too.
MIN_CAPABILITY = (8, 0)
# How to install each runtime a launcher needs (the message of MissingRuntime names it).
INSTALL = {
    "triton": "pip install 'triton>=3.6' (CUDA builds of torch bring it; also in 'qsa-kernels[test]')",
    "jax_triton": "pip install 'qsa-kernels[cuda12]' (jax-triton 0.3.1 and a CUDA build of jax)",
}


def off_gpu(device: str) -> UnsupportedDevice:
    """The error for inputs on ``device``, not a CUDA GPU, with compiled kernels."""
    return UnsupportedDevice(f"the Triton kernels run on CUDA GPUs (or in Triton's interpreter, "
                             f"TRITON_INTERPRET=1 set before they are imported); the inputs are on {device}")


def decline(head_dim: int, dtype: str, *, runtime: str, runtime_present: bool, device: str,
            capability: tuple[int, int] | None, interpreted: bool = False) -> BackendDeclined | None:
    """Why the Triton backend cannot take these inputs, or None; checked in this order.

    Args:
        head_dim: D.
        dtype: the inputs' dtype name (``"bfloat16"``, ...).
        runtime: the package the launcher needs (``"triton"`` or ``"jax_triton"``) and
            ``runtime_present`` whether it is installed.
        device: where the inputs live, as the framework names it (``"cuda"``, ``"cpu"``,
            ``"gpu"``...); ``capability`` the CUDA compute capability there, None off a
            CUDA GPU.
        interpreted: the kernels run in Triton's interpreter (any device is then fine).
    """
    if head_dim > MAX_HEAD_DIM:
        return UnsupportedShape(f"the Triton kernels support head dim <= {MAX_HEAD_DIM}, got {head_dim}")
    if dtype not in DTYPES:
        return UnsupportedDtype(f"the Triton kernels compute in {', '.join(DTYPES)}, got {dtype}")
    if not runtime_present:
        return MissingRuntime(f"the Triton backend needs the {runtime!r} package: {INSTALL[runtime]}")
    if interpreted:
        return None
    if capability is None:
        return off_gpu(device)
    if tuple(capability) < MIN_CAPABILITY:
        return UnsupportedDevice(f"Triton builds for CUDA compute capability >= "
                                 f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the inputs' GPU has "
                                 f"{capability[0]}.{capability[1]}")
    return None
