"""Soak: training-like steps with changing shapes and layouts through the default paths.

    python3 scripts/gpu/soak.py --out $OUT [--steps 200] [--budget-s 225] [--seed 0]

Each step draws a layout (right-padded batch of 2, one packed row of 1-4 documents, or a
context-parallel shard: rank r of 2 with S/2 local rows against the whole K/V), a length
from ``--seq-lens`` and a head layout from ``--heads`` (D = 256, bf16, QSA-format routes,
top_k 512), fresh inputs and routes, then runs forward+backward through

* ``qsa_torch.sparse_gqa_attention`` (``backend="auto"``), eagerly, or on every
  ``--compile-every``-th step through one ``torch.compile(fullgraph=True)`` function
  shared by all steps (so shape changes recompile it);
* JAX's default ``qsa_jax.sparse_gqa_attention`` under ``jax.jit`` + ``jax.vjp`` (one
  compiled function per shape), on the same inputs through DLPack.

Every step checks the output and dq of 64 sampled rows against the torch reference (fp32,
on the GPU; dq of a row depends only on that row's routes and upstream gradient); every
``--full-check-every``-th step also dk and dv, from a second backward whose upstream
gradient is zero outside the sampled rows. Reported (``soak.json``, ``soak.md``): the
backends ``auto`` ran, dynamo's compiled graphs, JAX compilations, the worst errors,
every failure and exception (the first tracebacks in full), and memory: peak and
end-of-step ``torch.cuda.memory_allocated`` and JAX ``bytes_in_use``, first 50 steps
against the last 50 (a leak shows as growth of the end-of-step figures). Steps stop when
``--budget-s`` has passed (the summary says so). Exit status 1 on any failed check or
exception. ``--device cpu`` is a dry run of the plumbing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX next to torch

import numpy as np  # noqa: E402
from gpu_common import ROOT, log, relative_error  # noqa: E402
from long_context import torch_to_jax  # noqa: E402

TOLERANCE = 1e-2  # the contract's bf16 tolerance
SAMPLED_ROWS = 64


class _BackendLog(logging.Handler):
    """Collects the backends ``qsa_torch`` logs as run."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.ran: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "ran backend" in message:
            self.ran.append(message.split("ran backend ", 1)[1].replace("'", ""))


def draw_problem(rng: np.random.Generator, seq_lens, heads, top_k):
    from qsa_common.layouts import make_problem

    layout = str(rng.choice(["padded", "packed", "cp"]))
    s = int(rng.choice(seq_lens))
    hq, hkv = heads[int(rng.integers(len(heads)))]
    problem = make_problem(layout, "qsa", seed=int(rng.integers(2**31)), seq_len=s, top_k=top_k,
                           batch=2, world_size=2, rank=int(rng.integers(2)))
    return layout, (hq, hkv), problem


def jax_step_function(cache: dict, key):
    """``jit(vjp)`` of JAX's default for one shape (compiled once per key)."""
    import jax

    from qsa_jax import sparse_gqa_attention

    if key not in cache:
        scale = key[-1]

        def step(q, k, v, do, routes):
            out, pull = jax.vjp(lambda a, b, c: sparse_gqa_attention(a, b, c, routes, scale), q, k, v)
            return (out, *pull(do))

        cache[key] = jax.jit(step)
    return cache[key]


def from_jax(torch, a, device):
    return torch.from_numpy(np.array(a.astype("float32"))).to(device)


