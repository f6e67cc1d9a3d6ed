"""The kernels a :class:`qsa_triton.launch.Launch` names, and how a launcher compiles them.

:func:`kernel` imports triton and the kernel modules on first use; :func:`interprets`
says, without importing them, whether Triton's interpreter will run them. Re-exported by
:mod:`qsa_triton.launch`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .launch import Launch

__all__ = ["attention_input_dtypes", "compile_signature", "interpreted", "interprets", "kernel"]

_MODULES = {"forward": ("forward", "qsa_forward_kernel"), "forward_sm90": ("forward_sm90", "qsa_forward_sm90_kernel"),
            "backward": ("backward", "qsa_backward_kernel"),
            "backward_sm90": ("backward_sm90", "qsa_backward_sm90_kernel"),
            "fixed_point": ("fixed_point", "fixed_point_kernel"),
            "union_keys": ("union_keys", "union_keys_kernel"), "union_merge": ("union_merge", "union_merge_kernel"),
            "union_cut": ("union_cut", "union_cut_kernel"),
            "union_rank": ("union_rank", "union_rank_kernel")}


def kernel(name: str):
    """The ``@triton.jit`` function a :class:`Launch` names (imports triton).

    Raises:
        ImportError: triton is not installed.
    """
    import importlib

    module, attr = _MODULES[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), attr)


_TRITON_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int32": "*i32"}


def attention_input_dtypes(launch: Launch, dtype: str) -> dict[str, str]:
    """Input name -> dtype name for a forward or backward kernel's ``launch`` whose Q, K, V,
    O and dO are ``dtype``: LSE and MAXIMA fp32, the unions' UNION / COUNT / ROWBITS int32
    (the arrays the launchers pass). Raises ``ValueError`` for an input outside these."""
    fixed = {"LSE": "float32", "MAXIMA": "float32", "UNION": "int32", "COUNT": "int32", "ROWBITS": "int32"}
    out = {}
    for name in launch.inputs:
        if name in ("Q", "K", "V", "O", "DO"):
            out[name] = dtype
        elif name in fixed:
            out[name] = fixed[name]
        else:
            raise ValueError(f"{launch.kernel}: input {name!r} is not an attention kernel's")
    return out


def compile_signature(launch: Launch, input_dtypes: dict[str, str], *, integers_constant: bool = False):
    """``(signature, constexprs, attrs)`` for compiling ``launch``'s kernel ahead of time
    (``triton.compile`` of an ``ASTSource`` / ``GluonASTSource``) as a launcher specialises
    it: pointers typed from ``input_dtypes`` (input name -> dtype name) and the outputs'
    dtypes, fp32 scalars, constexpr parameters, booleans and 1 as constants, other
    integers as i32 runtime arguments (torch's JIT) or, with ``integers_constant``, as
    constants (jax-triton); pointers and integers that are multiples of 16 marked divisible
    by 16 (imports triton)."""
    fn = kernel(launch.kernel)
    params = dict(launch.params)
    sig = {n: _TRITON_TYPES[input_dtypes[n]] for n in launch.inputs}
    sig.update({n: "fp32" for n, _ in launch.scalars})
    sig.update({o.name: _TRITON_TYPES[o.dtype] for o in launch.outputs})
    constexprs = {}
    for n, v in launch.params:
        if integers_constant or fn.params[fn.arg_names.index(n)].is_constexpr or isinstance(v, bool) or v == 1:
            constexprs[n], sig[n] = v, "constexpr"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and params[n] % 16 == 0)}
    return sig, constexprs, attrs


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` was set
    before they were first imported)."""
    kernel("forward")  # imports them, if nothing has yet
    return interprets()


# the values of TRITON_INTERPRET that turn Triton's interpreter on (its getenv_bool, lower-cased)
_TRUE_SETTINGS = ("1", "true", "on", "yes", "y")


def interprets() -> bool:
    """:func:`interpreted` without importing triton or the kernels: once they are imported,
    how they were; before, what their import will see (``TRITON_INTERPRET`` now)."""
    forward = sys.modules.get(f"{__package__}.forward")
    if forward is None:
        return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE_SETTINGS
    return type(forward.qsa_forward_kernel).__name__ == "InterpretedFunction"
