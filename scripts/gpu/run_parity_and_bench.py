#!/usr/bin/env python3
"""GPU run: the ``--gpu`` parity matrix, then the side-by-side benchmark.

On the H200 host, from the repository root, after ``source /tmp/qsa-site/env.sh``::

    python3 scripts/gpu/run_parity_and_bench.py --out "$OUT"            # ~9 minutes
    python3 scripts/gpu/run_parity_and_bench.py --out "$OUT" --skip-parity --budget 300
    # parity alone, the token-gather backends of both frameworks (bitwise table included):
    python3 scripts/gpu/run_parity_and_bench.py --out "$OUT" --skip-bench --skip-api --budget 540 \
        --parity-args "--backends triton,jax-triton,jax-pallas"

Steps (each guarded: one failing step never loses the others' results):

1. ``environment.json``: versions, GPU, which optional runtimes import.
2. In the background, the benchmark's route files are generated into
   ``/tmp/qsa-bench-routes`` (CPU work, overlapped with step 3).
3. Parity (``python -m parity --gpu``): one process per layout, in parallel
   (compilation is CPU-bound and dominates), each with a time budget; merged
   into ``$OUT/parity/parity.{md,json}``.
4. The GPU test of the dispatching torch API (``tests/test_torch_api.py -m gpu``:
   ``backend="auto"`` eager and under ``torch.compile``, against the oracle).
5. Benchmark (``python -m parity.bench``) into ``$OUT/bench/`` (results.jsonl is
   written as each shape finishes, so a timeout still leaves partial results;
   bench.md/json/png are rebuilt at the end in any case).
6. ``summary.md`` / ``summary.json`` and a short summary table printed last.
7. Everything but ``summary.md`` packed into ``results.tar.gz`` (``--no-pack`` to keep files).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

LAYOUTS = ("padded", "packed", "cp")
ROUTE_CACHE = "/tmp/qsa-bench-routes"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # torch and JAX share the GPU
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """A subprocess in its own process group, its output streamed to a log and to stdout."""

    def __init__(self, name: str, command: list[str], log_path: str, echo: bool = True):
        self.name = name
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.thread = threading.Thread(target=self._pump, args=(echo,), daemon=True)
        self.thread.start()

    def _pump(self, echo: bool) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            if echo and "Warning" not in line and "warn(" not in line:
                print(f"[{self.name}] {line.rstrip()}"[:400], flush=True)

    def wait(self, deadline: float) -> str:
        try:
            code = self.proc.wait(timeout=max(1.0, deadline - time.time()))
            status = f"exit {code}"
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            status = "killed at the deadline"
        self.thread.join(timeout=10)
        self.log.close()
        return status


def environment(out: str) -> dict:
    code = r"""
