"""The Flax port of Qwen3.8-Flash-Next's QSA layer (qsa_jax.qwen3_8_flash_next).

Without the upstream package: selection rules and layouts, the frozen indexer
under an optax step, routes kept under remat, errors. With it (the
``upstream`` extra, nemo-automodel 0.7.0): config defaults, bit-exact weight
round trips, rotary tables, and the layer itself against the PyTorch layer
(route agreement with only exact ties, forced-route outputs and gradients)
through ``parity.layers`` for padded, packed and context-parallel layouts.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from contract_base import round_to

from qsa_common.oracle import relative_error

SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, indexer_n_heads=2,
             indexer_head_dim=32, indexer_budget=32, indexer_compress_ratio=4)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, indexer_n_heads=2,
            indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4)


def upstream():
    return pytest.importorskip("nemo_automodel.components.models.qwen3_8_flash_next.layers",
                               reason="needs the upstream extra (nemo-automodel==0.7.0)")


def tiny_layer(seed, dtype="float32", **kw):
    import jax.numpy as jnp
    from flax import nnx

    from qsa_jax.qwen3_8_flash_next import QSAAttention, QSAConfig

    rng = np.random.default_rng(seed)
    layer = QSAAttention(QSAConfig(dtype=dtype, **dict(TINY, **kw)), rngs=nnx.Rngs(seed))
    for var in (layer.q_norm, layer.k_norm, layer.indexer.q_layernorm, layer.indexer.k_layernorm):
        var[...] = jnp.asarray(rng.uniform(-0.5, 0.5, var.shape), jnp.float32)
    return layer


# ------------------------------------------------------------------ no upstream needed
def test_importing_the_port_does_not_import_torch():
    code = "import sys, qsa_jax, qsa_jax.qwen3_8_flash_next; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_validates_and_reads_upstream_dicts():
    from qsa_jax.qwen3_8_flash_next import QSAConfig

    cfg = QSAConfig()
    assert (cfg.rotary_dim, cfg.top_k, cfg.route_width) == (64, 512, 2051)
    got = QSAConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16, "indexer_head_dim": 8, "vocab_size": 7, "torch_dtype": "float32",
                               "rope_parameters": {"rope_theta": 5e5, "partial_rotary_factor": 0.5}})
    assert (got.rope_theta, got.partial_rotary_factor, got.dtype, got.rotary_dim) == (5e5, 0.5, "float32", 8)
    # upstream's rotary embedding reads rope_parameters, over a top-level rope_theta
    both = QSAConfig.from_dict({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert both.rope_theta == 1e4
    with pytest.raises(ValueError, match="rope_type 'linear' is not implemented"):
        QSAConfig.from_dict({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}})
    for bad, text in ((dict(num_key_value_heads=5), "multiple"), (dict(indexer_kv_heads=2), "one key head"),
                      (dict(indexer_budget=30), "divisible"), (dict(indexer_compress_ratio=1), "ratio"),
                      (dict(partial_rotary_factor=0.9), "rotary width"), (dict(dtype="int8"), "dtype"),
                      (dict(head_dim=0), "positive"), (dict(rms_norm_eps=-1.0), "positive")):
        with pytest.raises(ValueError, match=text):
            QSAConfig(**bad)


def _check_routes(routes, scores, starts, layout_rows, cfg):
    """Format and true top-k of routes ``[B,S,W]`` given the port's own scores ``[B,S,N]``."""
    ratio, top_k = cfg.indexer_compress_ratio, cfg.top_k
    for b, t, start, real in layout_rows:
        row = routes[b, t]
        if not real:
            assert (row == -1).all(), (b, t)
            continue
        v = (t - start + 1) // ratio
        n = min(v, top_k)
        ids = row[row >= 0]
        assert (row[len(ids):] == -1).all(), "valid IDs first"
        blocks = ids[: ratio * n].reshape(n, ratio)
        assert (blocks == blocks[:, :1] + np.arange(ratio)).all() and ((blocks[:, 0] - start) % ratio == 0).all()
        assert (np.diff(blocks[:, 0]) > 0).all(), "blocks ascending"
        assert list(ids[ratio * n :]) == list(range(start + ratio * v, t + 1)), "the causal tail"
        if n:
            assert start <= blocks[:, 0].min() and blocks[:, 0].max() < start + ratio * v, "visible blocks only"
        visible = [j for j, s in enumerate(starts) if start <= s < start + ratio * v and (s - start) % ratio == 0]
        chosen = [int(np.searchsorted(starts, s)) for s in blocks[:, 0]]
        rest = sorted(set(visible) - set(chosen))
        if rest and chosen:
            assert min(scores[b, t, chosen]) >= max(scores[b, t, rest]) - 1e-6, (b, t)


