"""Where the time of the token-gather kernels goes, per kernel (run on the H200 host).

    python3 scripts/gpu/probe_kernels.py --out $OUT [--seq-len 32768] [--budget-s 420]

B=1, (24,2), D=256, bf16, QSA-format routes (top_k 512). Times separately, in one
process: dense causal attention (torch SDPA and JAX cuDNN), the route-union
preprocessing, the forward kernel alone and the backward kernel alone, for the torch
Triton backend and the JAX Pallas backend, under several launch configurations, and
each Triton backward once more with its dK/dV atomics masked off at run time (the
difference is what the atomics' memory traffic costs). JAX's ``no_atomics`` variant
drops the adds at trace time, so the compiler also drops the dK/dV dots: it times a
3-dot kernel, not the 5-dot one minus its atomics. Writes probe.json after every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

RESULTS: dict = {}
OUT = "."
DEADLINE = [float("inf")]


def log(*args):
    print(*args, flush=True)


def save():
    with open(os.path.join(OUT, "probe.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


def record(section, name, fn):
    """Run ``fn`` (returns a dict or float) under the time budget; store and save."""
    if time.time() > DEADLINE[0]:
        RESULTS.setdefault(section, {})[name] = "skipped: time budget"
        return
    t0 = time.time()
    try:
        value = fn()
    except Exception as err:  # keep going
        value = dict(error=repr(err), trace=traceback.format_exc()[-1500:])
    RESULTS.setdefault(section, {})[name] = value
    log(f"[{time.time() - t0:5.1f}s] {section}/{name}: {value if not isinstance(value, dict) or 'error' not in value else value['error']}")
    save()


def torch_part(routes_np, s, n_routes):
    import torch
    import triton.testing

    from qsa_torch import triton_qsa as tq

    dev = "cuda"
    hq, hkv, d = 24, 2, 256
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, s, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, s, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    routes = torch.as_tensor(routes_np, device=dev)
    bench = lambda f: float(triton.testing.do_bench(f, warmup=3, rep=60))  # noqa: E731
    flops = 4.0 * n_routes * hq * d

    def sdpa():
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        fwd = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                          enable_gqa=True))
        qr, kr, vr = (x.detach().requires_grad_() for x in (qt, kt, vt))
        o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
        dot = do.transpose(1, 2)
        bwd = bench(lambda: torch.autograd.grad(o, (qr, kr, vr), dot, retain_graph=True))
        return dict(fwd_ms=fwd, bwd_ms=bwd, fwdbwd_ms=fwd + bwd)

    record("torch", "sdpa_dense", sdpa)
    for t in (8,):
        def union(t=t):
            u = tq.build_tile_unions(routes, s, t)
            mean_u = float(u.count.float().mean())
            return dict(ms=bench(lambda: tq.build_tile_unions(routes, s, t)), mean_union=mean_u,
                        union_over_k=mean_u / (n_routes / s))
        record("torch", f"union_T{t}", union)

    def plan_for(**kw):
        # variants change the shipped defaults (not the dataclass's field defaults)
        return tq._make_plan(hq // hkv, d, dataclasses.replace(tq.DEFAULT_BLOCK_SIZES, **kw))

    fwd_cache = {}

    def fwd(**kw):
        plan = plan_for(**kw)
        unions = tq._unions_for(routes, s, plan)
        out, lse = tq._forward(q, k, v, unions, 1 / 16, plan, routes.shape[2])
        fwd_cache[plan.flat, plan.rows_per_tile, plan.union_rows] = (unions, out, lse)
        ms = bench(lambda: tq._forward(q, k, v, unions, 1 / 16, plan, routes.shape[2]))
        return dict(ms=ms, useful_tflops=flops / ms / 1e9, T=plan.rows_per_tile, HB=plan.fwd_heads,
                    union_ms=bench(lambda: tq._unions_for(routes, s, plan)))

    for name, kw in (("default", {}), ("padded", dict(flatten_heads=False)),
                     ("flat_backward", dict(flatten_heads=False, backward_flatten_heads=True))):
        record("torch_fwd_kernel", name, lambda kw=kw: fwd(**kw))

    top_k = routes.shape[2]

    @contextlib.contextmanager
    def options(**opts):
        saved = dict(tq.KERNEL_OPTIONS)
        tq.KERNEL_OPTIONS.update(opts)
        try:
            yield
        finally:
            tq.KERNEL_OPTIONS.update(saved)

    def unions(rows=8, **opts):
        with options(**opts):
            u = tq.build_tile_unions(routes, s, rows)
            return dict(build_ms=bench(lambda: tq.build_tile_unions(routes, s, rows)),
                        split_to_4_ms=bench(lambda: tq._split_tile_unions(u, 4, top_k, s)))

    record("torch_unions", "triton_kernels", unions)
    record("torch_unions", "torch_ops", lambda: unions(triton_unions=False))

    def bwd(skip=False, opts=None, **kw):
        plan = plan_for(**kw)
        if (plan.flat, plan.rows_per_tile, plan.union_rows) not in fwd_cache:
            fwd(**kw)
        unions, out, lse = fwd_cache[plan.flat, plan.rows_per_tile, plan.union_rows]
        run = lambda: tq._backward(q, k, v, out, lse, do, unions, 1 / 16, plan, top_k,  # noqa: E731
                                   skip_dkdv=skip)
        with options(**(opts or {})):
            ms = bench(run)
        return dict(ms=ms, useful_tflops=2.5 * flops / ms / 1e9, T=plan.backward_rows, HB=plan.bwd_heads)

    # default: flat programs of 128 pairs; padded: 4 rows x 16 heads, unions cut from
    # the forward's 8-row ones inside the timed call
    for name, kw in (("default", {}),
                     ("default_no_atomic_traffic", dict(skip=True)),
                     ("padded", dict(flatten_heads=False)),
                     ("flat_backward", dict(flatten_heads=False, backward_flatten_heads=True)),
                     ("lean", dict(opts=dict(lean_backward=True))),
                     ("lean_k32", dict(opts=dict(lean_backward=True), backward_block_k=32)),
                     ("lean_k32_s2", dict(opts=dict(lean_backward=True), backward_block_k=32,
                                          backward_num_stages=2))):
        record("torch_bwd_kernel", name, lambda kw=kw: bwd(**kw))

    def end_to_end(opts=None, **kw):
        blocks = dataclasses.replace(tq.DEFAULT_BLOCK_SIZES, **kw)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def step():
            for x in leaves:
                x.grad = None
            tq.triton_sparse_gqa_attention(*leaves, routes, 1 / 16, block_sizes=blocks).backward(do)

        with options(**(opts or {})):
            with torch.no_grad():
                fwd_ms = bench(lambda: tq.triton_sparse_gqa_attention(*leaves, routes, 1 / 16, block_sizes=blocks))
            return dict(fwd_ms=fwd_ms, fwdbwd_ms=bench(step))

    for name, kw in (("default", {}), ("torch_union_ops", dict(opts=dict(triton_unions=False))),
                     ("flat_keys_per_program", dict(opts=dict(flat_unions_from_tiles=False))),
                     ("lean_backward", dict(opts=dict(lean_backward=True))),
                     ("lean_backward_k32", dict(opts=dict(lean_backward=True), backward_block_k=32)),
                     ("flat_fwd_s2", dict(num_stages=2)),
                     ("flat_fwd_k32", dict(block_k=32)),
                     ("padded", dict(flatten_heads=False)),
                     ("flat_backward", dict(flatten_heads=False, backward_flatten_heads=True))):
        record("torch_end_to_end", name, lambda kw=kw: end_to_end(**kw))

    def api_op_pair():
        from qsa_torch import sparse_gqa_attention

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def step():
            for x in leaves:
                x.grad = None
            sparse_gqa_attention(*leaves, routes, 1 / 16, backend="triton").backward(do)

        return dict(fwdbwd_ms=bench(step))

    record("torch_end_to_end", "api_backend_triton", api_op_pair)


def jax_part(routes_np, s, n_routes):
    import jax
    import jax.numpy as jnp

    from jax_kernel import timed  # scripts/gpu/jax_kernel.py
    from qsa_jax import pallas_qsa as pq

    hq, hkv, d = 24, 2, 256
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k1, (1, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(k2, (1, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(k3, (1, s, hkv, d), jnp.bfloat16)
    do = jax.random.normal(k4, (1, s, hq, d), jnp.bfloat16)
    routes = jnp.asarray(routes_np.astype(np.int32))
    flops = 4.0 * n_routes * hq * d

    def dense():
        f = lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True, scale=1 / 16,  # noqa: E731
                                                         implementation="cudnn")
        g = jax.jit(lambda a, b, c, o: jax.vjp(f, a, b, c)[1](o))
        return dict(fwd_ms=timed(jax.jit(f), q, k, v), fwdbwd_ms=timed(g, q, k, v, do))

    record("jax", "cudnn_dense", dense)
    for name, kw in (("fwd_default", {}), ("fwd_padded", dict(flatten_heads=False))):
        def union(kw=kw):
            bs = dataclasses.replace(pq.BlockSizes.default(d, False), **kw)
            geo = pq._Geometry.make(hq // hkv, d, bs.block_m, bs.block_k, bs.flatten_heads)
            return timed(jax.jit(lambda r: pq._route_union(r, geo)), routes)
        record("jax", f"union_{name}", union)

    state = {}

    def fwd(**kw):
        bs = dataclasses.replace(pq.BlockSizes.default(d, False), **kw)
        geo = pq._Geometry.make(hq // hkv, d, bs.block_m, bs.block_k, bs.flatten_heads)
        union, bits, count = jax.jit(lambda r: pq._route_union(r, geo))(routes)
        call = jax.jit(lambda a, b, c, u, bt, ct: pq._forward_call(a, b, c, u, bt, ct, geo, 1 / 16, bs, False))
        o_arr, lse = call(q, k, v, union, bits, count)
        state["fwd"] = (o_arr, lse, geo)
        ms = timed(call, q, k, v, union, bits, count)
        return dict(ms=ms, useful_tflops=flops / ms / 1e9)

    for name, kw in (("default", {}), ("padded", dict(flatten_heads=False))):
        record("jax_fwd_kernel", name, lambda kw=kw: fwd(**kw))

    def bwd(no_atomics=False, **kw):
        bs = dataclasses.replace(pq.BlockSizes.default(d, False), **kw)
        geo = pq._Geometry.make(hq // hkv, d, bs.block_m_bwd, bs.block_k_bwd, bs.flatten_heads)
        union, bits, count = jax.jit(lambda r: pq._route_union(r, geo))(routes)
        n_rows = union.shape[1] * geo.block_m
        lse = jnp.zeros((1, hkv, n_rows), jnp.float32)
        delta = jnp.zeros((1, hkv, n_rows), jnp.float32)
        saved = pq.relaxed_addupdate  # looked up by the kernel body at trace time
        if no_atomics:
            pq.relaxed_addupdate = lambda *a, **k_: None
        try:
            call = jax.jit(lambda a, b, c, o, l_, dl, u, bt, ct: pq._backward_call(
                a, b, c, o, l_, dl, u, bt, ct, geo, 1 / 16, bs, False))
            jax.block_until_ready(call(q, k, v, do, lse, delta, union, bits, count))
        finally:
            pq.relaxed_addupdate = saved
        ms = timed(call, q, k, v, do, lse, delta, union, bits, count)
        return dict(ms=ms, useful_tflops=2.5 * flops / ms / 1e9, T=geo.rows)

    for name, kw in (("default", {}), ("default_no_atomics", dict(no_atomics=True)),
                     ("lean", dict(lean_backward=True)),
                     ("m64", dict(block_m_bwd=64)), ("padded", dict(flatten_heads=False, block_m_bwd=64))):
        record("jax_bwd_kernel", name, lambda kw=kw: bwd(**kw))

    def end_to_end(**kw):
        bs = dataclasses.replace(pq.BlockSizes.default(d, False), **kw)
        f = lambda a, b, c: pq.pallas_sparse_gqa_attention(a, b, c, routes, 1 / 16, block_sizes=bs)  # noqa: E731
        g = jax.jit(lambda a, b, c, o: jax.vjp(f, a, b, c)[1](o))
        return dict(fwd_ms=timed(jax.jit(f), q, k, v), fwdbwd_ms=timed(g, q, k, v, do))

    for name, kw in (("default", {}), ("lean", dict(lean_backward=True)), ("m64", dict(block_m_bwd=64))):
        record("jax_end_to_end", name, lambda kw=kw: end_to_end(**kw))


def main():
    global OUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe-out")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--parts", default="torch,jax")
    args = parser.parse_args()
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    DEADLINE[0] = time.time() + args.budget_s
    from qsa_common.generators import qsa_format_routes

    s = args.seq_len
    routes_np = qsa_format_routes(s, top_k=512, rng=np.random.default_rng(s))[None]
    n_routes = int((routes_np >= 0).sum())
    RESULTS["shape"] = dict(S=s, heads=[24, 2], D=256, sum_routes=n_routes)
    log(RESULTS["shape"])
    if "torch" in args.parts:
        torch_part(routes_np, s, n_routes)
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    if "jax" in args.parts:
        # torch's caching allocator keeps memory; JAX preallocates a fraction: keep both modest
        jax_part(routes_np, s, n_routes)
    save()


if __name__ == "__main__":
    main()
