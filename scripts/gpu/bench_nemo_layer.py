"""One training step of nemo-automodel's Qwen3.8-Flash-Next QSA layer on the H200, three ways.

    python3 scripts/gpu/bench_nemo_layer.py --out DIR [--seq-lens 8192 32768] [--hidden-rho 0 0.9 0.99]
        [--iters 5] [--warmup 2] [--kernel-iters 10] [--time-budget 250] [--variants flex cute qsa_torch]
        [--qsa-backend auto] [--cute-preprocess compiled] [--stack-dump-s 0]

Needs nemo-automodel 0.7.0 and its import closure (transformers, ...); ``cute`` needs
``flash_attn.cute`` (flash-attn-4 and the CuTe DSL), else it is reported unavailable
with the error. ``--dry-run`` checks the plumbing on CPU (small layer, S=150 unless
``--seq-lens`` is given, fp32).

The layer: ``Qwen3_8_FlashNextQSAAttention`` at the real config (hidden 2560, 24/2
heads, head_dim 256, indexer 4 x 128, budget 2048, ratio 4, config defaults otherwise),
upstream's initialisation, bf16 as upstream builds it (norm weights fp32), B = 1, no
padding. One step = forward of the whole layer (indexer, projections, norms, RoPE,
sparse GQA, gate, output projection) and backward from a fixed random ``grad_out``.

Hidden states, per ``--hidden-rho`` value rho: an AR(1) process along the sequence,
``x_0 = e_0``, ``x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t``, ``e`` standard normal (unit
variance per channel; rho = 0: independent tokens); every rho of one S shares ``e`` and
``grad_out``. Variants, all on the same weights and inputs:

* ``flex``: upstream with ``backend.attn = "flex"`` (builds its FlexAttention mask in
  ``_select_routes``, attention through its compiled ``flex_attention``);
* ``cute``: upstream with ``backend.attn = "cute"`` (FA4 block-sparse, SM90);
* ``qsa_torch``: the ``flex``-configured layer under ``use_qsa_torch(layer, "auto")``
  (run first, so that it is measured even if the time budget runs out).

Per variant, S and rho: warm-up steps first (they absorb compilation: upstream's
``torch.compile`` of flex_attention per shape, FA4's and Triton's JIT; each one's wall
seconds are logged and kept as ``warmup_step_s``), then

1. ``step_ms``: median of ``--iters`` steps timed with CUDA events around the whole step,
   the layer exactly as a user runs it (no instrumentation);
2. ``peak_gib``: peak allocated memory during one such step, above what was allocated
   before it (activations and workspaces; weights and inputs excluded);
3. the breakdown, from ``--iters`` more steps with CUDA events inside the layer (medians):
   ``attn_fwd`` around the layer's ``qsa_gqa_attention(...)`` call; ``attn_bwd`` from the
   moment autograd hands the gradient to the attention output to the moment it has
   produced dQ, dK and dV (two identity autograd nodes record the events; autograd runs
   the layer's backward in reverse creation order on one stream, and every node between
   them belongs to the attention); ``indexer`` around the indexer module's forward;
   ``flex_mask`` around upstream's ``build_flex_qsa_mask`` (flex only); ``other`` = the
   instrumented step minus those, i.e. projections, norms, RoPE, gate and their
   gradients. The spans include host time between the launches they contain (e.g. a
   host sync), which is part of the step's cost;
4. agreement with the ``flex`` run: ``||x - x_flex|| / ||x_flex||`` for the output, the
   input gradient and every trainable parameter's gradient, and whether the routes
   the indexer produced were identical.

Per S and rho, from the routes of the ``qsa_torch`` run's last instrumented step (on
the host, after the timed steps; :mod:`qsa_common.route_stats`): ``jaccard``, the mean
adjacent-row Jaccard past the identity region (rows ``4 * budget / ratio + 3`` on, as
``python -m parity.bench`` reports it; ``jaccard_all``: all rows), and ``inflation``, the
union inflation of programs of 128 (row, head) pairs at G = Hq / Hkv. ``kernel_alone``:
``qsa_torch.sparse_gqa_attention`` (``--qsa-backend``, ``route_format="qsa"``) alone on
those routes with random contiguous q/k/v/grad of the layer's attention shapes and dtype
(``layer_qkv_contiguous``: whether the layer's were), forward and forward+backward
medians of ``--kernel-iters`` CUDA-event timings, the L2 flushed before each (as
``python -m parity.bench``); ``attn_vs_kernel`` = the layer's ``attn`` / that
forward+backward.

Writes ``bench_nemo_layer.json`` and ``bench_nemo_layer.md`` under ``--out`` and prints
the table and, per S and rho, the route statistics and step ratios last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
for path in (ROOT, HERE):  # the repository; HERE for layer_timing also when this file is loaded by path
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
from layer_timing import Spans, new_event, synchronize, timed_dispatch, timed_function  # noqa: E402

UPSTREAM = "nemo_automodel.components.models.qwen3_8_flash_next"
# qsa_torch first: the measurement that matters most runs even if the budget runs out
VARIANTS = ("qsa_torch", "flex", "cute")
START = time.time()
# the real layer at config defaults; RoPE: default type, rotary width 64 (3 text streams)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10]}
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, indexer_n_heads=2,
             indexer_head_dim=32, indexer_budget=32, indexer_compress_ratio=4,
             rope_parameters={**ROPE, "mrope_section": [4, 2, 2]})


def log(*args) -> None:
    print(f"[{time.time() - START:6.1f}s]", *args, flush=True)


@dataclasses.dataclass
class Setup:
    config: object  # upstream's text config
    layer: torch.nn.Module
    backend: object  # upstream's backend config of the layer (attn="flex")
    spans: Spans
    upstream_dispatch: object
    device: torch.device
    restore: object  # undoes the instrumentation of upstream's module


def build(args) -> Setup:
    """The layer (seeded), instrumentation hooks that stay passive until ``spans.active``."""
    import importlib

    config_mod = importlib.import_module(f"{UPSTREAM}.config")
    backend_mod = importlib.import_module(f"{UPSTREAM}.backend")
    layers = importlib.import_module(f"{UPSTREAM}.layers")
    device = torch.device("cpu" if args.dry_run else "cuda")
    overrides = dict(SMALL, dtype="float32") if args.dry_run else {"rope_parameters": ROPE}
    config = config_mod.Qwen3_8_FlashNextTextConfig(**overrides)
    backend = backend_mod.Qwen3_8_FlashNextBackendConfig(attn="flex")
    torch.manual_seed(args.seed)
    layer = layers.Qwen3_8_FlashNextQSAAttention(config, 3, backend)
    layer.init_weights(torch.device("cpu"))
    layer = (layer.float() if args.dry_run else layer).to(device)
    spans = Spans(device)

    def indexer_started(*_):
        if spans.active:
            spans.open("indexer")[0].record()

    def indexer_finished(*_):
        if spans.active:
            spans.pairs["indexer"][-1][1].record()

    layer.indexer.register_forward_pre_hook(indexer_started)
    layer.indexer.register_forward_hook(indexer_finished)
    # upstream's _select_routes looks the mask builder up in layers.py at call time
    builder = layers.build_flex_qsa_mask
    layers.build_flex_qsa_mask = timed_function(builder, spans, "flex_mask")
    restore = lambda: setattr(layers, "build_flex_qsa_mask", builder)  # noqa: E731
    return Setup(config, layer, backend, spans, layers.qsa_gqa_attention, device, restore)


def rotary(config, seq: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    from nemo_automodel.components.models.qwen3_5_moe.model import Fp32SafeQwen3_5MoeTextRotaryEmbedding

    rope = Fp32SafeQwen3_5MoeTextRotaryEmbedding(config=config).to(device)
    positions = torch.arange(seq, device=device).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = rope(torch.empty(0, device=device, dtype=dtype), positions)
    half = cos.shape[-1] // 2
    return torch.cat((cos[..., :half], sin[..., :half]), dim=-1)


def hidden_states(seq: int, hidden: int, rho: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, grad_out)`` float32 ``[1, seq, hidden]`` on the host: x an AR(1) process along the
    sequence with unit stationary variance (independent for rho = 0), grad_out independent;
    the noise depends on (seed, seq) only."""
    gen = torch.Generator().manual_seed(seed + seq)
    x = torch.randn(1, seq, hidden, generator=gen)
    grad_out = torch.randn(1, seq, hidden, generator=gen)
    if rho:
        spread = (1.0 - rho * rho) ** 0.5
        for t in range(1, seq):
            x[:, t].mul_(spread).add_(x[:, t - 1], alpha=rho)
    return x, grad_out


