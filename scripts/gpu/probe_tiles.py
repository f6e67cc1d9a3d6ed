"""Tile heights across route overlap: torch Triton piece by piece under a few BlockSizes.

    python3 scripts/gpu/probe_tiles.py --out DIR [--seq-len 32768] [--overlaps 0.3 0.6 0.8 0.9]
        [--configs default flat64] [--budget-s 240] [--dry-run]

Issue 18 asks whether tile heights chosen from the routes' overlap beat the fixed default:
at low adjacent-row Jaccard a shorter program walks a less inflated union (its rows share
more of their routes) but adds dK/dV with twice the atomics per useful flop. Per overlap
(QSA-format routes from the benchmark's generator, B=1, (24,2), D=256, bf16) and per
configuration: the inflation of its programs (``qsa_common.route_stats``), CUDA-event
medians of the unions, the forward kernel and the backward kernel (the public residual
form of ``qsa_torch.triton_qsa``) and their sum, with the relative difference of out / dq /
dk / dv from the default configuration's (a wrong configuration must not look fast).
Writes ``probe_tiles.json`` under ``--out`` after every entry. ``--dry-run`` checks the
plumbing on CPU in Triton's interpreter (S=768, (6,1), D=32, top_k 4, one overlap, one
call timed by the wall clock).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import Record, log, probe_shape, relative_error  # noqa: E402


def configs(names):
    from qsa_triton.config import DEFAULT_BLOCK_SIZES

    table = {
        "default": DEFAULT_BLOCK_SIZES,
        "flat64": dataclasses.replace(DEFAULT_BLOCK_SIZES, block_m=64),
        # forward occupancy: 32-ID chunks in 4 stages (one CTA per SM); 64-pair programs of
        # 4 warps, whose forward CTAs fit two per SM (docs/benchmarks.md, fourth session)
        "k32s4": dataclasses.replace(DEFAULT_BLOCK_SIZES, block_k=32, num_stages=4),
        "flat64w4k32": dataclasses.replace(DEFAULT_BLOCK_SIZES, block_m=64, num_warps=4, block_k=32),
        "flat64w4k16": dataclasses.replace(DEFAULT_BLOCK_SIZES, block_m=64, num_warps=4, block_k=16, num_stages=4),
    }
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {sorted(table)}")
    ordered = sorted(dict.fromkeys(names), key=lambda name: name != "default")  # the reference runs first
    return {name: table[name] for name in ordered}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.3, 0.6, 0.8, 0.9])
    parser.add_argument("--configs", nargs="+", default=["default", "flat64"])
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    args = parser.parse_args(argv)
    chosen = configs(args.configs)
    # dry run: unions narrower than S (T * width < S), as at the GPU's sizes, so a wrong K shows
    shape = probe_shape(args.dry_run, args.seq_len, args.overlaps, dry_seq_len=768)
    heads, head_dim, top_k, device, timer = shape.heads, shape.head_dim, shape.top_k, shape.device, shape.timer
    args.seq_len, args.overlaps = shape.seq_len, shape.overlaps

    import torch

    from parity.bench_routes import _make_routes, overlap_label
    from qsa_common.route_stats import Tiling, route_stats
    from qsa_torch import triton_qsa

    record = Record(os.path.join(args.out, "probe_tiles.json"), args.budget_s, seq_len=args.seq_len,
                    heads=heads, head_dim=head_dim, configs={k: dataclasses.asdict(v) for k, v in chosen.items()})
    group = heads[0] // heads[1]
    q, k, v, do = shape.inputs()
    scale = head_dim ** -0.5
    tilings = tuple(Tiling(pairs=p) for p in sorted({b.block_m for b in chosen.values()}))
    for overlap in args.overlaps:
        routes_np = _make_routes(args.seq_len, overlap_label(overlap), top_k, 0)
        routes = torch.from_numpy(routes_np).to(device)
        width = routes.shape[2]  # K of the [B, S, K] routes (QSA format: 4 * top_k + 4)
        section = f"J={overlap}"
        stats = route_stats(routes_np, args.seq_len, groups=(group,), tilings=tilings,
                            first_row=min(4 * top_k + 3, args.seq_len - 1))
        record.run(section, "routes", lambda: {"jaccard": stats["jaccard"], "inflation": stats["inflation"][group]})
        kept = {}
        for name, blocks in chosen.items():
            def measure(name=name, blocks=blocks):
                with torch.no_grad():
                    out, lse, *unions = triton_qsa.forward_with_residuals(q, k, v, routes, scale, block_sizes=blocks)
                    grads = triton_qsa.backward_from_residuals(do, q, k, v, out, lse, *unions, scale, width,
                                                               block_sizes=blocks, deterministic=False)
                    ms = {
                        "unions": timer(lambda: triton_qsa.route_unions(q, k, routes, block_sizes=blocks)),
                        "forward_kernel": timer(lambda: triton_qsa.forward_from_unions(
                            q, k, v, *unions, scale, width, block_sizes=blocks)),
                        "backward_kernel": timer(lambda: triton_qsa.backward_from_residuals(
                            do, q, k, v, out, lse, *unions, scale, width, block_sizes=blocks,
                            deterministic=False)),
                    }
                kept[name] = (out, *grads)
                result = {"inflation": stats["inflation"][group][f"flat{blocks.block_m}"], "ms": ms,
                          "total_ms": sum(ms.values())}
                if name != "default" and "default" in kept:
                    result["vs_default"] = {label: relative_error(a.float(), b.float()) for label, a, b
                                            in zip(("out", "dq", "dk", "dv"), kept[name], kept["default"])}
                return result

            record.run(section, name, measure)
        del routes, kept
        torch.cuda.empty_cache()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
