"""What ptxas makes of the Hopper kernels, on a CPU: registers, spills, wgmma serialization.

    python3 scripts/ptxas_report.py [--kernels forward backward backward-deterministic] [--json PATH]
                                    [--dump DIR]

Compiles ``forward_sm90`` and ``backward_sm90`` (default and deterministic) for sm_90a with
the installed triton, as torch's launcher specialises them for the tuned problem (B=1,
(24,2), D=256, bf16, the default plan's 128-pair programs: ``qsa_triton.launch``'s
launches, runtime integers marked divisible by 16 where they are), then runs the wheel's
``ptxas -v`` on the PTX. Per kernel: registers, stack frame and spill bytes, whether ptxas
serialized the wgmma (a large slowdown; ptxas says why in an info line: C7512 for want of
registers, C7515 for a non-wgmma instruction writing an in-flight accumulator, ...), shared
memory and the number of wgmma instructions. No GPU is needed; the figures are the ones
to check before a kernel change goes to the GPU. They depend on the triton version (the
GPU host runs 3.6: ``docs/design-token-gather.md`` notes where 3.9's PTX differs).
``--dump DIR`` writes each kernel's PTX (and SASS, where the wheel has cuobjdump).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNELS = ("forward", "backward", "backward-deterministic")


def launches(names=KERNELS) -> dict:
    """The Hopper launches of the tuned problem, by name."""
    from qsa_triton import DEFAULT_BLOCK_SIZES, make_plan
    from qsa_triton import launch as spec
    from qsa_triton.plan import union_recipe

    plan = make_plan(12, 256, DEFAULT_BLOCK_SIZES)
    s = 4096
    q = ((1, s, 24, 256), spec.contiguous_strides((1, s, 24, 256)))
    kv = ((1, s, 2, 256), spec.contiguous_strides((1, s, 2, 256)))
    _, cut = union_recipe(plan, s, 2052, s)
    unions = (1, cut.n_sub, cut.width)
    make = {
        "forward": lambda: spec.forward_sm90_launch(plan, q, kv, kv, unions, 0.0625, "bfloat16"),
        "backward": lambda: spec.backward_sm90_launch(plan, q, kv, kv, q, q, unions, 0.0625, "bfloat16"),
        "backward-deterministic": lambda: spec.backward_sm90_launch(plan, q, kv, kv, q, q, unions, 0.0625,
                                                                    "bfloat16", deterministic=True),
    }
    out = {}
    for name in names:
        launch = make[name]()
        assert launch is not None, f"{name}: the tuned problem is outside the Hopper kernel's scope"
        out[name] = launch
    return out


def compile_ptx(launch):
    """``launch``'s kernel compiled for sm_90a as torch's JIT specialises it: (PTX, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from qsa_triton import launch as spec

    fn = spec.kernel(launch.kernel)
    sig, constexprs, attrs = spec.compile_signature(launch, spec.attention_input_dtypes(launch, "bfloat16"))
    kernel = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=launch.num_warps))
    return kernel.asm["ptx"], kernel.metadata


def _ptxas() -> str:
    """The ptxas triton itself uses for sm_90 (3.9 moved it to the wheel's newer one)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def _cuobjdump() -> str | None:
    from triton import knobs

    tool = getattr(knobs.nvidia, "cuobjdump", None)
    path = getattr(tool, "path", None)
    return path if path and os.path.exists(path) else None


def parse_ptxas(text: str) -> dict:
    """Registers, stack frame, spill store / load bytes and wgmma serialization (with the
    codes of ptxas's reasons) from ``ptxas -v`` output."""
    used = re.search(r"Used (\d+) registers", text)
    serialized = sorted(set(re.findall(r"\((C\d+)\) Potential Performance Loss: wgmma\.mma_async instructions are "
                                       r"serialized", text)))
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if used is None or frame is None:
        raise ValueError(f"no register report in the ptxas output: {text[-500:]}")
    return {"registers": int(used.group(1)), "stack_frame_bytes": int(frame.group(1)),
            "spill_store_bytes": int(frame.group(2)), "spill_load_bytes": int(frame.group(3)),
            "wgmma_serialized": bool(serialized), "wgmma_serialized_by": serialized}


def report(name: str, launch, dump: str | None = None) -> dict:
    """ptxas's figures for one launch's kernel."""
    ptx, meta = compile_ptx(launch)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", src, "-o", cubin], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed for {name}: {proc.stderr[-1000:]}")
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{name}.ptx"), "w") as f:
                f.write(ptx)
            if _cuobjdump():
                with open(os.path.join(dump, f"{name}.sass"), "w") as f:
                    subprocess.run([_cuobjdump(), "-sass", cubin], stdout=f, check=False)
    result = parse_ptxas(proc.stderr + proc.stdout)
    result.update(shared_bytes=int(meta.shared), wgmma=ptx.count("wgmma.mma_async"))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--dump", help="write each kernel's PTX (and SASS) into this directory")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    results = {"triton": triton.__version__}
    for name, launch in launches(args.kernels).items():
        r = results[name] = report(name, launch, args.dump)
        serial = (f"SERIALIZED ({', '.join(r['wgmma_serialized_by'])})" if r["wgmma_serialized"]
                  else "not serialized")
        print(f"{name:24s} registers {r['registers']:3d}  spills {r['spill_store_bytes']:5d} B stored / "
              f"{r['spill_load_bytes']:5d} B loaded  wgmma {r['wgmma']:4d}  "
              f"{serial}  "
              f"shared {r['shared_bytes']} B", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
