"""What the route unions take (torch Triton and JAX), and the two recipes side by side.

    python3 scripts/gpu/probe_unions.py --out DIR [--seq-lens 8192 32768 131072] [--overlaps 0.3 0.8]
        [--kv-scales 1 32 128] [--against OTHER_CHECKOUT]

Per S and overlap: QSA-format routes from the benchmark's generator (``parity.bench_routes``,
B=1, top_k 512; every head shares them), the default plan of (24,2) heads at D=256 bf16 on
this GPU. In a process of its own (``gpu_common.run_step``): CUDA-event medians (ms) of
torch's ``build_unions`` as the attention call runs it (unpadded, where the tree has ``padded``; the padded ones too),
its two stages apart (the step's tile unions, then their cut into programs, where the plan
cuts), its peak memory above the inputs, wall-clock medians of JAX's jitted ``build_unions``, and a
digest of the unions (counts, and the IDs and row bits up to each count) that must be
equal across trees and frameworks. ``--against`` runs the same step with another
checkout's modules (this script copied there: it uses only ``build_unions`` of both
frameworks). Then, in this tree, at S = the first length and overlap 0.8: the step's two
recipes (``rank_unions``, ``sorted_unions``) with the routes' IDs spread over ``scale * S``
K/V rows per ``--kv-scales`` entry: times, peak memory, equal up to the counts, and which
one ``qsa_triton.plan.rank_recipe`` picks. Writes ``probe_unions.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import Record, cuda_ms, jax_ms, log, step_result, timing_steps  # noqa: E402


CACHE = "/tmp/qsa-probe-routes"


def _routes(seq: int, overlap: float):
    """The routes of (S, overlap), generated once into ``CACHE`` (both trees' steps and the
    recipes read the same file)."""
    import numpy as np

    from parity.bench_routes import _make_routes, overlap_label

    path = os.path.join(CACHE, f"S{seq}-J{overlap}.npy")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npy"
        np.save(tmp, _make_routes(seq, overlap_label(overlap), 512, 0))
        os.replace(tmp, path)
    return np.load(path)


def _plan():
    from qsa_triton.config import default_block_sizes
    from qsa_triton.plan import make_plan

    import torch

    return make_plan(12, 256, default_block_sizes(torch.cuda.get_device_capability(), 256, "bfloat16"))


def _digest(union, count, rowbits) -> dict:
    """Counts and the entries up to each count, reduced to integers (torch tensors)."""
    import torch

    width = union.shape[-1]
    live = torch.arange(width, device=union.device) < count[..., None].long()
    weight = torch.arange(1, width + 1, device=union.device, dtype=torch.int64)
    return {"groups": int(count.numel()), "entries": int(count.long().sum()),
            "union": int((torch.where(live, union.long(), 0) * weight).sum()),
            "rowbits": int((torch.where(live, rowbits.long() & 0xFFFFFFFF, 0) * weight).sum())}


def _timing(seq: int, overlap: float) -> dict:
    import torch

    from qsa_torch import _triton_unions as unions

    routes = torch.from_numpy(_routes(seq, overlap)).to("cuda")
    plan = _plan()
    # the attention call's own unions (unpadded), where this tree builds them so
    own = {"padded": False} if "padded" in inspect.signature(unions.build_unions).parameters else {}
    build = lambda: unions.build_unions(routes, seq, plan, **own)  # noqa: E731
    got = build()
    result = {"shape": list(got.union.shape), "torch": _digest(got.union, got.count, got.rowbits),
              "unpadded": bool(own)}
    if own:
        result["torch_padded_ms"] = cuda_ms(lambda: unions.build_unions(routes, seq, plan))
    del got
    # the two stages apart: the step's tile unions, then their cut into programs
    from qsa_triton.plan import union_recipe

    step, cut = union_recipe(plan, seq, routes.shape[2], seq, routes.shape[0])
    tiles = lambda: unions.step_unions(routes, seq, step, plan.max_grid_y, padded=False)  # noqa: E731
    result["torch_tiles_ms"] = cuda_ms(tiles)
    if cut is not None:
        parents = tiles()
        result["torch_cut_ms"] = cuda_ms(lambda: unions.cut_unions(parents, cut, plan.max_grid_y, padded=False))
        del parents
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result["torch_ms"] = cuda_ms(build)
    result["torch_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    try:
        import jax
        import jax.numpy as jnp

        from qsa_jax import triton_qsa as jt

        jax_routes = jnp.asarray(routes.cpu().numpy().astype("int32"))
        fn = jax.jit(lambda r: jt.build_unions(r, seq, plan, **own))
        result["jax"] = _digest(*(torch.from_dlpack(x) for x in fn(jax_routes)))
        result["jax_ms"] = jax_ms(fn, jax_routes)
    except ImportError as err:
        result["jax"] = f"unavailable: {err}"
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.3, 0.8])
    parser.add_argument("--kv-scales", type=int, nargs="+", default=[1, 32, 128],
                        help="both recipes on the routes' IDs times each scale (S_kv = scale * S)")
    parser.add_argument("--against", help="another checkout whose build_unions runs beside this tree's")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--step", choices=["time"], help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--overlap", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        return step_result(_timing(args.seq, args.overlap))
    if not args.out:
        parser.error("--out is required")

    record = Record(os.path.join(args.out, "probe_unions.json"), args.budget_s)
    timing_steps(record, os.path.abspath(__file__), "build_unions", args.seq_lens, args.overlaps, args.timeout_s,
                 args.against)

    import torch

    from qsa_torch import _triton_unions as unions
    from qsa_triton.plan import rank_recipe, union_recipe

    seq = args.seq_lens[0]
    routes = torch.from_numpy(_routes(seq, 0.8)).to("cuda")
    plan = _plan()

    def recipes(scale):
        spread, kv = routes * scale, seq * scale
        step, _ = union_recipe(plan, seq, routes.shape[2], kv, routes.shape[0])
        ranked = unions.rank_unions(spread, kv, step)
        sorted_ = unions.sorted_unions(spread, kv, step)
        result = {"kv_per_route": kv / (step.rows * routes.shape[2]),
                  "picks_rank": rank_recipe(step, routes.shape[2], kv),
                  "equal": _digest(ranked.union, ranked.count, ranked.rowbits)
                  == _digest(sorted_.union, sorted_.count, sorted_.rowbits)}
        del ranked, sorted_
        for name, fn in (("rank", unions.rank_unions), ("sorted", unions.sorted_unions)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            result[f"{name}_ms"] = cuda_ms(lambda: fn(spread, kv, step))
            result[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        return result

    for scale in args.kv_scales:
        record.run(f"S={seq}/J=0.8", f"recipes_kv_x{scale}", lambda: recipes(scale))

    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
