"""The warp-specialized Hopper backward (``qsa_triton.backward_sm90``) beside
``backward.py``, on the same forward output, LSE and unions.

    python3 scripts/gpu/probe_backward_sm90.py --out DIR [--seq-lens 32768]

First correctness on small problems (B=2, (24,2) and (12,1) heads, bf16, QSA and
adversarial int64 routes, an unrouted K/V row holding inf/NaN): the kernel's
dQ/dK/dV against the float64 oracle and against ``backward.py``'s. Each step runs in a
subprocess with a time limit, since a kernel that hangs on an mbarrier would stall the
whole probe. Then, per S and overlap, both backward kernels alone: CUDA-event medians and
useful TFLOP/s (2.5x the forward's flops). ``--against DIR`` (a checkout of another
commit, e.g. ``git worktree add DIR main``) runs each timing step in that tree too, right
after this tree's, so two versions of the kernel are timed side by side in one run against
the same ``backward.py``. Writes ``probe_backward_sm90.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import Record, log, run_step, step_result  # noqa: E402


def _problem(seq, heads, kind, seed, device):
    import numpy as np
    import torch

    from parity.bench_routes import _make_routes, overlap_label
    from qsa_common.generators import adversarial_routes

    rng = np.random.default_rng(seed)
    if kind == "qsa":
        routes = np.concatenate([_make_routes(seq, overlap_label(0.8), 64, seed + i) for i in range(2)]).astype(np.int64)
    else:
        routes = np.stack([adversarial_routes(seq, width=96, rng=rng)[:seq] for _ in range(2)])
    routes[routes == 0] = -1  # nobody routes to K/V row 0
    hq, hkv = heads
    x = {n: rng.standard_normal((2, seq, h, 256)) for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("do", hq))}
    t = {n: torch.from_numpy(a).to(device, torch.bfloat16) for n, a in x.items()}
    t["k"][:, 0], t["v"][:, 0] = float("inf"), float("nan")
    return routes, x, t


def _run_both(t, routes, scale, group, device):
    """(sm90 grads, backward.py grads) on the default plan's forward and unions."""
    import torch

    from qsa_torch import _triton_launch as launcher
    from qsa_torch import _triton_unions as unions
    from qsa_triton import launch as spec
    from qsa_triton.config import DEFAULT_BLOCK_SIZES
    from qsa_triton.plan import make_plan

    plan = make_plan(group, 256, DEFAULT_BLOCK_SIZES)
    routes = torch.as_tensor(routes).to(device)
    tile = unions.build_unions(routes, t["k"].shape[1], plan)
    out, lse = launcher.forward(t["q"], t["k"], t["v"], tile, scale, plan)
    tile = unions.backward_unions(tile, plan, routes.shape[2], routes.shape[1])  # the forward's, for 128 pairs
    ops = [(tuple(x.shape), x.stride()) for x in (t["q"], t["k"], t["v"], out, t["do"])]
    launch = spec.backward_sm90_launch(plan, *ops, tuple(tile.union.shape), scale, "bfloat16")
    assert launch is not None, "the probe's shapes are in backward_sm90's scope"
    # MAXIMA is read by the deterministic kernels only (LSE stands in for it)
    arrays = dict(Q=t["q"], K=t["k"], V=t["v"], O=out, DO=t["do"], LSE=lse, UNION=tile.union, COUNT=tile.count,
                  ROWBITS=tile.rowbits, MAXIMA=lse)
    hopper = lambda: launcher.run(launch, arrays, device)  # noqa: E731
    # backward.py's own launch (launcher.backward takes the sm90 kernel on sm_90)
    generic_launch = spec.backward_launch(plan, *ops, tuple(tile.union.shape), scale, "bfloat16", interpreted=False)

    def generic():
        got = launcher.run(generic_launch, arrays, device)
        return got["DQ"], got["DK"], got["DV"]
    return hopper, generic


def _step(args) -> dict:
    """One probe step (in its own process)."""
    import torch

    from gpu_common import probe_shape
    from qsa_common.oracle import oracle_forward_backward, relative_error

    device = torch.device("cuda")
    if args.step == "check":
        heads = tuple(int(x) for x in args.heads.split("x"))
        routes, _, t = _problem(700, heads, args.kind, 1, device)
        hopper, generic = _run_both(t, routes, 0.0625, heads[0] // heads[1], device)
        h, g = hopper(), generic()
        torch.cuda.synchronize()
        ref = {n: t[n].double().cpu().numpy() for n in ("q", "k", "v", "do")}
        ref["k"][:, 0], ref["v"][:, 0] = 0.0, 0.0
        want = oracle_forward_backward(ref["q"], ref["k"], ref["v"], routes, 0.0625, ref["do"])[1:]
        got = (h["DQ"], h["DK"], h["DV"])
        return {name: {"oracle_sm90": relative_error(a.double().cpu().numpy(), w),
                       "oracle_generic": relative_error(b.double().cpu().numpy(), w),
                       "finite": bool(torch.isfinite(a).all())}
                for name, a, b, w in zip(("dq", "dk", "dv"), got, g, want)}
    shape = probe_shape(False, args.seq, [args.overlap])  # the benchmark's (24,2), D=256 problem
    t = dict(zip(("q", "k", "v", "do"), shape.inputs()))
    routes = shape.routes(args.overlap)
    useful = 2.5 * 4 * float((routes >= 0).sum()) * shape.heads[0] * shape.head_dim
    hopper, generic = _run_both(t, routes, shape.head_dim ** -0.5, shape.heads[0] // shape.heads[1], device)
    h, g = hopper(), generic()
    result = {"dq_rel_diff": float((h["DQ"].float() - g[0].float()).norm() / g[0].float().norm()),
              "dk_rel_diff": float((h["DK"] - g[1].float()).norm() / g[1].float().norm())}
    for name, fn in (("sm90", hopper), ("generic", generic)):
        ms = shape.timer(fn)
        result[f"{name}_ms"], result[f"{name}_tflops"] = ms, useful / ms / 1e9
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768])
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.3, 0.8])
    parser.add_argument("--timeout-s", type=float, default=90.0)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--skip-checks", action="store_true", help="the timing steps only")
    parser.add_argument("--against", help="another checkout whose kernels' timing steps run beside this tree's")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--heads", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--overlap", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        return step_result(_step(args))

    record = Record(os.path.join(args.out, "probe_backward_sm90.json"), args.budget_s)

    def sub(*extra, tree=None):
        return run_step(os.path.abspath(__file__), extra, args.timeout_s, tree)

    for heads, kind in () if args.skip_checks else (("24x2", "qsa"), ("24x2", "adversarial"), ("12x1", "qsa")):
        record.run("check", f"{heads}-{kind}", lambda: sub("--step", "check", "--heads", heads, "--kind", kind))
    for seq in args.seq_lens:
        for overlap in args.overlaps:
            step = ("--step", "time", "--seq", str(seq), "--overlap", str(overlap))
            record.run(f"S={seq}", f"J={overlap}", lambda: sub(*step))
            if args.against:
                record.run(f"S={seq}", f"J={overlap}/against", lambda: sub(*step, tree=args.against))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