def route_statistics(routes: torch.Tensor, config) -> dict:
    """Adjacent-row Jaccard and 128-pair union inflation of the layer's routes (host)."""
    from qsa_common.route_stats import FLAT_128, route_stats

    ids = routes.detach().cpu().numpy()
    seq = ids.shape[1]
    group = config.num_attention_heads // config.num_key_value_heads
    top_k = config.indexer_budget // config.indexer_compress_ratio
    first_row = min(4 * top_k + 3, seq - 1)
    stats = route_stats(ids, seq, groups=(group,), tilings=(FLAT_128,), first_row=first_row)
    return {"jaccard": stats["jaccard"], "jaccard_all": stats["jaccard_all"], "jaccard_first_row": first_row,
            "inflation": stats["inflation"][group][FLAT_128.label], "group": group, "route_width": ids.shape[-1]}


def kernel_alone(setup: Setup, captured: dict, args) -> dict:
    """``qsa_torch.sparse_gqa_attention`` alone on the layer's routes, attention shapes and
    dtype (random q/k/v/grad): forward and forward+backward medians, L2 flushed before each."""
    from qsa_torch import sparse_gqa_attention

    device, routes = setup.device, captured["routes"]
    q_shape, kv_shape, dtype, scale, contiguous = captured["call"]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=gen)
                   for shape in (q_shape, kv_shape, kv_shape, q_shape))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def forward():
        return sparse_gqa_attention(*leaves, routes, scale, backend=args.qsa_backend, route_format="qsa")

    result: dict = {"backend": args.qsa_backend, "iters": args.kernel_iters, "layer_qkv_contiguous": contiguous}
    with qsa_messages() as messages:
        for name, fn in (("fwd_ms", forward), ("fwdbwd_ms", lambda: forward().backward(do))):
            times = []
            for i in range(args.kernel_iters + 1):  # the first call absorbs compilation
                for t in leaves:
                    t.grad = None
                if flush is not None:
                    flush.zero_()
                start, end = new_event(device), new_event(device)
                start.record()
                fn()
                end.record()
                synchronize(device)
                if i:
                    times.append(start.elapsed_time(end))
            result[name] = statistics.median(times)
    result["ran"] = ran_backends(messages)
    return result