def _selection_layout(layout: str, s: int):
    """``(mask, cu_seqlens, positions, rows)`` of a padded batch (lengths s, 41, 0) or a
    packed row (documents 2, 40, 3, s - 45); rows: ``(b, t, doc start, real)``."""
    if layout == "padded":
        lengths = np.array([s, 41, 0])
        mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int32)
        return mask, None, np.broadcast_to(np.arange(s), mask.shape), [(b, t, 0, t < lengths[b])
                                                                         for b in range(3) for t in range(s)]
    docs = [2, 40, 3, s - 45]
    cu = np.concatenate([[0], np.cumsum(docs)]).astype(np.int32)
    rows = [(0, t, int(cu[np.searchsorted(cu, t, side="right") - 1]), True) for t in range(s)]
    return None, cu, np.concatenate([np.arange(d) for d in docs])[None], rows


@pytest.mark.parametrize("layout,chunk", [("padded", None), ("packed", None), ("padded", 16), ("packed", 16)])
def test_selection_keeps_a_true_top_k_in_the_qsa_format(layout, chunk):
    import jax.numpy as jnp
    from flax import nnx

    from parity.layers import port_ranked_scores, port_scores, score_with_bound
    from qsa_jax.qwen3_8_flash_next import rotary_freqs

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    layer = tiny_layer(seed, qsa_indexer_query_chunk_size=chunk)
    cfg = layer.config
    s = 83
    mask, cu, pos, rows = _selection_layout(layout, s)
    x = jnp.asarray(rng.standard_normal((len(pos), s, cfg.hidden_size)), jnp.float32)
    freqs = rotary_freqs(cfg, pos)
    kw = dict(attention_mask=None if mask is None else jnp.asarray(mask),
              cu_seqlens=None if cu is None else jnp.asarray(cu))
    routes = np.asarray(nnx.jit(lambda m, a, f, k: m.indexer(a, freqs_cis=f, **k))(layer, x, freqs, kw))
    assert routes.dtype == np.int32 and routes.shape == (len(pos), s, cfg.route_width)
    scores, step = port_scores(layer, x, freqs, mask, cu)
    _check_routes(routes, scores, np.arange(scores.shape[-1]) * step, rows, cfg)
    # parity's port_ranked_scores: the selection rerun with the scores it ranks copied out
    # (per query chunk; the last one padded): the same routes, and they are the true top-k
    # of those scores, which equal the diagnostic re-scoring's to float32 rounding
    wanted = [(b, t) for b, t, _, real in rows if real]
    again, ranked, (queries, keys, block_step) = port_ranked_scores(layer, x, freqs, mask, cu, wanted)
    assert (again == routes).all() and set(ranked) == set(wanted) == set(queries), seed
    # the inputs it copied out are the ones it scored: every ranked score is a float32
    # evaluation of them (a few rows; all blocks)
    assert block_step == step and keys.shape == (len(pos), scores.shape[-1], cfg.indexer_head_dim)
    for b, t in [wanted[i] for i in rng.choice(len(wanted), 4, replace=False)]:
        for n in range(keys.shape[1]):
            exact, beta = score_with_bound(queries[(b, t)], keys[b, n])
            assert abs(ranked[(b, t)][n] - exact) <= beta, (seed, b, t, n)
    copied = np.full(scores.shape, np.nan, np.float32)
    for (b, t), values in ranked.items():
        copied[b, t] = values
    np.testing.assert_allclose(copied[~np.isnan(copied)], scores[~np.isnan(copied)], rtol=1e-5, atol=1e-6)
    _check_routes(routes, copied, np.arange(scores.shape[-1]) * step, [r for r in rows if r[3]], cfg)
    out = np.asarray(nnx.jit(lambda m, a, f, k: m(a, freqs_cis=f, **k))(layer, x, freqs, kw))
    padding = np.array([[not r for (bb, tt, _, r) in rows if bb == b] for b in range(len(pos))])
    assert (out[padding] == 0).all() and np.isfinite(out).all()


