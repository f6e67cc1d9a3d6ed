"""GPU check of the cuDNN Frontend backend (``qsa_torch.cudnn_qsa``) on the H200 host.

    source /tmp/qsa-site/env.sh   # makes `import cudnn` work there
    python3 scripts/gpu/check_cudnn.py --out $OUT [--no-pytest]

The backend's kernels run on SM100/SM103 only, so on the H200 (SM90) this records what
can be seen there, each step in its own try/except:

1. ``environment``: torch, device, compute capability, the installed cuDNN Frontend
   version (package metadata, no import).
2. ``backend refuses (12,1)`` / ``(24,2)``: ``cudnn_sparse_gqa_attention`` on CUDA BF16
   QSA inputs raises RuntimeError naming SM100/SM103 and this GPU, before cuDNN is
   imported (``cudnn`` is still absent from ``sys.modules`` afterwards).
3. ``import cudnn``, ``qsa ops present``: the module, its version, whether
   ``cudnn.ops.qsa_indexed_forward`` / ``qsa_indexed_backward`` resolve, and their
   signatures.
4. ``direct forward`` / ``direct backward``: what the two kernels raise when called
   directly with tiny valid inputs on this GPU (on an H200: NotImplementedError).
5. ``numerics``: only on an SM100/SM103 device, out/dq/dk/dv against the fp32 torch
   reference (skipped elsewhere, with the reason).
6. ``pytest -m gpu``: the GPU-marked tests of ``tests/test_cudnn_qsa.py`` in a subprocess.

Writes ``check_cudnn.json`` and ``check_cudnn.md`` under --out and prints a summary table
last. Expected wall time on the H200: under a minute.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
import traceback

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpu_common import ROOT  # noqa: E402  (puts the repository root on sys.path)
from gpu_common import relative_error as rel

START = time.time()
BLACKWELL = {(10, 0): "SM100", (10, 3): "SM103"}
TOL = 1e-2  # the contract's bf16 tolerance on ||x - ref|| / ||ref||


def log(*args):
    print(f"[{time.time() - START:5.1f}s]", *args, flush=True)


def error_record(error: BaseException) -> dict:
    return {"raised": type(error).__name__, "message": str(error)[:2000]}


def qsa_inputs(heads, seq_len=64, top_k=4, batch=1, layout="packed", seed=0, grad=True):
    """CUDA BF16 q, k, v and int64 QSA routes of one layout."""
    from qsa_torch import generate_problem

    routes, _ = generate_problem(layout, "qsa", seed=seed, seq_len=seq_len, top_k=top_k,
                                 batch=batch, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hq, hkv = heads
    shapes = [(routes.shape[0], seq_len, hq, 256)] + [(routes.shape[0], seq_len, hkv, 256)] * 2
    leaves = [torch.randn(s, generator=gen, device="cuda").bfloat16().requires_grad_(grad)
              for s in shapes]
    return leaves, routes


# --------------------------------------------------------------------------- checks


def check_environment():
    from importlib import metadata

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "qsa_site_on_path": "/tmp/qsa-site" in os.environ.get("PYTHONPATH", ""),
    }
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"{cap[0]}.{cap[1]}",
                    blackwell=cap in BLACKWELL)
    for dist in ("nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return "info", info


def check_backend_refuses(heads):
    def run():
        from qsa_torch.cudnn_qsa import cudnn_sparse_gqa_attention

        if torch.cuda.get_device_capability(0) in BLACKWELL:
            return "n/a", {"note": "this GPU is SM100/SM103: the backend runs here (see numerics)"}
        (q, k, v), routes = qsa_inputs(heads)
        try:
            cudnn_sparse_gqa_attention(q, k, v, routes)
        except RuntimeError as error:
            message = str(error)
            named = "SM100/SM103" in message and torch.cuda.get_device_name(0) in message
            imported = "cudnn" in sys.modules
            ok = named and not imported
            return ("pass" if ok else "fail"), {
                **error_record(error), "names_requirement_and_gpu": named,
                "cudnn_imported_before_refusal": imported,
            }
        return "fail", {"raised": None, "message": "returned instead of raising RuntimeError"}

    return run


def check_import_cudnn():
    module = importlib.import_module("cudnn")
    info = {"file": getattr(module, "__file__", None),
            "version": getattr(module, "__version__", None)}
    try:
        info["backend_version"] = module.backend_version()
    except Exception as error:  # noqa: BLE001 - recorded, not fatal
        info["backend_version"] = f"unavailable: {error!r}"
    return "info", info


def check_qsa_ops():
    ops = importlib.import_module("cudnn.ops")
    info = {}
    for name in ("qsa_indexed_forward", "qsa_indexed_backward"):
        try:
            fn = getattr(ops, name)
            entry = {"present": True, "module": getattr(fn, "__module__", None)}
            try:
                entry["signature"] = str(inspect.signature(fn))
            except (TypeError, ValueError) as error:
                entry["signature"] = f"unavailable: {error!r}"
        except Exception as error:  # noqa: BLE001 - ImportError/AttributeError recorded
            entry = {"present": False, **error_record(error)}
        info[name] = entry
    present = all(info[n]["present"] for n in ("qsa_indexed_forward", "qsa_indexed_backward"))
    return ("pass" if present else "fail"), info


def tiny_kernel_inputs():
    """T = 8 tokens, one 12:1 head group, W = 8 QSA routes (block 0 and the causal tail)."""
    from qsa_common.generators import qsa_format_routes

    tokens = 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(tokens, 12, 256, generator=gen, device="cuda").bfloat16()
    k = torch.randn(tokens, 1, 256, generator=gen, device="cuda").bfloat16()
    v = torch.randn(tokens, 1, 256, generator=gen, device="cuda").bfloat16()
    routes = qsa_format_routes(tokens, top_k=1, rng=np.random.default_rng(1))
    indices = torch.from_numpy(routes).to(device="cuda", dtype=torch.int32).contiguous()
    return q, k, v, indices


def check_direct(kind):
    def run():
        ops = importlib.import_module("cudnn.ops")
        q, k, v, indices = tiny_kernel_inputs()
        started = time.time()
        try:
            if kind == "forward":
                result = ops.qsa_indexed_forward(q, k, v, indices, 1 / 16)
            else:
                out_fp32 = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
                lse = torch.zeros(12, q.shape[0], dtype=torch.float32, device="cuda")
                result = ops.qsa_indexed_backward(q.clone(), q, k, v, out_fp32, lse, indices,
                                                  1 / 16, selection_mode="general")
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - the point is to record it
            record = {**error_record(error), "call_s": round(time.time() - started, 3)}
            expected = type(error).__name__ == "NotImplementedError"
            record["matches_gpu_md"] = expected
            return ("pass" if expected else "info"), record
        shapes = [list(t.shape) for t in result]
        return "info", {"raised": None, "returned_shapes": shapes,
                        "note": "the kernel ran on this GPU, which earlier runs on SM90 did not"}

    return run


def check_numerics():
    if torch.cuda.get_device_capability(0) not in BLACKWELL:
        return "skipped", {"reason": "no SM100/SM103 GPU here; the kernels cannot run, so the "
                                     "backend's numerics are unverified on this host"}
    from qsa_torch import reference_sparse_gqa_attention
    from qsa_torch.cudnn_qsa import cudnn_sparse_gqa_attention

    errors = {}
    for layout, heads, batch in (("packed", (24, 2), 1), ("padded", (12, 1), 2)):
        leaves, routes = qsa_inputs(heads, seq_len=1024, top_k=128, batch=batch, layout=layout)
        grad = torch.randn_like(leaves[0])
        out = cudnn_sparse_gqa_attention(*leaves, routes, 1 / 16)
        out.backward(grad)
        refs = [t.detach().float().requires_grad_(True) for t in leaves]
        ref = reference_sparse_gqa_attention(*refs, routes, 1 / 16)
        ref.backward(grad.float())
        pairs = zip(("out", "dq", "dk", "dv"), [(out, ref)] + [(a.grad, b.grad) for a, b in zip(leaves, refs)])
        errors[f"{layout}/{heads}"] = {name: rel(a, b) for name, (a, b) in pairs}
    worst = max(e for row in errors.values() for e in row.values())
    return ("pass" if worst < TOL else "fail"), {"relative_errors": errors, "worst": worst}


def check_pytest():
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
               "-rA", "tests/test_cudnn_qsa.py"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    tail = (proc.stdout + proc.stderr)[-3000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    passed = int(passed.group(1)) if passed else 0
    # at least the two "other GPU raises" tests (or the Blackwell numerics) must have run
    ok = proc.returncode == 0 and passed >= 2
    return ("pass" if ok else "fail"), {"returncode": proc.returncode, "passed": passed,
                                        "command": " ".join(command[1:]), "output_tail": tail}


# ---------------------------------------------------------------------------- main


def summary_line(record: dict) -> str:
    keys = ("raised", "reason", "note", "worst", "version", "equal_to_cpu", "device", "returncode",
            "passed")
    parts = []
    for key in keys:
        if key in record and record[key] is not None:
            parts.append(f"{key}={record[key]}")
    if "message" in record:
        parts.append(f"message={record['message'][:160]!r}")
    return "; ".join(parts)[:300]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for check_cudnn.json / .md")
    parser.add_argument("--no-pytest", action="store_true", help="skip the pytest subprocess")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    checks = [
        ("environment", check_environment),
        # before anything imports cudnn, to show the refusal precedes the import
        ("backend refuses (12,1)", check_backend_refuses((12, 1))),
        ("backend refuses (24,2)", check_backend_refuses((24, 2))),
        ("import cudnn", check_import_cudnn),
        ("qsa ops present", check_qsa_ops),
        ("direct forward", check_direct("forward")),
        ("direct backward", check_direct("backward")),
        ("numerics", check_numerics),
    ]
    if not args.no_pytest:
        checks.append(("pytest -m gpu", check_pytest))

    records = []
    for name, fn in checks:
        log(f"{name} ...")
        started = time.time()
        try:
            status, detail = fn()
        except Exception as error:  # noqa: BLE001 - one failure must not lose the rest
            status, detail = "error", {**error_record(error),
                                       "traceback": traceback.format_exc()[-3000:]}
        records.append({"check": name, "status": status, "wall_s": round(time.time() - started, 2),
                        **detail})
        log(f"{name}: {status}")

    report = {"script": "scripts/gpu/check_cudnn.py", "total_s": round(time.time() - START, 1),
              "checks": records}
    with open(os.path.join(args.out, "check_cudnn.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    lines = ["# cuDNN Frontend backend on this GPU", "",
             f"Total wall time {report['total_s']} s.", "",
             "| check | status | wall s | detail |", "|---|---|---|---|"]
    for r in records:
        detail = summary_line(r).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['check']} | {r['status']} | {r['wall_s']} | {detail} |")
    with open(os.path.join(args.out, "check_cudnn.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

    print()
    width = max(len(r["check"]) for r in records)
    for r in records:
        print(f"{r['check']:<{width}}  {r['status']:<7}  {summary_line(r)[:110]}")
    failed = [r["check"] for r in records if r["status"] in ("fail", "error")]
    print(f"\n{len(records) - len(failed)}/{len(records)} checks without failure; "
          f"total {report['total_s']} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
