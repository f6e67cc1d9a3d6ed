"""Weights between the nnx layer and the upstream PyTorch layer's state dict.

Torch ``Linear`` weights are ``[out, in]``; the nnx kernels hold their
transposes. Values are copied bit for bit: bfloat16 tensors travel as their
16-bit patterns (``ml_dtypes.bfloat16`` on the numpy side), never through a
float conversion. This module never imports torch: torch tensors are
recognised by duck typing, and :func:`to_torch_state_dict` builds tensors with
the torch module the caller has already imported.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .attention import QSAAttention
from .indexer import QSAIndexer

__all__ = ["load_torch_state_dict", "to_torch_state_dict"]

_INDEXER = {"index_qk_proj.weight": (("index_qk_proj",), True),
            "q_layernorm.weight": (("q_layernorm",), False),
            "k_layernorm.weight": (("k_layernorm",), False)}
_ATTENTION = {
    "q_proj.weight": (("q_proj", "kernel"), True),
    "k_proj.weight": (("k_proj", "kernel"), True),
    "v_proj.weight": (("v_proj", "kernel"), True),
    "o_proj.weight": (("o_proj", "kernel"), True),
    "q_norm.weight": (("q_norm",), False),
    "k_norm.weight": (("k_norm",), False),
    **{f"indexer.{k}": (("indexer",) + path, t) for k, (path, t) in _INDEXER.items()},
}


def _names(module):
    if isinstance(module, QSAAttention):
        return _ATTENTION
    if isinstance(module, QSAIndexer):
        return _INDEXER
    raise TypeError(f"module must be a QSAAttention or QSAIndexer, got {type(module).__name__}")


def _variable(module, path):
    for name in path:
        module = getattr(module, name)
    return module


def _to_numpy(value, key: str) -> np.ndarray:
    """A host copy of a numpy array, jax array or torch tensor (bf16 bit-exact)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, jax.Array):
        return np.asarray(value)
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        torch = sys.modules["torch"]  # already imported: the tensor exists
        tensor = value.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    raise TypeError(f"state_dict[{key!r}] must be a numpy array, jax array or torch tensor, "
                    f"got {type(value).__name__}")


def load_torch_state_dict(module, state_dict: Mapping, prefix: str = "") -> None:
    """Copy the upstream layer's weights into ``module`` (in place).

    Args:
        module: a :class:`QSAAttention` (keys ``q_proj.weight`` ...
            ``indexer.k_layernorm.weight``) or a :class:`QSAIndexer` (keys
            ``index_qk_proj.weight``, ``q_layernorm.weight``, ``k_layernorm.weight``).
        state_dict: name -> torch tensor, numpy or jax array, torch layout.
        prefix: checkpoint prefix of the layer, e.g.
            ``"model.language_model.layers.3.self_attn."``; keys outside it are
            ignored (a whole model's state dict may be passed).

    Values are cast to the module's variable dtypes (bfloat16 <-> bfloat16 and
    float32 <-> float32 are bit-exact).

    Raises:
        ValueError: naming every missing, unexpected (under ``prefix``) or
            mis-shaped key; nothing is written then.
        TypeError: a value that is not an array or tensor.
    """
    names = _names(module)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    ours = {k[len(prefix):]: v for k, v in state_dict.items() if isinstance(k, str) and k.startswith(prefix)}
    missing = sorted(prefix + k for k in names if k not in ours)
    unexpected = sorted(prefix + k for k in ours if k not in names)
    arrays, bad_shapes = {}, []
    for key, (path, transpose) in names.items():
        if key not in ours:
            continue
        array = _to_numpy(ours[key], prefix + key)
        var = _variable(module, path)
        want = tuple(var.shape[::-1] if transpose else var.shape)
        if tuple(array.shape) != want:
            bad_shapes.append(f"{prefix + key}: expected {list(want)}, got {list(array.shape)}")
            continue
        arrays[key] = (var, array.T if transpose else array)
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if bad_shapes:
        problems.append("mis-shaped keys [" + "; ".join(bad_shapes) + "]")
    if problems:
        raise ValueError(f"cannot load the state dict into {type(module).__name__}: " + ", ".join(problems))
    for var, array in arrays.values():
        var[...] = jnp.asarray(np.ascontiguousarray(array).astype(var[...].dtype))


def to_torch_state_dict(module, prefix: str = "", *, as_numpy: bool = False) -> dict:
    """The upstream layer's state dict from ``module``: ``{prefix + name: [out, in] tensor}``.

    Args:
        module: a :class:`QSAAttention` or :class:`QSAIndexer`.
        prefix: prepended to every key.
        as_numpy: numpy arrays (``ml_dtypes.bfloat16`` for bf16) instead of torch tensors.

    Raises:
        ImportError: torch tensors were asked for but torch has not been imported
            in this process (qsa_jax never imports it itself).
    """
    names = _names(module)
    arrays = {}
    for key, (path, transpose) in names.items():
        array = np.asarray(_variable(module, path)[...])
        arrays[prefix + key] = np.ascontiguousarray(array.T if transpose else array)
    if as_numpy:
        return arrays
    torch = sys.modules.get("torch")
    if torch is None:
        raise ImportError("to_torch_state_dict builds tensors with an imported torch: `import torch` first, "
                          "or pass as_numpy=True for numpy arrays")
    out = {}
    for key, array in arrays.items():
        if array.dtype == ml_dtypes.bfloat16:
            out[key] = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out[key] = torch.from_numpy(array.copy())
    return out
