"""``use_qsa_torch`` inside nemo-automodel's Qwen3.8-Flash-Next (CPU; the optional ``upstream`` extra).

A small upstream QSA layer (hidden 256, 4/2 heads, D 64, indexer 2 x 32, budget 32,
ratio 4) and a two-layer stack of upstream decoder layers run with and without
``use_qsa_torch(..., backend="reference")``: outputs, the input gradient and every
trainable parameter's gradient agree (fp32 1e-5, bf16 1e-2 relative) in the padded,
packed and context-parallel (2 gloo ranks) layouts, under activation checkpointing
with route replay and under ``torch.compile``. The tensors the layer hands to the
dispatch are also checked against the float64 oracle, and an op counter proves that
``qsa::sparse_gqa_attention`` ran and upstream's oracle did not.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import inspect
import logging
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from qsa_common.generators import adversarial_routes
from qsa_common.oracle import oracle_forward_backward, relative_error

UPSTREAM = "nemo_automodel.components.models.qwen3_8_flash_next"
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2]}
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, indexer_n_heads=2,
             indexer_head_dim=32, indexer_budget=32, indexer_compress_ratio=4, rope_parameters=ROPE,
             num_hidden_layers=2, layer_types=["full_attention"] * 2, vocab_size=512, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64, hc_count=2,
             hc_lowrank=16)
PADDED_LENGTHS = (150, 97)  # S = 150 (not a multiple of 4), second row right-padded
PACKED_BOUNDS = (0, 61, 150, 230)  # three documents in one row of 230 tokens


# ------------------------------------------------------------------ building blocks
def upstream_module(name: str):
    return importlib.import_module(f"{UPSTREAM}.{name}")


def small_config(dtype: str, **overrides):
    config = upstream_module("config").Qwen3_8_FlashNextTextConfig
    return config(**{**SMALL, "dtype": dtype, **overrides})


def qsa_layer(config, dtype: str, seed: int = 0):
    """One upstream QSA attention layer; fp32 cast whole, bf16 as upstream builds it."""
    import torch

    backend = upstream_module("backend").Qwen3_8_FlashNextBackendConfig(attn="flex")
    torch.manual_seed(seed)
    layer = upstream_module("layers").Qwen3_8_FlashNextQSAAttention(config, 1, backend)
    layer.init_weights(torch.device("cpu"))
    with torch.no_grad():  # q/k norms start at zero: make them matter
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.normal_(0, 0.3)
    return layer.float() if dtype == "float32" else layer


def rotary(config, positions, dtype):
    """Upstream's freqs_cis [B, S, r] for positions [B, S] (text: three equal mRoPE streams)."""
    import torch
    from nemo_automodel.components.models.qwen3_5_moe.model import Fp32SafeQwen3_5MoeTextRotaryEmbedding

    rope = Fp32SafeQwen3_5MoeTextRotaryEmbedding(config=config)
    probe = torch.empty(0, dtype=getattr(torch, dtype))
    cos, sin = rope(probe, positions[None].expand(3, -1, -1))
    half = cos.shape[-1] // 2
    return torch.cat((cos[..., :half], sin[..., :half]), dim=-1)


