"""The fallback rules, the same in both dispatchers: automatic choice moves on after a
BackendDeclined (a plain ImportError counts as MissingRuntime), never after anything else
(out-of-memory included); with nothing left, NoBackendAvailable carries every reason."""

from __future__ import annotations

import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qsa_common import errors
from qsa_jax import attention
from qsa_torch import api

RAISED = {
    "declines": errors.UnsupportedShape("declined for the test"),
    "import": ImportError("a runtime went missing for the test"),
    "oom": MemoryError("RESOURCE_EXHAUSTED: out of memory for the test"),
    "other": RuntimeError("a failure for the test"),
}
MOVES_ON = {"declines": True, "import": True, "oom": False, "other": False}


def _raising(kind):
    def fn(*args, **kwargs):
        raise RAISED[kind]
    return fn


def _inputs():
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    routes = rng.integers(-1, 6, (1, 6, 3))
    return q, routes


@pytest.mark.parametrize("kind", sorted(RAISED))
def test_jax(monkeypatch, kind):
    """Implementations ("pallas" stands in, then the reference) on CPU."""
    fake = types.ModuleType("qsa_test_fake_pallas")
    fake.supports = lambda *a, **k: None
    fake.pallas_sparse_gqa_attention = fake.checked_attention = _raising(kind)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(attention.IMPLEMENTATIONS, "pallas", fake.__name__)
    monkeypatch.setitem(attention.IMPLEMENTATIONS, "triton", fake.__name__)
    q, routes = _inputs()
    x = jnp.asarray(q)
    if MOVES_ON[kind]:
        out = attention.sparse_gqa_attention(x, x, x, routes, implementation=("pallas", "xla"))
        assert out.shape == q.shape
        with pytest.raises(errors.NoBackendAvailable) as err:
            attention.sparse_gqa_attention(x, x, x, routes, implementation=("pallas", "triton"))
        assert list(err.value.reasons) == ["pallas", "triton"]
        assert all(isinstance(e, errors.BackendDeclined) for e in err.value.reasons.values())
        with pytest.raises(errors.BackendDeclined):  # one name: its own decline
            attention.sparse_gqa_attention(x, x, x, routes, implementation="pallas")
    else:
        with pytest.raises(type(RAISED[kind])):
            attention.sparse_gqa_attention(x, x, x, routes, implementation=("pallas", "xla"))


@pytest.mark.parametrize("kind", sorted(RAISED))
def test_torch(monkeypatch, kind):
    """Backends ("stand-in", then the reference) under "auto" on CPU."""
    fake = types.SimpleNamespace(supports=lambda *a, **k: None, run=_raising(kind))
    monkeypatch.setitem(api.BACKENDS, "stand-in", api._Backend("stand-in", "run"))
    monkeypatch.setitem(api._MODULES, "stand-in", fake)
    monkeypatch.setitem(api.VERIFIED, "stand-in", frozenset({"cpu"}))
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("stand-in",))
    monkeypatch.setattr(api, "_BROKEN", {})
    q, routes = _inputs()
    x, r = torch.from_numpy(q), torch.from_numpy(routes)
    if MOVES_ON[kind]:
        assert api.sparse_gqa_attention(x, x, x, r).shape == q.shape
        assert ("stand-in" in api._BROKEN) == (kind == "import")  # a missing runtime is not retried
        monkeypatch.setitem(api._BROKEN, "reference", errors.MissingRuntime("gone for the test"))
        api._BROKEN.pop("stand-in", None)
        with pytest.raises(errors.NoBackendAvailable) as err:
            api.sparse_gqa_attention(x, x, x, r)
        assert sorted(err.value.reasons) == ["reference", "stand-in"]
        with pytest.raises(errors.BackendDeclined):  # named explicitly: its own decline
            api.sparse_gqa_attention(x, x, x, r, backend="stand-in")
    else:
        with pytest.raises(type(RAISED[kind])):
            api.sparse_gqa_attention(x, x, x, r)


def test_aliases_mean_the_same_backend():
    """torch ``backend=None`` is "auto"; JAX ``"reference"`` is "xla" and ``"auto"`` is None."""
    q, routes = _inputs()
    x, r = torch.from_numpy(q), torch.from_numpy(routes)
    assert torch.equal(api.sparse_gqa_attention(x, x, x, r, backend=None), api.sparse_gqa_attention(x, x, x, r))
    j = jnp.asarray(q)
    want = np.asarray(attention.sparse_gqa_attention(j, j, j, routes, implementation="xla"))
    for name in ("reference", "auto", None, ["reference", "xla"]):
        got = attention.sparse_gqa_attention(j, j, j, routes, implementation=name)
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(errors.InvalidInput, match="'auto' cannot be part of a sequence"):
        attention.sparse_gqa_attention(j, j, j, routes, implementation=["auto", "xla"])
