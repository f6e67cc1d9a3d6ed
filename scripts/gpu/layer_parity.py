"""The Flax port of Qwen3.8-Flash-Next's QSA layer against the upstream PyTorch layer on the H200.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/gpu/layer_parity.py --out DIR \\
        [--seq-lens 8192 32768] [--layouts padded,packed] [--implementation pallas] [--time-budget 300]

The real config (hidden 2560, 24/2 heads, head_dim 256, indexer 4 x 128, budget 2048,
ratio 4), bfloat16, random weights. Upstream: nemo-automodel's layer on CUDA with
``backend.attn = "flex"``. The port: ``qsa_jax.qwen3_8_flash_next.QSAAttention`` with the
upstream state dict, attention through ``qsa_jax.sparse_gqa_attention(implementation=...)``
(default: the library's choice for the GPU). Both share the GPU (JAX does not preallocate).
Per case, the report of ``python -m parity --layers`` (:mod:`parity.layers`): route
agreement (identical rows, rows explained by exact upstream ties at the top-k cut, and
unexplained rows, which fail), forced routes (the port on upstream's routes: output, dx and
every trainable gradient at bf16's 1e-2), free running (each side's own routes; rows with
identical routes held to 1e-2, tie rows named).

Cases: S = 8192 padded (one full row, locally correlated hidden states) and packed (three
documents, one shorter than a block, plain noise), then the same at 32768 while the time
budget allows (a case starts only if its estimate still fits: the previous case's time
scaled by S, or 0.6 of it at the same S, whose compilations are mostly reused). Layouts
``cp`` (two padded rows, of S and 2S/3 tokens) and ``cp-packed`` (the packed documents) run
the port with context parallelism over the first two JAX devices (the upstream layer
unsharded on the first GPU): they need two GPUs (``nvidia-h200-x2``) and are refused on fewer.
Results are written after every case to ``layer_parity.json`` and ``layer_parity.md``.
``--dry-run``: the small config at S = 301 on whatever device is present (CPU plumbing check).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

START = time.time()


def log(*args) -> None:
    print(f"[{time.time() - START:6.1f}s]", *args, flush=True)


def environment() -> dict:
    import jax
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
            "jax_devices": [str(d) for d in jax.devices()]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import nemo_automodel

        info["nemo_automodel"] = getattr(nemo_automodel, "__version__", "?")
    except Exception as err:  # noqa: BLE001 - reported
        info["nemo_automodel"] = f"not importable: {err}"
    return info


def write(out: str, command: str, env: dict, records: list[dict], notes: list[str]) -> None:
    from parity.layers import summary_lines

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "layer_parity.json"), "w") as f:
        json.dump({"command": command, "environment": env, "notes": notes, "cases": records}, f, indent=1)
    lines = ["# Flax Qwen3.8-Flash-Next QSA layer vs upstream (H200)", "", f"Command: `{command}`", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    lines += summary_lines(records)
    for r in records:
        if "forced" in r:
            f, fr = r["forced"]["errors"], r["free"]["errors"]
            lines += ["", f"## {r['label']} ({r['seconds']} s, seed {r['seed']})", "",
                      "| quantity | forced routes | free running |", "|---|---|---|"]
            lines += [f"| {k} | {f[k]:.3e} | {fr[k]:.3e} |" for k in f]
            tie_rows = r["routes"]["tie_rows"]
            lines += ["", f"Free-running output error on rows with identical routes: "
                          f"{r['free']['out_same_route_rows']:.3e}; tie rows ({len(tie_rows)}): "
                          f"{tie_rows[:20]}{' ...' if len(tie_rows) > 20 else ''}"]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    with open(os.path.join(out, "layer_parity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


LAYOUTS = ("padded", "packed", "cp", "cp-packed")


def real_case(layout: str, s: int):
    """The real-config case of ``layout`` at S = ``s`` (bfloat16)."""
    from parity.layers import LayerCase

    docs = (s // 3 + 1, 2, s - s // 3 - 3)
    if layout == "padded":
        return LayerCase("padded", "bfloat16", "correlated", s, (s,), "real")
    if layout == "packed":
        return LayerCase("packed", "bfloat16", "noise", s, docs, "real")
    if layout == "cp":
        return LayerCase("cp", "bfloat16", "correlated", s, (s, 2 * s // 3), "real")
    if layout == "cp-packed":
        return LayerCase("cp", "bfloat16", "noise", s, docs, "real")
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layouts", default="padded,packed", help=f"comma list of {','.join(LAYOUTS)}")
    parser.add_argument("--implementation", default=None,
                        help="qsa_jax.sparse_gqa_attention implementation (default: the library's)")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds; later cases are skipped")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="small config, S=301 (plumbing check)")
    args = parser.parse_args(argv)
    command = "python3 scripts/gpu/layer_parity.py " + " ".join(argv if argv is not None else sys.argv[1:])

    import torch

    from parity.layers import LayerCase, run_case, upstream_missing

    env = environment()
    log("environment:", env)
    notes: list[str] = []
    records: list[dict] = []
    missing = upstream_missing()
    if missing:
        notes.append(missing)
        write(args.out, command, env, records, notes)
        log(missing)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        parser.error(f"unknown layouts {bad}; expected some of {','.join(LAYOUTS)}")
    if args.dry_run:
        cases = [LayerCase("padded", "bfloat16", "correlated", 301, (301, 174, 0)),
                 LayerCase("packed", "bfloat16", "noise", 301, (3, 150, 2, 146)),
                 LayerCase("cp", "bfloat16", "correlated", 296, (296, 203)),
                 LayerCase("cp", "bfloat16", "noise", 296, (5, 170, 121))]
    else:
        import jax

        if any(x.startswith("cp") for x in layouts) and len(jax.devices()) < 2:
            # run_case would fall back to host devices, far too slow at the real config
            notes.append(f"the CP layouts need two JAX devices; this host has {len(jax.devices())} "
                         f"({jax.devices()[0].platform}): run on nvidia-h200-x2")
            write(args.out, command, env, records, notes)
            log(notes[-1])
            return 2
        cases = [real_case(layout, s) for s in args.seq_lens for layout in layouts]
    cases = [c for c in cases if c.layout_name in layouts]
    last = None
    for i, case in enumerate(cases):
        left = args.time_budget - (time.time() - START)
        if last is not None:
            # a longer sequence scales with S; the same S reuses most compilations
            estimate = last[1] * case.seq_len / last[0] if case.seq_len > last[0] else 0.6 * last[1]
            if estimate > left:
                notes.append(f"{case.label()} not run: ~{estimate:.0f} s estimated, {left:.0f} s left")
                log(notes[-1])
                continue
        log(f"case {case.label()} on {device} ...")
        t0 = time.time()
        try:
            record = run_case(case, args.seed + i, implementation=args.implementation, device=device)
        except Exception as err:  # noqa: BLE001 - recorded, the next case still runs
            record = {"case": vars(case), "label": case.label(), "seed": args.seed + i, "pass": False,
                      "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            if device == "cuda":
                torch.cuda.empty_cache()
        last = (case.seq_len, time.time() - t0)
        records.append(record)
        route_keys = ("rows", "identical", "tie_explained", "rounding_explained", "unexplained")
        log(f"  {'PASS' if record['pass'] else 'FAIL'} in {last[1]:.0f} s",
            {k: record["routes"][k] for k in route_keys} if "routes" in record else record.get("error"))
        write(args.out, command, env, records, notes)
    write(args.out, command, env, records, notes)
    log(f"wrote {args.out}/layer_parity.md")
    return 0 if records and all(r["pass"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