def train_step(layer, x, grad_out, freqs):
    layer.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    out = layer(leaf, freqs_cis=freqs)
    out.backward(grad_out)
    return out, leaf


def routes_for(setup: Setup, variant: str, args, instrumented: bool):
    """The route a variant runs under: none (plain upstream), use_qsa_torch, or a timing route."""
    from qsa_torch.integrations.nemo_automodel import qsa_torch_dispatch, route_qsa_attention, use_qsa_torch

    if variant == "qsa_torch":
        if not instrumented:
            return use_qsa_torch(setup.layer, args.qsa_backend)
        ours = qsa_torch_dispatch(args.qsa_backend, setup.upstream_dispatch)
        return route_qsa_attention(setup.layer, timed_dispatch(ours, setup.spans))
    if not instrumented:
        return contextlib.nullcontext()
    return route_qsa_attention(setup.layer, timed_dispatch(setup.upstream_dispatch, setup.spans),
                               build_flex_mask=True)


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        line = record.getMessage()
        if line not in self.lines:
            self.lines.append(line)


@contextlib.contextmanager
def qsa_messages():
    """The distinct messages of the ``qsa_torch`` logger (DEBUG and up) while active."""
    handler, logger = _Messages(), logging.getLogger("qsa_torch")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def ran_backends(lines: list[str]) -> list[str]:
    return sorted({line.split("ran backend ")[1] for line in lines if "ran backend " in line})


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    norm = float(e.norm())
    return float((a - e).norm()) / norm if norm > 0 else float((a - e).norm())


