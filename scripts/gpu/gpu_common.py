"""What the GPU check scripts share: the contract's relative error, timers, a JSON record.

Scripts in this folder import it as ``gpu_common`` (Python puts a script's own folder on
``sys.path``). It imports torch only inside the functions that need it.

* :func:`relative_error`: ``||actual - expected|| / ||expected||``, the rule of
  :func:`qsa_common.oracle.relative_error` (inf where ``actual`` is not finite; the
  absolute norm where ``expected`` is zero), for numpy and JAX arrays (through that
  function) and torch tensors (in float64 on their own device, large GPU tensors never
  cross to the host).
* :func:`max_abs_diff`: ``max |a - b|`` (equal values count 0, NaN inf), for bitwise checks.
* :func:`cuda_ms` (torch, CUDA events): the median in milliseconds after warm-up calls.
* :class:`Record`: results by section and name, each entry the value or the error with
  its traceback and the seconds it took, written to JSON after every entry so that a run
  stopped by its time limit keeps what it measured; entries past a deadline are skipped.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from qsa_common.oracle import relative_error as _numpy_relative_error  # noqa: E402

__all__ = ["ROOT", "Record", "cuda_ms", "log", "max_abs_diff", "relative_error"]


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
            except Exception as err:  # noqa: BLE001 -- one failing entry must not lose the others
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
