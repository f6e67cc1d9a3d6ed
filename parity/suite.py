"""The parity matrix: layouts x route families x dtypes x heads x backends.

For every case the inputs are made once, in numpy (routes from
:func:`qsa_common.layouts.make_problem`, q/k/v/dout drawn in float32 and
rounded to the case's dtype), handed unchanged to every backend of both
frameworks, and the results (out, dq, dk, dv) are compared with an oracle
(float64) and with each other, by relative Frobenius error against the
contract's tolerance.
"""

from __future__ import annotations

import gc
import itertools
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from qsa_common.generators import qsa_width
from qsa_common.layouts import make_problem

from .backends import BACKENDS, BITWISE_PAIRS, Backend, Case, Environment, load_reason, static_reason
from .runners import QUANTITIES, CaseInputs, max_abs_diff, oracle, relative_error, run_backend, run_forward_lse

__all__ = ["TOLERANCE", "Config", "Cell", "CrossCell", "BitwiseCell", "SuiteResult", "run_suite", "PRESETS",
           "load_result", "merge_results"]

# The contract's tolerances on ||x - ref|| / ||ref||.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}

# Fragments of exception text after which a CUDA context is unusable.
_DEVICE_LOST = ("illegal memory access", "CUDA error", "CUDA_ERROR", "device-side assert",
                "unspecified launch failure")


@dataclass(frozen=True)
class Config:
    """What to run. ``heads`` is a tuple of (Hq, Hkv); ``top_k`` sets the route
    width 4*top_k+4 of every family; ``batch`` is the padded layout's batch and
    ``world_size`` the CP layout's (the last rank's shard is checked)."""

    layouts: tuple[str, ...]
    families: tuple[str, ...]
    dtypes: tuple[str, ...]
    heads: tuple[tuple[int, int], ...]
    head_dim: int
    seq_len: int
    top_k: int
    batch: int = 2
    world_size: int = 2
    seed: int = 0
    backends: tuple[str, ...] = ()
    time_budget: float | None = None


PRESETS = {
    # a few minutes on a 2-core CPU, interpreted kernels included
    "default": dict(seq_len=32, heads=((4, 2), (2, 1)), head_dim=16, top_k=4,
                    dtypes=("float32", "bfloat16")),
    # CI size: well under a minute on 2 CPU cores
    "quick": dict(seq_len=16, heads=((4, 2),), head_dim=16, top_k=2, dtypes=("float32",)),
    # the H200: the model's shapes
    "gpu": dict(seq_len=8192, heads=((24, 2), (12, 1)), head_dim=256, top_k=512,
                dtypes=("bfloat16",)),
}


@dataclass
class Cell:
    """One backend's result for one quantity of one case."""

    case: dict
    backend: str
    quantity: str
    status: str  # pass | fail | error | unavailable | skipped
    error: float | None = None
    tolerance: float | None = None
    reason: str = ""


@dataclass
class CrossCell:
    """Agreement of two backends on one quantity of one case."""

    case: dict
    first: str
    second: str
    quantity: str
    error: float
    tolerance: float
    status: str


@dataclass
class BitwiseCell:
    """Two backends that launch the same kernels (:data:`parity.backends.BITWISE_PAIRS`)
    on one case: ``max |a - b|`` of the forward's output and LSE (must be 0: ``status``
    is pass only then) and of the backward's dq, dk, dv (reported, not judged: dK/dV
    come from fp32 atomic adds, whose order the GPU picks anew on every run)."""

    case: dict
    first: str
    second: str
    out: float
    lse: float
    backward: dict[str, float]
    status: str
    reason: str = ""


@dataclass
class SuiteResult:
    config: Config
    environment: Environment
    seed: int
    cells: list[Cell] = field(default_factory=list)
    cross: list[CrossCell] = field(default_factory=list)
    bitwise: list[BitwiseCell] = field(default_factory=list)
    backends: dict[str, dict] = field(default_factory=dict)
    oracles: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    complete: bool = False

    @property
    def failures(self) -> int:
        return (sum(c.status in ("fail", "error") for c in self.cells)
                + sum(c.status == "fail" for c in self.cross)
                + sum(c.status in ("fail", "error") for c in self.bitwise))

    def to_json(self) -> dict:
        return {
            "config": asdict(self.config),
            "environment": asdict(self.environment),
            "seed": self.seed,
            "tolerance": TOLERANCE,
            "backends": self.backends,
            "oracles": self.oracles,
            "cells": [asdict(c) for c in self.cells],
            "cross": [asdict(c) for c in self.cross],
            "bitwise": [asdict(c) for c in self.bitwise],
            "timings_s": self.timings,
            "notes": self.notes,
            "elapsed_s": round(self.elapsed, 2),
            "complete": self.complete,
            "failures": self.failures,
        }