@contextlib.contextmanager
def cute_preprocess(variant: str, mode: str):
    """With ``mode`` "eager", upstream's FA4 route preprocessing (``fa4_qsa._preprocess``,
    ``torch.compile``'d upstream) runs uncompiled for the ``cute`` variant: on the H200
    host (torch 2.11, Triton 3.6) ptxas was still compiling its Inductor kernels after
    4 minutes (docs/benchmarks.md). Restored on exit."""
    if variant != "cute" or mode == "compiled":
        yield
        return
    from nemo_automodel.components.models.qwen3_8_flash_next import fa4_qsa

    compiled = fa4_qsa._preprocess
    original = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(compiled, "__wrapped__", None)
    if original is None:
        raise RuntimeError("--cute-preprocess eager: upstream's fa4_qsa._preprocess is not a torch.compile "
                           "wrapper in this nemo-automodel version; run with --cute-preprocess compiled")
    fa4_qsa._preprocess = original
    try:
        yield
    finally:
        fa4_qsa._preprocess = compiled


def run_variant(setup: Setup, variant: str, seq: int, rho: float, inputs, args) -> tuple[dict, dict]:
    """Time one variant; returns its result and its output, gradients and routes."""
    layer, device = setup.layer, setup.device
    layer.backend = dataclasses.replace(setup.backend, attn="cute" if variant == "cute" else "flex")
    x, grad_out, freqs = inputs
    result: dict = {"variant": variant, "seq_len": seq, "hidden_rho": rho}
    if variant == "cute":
        result["preprocess"] = args.cute_preprocess
    with qsa_messages() as messages:
        with routes_for(setup, variant, args, instrumented=False):
            t0 = time.time()
            result["warmup_step_s"] = []
            for i in range(args.warmup):
                step_start = time.time()
                train_step(layer, x, grad_out, freqs)
                synchronize(device)
                result["warmup_step_s"].append(time.time() - step_start)
                log(f"S={seq} rho={rho:g} {variant}: warm-up step {i} took {result['warmup_step_s'][-1]:.1f} s")
            result["warmup_s"] = time.time() - t0
            times = []
            for _ in range(args.iters):
                start, end = new_event(device), new_event(device)
                start.record()
                train_step(layer, x, grad_out, freqs)
                end.record()
                times.append((start, end))
            synchronize(device)
            result["step_ms"] = statistics.median(s.elapsed_time(e) for s, e in times)
            result["step_ms_all"] = [s.elapsed_time(e) for s, e in times]
            if device.type == "cuda":
                layer.zero_grad(set_to_none=True)
                synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                train_step(layer, x, grad_out, freqs)
                synchronize(device)
                result["peak_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
            out, leaf = train_step(layer, x, grad_out, freqs)
            tensors = {"out": out.detach(), "dx": leaf.grad}
            tensors.update({f"grad/{n}": p.grad for n, p in layer.named_parameters() if p.requires_grad})
        result["qsa_torch_log"] = list(messages)

        parts = []
        with routes_for(setup, variant, args, instrumented=True):
            for i in range(args.iters + 1):  # the first one is discarded (any recompilation)
                setup.spans.pairs = {}
                setup.spans.active = True
                start, end = new_event(device), new_event(device)
                start.record()
                train_step(layer, x, grad_out, freqs)
                end.record()
                setup.spans.active = False
                synchronize(device)
                if i:
                    parts.append({"step": start.elapsed_time(end), **setup.spans.durations()})
        names = sorted({k for p in parts for k in p})
        breakdown = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in names}
        measured = sum(breakdown.get(k, 0.0) for k in ("attn_fwd", "attn_bwd", "indexer", "flex_mask"))
        breakdown["other"] = breakdown["step"] - measured
        breakdown["attn"] = breakdown["attn_fwd"] + breakdown["attn_bwd"]
        result["breakdown_ms"] = breakdown
    routes, setup.spans.routes = setup.spans.routes, None
    return result, {"tensors": tensors, "routes": routes, "call": setup.spans.call}


