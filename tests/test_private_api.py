"""The private torch API of qsa_torch._private_api: its signature and effect, and the
torch versions it is declared for. A change in torch fails here before it fails a user."""

from __future__ import annotations

import pytest
import torch

from qsa_torch import _private_api


def test_installed_torch_is_in_the_declared_range():
    low, high = _private_api.TORCH_RANGE
    assert low <= _private_api.torch_version() < high, (
        f"torch {torch.__version__} is outside {_private_api.TORCH_RANGE}: check the guard (this module's "
        "other tests) on it, then widen TORCH_RANGE")


def test_the_guard_takes_a_key_and_a_bool_and_removes_the_exclusion():
    """``_SetExcludeDispatchKeyGuard(key, False)`` inside an excluding guard removes ``key``
    from the thread's excluded set, and restores it on exit; ``(key, True)`` adds it."""
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
    for key in _private_api.AUTOGRAD_KEYS:
        assert isinstance(key, torch._C.DispatchKey)
        before = excluded(key)
        with torch._C._SetExcludeDispatchKeyGuard(key, True):
            assert excluded(key)
            with torch._C._SetExcludeDispatchKeyGuard(key, False):
                assert not excluded(key)
            assert excluded(key)
        assert excluded(key) == before
    with pytest.raises(TypeError):  # the signature: a key and a bool, nothing else
        torch._C._SetExcludeDispatchKeyGuard(_private_api.AUTOGRAD_KEYS[0])


def test_autograd_enabled_records_a_graph_inside_a_custom_op():
    """What qsa_torch needs the guard for: inside a custom op's implementation (autograd
    keys excluded, grad mode off), a graph is recorded under ``autograd_enabled``."""
    seen = []

    @torch.library.custom_op("qsa_test::private_api_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        leaf = x.detach().requires_grad_()
        seen.append((leaf * 2).requires_grad)
        with _private_api.autograd_enabled():
            y = (leaf * 3).sum()
            seen.append(y.requires_grad)
            (grad,) = torch.autograd.grad(y, leaf)
        return grad

    out = probe(torch.ones(3, requires_grad=True))
    assert seen == [False, True]
    assert torch.equal(out, torch.full((3,), 3.0))
