"""Which launch configurations at head dim 256 read out of bounds (compute-sanitizer memcheck).

    python3 scripts/gpu/probe_chunks.py --out DIR [--cases NAME ...] [--timeout-s 200]

Triton 3.6 on the H200 reads past a backward program's shared memory in a ``tl.dot`` with
128-pair flat programs over 32-ID chunks at D=256 (docs/benchmarks.md; plans refuse it),
and ``scripts/gpu/probe_tiles.py`` met an illegal address with 64-pair programs over
32-ID chunks. This runs each configuration below (bf16 unless named, D=256, a small QSA
problem) in its own ``compute-sanitizer --tool memcheck`` process, side by side, and
checks its forward and backward against the float64 oracle there, so that the plans'
refusal rule (``qsa_triton.plan.min_backward_block_k``) follows measurements. Per case:
the sanitizer's error count and exit status, the relative errors, or the configuration
error the plan raised. Writes ``probe_chunks.json`` under ``--out``. ``--case NAME``
runs one case in this process (what each sanitizer process runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import ROOT, log, relative_error, step_result  # noqa: E402

# name: (heads, dtype, BlockSizes changes from the base, base) with base "default" or "safe"
CASES = {
    "flat128_k64": ((24, 2), "bfloat16", {}, "default"),
    "flat64_k64": ((24, 2), "bfloat16", {"block_m": 64}, "default"),
    "flat64_k32": ((24, 2), "bfloat16", {"block_m": 64, "backward_block_k": 32}, "default"),
    "flat32_k32": ((24, 2), "bfloat16", {"block_m": 32, "backward_block_k": 32}, "default"),
    "flat32_k16": ((24, 2), "bfloat16", {"block_m": 32, "backward_block_k": 16}, "default"),
    "flat128_fwd_k32": ((24, 2), "bfloat16", {"block_k": 32}, "default"),
    "padded_g8_k64": ((16, 2), "bfloat16", {}, "default"),
    "padded_g8_k32": ((16, 2), "bfloat16", {"backward_block_k": 32}, "default"),
    "padded_g8_k16": ((16, 2), "bfloat16", {"backward_block_k": 16}, "default"),
    "safe_bf16": ((24, 2), "bfloat16", {}, "safe"),
    "safe_fp32": ((24, 2), "float32", {}, "safe"),
}


def run_case(name: str) -> int:
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from contract_base import random_inputs
    from runners import run_torch

    from qsa_common.layouts import make_problem
    from qsa_common.oracle import oracle_forward_backward
    from qsa_torch.triton_qsa import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, triton_sparse_gqa_attention

    heads, dtype, changes, base = CASES[name]
    blocks = dataclasses.replace(DEFAULT_BLOCK_SIZES if base == "default" else SAFE_BLOCK_SIZES, **changes)
    problem = make_problem("padded", "qsa", seed=5, seq_len=160, top_k=8)
    q, k, v, do = random_inputs(np.random.default_rng(0), problem.routes, problem.kv_length, heads, 256, dtype)
    try:
        got = run_torch(lambda *a: triton_sparse_gqa_attention(*a, block_sizes=blocks), q, k, v, problem.routes,
                        256 ** -0.5, do, dtype, device="cuda")
    except ValueError as err:  # the plan refuses the configuration
        return step_result({"refused": str(err)})
    want = oracle_forward_backward(q, k, v, problem.routes, 256 ** -0.5, do)
    errs = {n: relative_error(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    return step_result(errs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--case", choices=sorted(CASES), help="run one case here (no sanitizer)")
    parser.add_argument("--timeout-s", type=float, default=200.0)
    args = parser.parse_args(argv)
    if args.case:
        return run_case(args.case)
    if not args.out:
        parser.error("--out is required unless --case is given")
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        log("compute-sanitizer is not on PATH")
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    env.pop("TRITON_INTERPRET", None)
    procs = {}
    for name in args.cases:
        logfile = open(os.path.join(args.out, f"{name}.log"), "w")
        cmd = [tool, "--tool", "memcheck", "--print-limit", "10", "--error-exitcode", "3",
               sys.executable, os.path.abspath(__file__), "--case", name]
        procs[name] = (subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, cwd=ROOT, env=env), logfile)
    deadline = time.time() + args.timeout_s
    report = {}
    for name, (proc, logfile) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        logfile.close()
        text = open(logfile.name).read()
        found = re.search(r"ERROR SUMMARY: (\d+) error", text)
        result = re.search(r"^RESULT (.*)$", text, re.M)
        report[name] = {"returncode": rc, "sanitizer_errors": int(found.group(1)) if found else None,
                        "result": json.loads(result.group(1)) if result else None}
        log(name, json.dumps(report[name]))
    with open(os.path.join(args.out, "probe_chunks.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
