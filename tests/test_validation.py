"""Every error path of input validation, in both frameworks, through the references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qsa_common.errors import InvalidDtype, InvalidInput

B, S, HQ, HKV, D, K = 2, 8, 4, 2, 8, 5


def good():
    rng = np.random.default_rng()
    return dict(
        query=rng.standard_normal((B, S, HQ, D)).astype(np.float32),
        key=rng.standard_normal((B, S, HKV, D)).astype(np.float32),
        value=rng.standard_normal((B, S, HKV, D)).astype(np.float32),
        selected_token_ids=rng.integers(-1, S, (B, S, K)),
    )


def change(**kw):
    args = good()
    for name, fn in kw.items():
        args[name] = fn(args[name])
    return args


# (arguments, softmax_scale, exception, text the message must contain)
CASES = {
    "query rank": (change(query=lambda x: x[0]), None, InvalidInput, "query"),
    "key rank": (change(key=lambda x: x[..., 0]), None, InvalidInput, "key"),
    "routes rank": (change(selected_token_ids=lambda x: x[..., 0]), None, InvalidInput, "selected_token_ids"),
    "heads not a multiple": (change(query=lambda x: x[:, :, :3]), None, InvalidInput, "multiple"),
    "value shape": (change(value=lambda x: x[:, :-1]), None, InvalidInput, "value"),
    "key batch": (change(key=lambda x: x[:1], value=lambda x: x[:1]), None, InvalidInput, "batch"),
    "head dim": (change(key=lambda x: x[..., :4], value=lambda x: x[..., :4]), None, InvalidInput, "head dim"),
    "routes batch": (change(selected_token_ids=lambda x: x[:1]), None, InvalidInput, "selected_token_ids"),
    "routes rows": (change(selected_token_ids=lambda x: x[:, :-1]), None, InvalidInput, "selected_token_ids"),
    "empty dim": (change(selected_token_ids=lambda x: x[..., :0]), None, InvalidInput, "empty"),
    "float routes": (change(selected_token_ids=lambda x: x.astype(np.float32)), None, InvalidDtype,
                     "selected_token_ids"),
    "unsigned routes": (change(selected_token_ids=lambda x: np.abs(x).astype(np.uint8)), None, InvalidDtype,
                        "selected_token_ids"),
    "bool routes": (change(selected_token_ids=lambda x: x > 0), None, InvalidDtype, "selected_token_ids"),
    "int query": (change(query=lambda x: x.astype(np.int32)), None, InvalidDtype, "query"),
    "mixed dtypes": (change(key=lambda x: x.astype(np.float16)), None, InvalidDtype, "key"),
    "zero scale": (good(), 0.0, InvalidInput, "softmax_scale"),
    "negative scale": (good(), -1.0, InvalidInput, "softmax_scale"),
    "nan scale": (good(), math.nan, InvalidInput, "softmax_scale"),
    "inf scale": (good(), math.inf, InvalidInput, "softmax_scale"),
    "string scale": (good(), "0.5", InvalidDtype, "softmax_scale"),
    "bool scale": (good(), True, InvalidDtype, "softmax_scale"),
    "scale past float32": (good(), 1e39, InvalidInput, "softmax_scale"),  # inf in fp32 scores
    "scale times log2(e) past float32": (good(), 3e38, InvalidInput, "softmax_scale"),
    "scale below float32": (good(), 1e-46, InvalidInput, "softmax_scale"),  # rounds to 0 in fp32
    "scale past float64": (good(), 10**400, InvalidInput, "softmax_scale"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_validation(case):
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    args, scale, exc, text = CASES[case]
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in args.items()}
    with pytest.raises(exc, match=text):
        reference_sparse_gqa_attention(**tensors, softmax_scale=scale)


@pytest.mark.parametrize("case", sorted(CASES))
def test_jax_validation(case):
    from qsa_jax import reference_sparse_gqa_attention as reference

    args, scale, exc, text = CASES[case]
    with pytest.raises(exc, match=text):
        reference(**args, softmax_scale=scale)


def test_torch_mismatched_devices():
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    args = {k: torch.from_numpy(v) for k, v in good().items()}
    args["key"] = args["key"].to("meta")
    with pytest.raises(InvalidInput, match="key is on meta"):
        reference_sparse_gqa_attention(**args)


def test_jax_mismatched_devices():
    import jax

    from qsa_jax import reference_sparse_gqa_attention as reference

    devices = jax.devices("cpu")
    assert len(devices) >= 2, "conftest asks XLA for several host devices"
    args = {k: jax.device_put(v, devices[0]) for k, v in good().items()}
    args["value"] = jax.device_put(args["value"], devices[1])
    with pytest.raises(InvalidInput, match="value is on"):
        reference(**args)


def test_huge_int64_routes_are_padding_in_both_frameworks():
    """2**32 + 3 must not wrap into the valid ID 3 (JAX without x64 truncates int64)."""
    import jax.numpy as jnp
    import torch

    from qsa_jax import reference_sparse_gqa_attention as reference
    from qsa_torch import reference_sparse_gqa_attention

    args = good()
    routes = np.full((B, S, K), 2**32 + 3, dtype=np.int64)
    routes[:, :, 0] = 1
    args["selected_token_ids"] = routes
    j = np.asarray(reference(**args))
    t = reference_sparse_gqa_attention(**{k: torch.from_numpy(v) for k, v in args.items()}).numpy()
    v1 = args["value"][:, 1]  # only route 1 is valid: the output is value row 1
    want = np.repeat(v1, HQ // HKV, axis=1)[:, None].repeat(S, axis=1)
    np.testing.assert_allclose(j, want, rtol=1e-6)
    np.testing.assert_allclose(t, want, rtol=1e-6)
    assert jnp.asarray(j).dtype == jnp.float32


@pytest.mark.parametrize("chunk_rows,exc", [(0, InvalidInput), (-1, InvalidInput), (2.5, InvalidDtype),
                                           (True, InvalidDtype)])
def test_reference_chunk_rows_is_checked(chunk_rows, exc):
    import torch

    from qsa_jax import reference_sparse_gqa_attention as reference
    from qsa_torch import reference_sparse_gqa_attention

    args = good()
    with pytest.raises(exc, match="chunk_rows"):
        reference(**args, chunk_rows=chunk_rows)
    with pytest.raises(exc, match="chunk_rows"):
        reference_sparse_gqa_attention(**{k: torch.from_numpy(v) for k, v in args.items()},
                                       chunk_rows=chunk_rows)


def test_membership_table_checks_its_arguments():
    import torch

    from qsa_torch.routes import membership_table

    with pytest.raises(InvalidInput, match="selected_token_ids"):
        membership_table(torch.zeros(4, 3, dtype=torch.int64), 8)
    with pytest.raises(InvalidInput, match="kv_length"):
        membership_table(torch.zeros(1, 4, 3, dtype=torch.int64), 0)
    with pytest.raises(InvalidDtype, match="selected_token_ids"):
        membership_table(torch.zeros(1, 4, 3), 8)


def _both(scale):
    """The torch and JAX references on one good input with ``scale``."""
    import torch

    from qsa_jax import reference_sparse_gqa_attention as jax_reference
    from qsa_torch import reference_sparse_gqa_attention

    args = good()
    jax_out = np.asarray(jax_reference(**args, softmax_scale=scale))
    torch_out = reference_sparse_gqa_attention(**{k: torch.from_numpy(v) for k, v in args.items()},
                                               softmax_scale=scale).numpy()
    return jax_out, torch_out


def test_softmax_scale_limits_accept_just_inside_and_refuse_just_outside():
    """The contract's scale range [SCALE_MIN, SCALE_MAX], at both ends, in both frameworks:
    the limits themselves and the next float64 inward are accepted, the next float64
    outward refused. A limit moved (1.0, 2**-126, ...) fails here."""
    from qsa_common import contract

    assert contract.SCALE_MIN == 2.0**-149 and np.float32(contract.SCALE_MIN) > 0
    assert np.isfinite(np.float32(contract.SCALE_MAX) * np.float32(np.log2(np.e)))
    inside = (contract.SCALE_MIN, np.nextafter(contract.SCALE_MIN, 1.0), contract.SCALE_MAX,
              np.nextafter(contract.SCALE_MAX, 0.0), 2.0**-126, 1.0, 2.0)
    for scale in inside:
        assert contract.resolve_scale(float(scale), 8) == float(scale)
        for out in _both(float(scale)):
            assert out.shape == (B, S, HQ, D)
    outside = (np.nextafter(contract.SCALE_MIN, 0.0), np.nextafter(contract.SCALE_MAX, np.inf))
    for scale in outside:
        for fn in (lambda s: contract.resolve_scale(s, 8), _both):
            with pytest.raises(InvalidInput, match="softmax_scale"):
                fn(float(scale))
