"""What the GPU check scripts share: the contract's relative error, timers, a JSON record.

Scripts in this folder import it as ``gpu_common`` (Python puts a script's own folder on
``sys.path``). It imports torch and jax only inside the functions that need them.

* :func:`relative_error`: ``||actual - expected|| / ||expected||``, the rule of
  :func:`qsa_common.oracle.relative_error` (inf where ``actual`` is not finite; the
  absolute norm where ``expected`` is zero), for numpy and JAX arrays (through that
  function) and torch tensors (in float64 on their own device, large GPU tensors never
  cross to the host).
* :func:`cuda_ms` (torch, CUDA events) and :func:`jax_ms` (wall clock around
  ``block_until_ready``): medians in milliseconds after warm-up calls.
* :func:`run_step`: one step of a probe script in its own process, with a time limit (a
  kernel that hangs on an mbarrier costs one step), optionally the same script of another
  checkout on that checkout's modules (two versions of a kernel timed side by side).
* :class:`Record`: results by section and name, each entry the value or the error with
  its traceback and the seconds it took, written to JSON after every entry so that a run
  stopped by its time limit keeps what it measured; entries past a deadline are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from qsa_common.oracle import relative_error as _numpy_relative_error  # noqa: E402

__all__ = ["ROOT", "ProbeShape", "Record", "cuda_ms", "jax_ms", "log", "max_abs_diff", "probe_shape",
           "relative_error", "run_step", "step_result", "timing_steps", "wall_ms"]


def log(*args) -> None:
    print(*args, flush=True)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` (Frobenius, float64); see the module doc."""
    if _is_torch(actual) or _is_torch(expected):
        import torch

        a = torch.as_tensor(actual).detach().to(torch.float64)
        e = torch.as_tensor(expected).detach().to(device=a.device, dtype=torch.float64)
        if a.shape != e.shape:
            raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
        if not bool(torch.isfinite(a).all()):
            return float("inf")
        ref = float(torch.linalg.vector_norm(e))
        diff = float(torch.linalg.vector_norm(a - e))
        return diff / ref if ref > 0 else diff
    return float(_numpy_relative_error(np.asarray(actual, np.float64), np.asarray(expected, np.float64)))


def max_abs_diff(a, b) -> float:
    """``max |a - b|`` in float64: equal values (equal infinities included) count 0, a
    NaN on either side inf; torch tensors on their device, anything else through numpy."""
    if _is_torch(a) or _is_torch(b):
        import torch

        a = torch.as_tensor(a).detach().to(torch.float64)
        b = torch.as_tensor(b).detach().to(device=a.device, dtype=torch.float64)
        d = torch.where(a == b, 0.0, (a - b).abs())
        return float("inf") if bool(torch.isnan(d).any()) else (float(d.max()) if d.numel() else 0.0)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where equal: replaced by 0
        d = np.where(a == b, 0.0, np.abs(a - b))
    return float("inf") if np.isnan(d).any() else (float(d.max()) if d.size else 0.0)