import json, importlib, platform, subprocess
info = {"python": platform.python_version()}
for name in ("torch", "triton", "jax", "jaxlib", "flax", "numpy", "ml_dtypes", "matplotlib", "rich"):
    try:
        info[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as e:
        info[name] = f"missing: {type(e).__name__}"
for name in ("flash_attn.cute", "cudnn", "jax_triton"):
    try:
        importlib.import_module(name); info[name] = "imports"
    except Exception as e:
        info[name] = f"{type(e).__name__}: {e}"[:200]
try:
    import torch
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    info["capability"] = list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
except Exception as e:
    info["gpu"] = repr(e)
try:
    import jax
    info["jax_devices"] = [str(d) for d in jax.devices()]
except Exception as e:
    info["jax_devices"] = repr(e)
print(json.dumps(info))
"""
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=180)
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as err:  # noqa: BLE001
        info = {"error": f"{type(err).__name__}: {err}"}
    with open(os.path.join(out, "environment.json"), "w") as f:
        json.dump(info, f, indent=1)
    print("environment:", json.dumps(info), flush=True)
    return info


def parity(out: str, budget: float, seed: int, extra: list[str]) -> dict:
    """The --gpu parity matrix, one process per layout in parallel, then merged."""
    deadline = time.time() + budget
    # cases not started by then are reported as not run; the hard kill leaves time for a case in flight
    case_budget = max(30.0, budget - 90.0)
    children = []
    for layout in LAYOUTS:
        command = [sys.executable, "-m", "parity", "--gpu", "--layouts", layout, "--seed", str(seed),
                   "--time-budget", f"{case_budget:.0f}", "--out", os.path.join(out, f"parity-{layout}"),
                   "--no-progress", *extra]
        children.append(Child(f"parity-{layout}", command, os.path.join(out, f"parity-{layout}.log")))
    statuses = {c.name: c.wait(deadline) for c in children}
    merge = Child("parity-merge", [sys.executable, "-m", "parity", "--merge",
                                   *(os.path.join(out, f"parity-{layout}") for layout in LAYOUTS),
                                   "--out", os.path.join(out, "parity")],
                  os.path.join(out, "parity-merge.log"), echo=False)
    statuses["merge"] = merge.wait(time.time() + 120)
    return statuses


def api_check(out: str, budget: float) -> dict:
    """The GPU test of qsa_torch.sparse_gqa_attention (auto backend, torch.compile, oracle)."""
    child = Child("api", [sys.executable, "-m", "pytest", "-q", "-s", "-m", "gpu", "-p", "no:cacheprovider",
                          "tests/test_torch_api.py"], os.path.join(out, "api.log"))
    return {"api (tests/test_torch_api.py -m gpu)": child.wait(time.time() + budget)}


def bench(out: str, budget: float, extra: list[str]) -> dict:
    bench_dir = os.path.join(out, "bench")
    # the benchmark stops starting work at its budget; the last worker may overrun by ~45 s
    child = Child("bench", [sys.executable, "-m", "parity.bench", "--out", bench_dir,
                            "--time-budget", f"{max(30.0, budget - 60):.0f}", "--cache-dir", ROUTE_CACHE,
                            *extra],
                  os.path.join(out, "bench.log"))
    statuses = {"bench": child.wait(time.time() + budget)}
    if os.path.exists(os.path.join(bench_dir, "meta.json")):
        replot = Child("bench-replot", [sys.executable, "-m", "parity.bench", "--replot", bench_dir],
                       os.path.join(out, "bench-replot.log"), echo=False)
        statuses["replot"] = replot.wait(time.time() + 120)
    return statuses


def summary(out: str, steps: dict, ran_parity: bool = True, ran_bench: bool = True) -> None:
    """summary.md / summary.json of a run; a part skipped by its flag is reported as skipped,
    not as a missing report."""
    lines = ["# GPU run: parity and benchmark", "", "| step | status |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in steps.items()]
    text_parts = [_parity_text(out) if ran_parity else "PARITY: skipped (--skip-parity)",
                  _bench_text(out) if ran_bench else "BENCH: skipped (--skip-bench)"]
    body = "\n\n".join(text_parts)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n\n```\n" + body + "\n```\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(steps, f, indent=1)
    print("\n".join(lines), flush=True)
    print(body, flush=True)


def _parity_text(out: str) -> str:
    try:
        from parity.report import summary_text
        from parity.suite import load_result

        with open(os.path.join(out, "parity", "parity.json")) as f:
            result = load_result(json.load(f))
        return "PARITY (--gpu)\n" + summary_text(result)
    except Exception as err:  # noqa: BLE001
        return f"PARITY: no merged report ({type(err).__name__}: {err})"


def _bench_text(out: str) -> str:
    try:
        from parity.bench_report import console_summary

        with open(os.path.join(out, "bench", "bench.json")) as f:
            rows = json.load(f)["results"]
        return "BENCH\n" + console_summary(rows)
    except Exception as err:  # noqa: BLE001
        return f"BENCH: no report ({type(err).__name__}: {err})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    parser.add_argument("--budget", type=float, default=510.0, help="seconds for everything (default 510)")
    parser.add_argument("--parity-share", type=float, default=0.45, help="fraction of the budget for parity")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 2**31)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-api", action="store_true", help="skip the GPU test of the torch API")
    parser.add_argument("--parity-args", default="", help="extra arguments for python -m parity (one string)")
    parser.add_argument("--bench-args", default="", help="extra arguments for python -m parity.bench")
    parser.add_argument("--no-pack", dest="pack", action="store_false",
                        help="leave the outputs as files instead of one results.tar.gz beside summary.md")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    steps: dict = {}
    try:
        steps["environment"] = "gpu: " + str(environment(args.out).get("gpu"))
    except Exception as err:  # noqa: BLE001
        steps["environment"] = f"failed: {err}"
    routes = None
    if not args.skip_bench:
        try:
            routes = Child("routes", [sys.executable, "-m", "parity.bench", "--prepare-routes",
                                      "--cache-dir", ROUTE_CACHE, *args.bench_args.split()],
                           os.path.join(args.out, "routes.log"), echo=False)
        except Exception as err:  # noqa: BLE001
            steps["routes"] = f"failed to start: {err}"
    if not args.skip_parity:
        share = args.budget * (1.0 if args.skip_bench else args.parity_share)
        try:
            steps.update(parity(args.out, share, args.seed, args.parity_args.split()))
        except Exception as err:  # noqa: BLE001
            steps["parity"] = f"failed: {type(err).__name__}: {err}"
    if not args.skip_api:
        try:
            steps.update(api_check(args.out, 120.0))
        except Exception as err:  # noqa: BLE001
            steps["api"] = f"failed: {type(err).__name__}: {err}"
    if not args.skip_bench:
        left = args.budget - (time.time() - start)
        try:
            steps.update(bench(args.out, max(60.0, left), args.bench_args.split()))
        except Exception as err:  # noqa: BLE001
            steps["bench"] = f"failed: {type(err).__name__}: {err}"
        if routes is not None:
            steps["routes"] = routes.wait(time.time() + 5)
    steps["total_seconds"] = round(time.time() - start)
    summary(args.out, steps, ran_parity=not args.skip_parity, ran_bench=not args.skip_bench)
    if args.pack:
        pack(args.out)
    return 0


def pack(out: str) -> None:
    """Everything under ``out`` but summary.md into one ``results.tar.gz`` (the device
    tool returns at most 8 files: the first GPU run lost its parity JSON to that limit)."""
    import shutil
    import tarfile

    names = [n for n in sorted(os.listdir(out)) if n not in ("summary.md", "results.tar.gz")]
    with tarfile.open(os.path.join(out, "results.tar.gz"), "w:gz") as tar:
        for name in names:
            tar.add(os.path.join(out, name), arcname=name)
    for name in names:
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    print(f"packed {len(names)} entries into {out}/results.tar.gz", flush=True)


if __name__ == "__main__":
    sys.exit(main())
