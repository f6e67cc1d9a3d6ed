"""The backends the parity suite and the benchmark know, in both frameworks.

Each :class:`Backend` names its attention function by module path and imports
it on first use, so a module that does not exist yet, or whose runtime is
absent, makes that backend *unavailable* (with the reason) instead of breaking
the suite. :func:`static_reason` says, before any call, why a backend cannot
run a given case here (device, dtype, head sizes, layout, route family).

Every function is called as ``fn(query, key, value, routes, softmax_scale)``;
torch functions take torch tensors, JAX functions JAX arrays.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Backend", "BACKENDS", "BITWISE_PAIRS", "Environment", "Case", "static_reason", "register"]

# Products B * S_q * K * Hq above which an interpreted kernel (CPU emulation of a
# GPU kernel) would take minutes: such cells are reported unavailable.
INTERPRET_LIMIT = 1 << 20


@dataclass(frozen=True)
class Case:
    """One cell row of the matrix: what a backend is asked to compute."""

    layout: str
    family: str
    dtype: str
    heads: tuple[int, int]
    head_dim: int
    batch: int
    query_length: int
    kv_length: int
    width: int

    @property
    def work(self) -> int:
        return self.batch * self.query_length * self.width * self.heads[0]

    def label(self) -> str:
        return f"{self.layout}/{self.family}/{self.dtype}/{self.heads[0]}:{self.heads[1]}"


@dataclass(frozen=True)
class Environment:
    """What this process can run on: torch device and capability, JAX platform."""

    torch_device: str  # "cuda" or "cpu"; "" without torch
    capability: tuple[int, int] | None
    jax_platform: str  # "gpu", "cpu", ...; "" without jax
    triton_interpret: bool

    @staticmethod
    def detect(frameworks: tuple[str, ...] = ("torch", "jax")) -> Environment:
        """Probe the frameworks named (only those are imported)."""
        device, capability, platform = "", None, ""
        if "torch" in frameworks:
            try:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
                if device == "cuda":
                    capability = tuple(torch.cuda.get_device_capability())
            except ImportError:
                pass
        if "jax" in frameworks:
            try:
                import jax

                platform = jax.default_backend()
            except ImportError:
                pass
        return Environment(device, capability, platform, os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class Backend:
    """A named attention function of one framework.

    ``load`` returns the function (imports happen there). ``dtypes``: the
    compute dtypes it accepts. ``requires``: extra static conditions,
    ``(env, case) -> reason or None``. ``interpreted``: runs a GPU kernel on
    the CPU (small shapes only). ``forward_lse``: where the backend can say, a
    loader of ``fn(query, key, value, routes, scale) -> (out, lse, ...)`` (its
    forward without autograd, LSE ``[B, Hq, S_q]``), for the bitwise comparisons
    of :data:`BITWISE_PAIRS`.
    """

    name: str
    framework: str  # "torch" or "jax"
    load: Callable[[], Callable[..., Any]] = field(compare=False)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    requires: Callable[[Environment, Case], str | None] | None = field(default=None, compare=False)
    interpreted: bool = False
    description: str = ""
    forward_lse: Callable[[], Callable[..., Any]] | None = field(default=None, compare=False)


def _from_module(module: str, function: str, **kwargs) -> Callable[[], Callable[..., Any]]:
    """A loader importing ``module.function`` on first use, binding ``kwargs``."""

    @functools.cache
    def load():
        fn = getattr(importlib.import_module(module), function)
        return functools.partial(fn, **kwargs) if kwargs else fn

    return load


def _needs_cuda(env: Environment, case: Case) -> str | None:
    return None if env.torch_device == "cuda" else "needs a CUDA GPU (none here)"


def _triton(env: Environment, case: Case) -> str | None:
    if env.torch_device == "cuda" or env.triton_interpret:
        return None
    return "needs a CUDA GPU or TRITON_INTERPRET=1"


def _fa4(env: Environment, case: Case) -> str | None:
    if env.torch_device != "cuda" or env.capability is None or env.capability[0] != 9:
        return "needs an SM90 (Hopper) GPU"
    if case.head_dim != 256:
        return "head dim 256 only"
    return None


def _cudnn(env: Environment, case: Case) -> str | None:
    if env.capability not in ((10, 0), (10, 3)):
        return "needs an SM100/SM103 (Blackwell) GPU (cuDNN QSA kernels)"
    if case.family != "qsa":
        return "QSA-format routes only"
    if case.layout == "cp" or case.query_length != case.kv_length:
        return "no context-parallel layout"
    if case.heads not in ((24, 2), (12, 1)) or case.head_dim != 256:
        return "(Hq, Hkv) in {(24,2), (12,1)} and D = 256 only"
    if case.width > 2052:
        return "route width <= 2052 only"
    return None


def _jax_gpu(env: Environment, case: Case) -> str | None:
    return None if env.jax_platform == "gpu" else "needs JAX on a CUDA GPU (see jax-pallas-interpret)"


def _jax_triton(env: Environment, case: Case) -> str | None:
    if env.jax_platform != "gpu":
        return "needs JAX on a CUDA GPU (jax-triton has no CPU mode; the CPU tests emulate its launch)"
    return None


BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` (the order of registration is the report's)."""
    BACKENDS[backend.name] = backend
    return backend