def cuda_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` by CUDA events (torch), after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn) -> float:
    """Milliseconds of one call of ``fn()`` by the wall clock (the probes' CPU dry runs)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """What the torch Triton probes run on; ``timer``: :func:`cuda_ms`, or :func:`wall_ms`
    in a dry run."""

    heads: tuple[int, int]
    head_dim: int
    top_k: int
    device: str
    timer: Callable
    seq_len: int
    overlaps: list[float]

    def inputs(self):
        """Seeded bf16 ``q, k, v, do`` (B=1)."""
        import torch

        hq, hkv = self.heads
        gen = torch.Generator(device=self.device).manual_seed(0)
        shape_q, shape_kv = (1, self.seq_len, hq, self.head_dim), (1, self.seq_len, hkv, self.head_dim)
        q, do = (torch.randn(shape_q, generator=gen, device=self.device, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(shape_kv, generator=gen, device=self.device, dtype=torch.bfloat16) for _ in range(2))
        return q, k, v, do

    def routes(self, overlap: float):
        """The benchmark's QSA-format routes (``python -m parity.bench``, seed 0) at ``overlap``:
        int ``[1, seq_len, width]`` on the shape's device."""
        import torch

        from parity.bench_routes import _make_routes, overlap_label

        return torch.from_numpy(_make_routes(self.seq_len, overlap_label(overlap), self.top_k, 0)).to(self.device)


def probe_shape(dry_run: bool, seq_len: int, overlaps, dry_seq_len: int = 768) -> ProbeShape:
    """The H200 shape ((24,2), D=256, top_k 512, CUDA events), or with ``dry_run`` a tiny one
    in Triton's interpreter ((6,1), D=32, top_k 4, ``dry_seq_len`` rows, the first overlap,
    one wall-clock call); a dry run sets ``TRITON_INTERPRET`` (call it before importing
    the kernels)."""
    if not dry_run:
        return ProbeShape((24, 2), 256, 512, "cuda", cuda_ms, seq_len, list(overlaps))
    os.environ["TRITON_INTERPRET"] = "1"
    return ProbeShape((6, 1), 32, 4, "cpu", wall_ms, dry_seq_len, list(overlaps)[:1])


def jax_ms(fn, *args, reps: int = 10, warmup: int = 2) -> float:
    """Median wall milliseconds of ``jax.block_until_ready(fn(*args))`` after ``warmup``
    calls (the first compiles); long calls get at most 3 repetitions."""
    import jax

    for _ in range(warmup):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
    if time.perf_counter() - start > 0.2:
        reps = min(reps, 3)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def run_step(script: str, args, timeout_s: float, tree: str | None = None) -> dict:
    """``python script *args`` in a subprocess; the JSON on its ``RESULT `` line, or
    ``{"error": ...}`` (time limit, exit status and stderr's tail). With ``tree`` (another
    checkout), the script of the same name under ``tree/scripts/gpu`` runs with ``tree``
    first on ``PYTHONPATH`` and as its working directory."""
    env = cwd = None
    if tree is not None:
        cwd = os.path.abspath(tree)
        script = os.path.join(cwd, "scripts", "gpu", os.path.basename(script))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([cwd, os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout_s,
                              env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s (a hang?)"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"rc={done.returncode}", "stderr": done.stderr[-2000:]}


def timing_steps(record, script: str, name: str, seq_lens, overlaps, timeout_s: float,
                 against: str | None = None) -> None:
    """Per S and overlap, ``script --step time --seq S --overlap J`` in a process of its own
    (:func:`run_step`) into ``record`` (section ``S=../J=..``, entry ``name``), and with
    ``against`` the same step of that checkout's script right after (``name/against``)."""
    for seq in seq_lens:
        for overlap in overlaps:
            key, step = f"S={seq}/J={overlap}", ("--step", "time", "--seq", str(seq), "--overlap", str(overlap))
            record.run(key, name, lambda: run_step(script, step, timeout_s))
            if against:
                record.run(key, f"{name}/against", lambda: run_step(script, step, timeout_s, against))


def step_result(value) -> int:
    """A timing step's result, printed for :func:`run_step` (returns the exit status 0)."""
    print("RESULT " + json.dumps(value), flush=True)
    return 0


class Record:
    """Results of one script: ``record.run(section, name, fn)`` stores ``fn()``'s value (or
    its error) under ``results[section][name]`` and rewrites ``path`` at once."""

    def __init__(self, path: str, budget_s: float = float("inf"), **meta):
        self.path = path
        self.deadline = time.time() + budget_s
        self.results: dict = dict(meta)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def run(self, section: str, name: str, fn, *, margin_s: float = 0.0):
        """``fn()``'s value, or None when it raised or the deadline (less ``margin_s``) passed."""
        entry: dict
        if time.time() > self.deadline - margin_s:
            entry = {"skipped": "time budget"}
            value = None
        else:
            start = time.time()
            try:
                value = fn()
                entry = {"ok": True, "result": value}
            except Exception as err:  # noqa: BLE001: one failing entry must not lose the others
                value = None
                entry = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                         "traceback": traceback.format_exc()[-3000:]}
            entry["seconds"] = round(time.time() - start, 2)
        self.results.setdefault(section, {})[name] = entry
        shown = entry.get("error") or entry.get("skipped") or entry.get("result")
        log(f"[{entry.get('seconds', 0):6.1f}s] {section}/{name}: {str(shown)[:300]}")
        self.save()
        return value

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(tmp, self.path)
