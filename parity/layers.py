"""The Flax port of Qwen3.8-Flash-Next's QSA layer against the installed PyTorch model.

``python -m parity --layers`` (and the small case inside plain ``python -m
parity``) builds the upstream layer (nemo-automodel's
``Qwen3_8_FlashNextQSAAttention``) with random weights, copies its state dict
into :class:`qsa_jax.qwen3_8_flash_next.QSAAttention` and feeds both the same
hidden states and the same ``freqs_cis`` (from the upstream rotary
embedding). Hidden states are either locally correlated along the sequence (an
AR(1) walk, so neighbouring rows pick overlapping blocks as a trained model's
do) or plain noise. Per case it reports:

* route agreement: rows whose route sets are identical; every other row must
  differ only among blocks whose upstream scores equal the score at the top-k
  cut (the upstream scores are the very tensors its ``torch.topk`` ranked,
  captured during its forward), or be explained by rounding
  (:func:`explain_by_rounding`: each side's choice is right, within float32
  evaluation error, for its own indexer inputs, and the two sides' inputs differ
  by at most one rounding in a 16-bit model dtype, or in float32 move the scores
  no further than float32 evaluation error); anything else is unexplained and
  fails;
* forced routes: the port run on the upstream routes: output, input gradient
  and every trainable parameter's gradient against upstream at the contract's
  tolerance (float32 1e-5, bfloat16 1e-2, relative L2);
* free running: each side on its own routes; output rows with identical
  routes are held to the tolerance, the tie rows are named.

Layouts: right-padded batch (ragged lengths, an all-padding row), packed row
(``cu_seqlens``, documents shorter than a block), context parallel (the port
on a 2-device mesh against the upstream single-process result; on a CPU
machine in a subprocess with two host devices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

from qsa_common.quiet_import import quiet, quiet_import

from .suite import TOLERANCE

__all__ = ["LayerCase", "SMALL_CONFIG", "default_cases", "run_case", "run_layers", "summary_lines",
           "upstream_missing", "write_section"]

SMALL_CONFIG = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    indexer_n_heads=2, indexer_head_dim=32, indexer_budget=32, indexer_compress_ratio=4)
REAL_CONFIG: dict = {}  # the upstream defaults: hidden 2560, 24/2 heads, D 256, indexer 4 x 128, budget 2048
TRAINABLE = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
             "k_norm.weight")
_UPSTREAM_LAYERS = "nemo_automodel.components.models.qwen3_8_flash_next.layers"
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10]}


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One comparison: ``layout`` padded/packed/cp, ``dtype`` float32/bfloat16,
    ``hidden`` correlated/noise; ``lengths`` are the padded rows' lengths or the
    packed documents' lengths (their sum may be < ``seq_len`` under CP: padding tail)."""

    layout: str
    dtype: str
    hidden: str
    seq_len: int
    lengths: tuple[int, ...]
    config: str = "small"
    world_size: int = 2

    @property
    def layout_name(self) -> str:
        """``layout``, with context-parallel packed documents named ``cp-packed``."""
        return "cp-packed" if self.layout == "cp" and _packed(self) else self.layout

    def label(self) -> str:
        return f"{self.config}/{self.layout_name}/{self.dtype}/{self.hidden}/S={self.seq_len}"