def layout_inputs(config, layout: str, dtype: str, seed: int = 1):
    """(x [B,S,hidden], grad_out, layer kwargs) for the padded or packed layout."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    if layout == "padded":
        batch, seq = len(PADDED_LENGTHS), PADDED_LENGTHS[0]
        positions = torch.arange(seq).expand(batch, -1)
        mask = (positions < torch.tensor(PADDED_LENGTHS)[:, None]).long()
        kwargs = {"attention_mask": mask}
    else:
        batch, seq = 1, PACKED_BOUNDS[-1]
        bounds = torch.tensor(PACKED_BOUNDS)
        doc = torch.searchsorted(bounds[1:], torch.arange(seq), right=True)
        positions = (torch.arange(seq) - bounds[doc])[None]  # document-relative
        kwargs = {"cu_seqlens": bounds.to(torch.int32)}
    x = torch.randn(batch, seq, config.hidden_size, generator=gen).to(tdtype)
    grad = torch.randn(batch, seq, config.hidden_size, generator=gen).to(tdtype)
    return x, grad, {"freqs_cis": rotary(config, positions, dtype), **kwargs}


def train_step(module, x, grad, **kwargs) -> dict[str, np.ndarray]:
    """Forward + backward; float64 numpy of the output, dx and every trainable grad."""
    import torch

    module.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    out = module(leaf, **kwargs)
    out = getattr(out, "last_hidden_state", out)
    out.backward(grad)
    result = {"out": out, "dx": leaf.grad}
    for name, param in module.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, f"{name} got no gradient"
            result[f"grad/{name}"] = param.grad
        else:
            assert param.grad is None, f"frozen {name} got a gradient"
    return {k: v.detach().cpu().to(torch.float64).numpy() for k, v in result.items()}


def assert_same(got: dict, want: dict, dtype: str, label: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert np.abs(want[name]).max() > 0, f"{label} {name}: all zero (the comparison could not fail)"
        err = relative_error(got[name], want[name])
        assert err < TOLERANCE[dtype], f"{label} {name}: relative error {err:.2e} ({dtype})"


class OpCounter:
    """Counts calls of ``qsa::*`` custom ops (forward and backward) through a dispatch mode;
    ``lengths`` holds (S_q, S_kv) of every forward call."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()
        lengths = self.lengths = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "qsa":
                    counts[func._opname] += 1
                    if func._opname == "sparse_gqa_attention":
                        lengths.append((args[0].shape[1], args[1].shape[1]))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@contextlib.contextmanager
def count_calls(monkeypatch, module, name):
    """Wrap ``module.name`` with a call counter (a one-element list)."""
    calls = [0]
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    yield calls
    monkeypatch.setattr(module, name, original)


