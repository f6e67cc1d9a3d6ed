"""Both dispatchers, ``qsa_torch.sparse_gqa_attention`` and ``qsa_jax.sparse_gqa_attention``,
raise the same exception class with the same message for every bad input of the contract
(CONTRACT.md; the checks of :mod:`qsa_common.contract`), and for bad values of the
arguments both share (``deterministic``)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import torch
from test_validation import CASES, good

import qsa_jax
import qsa_torch
from qsa_common import errors

# Bad inputs beyond test_validation's CASES (arguments, softmax_scale, extra keyword arguments)
EXTRA = {
    "query not an array": (dict(good(), query=[[1.0]]), None, {}),
    "routes not an array": (dict(good(), selected_token_ids=[[0]]), None, {}),
    "value dtype differs": (dict(good(), value=good()["value"].astype(np.float16)), None, {}),
    "float64 key with float32 query": (dict(good(), key=good()["key"].astype(np.float64)), None, {}),
    "deterministic not a bool": (good(), None, {"deterministic": 1}),
    "deterministic a string": (good(), None, {"deterministic": "yes"}),
    "scale a complex": (good(), 1j, {}),
    "scale -0.0": (good(), -0.0, {}),
    "scale -inf": (good(), -math.inf, {}),
}
ALL = {name: (args, scale, {}) for name, (args, scale, _, _) in CASES.items()} | EXTRA


def _to_torch(x):
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def _raised(fn):
    with pytest.raises(errors.QSAError) as info:
        fn()
    return info.value


@pytest.mark.parametrize("case", sorted(ALL))
def test_same_class_and_message_in_both_frameworks(case):
    args, scale, kwargs = ALL[case]
    torch_err = _raised(lambda: qsa_torch.sparse_gqa_attention(
        **{k: _to_torch(v) for k, v in args.items()}, softmax_scale=scale, **kwargs))
    jax_err = _raised(lambda: qsa_jax.sparse_gqa_attention(**args, softmax_scale=scale, **kwargs))
    assert type(torch_err) is type(jax_err), (torch_err, jax_err)
    assert str(torch_err) == str(jax_err)
    assert isinstance(torch_err, (errors.InvalidInput, errors.InvalidDtype))
    if case in CASES:  # and the class the contract names
        assert isinstance(torch_err, CASES[case][2]) and CASES[case][3] in str(torch_err)


def test_mismatched_devices_are_invalid_input_in_both():
    """Devices are spelled by each framework, so the messages share their form only."""
    args = {k: torch.from_numpy(v) for k, v in good().items()}
    args["key"] = args["key"].to("meta")
    torch_err = _raised(lambda: qsa_torch.sparse_gqa_attention(**args))
    devices = jax.devices("cpu")
    assert len(devices) >= 2, "conftest asks XLA for several host devices"
    jargs = {k: jax.device_put(v, devices[0]) for k, v in good().items()}
    jargs["key"] = jax.device_put(jargs["key"], devices[1])
    jax_err = _raised(lambda: qsa_jax.sparse_gqa_attention(**jargs))
    assert type(torch_err) is type(jax_err) is errors.InvalidInput
    for err in (torch_err, jax_err):
        assert str(err).startswith("key is on ") and " but query is on " in str(err)


def test_named_backend_declines_alike():
    """A head dim past the kernels' limit: the torch Triton backend and the JAX Pallas
    implementation decline with the same class (UnsupportedShape, a ValueError); under
    automatic choice both fall back to their reference and answer."""
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 4, 2, 264)).astype(np.float32)
    routes = np.zeros((1, 4, 2), np.int64)
    jax_err = _raised(lambda: qsa_jax.sparse_gqa_attention(q, q, q, routes, implementation="pallas"))
    pytest.importorskip("triton")
    t = torch.from_numpy(q)
    torch_err = _raised(lambda: qsa_torch.sparse_gqa_attention(t, t, t, torch.from_numpy(routes), backend="triton"))
    if isinstance(torch_err, errors.UnsupportedDevice):
        pytest.skip("the Triton kernels are compiled here and refuse CPU tensors first")
    assert type(torch_err) is type(jax_err) is errors.UnsupportedShape
    assert "head dim <= 256, got 264" in str(torch_err) and "head dim <= 256, got 264" in str(jax_err)
