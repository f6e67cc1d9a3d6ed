"""The warp-specialized Hopper forward (``qsa_triton.forward_sm90``) beside ``forward.py``.

    python3 scripts/gpu/probe_forward_sm90.py --out DIR [--seq-lens 32768 131072] [--overlaps 0.3 0.8]

First, correctness on small problems (B=2, (24,2) and (12,1) heads, bf16 and fp16, QSA
and adversarial routes, an unrouted K/V row holding inf/NaN): both kernels' O and LSE
against each other and O against the float64 oracle. Then, per S and overlap (QSA-format
routes from the benchmark's generator, B=1, (24,2), D=256, bf16, the default plan), the
two forward kernels alone on the same unions: CUDA-event medians, useful TFLOP/s, and
their largest differences, each (S, overlap) in its own process with a time limit.
``--against DIR`` (a checkout of another commit whose probe has ``--step``) runs each timing
step in that tree too, right after this tree's, so two versions of the kernel are timed
side by side in one run against the same ``forward.py``. Writes ``probe_forward_sm90.json``
under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import Record, log, step_result, timing_steps  # noqa: E402


def _both(q, k, v, routes, scale, group):
    """(sm90 O, LSE), (forward.py O, LSE) on the default plan's unions."""
    import torch

    from qsa_torch import _triton_launch as launcher
    from qsa_torch import _triton_unions as unions
    from qsa_triton import launch as spec
    from qsa_triton.config import default_block_sizes
    from qsa_triton.plan import make_plan

    blocks = default_block_sizes(torch.cuda.get_device_capability(), q.shape[3], launcher.dtype_name(q.dtype))
    plan = make_plan(group, q.shape[3], blocks)
    tile = unions.build_unions(routes, k.shape[1], plan)
    arrays = dict(Q=q, K=k, V=v, UNION=tile.union, COUNT=tile.count, ROWBITS=tile.rowbits)
    ops = [(tuple(x.shape), x.stride()) for x in (q, k, v)]
    hopper = spec.forward_sm90_launch(plan, *ops, tuple(tile.union.shape), scale, launcher.dtype_name(q.dtype))
    assert hopper is not None, "the probe's shapes are in forward_sm90's scope"
    generic = spec.forward_launch(plan, *ops, tuple(tile.union.shape), scale, launcher.dtype_name(q.dtype),
                                  interpreted=False)
    device = q.device
    return (lambda: launcher.run(hopper, arrays, device)), (lambda: launcher.run(generic, arrays, device))


def _timing(seq: int, overlap: float) -> dict:
    """Both kernels alone at (S, overlap): the benchmark's (24,2), D=256, bf16 problem and routes."""
    from gpu_common import probe_shape

    shape = probe_shape(False, seq, [overlap])
    q, k, v, _ = shape.inputs()
    routes = shape.routes(overlap)
    useful = 4 * float((routes >= 0).sum()) * shape.heads[0] * shape.head_dim
    hopper, generic = _both(q, k, v, routes, shape.head_dim ** -0.5, shape.heads[0] // shape.heads[1])
    h, g = hopper(), generic()
    result = {"max_abs_o_diff": (h["O"].float() - g["O"].float()).abs().max().item(),
              "max_abs_lse_diff": (h["LSE"] - g["LSE"]).abs().max().item()}
    del h, g
    for name, fn in (("sm90", hopper), ("generic", generic)):
        ms = shape.timer(fn)
        result[f"{name}_ms"] = ms
        result[f"{name}_tflops"] = useful / ms / 1e9
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.3, 0.8])
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--against", help="another checkout whose kernels' timing steps run beside this tree's")
    parser.add_argument("--step", choices=["time"], help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--overlap", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        return step_result(_timing(args.seq, args.overlap))
    if not args.out:
        parser.error("--out is required")

    import numpy as np
    import torch

    from parity.bench_routes import _make_routes, overlap_label
    from qsa_common.generators import adversarial_routes
    from qsa_common.oracle import oracle_forward_backward, relative_error
    from qsa_torch import _triton_launch as launcher

    record = Record(os.path.join(args.out, "probe_forward_sm90.json"), args.budget_s)
    device = torch.device("cuda")
    record.run("device", "hopper_forward", lambda: launcher.hopper_forward(device))

    def check(heads, dtype, routes_kind, seed):
        rng = np.random.default_rng(seed)
        bsz, seq, d = 2, 700, 256
        hq, hkv = heads
        if routes_kind == "qsa":
            routes = np.concatenate([_make_routes(seq, overlap_label(0.8), 64, s) for s in (seed, seed + 1)])
        else:
            routes = np.stack([adversarial_routes(seq, width=96, rng=rng)[:seq] for _ in range(bsz)])
        routes[routes == 0] = 1  # nobody routes to K/V row 0
        x = {n: rng.standard_normal((bsz, seq, h, d)).astype(np.float32)
             for n, h in (("q", hq), ("k", hkv), ("v", hkv))}
        tq, tk, tv = (torch.from_numpy(x[n]).to(device, dtype) for n in ("q", "k", "v"))
        tk[:, 0], tv[:, 0] = float("inf"), float("nan")
        troutes = torch.from_numpy(routes).to(device)  # int64: huge IDs stay padding
        scale = d ** -0.5
        hopper, generic = _both(tq, tk, tv, troutes, scale, hq // hkv)
        h, g = hopper(), generic()
        torch.cuda.synchronize()
        ref_in = [t.double().cpu().numpy() for t in (tq, tk, tv)]
        ref_in[1][:, 0], ref_in[2][:, 0] = 0.0, 0.0
        want = oracle_forward_backward(*ref_in, routes, scale, np.zeros_like(ref_in[0]))[0]
        lse_h, lse_g = h["LSE"], g["LSE"]
        finite = torch.isfinite(lse_g)
        return {"oracle_rel_err_sm90": relative_error(h["O"].double().cpu().numpy(), want),
                "oracle_rel_err_generic": relative_error(g["O"].double().cpu().numpy(), want),
                "max_abs_o_diff": (h["O"].float() - g["O"].float()).abs().max().item(),
                "o_finite": bool(torch.isfinite(h["O"]).all()),
                "lse_inf_same": bool(torch.equal(~finite, ~torch.isfinite(lse_h))),
                "max_abs_lse_diff": (lse_h[finite] - lse_g[finite]).abs().max().item()}

    for name, heads, dtype, kind, seed in (("24x2-bf16-qsa", (24, 2), torch.bfloat16, "qsa", 1),
                                           ("24x2-bf16-adversarial", (24, 2), torch.bfloat16, "adversarial", 2),
                                           ("12x1-fp16-qsa", (12, 1), torch.float16, "qsa", 3),
                                           ("12x1-bf16-adversarial", (12, 1), torch.bfloat16, "adversarial", 4)):
        record.run("correctness", name, lambda: check(heads, dtype, kind, seed))

    torch.cuda.empty_cache()
    timing_steps(record, os.path.abspath(__file__), "forward_kernels", args.seq_lens, args.overlaps, args.timeout_s,
                 args.against)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
