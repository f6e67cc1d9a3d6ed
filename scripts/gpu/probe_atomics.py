"""What the backward's dK/dV atomics cost: the fused backward with and without their memory traffic.

    python3 scripts/gpu/probe_atomics.py --out DIR [--seq-len 32768] [--overlaps 0.3 0.8]
        [--budget-s 150] [--dry-run]

Both kernels' times follow the union entries each program walks per pair
(``scripts/gpu/probe_tiles.py``, docs/benchmarks.md); in the backward each union ID costs a
gathered K/V row pair and a [2, D] fp32 block of dK/dV atomic adds. This separates the two:
per overlap (QSA-format routes from the benchmark's generator, B=1, (24,2), D=256, bf16,
the default configuration) it times the backward kernel (``backward_from_residuals``, CUDA
events) as shipped and as a copy of ``qsa_triton/backward.py`` whose adds are predicated off
by a condition the compiler cannot prove false (``0 > count``): every product is still
computed and every add instruction issued, but none moves memory. The copy's gradients are
wrong (dK/dV stay zero) and only its time is read; the difference is the adds' memory cost.
Writes ``probe_atomics.json`` under ``--out``. ``--dry-run``: CPU, Triton's interpreter,
tiny shapes (plumbing only; checks that the copy leaves dK/dV zero and dQ unchanged).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import ROOT, Record, log, probe_shape  # noqa: E402

_ADDS = ("kv_mask_t, fix_v,", "kv_mask_t, fix_k,")


def adds_off_kernel():
    """``qsa_backward_kernel`` compiled from a copy of backward.py whose dK/dV adds are
    masked by ``0 > count`` (never true; not provable at compile time)."""
    import importlib.util

    path = os.path.join(ROOT, "qsa_triton", "backward.py")
    with open(path) as f:
        source = f.read()
    for mask in _ADDS:
        if source.count(mask) != 1:
            raise RuntimeError(f"qsa_triton/backward.py changed: expected one {mask!r} in _backward_step")
        source = source.replace(mask, mask.replace("kv_mask_t,", "kv_mask_t & (tl.zeros_like(acc_off_t) > count),"))
    # Triton reads a jit function's source from its file: the copy needs one of its own
    name = f"_probe_backward_adds_off_{os.getpid()}"
    copy = os.path.join(ROOT, "qsa_triton", name + ".py")
    with open(copy, "w") as f:
        f.write(source)
    try:
        spec = importlib.util.spec_from_file_location(f"qsa_triton.{name}", copy)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        os.remove(copy)
    return module.qsa_backward_kernel


@contextlib.contextmanager
def kernel_swapped(kernel):
    """The launchers look the backward kernel up by name at each launch (``qsa_triton.launch.kernel``)."""
    import qsa_triton.backward as backward

    shipped = backward.qsa_backward_kernel
    backward.qsa_backward_kernel = kernel
    try:
        yield
    finally:
        backward.qsa_backward_kernel = shipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.3, 0.8])
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    args = parser.parse_args(argv)
    shape = probe_shape(args.dry_run, args.seq_len, args.overlaps, dry_seq_len=256)
    heads, head_dim, device, timer = shape.heads, shape.head_dim, shape.device, shape.timer
    args.seq_len, args.overlaps = shape.seq_len, shape.overlaps

    import torch

    from qsa_torch import triton_qsa

    record = Record(os.path.join(args.out, "probe_atomics.json"), args.budget_s, seq_len=args.seq_len,
                    heads=heads, head_dim=head_dim)
    adds_off = adds_off_kernel()
    q, k, v, do = shape.inputs()
    scale = head_dim ** -0.5
    for overlap in args.overlaps:
        routes = shape.routes(overlap)
        width = routes.shape[2]
        section = f"J={overlap}"
        with torch.no_grad():
            out, lse, *unions = triton_qsa.forward_with_residuals(q, k, v, routes, scale)

            def backward():
                return triton_qsa.backward_from_residuals(do, q, k, v, out, lse, *unions, scale, width,
                                                          deterministic=False)

            shipped = backward()
            record.run(section, "backward_ms", lambda: timer(backward))
            with kernel_swapped(adds_off):
                silent = backward()
                record.run(section, "adds_off_ms", lambda: timer(backward))
            record.run(section, "adds_off_check", lambda: {
                "dk_dv_zero": bool((silent[1] == 0).all() and (silent[2] == 0).all()),
                "dq_equal": bool(torch.equal(silent[0], shipped[0]))})
        del routes, out, lse, unions, shipped, silent
        if device == "cuda":
            torch.cuda.empty_cache()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