@pytest.fixture(scope="module")
def upstream():
    pytest.importorskip(f"{UPSTREAM}.layers", reason="needs the optional 'upstream' extra (nemo-automodel)")
    import torch

    from qsa_torch.integrations import nemo_automodel

    # these shapes are tiny: intra-op threads only contend (30x slower on 2 cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield nemo_automodel
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------- tests
def test_importing_qsa_torch_and_the_integration_leaves_nemo_automodel_alone():
    code = ("import sys, qsa_torch, qsa_torch.integrations, qsa_torch.integrations.nemo_automodel\n"
            "assert 'nemo_automodel' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_matches_upstream_and_runs_our_op(upstream, monkeypatch, layout, dtype):

    qsa = upstream_module("qsa")
    config = small_config(dtype)
    layer = qsa_layer(config, dtype)
    x, grad, kwargs = layout_inputs(config, layout, dtype)
    cls = upstream_module("layers").Qwen3_8_FlashNextQSAAttention

    with count_calls(monkeypatch, qsa, "gathered_qsa_gqa_attention") as oracle, OpCounter() as ops:
        want = train_step(layer, x, grad, **kwargs)
    assert oracle[0] > 0 and not ops.counts
    with count_calls(monkeypatch, qsa, "gathered_qsa_gqa_attention") as oracle, OpCounter() as ops:
        with upstream.use_qsa_torch(layer, backend="reference") as route:
            assert route.layers == (layer,) and route.active
            got = train_step(layer, x, grad, **kwargs)
    assert oracle[0] == 0, "upstream's oracle ran under the route"
    assert ops.counts == {"sparse_gqa_attention": 1, "sparse_gqa_attention_backward": 1}, ops.counts
    assert_same(got, want, dtype, f"{layout}/{dtype}")

    # restored: the class's methods again, and upstream's exact numbers
    assert not route.active and "forward" not in vars(layer) and "_select_routes" not in vars(layer)
    assert layer.forward.__func__ is cls.forward and layer._select_routes.__func__ is cls._select_routes
    again = train_step(layer, x, grad, **kwargs)
    np.testing.assert_array_equal(again["out"], want["out"])
    assert_same(again, want, dtype, "restored")  # gradients: CPU scatter-adds in any order

    # upstream counts a duplicate ID twice, the contract once: the indexer emits none
    routes = layer.indexer(x, freqs_cis=kwargs["freqs_cis"], attention_mask=kwargs.get("attention_mask"),
                           cu_seqlens=kwargs.get("cu_seqlens"))
    for row in routes.reshape(-1, routes.shape[-1]):
        valid = row[row >= 0]
        assert valid.unique().numel() == valid.numel()
    assert (routes == -1).any() and (routes >= 0).any()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_triton_backend_in_the_interpreter(upstream, layout):
    """The backend "auto" picks on Hopper, on the layer's real calls (interpreted on CPU)."""
    pytest.importorskip("triton", reason="needs triton (the 'test' extra)")
    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    x, grad, kwargs = layout_inputs(config, layout, "float32")
    want = train_step(layer, x, grad, **kwargs)
    with OpCounter() as ops, upstream.use_qsa_torch(layer, backend="triton"):
        got = train_step(layer, x, grad, **kwargs)
    assert ops.counts == {"triton_sparse_gqa_attention": 1, "triton_sparse_gqa_attention_backward": 1}, ops.counts
    assert_same(got, want, "float32", f"triton {layout}")


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_decoder_stack_matches_upstream(upstream, layout):
    """Two upstream decoder layers (QSA attention + MoE + hyper-connections), one call routes both."""
    import torch

    model_cls = upstream_module("model").Qwen3_8_FlashNextTextModelBackend
    backend = upstream_module("backend").Qwen3_8_FlashNextBackendConfig(attn="flex")
    torch.manual_seed(0)
    model = model_cls(small_config("float32"), backend)
    model.init_weights(torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    if layout == "padded":
        ids = torch.randint(0, SMALL["vocab_size"], (2, PADDED_LENGTHS[0]), generator=gen)
        kwargs = {"attention_mask": (torch.arange(ids.shape[1]) < torch.tensor(PADDED_LENGTHS)[:, None]).long()}
    else:
        ids = torch.randint(0, SMALL["vocab_size"], (1, PACKED_BOUNDS[-1]), generator=gen)
        kwargs = {"cu_seqlens": torch.tensor(PACKED_BOUNDS, dtype=torch.int32)}
    grad = torch.randn(*ids.shape, SMALL["hidden_size"], generator=gen)

    def step():
        model.zero_grad(set_to_none=True)
        # upstream torch.compiles its MoE activation: run it eagerly here (no inductor warm-up)
        with torch.compiler.set_stance("force_eager"):
            out = model(ids, **kwargs).last_hidden_state
            out.backward(grad)
        grads = {f"grad/{n}": p.grad for n, p in model.named_parameters() if p.requires_grad}
        return {k: v.detach().double().numpy() for k, v in {"out": out, **grads}.items()}

    want = step()
    with OpCounter() as ops, upstream.use_qsa_torch(model, backend="reference") as route:
        assert len(route.layers) == 2
        got = step()
    assert ops.counts == {"sparse_gqa_attention": 2, "sparse_gqa_attention_backward": 2}, ops.counts
    assert_same(got, want, "float32", f"decoder stack {layout}")


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_activation_checkpointing_replays_routes(upstream, selective):
    """Upstream's checkpoint hook (``nemo_checkpoint_context_fn``) keeps working: the
    indexer runs once per step, the recompute replays its routes through our op."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    layers = upstream_module("layers")
    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    x, grad, kwargs = layout_inputs(config, "padded", "float32")
    policy = lambda ctx, op, *args, **kw: CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731
    base = (lambda: create_selective_checkpoint_contexts(policy)) if selective else None
    context_fn = layers.qsa_route_replay.checkpoint_context_fn(base)
    indexer_calls = []
    layer.indexer.register_forward_hook(lambda *_: indexer_calls.append(1))

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = layer

        def forward(self, x, **kw):
            return checkpoint(lambda t: self.inner(t, **kw), x, use_reentrant=False, context_fn=context_fn)

    want = train_step(layer, x, grad, **kwargs)
    indexer_calls.clear()
    with OpCounter() as ops, upstream.use_qsa_torch(layer, backend="reference"):
        got = train_step(Checkpointed(), x, grad, **kwargs)
    assert len(indexer_calls) == 1, f"indexer ran {len(indexer_calls)} times in one checkpointed step"
    assert ops.counts["sparse_gqa_attention"] == 2  # forward and recompute
    assert_same({k.replace("inner.", ""): v for k, v in got.items()}, want, "float32", "checkpointed")


def test_torch_compile_has_no_graph_break_at_our_op(upstream):
    """With the routes given (route replay), the whole routed layer forward compiles
    with fullgraph=True and contains our op; the full layer's graph breaks are all in
    upstream's indexer (qsa.py: host syncs in right_padded_sequence_lengths and
    select_qsa_token_ids), none in its layer forward or in qsa_torch. A route installed
    after torch.compile takes effect (dynamo guards the layer's forward)."""
    import torch
    import torch._dynamo
    from nemo_automodel.components.distributed.recompute_replay import RecomputeReplayRecorder

    qsa = upstream_module("qsa")
    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    x, grad, kwargs = layout_inputs(config, "padded", "float32")
    want = train_step(layer, x, grad, **kwargs)
    with upstream.use_qsa_torch(layer, backend="reference"):
        explained = torch._dynamo.explain(layer)(x, **kwargs)
        torch._dynamo.reset()
        where = [(r.user_stack[-1].filename, r.user_stack[-1].name) for r in explained.break_reasons]
        assert explained.graph_break_count > 0  # upstream's indexer
        assert all(f.endswith(os.path.join("qwen3_8_flash_next", "qsa.py")) for f, _ in where), where

        selection = layer._select_routes(x, freqs_cis=kwargs["freqs_cis"], attention_mask=kwargs["attention_mask"],
                                         cp_context=None, packed_cu_seqlens=None)
        assert selection.flex_mask is None
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(layer, fullgraph=True, backend=capture)
        recorder = RecomputeReplayRecorder()
        recorder.record(selection)
        with qsa.qsa_route_replay.scope(recorder, "replay"):
            got = train_step(compiled, x, grad, **kwargs)
        assert recorder.replay_misses == 0 and len(graphs) == 1
        targets = {str(node.target) for node in graphs[0].graph.nodes}
        assert "qsa.sparse_gqa_attention.default" in targets, targets
        torch._dynamo.reset()
    assert_same({k.replace("_orig_mod.", ""): v for k, v in got.items()}, want, "float32", "compiled")

    # a layer compiled before the route is installed picks it up, and drops it on restore
    compiled = torch.compile(layer, backend="aot_eager")
    train_step(compiled, x, grad, **kwargs)
    with OpCounter() as ops, upstream.use_qsa_torch(layer, backend="reference"):
        got = train_step(compiled, x, grad, **kwargs)
    assert ops.counts == {"sparse_gqa_attention": 1, "sparse_gqa_attention_backward": 1}, ops.counts
    with OpCounter() as ops:
        train_step(compiled, x, grad, **kwargs)
    assert not ops.counts
    torch._dynamo.reset()
    assert_same({k.replace("_orig_mod.", ""): v for k, v in got.items()}, want, "float32", "compiled first")


def test_dispatch_matches_float64_oracle(upstream):
    """What the layer hands to the dispatch (real indexer routes, trimmed int32, scale
    1/8), and adversarial routes in upstream's call signature, against the oracle."""
    import torch

    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    ours = upstream.qsa_torch_dispatch("reference", fallback=None)
    calls = []

    def capture(query, key, value, selected_token_ids, *, backend, softmax_scale=None, flex_mask=None):
        calls.append((query.detach(), key.detach(), value.detach(), selected_token_ids, softmax_scale, backend))
        return ours(query, key, value, selected_token_ids, backend=backend, softmax_scale=softmax_scale,
                    flex_mask=flex_mask)

    with upstream.route_qsa_attention(layer, capture):
        for layout in ("padded", "packed"):
            x, _, kwargs = layout_inputs(config, layout, "float32")
            layer(x, **kwargs)
        layer(x[:, :21], freqs_cis=kwargs["freqs_cis"][:, :21], cu_seqlens=torch.tensor([0, 13, 21]))
    (q, k, v, ids, scale, backend), (_, _, _, packed_ids, _, _), (_, _, _, short_ids, _, _) = calls
    # int32 IDs, width min(longest visible extent, budget + ratio - 1), scale passed, backend.attn
    assert ids.dtype == packed_ids.dtype == short_ids.dtype == torch.int32
    assert ids.shape[-1] == packed_ids.shape[-1] == SMALL["indexer_budget"] + 3 and short_ids.shape[-1] == 13
    assert scale == SMALL["head_dim"] ** -0.5 and backend == "flex"

    rng = np.random.default_rng()
    adversarial = np.stack([adversarial_routes(k.shape[1], width=24, rng=rng) for _ in range(k.shape[0])])
    for routes in (ids, torch.from_numpy(adversarial)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        do = torch.randn_like(q)
        out = ours(*leaves, routes, backend="flex", softmax_scale=scale, flex_mask=object())
        out.backward(do)
        expect = oracle_forward_backward(q.numpy(), k.numpy(), v.numpy(), routes.numpy(), scale, do.numpy())
        for name, a, e in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), expect):
            assert relative_error(a.detach().double().numpy(), e) < 1e-5, name


def _cp_worker(rank, world, init_file, out_dir):
    """One gloo rank: upstream's contiguous CP (K/V all-gathered by upstream, global routes)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    from qsa_torch.integrations.nemo_automodel import use_qsa_torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        context_cls = upstream_module("cp").Qwen3_8_FlashNextCPContext
        config = small_config("float32")
        layer = qsa_layer(config, "float32")
        x, grad, kwargs = layout_inputs(config, "padded", "float32")
        x, grad, kwargs = cp_inputs(x, grad, kwargs)
        local = x.shape[1] // world
        rows = slice(rank * local, (rank + 1) * local)
        context = context_cls(group=dist.group.WORLD, rank=rank, size=world,
                              global_input_ids=torch.zeros(x.shape[:2], dtype=torch.long),
                              global_padding_mask=kwargs["attention_mask"] == 0,
                              local_sequence_start=rank * local, local_sequence_length=local)
        results = {}
        for label, backend in (("upstream", None), ("qsa_torch", "reference")):
            route = use_qsa_torch(layer, backend) if backend else contextlib.nullcontext()
            with route, OpCounter() as ops:
                step = train_step(layer, x[:, rows], grad[:, rows], freqs_cis=kwargs["freqs_cis"][:, rows],
                                  cp_context=context)
            results.update({f"{label}|{name}": value for name, value in step.items()})
            results[f"{label}|lengths"] = np.array(ops.lengths).reshape(-1, 2)
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    finally:
        dist.destroy_process_group()


def cp_inputs(x, grad, kwargs, seq=128):
    """The padded case cut to ``seq`` tokens (CP needs S_local % 4 == 0), row 1 length 101."""
    mask = kwargs["attention_mask"][:, :seq].clone()
    mask[1, 101:] = 0
    return x[:, :seq], grad[:, :seq], {"freqs_cis": kwargs["freqs_cis"][:, :seq], "attention_mask": mask}


def test_context_parallel_two_gloo_ranks(upstream, tmp_path):
    import torch.multiprocessing as mp

    world = 2
    ctx = mp.start_processes(_cp_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail("CP workers did not finish in 180 s")
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]
    for rank, result in enumerate(ranks):
        # our op ran once per rank, on the local queries against upstream's gathered K/V
        assert result.pop("upstream|lengths").size == 0
        assert result.pop("qsa_torch|lengths").tolist() == [[64, 128]]
        split = {label: {k.split("|")[1]: v for k, v in result.items() if k.startswith(label)}
                 for label in ("upstream", "qsa_torch")}
        assert_same(split["qsa_torch"], split["upstream"], "float32", f"cp rank {rank}")

    # the ranks together are the single-process layer on the whole sequence
    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    x, grad, kwargs = cp_inputs(*layout_inputs(config, "padded", "float32"))
    with upstream.use_qsa_torch(layer, backend="reference"):
        whole = train_step(layer, x, grad, **kwargs)
    joined = {name: (np.concatenate([r[f"qsa_torch|{name}"] for r in ranks], axis=1) if name in ("out", "dx")
                     else sum(r[f"qsa_torch|{name}"] for r in ranks)) for name in whole}
    assert_same(joined, whole, "float32", "cp vs single process")


def test_auto_on_cpu_keeps_upstream_oracle(upstream, monkeypatch):
    qsa = upstream_module("qsa")
    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    x, grad, kwargs = layout_inputs(config, "packed", "float32")
    want = train_step(layer, x, grad, **kwargs)
    with count_calls(monkeypatch, qsa, "gathered_qsa_gqa_attention") as oracle, OpCounter() as ops:
        with upstream.use_qsa_torch(layer):
            got = train_step(layer, x, grad, **kwargs)
    assert oracle[0] == 1 and not ops.counts
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_dispatch_has_upstreams_signature(upstream):
    dispatch = upstream_module("layers").qsa_gqa_attention
    ours = upstream.qsa_torch_dispatch("auto", fallback=dispatch)
    strip = lambda fn: [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # noqa: E731
    assert strip(ours) == strip(dispatch)


def test_handle_lifecycle_and_errors(upstream, caplog):
    import torch

    layers = upstream_module("layers")
    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    for bad in ("nope", "Auto", None):
        with pytest.raises(ValueError, match="backend"):
            upstream.use_qsa_torch(layer, backend=bad)
    with pytest.raises(ValueError, match="backend"):
        upstream.qsa_torch_dispatch("nope", fallback=None)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        upstream.use_qsa_torch("model")
    with pytest.raises(ValueError, match="no Qwen3_8_FlashNextQSAAttention"):
        upstream.use_qsa_torch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="callable"):
        upstream.route_qsa_attention(layer, "reference")

    stack = torch.nn.ModuleList([layer, qsa_layer(config, "float32", seed=1)])
    with caplog.at_level(logging.INFO, logger="qsa_torch"):
        route = upstream.use_qsa_torch(stack, backend="reference")
    assert "2 Qwen3_8_FlashNextQSAAttention layer(s)" in caplog.text
    # no nesting: the model, or one of its layers, again
    for target in (stack, layer):
        with pytest.raises(RuntimeError, match="already routed"):
            upstream.use_qsa_torch(target, backend="triton")
    assert route.active and "active" in repr(route)
    route.restore()
    route.restore()  # harmless
    assert not route.active and "restored" in repr(route)
    assert all("forward" not in vars(m) for m in stack)
    with upstream.use_qsa_torch(layer, backend="reference"):  # fine again after restore
        pass

    # someone else's instance override: refused, and restore leaves a replaced method alone
    layer.forward = lambda *a, **k: None
    with pytest.raises(RuntimeError, match="own instance attribute 'forward'"):
        upstream.use_qsa_torch(layer)
    del layer.forward
    route = upstream.use_qsa_torch(layer)
    layer.forward = lambda *a, **k: None
    with pytest.raises(RuntimeError, match="replaced since"):
        route.restore()
    assert "_select_routes" not in vars(layer)  # the other method was restored
    del layer.forward

    class Custom(layers.Qwen3_8_FlashNextQSAAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    layer.__class__ = Custom
    with pytest.raises(RuntimeError, match="overrides forward"):
        upstream.use_qsa_torch(layer)


def test_copies_of_a_routed_layer(upstream, monkeypatch):
    """deepcopy keeps calling our op, torch.save/torch.load gives upstream's methods back;
    neither copy belongs to the handle, and each can be routed (and restored) afresh."""
    import copy
    import io

    import torch

    qsa = upstream_module("qsa")
    cls = upstream_module("layers").Qwen3_8_FlashNextQSAAttention
    config = small_config("float32")
    layer = qsa_layer(config, "float32")
    x, grad, kwargs = layout_inputs(config, "padded", "float32")
    want = train_step(layer, x, grad, **kwargs)
    route = upstream.use_qsa_torch(layer, backend="reference")

    copied = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for clone in (copied, loaded):
        assert clone is not layer and {"forward", "_select_routes"} <= vars(clone).keys()
        assert clone.forward.__self__ is clone
    assert loaded.forward.__func__ is cls.forward and loaded._select_routes.__func__ is cls._select_routes

    with count_calls(monkeypatch, qsa, "gathered_qsa_gqa_attention") as oracle, OpCounter() as ops:
        got = train_step(copied, x, grad, **kwargs)
    assert oracle[0] == 0 and ops.counts["sparse_gqa_attention"] == 1, ops.counts
    assert_same(got, want, "float32", "deepcopy")
    with count_calls(monkeypatch, qsa, "gathered_qsa_gqa_attention") as oracle, OpCounter() as ops:
        got = train_step(loaded, x, grad, **kwargs)
    assert oracle[0] > 0 and not ops.counts
    assert_same(got, want, "float32", "loaded")

    # the original is still routed by its handle; the copies are routable
    with pytest.raises(RuntimeError, match="already routed"):
        upstream.use_qsa_torch(layer)
    for clone in (copied, loaded):
        again = upstream.use_qsa_torch(clone, backend="reference")
        with pytest.raises(RuntimeError, match="already routed"):
            upstream.use_qsa_torch(clone)
        with OpCounter() as ops:
            got = train_step(clone, x, grad, **kwargs)
        assert ops.counts["sparse_gqa_attention"] == 1, ops.counts
        assert_same(got, want, "float32", "rerouted")
        again.restore()
        assert "forward" not in vars(clone) and "_select_routes" not in vars(clone)
    assert route.active and layer.forward.__func__ is not cls.forward
    route.restore()
    assert "forward" not in vars(layer) and "_select_routes" not in vars(layer)
    # a foreign method bound to the layer is still refused
    layer.forward = types.MethodType(lambda self, *a, **k: None, layer)
    with pytest.raises(RuntimeError, match="own instance attribute 'forward'"):
        upstream.use_qsa_torch(layer)
    del layer.forward

    # a copy of the handle owns nothing; the original still restores
    route = upstream.use_qsa_torch(layer, backend="reference")
    for twin in (copy.copy(route), copy.deepcopy(route)):
        assert not twin.active and twin.layers == ()
        twin.restore()
    with pytest.raises(TypeError, match="AttentionRoute cannot be pickled"):
        torch.save(route, io.BytesIO())
    assert route.active and "forward" in vars(layer)
    route.restore()
    assert "forward" not in vars(layer)

    # a routed layer dropped without restore() is freed (the registry holds no reference)
    import gc
    import weakref

    dropped = qsa_layer(config, "float32")
    upstream.use_qsa_torch(dropped, backend="reference")
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None


def test_unknown_upstream_versions(upstream, monkeypatch, caplog):
    layers = upstream_module("layers")
    layer = qsa_layer(small_config("float32"), "float32")

    monkeypatch.setattr(upstream.importlib.metadata, "version", lambda name: "9.9.9")
    with caplog.at_level(logging.WARNING, logger="qsa_torch"):
        upstream.use_qsa_torch(layer).restore()
    assert "nemo-automodel 9.9.9 has the expected layer and dispatch but was not checked" in caplog.text

    monkeypatch.delattr(layers, "qsa_gqa_attention")
    with pytest.raises(RuntimeError, match=r"installed nemo-automodel 9\.9\.9: .*no dispatch function"):
        upstream.use_qsa_torch(layer)
    monkeypatch.undo()

    def renamed(query, key, value, ids, *, backend, softmax_scale=None, flex_mask=None):
        raise AssertionError("never called")

    monkeypatch.setattr(layers, "qsa_gqa_attention", renamed)
    with pytest.raises(RuntimeError, match=r"nemo-automodel 0\.7\.0: .*is not the expected"):
        upstream.use_qsa_torch(layer)
    monkeypatch.undo()

    monkeypatch.setitem(sys.modules, f"{UPSTREAM}.layers", None)
    with pytest.raises(ImportError, match=r"qsa-kernels\[upstream\]"):
        upstream.use_qsa_torch(layer)


def test_gpu_benchmark_script_dry_run(upstream, tmp_path, monkeypatch):
    """scripts/gpu/bench_nemo_layer.py end to end on CPU (small layer, fp32), so that the
    H200 run does not fail on plumbing: every variant timed and compared with flex."""
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu", "bench_nemo_layer.py")
    spec = importlib.util.spec_from_file_location("bench_nemo_layer", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    layers = upstream_module("layers")
    builder = layers.build_flex_qsa_mask
    fa4 = upstream_module("fa4_qsa")
    preprocess = fa4._preprocess
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--qsa-backend", "reference",
                       "--cute-preprocess", "eager"]) == 0
    assert layers.build_flex_qsa_mask is builder  # the benchmark undid its instrumentation
    assert fa4._preprocess is preprocess  # and its eager preprocessing
    with bench.cute_preprocess("cute", "eager"):
        assert fa4._preprocess is preprocess._torchdynamo_orig_callable
    report = json.loads((tmp_path / "bench_nemo_layer.json").read_text())
    results = {r["variant"]: r for r in report["results"]}
    assert set(results) == {"flex", "cute", "qsa_torch"}
    for name, r in results.items():
        assert r["step_ms"] > 0 and r["breakdown_ms"]["attn_bwd"] > 0 and r["breakdown_ms"]["indexer"] > 0
        if name != "flex":  # on CPU every variant but ours runs upstream's oracle
            assert r["routes_identical"] and max(r["agreement"].values()) < 1e-5, r["agreement"]
    assert "sparse_gqa_attention: ran backend" not in " ".join(results["flex"]["qsa_torch_log"])
    assert results["cute"]["preprocess"] == "eager" and "preprocess" not in results["flex"]
    assert (tmp_path / "bench_nemo_layer.md").read_text().count("| 150 |") == 3
    assert "| 150 | cute (eager preprocessing) |" in (tmp_path / "bench_nemo_layer.md").read_text()


@pytest.mark.gpu
def test_auto_on_cuda_matches_upstream_flex_and_skips_its_mask(upstream):

    config = small_config(dtype="bfloat16")
    layer = qsa_layer(config, "bfloat16").cuda()
    x, grad, kwargs = layout_inputs(config, "padded", "bfloat16")
    kwargs = {k: v.cuda() for k, v in kwargs.items()}
    select = dict(freqs_cis=kwargs["freqs_cis"], attention_mask=kwargs["attention_mask"], cp_context=None,
                  packed_cu_seqlens=None)

    x, grad = x.cuda(), grad.cuda()
    assert layer._select_routes(x, **select).flex_mask is not None
    want = train_step(layer, x, grad, **kwargs)
    with OpCounter() as ops, upstream.use_qsa_torch(layer):
        assert layer._select_routes(x, **select).flex_mask is None
        got = train_step(layer, x, grad, **kwargs)
    assert ops.counts and set(ops.counts) <= {"sparse_gqa_attention", "sparse_gqa_attention_backward",
                                              "triton_sparse_gqa_attention",
                                              "triton_sparse_gqa_attention_backward"}
    assert_same(got, want, "bfloat16", "cuda auto vs flex")
