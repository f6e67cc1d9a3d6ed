"""Flax QSA layer: forward against a float64 numpy model, gradients against dense
attention, indexer wiring, nnx.jit + optax training (the toy example)."""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

from qsa_common.generators import random_routes
from qsa_common.layouts import padded_batch
from qsa_common.oracle import oracle_forward_backward, relative_error

M, HQ, HKV, D, TOP_K = 16, 4, 2, 8, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def numpy_forward(x, params, routes, positions, theta, eps=1e-6, scale=None):
    """The layer in float64 numpy, attention by the float64 oracle."""
    p = {n: np.asarray(w, np.float64) for n, w in params.items()}
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    q = (x @ p["q"]).reshape(b, s, HQ, D)
    k = (x @ p["k"]).reshape(b, s, HKV, D)
    v = (x @ p["v"]).reshape(b, s, HKV, D)

    def norm(t, w):
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + eps) * w

    def rope(t):
        freq = theta ** (-np.arange(D // 2) * 2.0 / D)
        ang = np.asarray(positions, np.float64)[..., None, None] * freq
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        return np.concatenate([t1 * np.cos(ang) - t2 * np.sin(ang), t2 * np.cos(ang) + t1 * np.sin(ang)], -1)

    if "q_norm" in p:
        q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    if theta is not None:
        q, k = rope(q), rope(k)
    out = oracle_forward_backward(q, k, v, routes, D ** -0.5 if scale is None else scale)[0]
    return out.reshape(b, s, HQ * D) @ p["o"]


def dense_attention(q, k, v, routes, scale):
    """Masked dense softmax attention in jnp (an independent path for gradients)."""
    import jax.numpy as jnp

    from qsa_jax.routes import membership_table

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = membership_table(routes, k.shape[1])[:, None]  # [B,1,Sq,Skv]
    group = q.shape[2] // k.shape[2]
    kh, vh = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kh) * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    w = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(w, -1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", w / jnp.where(den > 0, den, 1.0), vh)


def make_layer(rng, **kw):
    import jax.numpy as jnp
    from flax import nnx

    from qsa_jax.layers import QSAAttention

    layer = QSAAttention(M, HQ, HKV, D, top_k=TOP_K, index_heads=2, index_dim=4,
                         rngs=nnx.Rngs(int(rng.integers(2**31))), **kw)
    if layer.q_norm is not None:  # make the norm weights matter
        layer.q_norm[...] = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)
        layer.k_norm[...] = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)
    return layer


def layout_args(rng, layout, batch, seq):
    """(call kwargs, document start per row, padding mask)."""
    import jax.numpy as jnp

    if layout == "padded":
        lengths = np.array([seq] + [int(rng.integers(1, seq)) for _ in range(batch - 1)])
        pad = np.arange(seq)[None] >= lengths[:, None]
        return dict(lengths=jnp.asarray(lengths)), np.zeros((batch, seq), int), pad
    seg = np.zeros((batch, seq), np.int32)
    starts = np.zeros((batch, seq), int)
    for b in range(batch):
        cut = int(rng.integers(3, seq - 3))
        seg[b, cut:] = 1
        starts[b, cut:] = cut
    return dict(segment_ids=jnp.asarray(seg)), starts, np.zeros((batch, seq), bool)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("qk_norm,theta", [(True, 10000.0), (False, None)])
def test_layer_forward_matches_float64(layout, qk_norm, theta):
    import jax.numpy as jnp
    from flax import nnx

    from qsa_jax.indexer import qsa_indexer_routes

    rng = np.random.default_rng()
    batch, seq = 2, 26
    layer = make_layer(rng, qk_norm=qk_norm, rope_theta=theta)
    x = rng.standard_normal((batch, seq, M)).astype(np.float32)
    kwargs, starts, pad = layout_args(rng, layout, batch, seq)
    routes = np.asarray(nnx.jit(lambda m, a: m.routes(a, **kwargs))(layer, jnp.asarray(x)))
    qi, ki = layer.index_projections(jnp.asarray(x))
    assert np.array_equal(routes, np.asarray(qsa_indexer_routes(qi, ki, TOP_K, **kwargs)))
    assert routes.shape == (batch, seq, 4 * TOP_K + 4) and (routes[pad] == -1).all()
    out = np.asarray(nnx.jit(lambda m, a: m(a, **kwargs))(layer, jnp.asarray(x)))
    positions = np.arange(seq)[None] - starts
    want = numpy_forward(x, layer.projection_params(), routes, positions, theta)
    assert relative_error(out, want) < 1e-5
    assert (out[pad] == 0).all(), "padding rows give exact zeros"