def test_frozen_indexer_is_untouched_by_an_adamw_step():
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from qsa_jax.qwen3_8_flash_next import FrozenParam, rotary_freqs

    rng = np.random.default_rng()
    layer = tiny_layer(int(rng.integers(2**31)))
    x = jnp.asarray(rng.standard_normal((1, 40, 64)), jnp.float32)
    freqs = rotary_freqs(layer.config, jnp.arange(40)[None])
    frozen = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(layer, FrozenParam))}
    trained = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert len(frozen) == 3 and all(k[0] == "indexer" for k in frozen)
    optimizer = nnx.Optimizer(layer, optax.adamw(1e-2, weight_decay=0.5), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, a):
        grads = nnx.grad(lambda m: jnp.sum(m(a, freqs_cis=freqs) ** 2))(model)
        opt.update(model, grads)
        return grads

    grads = step(layer, optimizer, x)
    assert not nnx.state(grads, FrozenParam), "the frozen weights get no gradient"
    for k, v in nnx.to_flat_state(nnx.state(layer, FrozenParam)):
        assert np.array_equal(np.asarray(v), frozen[k]), f"{k} changed"
    changed = [k for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))
               if not np.array_equal(np.asarray(v), trained[k])]
    assert len(changed) == len(trained), "every trainable weight moved"
    assert jax.tree.leaves(optimizer.opt_state), "an optimizer state exists for the trainable weights"


