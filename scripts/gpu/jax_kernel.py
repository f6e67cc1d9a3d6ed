"""GPU check and timing of the JAX kernels (run on the H200 host).

    python3 scripts/gpu/jax_kernel.py --out $OUT [--check] [--time] [--sizes 8192,32768]
        [--check-implementations pallas,triton] [--configs triton,pallas] [--overlap 0.8]

--check: bf16 out/dq/dk/dv vs the XLA reference on padded, packed and CP layouts,
(24,2) and (12,1), D=256, QSA routes (top_k 512) and adversarial routes.
--time: forward and forward+backward medians of each implementation (Pallas under
several block configurations; ``triton``, the qsa_triton kernels through jax-triton,
needs ``source /tmp/qsa-site/env.sh``) and of dense causal cuDNN attention in the same
run, on QSA-format routes (with --overlap, the benchmark's routes at that adjacent-row
Jaccard target), B=1, (24,2), D=256.
Writes jax_kernel.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback

from gpu_common import jax_ms, log, relative_error  # noqa: E402  (puts the repository root on sys.path)

import numpy as np  # noqa: E402


def check(results, seq_len, heads_list=((24, 2), (12, 1)), dtype="bfloat16", implementation="pallas"):
    import functools

    import jax
    import jax.numpy as jnp

    from qsa_common.layouts import make_problem
    from qsa_jax import sparse_gqa_attention
    from qsa_jax.routes import prepare_routes
    from qsa_jax.xla_reference import reference_sparse_gqa_attention

    rng = np.random.default_rng(0)
    for heads in heads_list:
        for layout, fam in (("padded", "qsa"), ("packed", "qsa"), ("cp", "qsa"), ("packed", "adversarial")):
            name = f"{implementation}/{layout}/{fam}/{heads}/{dtype}"
            try:
                kw = dict(top_k=512) if fam == "qsa" else dict(width=256)
                prob = make_problem(layout, fam, seed=int(rng.integers(1 << 30)), seq_len=seq_len,
                                    batch=2, **kw)
                b, s_q = prob.routes.shape[:2]
                hq, hkv = heads
                key = jax.random.key(int(rng.integers(1 << 30)))
                k1, k2, k3, k4 = jax.random.split(key, 4)
                q = jax.random.normal(k1, (b, s_q, hq, 256), jnp.bfloat16)
                k = jax.random.normal(k2, (b, prob.kv_length, hkv, 256), jnp.bfloat16)
                v = jax.random.normal(k3, (b, prob.kv_length, hkv, 256), jnp.bfloat16)
                do = jax.random.normal(k4, (b, s_q, hq, 256), jnp.bfloat16)
                routes = jnp.asarray(prepare_routes(prob.routes))
                outs = {}
                # the reference runs in fp32 on the same bf16-rounded inputs
                kernel = functools.partial(sparse_gqa_attention, implementation=implementation)
                for impl, fn, dt in (("kernel", kernel, jnp.dtype(dtype)),
                                     ("xla", reference_sparse_gqa_attention, jnp.float32)):
                    # routes are a jit argument: as a closed-over constant XLA would
                    # constant-fold the route sorts for minutes
                    f = jax.jit(lambda q, k, v, do, r, fn=fn: (lambda o, vjp: (o, *vjp(do)))(
                        *jax.vjp(lambda a, b_, c: fn(a, b_, c, r, 1 / 16), q, k, v)))
                    args = [x.astype(dt) for x in (q, k, v, do)]
                    outs[impl] = [np.asarray(x.astype(jnp.float32)) for x in f(*args, routes)]
                errs = {n: relative_error(a, b_)
                        for n, a, b_ in zip(("out", "dq", "dk", "dv"), outs["kernel"], outs["xla"])}
                empty = ~np.any((prob.routes >= 0) & (prob.routes < prob.kv_length), axis=-1)
                zero_ok = bool(np.all(outs["kernel"][0][empty] == 0) and np.all(outs["kernel"][1][empty] == 0))
                ok = all(e < 1e-2 for e in errs.values()) and zero_ok
                results["check"][name] = dict(errors=errs, empty_rows=int(empty.sum()), empty_exact_zero=zero_ok, ok=ok)
                log(f"check {name}: {errs} empty={int(empty.sum())} zeros={zero_ok} {'PASS' if ok else 'FAIL'}")
            except Exception as err:  # keep going
                results["check"][name] = dict(error=repr(err), trace=traceback.format_exc()[-2000:])
                log(f"check {name}: ERROR {err!r}")


def timing(results, sizes, configs, overlap=None):
    import jax
    import jax.numpy as jnp

    from qsa_common.generators import qsa_format_routes
    from qsa_jax import sparse_gqa_attention
    from qsa_jax.pallas_qsa import BlockSizes

    hq, hkv, d = 24, 2, 256
    for s in sizes:
        t0 = time.time()
        if overlap is None:
            routes_np = qsa_format_routes(s, top_k=512, rng=np.random.default_rng(s))[None].astype(np.int32)
        else:  # the benchmark's routes (python -m parity.bench --overlaps, seed 0)
            from parity.bench_routes import _make_routes, overlap_label
            routes_np = _make_routes(s, overlap_label(overlap), 512, 0).astype(np.int32)  # [1, S, W]
        n_routes = int((routes_np >= 0).sum())
        log(f"S={s}: routes generated in {time.time() - t0:.1f}s, sum|R|={n_routes}")
        flops_fwd = 4.0 * n_routes * hq * d
        key = jax.random.key(s)
        k1, k2, k3, k4 = jax.random.split(key, 4)
        q = jax.random.normal(k1, (1, s, hq, d), jnp.bfloat16)
        k = jax.random.normal(k2, (1, s, hkv, d), jnp.bfloat16)
        v = jax.random.normal(k3, (1, s, hkv, d), jnp.bfloat16)
        do = jax.random.normal(k4, (1, s, hq, d), jnp.bfloat16)
        routes = jnp.asarray(routes_np)
        row = results["time"].setdefault(str(s), {"sum_routes": n_routes})

        def fwd_bwd(fn):
            def run(q, k, v, do, *rest):
                o, vjp = jax.vjp(lambda a, b_, c: fn(a, b_, c, *rest), q, k, v)
                return vjp(do)
            return jax.jit(run)

        try:
            dense = lambda a, b_, c: jax.nn.dot_product_attention(a, b_, c, is_causal=True, scale=1 / 16,
                                                                  implementation="cudnn")
            row["dense_fwd_ms"] = jax_ms(jax.jit(dense), q, k, v)
            row["dense_fwdbwd_ms"] = jax_ms(fwd_bwd(dense), q, k, v, do)
            log(f"S={s} dense cudnn: fwd {row['dense_fwd_ms']:.2f} ms, fwd+bwd {row['dense_fwdbwd_ms']:.2f} ms")
        except Exception as err:
            row["dense_error"] = repr(err)
            log(f"S={s} dense: ERROR {err!r}")
        for label, (implementation, cfg) in configs:
            try:
                bs = None if cfg is None else dataclasses.replace(BlockSizes.default(d, False), **cfg)
                fn = lambda a, b_, c, r, bs=bs, impl=implementation: sparse_gqa_attention(  # noqa: E731
                    a, b_, c, r, 1 / 16, implementation=impl, block_sizes=bs)
                entry = dict(implementation=implementation, config=cfg)
                entry["fwd_ms"] = jax_ms(jax.jit(fn), q, k, v, routes)
                entry["fwdbwd_ms"] = jax_ms(fwd_bwd(fn), q, k, v, do, routes, reps=5)
                entry["fwd_tflops"] = flops_fwd / entry["fwd_ms"] / 1e9
                entry["fwdbwd_tflops"] = 3.5 * flops_fwd / entry["fwdbwd_ms"] / 1e9
                stats = jax.devices()[0].memory_stats() or {}
                entry["peak_bytes"] = stats.get("peak_bytes_in_use")
                if "dense_fwdbwd_ms" in row:
                    entry["ratio_fwdbwd_to_dense"] = entry["fwdbwd_ms"] / row["dense_fwdbwd_ms"]
                    entry["ratio_fwd_to_dense"] = entry["fwd_ms"] / row["dense_fwd_ms"]
                row[label] = entry
                log(f"S={s} {label}: fwd {entry['fwd_ms']:.2f} ms "
                    f"({entry['fwd_tflops']:.0f} TFLOP/s), fwd+bwd {entry['fwdbwd_ms']:.2f} ms "
                    f"({entry['fwdbwd_tflops']:.0f} TFLOP/s) ratio {entry.get('ratio_fwdbwd_to_dense', float('nan')):.2f}")
            except Exception as err:
                row[label] = dict(config=cfg, error=repr(err), trace=traceback.format_exc()[-3000:])
                log(f"S={s} {label}: ERROR {err!r}")


# label -> (implementation, changes to the Pallas defaults, or None: the implementation's defaults)
CONFIGS = {
    "triton": ("triton", None),
    "pallas": ("pallas", None),
    "pallas-m64": ("pallas", dict(block_m_bwd=64)),
    "pallas-m128": ("pallas", dict(block_m_bwd=128)),  # the forward's geometry: unions shared
    "pallas-padded": ("pallas", dict(flatten_heads=False, block_m_bwd=64)),
    "pallas-m64-both": ("pallas", dict(block_m=64, block_m_bwd=64)),
    "pallas-k32": ("pallas", dict(block_m_bwd=64, block_k_bwd=32)),
    "pallas-k32s2": ("pallas", dict(block_m_bwd=64, block_k_bwd=32, num_stages_bwd=2)),
    "pallas-s3": ("pallas", dict(num_stages=3)),  # the forward's third stage
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="jax-kernel-out")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--check-len", type=int, default=8192)
    parser.add_argument("--heads", default="24:2,12:1", help="heads for --check, e.g. 12:1")
    parser.add_argument("--check-dtype", default="bfloat16", help="input dtype of the kernels' run in --check")
    parser.add_argument("--check-implementations", default="pallas", help="comma list of pallas,triton")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--sizes", default="8192,32768")
    parser.add_argument("--overlap", type=float, default=None,
                        help="--time on the benchmark's routes at this adjacent-row Jaccard target")
    parser.add_argument("--configs", default="triton,pallas", help=f"comma list of {','.join(CONFIGS)}")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import jax

    results = dict(jax=jax.__version__, overlap=args.overlap, devices=[str(d) for d in jax.devices()],
                   check={}, time={})
    log(results["jax"], results["devices"])
    try:
        if args.check:
            heads = [tuple(int(x) for x in h.split(":")) for h in args.heads.split(",")]
            for implementation in args.check_implementations.split(","):
                check(results, args.check_len, heads, args.check_dtype, implementation)
        if args.time:
            configs = [(c, CONFIGS[c]) for c in args.configs.split(",")]
            timing(results, [int(s) for s in args.sizes.split(",")], configs, args.overlap)
    finally:
        with open(os.path.join(args.out, "jax_kernel.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    log(json.dumps({k: v for k, v in results.items() if k == "time"}, indent=1)[:4000])


if __name__ == "__main__":
    main()