def load_result(data: dict) -> SuiteResult:
    """Rebuild a :class:`SuiteResult` from :meth:`SuiteResult.to_json` output."""
    raw = dict(data["config"])
    raw["heads"] = tuple(tuple(h) for h in raw["heads"])
    for name in ("layouts", "families", "dtypes", "backends"):
        raw[name] = tuple(raw[name])
    env = dict(data["environment"])
    env["capability"] = tuple(env["capability"]) if env.get("capability") else None
    result = SuiteResult(Config(**raw), Environment(**env), data["seed"])
    result.cells = [Cell(**c) for c in data["cells"]]
    result.cross = [CrossCell(**c) for c in data["cross"]]
    result.bitwise = [BitwiseCell(**c) for c in data.get("bitwise", [])]
    result.backends = data["backends"]
    result.oracles = data["oracles"]
    result.timings = data["timings_s"]
    result.notes = data["notes"]
    result.elapsed = data["elapsed_s"]
    result.complete = data["complete"]
    return result


def merge_results(parts: Sequence[SuiteResult]) -> SuiteResult:
    """One result from runs over disjoint parts of the matrix (e.g. one per layout).

    The merged config lists the union of layouts, families, dtypes and heads; the
    elapsed time is the longest part's (the parts ran in parallel)."""
    first = parts[0]
    union = lambda name: tuple(dict.fromkeys(x for p in parts for x in getattr(p.config, name)))  # noqa: E731
    config = Config(**{**asdict(first.config), "layouts": union("layouts"), "families": union("families"),
                       "dtypes": union("dtypes"), "heads": union("heads"),
                       "backends": union("backends")})
    merged = SuiteResult(config, first.environment, first.seed)
    for part in parts:
        merged.cells += part.cells
        merged.cross += part.cross
        merged.bitwise += part.bitwise
        merged.oracles.update(part.oracles)
        merged.timings.update(part.timings)
        merged.notes += part.notes
        for name, info in part.backends.items():
            if name not in merged.backends or info["status"] != "available":
                merged.backends[name] = info
    merged.elapsed = max(p.elapsed for p in parts)
    merged.complete = all(p.complete for p in parts)
    return merged


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of ``x`` holding only values representable in ``dtype``."""
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x.astype(dtype).astype(np.float32)


def make_cases(config: Config) -> list[Case]:
    """All cases in run order: heads, layout, dtype, then family (so inputs and
    compiled kernels of one shape are reused across families)."""
    width = qsa_width(config.top_k)
    cases = []
    for heads, layout, dtype, family in itertools.product(
        config.heads, config.layouts, config.dtypes, config.families
    ):
        batch = config.batch if layout == "padded" else 1
        s_q = config.seq_len // config.world_size if layout == "cp" else config.seq_len
        cases.append(Case(layout, family, dtype, tuple(heads), config.head_dim, batch, s_q,
                          config.seq_len, width))
    return cases


class _Inputs:
    """Routes per (layout, family) and random tensors per (layout, heads, dtype),
    generated once from the suite's seed."""

    def __init__(self, config: Config, seed: int):
        self.config = config
        self.seed = seed
        self._routes: dict[tuple[str, str], np.ndarray] = {}
        self._tensors: tuple[tuple, tuple] | None = None

    def _rng(self, *key: str) -> np.random.Generator:
        words = [self.seed] + [int.from_bytes(k.encode()[:8].ljust(8, b"\0"), "little") for k in key]
        return np.random.default_rng(words)

    def routes(self, case: Case) -> np.ndarray:
        key = (case.layout, case.family)
        if key not in self._routes:
            c = self.config
            rank = c.world_size - 1
            seed = int(self._rng("routes", *key).integers(2**31))
            problem = make_problem(case.layout, case.family, seed=seed, seq_len=c.seq_len,
                                   top_k=c.top_k, batch=c.batch, world_size=c.world_size, rank=rank)
            self._routes[key] = problem.routes
        return self._routes[key]

    def get(self, case: Case) -> CaseInputs:
        routes = self.routes(case)
        key = (case.layout, case.heads, case.dtype)
        if self._tensors is None or self._tensors[0] != key:
            self._tensors = None
            rng = self._rng("tensors", case.layout, f"{case.heads}", case.dtype)
            b, s_q, _ = routes.shape
            hq, hkv = case.heads
            d = case.head_dim
            shapes = ((b, s_q, hq, d), (b, case.kv_length, hkv, d), (b, case.kv_length, hkv, d),
                      (b, s_q, hq, d))
            arrays = tuple(round_to_dtype(rng.standard_normal(s, dtype=np.float32), case.dtype)
                           for s in shapes)
            self._tensors = (key, arrays)
        q, k, v, do = self._tensors[1]
        # not the default 1/sqrt(D), so a backend that ignores softmax_scale fails
        return CaseInputs(q, k, v, do, routes, 0.77 * case.head_dim ** -0.5)