def default_cases(config: str = "small", dtypes=("float32", "bfloat16"), seq_len: int | None = None):
    """The CPU matrix (small config): every layout x dtype x hidden-state kind.

    Padded: S = 301 (not a multiple of 4), lengths (301, 174, 0); packed: documents
    of 3, 150, 2 and 146 tokens; CP: S = 296 on 2 devices, padded (296, 203) and
    packed (5, 170, 121) crossing the shard boundary. ``config="real"`` gives the
    H200 cases (S = 8192 or ``seq_len``, one padded row and one packed row).
    """
    cases = []
    if config == "real":
        s = seq_len or 8192
        docs = (s // 3 + 1, 2, s - s // 3 - 3)
        for dtype in dtypes:
            cases.append(LayerCase("padded", dtype, "correlated", s, (s,), "real"))
            cases.append(LayerCase("packed", dtype, "noise", s, docs, "real"))
        return cases
    for dtype in dtypes:
        for hidden in ("correlated", "noise"):
            cases.append(LayerCase("padded", dtype, hidden, 301, (301, 174, 0)))
            cases.append(LayerCase("packed", dtype, hidden, 301, (3, 150, 2, 146)))
            cases.append(LayerCase("cp", dtype, hidden, 296, (296, 203)))
        cases.append(LayerCase("cp", dtype, "correlated", 296, (5, 170, 121)))
    return cases


# --------------------------------------------------------------------------- inputs
def _config_kwargs(case: LayerCase) -> dict:
    return dict(SMALL_CONFIG if case.config == "small" else REAL_CONFIG)


def hidden_states(rng: np.random.Generator, shape, kind: str) -> np.ndarray:
    """float32 ``[B, S, M]``: iid N(0, 1) (``noise``) or an AR(1) walk along S with
    correlation 0.98 per step and unit variance (``correlated``)."""
    noise = rng.standard_normal(shape).astype(np.float32)
    if kind == "noise":
        return noise
    if kind != "correlated":
        raise ValueError(f"hidden kind must be correlated or noise, got {kind!r}")
    a = 0.98
    out = np.empty_like(noise)
    out[:, 0] = noise[:, 0]
    for t in range(1, shape[1]):
        out[:, t] = a * out[:, t - 1] + np.sqrt(1 - a * a) * noise[:, t]
    return out


def _packed(case: LayerCase) -> bool:
    return case.layout == "packed" or (case.layout == "cp" and len(case.lengths) != 2)


def _layout_inputs(case: LayerCase):
    """``(batch, attention_mask [B,S] or None, cu_seqlens or None, positions [B,S])``."""
    s = case.seq_len
    if _packed(case):
        cu = np.concatenate([[0], np.cumsum(case.lengths)]).astype(np.int64)
        pos = np.zeros(s, np.int64)
        for lo, hi in zip(cu[:-1], cu[1:]):
            pos[lo:hi] = np.arange(hi - lo)
        return 1, None, cu, pos[None]
    mask = (np.arange(s)[None] < np.asarray(case.lengths)[:, None]).astype(np.int64)
    return len(case.lengths), mask, None, np.broadcast_to(np.arange(s), mask.shape).copy()


# --------------------------------------------------------------------------- upstream
def upstream_layer(case: LayerCase, seed: int, device: str = "cpu"):
    """``(layer, rotary)``: the upstream layer with random weights (linears ~N(0, 0.02),
    every RMSNorm weight ~U(-0.5, 0.5) so ``1 + w`` matters) and its rotary embedding."""
    import torch

    quiet_import(_UPSTREAM_LAYERS)  # its import-time warnings are third-party noise
    from nemo_automodel.components.models.qwen3_5_moe.model import Fp32SafeQwen3_5MoeTextRotaryEmbedding
    from nemo_automodel.components.models.qwen3_8_flash_next.backend import Qwen3_8_FlashNextBackendConfig
    from nemo_automodel.components.models.qwen3_8_flash_next.config import Qwen3_8_FlashNextTextConfig
    from nemo_automodel.components.models.qwen3_8_flash_next.layers import Qwen3_8_FlashNextQSAAttention

    with quiet():  # transformers' config deprecation notices are upstream's own
        config = Qwen3_8_FlashNextTextConfig(num_hidden_layers=4, rope_parameters=dict(ROPE), dtype=case.dtype,
                                             **_config_kwargs(case))
        backend = Qwen3_8_FlashNextBackendConfig(attn="flex", linear="torch")
        layer = Qwen3_8_FlashNextQSAAttention(config, 3, backend)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return layer.to(device), Fp32SafeQwen3_5MoeTextRotaryEmbedding(config=config).to(device), config


def upstream_freqs(rotary, positions: np.ndarray, dtype: str, device: str):
    """``freqs_cis`` as the upstream model builds it for text positions ``[B, S]``."""
    import torch

    pos = torch.as_tensor(positions, device=device)
    probe = torch.empty(0, dtype=getattr(torch, dtype), device=device)
    cos, sin = rotary(probe, pos.unsqueeze(0).expand(3, -1, -1))
    half = cos.shape[-1] // 2
    return torch.cat([cos[..., :half], sin[..., :half]], dim=-1)


@contextlib.contextmanager
def captured_scores():
    """Record the score tensors the upstream indexer hands to ``torch.topk``, per
    ``select_qsa_token_ids`` call, with that call's lengths, query offset and inputs
    (``queries`` ``[B, S_query, H, D]`` and ``keys`` ``[B, P, D]``, float32 numpy holding
    the model-dtype values)."""
    import torch

    quiet_import(_UPSTREAM_LAYERS)
    from nemo_automodel.components.models.qwen3_8_flash_next import qsa

    calls: list[dict] = []
    select, topk = qsa.select_qsa_token_ids, torch.topk

    def recording_select(index_queries, compressed_keys, sequence_lengths, **kw):
        calls.append({"lengths": [int(v) for v in sequence_lengths.tolist()], "rows": index_queries.shape[1],
                      "offset": int(kw.get("query_position_offset", 0)), "ratio": kw["compress_ratio"],
                      "top_k": kw["token_budget"] // kw["compress_ratio"], "scores": [],
                      "queries": index_queries.detach().float().cpu().numpy(),
                      "keys": compressed_keys.detach()[:, :, 0].float().cpu().numpy()})
        return select(index_queries, compressed_keys, sequence_lengths, **kw)

    def recording_topk(scores, *args, **kw):
        if calls:
            calls[-1]["scores"].append(scores.detach().float().cpu().numpy())
        return topk(scores, *args, **kw)

    qsa.select_qsa_token_ids, torch.topk = recording_select, recording_topk
    try:
        yield calls
    finally:
        qsa.select_qsa_token_ids, torch.topk = select, topk


def scores_by_row(call: dict) -> dict[tuple[int, int], np.ndarray]:
    """``{(pseudo-batch row, position): scores over its blocks}`` of one recorded call.

    The upstream selection scores, per pseudo-batch row in order, the rows at
    positions ``first_sparse .. offset + valid - 1`` in ascending chunks; the
    recorded tensors are cut back into rows on that rule (and checked against it).
    """
    ratio, top_k, offset = call["ratio"], call["top_k"], call["offset"]
    first_sparse = (top_k + 1) * ratio - 1
    rows = [row for tensor in call["scores"] for row in tensor]
    out, used = {}, 0
    for b, length in enumerate(call["lengths"]):
        valid = min(max(length - offset, 0), call["rows"])
        if valid == 0 or length // ratio == 0:
            continue
        for p in range(max(first_sparse, offset), offset + valid):
            if used >= len(rows):
                raise AssertionError("fewer recorded score rows than sparse query rows")
            score = rows[used]
            visible = (p + 1) // ratio
            if not (np.isfinite(score[:visible]).all() and np.isneginf(score[visible:]).all()):
                raise AssertionError(f"recorded scores of row {b}, position {p} do not match its visibility")
            out[(b, p)] = score
            used += 1
    if used != len(rows):
        raise AssertionError(f"{len(rows)} recorded score rows, {used} sparse query rows")
    return out


def inputs_by_row(call: dict) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """``{(pseudo-batch row, position): (query [H, D], block keys [P, D])}``: the upstream
    indexer inputs behind each row of :func:`scores_by_row` (the same rows, the same call)."""
    return {(b, p): (call["queries"][b, p - call["offset"]], call["keys"][b]) for b, p in scores_by_row(call)}


def run_upstream(layer, x, freqs, mask, cu, cotangent):
    """``(routes, out, dx, {name: grad}, score calls)`` of the upstream layer (float32 numpy
    results); the routes are the indexer's, trimmed as the layer trims them."""
    import torch

    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    kwargs = {"attention_mask": mask} if cu is None else {"cu_seqlens": cu}
    with captured_scores() as calls, torch.no_grad():
        full = layer.indexer(x, freqs_cis=freqs, **kwargs)
    width = min(full.shape[-1], int(torch.diff(cu).max()) if cu is not None else x.shape[1])
    out = layer(x, freqs_cis=freqs, **kwargs)
    (out.float() * cotangent).sum().backward()
    grads = {n: p.grad.float().cpu().numpy() for n, p in layer.named_parameters() if p.requires_grad}
    return (full[..., :width].cpu().numpy(), out.detach().float().cpu().numpy(), x.grad.float().cpu().numpy(),
            grads, calls)


# --------------------------------------------------------------------------- the port
def port_layer(upstream, case: LayerCase, implementation=None):
    """The nnx layer with the upstream weights loaded (bit for bit)."""
    from flax import nnx

    from qsa_jax.qwen3_8_flash_next import QSAAttention, QSAConfig, load_torch_state_dict

    config = QSAConfig(dtype=case.dtype, **_config_kwargs(case))
    layer = QSAAttention(config, rngs=nnx.Rngs(0), implementation=implementation)
    load_torch_state_dict(layer, upstream.state_dict())
    return layer


def _port_step(mesh, kind: str):
    """Jitted port functions, one per (mesh, kind) so cases of the same shapes share
    compilations: ``routes`` ``(layer, x, freqs, mask, cu_seqlens) -> routes``, and
    ``free`` / ``forced`` ``(layer, x, freqs, cotangent, mask, cu_seqlens, routes) ->
    ((loss, out), (grads, dx))``. Layout arrays and routes are arguments, never
    constants (XLA would spend seconds folding them)."""
    key = (id(mesh), kind)
    if key not in _STEPS:
        import jax.numpy as jnp
        from flax import nnx

        from qsa_jax.qwen3_8_flash_next import context_parallel_qsa_attention, context_parallel_qsa_indexer

        forced = kind == "forced"
        if kind == "routes":
            def routes_fn(layer, x, freqs, mask, cu):
                if mesh is None:
                    return layer.indexer(x, freqs_cis=freqs, attention_mask=mask, cu_seqlens=cu)
                return context_parallel_qsa_indexer(layer.indexer, x, freqs_cis=freqs, mesh=mesh,
                                                    attention_mask=mask, cu_seqlens=cu)

            _STEPS[key] = (nnx.jit(routes_fn), mesh)
            return _STEPS[key][0]

        def loss(layer, x, freqs, g, mask, cu, routes):
            kwargs = dict(freqs_cis=freqs, attention_mask=mask, cu_seqlens=cu,
                          selected_token_ids=routes if forced else None)
            if mesh is None:
                out = layer(x, **kwargs)
            else:
                out = context_parallel_qsa_attention(layer, x, mesh=mesh, **kwargs)
            return jnp.sum(out.astype(jnp.float32) * g), out

        grad = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        _STEPS[key] = (nnx.jit(lambda *a: grad(*a)), mesh)
    return _STEPS[key][0]


_STEPS: dict = {}


def run_port(layer, x, freqs, mask, cu, cotangent, routes=None, mesh=None):
    """``(own routes, out, dx, {torch name: grad})`` of the port (float32 numpy)."""
    import jax
    import jax.numpy as jnp

    x, freqs, mask, cu = _port_arrays(x, freqs, mask, cu)
    g = jnp.asarray(cotangent)
    own = _port_step(mesh, "routes")(layer, x, freqs, mask, cu)
    forced = routes is not None
    step = _port_step(mesh, "forced" if forced else "free")
    (_, out), (grads, dx) = step(layer, x, freqs, g, mask, cu, jnp.asarray(routes, jnp.int32) if forced else None)
    flat = {"q_proj.weight": grads.q_proj.kernel, "k_proj.weight": grads.k_proj.kernel,
            "v_proj.weight": grads.v_proj.kernel, "o_proj.weight": grads.o_proj.kernel,
            "q_norm.weight": grads.q_norm, "k_norm.weight": grads.k_norm}
    flat = {n: np.asarray(jax.device_get(v[...]), np.float32) for n, v in flat.items()}
    flat = {n: (v.T if v.ndim == 2 else v) for n, v in flat.items()}
    f32 = lambda a: np.asarray(jax.device_get(a)).astype(np.float32)  # noqa: E731
    return np.asarray(own), f32(out), f32(dx), flat


def port_score_inputs(layer, x, freqs, mask, cu):
    """The port's indexer queries ``[B, S, H, D]`` and compressed block keys ``[B, N, D]``
    (float32 numpy holding its model-dtype values) and the block step (diagnostics)."""
    import jax.numpy as jnp

    from qsa_jax.qwen3_8_flash_next import make_layout

    x, freqs, mask, cu = _port_arrays(x, freqs, mask, cu)
    layout = make_layout(x.shape[0], x.shape[1], attention_mask=mask, cu_seqlens=cu)
    query, raw_key = layer.indexer.project(x, freqs)
    keys = layer.indexer.compress(raw_key, freqs, packed=layout.packed)
    step = 1 if layout.packed else layer.config.indexer_compress_ratio
    return np.asarray(query.astype(jnp.float32)), np.asarray(keys.astype(jnp.float32)), step


def port_scores(layer, x, freqs, mask, cu):
    """The port's own float32 block scores ``[B, S, N]`` and block starts (diagnostics)."""
    import jax.numpy as jnp

    query, keys, step = port_score_inputs(layer, x, freqs, mask, cu)
    dots = jnp.maximum(jnp.einsum("bshd,bnd->bshn", query, keys, precision="highest"), 0)
    total = dots[:, :, 0]
    for h in range(1, dots.shape[2]):
        total = total + dots[:, :, h]
    return np.asarray(total / np.sqrt(layer.config.indexer_head_dim)), step


def port_ranked_scores(layer, x, freqs, mask, cu, rows):
    """The block scores the port's selection ranks, and the inputs it scored, for ``rows``
    (``[(b, t), ...]``).

    Runs the port's indexer once more (unsharded, on one device, its own jit) with the score callable of
    :func:`qsa_jax.indexer.select_routes` copying each chunk's ``[B, c, N]`` float32 scores
    to the host (an ordered ``jax.debug.callback`` on the very array ``lax.top_k`` ranks),
    and ``select_routes`` itself copying the index queries of ``rows`` and the compressed
    keys it was given (the values the jitted projections produced: an eager rerun of the
    projections may round differently). Returns that run's routes (numpy; equal to the
    routes under comparison when the callbacks changed nothing), ``{(b, t): scores [N]}``
    and the inputs ``({(b, t): query [H, D]}, keys [B, N, D], block step)`` (float32 numpy).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qsa_jax.qwen3_8_flash_next import indexer as port_indexer

    rows = [(int(b), int(t)) for b, t in rows]
    wanted: dict = {}
    for b, t in rows:
        wanted.setdefault(t, []).append(b)
    kept, done, inputs = {}, [0], {}

    def keep(total):
        total = np.asarray(total)
        for i in range(total.shape[1]):
            for b in wanted.get(done[0] + i, ()):
                kept[(b, done[0] + i)] = total[b, i].copy()
        done[0] += total.shape[1]

    def keep_inputs(query_rows, keys):
        inputs["queries"] = {(b, t): np.asarray(query_rows[b, i]).copy() for i, (b, t) in enumerate(rows)}
        inputs["keys"] = np.asarray(keys).copy()

    real_score, real_select = port_indexer._head_sum_score, port_indexer.select_routes

    def recording(dim):
        score = real_score(dim)

        def ranked(relu_dots):
            total = score(relu_dots)
            jax.debug.callback(keep, total, ordered=True)
            return total

        return ranked

    def selecting(query, keys, *args, **kwargs):  # query [B, S, H, D], keys [B, N, D], float32
        picked = jnp.take(query, jnp.asarray([t for _, t in rows], jnp.int32), axis=1)  # [B, len(rows), H, D]
        jax.debug.callback(keep_inputs, picked, keys)  # once per run: no order to keep
        return real_select(query, keys, *args, **kwargs)

    # one device (a context-parallel case's layer is placed on its mesh): ordered callbacks
    # run on one device only
    graph, state = nnx.split(layer)
    layer = nnx.merge(graph, jax.device_put(state, jax.devices()[0]))
    port_indexer._head_sum_score, port_indexer.select_routes = recording, selecting
    try:
        step = nnx.jit(lambda m, a, f, k, c: m.indexer(a, freqs_cis=f, attention_mask=k, cu_seqlens=c))
        routes = np.asarray(step(layer, *_port_arrays(x, freqs, mask, cu)))
    finally:
        port_indexer._head_sum_score, port_indexer.select_routes = real_score, real_select
    block_step = 1 if cu is not None else layer.config.indexer_compress_ratio
    return routes, kept, (inputs["queries"], inputs["keys"], block_step)


def _port_arrays(x, freqs, mask, cu):
    import jax.numpy as jnp

    return (jnp.asarray(x), jnp.asarray(freqs), None if mask is None else jnp.asarray(mask, jnp.int32),
            None if cu is None else jnp.asarray(cu, jnp.int32))


def score_with_bound(query_row, key):
    """The block score ``sum_h relu(q_h . k) / sqrt(D)`` of one query row ``[H, D]`` and one
    block key ``[D]``, exactly (float64 of the 16/32-bit inputs), and ``beta``: a bound on how
    far any float32 evaluation of it, in any summation order, may fall from that value
    (Higham's ``gamma_n = n u / (1 - n u)``, u = 2**-24: each dot errs by at most
    ``gamma_D * sum_d |q_hd k_d|`` (with or without fused multiply-adds), relu is
    1-Lipschitz, the head sum adds ``gamma_H * sum_h |r_h|``, and the scaling by a rounded
    ``1 / sqrt(D)`` multiplies all of it by ``(1 + u)**2 / (1 - u)`` and adds ``3 u |score|``)."""
    q = np.asarray(query_row, np.float64)
    k = np.asarray(key, np.float64)
    heads, dim = q.shape
    u = 2.0 ** -24

    def gamma(n):
        return n * u / (1 - n * u)

    dots = q @ k
    dot_err = gamma(dim) * (np.abs(q) @ np.abs(k))
    relu = np.maximum(dots, 0)
    score = relu.sum() / np.sqrt(dim)
    summed = (dot_err.sum() + gamma(heads) * (relu + dot_err).sum()) / np.sqrt(dim)
    # (T + E)(1 + d1)(1 + d2) or (T + E) / (1 + d1) * (1 + d2), |d| <= u: the scaling's rounded
    # constant and its rounding, applied to the summed error E too
    beta = summed * (1 + u) ** 2 / (1 - u) + 3 * u * abs(score)
    return float(score), float(beta)


# --------------------------------------------------------------------------- comparisons
def relative_error(actual, expected) -> float:
    from qsa_common.oracle import relative_error as rel

    return rel(actual, expected)


def route_agreement(port_routes, up_routes, case: LayerCase, scores: dict, ratio: int, examples: int = 3):
    """Compare route sets row by row; explain every difference by exact upstream ties.

    Returns ``(summary, unexplained entries)``: the summary has ``rows`` (real
    query rows), ``identical``, ``tie_explained``, ``unexplained`` (padding rows
    that are not all -1 on either side count here too), ``tie_rows``
    (``[b, row]``), a few worked tie checks (``examples``) and failures
    (``failures``); the entries are every unexplained row's verdict.
    ``rounding_explained``, ``rounding_rows`` and ``rounding_examples`` start empty:
    :func:`settle_by_rounding` fills them.
    """
    batch, s = up_routes.shape[:2]
    _, _, cu, _ = _layout_inputs(case)
    real = _real_rows(case, batch)
    same = _same_sets(up_routes, port_routes)
    out = {"rows": int(real.sum()), "identical": int((same & real).sum()), "tie_explained": 0,
           "rounding_explained": 0, "unexplained": 0, "tie_rows": [], "rounding_rows": [], "examples": [],
           "rounding_examples": [], "failures": []}
    unexplained = []
    for b, t in zip(*np.nonzero(~same)):
        b, t = int(b), int(t)
        up = {int(i) for i in up_routes[b, t] if i >= 0}
        mine = {int(i) for i in port_routes[b, t] if i >= 0}
        if not real[b, t] or up == mine:
            out["unexplained"] += 1
            out["failures"].append({"row": [b, t], "reason": "a padding row has routes" if not real[b, t]
                                    else "duplicate IDs"})
            continue
        if cu is not None:
            d = int(np.searchsorted(cu, t, side="right") - 1)
            start, key = int(cu[d]), (d, t - int(cu[d]))
        else:
            start, key = 0, (b, t)
        entry = {"row": [b, t], **_explain(up, mine, start, t, ratio, scores.get(key))}
        if entry["tie"]:
            out["tie_explained"] += 1
            out["tie_rows"].append([b, t])
            if len(out["examples"]) < examples:
                out["examples"].append(entry)
        else:
            out["unexplained"] += 1
            unexplained.append(entry)
            if len(out["failures"]) < examples:
                out["failures"].append(entry)
    padding_routes = ~real & ~((up_routes < 0).all(-1) & (port_routes < 0).all(-1))
    for b, t in zip(*np.nonzero(padding_routes & same)):
        out["unexplained"] += 1
        out["failures"].append({"row": [int(b), int(t)], "reason": "a padding row has routes"})
    return out, unexplained


def _same_sets(a, b):
    """Rows whose sets of valid IDs (>= 0) are equal (neither side emits duplicates)."""
    a = np.where(a >= 0, a, -1)
    b = np.where(b >= 0, b, -1)
    return (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(-1)


def _explain(up: set, mine: set, start: int, t: int, ratio: int, scores):
    """Is the difference between two route sets an exact tie at upstream's top-k cut?"""
    visible = (t - start + 1) // ratio
    tail = set(range(start + ratio * visible, t + 1))

    def blocks(ids):
        body = ids - tail
        firsts = {(i - start) // ratio for i in body}
        whole = all({start + ratio * k + j for j in range(ratio)} <= body for k in firsts)
        return firsts, whole and len(body) == ratio * len(firsts)

    up_blocks, up_ok = blocks(up)
    my_blocks, my_ok = blocks(mine)
    result = {"tie": False, "upstream_only": sorted(up_blocks - my_blocks), "port_only": sorted(my_blocks - up_blocks),
              "port_kept": sorted(my_blocks)}
    if not (up_ok and my_ok) or (up & tail) != (mine & tail) or len(up_blocks) != len(my_blocks) or scores is None:
        result["reason"] = "tails, partial blocks, counts or a row without top-k scores differ"
        return result
    if any(k >= visible for k in my_blocks):
        result["reason"] = "the port chose an invisible block"
        return result
    cut = min(float(scores[k]) for k in up_blocks)
    swapped = sorted(up_blocks ^ my_blocks)
    values = {int(k): float(scores[k]) for k in swapped}
    result.update(cut=cut, swapped_scores=values)
    result["tie"] = all(v == cut for v in values.values())
    if not result["tie"]:
        result["reason"] = "swapped blocks' upstream scores differ from the cut score"
    return result


def _compare(port, up, tol):
    keys = ("out", "dx") + TRAINABLE
    errors = {k: relative_error(port[k], up[k]) for k in keys}
    return {"errors": errors, "tolerance": tol, "pass": all(e < tol for e in errors.values())}


# --------------------------------------------------------------------------- one case
def run_case(case: LayerCase, seed: int, *, implementation=None, device: str = "cpu") -> dict:
    """Build both layers, run the three checks of the module docstring, return the record."""
    import torch

    t0 = time.monotonic()
    if case.layout == "cp":
        import jax

        if len(jax.devices()) < case.world_size:
            return _cp_subprocess([case], [seed], implementation)[0]
    rng = np.random.default_rng(seed)
    layer, rotary, _ = upstream_layer(case, seed, device)
    port = port_layer(layer, case, implementation)
    batch, mask, cu, positions = _layout_inputs(case)
    hidden = port.config.hidden_size
    x = hidden_states(rng, (batch, case.seq_len, hidden), case.hidden)
    g = rng.standard_normal((batch, case.seq_len, hidden)).astype(np.float32)
    tdtype = getattr(torch, case.dtype)
    xt = torch.from_numpy(x).to(device, tdtype)
    freqs = upstream_freqs(rotary, positions, case.dtype, device)
    mask_t = None if mask is None else torch.from_numpy(mask).to(device)
    cu_t = None if cu is None else torch.from_numpy(cu).to(device)
    gt = torch.from_numpy(g).to(device)
    if cu is not None and cu[-1] < case.seq_len:
        # a CP row padded past its last document: upstream (unsharded) sees the documents only
        n = int(cu[-1])
        up_routes, up_out, up_dx, up_grads, calls = run_upstream(layer, xt[:, :n], freqs[:, :n], None, cu_t,
                                                                 gt[:, :n])
        up_routes = np.pad(up_routes, ((0, 0), (0, case.seq_len - n), (0, 0)), constant_values=-1)
        up_out, up_dx = (np.pad(a, ((0, 0), (0, case.seq_len - n), (0, 0))) for a in (up_out, up_dx))
    else:
        up_routes, up_out, up_dx, up_grads, calls = run_upstream(layer, xt, freqs, mask_t, cu_t, gt)
    scores = {}
    for call in calls:
        scores.update(scores_by_row(call))
    # the same numbers on the JAX side: bf16 inputs travel as float32 (exact)
    x_np = xt.float().cpu().numpy().astype(_np_dtype(case.dtype))
    freqs_np = freqs.float().cpu().numpy().astype(_np_dtype(case.dtype))
    mesh = _mesh(case) if case.layout == "cp" else None
    tol = TOLERANCE[case.dtype]
    upstream = {"out": up_out, "dx": up_dx, **up_grads}

    own, out, dx, grads = run_port(port, x_np, freqs_np, mask, cu, g, mesh=mesh)
    width = up_routes.shape[-1]
    agreement, unexplained = route_agreement(own[..., :width], up_routes, case, scores,
                                             port.config.indexer_compress_ratio)
    if own.shape[-1] > width and (own[..., width:] >= 0).any():
        agreement["unexplained"] += 1
        agreement["failures"].append({"reason": "port routes longer than the visible extent"})
    if any("swapped_scores" in e for e in unexplained):
        up_inputs = {}
        for call in calls:
            up_inputs.update(inputs_by_row(call))
        # the inputs the port's jitted selection ranked, and its scores (unsharded, also for a
        # context-parallel case); a row counts only where that rerun kept the compared routes
        again, ranked, (queries, keys, step) = port_ranked_scores(
            port, x_np, freqs_np, mask, cu, [e["row"] for e in unexplained])
        agreement["ranked_scores_routes_equal"] = bool((again == own).all())
        ranked = {row: v for row, v in ranked.items() if (again[row] == own[row]).all()}
        explain_by_rounding(unexplained, (queries, keys), up_inputs, step, port.config.indexer_compress_ratio, cu,
                            case.dtype, ranked)
        settle_by_rounding(agreement, unexplained)
    for entry in agreement["examples"] + agreement["rounding_examples"] + agreement["failures"]:
        entry.pop("port_kept", None)
    free = _compare({"out": out, "dx": dx, **grads}, upstream, tol)
    same = _same_sets(up_routes, own[..., :width])
    free["out_same_route_rows"] = relative_error(out[same], up_out[same])
    differ = agreement["tie_explained"] + agreement["rounding_explained"]
    free["pass"] = free["out_same_route_rows"] < tol and (differ > 0 or free["pass"])
    free["gradients_checked"] = differ == 0

    _, f_out, f_dx, f_grads = run_port(port, x_np, freqs_np, mask, cu, g, routes=up_routes, mesh=mesh)
    forced = _compare({"out": f_out, "dx": f_dx, **f_grads}, upstream, tol)
    padding_zero = bool((f_out[~_real_rows(case, batch)] == 0).all() and (out[~_real_rows(case, batch)] == 0).all())

    record = {"case": dataclasses.asdict(case), "label": case.label(), "seed": seed, "device": device,
              "implementation": implementation, "routes": agreement, "forced": forced, "free": free,
              "padding_rows_zero": padding_zero, "seconds": round(time.monotonic() - t0, 2)}
    record["pass"] = bool(agreement["unexplained"] == 0 and forced["pass"] and free["pass"] and padding_zero)
    return record


def explain_by_rounding(entries: list, port_inputs, upstream_inputs: dict, step: int, ratio: int, cu, dtype: str,
                        ranked=None) -> int:
    """Mark the unexplained rows whose difference rounding explains; count them.

    Both sides evaluate the same score formula in float32, each in its own summation
    order, from 16/32-bit indexer inputs that each computes in its own reduction order
    (the compressed keys' float32 mean-pool and normalisation): an input whose float32
    value lies near a rounding midpoint of the model dtype may round to neighbouring
    values on the two sides. An entry (an :func:`_explain` verdict with swapped scores)
    gets, per swapped block, ``exact_scores`` / ``beta`` from the port's inputs
    (``port_inputs`` = ``({(b, t): query [H, D]}, keys [B, N, D])``, those
    :func:`port_ranked_scores` captured) and ``upstream_exact_scores`` /
    ``upstream_beta`` from upstream's (``upstream_inputs``: :func:`inputs_by_row`), both by
    :func:`score_with_bound`; ``input_ulps``: the largest difference between the two
    sides' query row and swapped keys, in units in the last place of ``dtype``. It is
    ``rounding`` explained when all of these hold:

    * upstream's ranked scores are within ``upstream_beta`` of the exact scores of its
      captured inputs (they are the inputs it ranked); with ``ranked``
      (:func:`port_ranked_scores`'s ``{(b, t): scores}``, holding only the rows whose
      routes that rerun kept) the row is there and the port's ranked scores are within
      ``beta`` of its exact ones (``port_inputs_same``);
    * each side's choice is right for its own inputs up to float32 evaluation error:
      for every upstream-only block ``a`` and port-only block ``p``,
      ``e_a + beta_a + beta_p >= e_p`` on upstream's inputs and the reverse on the port's;
    * the inputs are the same up to rounding: in a 16-bit ``dtype``, ``input_ulps <= 1``
      (one rounding of the float32 values both compute); in float32, where the inputs are
      those float32 values themselves and differ in their last bits with each side's
      reduction order, each swapped block's exact score on the port's inputs is within
      ``beta + upstream_beta`` of its exact score on upstream's (the inputs' difference
      moves the scores no further than evaluating them in float32 may).
    """
    queries, keys = port_inputs
    explained = 0
    for entry in entries:
        if "swapped_scores" not in entry:
            continue
        b, t = entry["row"]
        if cu is None:
            start, up_key = 0, (b, t)
        else:  # upstream scores each packed document as its own pseudo-batch row
            doc = int(np.searchsorted(cu, t, side="right")) - 1
            start = int(cu[doc])
            up_key = (doc, t - start)
        blocks = [int(k) for k in entry["swapped_scores"]]
        column = {k: (start + ratio * k) // step for k in blocks}
        port = {k: score_with_bound(queries[(b, t)], keys[b, c]) for k, c in column.items()}
        entry["exact_scores"] = {k: e for k, (e, _) in port.items()}
        entry["beta"] = {k: beta for k, (_, beta) in port.items()}
        checks = {}
        if ranked is not None:
            mine = {k: float(ranked[(b, t)][c]) for k, c in column.items()} if (b, t) in ranked else {}
            entry["port_ranked_scores"] = mine
            entry["port_inputs_same"] = bool(mine) and all(abs(mine[k] - e) <= beta for k, (e, beta) in port.items())
            checks["the port's ranked scores are float32 evaluations of its inputs"] = entry["port_inputs_same"]
        if up_key not in upstream_inputs:
            entry["rounding"] = False
            entry["reason"] += "; no captured upstream inputs for this row"
            continue
        up_query, up_keys = upstream_inputs[up_key]
        up = {k: score_with_bound(up_query, up_keys[k]) for k in blocks}
        entry["upstream_exact_scores"] = {k: e for k, (e, _) in up.items()}
        entry["upstream_beta"] = {k: beta for k, (_, beta) in up.items()}
        entry["input_ulps"] = max(_ulps(queries[(b, t)], up_query, dtype),
                                  max(_ulps(keys[b, column[k]], up_keys[k], dtype) for k in blocks))
        checks["upstream's ranked scores are float32 evaluations of its inputs"] = all(
            abs(entry["swapped_scores"][k] - e) <= beta for k, (e, beta) in up.items())
        pairs = [(a, p) for a in entry["upstream_only"] for p in entry["port_only"]]
        checks["upstream's choice is right for its inputs"] = all(
            up[a][0] + up[a][1] + up[p][1] >= up[p][0] for a, p in pairs)
        checks["the port's choice is right for its inputs"] = all(
            port[p][0] + port[p][1] + port[a][1] >= port[a][0] for a, p in pairs)
        if dtype == "float32":  # float32 inputs: reduction order differs by many ulps (module doc)
            checks["the two sides' inputs move the swapped scores by at most float32 evaluation error"] = all(
                abs(port[k][0] - up[k][0]) <= port[k][1] + up[k][1] for k in blocks)
        else:
            checks["the inputs differ by at most one rounding"] = entry["input_ulps"] <= 1
        entry["rounding"] = all(checks.values())
        if entry["rounding"]:
            entry["reason"] = "rounding: " + "; ".join(checks)
            explained += 1
        else:
            entry["reason"] += "; not rounding: " + "; ".join(f"not {k}" for k, v in checks.items() if not v)
    return explained


def settle_by_rounding(summary: dict, entries: list, examples: int = 3) -> None:
    """Move the entries :func:`explain_by_rounding` explained from ``unexplained`` to
    ``rounding_explained`` in a :func:`route_agreement` summary (rows, a few examples)
    and list the first still unexplained ones as its failures."""
    explained = [e for e in entries if e.get("rounding")]
    left = [e for e in entries if not e.get("rounding")]
    summary["rounding_explained"] += len(explained)
    summary["unexplained"] -= len(explained)
    summary["rounding_rows"] += [e["row"] for e in explained]
    summary["rounding_examples"] += explained[:examples]
    others = [f for f in summary["failures"] if f not in entries]
    summary["failures"] = others + left[:examples]


def _ulps(a, b, dtype: str) -> float:
    """Largest ``|a - b|`` in units in the last place of ``dtype`` at ``max(|a|, |b|)``."""
    import ml_dtypes

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    info = ml_dtypes.finfo(_np_dtype(dtype))  # numpy >= 2.3's finfo refuses ml_dtypes' bfloat16
    big = np.maximum(np.maximum(np.abs(a), np.abs(b)), float(info.tiny))
    ulp = 2.0 ** (np.floor(np.log2(big)) - info.nmant)
    return float((np.abs(a - b) / ulp).max())


def _real_rows(case: LayerCase, batch: int) -> np.ndarray:
    s = case.seq_len
    if _packed(case):
        return (np.arange(s) < sum(case.lengths))[None]
    return np.arange(s)[None] < np.asarray(case.lengths)[:, None]


def _np_dtype(dtype: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _mesh(case: LayerCase):
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[: case.world_size]), ("cp",))


def _cp_subprocess(cases: list[LayerCase], seeds: list[int], implementation) -> list[dict]:
    """Run CP cases in one fresh interpreter with enough host devices; one record per case."""
    env = dict(os.environ)
    world = max(c.world_size for c in cases)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={world}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, "-m", "parity.layers", "--cases", json.dumps([dataclasses.asdict(c) for c in cases]),
            "--seeds", json.dumps(seeds)] + (["--implementation", implementation] if implementation else [])
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(lines) != len(cases):
        error = f"CP worker exited {proc.returncode}: {proc.stderr[-2000:]}"
        return [_error_record(c, s, error) for c, s in zip(cases, seeds)]
    return [json.loads(line) for line in lines]


# --------------------------------------------------------------------------- many cases
def upstream_missing() -> str | None:
    """Why the upstream layer cannot run here (None when it can)."""
    try:
        quiet_import(_UPSTREAM_LAYERS)
    except Exception as err:  # noqa: BLE001 - any import failure makes the section unavailable
        return f"nemo-automodel's Qwen3.8-Flash-Next layer is not importable ({type(err).__name__}: {err}); " \
               "install the 'upstream' extra"
    return None


def run_layers(cases, seed: int, *, implementation=None, device: str = "cpu", on_case=None) -> list[dict]:
    """Run every case (seed + index each); a case that raises is recorded as failing.

    Context-parallel cases that need more devices than this process has run together
    in one subprocess with host devices (jax's device count is fixed at import)."""
    import jax

    records: dict[int, dict] = {}
    spawn = [i for i, c in enumerate(cases) if c.layout == "cp" and len(jax.devices()) < c.world_size]
    if spawn:
        for i, record in zip(spawn, _cp_subprocess([cases[i] for i in spawn], [seed + i for i in spawn],
                                                   implementation)):
            records[i] = record
            if on_case is not None:
                on_case(record)
    for i, case in enumerate(cases):
        if i in records:
            continue
        try:
            record = run_case(case, seed + i, implementation=implementation, device=device)
        except Exception as err:  # noqa: BLE001 - reported, never hidden
            record = _error_record(case, seed + i, f"{type(err).__name__}: {err}")
        records[i] = record
        if on_case is not None:
            on_case(record)
    return [records[i] for i in range(len(cases))]


def _error_record(case: LayerCase, seed: int, error: str) -> dict:
    return {"case": dataclasses.asdict(case), "label": case.label(), "seed": seed, "pass": False, "error": error}


def write_section(records: list[dict], out_dir: str, command: str, note: str | None = None) -> tuple[str, str]:
    """``layers.md`` and ``layers.json`` in ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    md, js = os.path.join(out_dir, "layers.md"), os.path.join(out_dir, "layers.json")
    failures = sum(not r["pass"] for r in records)
    lines = ["# The Flax Qwen3.8-Flash-Next QSA layer against the upstream PyTorch layer", "",
             f"Command: `{command}`", ""]
    if note:
        lines += [note, ""]
    lines += summary_lines(records) + ["", f"{len(records)} cases, {failures} failing."]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(js, "w") as f:
        json.dump({"command": command, "note": note, "failures": failures, "cases": records}, f, indent=1)
    return md, js


def summary_lines(records: list[dict]) -> list[str]:
    """A markdown table: route agreement, forced and free-running worst errors per case."""
    lines = ["| case | rows | identical | ties | rounding | unexplained | forced worst (tol) | free out (same routes) "
             "| result |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['label']} | - | - | - | - | - | - | - | FAIL: {r['error'][:200]} |")
            continue
        a, f, fr = r["routes"], r["forced"], r["free"]
        worst = max(f["errors"], key=f["errors"].get)
        lines.append(
            f"| {r['label']} | {a['rows']} | {a['identical']} | {a['tie_explained']} | "
            f"{a.get('rounding_explained', 0)} | {a['unexplained']} | "
            f"{f['errors'][worst]:.2e} {worst} ({f['tolerance']:g}) | {fr['out_same_route_rows']:.2e} | "
            f"{'PASS' if r['pass'] else 'FAIL'} |")
    ties = [(r["label"], e) for r in records if "routes" in r for e in r["routes"]["examples"][:1]]
    if ties:
        lines += ["", "Tie checks (upstream scores of the swapped blocks = the score at the cut):", ""]
        for label, e in ties:
            lines.append(f"- {label} row {e['row']}: upstream kept {e['upstream_only']}, port kept {e['port_only']}; "
                         f"cut {e['cut']!r}, swapped {e['swapped_scores']}")
    rounding = [(r["label"], e) for r in records if "routes" in r for e in r["routes"].get("rounding_examples", [])[:1]]
    if rounding:
        lines += ["", "Rounding checks (each side's choice right for its own inputs within float32 evaluation "
                      "error `beta`; the inputs at most one ulp of a 16-bit model dtype apart, or in float32 "
                      "moving the scores by at most `beta`):", ""]
        for label, e in rounding:
            lines.append(f"- {label} row {e['row']}: upstream kept {e['upstream_only']}, port kept {e['port_only']}; "
                         f"input ulps {e['input_ulps']:g}, upstream exact {e['upstream_exact_scores']}, "
                         f"port exact {e['exact_scores']}")
    fails = [(r["label"], e) for r in records if "routes" in r for e in r["routes"]["failures"][:2]]
    if fails:
        lines += ["", "Unexplained route differences (each names the checks it failed):", ""]
        lines += [f"- {label}: {e}" for label, e in fails]
    return lines


def _worker(argv=None) -> int:
    """``python -m parity.layers --cases JSON --seeds JSON``: one JSON record per line."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m parity.layers")
    parser.add_argument("--cases", required=True, help="a JSON list of LayerCase fields")
    parser.add_argument("--seeds", required=True, help="a JSON list of seeds, one per case")
    parser.add_argument("--implementation")
    args = parser.parse_args(argv)
    for fields, seed in zip(json.loads(args.cases), json.loads(args.seeds)):
        case = LayerCase(**dict(fields, lengths=tuple(fields["lengths"])))
        try:
            record = run_case(case, seed, implementation=args.implementation)
        except Exception as err:  # noqa: BLE001 - reported, never hidden
            record = _error_record(case, seed, f"{type(err).__name__}: {err}")
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