register(Backend(
    "torch-reference", "torch",
    _from_module("qsa_torch.reference", "reference_sparse_gqa_attention"),
    description="qsa_torch.reference_sparse_gqa_attention (gather, autograd)",
))
register(Backend(
    "jax-xla", "jax",
    _from_module("qsa_jax.attention", "sparse_gqa_attention", implementation="xla"),
    description='qsa_jax.sparse_gqa_attention(implementation="xla")',
))
register(Backend(
    "jax-pallas", "jax",
    _from_module("qsa_jax.attention", "sparse_gqa_attention", implementation="pallas",
                 interpret=False),
    requires=_jax_gpu,
    description='qsa_jax.sparse_gqa_attention(implementation="pallas") on the GPU',
))
register(Backend(
    "jax-pallas-interpret", "jax",
    _from_module("qsa_jax.attention", "sparse_gqa_attention", implementation="pallas",
                 interpret=True),
    interpreted=True,
    description="the Pallas kernels in interpret mode (CPU emulation)",
))
register(Backend(
    "flex", "torch",
    _from_module("qsa_torch.flex_qsa", "flex_sparse_gqa_attention"),
    description="qsa_torch.flex_qsa (FlexAttention; forward only on CPU)",
))
register(Backend(
    "fa4", "torch",
    _from_module("qsa_torch.fa4_qsa", "fa4_sparse_gqa_attention"),
    dtypes=("bfloat16",), requires=_fa4,
    description="qsa_torch.fa4_qsa (FlashAttention 4, SM90, D=256, bf16)",
))
register(Backend(
    "cudnn", "torch",
    _from_module("qsa_torch.cudnn_qsa", "cudnn_sparse_gqa_attention"),
    dtypes=("bfloat16",), requires=_cudnn,
    description="qsa_torch.cudnn_qsa (cuDNN Frontend QSA, SM100/SM103, bf16)",
))
register(Backend(
    "triton", "torch",
    _from_module("qsa_torch.triton_qsa", "triton_sparse_gqa_attention"),
    requires=_triton,
    description="qsa_torch.triton_qsa (the qsa_triton token-gather kernels through torch)",
    forward_lse=_from_module("qsa_torch.triton_qsa", "forward_with_residuals"),
))
register(Backend(
    "jax-triton", "jax",
    _from_module("qsa_jax.attention", "sparse_gqa_attention", implementation="triton"),
    requires=_jax_triton,
    description='qsa_jax.sparse_gqa_attention(implementation="triton"): the same kernels through jax-triton',
    forward_lse=_from_module("qsa_jax.triton_qsa", "forward_with_lse"),
))

# Backends that launch the same kernels with the same launches: their forward output and
# LSE must be equal bit for bit on the same inputs and GPU.
BITWISE_PAIRS: tuple[tuple[str, str], ...] = (("triton", "jax-triton"),)


def static_reason(backend: Backend, env: Environment, case: Case) -> str | None:
    """Why ``backend`` cannot run ``case`` here (checked without calling it), or None."""
    if backend.framework == "torch" and not env.torch_device:
        return "torch is not installed"
    if backend.framework == "jax" and not env.jax_platform:
        return "jax is not installed"
    if backend.requires is not None and (reason := backend.requires(env, case)) is not None:
        return reason
    if case.dtype not in backend.dtypes:
        return f"computes in {'/'.join(backend.dtypes)} only"
    on_gpu = env.torch_device == "cuda" if backend.framework == "torch" else env.jax_platform == "gpu"
    if backend.interpreted and (on_gpu or case.work > INTERPRET_LIMIT):
        return "interpret mode is for small CPU shapes only"
    if backend.name == "triton" and env.torch_device != "cuda" and case.work > INTERPRET_LIMIT:
        return "interpreted Triton is for small CPU shapes only"
    return None


def load_reason(backend: Backend) -> str | None:
    """Import the backend's function; return why that failed, or None."""
    try:
        backend.load()
    except Exception as err:  # noqa: BLE001 -- any import-time failure means unavailable
        return f"{type(err).__name__}: {err}".strip()
    return None