def _device_lost(message: str) -> bool:
    return any(fragment in message for fragment in _DEVICE_LOST)


def _on_gpu(backend: Backend, env: Environment) -> bool:
    return env.torch_device == "cuda" if backend.framework == "torch" else env.jax_platform == "gpu"


def _free_device_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


class _Runner:
    """Runs the cases one by one, remembering what cannot run at all (``broken``)
    and whether a GPU context was lost (then no later GPU work is attempted)."""

    def __init__(self, config: Config, env: Environment, result: SuiteResult):
        self.config = config
        self.env = env
        self.result = result
        self.backends = [BACKENDS[n] for n in (config.backends or tuple(BACKENDS))]
        for b in self.backends:
            result.backends[b.name] = {"framework": b.framework, "description": b.description,
                                       "status": "available", "reason": ""}
        self.broken: dict[str, str] = {}
        self.device_lost = ""

    def _cells(self, label: dict, backend: str, status: str, reason: str) -> None:
        for q in QUANTITIES:
            self.result.cells.append(Cell(label, backend, q, status, reason=reason))

    def _mark_broken(self, name: str, reason: str) -> str:
        """Record that backend ``name`` cannot run at all here (import or runtime missing)."""
        self.broken[name] = reason
        self.result.backends[name].update(status="unavailable", reason=reason)
        return reason

    def _reason(self, b: Backend, case: Case) -> str | None:
        """Why ``b`` does not run ``case``, or None (imports the backend on first use)."""
        reason = self.broken.get(b.name) or static_reason(b, self.env, case)
        if reason is None and self.device_lost and _on_gpu(b, self.env):
            reason = f"not run: {self.device_lost}"
        if reason is None:
            load_error = load_reason(b)
            if load_error:
                reason = self._mark_broken(b.name, f"unavailable: {load_error}")
        return reason

    def _run(self, b: Backend, case: Case, inputs: CaseInputs, label: dict):
        """``(results, grad_reason)``, or None when the cells were recorded as not measured."""
        grad_reason = ""
        try:
            try:
                return run_backend(b, inputs, case.dtype, backward=True), grad_reason
            except NotImplementedError as err:
                if _on_gpu(b, self.env):  # every backend has a backward on the GPU
                    raise RuntimeError(f"backward raised NotImplementedError on the GPU: {err}") from err
                grad_reason = f"no backward here ({err}); checked on GPU only"
                return run_backend(b, inputs, case.dtype, backward=False), grad_reason
        except ImportError as err:  # an optional runtime imported on first call
            self._cells(label, b.name, "unavailable",
                        self._mark_broken(b.name, f"unavailable: {type(err).__name__}: {err}"))
        except NotImplementedError as err:
            # the backend's static checks said it supports this case: refusing it is a failure
            self._cells(label, b.name, "error", f"NotImplementedError: {err}")
        except Exception as err:  # noqa: BLE001 -- every other exception is a failure of this cell
            message = f"{type(err).__name__}: {err}"
            if _on_gpu(b, self.env) and _device_lost(message):
                self.device_lost = f"the device context was lost after {b.name} on {case.label()}"
                self.result.notes.append(self.device_lost)
            self._cells(label, b.name, "error", message[:500])
            self.result.notes.append(f"{b.name} {case.label()}: "
                                     + "".join(traceback.format_exception(err))[-2000:])
        return None

    def case(self, case: Case, inputs: CaseInputs) -> None:
        result, label, tol = self.result, asdict(case), TOLERANCE[case.dtype]
        runnable = []
        for b in self.backends:
            reason = self._reason(b, case)
            if reason is None:
                runnable.append(b)
            else:
                self._cells(label, b.name, "skipped" if reason.startswith("not run") else "unavailable",
                            reason)
        if not runnable:
            return
        t0 = time.monotonic()
        want, result.oracles[case.label()] = oracle(inputs)
        result.timings[f"{case.label()}/oracle"] = round(time.monotonic() - t0, 3)
        got: dict[str, tuple] = {}
        for b in runnable:
            t0 = time.monotonic()
            ran = self._run(b, case, inputs, label)
            if ran is None:
                continue
            res, grad_reason = ran
            result.timings[f"{case.label()}/{b.name}"] = round(time.monotonic() - t0, 3)
            got[b.name] = res
            for q, value, ref in itertools.zip_longest(QUANTITIES, res, want):
                if value is None:
                    result.cells.append(Cell(label, b.name, q, "unavailable", reason=grad_reason))
                else:
                    err = relative_error(value, ref)
                    result.cells.append(Cell(label, b.name, q, "pass" if err < tol else "fail", err, tol))
        for first, second in itertools.combinations(got, 2):
            for q, a, c in zip(QUANTITIES, got[first], got[second]):
                err = relative_error(c, a)
                result.cross.append(CrossCell(label, first, second, q, err, tol,
                                              "pass" if err < tol else "fail"))
        for first, second in BITWISE_PAIRS:
            if first in got and second in got:
                self.bitwise(case, inputs, label, first, second, got)

    def bitwise(self, case: Case, inputs: CaseInputs, label: dict, first: str, second: str, got: dict) -> None:
        """The forward's out and LSE of two backends launching the same kernels, compared
        bit for bit (max |diff|), and their backward's max |diff| as measured above."""
        backward = {q: max_abs_diff(a, b) for q, a, b in zip(QUANTITIES[1:], got[first][1:], got[second][1:])}
        try:
            (out_a, lse_a), (out_b, lse_b) = (run_forward_lse(BACKENDS[name], inputs, case.dtype)
                                              for name in (first, second))
        except Exception as err:  # noqa: BLE001 -- a failure of this comparison, recorded as such
            self.result.bitwise.append(BitwiseCell(label, first, second, float("nan"), float("nan"), backward,
                                                   "error", f"{type(err).__name__}: {err}"[:500]))
            return
        out, lse = max_abs_diff(out_a, out_b), max_abs_diff(lse_a, lse_b)
        status = "pass" if out == 0.0 and lse == 0.0 else "fail"
        self.result.bitwise.append(BitwiseCell(label, first, second, out, lse, backward, status))


def run_suite(
    config: Config,
    *,
    env: Environment | None = None,
    on_case: Callable[[int, int, Case, SuiteResult], None] | None = None,
) -> SuiteResult:
    """Run the matrix; ``on_case(i, n, case, result)`` is called after each case
    (progress display, incremental report writing)."""
    env = env or Environment.detect()
    result = SuiteResult(config, env, config.seed)
    runner = _Runner(config, env, result)
    inputs = _Inputs(config, config.seed)
    start = time.monotonic()
    cases = make_cases(config)
    for i, case in enumerate(cases):
        if config.time_budget is not None and time.monotonic() - start > config.time_budget:
            for b in runner.backends:
                runner._cells(asdict(case), b.name, "skipped",
                              f"not run: the time budget of {config.time_budget:.0f} s was used up")
        else:
            runner.case(case, inputs.get(case))
            _free_device_memory()
        result.elapsed = time.monotonic() - start
        if on_case:
            on_case(i, len(cases), case, result)
    result.complete = True
    return result