def test_layer_gradients_match_dense_attention_and_indexer_gets_none():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qsa_jax.layers import qsa_attention

    rng = np.random.default_rng()
    layer = make_layer(rng)
    batch, seq = 2, 24
    x = jnp.asarray(rng.standard_normal((batch, seq, M)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((batch, seq, M)), jnp.float32)
    kwargs, starts, _ = layout_args(rng, "packed", batch, seq)
    positions = jnp.arange(seq)[None] - jnp.asarray(starts)

    grads, dx = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a, **kwargs) * g), argnums=(0, 1)))(layer, x)
    routes = nnx.jit(lambda m, a: m.routes(a, **kwargs))(layer, x)

    def dense_loss(params, a):
        out = qsa_attention(a, params, routes, num_heads=HQ, num_kv_heads=HKV, positions=positions,
                            rope_theta=10000.0, attention_fn=dense_attention)
        return jnp.sum(out * g)

    want_p, want_x = jax.jit(jax.grad(dense_loss, argnums=(0, 1)))(layer.projection_params(), x)
    assert relative_error(np.asarray(dx), np.asarray(want_x)) < 1e-5
    got = {"q": grads.q_proj.kernel, "k": grads.k_proj.kernel, "v": grads.v_proj.kernel,
           "o": grads.o_proj.kernel, "q_norm": grads.q_norm, "k_norm": grads.k_norm}
    for name, want in want_p.items():
        err = relative_error(np.asarray(got[name][...]), np.asarray(want))
        assert err < 1e-5, f"d{name}: {err:.2e}"
        assert np.abs(np.asarray(want)).max() > 0
    for var in (grads.index_q.kernel, grads.index_k.kernel):
        assert (np.asarray(var[...]) == 0).all(), "routes are discrete: no gradient to the indexer"


def test_functional_form_with_own_routes_under_jit():
    import jax
    import jax.numpy as jnp

    from qsa_jax.layers import qsa_attention

    rng = np.random.default_rng()
    batch, seq = 2, 20
    problem = padded_batch([seq, 13], seq, lambda n: random_routes(n, width=7, rng=rng))
    params = {
        "q": rng.standard_normal((M, HQ * D)) / 4, "k": rng.standard_normal((M, HKV * D)) / 4,
        "v": rng.standard_normal((M, HKV * D)) / 4, "o": rng.standard_normal((HQ * D, M)) / 4,
    }
    params = {n: jnp.asarray(w, jnp.float32) for n, w in params.items()}
    x = rng.standard_normal((batch, seq, M)).astype(np.float32)
    fn = jax.jit(lambda p, a, r: qsa_attention(a, p, r, num_heads=HQ, num_kv_heads=HKV,
                                                 softmax_scale=0.3, implementation="xla"))
    out = np.asarray(fn(params, jnp.asarray(x), jnp.asarray(problem.routes.astype(np.int32))))
    want = numpy_forward(x, params, problem.routes, None, None, scale=0.3)
    assert relative_error(out, want) < 1e-5


def test_functional_form_keeps_huge_int64_routes_as_padding():
    """numpy int64 IDs past int32 are padding: JAX must not wrap 2**32 + 3 into ID 3."""
    import jax.numpy as jnp

    from qsa_jax.layers import qsa_attention

    rng = np.random.default_rng()
    seq = 12
    problem = padded_batch([seq], seq, lambda n: random_routes(n, width=5, rng=rng))
    params = {
        "q": rng.standard_normal((M, HQ * D)) / 4, "k": rng.standard_normal((M, HKV * D)) / 4,
        "v": rng.standard_normal((M, HKV * D)) / 4, "o": rng.standard_normal((HQ * D, M)) / 4,
    }
    params = {n: jnp.asarray(w, jnp.float32) for n, w in params.items()}
    x = rng.standard_normal((1, seq, M)).astype(np.float32)
    huge = problem.routes.copy()
    huge[..., -1] = 2**32 + 3  # would wrap to the valid ID 3
    out = np.asarray(qsa_attention(jnp.asarray(x), params, huge, num_heads=HQ, num_kv_heads=HKV,
                                   implementation="xla"))
    want = numpy_forward(x, params, problem.routes[..., :-1], None, None, scale=D**-0.5)
    assert relative_error(out, want) < 1e-5


def test_implementation_is_passed_through_and_bad_params_are_named():
    import jax.numpy as jnp

    from qsa_jax.layers import qsa_attention

    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((1, 8, M)), jnp.float32)
    with pytest.raises(ValueError, match="unknown implementation"):
        make_layer(rng, implementation="no-such-kernel")(x)
    layer = make_layer(rng)
    params = layer.projection_params()
    routes = layer.routes(x)
    with pytest.raises(ValueError, match="params is missing"):
        qsa_attention(x, {"q": params["q"]}, routes, num_heads=HQ, num_kv_heads=HKV)
    with pytest.raises(ValueError, match="params\\['o'\\]"):
        qsa_attention(x, dict(params, o=params["o"][:-1]), routes, num_heads=HQ, num_kv_heads=HKV)
    with pytest.raises(ValueError, match="num_kv_heads"):
        qsa_attention(x, params, routes, num_heads=HQ, num_kv_heads=3)


def test_toy_training_loss_goes_down():
    spec = importlib.util.spec_from_file_location("train_toy_jax", os.path.join(ROOT, "examples", "train_toy_jax.py"))
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    losses = toy.train(steps=30, seed=int(np.random.default_rng().integers(2**31)))
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    assert np.all(np.isfinite(losses))
    assert last < first - 0.3, losses
    # below the unigram entropy: the model copies through its routed attention
    assert last < math.log(toy.VOCAB), losses