def run_step(i, args, rng, state) -> dict:
    """One training-like step; returns its record (errors go into it, never raised)."""
    import torch

    from qsa_torch import reference_sparse_gqa_attention, sparse_gqa_attention

    device = args.device
    layout, (hq, hkv), problem = draw_problem(rng, args.seq_lens, args.heads, args.top_k)
    b, s_q, _ = problem.routes.shape
    s_kv, d = problem.kv_length, args.head_dim
    scale = d**-0.5
    compiled = args.compile_every > 0 and i % args.compile_every == args.compile_every - 1
    full_check = args.full_check_every > 0 and i % args.full_check_every == 0
    entry = {"step": i, "layout": layout, "shape": [b, s_q, s_kv, hq, hkv, d, problem.routes.shape[2]],
             "torch": "compiled" if compiled else "eager", "failures": [], "exceptions": []}
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31)))
    draw = lambda *shape: torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)  # noqa: E731
    q, do = draw(b, s_q, hq, d), draw(b, s_q, hq, d)
    k, v = draw(b, s_kv, hkv, d), draw(b, s_kv, hkv, d)
    routes = torch.from_numpy(problem.routes).to(device)
    rows = torch.from_numpy(np.unique(rng.integers(0, s_q, SAMPLED_ROWS))).to(device)
    do_masked = torch.zeros_like(do)
    do_masked[:, rows] = do[:, rows]

    # the reference on the sampled rows (fp32): out, dq; dk, dv of the masked gradient
    rq = q[:, rows].float().requires_grad_(True)
    rk, rv = (t.float().requires_grad_(True) for t in (k, v))
    ref_out = reference_sparse_gqa_attention(rq, rk, rv, routes[:, rows], scale)
    ref_out.backward(do[:, rows].float())
    reference = {"out": ref_out.detach(), "dq": rq.grad, "dk": rk.grad, "dv": rv.grad}
    del rq, rk, rv, ref_out

    def check(label, out=None, dq=None, dk=None, dv=None):
        """Relative errors of what is given: out and dq on the sampled rows, dk and dv whole."""
        got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
        for name, want in reference.items():
            if got[name] is None:
                continue
            if name in ("out", "dq"):
                got[name] = got[name][:, rows]
            err = relative_error(got[name], want)
            entry.setdefault("errors", {})[f"{label} {name}"] = err
            if not err < TOLERANCE:
                entry["failures"].append(f"{label} {name}: {err:.3e}")

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    state["backend_log"].ran.clear()
    try:
        attention = state["compiled_attention"] if compiled else sparse_gqa_attention
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, routes, scale)
        out.backward(do)
        check("torch", out.detach(), leaves[0].grad)
        if full_check:
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            attention(*leaves, routes, scale).backward(do_masked)
            check("torch masked", dk=leaves[1].grad, dv=leaves[2].grad)
        del out, leaves
    except Exception as err:  # noqa: BLE001 -- a soak records errors and goes on
        entry["exceptions"].append(("torch", f"{type(err).__name__}: {err}"[:1000], traceback.format_exc()))
    entry["torch backends"] = sorted(set(state["backend_log"].ran))
    if device == "cuda":
        entry["torch peak bytes"] = torch.cuda.max_memory_allocated()

    if not args.skip_jax:
        try:
            import jax

            key = (b, s_q, s_kv, hq, hkv, d, problem.routes.shape[2], scale)
            known = len(state["jax_cache"])
            step = jax_step_function(state["jax_cache"], key)
            entry["jax compiled"] = len(state["jax_cache"]) > known
            jq, jk, jv, jdo, jdm, jr = (torch_to_jax(torch, t) for t in (q, k, v, do, do_masked, routes))
            out, dq, _, _ = step(jq, jk, jv, jdo, jr)
            check("jax", from_jax(torch, out, device), from_jax(torch, dq, device))
            if full_check:
                _, _, dk, dv = step(jq, jk, jv, jdm, jr)
                check("jax masked", dk=from_jax(torch, dk, device), dv=from_jax(torch, dv, device))
            jax.block_until_ready(out)
            del jq, jk, jv, jdo, jdm, jr, out, dq
        except Exception as err:  # noqa: BLE001
            entry["exceptions"].append(("jax", f"{type(err).__name__}: {err}"[:1000], traceback.format_exc()))
    reference.clear()  # frees the reference tensors (the check closure reads the dict)
    del q, k, v, do, do_masked, routes
    if device == "cuda":
        torch.cuda.synchronize()
        entry["torch end bytes"] = torch.cuda.memory_allocated()
    if not args.skip_jax:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_in_use" in stats:
            entry["jax end bytes"] = stats["bytes_in_use"]
    return entry


