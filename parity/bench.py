"""``python -m parity.bench``: every QSA backend of both frameworks, timed side by side
with dense causal attention in the same run.

For each shape (S, (Hq, Hkv), route family; B=1, D=256, bf16, QSA-format routes
of top_k 512 = width 2052 or random routes of the same width, one document per
row) it measures, per backend:

* forward and forward+backward median time (CUDA events for torch, with the L2
  cache flushed before every repetition; ``block_until_ready`` wall time for JAX,
  flushed the same way), after a warm-up call that absorbs compilation;
* useful TFLOP/s: forward ``4 * sum|R| * Hq * D / time``; the backward counts 2.5x
  the forward's flops, so forward+backward counts 3.5x (dense causal attention is
  credited with its causal work ``4 * S(S+1)/2 * Hq * D``);
* peak device memory (torch ``max_memory_allocated`` after a reset; JAX
  ``peak_bytes_in_use``, a process high-water mark: shapes run in ascending S);
* the ratio to dense causal attention of the same framework (torch SDPA with
  ``is_causal=True``; ``jax.nn.dot_product_attention(implementation="cudnn",
  is_causal=True)``).

Robustness: each backend runs in its own subprocess (a crash, an OOM or a hung
kernel costs that backend only, and its memory is returned), gets a fair share of
the remaining time budget, skips shapes it would not finish in time and larger
shapes after an OOM, and appends every result to ``results.jsonl`` as soon as it
has it. The parent writes ``bench.json``, ``bench.md`` and ``bench.png`` after
every backend; ``--replot DIR`` rebuilds them from ``DIR/results.jsonl``.
Routes are generated once per (S, family), in background processes, into
``--cache-dir`` (reused by later runs with the same parameters).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["main", "PRIORITY", "Shape"]

# Run order (most important first): each backend gets a fair share of what is left.
PRIORITY = ("torch-dense-sdpa", "jax-dense-cudnn", "jax-pallas", "triton", "flex", "fa4", "cudnn",
            "torch-reference", "jax-xla")
DENSE = {"torch-dense-sdpa": "torch", "jax-dense-cudnn": "jax"}
_L2_FLUSH_BYTES = 256 << 20
_TARGET_SECONDS = 1.0  # measured time per quantity, before the repetition cap
_REPS = (3, 20)  # min and max timed repetitions
_GRACE = 45.0  # seconds a worker may overrun its share before it is killed


@dataclass(frozen=True)
class Shape:
    seq_len: int
    heads: tuple[int, int]
    family: str  # route family; dense baselines ignore routes

    def key(self) -> str:
        return f"S={self.seq_len}/{self.heads[0]}:{self.heads[1]}/{self.family}"


# ----------------------------------------------------------------------------- planning
def _routes_path(cache_dir: str, seq_len: int, family: str, top_k: int, seed: int) -> str:
    return os.path.join(cache_dir, f"routes-S{seq_len}-{family}-k{top_k}-seed{seed}.npy")


def _generate_routes(path: str, seq_len: int, family: str, top_k: int, seed: int) -> str:
    """One full-length document of ``family`` routes, saved as int32 ``[1, S, 4*top_k+4]``."""
    if os.path.exists(path):
        return path
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    except FileExistsError:  # another process makes this file: wait while it is alive
        while not os.path.exists(path) and _lock_alive(lock):
            time.sleep(1.0)
        if os.path.exists(path):
            return path
    from qsa_common.layouts import make_problem

    try:
        problem = make_problem("padded", family, seed=seed, seq_len=seq_len, top_k=top_k, batch=1)
        routes = problem.routes
        routes = np.where((routes < 0) | (routes >= seq_len), -1, routes).astype(np.int32)
        tmp = f"{path}.{os.getpid()}.tmp.npy"
        np.save(tmp, routes)
        os.replace(tmp, path)
    finally:
        if os.path.exists(lock):
            os.remove(lock)
    return path


def _lock_alive(lock: str) -> bool:
    """Whether the process named in ``lock`` still runs."""
    try:
        with open(lock) as f:
            os.kill(int(f.read().strip() or 0), 0)
        return True
    except (OSError, ValueError):  # no lock, no such process, or a half-written lock
        return False


def _plan(args) -> list[Shape]:
    """Shapes in run order: family, heads, then ascending S (each backend's time-budget
    estimate extrapolates from the previous S of the same family and heads)."""
    return [Shape(s, h, f) for f in args.families for h in args.heads for s in sorted(args.seq_lens)]


# ----------------------------------------------------------------------------- backends
@functools.cache
def _dense_torch():
    import torch.nn.functional as F

    def dense(query, key, value, routes, scale):
        del routes  # dense causal attention ignores the routes
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        kernels = contextlib.nullcontext()
        if q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            # never the math kernel: it materialises S x S scores
            kernels = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION])
        with kernels:
            if not dense.note:
                try:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                         enable_gqa=True)
                    return out.transpose(1, 2)
                except RuntimeError:
                    dense.note = "K/V heads repeated inside the timed call (no GQA kernel)"
            group = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)

    dense.note = ""
    return dense


@functools.cache
def _dense_jax():
    import jax

    def dense(query, key, value, routes, scale):
        del routes
        return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=True,
                                            implementation="cudnn")

    return dense


def _bench_backends() -> dict:
    from .backends import BACKENDS, Backend

    table = {
        "torch-dense-sdpa": Backend("torch-dense-sdpa", "torch", _dense_torch,
                                    dtypes=("bfloat16", "float16", "float32"),
                                    description="torch SDPA, is_causal=True (dense baseline)"),
        "jax-dense-cudnn": Backend("jax-dense-cudnn", "jax", _dense_jax,
                                   dtypes=("bfloat16", "float16"),
                                   requires=lambda env, case: None if env.jax_platform == "gpu"
                                   else "cuDNN attention needs a GPU",
                                   description='jax.nn.dot_product_attention(implementation="cudnn", '
                                               "is_causal=True) (dense baseline)"),
    }
    table.update(BACKENDS)
    return table


# ----------------------------------------------------------------------------- worker
def _is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return ("OutOfMemory" in text or "out of memory" in text.lower() or "RESOURCE_EXHAUSTED" in text)


class _TorchTimer:
    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.cuda = device == "cuda"
        self.flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda else None

    def time(self, fn, before=None) -> float:
        """Milliseconds of one call of ``fn`` (``before`` runs untimed first)."""
        torch = self.torch
        if before is not None:
            before()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated()) if self.cuda else None

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


class _JaxTimer:
    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.jax = jax
        self.device = jax.devices()[0]
        self.gpu = self.device.platform == "gpu"
        self.flush_buf = jnp.zeros(_L2_FLUSH_BYTES // 4, jnp.float32) if self.gpu else None
        self.flush_fn = jax.jit(lambda x: x + 1.0)

    def time(self, fn, before=None) -> float:
        if before is not None:
            before()
        if self.gpu:
            self.jax.block_until_ready(self.flush_fn(self.flush_buf))
        start = time.perf_counter()
        self.jax.block_until_ready(fn())
        return (time.perf_counter() - start) * 1e3

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int | None:
        stats = self.device.memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return int(peak) if peak is not None else None

    def free(self) -> None:
        import gc

        gc.collect()


def _measure(timer, fn, before=None, deadline: float = math.inf) -> dict:
    """Warm-up (compilation) call, one estimating call, then repetitions; median ms."""
    first = timer.time(fn, before)
    estimate = timer.time(fn, before)
    reps = int(min(_REPS[1], max(_REPS[0], _TARGET_SECONDS * 1e3 / max(estimate, 1e-3))))
    times = [estimate]
    for _ in range(reps):
        if time.time() + 2 * times[-1] / 1e3 > deadline and len(times) >= _REPS[0]:
            break
        times.append(timer.time(fn, before))
    return {"median_ms": statistics.median(times), "reps": len(times), "first_call_ms": first,
            "min_ms": min(times)}


def _torch_shape(backend, fn, shape: Shape, routes_np, head_dim, dtype, timer, deadline):
    import torch

    device = "cuda" if timer.cuda else "cpu"
    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(shape.seq_len)
    hq, hkv = shape.heads
    s = shape.seq_len
    q = torch.randn(1, s, hq, head_dim, device=device, dtype=tdtype, generator=gen)
    k = torch.randn(1, s, hkv, head_dim, device=device, dtype=tdtype, generator=gen)
    v = torch.randn(1, s, hkv, head_dim, device=device, dtype=tdtype, generator=gen)
    do = torch.randn(1, s, hq, head_dim, device=device, dtype=tdtype, generator=gen)
    routes = torch.from_numpy(routes_np).to(device)
    scale = head_dim ** -0.5
    result = {}
    timer.reset_peak()
    with torch.no_grad():
        fwd = _measure(timer, lambda: fn(q, k, v, routes, scale), deadline=deadline)
    result.update(fwd_ms=fwd["median_ms"], fwd_reps=fwd["reps"], fwd_first_call_ms=fwd["first_call_ms"],
                  fwd_peak_bytes=timer.peak())
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def clear():
        for t in leaves:
            t.grad = None

    def step():
        fn(*leaves, routes, scale).backward(do)

    timer.reset_peak()
    return _add_fwdbwd(result, timer, lambda: _measure(timer, step, before=clear, deadline=deadline),
                       may_lack_backward=True)


def _jax_shape(backend, fn, shape: Shape, routes_np, head_dim, dtype, timer, deadline):
    import jax
    import jax.numpy as jnp

    from qsa_jax.routes import prepare_routes

    from .runners import _jitted

    jdtype = jnp.dtype(dtype)
    hq, hkv = shape.heads
    s = shape.seq_len
    keys = jax.random.split(jax.random.key(shape.seq_len), 4)
    q = jax.random.normal(keys[0], (1, s, hq, head_dim), jdtype)
    k = jax.random.normal(keys[1], (1, s, hkv, head_dim), jdtype)
    v = jax.random.normal(keys[2], (1, s, hkv, head_dim), jdtype)
    do = jax.random.normal(keys[3], (1, s, hq, head_dim), jdtype)
    routes = jnp.asarray(prepare_routes(routes_np))  # int64 past int32 stays padding
    scale = head_dim ** -0.5
    forward = _jitted(fn, scale, False)
    fwd = _measure(timer, lambda: forward(q, k, v, routes), deadline=deadline)
    result = dict(fwd_ms=fwd["median_ms"], fwd_reps=fwd["reps"], fwd_first_call_ms=fwd["first_call_ms"],
                  fwd_peak_bytes=timer.peak())
    both_fn = _jitted(fn, scale, True)
    return _add_fwdbwd(result, timer,
                       lambda: _measure(timer, lambda: both_fn(q, k, v, routes, do), deadline=deadline))


def _add_fwdbwd(result: dict, timer, measure_both, may_lack_backward: bool = False) -> dict:
    """Add the forward+backward figures of ``measure_both()`` to ``result``; a backend
    whose backward runs out of memory (or, with ``may_lack_backward``, raises
    NotImplementedError) keeps its forward figures with the reason."""
    try:
        both = measure_both()
    except NotImplementedError as err:
        if not may_lack_backward:
            raise
        result.update(fwdbwd_reason=f"no backward: {err}")
        return result
    except Exception as err:  # noqa: BLE001: keep the forward figures when only the backward OOMs
        if not _is_oom(err):
            raise
        result.update(fwdbwd_reason=f"forward+backward out of memory: {str(err)[:200]}")
        return result
    result.update(fwdbwd_ms=both["median_ms"], fwdbwd_reps=both["reps"],
                  fwdbwd_first_call_ms=both["first_call_ms"], fwdbwd_peak_bytes=timer.peak())
    return result


def _wait_for(path: str, deadline: float) -> bool:
    while not os.path.exists(path):
        if time.time() > deadline:
            return False
        time.sleep(0.5)
    return True


def _predict_seconds(previous: dict | None, seq_len: int) -> float:
    """Seconds the next shape should take, from the previous S of the same family and heads
    (time scaled as S^2: conservative for kernels that scale linearly)."""
    if not previous or "fwd_ms" not in previous:
        return 0.0
    ratio = (seq_len / previous["seq_len"]) ** 2
    per_call = (previous["fwd_ms"] + previous.get("fwdbwd_ms", 0.0)) / 1e3 * ratio
    compile_s = (previous.get("fwd_first_call_ms", 0.0) - previous["fwd_ms"]
                 + previous.get("fwdbwd_first_call_ms", 0.0) - previous.get("fwdbwd_ms", 0.0)) / 1e3
    return max(compile_s, 0.0) + (2 + _REPS[0]) * per_call


def _worker(plan_path: str) -> int:
    """Time one backend on every shape of the plan; append one JSON line per shape."""
    with open(plan_path) as f:
        plan = json.load(f)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    name = plan["backend"]
    deadline = plan["deadline"]
    backend = _bench_backends()[name]
    out = open(plan["results"], "a")

    def emit(record: dict) -> None:
        record = {"backend": name, "framework": backend.framework, **record}
        out.write(json.dumps(record) + "\n")
        out.flush()
        ms = lambda key: f"{record[key]:.2f} ms" if key in record else "—"  # noqa: E731
        print(f"  {name:18} {record['shape']:28} {record['status']:12} fwd {ms('fwd_ms')}, "
              f"fwd+bwd {ms('fwdbwd_ms')} {record.get('reason', '')[:160]}", flush=True)

    from .backends import Case, Environment, load_reason, static_reason

    env = Environment.detect((backend.framework,))
    shapes = [Shape(s["seq_len"], tuple(s["heads"]), s["family"]) for s in plan["shapes"]]
    dense = name in DENSE
    if dense:  # the routes do not matter: once per (S, heads)
        shapes = list({(sh.seq_len, sh.heads): Shape(sh.seq_len, sh.heads, "-") for sh in shapes}.values())
    load_error = load_reason(backend)
    timer = None
    if load_error is None:
        try:
            timer = _TorchTimer(env.torch_device) if backend.framework == "torch" else _JaxTimer()
        except Exception as err:  # noqa: BLE001
            load_error = f"{type(err).__name__}: {err}"
    previous: dict[tuple, dict] = {}
    oom_at: dict[tuple, int] = {}
    for shape in shapes:
        base = {"shape": shape.key(), "seq_len": shape.seq_len, "heads": list(shape.heads),
                "family": shape.family, "head_dim": plan["head_dim"], "dtype": plan["dtype"]}
        group = (shape.heads, shape.family)
        case = Case("padded", shape.family if not dense else "qsa", plan["dtype"], shape.heads,
                    plan["head_dim"], 1, shape.seq_len, shape.seq_len, 4 * plan["top_k"] + 4)
        reason = static_reason(backend, env, case)
        if reason is None and load_error:
            reason = f"cannot load: {load_error}"
        if reason is not None:
            emit({**base, "status": "unavailable", "reason": reason})
            continue
        if group in oom_at:
            emit({**base, "status": "skipped", "reason": f"out of memory at S={oom_at[group]}"})
            continue
        remaining = deadline - time.time()
        predicted = _predict_seconds(previous.get(group), shape.seq_len)
        if predicted > remaining:
            emit({**base, "status": "skipped",
                  "reason": f"would exceed the time budget (needs ~{predicted:.0f} s, {remaining:.0f} s left)"})
            continue
        if dense:  # a placeholder: the baseline ignores routes
            routes_np = np.full((1, shape.seq_len, 1), -1, dtype=np.int32)
        else:
            path = plan["routes"][f"{shape.seq_len}/{shape.family}"]
            if not _wait_for(path, deadline):
                emit({**base, "status": "skipped", "reason": "routes were not ready within the time budget"})
                continue
            routes_np = np.load(path)
            base["sum_routes"] = int(((routes_np >= 0) & (routes_np < shape.seq_len)).sum())
        started = time.time()
        runner = _torch_shape if backend.framework == "torch" else _jax_shape
        try:
            measured = runner(backend, backend.load(), shape, routes_np, plan["head_dim"], plan["dtype"],
                              timer, deadline)
            record = {**base, "status": "ok", **measured}
            if getattr(backend.load(), "note", ""):
                record["note"] = backend.load().note
            previous[group] = {"seq_len": shape.seq_len, **measured}
        except Exception as err:  # noqa: BLE001: record and go on with the next shape
            if _is_oom(err):
                oom_at[group] = shape.seq_len
                record = {**base, "status": "oom", "reason": f"{type(err).__name__}: {str(err)[:300]}"}
            else:
                record = {**base, "status": "error", "reason": f"{type(err).__name__}: {str(err)[:500]}"}
            text = str(err)
            if "illegal memory access" in text or "CUDA error" in text:
                emit(record)
                print(f"  {name}: the CUDA context is lost; stopping this backend", flush=True)
                return 3
        record["seconds"] = round(time.time() - started, 2)
        emit(record)
        del routes_np
        timer.free()
    return 0


# ----------------------------------------------------------------------------- report
def _flops(record: dict, head_dim: int) -> float | None:
    hq = record["heads"][0]
    if record.get("sum_routes"):
        return 4.0 * record["sum_routes"] * hq * head_dim
    if record["backend"] in DENSE:
        s = record["seq_len"]
        return 4.0 * s * (s + 1) / 2 * hq * head_dim
    return None


def _enrich(records: list[dict]) -> list[dict]:
    """Add TFLOP/s and the ratio to the same framework's dense baseline (else the other's)."""
    dense = {}
    for r in records:
        if r["backend"] in DENSE and r.get("status") == "ok":
            dense[(r["framework"], r["seq_len"], tuple(r["heads"]))] = r
    rows = []
    for r in records:
        r = dict(r)
        flops = _flops(r, r["head_dim"])
        if r.get("status") == "ok" and flops:
            if r.get("fwd_ms"):
                r["fwd_tflops"] = flops / (r["fwd_ms"] * 1e-3) / 1e12
            if r.get("fwdbwd_ms"):
                r["fwdbwd_tflops"] = 3.5 * flops / (r["fwdbwd_ms"] * 1e-3) / 1e12
        other = "jax" if r["framework"] == "torch" else "torch"
        base = (dense.get((r["framework"], r["seq_len"], tuple(r["heads"])))
                or dense.get((other, r["seq_len"], tuple(r["heads"]))))
        if base is not None and r.get("status") == "ok":
            r["dense_baseline"] = base["backend"]
            for key in ("fwd_ms", "fwdbwd_ms"):
                if r.get(key) and base.get(key):
                    r[f"{key[:-3]}_vs_dense"] = r[key] / base[key]
        rows.append(r)
    return rows


def _cell(value, fmt="{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# QSA benchmark",
        "",
        f"Command: `{meta.get('command', '')}`  ",
        f"Device: {meta.get('device', '?')}; {meta.get('date', '')}; B=1, D={meta.get('head_dim')}, "
        f"{meta.get('dtype')}, route width {4 * meta.get('top_k', 512) + 4} (top_k {meta.get('top_k')}), "
        "one document per row.",
        "",
        "Median milliseconds (L2 flushed before each repetition). Useful TFLOP/s: forward "
        "4·Σ|R|·Hq·D / time, forward+backward 3.5x that (dense: its causal work). "
        "÷dense: time over the same framework's dense causal attention at the same S and heads. "
        "Peak: device memory high-water mark during forward+backward (JAX: process high-water mark).",
        "",
    ]
    header = ["S", "heads", "routes", "backend", "fwd ms", "fwd TFLOP/s", "fwd ÷dense",
              "fwd+bwd ms", "fwd+bwd TFLOP/s", "fwd+bwd ÷dense", "peak GiB", "note"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = {name: i for i, name in enumerate(PRIORITY)}
    families = sorted({r["family"] for r in rows if r["family"] != "-"}) or ["-"]
    for family in families:
        for r in sorted((r for r in rows if r["family"] in (family, "-")),
                        key=lambda r: (r["heads"][0], r["seq_len"], order.get(r["backend"], 99))):
            peak = r.get("fwdbwd_peak_bytes") or r.get("fwd_peak_bytes")
            note = r.get("note", "") if r.get("status") == "ok" else f"{r.get('status')}: {r.get('reason', '')}"
            if r.get("fwdbwd_reason"):
                note = r["fwdbwd_reason"]
            lines.append("| " + " | ".join([
                str(r["seq_len"]), f"{r['heads'][0]}:{r['heads'][1]}",
                "dense causal" if r["backend"] in DENSE else family, r["backend"],
                _cell(r.get("fwd_ms")), _cell(r.get("fwd_tflops"), "{:.3g}"),
                _cell(r.get("fwd_vs_dense")), _cell(r.get("fwdbwd_ms")),
                _cell(r.get("fwdbwd_tflops"), "{:.3g}"), _cell(r.get("fwdbwd_vs_dense")),
                _cell(peak / 2**30 if peak else None), note.replace("|", "/")[:200],
            ]) + " |")
    return "\n".join(lines) + "\n"


def _color(name: str) -> str:
    """The same colour for a backend in every panel."""
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    index = PRIORITY.index(name) if name in PRIORITY else len(PRIORITY) + sum(map(ord, name))
    return palette[index % len(palette)]


def _plot(rows: list[dict], path: str) -> str | None:
    """PNG of time vs S per backend (log-log): one row of panels per (routes, heads)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no plot: {err} (rerun `python -m parity.bench --replot DIR` where matplotlib is installed)"
    ok = [r for r in rows if r.get("status") == "ok"]
    groups = sorted({(r["family"], tuple(r["heads"])) for r in ok if r["family"] != "-"})
    if not groups:
        groups = sorted({("-", tuple(r["heads"])) for r in ok})
    if not groups:
        return "no plot: nothing was measured"
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.2 * len(groups)), squeeze=False)
    for row, (family, heads) in enumerate(groups):
        for col, (key, title) in enumerate((("fwd_ms", "forward"), ("fwdbwd_ms", "forward+backward"))):
            ax = axes[row][col]
            members = [r for r in ok if tuple(r["heads"]) == heads and r["family"] in (family, "-")]
            for name in dict.fromkeys(r["backend"] for r in members):
                pts = sorted((r["seq_len"], r[key]) for r in members if r["backend"] == name and r.get(key))
                if pts:
                    style = "--" if name in DENSE else "-"
                    ax.plot(*zip(*pts), style, marker="o", label=name, color=_color(name))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("S (tokens)")
            ax.set_ylabel("median ms")
            label = "dense only" if family == "-" else f"{family} routes"
            ax.set_title(f"{title}, {label}, (Hq,Hkv)=({heads[0]},{heads[1]})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _write_outputs(out_dir: str, meta: dict) -> dict:
    records = []
    results = os.path.join(out_dir, "results.jsonl")
    if os.path.exists(results):
        with open(results) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by a kill
    rows = _enrich(records)
    meta = dict(meta)
    plot_note = _plot(rows, os.path.join(out_dir, "bench.png"))
    if plot_note:
        meta["plot"] = plot_note
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(_markdown(rows, meta))
    return {"rows": rows, "meta": meta}


def _summary(rows: list[dict]) -> str:
    header = ["shape", "backend", "status", "fwd ms", "fwd+bwd ms", "fwd+bwd ÷dense", "TFLOP/s fwd",
              "note"]
    table = [[r["shape"], r["backend"], r.get("status", "?"), _cell(r.get("fwd_ms")),
              _cell(r.get("fwdbwd_ms")), _cell(r.get("fwdbwd_vs_dense")),
              _cell(r.get("fwd_tflops"), "{:.3g}"), (r.get("reason") or r.get("fwdbwd_reason") or "")[:70]]
             for r in rows if r.get("status") != "unavailable"]
    hidden = sum(r.get("status") == "unavailable" for r in rows)
    if not table:
        return f"(nothing measured; {hidden} unavailable)"
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header)] + [fmt.format(*r) for r in table]
    if hidden:
        lines.append(f"({hidden} unavailable shape/backend pairs not shown; see bench.md)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- parent
def _parse(argv):
    from .__main__ import _csv, _heads

    p = argparse.ArgumentParser(prog="python -m parity.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=lambda t: tuple(int(x) for x in _csv(t)), default=(8192, 32768, 131072))
    p.add_argument("--heads", type=_heads, default=((24, 2), (12, 1)))
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--families", type=_csv, default=("qsa", "random"))
    p.add_argument("--backends", type=_csv, default=PRIORITY, help=f"comma list of {','.join(PRIORITY)}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-report")
    p.add_argument("--cache-dir", default=os.path.join("/tmp", "qsa-bench-routes"))
    p.add_argument("--replot", metavar="DIR", help="only rebuild bench.json/md/png from DIR/results.jsonl")
    p.add_argument("--prepare-routes", action="store_true",
                   help="only generate the route files into --cache-dir (e.g. while something else runs)")
    p.add_argument("--worker", metavar="PLAN", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = set(_bench_backends())
    bad = [b for b in args.backends if b not in known]
    if bad:
        p.error(f"unknown backends {bad}; expected some of {','.join(sorted(known))}")
    return args


def _gpu_query() -> tuple[str, tuple[int, int] | None]:
    """The first GPU's name and compute capability from nvidia-smi, or ("CPU", None).

    The parent never imports a framework (no CUDA context of its own)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        name, cap = out.stdout.strip().splitlines()[0].rsplit(",", 1)
        major, minor = cap.strip().split(".")
        return name.strip(), (int(major), int(minor))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return "CPU", None


def _statically_unavailable(name: str, shapes: list[Shape], args, capability) -> str | None:
    """The reason a torch backend cannot run any shape on this GPU (known without starting
    a worker: compute capability, dtype, head sizes), or None."""
    from .backends import Case, Environment, static_reason

    backend = _bench_backends()[name]
    if backend.framework != "torch":
        return None
    env = Environment("cuda" if capability else "cpu", capability, "", os.environ.get("TRITON_INTERPRET") == "1")
    reasons = {static_reason(backend, env, Case("padded", shape.family, args.dtype, shape.heads, args.head_dim,
                                                1, shape.seq_len, shape.seq_len, 4 * args.top_k + 4))
               for shape in shapes}
    return reasons.pop() if len(reasons) == 1 and None not in reasons else None


def _route_pool():
    """Processes for route generation (numpy only; spawned, so never a fork of a threaded process)."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(max(1, min(4, (os.cpu_count() or 2) // 2)))


def _start_routes(args, pool) -> tuple[dict[str, str], list]:
    """Submit the generation of every (S, family) route file (smallest S first, so the
    first shapes are ready soon); return {"S/family": path} and the futures."""
    os.makedirs(args.cache_dir, exist_ok=True)
    routes, jobs = {}, []
    for s in sorted(args.seq_lens):
        for family in args.families:
            path = _routes_path(args.cache_dir, s, family, args.top_k, args.seed + s)
            routes[f"{s}/{family}"] = path
            jobs.append(pool.apply_async(_generate_routes, (path, s, family, args.top_k, args.seed + s)))
    return routes, jobs


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        return _worker(args.worker)
    if args.prepare_routes:
        pool = _route_pool()
        try:
            for job in _start_routes(args, pool)[1]:
                print("routes ready:", job.get(), flush=True)
        finally:
            pool.terminate()
        return 0
    if args.replot:
        with open(os.path.join(args.replot, "meta.json")) as f:
            meta = json.load(f)
        print(_summary(_write_outputs(args.replot, meta)["rows"]))
        return 0
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, "meta.json")
    start = time.time()
    end = start + args.time_budget
    device, capability = _gpu_query()
    meta = {"command": "python -m parity.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": device, "date": time.strftime("%Y-%m-%d %H:%M"), "head_dim": args.head_dim,
            "dtype": args.dtype, "top_k": args.top_k, "seq_lens": list(args.seq_lens),
            "heads": [list(h) for h in args.heads], "families": list(args.families),
            "backends": list(args.backends), "time_budget_s": args.time_budget}
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    results = os.path.join(args.out, "results.jsonl")
    open(results, "w").close()
    shapes = _plan(args)
    pool = _route_pool()
    routes, _ = _start_routes(args, pool)
    order = [b for b in PRIORITY if b in args.backends] + [b for b in args.backends if b not in PRIORITY]
    print(f"bench: {len(order)} backends x {len(shapes)} shapes, budget {args.time_budget:.0f} s; "
          f"results in {args.out}/", flush=True)
    if capability is None:  # a CPU smoke run: Triton kernels through the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        for i, name in enumerate(order):
            left = end - time.time()
            share = left / (len(order) - i)
            if share < 5:
                _mark_missing(results, name, shapes, args, "skipped", "the time budget was used up")
                continue
            reason = _statically_unavailable(name, shapes, args, capability)
            if reason is not None:
                print(f"[{i + 1}/{len(order)}] {name}: unavailable here: {reason}", flush=True)
                _mark_missing(results, name, shapes, args, "unavailable", reason)
                continue
            plan = {"backend": name, "shapes": [asdict(s) for s in shapes], "routes": routes,
                    "families": list(args.families), "head_dim": args.head_dim, "dtype": args.dtype,
                    "top_k": args.top_k, "deadline": time.time() + share, "results": results}
            plan_path = os.path.join(args.out, f".plan-{name}.json")
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            print(f"[{i + 1}/{len(order)}] {name}: up to {share:.0f} s", flush=True)
            t0 = time.time()
            status = _run_worker([sys.executable, "-m", "parity.bench", "--worker", plan_path],
                                 env, root, share + _GRACE)
            print(f"  {name}: {status} after {time.time() - t0:.0f} s", flush=True)
            if status != "exit 0":
                _mark_missing(results, name, shapes, args, "not run", f"worker {status}")
            os.remove(plan_path)
            _write_outputs(args.out, meta)
    finally:
        pool.terminate()  # route files still being made are not needed any more
    report = _write_outputs(args.out, meta)
    print(_summary(report["rows"]), flush=True)
    print(f"bench: {time.time() - start:.0f} s; {args.out}/bench.md, bench.json, bench.png", flush=True)
    return 0


def _run_worker(command: list[str], env: dict, cwd: str, timeout: float) -> str:
    """Run a worker in its own process group; kill the whole group (compile workers
    included) if it overruns. Returns "exit N" or why it was stopped."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True)
    try:
        return f"exit {proc.wait(timeout=timeout)}"
    except subprocess.TimeoutExpired:
        status = f"killed after {timeout:.0f} s (its share of the time budget)"
    except KeyboardInterrupt:
        status = "interrupted"
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return status


def _mark_missing(results: str, name: str, shapes: list[Shape], args, status: str, reason: str) -> None:
    """Record the shapes a worker did not report (it died, was killed, or never ran)."""
    done = set()
    with open(results) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("backend") == name:
                done.add((r["seq_len"], tuple(r["heads"])) if name in DENSE else r["shape"])
    framework = _bench_backends()[name].framework
    with open(results, "a") as f:
        for shape in shapes:
            key = (shape.seq_len, shape.heads) if name in DENSE else shape.key()
            if key in done:
                continue
            done.add(key)
            family = "-" if name in DENSE else shape.family
            f.write(json.dumps({"backend": name, "framework": framework,
                                "shape": Shape(shape.seq_len, shape.heads, family).key(),
                                "seq_len": shape.seq_len, "heads": list(shape.heads), "family": family,
                                "head_dim": args.head_dim, "dtype": args.dtype, "status": status,
                                "reason": reason}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