def compare(entries: list[dict], captured: dict) -> None:
    """Agreement of every variant's output, gradients and routes with the flex run."""
    reference = captured.get("flex")
    for entry in entries:
        if entry["variant"] not in captured:
            continue
        if entry["variant"] == "flex":
            entry["agreement"] = "reference"
        elif reference is None:
            entry["agreement"] = "no flex run to compare with"
        else:
            mine = captured[entry["variant"]]
            entry["agreement"] = {name: rel(t, reference["tensors"][name]) for name, t in mine["tensors"].items()}
            entry["routes_identical"] = bool(torch.equal(mine["routes"], reference["routes"]))


def fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def label(result: dict) -> str:
    eager = result.get("preprocess") == "eager"
    return result["variant"] + (" (eager preprocessing)" if eager else "")


def markdown(report: dict) -> str:
    lines = [
        "# nemo-automodel Qwen3.8-Flash-Next QSA layer: one training step",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Environment: {json.dumps(report['env'])}",
        "",
        "| S | variant | rho | J | inflation | step ms | peak GiB | attn fwd | attn bwd | attn | kernel alone "
        "| attn / kernel | indexer | flex mask | other | out err | dx err | max param-grad err | routes equal |",
        "|" + "---|" * 19,
    ]
    for r in report["results"]:
        head = (f"| {r['seq_len']} | {label(r)} | {r['hidden_rho']:g} | {fmt(r.get('jaccard'))} "
                f"| {fmt(r.get('inflation'))} ")
        if "error" in r or "skipped" in r:
            lines.append(head + f"| {r.get('error') or r.get('skipped')} " + "| " * 13 + "|")
            continue
        b = r["breakdown_ms"]
        agree = r["agreement"]
        errs = ("-", "-", "-") if isinstance(agree, str) else (
            f"{agree['out']:.1e}", f"{agree['dx']:.1e}",
            f"{max(v for k, v in agree.items() if k.startswith('grad/')):.1e}")
        lines.append(
            head + f"| {fmt(r['step_ms'])} | {fmt(r.get('peak_gib'))} "
            f"| {fmt(b.get('attn_fwd'))} | {fmt(b.get('attn_bwd'))} | {fmt(b.get('attn'))} "
            f"| {fmt(r.get('kernel_alone', {}).get('fwdbwd_ms'))} | {fmt(r.get('attn_vs_kernel'))} "
            f"| {fmt(b.get('indexer'))} | {fmt(b.get('flex_mask'))} | {fmt(b.get('other'))} "
            f"| {errs[0]} | {errs[1]} | {errs[2]} | {r.get('routes_identical', '-')} |")
    lines += ["", "Times are medians in ms (CUDA events). `rho`: AR(1) correlation of neighbouring hidden "
              "states; `J`: mean adjacent-row Jaccard of the layer's routes past the identity region; "
              "`inflation`: their union inflation for 128-pair programs. `step ms`: uninstrumented step; the "
              "breakdown columns come from separate instrumented steps; `kernel alone`: fwd+bwd of "
              "sparse_gqa_attention alone on the same routes and shapes (see the script's docstring); "
              "errors are relative to the flex run.", ""]
    lines += [f"* {line}" for line in report["notes"]]
    return "\n".join(lines) + "\n"


