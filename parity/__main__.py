"""``python -m parity``: every QSA backend of both frameworks on identical inputs.

Runs layouts x route families x dtypes x heads x backends, compares out, dq,
dk and dv of each backend with a float64 oracle and with every other backend
(the contract's tolerances), prints a summary and writes ``parity.md`` and
``parity.json`` (default directory ``parity-report/``). Backends or quantities
that cannot run here are reported as unavailable with the reason. Exit status
1 on any failing cell, 0 otherwise.

Sizes: no option = a small CPU matrix (a few minutes, interpreted kernels
included); ``--quick`` = CI size; ``--gpu`` = the H200 shapes (S=8192,
(24,2) and (12,1), D=256, top_k 512, bf16). Any size option overrides the preset.

The layer section (:mod:`parity.layers`): the Flax port of Qwen3.8-Flash-Next's
QSA layer against the installed upstream PyTorch layer (the ``upstream``
extra). ``--layers`` runs only it: the CPU matrix (padded, packed, CP; float32
and bfloat16; correlated and noise hidden states), or with ``--gpu`` the real
config at ``--seq-len`` (default 8192) on the GPU. Plain ``python -m parity``
ends with its two smallest cases. It writes ``layers.md`` and ``layers.json``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

__all__ = ["main", "parse_args"]


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _heads(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(n) for n in item.split(":")) for item in _csv(text))
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 or p[0] < 1 or p[1] < 1 or p[0] % p[1] for p in pairs):
        raise argparse.ArgumentTypeError(f"heads must look like 24:2,12:1 (Hq:Hkv, Hq % Hkv == 0), got {text!r}")
    return pairs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from qsa_common.generators import FAMILIES
    from qsa_common.layouts import LAYOUTS

    from .backends import BACKENDS

    parser = argparse.ArgumentParser(
        prog="python -m parity", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI size (well under a minute on 2 CPU cores)")
    size.add_argument("--gpu", action="store_true",
                      help="H200 sizes: S=8192, heads 24:2,12:1, D=256, top_k 512, bfloat16")
    parser.add_argument("--layouts", type=_csv, default=LAYOUTS, help=f"comma list of {','.join(LAYOUTS)}")
    parser.add_argument("--families", type=_csv, default=FAMILIES,
                        help=f"comma list of {','.join(FAMILIES)}")
    parser.add_argument("--backends", type=_csv, default=(),
                        help=f"comma list of {','.join(BACKENDS)} (default: all)")
    parser.add_argument("--dtypes", type=_csv, help="comma list of float32,bfloat16,float16")
    parser.add_argument("--seq-len", type=int, help="sequence length S (the global length for cp)")
    parser.add_argument("--heads", type=_heads, help="comma list of Hq:Hkv, e.g. 24:2,12:1")
    parser.add_argument("--head-dim", type=int, help="head dim D")
    parser.add_argument("--top-k", type=int, help="route width is 4*top_k+4 (QSA format)")
    parser.add_argument("--batch", type=int, default=2, help="batch of the padded layout (default 2)")
    parser.add_argument("--world-size", type=int, default=2, help="CP ranks (default 2; the last is checked)")
    parser.add_argument("--seed", type=int, help="base seed (default: fresh, printed in the report)")
    parser.add_argument("--time-budget", type=float,
                        help="seconds; cases not started by then are reported as not run")
    parser.add_argument("--out", default="parity-report", help="report directory (default parity-report/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--layers", action="store_true",
                        help="only the Flax Qwen3.8-Flash-Next layer against the upstream PyTorch layer")
    parser.add_argument("--merge", nargs="+", metavar="DIR",
                        help="only merge the reports of runs over parts of the matrix into --out")
    args = parser.parse_args(argv)
    for name, allowed in (("layouts", LAYOUTS), ("families", FAMILIES), ("backends", tuple(BACKENDS)),
                          ("dtypes", ("float32", "bfloat16", "float16"))):
        bad = [x for x in (getattr(args, name) or ()) if x not in allowed]
        if bad:
            parser.error(f"unknown {name} {bad}; expected some of {','.join(allowed)}")
    return args


class _Progress:
    """A rich progress bar on a terminal; one flushed line per case otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.bar = None
        self.start = time.monotonic()
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import Progress

                self.bar = Progress(transient=True)
                self.task = self.bar.add_task("parity", total=total)
                self.bar.start()
            except ImportError:
                self.bar = None
        self.enabled = enabled

    def update(self, i: int, case, result) -> None:
        if not self.enabled:
            return
        done = [c for c in result.cells if c.case["layout"] == case.layout
                and c.case["family"] == case.family and c.case["dtype"] == case.dtype
                and tuple(c.case["heads"]) == case.heads]
        bad = sum(c.status in ("fail", "error") for c in done)
        elapsed = time.monotonic() - self.start
        text = f"[{i + 1}/{self.total}] {case.label()}: {'FAIL' if bad else 'ok'} ({elapsed:.0f} s)"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=case.label())
            if bad:
                self.bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _prepare_environment(gpu: bool) -> None:
    """Environment switches that must precede the first jax / triton import."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    try:
        import torch

        if not torch.cuda.is_available() and not gpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # run the Triton kernels on the CPU
    except ImportError:
        pass


def _merge(dirs: list[str], out: str, command: str) -> int:
    """Merge parity.json of several runs (e.g. one per layout, run in parallel)."""
    import json

    from .report import summary_text, write_report
    from .suite import load_result, merge_results

    parts = []
    for d in dirs:
        path = os.path.join(d, "parity.json")
        if not os.path.exists(path):
            print(f"merge: {path} is missing (that part did not start)", file=sys.stderr)
            continue
        with open(path) as f:
            parts.append(load_result(json.load(f)))
    if not parts:
        print("merge: nothing to merge", file=sys.stderr)
        return 2
    merged = merge_results(parts)
    if len(parts) < len(dirs):
        merged.complete = False
        merged.notes.append(f"only {len(parts)} of {len(dirs)} parts reported")
    md_path, json_path = write_report(merged, out, command)
    print(summary_text(merged))
    print(f"report: {md_path} and {json_path}", flush=True)
    return 1 if merged.failures or len(parts) < len(dirs) else 0


# plain ``python -m parity``: the two smallest layer cases (well under a minute on 2 cores)
DEFAULT_LAYER_CASES = (("padded", "float32", "correlated", 301, (301, 174, 0)),
                       ("packed", "bfloat16", "noise", 301, (3, 150, 2, 146)))


def _layer_section(args, command: str, cases) -> int:
    """Run the layer cases, write ``layers.md`` / ``layers.json``, print the table; 1 on failure."""
    import numpy as np

    from .layers import run_layers, summary_lines, upstream_missing, write_section

    cases = [c for c in cases if c.layout in args.layouts and c.dtype in (args.dtypes or (c.dtype,))]
    missing = upstream_missing()
    if missing or not cases:
        note = f"layer section unavailable: {missing}" if missing else "layer section: no case left by the filters"
        write_section([], args.out, command, note)
        print(note, flush=True)
        return 0
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    device = "cuda" if args.gpu else "cpu"
    print(f"layers: {len(cases)} cases on {device}, seed {seed}", flush=True)

    def on_case(record):
        if not args.no_progress:
            print(f"  {record['label']}: {'ok' if record['pass'] else 'FAIL'}", flush=True)

    records = run_layers(cases, seed, device=device, on_case=on_case)
    md_path, json_path = write_section(records, args.out, command)
    print("\n".join(summary_lines(records)))
    print(f"layer report: {md_path} and {json_path}", flush=True)
    return 1 if any(not r["pass"] for r in records) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.out, "python -m parity " + " ".join(argv or sys.argv[1:]))
    _prepare_environment(args.gpu)
    if args.layers:
        from .layers import default_cases

        command = "python -m parity " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        if args.gpu:
            cases = default_cases("real", dtypes=args.dtypes or ("bfloat16",), seq_len=args.seq_len)
        else:
            cases = default_cases("small")
        return _layer_section(args, command, cases)
    import numpy as np

    from .report import summary_text, write_report
    from .suite import PRESETS, Config, make_cases, run_suite

    preset = dict(PRESETS["gpu" if args.gpu else "quick" if args.quick else "default"])
    for name in ("seq_len", "heads", "head_dim", "top_k", "dtypes"):
        if getattr(args, name) is not None:
            preset[name] = getattr(args, name)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    config = Config(layouts=args.layouts, families=args.families, batch=args.batch,
                    world_size=args.world_size, seed=seed, backends=args.backends,
                    time_budget=args.time_budget, **preset)
    if config.seq_len % config.world_size and "cp" in config.layouts:
        print(f"error: --seq-len {config.seq_len} is not divisible by --world-size {config.world_size}",
              file=sys.stderr)
        return 2
    command = "python -m parity " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    cases = make_cases(config)
    print(f"parity: {len(cases)} cases (S={config.seq_len}, heads={config.heads}, D={config.head_dim}, "
          f"dtypes={','.join(config.dtypes)}), seed {seed}; report in {args.out}/", flush=True)
    progress = _Progress(len(cases), not args.no_progress)

    def on_case(i, n, case, result):
        progress.update(i, case, result)
        write_report(result, args.out, command)

    try:
        result = run_suite(config, on_case=on_case)
    finally:
        progress.close()
    md_path, json_path = write_report(result, args.out, command)
    print(summary_text(result))
    print(f"report: {md_path} and {json_path}", flush=True)
    status = 1 if result.failures else 0
    if not (args.quick or args.gpu):
        from .layers import LayerCase

        status |= _layer_section(args, command, [LayerCase(*c) for c in DEFAULT_LAYER_CASES])
    return status


if __name__ == "__main__":
    sys.exit(main())
