#!/usr/bin/env python3
"""compute-sanitizer memcheck of the JAX kernels alone, small (run on the GPU host).

From the repository root, after ``source /tmp/qsa-site/env.sh`` (jax-triton 0.3.1)::

    python3 scripts/gpu/sanitize_jax.py --out $OUT                       # triton, ~2 minutes
    python3 scripts/gpu/sanitize_jax.py --out $OUT --implementation pallas,triton

Runs itself under ``compute-sanitizer --tool memcheck`` (``--probe``), one process per case
(so that a crash of one leaves the others' results), and records each run's ERROR SUMMARY
in sanitize_jax.json. The probe runs forward and backward
(``jax.vjp``) of ``qsa_jax.sparse_gqa_attention`` on small problems, each checked against
the float64 numpy oracle (so nothing else of XLA's, no reference attention, runs beside
the kernels), and prints PROBE_OK when every case agrees:

* ``triton`` (the qsa_triton kernels through jax-triton: union key, merge and cut
  kernels, forward, backward): the default flat tiling with unions cut from tiles (G=12),
  flat programs sorted one by one (G=6), padded tiles with the backward's unions cut
  (G=12 padded to 16), fp32 padded tiles; packed, padded and CP
  layouts, QSA, random and adversarial routes;
* ``pallas``: the default flattened heads, padded tiles with split heads, fp32 tiles,
  adversarial routes.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from gpu_common import ROOT, log, relative_error  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402


def _cases(implementation: str):
    """(problem, heads, dtype, block sizes, tolerance, label) per case."""
    from qsa_common.layouts import make_problem

    if implementation == "triton":
        from qsa_triton import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, BlockSizes

        split = BlockSizes(block_m=64, block_k=32, backward_block_m=32, backward_block_k=32,
                           backward_rows_per_tile=2)
        return [
            (make_problem("packed", "qsa", seed=1, seq_len=128, top_k=8), (12, 1), "bfloat16", None, 1e-2,
             "default: flat, cut from tiles"),
            (make_problem("padded", "qsa", seed=2, seq_len=80, top_k=5), (6, 1), "bfloat16", DEFAULT_BLOCK_SIZES,
             1e-2, "flat, sorted per program"),
            (make_problem("padded", "adversarial", seed=3, seq_len=64, width=12), (24, 2), "bfloat16", split, 1e-2,
             "padded, backward cut"),
            (make_problem("cp", "random", seed=4, seq_len=96, width=16), (12, 1), "float32", SAFE_BLOCK_SIZES, 1e-4,
             "fp32 padded"),
            (make_problem("packed", "adversarial", seed=5, seq_len=100, width=12), (12, 1), "bfloat16",
             DEFAULT_BLOCK_SIZES, 1e-2, "default, adversarial"),
        ]
    from qsa_jax.pallas_qsa import BlockSizes

    padded_split = BlockSizes(block_m=64, block_k=32, block_m_bwd=32, block_k_bwd=32)
    return [
        (make_problem("packed", "qsa", seed=1, seq_len=128, top_k=8), (12, 1), "bfloat16", None, 1e-2, "default"),
        (make_problem("padded", "adversarial", seed=2, seq_len=64, width=12), (24, 2), "bfloat16", padded_split,
         1e-2, "padded/split"),
        (make_problem("cp", "random", seed=3, seq_len=96, width=16), (12, 1), "float32", None, 1e-4, "fp32"),
        (make_problem("packed", "adversarial", seed=4, seq_len=100, width=12), (24, 2), "bfloat16", None, 1e-2,
         "default, adversarial"),
    ]


def probe(implementations, case=None) -> int:
    """The kernels on small problems against the oracle (every case, or the one numbered
    ``case``); PROBE_OK if every case run agrees."""
    faulthandler.enable()
    import jax
    import jax.numpy as jnp
    from contract_base import random_inputs

    from qsa_common.oracle import oracle_forward_backward
    from qsa_jax import sparse_gqa_attention

    log(jax.__version__, jax.devices())
    worst, ran = 0.0, 0
    for implementation in implementations:
        for index, (problem, heads, dtype, blocks, tol, label) in enumerate(_cases(implementation)):
            if case is not None and index != case:
                continue
            ran += 1
            # seeded by the case, so a case run alone gets the inputs it gets among all
            rng = np.random.default_rng(index)
            q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 256, dtype)
            jdt = jnp.dtype(dtype)

            def f(a, b, c, routes=problem.routes, blocks=blocks, implementation=implementation):
                # int64 numpy routes, huge IDs included: the API maps them to padding
                return sparse_gqa_attention(a, b, c, routes, 1 / 16, implementation=implementation,
                                            block_sizes=blocks)

            out, pullback = jax.vjp(f, *(jnp.asarray(x, jdt) for x in (q, k, v)))
            got = [np.asarray(x, np.float64) for x in (out, *pullback(jnp.asarray(do, jdt)))]
            want = oracle_forward_backward(q, k, v, problem.routes, 1 / 16, do)
            errs = [relative_error(g, w) for g, w in zip(got, want)]
            log("probe", implementation, label, problem.layout, heads, dtype, [f"{e:.2e}" for e in errs])
            worst = max(worst, max(e / tol for e in errs))
    if not ran:
        log(f"PROBE_NOTHING_RAN: no case {case} of {implementations}")
        return 2
    log("PROBE_OK" if worst < 1 else "PROBE_NUMERICS_FAIL")
    return 0 if worst < 1 else 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "sanitize-out"))
    parser.add_argument("--implementation", default="triton", help="comma list of triton,pallas")
    parser.add_argument("--timeout-s", type=float, default=170.0, help="for all the sanitizer's runs together")
    parser.add_argument("--probe", action="store_true", help="run the cases (under the sanitizer)")
    parser.add_argument("--case", type=int, default=None, help="with --probe: only this case of each implementation")
    args = parser.parse_args()
    implementations = [x for x in args.implementation.split(",") if x]
    if args.probe:
        return probe(implementations, args.case)
    import json

    os.makedirs(args.out, exist_ok=True)
    tool = shutil.which("compute-sanitizer")
    summary = {"implementations": implementations}
    if tool is None:
        summary["error"] = "compute-sanitizer not on PATH"
    else:
        deadline = time.monotonic() + args.timeout_s
        summary["runs"] = [_sanitize(tool, implementation, case, args.out, deadline - time.monotonic())
                           for implementation in implementations for case in range(len(_cases(implementation)))]
        summary["ok"] = bool(summary["runs"]) and all(run["returncode"] == 0 and run["probe_ok"]
                                                     for run in summary["runs"])
    with open(os.path.join(args.out, "sanitize_jax.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    for run in summary.get("runs", []):
        log(f"sanitizer {run['implementation']} case {run['case']}: {run['error_summary']} rc={run['returncode']} "
            f"probe_ok={run['probe_ok']}")
    if "error" in summary:
        log("sanitizer:", summary["error"])
    return 0 if summary.get("ok") else 1


def _sanitize(tool: str, implementation: str, case: int, out: str, timeout_s: float) -> dict:
    """One case of one implementation under memcheck, in its own process."""
    command = [tool, "--tool", "memcheck", "--print-limit", "30", "--error-exitcode", "3", sys.executable,
               os.path.abspath(__file__), "--probe", "--implementation", implementation, "--case", str(case)]
    log_path = os.path.join(out, f"sanitize_jax_{implementation}_{case}.log")
    start = time.monotonic()
    with open(log_path, "w") as log_file:
        rc = "timeout"
        if timeout_s > 0:
            # its own session, so that a timeout ends the probe under the sanitizer too
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    elapsed = time.monotonic() - start
    text = open(log_path, errors="replace").read()
    lines = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
    return dict(implementation=implementation, case=case, command=" ".join(command), returncode=rc,
                elapsed_s=round(elapsed, 1),
                error_summary=lines[-1] if lines else None, probe_ok="PROBE_OK" in text,
                probes=[line for line in text.splitlines() if line.startswith("probe ")], tail=text[-2000:])


if __name__ == "__main__":
    sys.exit(main())