def environment(args) -> dict:
    import importlib.metadata as md

    env = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("nemo-automodel", "transformers", "flash-attn-4", "triton"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    if torch.cuda.is_available() and not args.dry_run:
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def cute_unavailable() -> str | None:
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as err:  # ImportError, or a broken install raising anything else
        return f"flash_attn.cute does not import: {type(err).__name__}: {err}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", help="default 8192 32768 (dry run: 150)")
    parser.add_argument("--hidden-rho", type=float, nargs="+", default=[0.0], metavar="RHO",
                        help="AR(1) correlation of neighbouring hidden states, 0 <= RHO < 1 (default 0)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=250.0,
                        help="seconds; a (S, rho, variant) that would start later is skipped")
    parser.add_argument("--kernel-iters", type=int, default=10,
                        help="timed calls of sparse_gqa_attention alone per (S, rho)")
    parser.add_argument("--qsa-backend", default="auto", help="backend for use_qsa_torch (default auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="CPU, small layer, fp32: plumbing only")
    parser.add_argument("--cute-preprocess", choices=("compiled", "eager"), default="compiled",
                        help="upstream's FA4 route preprocessing as shipped (torch.compile) or eager")
    parser.add_argument("--stack-dump-s", type=float, default=0.0,
                        help="every so many seconds, print every thread's Python stack to stderr "
                             "(tells a long JIT compile from a hang); 0: never")
    args = parser.parse_args(argv)
    if not all(0.0 <= rho < 1.0 for rho in args.hidden_rho):
        parser.error(f"--hidden-rho values must lie in [0, 1), got {args.hidden_rho}")
    if args.stack_dump_s > 0:
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)
    if args.dry_run:
        args.seq_lens, args.iters, args.warmup = args.seq_lens or [150], 2, 1
        args.kernel_iters = min(args.kernel_iters, 2)
    args.seq_lens = args.seq_lens or [8192, 32768]
    os.makedirs(args.out, exist_ok=True)
    report = {"command": " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
              "env": environment(args), "results": [], "notes": []}
    started = time.time()
    try:
        setup = build(args)
    except Exception as err:
        report["error"] = f"{type(err).__name__}: {err}"
        report["notes"].append("the upstream layer could not be built: " + report["error"])
        log(traceback.format_exc())
        write(report, args.out)
        return 1
    try:
        run_all(setup, args, report, started)
    finally:
        setup.restore()
    report["wall_s"] = time.time() - started
    write(report, args.out)
    print(markdown(report), flush=True)
    failed = [r for r in report["results"]
              if "kernel_alone_error" in r or "error" in (r.get("route_stats") or {})
              or ("error" in r and not r["error"].startswith("unavailable"))]
    return 1 if failed else 0


