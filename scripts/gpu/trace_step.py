"""torch's forward+backward step of the Triton backend under ``torch.profiler``: where a step's
time goes between kernels (host launch gaps) and in them.

    python3 scripts/gpu/trace_step.py --out DIR [--seq-len 8192] [--overlap 0.8] [--steps 4]

The benchmark's QSA routes, B=1, (24,2), D=256, bf16, ``triton_sparse_gqa_attention`` as
``python -m parity.bench`` times it (after a warm-up step). Writes ``trace.json.gz`` (Chrome
trace of the profiled steps) and ``trace_step.json``: per step its CUDA-event milliseconds,
the kernels' summed time, the GPU's idle time between the step's first and last kernel, and
the host's time from the step's start to its first kernel launch.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import probe_shape  # noqa: E402


def _steps(trace: dict, n_steps: int) -> list[dict]:
    """Per ``step`` annotation: its kernels (device timeline) and the launch gaps."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e.get("name") == "step" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])[:n_steps]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # torch launches through the runtime API (cudaLaunchKernel), Triton through the driver's (cuLaunchKernelEx)
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    out = []
    for s in steps:
        begin, end = s["ts"], s["ts"] + s["dur"]
        mine = [k for k in kernels if begin <= launches.get(k["args"].get("correlation"), k)["ts"] <= end]
        if not mine:
            continue
        busy = sum(k["dur"] for k in mine)
        span = mine[-1]["ts"] + mine[-1]["dur"] - mine[0]["ts"]
        first_launch = launches.get(mine[0]["args"].get("correlation"), mine[0])["ts"]
        out.append({
            "kernels": [(k["name"][:60], round(k["dur"] / 1e3, 4)) for k in mine],
            "kernel_ms": round(busy / 1e3, 4),
            "span_ms": round(span / 1e3, 4),
            "idle_ms": round((span - busy) / 1e3, 4),
            "host_to_first_launch_ms": round((first_launch - begin) / 1e3, 4),
            "host_step_ms": round(s["dur"] / 1e3, 4),
        })
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--overlap", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    shape = probe_shape(False, args.seq_len, [args.overlap])

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from qsa_torch.triton_qsa import triton_sparse_gqa_attention

    os.makedirs(args.out, exist_ok=True)
    q, k, v, do = shape.inputs()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    routes = shape.routes(args.overlap)
    scale = shape.head_dim ** -0.5

    def step():
        for t in leaves:
            t.grad = None
        triton_sparse_gqa_attention(*leaves, routes, scale).backward(do)

    step()
    torch.cuda.synchronize()
    event_ms = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        event_ms.append(round(start.elapsed_time(end), 4))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            torch.cuda.synchronize()
            with record_function("step"):
                step()
            torch.cuda.synchronize()
    raw = os.path.join(args.out, "trace.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)
    result = {"seq_len": args.seq_len, "overlap": args.overlap, "event_ms": event_ms,
              "steps": _steps(trace, args.steps)}
    with open(os.path.join(args.out, "trace_step.json"), "w") as f:
        json.dump(result, f, indent=1)
    for s in result["steps"]:
        print({k: v for k, v in s.items() if k != "kernels"})
    print("event ms", event_ms)
    if result["steps"]:
        print(*result["steps"][0]["kernels"], sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