def _count(jaxpr, primitive):
    from jax.extend.core import jaxprs_in_params

    return sum((eqn.primitive.name == primitive) + sum(_count(sub, primitive) for sub in jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def test_remat_replays_the_routes_instead_of_reselecting():
    """The backward of a rematerialised layer contains the selection's top_k again unless the
    routes are saved: once with save_routes_policy (as without remat), twice without it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qsa_jax.qwen3_8_flash_next import rotary_freqs, save_routes_policy

    layer = tiny_layer(0)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 64)), jnp.float32)
    freqs = rotary_freqs(layer.config, jnp.arange(40)[None])
    graphdef, state = nnx.split(layer)

    def apply(state, a):
        return nnx.merge(graphdef, state)(a, freqs_cis=freqs)

    def top_ks(fn):
        jaxpr = jax.make_jaxpr(jax.grad(lambda s, a: jnp.sum(fn(s, a)), argnums=(0, 1)))(state, x).jaxpr
        return _count(jaxpr, "top_k")

    assert top_ks(apply) == 1
    assert top_ks(jax.checkpoint(apply)) == 2, "plain remat reruns the selection in the backward"
    assert top_ks(jax.checkpoint(apply, policy=save_routes_policy())) == 1
    assert top_ks(jax.checkpoint(apply, policy=save_routes_policy(jax.checkpoint_policies.dots_saveable))) == 1

    def nnx_apply(state, a):
        model = nnx.merge(graphdef, state)
        return nnx.remat(lambda m, b: m(b, freqs_cis=freqs), policy=save_routes_policy())(model, a)

    assert top_ks(nnx_apply) == 1
    # and remat changes no number
    plain = jax.jit(jax.grad(lambda s, a: jnp.sum(apply(s, a) ** 2), argnums=1))(state, x)
    saved = jax.jit(jax.grad(lambda s, a: jnp.sum(jax.checkpoint(apply, policy=save_routes_policy())(s, a) ** 2),
                             argnums=1))(state, x)
    assert relative_error(np.asarray(saved), np.asarray(plain)) < 1e-6


def test_bad_inputs_raise_clear_errors():
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    from qsa_jax.qwen3_8_flash_next import QSAAttention, context_parallel_qsa_attention, rotary_freqs

    layer = tiny_layer(0)
    x = jnp.ones((2, 12, 64), jnp.float32)
    freqs = rotary_freqs(layer.config, jnp.broadcast_to(jnp.arange(12), (2, 12)))
    call = lambda **kw: layer(kw.pop("x", x), freqs_cis=kw.pop("freqs_cis", freqs), **kw)  # noqa: E731
    cases = [
        (dict(x=jnp.ones((2, 12, 63))), ValueError, "x must be"),
        (dict(freqs_cis=freqs[..., :2]), ValueError, "freqs_cis must be"),
        (dict(attention_mask=jnp.full((2, 12), 2)), ValueError, "only 0 and 1"),
        (dict(attention_mask=jnp.asarray([[1] * 12, [1, 0] * 6])), ValueError, "right-padded"),
        (dict(attention_mask=jnp.ones((2, 11))), ValueError, "attention_mask must be"),
        (dict(cu_seqlens=jnp.asarray([0, 12])), ValueError, "batch of one row"),
        (dict(x=x[:1], freqs_cis=freqs[:1], cu_seqlens=jnp.asarray([0, 5, 5, 12])), ValueError, "increase strictly"),
        (dict(x=x[:1], freqs_cis=freqs[:1], cu_seqlens=jnp.asarray([0, 5, 11])), ValueError, "end at"),
        (dict(x=x[:1], freqs_cis=freqs[:1], cu_seqlens=jnp.asarray([0, 12]), attention_mask=jnp.ones((1, 12))),
         ValueError, "not both"),
        (dict(x=x.astype(jnp.int32)), TypeError, "floating"),
    ]
    for kwargs, exc, text in cases:
        with pytest.raises(exc, match=text):
            call(**kwargs)
    with pytest.raises(TypeError, match="QSAConfig"):
        QSAAttention({"hidden_size": 64}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown implementation"):
        QSAAttention(layer.config, rngs=nnx.Rngs(0), implementation="no-such-kernel")(
            x, freqs_cis=freqs, selected_token_ids=np.zeros((2, 12, 1), np.int32))
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    with pytest.raises(ValueError, match="not an axis"):
        context_parallel_qsa_attention(layer, x, freqs_cis=freqs, mesh=mesh, axis_name="sp")
    with pytest.raises(ValueError, match="divisible"):
        context_parallel_qsa_attention(layer, x[:, :10], freqs_cis=freqs[:, :10], mesh=Mesh(
            np.array(jax.devices()[:2]), ("cp",)))


# ------------------------------------------------------------------ against the upstream layer
def test_config_defaults_are_upstreams():
    upstream()
    from nemo_automodel.components.models.qwen3_8_flash_next.config import Qwen3_8_FlashNextTextConfig

    from qsa_jax.qwen3_8_flash_next import QSAConfig

    theirs = Qwen3_8_FlashNextTextConfig()
    ours = QSAConfig()
    for field in dataclasses.fields(QSAConfig):
        want = getattr(theirs, field.name)
        want = str(want).removeprefix("torch.") if field.name == "dtype" else want
        assert getattr(ours, field.name) == want, field.name
    assert QSAConfig.from_dict(theirs.to_dict()) == ours


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_round_trip_bit_exact(dtype):
    upstream()
    import torch
    from flax import nnx

    from parity.layers import LayerCase, upstream_layer
    from qsa_jax.qwen3_8_flash_next import QSAAttention, QSAConfig, load_torch_state_dict, to_torch_state_dict

    seed = int(np.random.default_rng().integers(2**31))
    torch_layer, _, _ = upstream_layer(LayerCase("padded", dtype, "noise", 8, (8,)), seed)
    theirs = torch_layer.state_dict()
    layer = QSAAttention(QSAConfig(dtype=dtype, **SMALL), rngs=nnx.Rngs(1))
    prefix = "model.language_model.layers.3.self_attn."
    whole_model = {prefix + k: v for k, v in theirs.items()}
    whole_model["model.language_model.layers.2.mlp.weight"] = torch.zeros(3)  # outside the prefix: ignored
    load_torch_state_dict(layer, whole_model, prefix=prefix)
    back = to_torch_state_dict(layer)
    assert back.keys() == theirs.keys()
    for k, v in theirs.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].view(torch.int16) if v.dtype == torch.bfloat16 else back[k],
                           v.view(torch.int16) if v.dtype == torch.bfloat16 else v), k
    arrays = to_torch_state_dict(layer, prefix, as_numpy=True)
    other = QSAAttention(QSAConfig(dtype=dtype, **SMALL), rngs=nnx.Rngs(2))
    load_torch_state_dict(other, arrays, prefix=prefix)  # numpy (ml_dtypes bf16) in, same bits out
    assert all(torch.equal(to_torch_state_dict(other)[k].float(), v.float()) for k, v in theirs.items())
    assert np.array_equal(np.asarray(layer.q_proj.kernel[...]).T.astype(np.float32),
                          theirs["q_proj.weight"].float().numpy()), "torch [out, in] is the kernel's transpose"

    broken = dict(theirs)
    del broken["k_norm.weight"]
    broken["q_proj.bias"] = torch.zeros(3)
    broken["o_proj.weight"] = theirs["o_proj.weight"][:, :-1]
    with pytest.raises(ValueError) as err:
        load_torch_state_dict(other, broken)
    message = str(err.value)
    assert "missing keys ['k_norm.weight']" in message and "q_proj.bias" in message and "o_proj.weight" in message
    with pytest.raises(TypeError, match="q_proj.weight"):
        load_torch_state_dict(other, dict(theirs, **{"q_proj.weight": [[1.0]]}))


def test_rotary_freqs_match_the_upstream_rotary():
    import jax

    upstream()
    from parity.layers import LayerCase, upstream_freqs, upstream_layer
    from qsa_jax.qwen3_8_flash_next import QSAConfig, rotary_freqs

    pos = np.array([[0, 1, 2, 3, 100, 2051, 8191, 32767, 131071, 262143]])
    for config, kw in (("small", SMALL), ("real", {})):
        for dtype in ("float32", "bfloat16"):
            _, rot, _ = upstream_layer(LayerCase("padded", dtype, "noise", 8, (8,), config), 0)
            want = upstream_freqs(rot, pos, dtype, "cpu").float().numpy()
            # on the host, as upstream's here: XLA's GPU cos/sin differ from the host's by up to
            # ~7e-6 at the largest angles (~2.6e5 rad), far past an ulp of the result
            with jax.default_device(jax.devices("cpu")[0]):
                got = np.asarray(rotary_freqs(QSAConfig(dtype=dtype, **kw), pos)).astype(np.float32)
            assert got.shape == want.shape
            # host cos/sin libraries differ by at most an ulp; the inverse frequencies and angles are exact
            ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -23
            assert np.abs(got - want).max() <= ulp, (config, dtype)


CASES = {
    "padded-f32-correlated": ("padded", "float32", "correlated", 301, (301, 174, 0)),
    "packed-bf16-noise": ("packed", "bfloat16", "noise", 301, (3, 150, 2, 146)),
    "cp-padded-bf16-correlated": ("cp", "bfloat16", "correlated", 296, (296, 203)),
    "cp-packed-f32-noise": ("cp", "float32", "noise", 296, (5, 170, 118)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_port_matches_the_upstream_layer(name):
    """Route sets agree except at exact upstream ties or where rounding of the two sides'
    indexer inputs explains the difference; on upstream's routes the output, dx and every
    trainable gradient agree at the contract's tolerance; padding rows are exact zeros."""
    upstream()
    from parity.layers import LayerCase, run_case

    case = LayerCase(*CASES[name])
    record = run_case(case, int(np.random.default_rng().integers(2**31)))
    assert "error" not in record, record.get("error")
    routes = record["routes"]
    assert routes["unexplained"] == 0, routes["failures"]
    assert routes["identical"] + routes["tie_explained"] + routes["rounding_explained"] == routes["rows"] > 0
    for example in routes["examples"]:
        assert example["tie"] and all(v == example["cut"] for v in example["swapped_scores"].values())
    for example in routes["rounding_examples"]:
        assert example["rounding"] and example["port_inputs_same"], example
        if case.dtype != "float32":
            assert example["input_ulps"] <= 1, example
    forced = record["forced"]
    assert set(forced["errors"]) == {"out", "dx", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                                     "o_proj.weight", "q_norm.weight", "k_norm.weight"}
    assert forced["pass"], forced["errors"]
    assert record["free"]["out_same_route_rows"] < forced["tolerance"]
    assert record["padding_rows_zero"] and record["pass"]


def test_tie_check_tells_ties_from_real_differences():
    from parity.layers import _explain

    scores = np.array([5.0, 0.0, 2.0, 0.0, 3.0, 0.0])  # 6 visible blocks of a row at position 25
    up = {i for b in (0, 1, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}
    tie = {i for b in (0, 3, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}
    wrong = {i for b in (0, 2, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}
    assert _explain(up, tie, 0, 25, 4, scores)["tie"]
    verdict = _explain(up, wrong, 0, 25, 4, scores)
    assert not verdict["tie"] and verdict["port_only"] == [2]
    assert not _explain(up, tie - {25}, 0, 25, 4, scores)["tie"], "a different tail is never a tie"


def _bf16(a):
    """float32 holding bfloat16 values (what a 16-bit indexer hands its float32 scores)."""
    return round_to(np.asarray(a, np.float64), "bfloat16").astype(np.float32)


def test_score_bound_covers_float32_evaluations_in_any_order():
    """score_with_bound's beta bounds every float32 evaluation of the block score tried here
    (summation forward, backward, in a random order, numpy's pairwise; products of 16-bit
    inputs are exact in float32, so fused multiply-adds change nothing) and stays within
    a few float32 ulps of the terms' magnitude."""
    from parity.layers import score_with_bound

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    u = 2.0 ** -24
    for _ in range(20):
        q = _bf16(rng.standard_normal((4, 128)) * rng.uniform(0.1, 30))
        k = _bf16(rng.standard_normal(128) * rng.uniform(0.1, 30))
        exact, beta = score_with_bound(q, k)
        scale = np.float32(1 / np.sqrt(128))

        def evaluate(order, heads, q=q, k=k, scale=scale):
            total = np.float32(0)
            for h in heads:
                dot = np.float32(0)
                for d in order:
                    dot = np.float32(dot + np.float32(q[h, d] * k[d]))
                total = np.float32(total + max(dot, np.float32(0)))
            return float(np.float32(total * scale))

        fwd, rev = np.arange(128), np.arange(128)[::-1]
        pairwise = float(np.float32(np.maximum((q @ k).astype(np.float32), 0).sum(dtype=np.float32) * scale))
        for value in (evaluate(fwd, range(4)), evaluate(rev, range(4)[::-1]), evaluate(rng.permutation(128), range(4)),
                      pairwise):
            assert abs(value - exact) <= beta, (seed, value, exact, beta)
        magnitude = float((np.abs(q).astype(np.float64) @ np.abs(k)).sum()) / np.sqrt(128)
        assert beta <= 2**-16 * magnitude + 4 * u * abs(exact), (seed, beta, magnitude)


def test_rounding_explanation_tells_rounded_inputs_from_real_differences():
    """A swap at the cut between blocks whose keys differ, on one side, by one bf16 ulp in
    one element (and are equal on the other) is explained by rounding; a swap to a block
    with a clear score gap is not, nor one whose inputs differ by two ulps, nor one whose
    ranked scores are not float32 evaluations of the side's inputs, nor one the port's
    rerun did not rank the same way."""
    from parity.layers import _explain, explain_by_rounding, score_with_bound, settle_by_rounding

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    heads, dim, t = 4, 128, 25
    query = {(0, t): _bf16(np.abs(rng.standard_normal((heads, dim))) + 0.1)}
    keys = _bf16(np.abs(rng.standard_normal((1, 6, dim))) + 0.1)
    keys[0, 2] *= 0.5  # block 2: clearly lower
    j = int(rng.integers(dim))
    keys[0, 1, j] = 1.5  # bf16's ulp there: 2**-7
    keys[0, 0] = keys[0, 4] = keys[0, 1] * 2  # blocks 0 and 4, kept by both: far above the cut
    keys[0, 3] = keys[0, 1]
    keys[0, 3, j] = 1.5 + 2.0**-7  # one bf16 ulp up: on the port's inputs block 3 wins

    up_keys = keys[0].copy()
    up_keys[3] = keys[0, 1]  # upstream rounded block 3's element down: blocks 1 and 3 equal there

    def scores_of(q, k):
        return np.array([score_with_bound(q, k[n])[0] for n in range(len(k))]).astype(np.float32).astype(np.float64)

    up_scores = scores_of(query[(0, t)], up_keys)
    up_scores[3] = np.nextafter(np.float32(up_scores[1]), np.float32(0))  # upstream's topk: 1 above 3
    port_scores = scores_of(query[(0, t)], keys[0])
    up = {i for b in (0, 1, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}
    swap = {i for b in (0, 3, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}
    wrong = {i for b in (0, 2, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}

    def explained(mine, upstream_keys=up_keys, upstream_scores=up_scores, ranked_scores=port_scores):
        entry = {"row": [0, t], **_explain(up, mine, 0, t, 4, upstream_scores)}
        assert not entry["tie"]
        padding = {"row": [0, 3], "reason": "a padding row has routes"}
        count = explain_by_rounding([entry, padding], (query, keys), {(0, t): (query[(0, t)], upstream_keys)}, 4, 4,
                                    None, "bfloat16",
                                    {} if ranked_scores is None else {(0, t): ranked_scores.astype(np.float32)})
        assert count == int(entry["rounding"]) and "rounding" not in padding
        return entry

    entry = explained(swap)
    assert entry["rounding"] and entry["input_ulps"] == 1 and entry["port_inputs_same"], (seed, entry)
    assert entry["upstream_exact_scores"][1] == entry["upstream_exact_scores"][3], (seed, entry)
    assert entry["exact_scores"][3] > entry["exact_scores"][1], (seed, entry)
    summary = {"rounding_explained": 0, "unexplained": 2, "rounding_rows": [], "rounding_examples": [],
               "failures": [{"reason": "a padding row has routes"}, entry]}
    settle_by_rounding(summary, [entry])
    assert summary["unexplained"] == 1 and summary["rounding_rows"] == [[0, t]]
    assert summary["failures"] == [{"reason": "a padding row has routes"}]

    entry = explained(wrong)
    assert not entry["rounding"] and "not the port's choice is right" in entry["reason"], (seed, entry)
    two = up_keys.copy()
    two[3, j] = 1.5 - 2.0**-7  # two ulps below the port's value
    entry = explained(swap, upstream_keys=two)
    assert not entry["rounding"] and entry["input_ulps"] >= 2, (seed, entry)
    off = up_scores.copy()
    off[1] *= 1 + 1e-3  # no float32 evaluation of upstream's inputs
    entry = explained(swap, upstream_scores=off)
    assert not entry["rounding"] and "not upstream's ranked scores" in entry["reason"], (seed, entry)
    entry = explained(swap, ranked_scores=port_scores * (1 + 1e-3))
    assert not entry["rounding"] and not entry["port_inputs_same"], (seed, entry)
    entry = explained(swap, ranked_scores=None)  # the rerun did not keep this row's routes
    assert not entry["rounding"] and not entry["port_inputs_same"], (seed, entry)


def test_rounding_explanation_in_float32_bounds_the_inputs_by_their_scores():
    """In float32 the two sides' inputs differ in their last bits (each side's reduction
    order): a swap at the cut whose keys differ by a few float32 ulps is explained; the
    same swap with upstream's key 1e-3 off (a port bug's size) is not."""
    from parity.layers import _explain, explain_by_rounding, score_with_bound

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    heads, dim, t = 4, 128, 25
    query = {(0, t): (np.abs(rng.standard_normal((heads, dim))) + 0.1).astype(np.float32)}
    keys = (np.abs(rng.standard_normal((1, 6, dim))) + 0.1).astype(np.float32)
    keys[0, 2] *= 0.5  # block 2: clearly lower
    keys[0, 0] = keys[0, 4] = keys[0, 1] * 2  # blocks 0 and 4, kept by both: far above the cut
    keys[0, 3] = keys[0, 1]
    j = int(rng.integers(dim))
    keys[0, 3, j] = np.nextafter(np.nextafter(keys[0, 1, j], np.float32(9)), np.float32(9))  # two ulps up

    def scores_of(k):
        return np.array([score_with_bound(query[(0, t)], k[n])[0] for n in range(len(k))])

    up_keys = keys[0].copy()
    up_keys[3] = keys[0, 1]  # upstream's reduction order: blocks 1 and 3 equal
    port_scores = scores_of(keys[0]).astype(np.float32)
    assert port_scores[3] >= port_scores[1], seed
    up = {i for b in (0, 1, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}
    swap = {i for b in (0, 3, 4) for i in range(4 * b, 4 * b + 4)} | {24, 25}

    def explained(upstream_keys):
        up_scores = scores_of(upstream_keys).astype(np.float32).astype(np.float64)
        up_scores[3] = np.nextafter(np.float32(up_scores[1]), np.float32(0))  # upstream's topk: 1 above 3
        entry = {"row": [0, t], **_explain(up, swap, 0, t, 4, up_scores)}
        explain_by_rounding([entry], (query, keys), {(0, t): (query[(0, t)], upstream_keys)}, 4, 4, None,
                            "float32", {(0, t): port_scores})
        return entry

    entry = explained(up_keys)
    assert entry["rounding"] and entry["input_ulps"] == 2, (seed, entry)
    off = up_keys.copy()
    off[3] *= 1 - 1e-3
    off[1] *= 1 - 1e-3
    entry = explained(off)
    assert not entry["rounding"] and entry["reason"].endswith(
        "not rounding: not the two sides' inputs move the swapped scores by at most float32 evaluation error"), (
        seed, entry)


def test_parity_flags_a_wrong_port(monkeypatch):
    """A norm weight off by 1e-3 fails the forced-route check; a selection biased towards
    later blocks leaves unexplained route differences."""
    upstream()
    import jax.numpy as jnp

    import parity.layers as layers
    from qsa_jax.qwen3_8_flash_next import indexer as port_indexer

    real_port, real_score = layers.port_layer, port_indexer._head_sum_score

    def perturbed(*args, **kw):
        port = real_port(*args, **kw)
        port.q_norm[...] = port.q_norm[...] + 1e-3
        return port

    def biased(dim):
        score = real_score(dim)
        return lambda relu_dots: score(relu_dots) + 0.1 * jnp.arange(relu_dots.shape[-1])

    monkeypatch.setattr(layers, "port_layer", perturbed)
    monkeypatch.setattr(port_indexer, "_head_sum_score", biased)
    monkeypatch.setattr(layers, "_STEPS", {})
    record = layers.run_case(layers.LayerCase("padded", "float32", "noise", 96, (96, 61)), 5)
    assert not record["pass"]
    assert not record["forced"]["pass"] and record["forced"]["errors"]["q_norm.weight"] > 1e-5
    assert record["routes"]["unexplained"] > 0
