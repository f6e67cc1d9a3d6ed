"""The one private torch API ``qsa_torch`` uses, in one place.

``torch._C._SetExcludeDispatchKeyGuard(key: DispatchKey, enabled: bool)`` is a context
manager that adds (``True``) or removes (``False``) ``key`` from the thread's excluded
dispatch keys. A custom op's implementation runs with the Autograd keys excluded, so
tensors made there record no graph; :func:`autograd_enabled` removes them again, so
the backward op of ``qsa::sparse_gqa_attention`` can run a backend's forward under
autograd and ask torch for its gradients. No public API does this inside an op.

Supported torch versions: :data:`TORCH_RANGE`, ``2.11 <= torch < 2.14`` (checked with
torch 2.11 on the GPU host and 2.13 on CPU). ``tests/test_private_api.py`` calls the
guard with the arguments used here and fails when its signature or effect changes, or
when the installed torch falls outside the range (widen it only after that test passes
on the new version).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["AUTOGRAD_KEYS", "TORCH_RANGE", "autograd_enabled", "torch_version"]

# [lowest, first unsupported) (major, minor) of torch
TORCH_RANGE = ((2, 11), (2, 14))


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _keys() -> tuple:
    keys = torch._C.DispatchKey
    return (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor)


# the dispatch keys whose exclusion stops autograd inside an op implementation
AUTOGRAD_KEYS = _keys()


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Turn autograd back on inside a custom op's implementation (module docstring)."""
    with contextlib.ExitStack() as stack:
        for key in AUTOGRAD_KEYS:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        yield
