"""Every error path of input validation, in both frameworks, through the references."""

from __future__ import annotations

import math

import numpy as np
import pytest

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
    "query rank": (change(query=lambda x: x[0]), None, ValueError, "query"),
    "key rank": (change(key=lambda x: x[..., 0]), None, ValueError, "key"),
    "routes rank": (change(selected_token_ids=lambda x: x[..., 0]), None, ValueError, "selected_token_ids"),
    "heads not a multiple": (change(query=lambda x: x[:, :, :3]), None, ValueError, "multiple"),
    "value shape": (change(value=lambda x: x[:, :-1]), None, ValueError, "value"),
    "key batch": (change(key=lambda x: x[:1], value=lambda x: x[:1]), None, ValueError, "batch"),
    "head dim": (change(key=lambda x: x[..., :4], value=lambda x: x[..., :4]), None, ValueError, "head dim"),
    "routes batch": (change(selected_token_ids=lambda x: x[:1]), None, ValueError, "selected_token_ids"),
    "routes rows": (change(selected_token_ids=lambda x: x[:, :-1]), None, ValueError, "selected_token_ids"),
    "empty dim": (change(selected_token_ids=lambda x: x[..., :0]), None, ValueError, "empty"),
    "float routes": (change(selected_token_ids=lambda x: x.astype(np.float32)), None, TypeError, "selected_token_ids"),
    "unsigned routes": (change(selected_token_ids=lambda x: np.abs(x).astype(np.uint32)), None, TypeError, "selected_token_ids"),
    "bool routes": (change(selected_token_ids=lambda x: x > 0), None, TypeError, "selected_token_ids"),
    "int query": (change(query=lambda x: x.astype(np.int32)), None, TypeError, "query"),
    "mixed dtypes": (change(key=lambda x: x.astype(np.float16)), None, TypeError, "key"),
    "zero scale": (good(), 0.0, ValueError, "softmax_scale"),
    "negative scale": (good(), -1.0, ValueError, "softmax_scale"),
    "nan scale": (good(), math.nan, ValueError, "softmax_scale"),
    "inf scale": (good(), math.inf, ValueError, "softmax_scale"),
    "string scale": (good(), "0.5", TypeError, "softmax_scale"),
    "bool scale": (good(), True, TypeError, "softmax_scale"),
    "scale past float32": (good(), 1e39, ValueError, "softmax_scale"),  # inf in fp32 scores
    "scale times log2(e) past float32": (good(), 3e38, ValueError, "softmax_scale"),
    "scale below float32": (good(), 1e-46, ValueError, "softmax_scale"),  # rounds to 0 in fp32
    "scale past float64": (good(), 10**400, ValueError, "softmax_scale"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_validation(case):
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    args, scale, exc, text = CASES[case]
    if case == "unsigned routes":
        args = dict(args, selected_token_ids=np.abs(args["selected_token_ids"]).astype(np.uint8))
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in args.items()}
    with pytest.raises(exc, match=text):
        reference_sparse_gqa_attention(**tensors, softmax_scale=scale)


@pytest.mark.parametrize("case", sorted(CASES))
def test_jax_validation(case):
    from qsa_jax import reference

    args, scale, exc, text = CASES[case]
    with pytest.raises(exc, match=text):
        reference(**args, softmax_scale=scale)


def test_torch_mismatched_devices():
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    args = {k: torch.from_numpy(v) for k, v in good().items()}
    args["key"] = args["key"].to("meta")
    with pytest.raises(ValueError, match="key is on meta"):
        reference_sparse_gqa_attention(**args)


def test_jax_mismatched_devices():
    import jax

    from qsa_jax import reference

    devices = jax.devices("cpu")
    assert len(devices) >= 2, "conftest asks XLA for several host devices"
    args = {k: jax.device_put(v, devices[0]) for k, v in good().items()}
    args["value"] = jax.device_put(args["value"], devices[1])
    with pytest.raises(ValueError, match="value is on"):
        reference(**args)


def test_huge_int64_routes_are_padding_in_both_frameworks():
    """2**32 + 3 must not wrap into the valid ID 3 (JAX without x64 truncates int64)."""
    import jax.numpy as jnp
    import torch

    from qsa_jax import reference
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


@pytest.mark.parametrize("chunk_rows,exc", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_reference_chunk_rows_is_checked(chunk_rows, exc):
    import torch

    from qsa_jax import reference
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

    with pytest.raises(ValueError, match="selected_token_ids"):
        membership_table(torch.zeros(4, 3, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="kv_length"):
        membership_table(torch.zeros(1, 4, 3, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="selected_token_ids"):
        membership_table(torch.zeros(1, 4, 3), 8)