def run_one(setup: Setup, variant: str, seq: int, rho: float, inputs, args, started: float,
            cute_reason: str | None, captured: dict) -> dict:
    """One (S, rho, variant): its result entry; its tensors and routes into ``captured``."""
    entry = {"variant": variant, "seq_len": seq, "hidden_rho": rho}
    if variant == "cute" and cute_reason:
        entry["error"] = f"unavailable: {cute_reason}"
    elif time.time() - started > args.time_budget:
        entry["skipped"] = f"time budget {args.time_budget:.0f} s spent"
    else:
        log(f"S={seq} rho={rho:g} {variant} ...")
        try:
            with cute_preprocess(variant, args.cute_preprocess):
                entry, captured[variant] = run_variant(setup, variant, seq, rho, inputs, args)
        except Exception as err:
            missing = variant == "cute" and isinstance(err, ImportError)
            entry["error"] = ("unavailable: " if missing else "") + f"{type(err).__name__}: {str(err)[:300]}"
            log(traceback.format_exc())
    if variant == "qsa_torch" and variant in captured:
        try:
            entry["kernel_alone"] = kernel_alone(setup, captured[variant], args)
            entry["attn_vs_kernel"] = entry["breakdown_ms"]["attn"] / entry["kernel_alone"]["fwdbwd_ms"]
        except Exception as err:
            entry["kernel_alone_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            log(traceback.format_exc())
    shown = ("step_ms", "peak_gib", "error", "skipped", "breakdown_ms", "kernel_alone", "kernel_alone_error")
    log(f"S={seq} rho={rho:g} {variant}: " + json.dumps({k: v for k, v in entry.items() if k in shown}))
    return entry


def summarize(setup: Setup, args, report: dict, entries: list[dict], captured: dict) -> None:
    """Route statistics (of the qsa_torch run's routes, else another's) on every entry of one
    (S, rho), and a note: backends, step ratios, attention against the kernel alone."""
    source = "qsa_torch" if "qsa_torch" in captured else next(iter(captured), None)
    try:
        stats = None if source is None else dict(route_statistics(captured[source]["routes"], setup.config),
                                                 variant=source)
    except Exception as err:
        stats = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        log(traceback.format_exc())
    for entry in entries:
        entry.update(route_stats=stats, jaccard=(stats or {}).get("jaccard"), inflation=(stats or {}).get("inflation"))
    steps = {e["variant"]: e["step_ms"] for e in entries if "step_ms" in e}
    ours = next((e for e in entries if e["variant"] == "qsa_torch" and "step_ms" in e), None)
    if not ours or stats is None or "error" in stats:
        return
    ran = ran_backends(ours["qsa_torch_log"])
    b = ours["breakdown_ms"]
    note = (f"S={ours['seq_len']} rho={ours['hidden_rho']:g}: use_qsa_torch(backend={args.qsa_backend!r}) ran "
            f"{', '.join(ran) or 'no logged backend (see qsa_torch_log)'}; routes J {fmt(stats['jaccard'])} "
            f"(all rows {fmt(stats['jaccard_all'])}), inflation {fmt(stats['inflation'])}; "
            + "".join(f"step {steps[v] / ours['step_ms']:.2f}x faster than {v}; " for v in steps if v != "qsa_torch")
            + f"indexer {b.get('indexer', 0):.2f} ms = {100 * b.get('indexer', 0) / b['step']:.0f}% of the "
            f"instrumented step ({b['step']:.2f} ms), attention {b['attn']:.2f} ms "
            f"= {100 * b['attn'] / b['step']:.0f}%")
    if "kernel_alone" in ours:
        k = ours["kernel_alone"]
        note += (f", {ours['attn_vs_kernel']:.2f}x sparse_gqa_attention alone on the same routes "
                 f"({k['fwd_ms']:.2f} / {k['fwdbwd_ms']:.2f} ms fwd / fwd+bwd, ran {', '.join(k['ran']) or '-'})")
    report["notes"].append(note)


def run_all(setup: Setup, args, report: dict, started: float) -> None:
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    cute_reason = None if args.dry_run else cute_unavailable()
    for seq in args.seq_lens:
        freqs = rotary(setup.config, seq, setup.device, dtype)
        for rho in args.hidden_rho:
            x, grad_out = hidden_states(seq, setup.config.hidden_size, rho, args.seed)
            inputs = (x.to(setup.device, dtype), grad_out.to(setup.device, dtype), freqs)
            captured: dict = {}
            entries = []
            for variant in args.variants:
                entries.append(run_one(setup, variant, seq, rho, inputs, args, started, cute_reason, captured))
                report["results"].append(entries[-1])
                write_json(report, args.out)  # kept if the run is cut short
            compare(entries, captured)
            summarize(setup, args, report, entries, captured)
            write_json(report, args.out)
            del captured, inputs
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()


def write_json(report: dict, out: str) -> None:
    with open(os.path.join(out, "bench_nemo_layer.json"), "w") as f:
        json.dump(report, f, indent=1)


def write(report: dict, out: str) -> None:
    write_json(report, out)
    with open(os.path.join(out, "bench_nemo_layer.md"), "w") as f:
        f.write(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
