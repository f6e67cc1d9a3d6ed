"""Where the route unions' time goes (torch Triton), and what a keys-only sort would take.

    python3 scripts/gpu/probe_unions.py --out DIR [--seq-lens 8192 32768] [--overlap 0.8] [--kv-scales 1 2 4 8]

Per S: QSA-format routes from the benchmark's generator (``parity.bench_routes``, B=1,
top_k 512, the given adjacent-row overlap), the default plan of (24,2) heads at D=256
bf16 on this GPU. CUDA-event medians (ms) of the whole ``build_unions`` and of its
pieces in order: the keys kernel, ``torch.sort`` of the keys (what ``sorted_unions``
runs: key/value pairs, the values being int64 indices nobody reads), the merge kernel,
the cut kernel. Then the same keys sorted by sorts that produce no indices: XLA's
``jnp.sort`` (what the JAX launcher runs) and, where cupy is installed, ``cupy.sort``;
each sorted copy is checked equal to torch's. Then both recipes of the step (the bitmap's
``bitmap_unions`` and ``sorted_unions``) with the routes' IDs spread over ``scale * S``
K/V rows for each ``--kv-scales`` entry: their times and peak memory, torch and
JAX, their unions checked equal, and which one ``qsa_triton.plan.bitmap_recipe`` picks
(the bitmap scans S_kv words per group, the sort orders rows * K keys: this locates the
crossover). Writes ``probe_unions.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import Record, cuda_ms, jax_ms, log  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--overlap", type=float, default=0.8)
    parser.add_argument("--kv-scales", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="both union recipes on the routes' IDs times each scale (S_kv = scale * S)")
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args(argv)

    import torch

    from parity.bench_routes import _make_routes, overlap_label
    from qsa_torch import _triton_launch as launcher
    from qsa_torch import _triton_unions as unions
    from qsa_triton import launch as spec
    from qsa_triton.config import default_block_sizes
    from qsa_triton.plan import bitmap_recipe, make_plan, union_recipe

    record = Record(os.path.join(args.out, "probe_unions.json"), args.budget_s, overlap=args.overlap)
    device = torch.device("cuda")
    blocks = default_block_sizes(torch.cuda.get_device_capability(), 256, "bfloat16")
    plan = make_plan(12, 256, blocks)
    for seq in args.seq_lens:
        routes = torch.from_numpy(_make_routes(seq, overlap_label(args.overlap), 512, 0)).to(device)
        step, cut = union_recipe(plan, seq, routes.shape[2], seq, 1)
        key = f"S={seq}"
        record.run(key, "recipe", lambda: {"sort_rows": step.rows, "groups": step.n_groups,
                                           "keys": step.rows * step.n_groups * routes.shape[2],
                                           "key_dtype": step.keys.dtype, "per_sort": step.keys.per_sort,
                                           "cut": cut is not None})
        record.run(key, "build_unions_ms", lambda: cuda_ms(lambda: unions.build_unions(routes, seq, plan)))
        keys_launch = spec.keys_launch(step, (tuple(routes.shape), routes.stride()), seq, plan.max_grid_y)
        make_keys = lambda: launcher.run(keys_launch, {"ROUTES": routes}, device)["KEYS"]  # noqa: E731
        keys = make_keys()
        record.run(key, "keys_kernel_ms", lambda: cuda_ms(make_keys))
        chunk = step.keys.per_sort * step.rows * routes.shape[2]
        record.run(key, "sorts_per_step", lambda: -(-keys.numel() // chunk))
        record.run(key, "torch_sort_ms", lambda: cuda_ms(lambda: torch.sort(keys[:chunk]).values)
                   * -(-keys.numel() // chunk))
        ordered = torch.cat([torch.sort(keys[i:i + chunk]).values for i in range(0, keys.numel(), chunk)])
        merge = spec.merge_launch(step, 1, routes.shape[2], interpreted=False)
        record.run(key, "merge_kernel_ms", lambda: cuda_ms(lambda: launcher.run(merge, {"KEYS": ordered}, device)))
        if cut is not None:
            parent = unions.sorted_unions(routes, seq, step, plan.max_grid_y)
            record.run(key, "cut_kernel_ms", lambda: cuda_ms(lambda: unions.cut_unions(parent, cut, plan.max_grid_y)))

        def recipes(scale):
            """Both recipes on the routes' IDs times ``scale`` (S_kv = scale * S): times,
            peak memory, the unions equal element for element, which one
            ``qsa_triton.plan.bitmap_recipe`` picks, and JAX's build_unions with either."""
            spread, kv = routes * scale, seq * scale
            step, _ = union_recipe(plan, seq, routes.shape[2], kv, 1)  # keys sized for this S_kv
            sorted_ = unions.sorted_unions(spread, kv, step, plan.max_grid_y)
            got = unions.bitmap_unions(spread, kv, step, plan.max_grid_y)
            equal = all(torch.equal(a, b) for a, b in zip((got.union, got.count, got.rowbits),
                                                          (sorted_.union, sorted_.count, sorted_.rowbits)))
            del sorted_, got
            result = {"kv_per_key": kv / (step.rows * routes.shape[2]), "equal": equal,
                      "picks_bitmap": bitmap_recipe(step, routes.shape[2], kv),
                      "window": spec.bitmap_window(step, 1, routes.shape[2], kv)}
            for name, fn in (("bitmap", unions.bitmap_unions), ("sorted", unions.sorted_unions)):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                result[f"{name}_ms"] = cuda_ms(lambda: fn(spread, kv, step, plan.max_grid_y))
                result[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            try:
                import jax
                import jax.numpy as jnp

                from qsa_jax import _triton_call
                jax_routes = jnp.asarray(spread.cpu().numpy())
                jl = _triton_call.default_launcher()
                for name, fn in (("bitmap", _triton_call.bitmap_unions), ("sorted", _triton_call.sorted_unions)):
                    build = jax.jit(lambda r, fn=fn: fn(r, kv, step, plan.max_grid_y, jl))
                    result[f"jax_{name}_ms"] = jax_ms(build, jax_routes)
            except ImportError as err:
                result["jax"] = f"unavailable: {err}"
            return result

        for scale in args.kv_scales:
            record.run(key, f"recipes_kv_x{scale}", lambda: recipes(scale))

        def jax_sort():
            import jax
            import jax.numpy as jnp

            flat = jnp.asarray(keys[:chunk].cpu().numpy())
            sort = jax.jit(jnp.sort)
            same = bool((torch.from_numpy(jax.device_get(sort(flat)).copy()).to(device) == ordered[:chunk]).all())
            return {"ms_per_step": jax_ms(sort, flat) * -(-keys.numel() // chunk), "equal": same}

        record.run(key, "jnp_sort", jax_sort)

        def cupy_sort():
            import cupy

            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                view = cupy.from_dlpack(keys[:chunk].clone())
                view.sort()
                same = bool((torch.from_dlpack(view) == ordered[:chunk]).all())

                def run():
                    cupy.sort(cupy.from_dlpack(keys[:chunk]))
                return {"ms_per_step": cuda_ms(run) * -(-keys.numel() // chunk), "equal": same}

        record.run(key, "cupy_sort", cupy_sort)
        del routes, keys, ordered
        torch.cuda.empty_cache()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