def summarize(steps: list[dict], state: dict, seconds: float) -> dict:
    from torch._dynamo.utils import counters

    def mean(key, part):
        values = [s[key] for s in part if key in s]
        return float(np.mean(values)) if values else None

    first, last = steps[:50], steps[-50:]
    memory = {}
    for key in ("torch peak bytes", "torch end bytes", "jax end bytes"):
        a, z = mean(key, first), mean(key, last)
        memory[key] = {"first 50 mean GiB": None if a is None else a / 2**30,
                       "last 50 mean GiB": None if z is None else z / 2**30,
                       "max GiB": max((s[key] for s in steps if key in s), default=0) / 2**30}
    worst: dict[str, float] = {}
    for s in steps:
        for name, err in s.get("errors", {}).items():
            worst[name] = max(worst.get(name, 0.0), err)
    backends: dict[str, int] = {}
    for s in steps:
        for name in s.get("torch backends", []):
            backends[name] = backends.get(name, 0) + 1
    return {
        "steps": len(steps), "seconds": round(seconds, 1),
        "failed steps": [s["step"] for s in steps if s["failures"] or s["exceptions"]],
        "failures": [f"step {s['step']}: {f}" for s in steps for f in s["failures"]][:50],
        "exceptions": [f"step {s['step']} {where}: {msg}"
                       for s in steps for where, msg, _ in s["exceptions"]][:50],
        "first tracebacks": [tb for s in steps for _, _, tb in s["exceptions"]][:3],
        "layouts": {k: sum(s["layout"] == k for s in steps) for k in ("padded", "packed", "cp")},
        "distinct shapes": len({tuple(s["shape"]) for s in steps}),
        "torch backends ran (steps)": backends,
        "torch compiled steps": sum(s["torch"] == "compiled" for s in steps),
        "dynamo compiled graphs": int(counters["stats"]["unique_graphs"] - state["graphs_before"]),
        "jax compilations": len(state["jax_cache"]),
        "worst errors": worst,
        "memory": memory,
    }


def write_markdown(path: str, summary: dict) -> None:
    lines = ["# Soak summary", ""]
    for key, value in summary.items():
        if key == "first tracebacks":
            continue
        lines.append(f"* **{key}**: `{value}`")
    for tb in summary["first tracebacks"]:
        lines += ["", "```", tb[-3000:], "```"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget-s", type=float, default=225.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-lens", default="2048,4096")
    parser.add_argument("--heads", default="12:1,24:2")
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=512)
    parser.add_argument("--compile-every", type=int, default=4)
    parser.add_argument("--full-check-every", type=int, default=10)
    parser.add_argument("--skip-jax", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    args.seq_lens = [int(x) for x in args.seq_lens.split(",")]
    args.heads = [tuple(int(x) for x in h.split(":")) for h in args.heads.split(",")]
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    import torch
    from torch._dynamo.utils import counters

    from qsa_torch import sparse_gqa_attention

    handler = _BackendLog()
    qsa_logger = logging.getLogger("qsa_torch")
    qsa_logger.addHandler(handler)
    qsa_logger.setLevel(logging.DEBUG)
    state = {"backend_log": handler, "jax_cache": {}, "graphs_before": counters["stats"]["unique_graphs"],
             "compiled_attention": torch.compile(
                 lambda q, k, v, r, scale: sparse_gqa_attention(q, k, v, r, scale), fullgraph=True)}
    rng = np.random.default_rng(args.seed)
    start, steps = time.time(), []
    for i in range(args.steps):
        if time.time() - start > args.budget_s:
            log(f"time budget reached after {i} steps")
            break
        entry = run_step(i, args, rng, state)
        steps.append(entry)
        flag = "FAIL" if entry["failures"] or entry["exceptions"] else "ok"
        log(f"[{time.time() - start:6.1f}s] step {i} {entry['layout']} {entry['shape']} {entry['torch']} "
            f"{entry.get('torch backends')} {flag} {entry['failures'][:2]} "
            f"{[e[1][:200] for e in entry['exceptions']]}")
    summary = summarize(steps, state, time.time() - start)
    if len(steps) < args.steps:
        summary["stopped"] = f"time budget: {len(steps)} of {args.steps} steps"
    summary["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    if args.device == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)
    import json

    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump({"summary": summary, "steps": [{k: v for k, v in s.items() if k != "exceptions"} | {
            "exceptions": [e[:2] for e in s["exceptions"]]} for s in steps]}, f, indent=1, default=str)
    write_markdown(os.path.join(args.out, "soak.md"), summary)
    log({k: v for k, v in summary.items() if k != "first tracebacks"})
    return 1 if summary["failed steps"] else 0


if __name__ == "__main__":
    sys.exit(main())
