"""``python -m parity.bench``: every QSA backend of both frameworks, timed side by side
with dense causal attention in the same run.

For each shape (S, (Hq, Hkv), route set; B=1, D=256, bf16, QSA-format routes
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
  is_causal=True)``), and for JAX route-sparse backends the ratio to torch Triton;
* for torch Triton, each piece on its own (:func:`_triton_pieces`): route unions,
  forward kernel, backward kernel from the forward's residuals;
* of every route set it times: the measured mean adjacent-row Jaccard and the
  tile-union inflation of the kernels' tilings (:mod:`parity.bench_routes`).

Overlap sweep: ``--overlaps 0.3,0.6,0.8,0.9`` adds QSA-format route sets whose
adjacent-row Jaccard targets those values (the generator's ``overlap`` knob; the
report gives the measured value) at every ``--seq-lens``; ``--overlaps-at
32768=0.3,0.6,0.8,0.9`` does so at one S only. With either, ``--families``
defaults to none (name ``qsa`` there to time the default routes as well).

Robustness: each backend runs in its own subprocess (a crash, an OOM or a hung
kernel costs that backend only, and its memory is returned), gets a fair share of
the remaining time budget, skips shapes it would not finish in time and larger
shapes after an OOM, and appends every result to ``results.jsonl`` as soon as it
has it. The parent writes ``bench.json``, ``bench.md`` and ``bench.png`` (and
``bench-overlap.png`` for a sweep; :mod:`parity.bench_report`) after every backend;
``--replot DIR`` rebuilds them from ``DIR/results.jsonl``. Routes and their
statistics are generated once per (S, route set), in background processes, into
``--cache-dir`` (reused by later runs with the same parameters).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
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

from . import bench_routes
from .bench_report import DENSE, PRIORITY
from .bench_report import console_summary as _summary
from .bench_report import enrich as _enrich  # noqa: F401  (tests/test_parity.py reaches it here)
from .bench_report import write_outputs as _write_outputs

__all__ = ["main", "PRIORITY", "Shape"]

_L2_FLUSH_BYTES = 256 << 20
_TARGET_SECONDS = 1.0  # measured time per quantity, before the repetition cap
_REPS = (3, 20)  # min and max timed repetitions
_GRACE = 45.0  # seconds a worker may overrun its share before it is killed


@dataclass(frozen=True)
class Shape:
    seq_len: int
    heads: tuple[int, int]
    family: str  # route set label (bench_routes.parse_label); dense baselines ignore routes

    def key(self) -> str:
        return f"S={self.seq_len}/{self.heads[0]}:{self.heads[1]}/{self.family}"


# ----------------------------------------------------------------------------- planning
def _route_sets(args) -> dict[int, list[str]]:
    """The route set labels timed at each S: ``--families``, then the overlap sets
    (``--overlaps-at`` for its S, else ``--overlaps``)."""
    return {s: list(args.families) + [bench_routes.overlap_label(j)
                                      for j in args.overlaps_at.get(s, args.overlaps)]
            for s in args.seq_lens}


def _plan(args) -> list[Shape]:
    """Shapes in run order: route set (in order of first appearance, smallest S first),
    heads, then ascending S (each backend's time-budget estimate extrapolates from the
    previous S of the same route set and heads)."""
    sets = _route_sets(args)
    labels = list(dict.fromkeys(label for s in sorted(sets) for label in sets[s]))
    return [Shape(s, h, label) for label in labels for h in args.heads for s in sorted(sets)
            if label in sets[s]]


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
    table["jax-triton"] = Backend("jax-triton", "jax", _jax_triton, dtypes=("bfloat16", "float16", "float32"),
                                  requires=lambda env, case: None if env.jax_platform == "gpu"
                                  else "needs JAX on a CUDA GPU (Triton kernels through jax_triton)",
                                  description='qsa_jax.sparse_gqa_attention(implementation="triton")')
    table.update(BACKENDS)  # the parity suite's own registration of a name wins
    return table


@functools.cache
def _jax_triton():
    """``qsa_jax.sparse_gqa_attention(..., implementation="triton")``; ImportError (so the
    backend shows as unavailable, with the reason) where this checkout has no such
    implementation or jax_triton is not installed."""
    attention = importlib.import_module("qsa_jax.attention")
    if "triton" not in getattr(attention, "IMPLEMENTATIONS", {}):
        raise ImportError('qsa_jax.sparse_gqa_attention has no implementation="triton" in this checkout')
    importlib.import_module("jax_triton")
    return functools.partial(attention.sparse_gqa_attention, implementation="triton")


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
    result = _add_fwdbwd(result, timer, lambda: _measure(timer, step, before=clear, deadline=deadline),
                         may_lack_backward=True)
    if backend.name in PIECES:
        q, k, v = (t.detach() for t in leaves)
        try:
            result.update(PIECES[backend.name](q, k, v, do, routes, scale, timer, deadline))
        except Exception as err:  # noqa: BLE001 -- the whole-op figures stand without the pieces
            if "illegal memory access" in str(err) or "CUDA error" in str(err):
                raise
            result["pieces_reason"] = f"{type(err).__name__}: {str(err)[:200]}"
    return result


# Names the torch Triton module would need for the unions and the forward kernel to be
# timed apart (today: forward_with_residuals = unions + forward kernel).
_UNIONS_ENTRY, _FORWARD_ENTRY = "route_unions", "forward_from_unions"


def _triton_pieces(q, k, v, do, routes, scale, timer, deadline) -> dict:
    """torch Triton piece by piece, with its public residual form: unions + forward kernel
    (``forward_with_residuals``) and the backward kernel (``backward_from_residuals``);
    the unions alone and the forward kernel alone where ``qsa_torch.triton_qsa`` offers
    ``route_unions(query, key, selected_token_ids) -> (union, count, rowbits)`` and
    ``forward_from_unions(query, key, value, union, count, rowbits, softmax_scale, top_k)
    -> (out, lse)`` (else the forward kernel is unions+forward minus unions, or not split)."""
    import torch

    from qsa_torch import triton_qsa

    top_k = routes.shape[2]
    result = {}
    with torch.no_grad():
        both = functools.partial(triton_qsa.forward_with_residuals, q, k, v, routes, scale)
        result["piece_unions_fwd_ms"] = _measure(timer, both, deadline=deadline)["median_ms"]
        out, lse, *unions = both()
        result.update(_union_traffic(q, k, unions[1]))
        backward = functools.partial(triton_qsa.backward_from_residuals, do, q, k, v, out, lse, *unions,
                                     scale, top_k)
        result["piece_bwd_ms"] = _measure(timer, backward, deadline=deadline)["median_ms"]
        build = getattr(triton_qsa, _UNIONS_ENTRY, None)
        forward = getattr(triton_qsa, _FORWARD_ENTRY, None)
        if build is not None:
            result["piece_unions_ms"] = _measure(timer, lambda: build(q, k, routes),
                                                 deadline=deadline)["median_ms"]
        if forward is not None:
            result["piece_fwd_ms"] = _measure(timer, lambda: forward(q, k, v, *unions, scale, top_k),
                                              deadline=deadline)["median_ms"]
        elif build is not None:
            result["piece_fwd_ms"] = result["piece_unions_fwd_ms"] - result["piece_unions_ms"]
            result["piece_fwd_by_difference"] = True
    missing = [name for name, fn in ((_UNIONS_ENTRY, build), (_FORWARD_ENTRY, forward)) if fn is None]
    if missing:
        result["pieces_note"] = f"qsa_torch.triton_qsa has no {' / '.join(missing)}: " + (
            "forward kernel by difference" if build is not None else "unions and forward kernel timed together")
    return result


def _union_traffic(q, k, count) -> dict:
    """Bytes the kernels move per union ID, from the forward's union ``count`` ``[B, n_tiles]``:
    every program gathers one K and one V row per ID of its union, once per KV head
    (``gather_bytes``, forward kernel); a flat plan's backward walks the same programs,
    gathers the same rows and adds a [2, D] fp32 dK/dV block per ID (``bwd_add_bytes``;
    absent for padded plans, whose backward tiles are cut finer)."""
    from qsa_torch import triton_qsa
    from qsa_triton.plan import default_plan

    hkv, head_dim = k.shape[2], q.shape[3]
    ids = int(count.sum()) * hkv
    result = {"union_ids": ids, "gather_bytes": ids * 2 * head_dim * q.element_size()}
    blocks = triton_qsa.default_block_sizes(q.device, head_dim, q.dtype)
    if default_plan(q.shape[2] // hkv, head_dim, blocks, q.shape[1]).flat:  # the plan the op ran
        result["bwd_add_bytes"] = ids * 2 * head_dim * 4
    return result


PIECES = {"triton": _triton_pieces}


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
    except Exception as err:  # noqa: BLE001 -- keep the forward figures when only the backward OOMs
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


def _route_fields(stats: dict, shape: Shape) -> dict:
    """What a result records of its route set: the overlap target, the measured Jaccard
    and the inflation of each tiling at this shape's head group."""
    group = str(shape.heads[0] // shape.heads[1])
    return {"overlap_target": stats.get("target"), "jaccard": stats.get("jaccard"),
            "jaccard_all": stats.get("jaccard_all"), "inflation": stats["inflation"].get(group)}


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
        case = Case("padded", bench_routes.parse_label(shape.family)[0] if not dense else "qsa", plan["dtype"],
                    shape.heads, plan["head_dim"], 1, shape.seq_len, shape.seq_len, 4 * plan["top_k"] + 4)
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
            if not _wait_for(bench_routes.stats_path(path), deadline):  # written after the routes
                emit({**base, "status": "skipped", "reason": "routes were not ready within the time budget"})
                continue
            routes_np = np.load(path)
            base.update(_route_fields(bench_routes.load_stats(path), shape))
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
        except Exception as err:  # noqa: BLE001 -- record and go on with the next shape
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


# ----------------------------------------------------------------------------- parent
def _parse(argv):
    from .__main__ import _csv, _heads

    p = argparse.ArgumentParser(prog="python -m parity.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=lambda t: tuple(int(x) for x in _csv(t)), default=(8192, 32768, 131072))
    p.add_argument("--heads", type=_heads, default=((24, 2), (12, 1)))
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--families", type=_csv, default=None,
                   help="route sets: families (qsa, random, adversarial) or qsa@J labels; default qsa,random "
                        "(none with --overlaps/--overlaps-at)")
    p.add_argument("--overlaps", type=_overlap_list, default=(),
                   help="adjacent-row Jaccard targets of extra QSA-format route sets at every S, "
                        "e.g. 0.3,0.6,0.8,0.9")
    p.add_argument("--overlaps-at", action="append", default=[], metavar="S=J1,J2",
                   help="overlap targets at one S (repeatable; replaces --overlaps there; adds S to --seq-lens)")
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
    try:
        items, args.overlaps_at = args.overlaps_at, {}
        for item in items:
            s, sep, targets = item.partition("=")
            if not sep or not s.strip().isdigit() or int(s) < 1:
                raise ValueError(f"--overlaps-at takes S=J1,J2,..., got {item!r}")
            args.overlaps_at[int(s)] = _overlap_list(targets)
        if args.families is None:
            args.families = () if args.overlaps or args.overlaps_at else ("qsa", "random")
        from qsa_common.generators import FAMILIES

        for label in args.families:
            if bench_routes.parse_label(label)[0] not in FAMILIES:
                raise ValueError(f"unknown route family {label!r}; expected one of {FAMILIES} or qsa@J")
    except (ValueError, argparse.ArgumentTypeError) as err:
        p.error(str(err))
    args.seq_lens = tuple(sorted(set(args.seq_lens) | set(args.overlaps_at)))
    if not any(_route_sets(args).values()):
        p.error("no route sets to time: give --families, --overlaps or --overlaps-at")
    known = set(_bench_backends())
    bad = [b for b in args.backends if b not in known]
    if bad:
        p.error(f"unknown backends {bad}; expected some of {','.join(sorted(known))}")
    return args


def _overlap_list(text: str) -> tuple[float, ...]:
    """``"0.3,0.6"`` -> (0.3, 0.6); each target in (0, 1)."""
    try:
        targets = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"overlap targets must be numbers, got {text!r}") from None
    if not targets or not all(0.0 < j < 1.0 for j in targets):
        raise argparse.ArgumentTypeError(f"overlap targets must be in (0, 1), got {text!r}")
    return targets


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
    """The reason a backend cannot run any shape on this machine, known without starting
    a worker (torch backends: compute capability, dtype, head sizes; jax-triton: its
    runtime is not installed), or None."""
    from .backends import Case, Environment, static_reason

    if name == "jax-triton" and importlib.util.find_spec("jax_triton") is None:
        return "jax_triton is not installed (the GPU wheel bundle carries it)"
    backend = _bench_backends()[name]
    if backend.framework != "torch":
        return None
    env = Environment("cuda" if capability else "cpu", capability, "", os.environ.get("TRITON_INTERPRET") == "1")
    reasons = {static_reason(backend, env, Case("padded", bench_routes.parse_label(shape.family)[0], args.dtype,
                                                shape.heads, args.head_dim, 1, shape.seq_len, shape.seq_len,
                                                4 * args.top_k + 4))
               for shape in shapes}
    return reasons.pop() if len(reasons) == 1 and None not in reasons else None


def _start_routes(args, pool) -> tuple[dict[str, str], list]:
    """Submit the generation of every (S, route set) route file and its statistics
    (smallest S first, so the first shapes are ready soon); return {"S/label": path}
    and the futures."""
    os.makedirs(args.cache_dir, exist_ok=True)
    groups = tuple(sorted({hq // hkv for hq, hkv in args.heads}))
    routes, jobs = {}, []
    for s, labels in sorted(_route_sets(args).items()):
        for label in labels:
            path = bench_routes.routes_path(args.cache_dir, s, label, args.top_k, args.seed + s)
            routes[f"{s}/{label}"] = path
            jobs.append(pool.apply_async(bench_routes.generate,
                                         (path, s, label, args.top_k, args.seed + s, groups)))
    return routes, jobs


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        return _worker(args.worker)
    if args.prepare_routes:
        pool = bench_routes.pool()
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
            "route_sets": {str(s): labels for s, labels in sorted(_route_sets(args).items())},
            "backends": list(args.backends), "time_budget_s": args.time_budget}
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    results = os.path.join(args.out, "results.jsonl")
    open(results, "w").close()
    shapes = _plan(args)
    pool = bench_routes.pool()
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
