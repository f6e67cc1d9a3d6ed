"""One forward and one backward kernel launch at the H200 shape, for Nsight Compute.

    ncu --profile-from-start off --set full -o OUT/prof \
        python3 scripts/gpu/profile_kernels.py [--seq-len 32768] [--overlap 0.8] [--dry-run]

QSA-format routes from the benchmark's generator, B=1, (24,2), D=256, bf16, the default
configuration. Everything (unions, compilation, a first run of both kernels) happens before
``cudaProfilerStart``; between start and stop run only the unions, the forward and the backward
of one step, so ``ncu --profile-from-start off`` profiles exactly those kernels
(``bash scripts/gpu/session.sh profile`` runs it so). ``--dry-run``: CPU, Triton's
interpreter, tiny shapes, no profiler; the step's output and gradients are checked against
the float64 reference instead (plumbing only).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import probe_shape  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--overlap", type=float, default=0.8)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    args = parser.parse_args(argv)
    shape = probe_shape(args.dry_run, args.seq_len, [args.overlap], dry_seq_len=256)
    args.seq_len, (args.overlap,) = shape.seq_len, shape.overlaps

    import torch

    from qsa_torch import triton_qsa

    q, k, v, do = shape.inputs()
    scale = shape.head_dim ** -0.5
    routes = shape.routes(args.overlap)
    width = routes.shape[2]

    def step():
        out, lse, *unions = triton_qsa.forward_with_residuals(q, k, v, routes, scale)
        return out, triton_qsa.backward_from_residuals(do, q, k, v, out, lse, *unions, scale, width,
                                                       deterministic=False)

    if args.dry_run:
        return _check_against_reference(step, q, k, v, do, routes, scale)
    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print("profiled one step at S", args.seq_len, "J", args.overlap)
    return 0


def _check_against_reference(step, q, k, v, do, routes, scale) -> int:
    """The profiled step's output and gradients against the float64 oracle."""
    import torch

    from gpu_common import relative_error
    from qsa_common.oracle import oracle_forward_backward

    with torch.no_grad():
        out, grads = step()
    want = oracle_forward_backward(*(x.double().numpy() for x in (q, k, v)), routes.numpy(), scale,
                                   do.double().numpy())
    errors = {name: relative_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), want)}
    print("dry run: relative errors against the float64 reference", errors)
    return 0 if max(errors.values()) < 1e-2 else 1  # the contract's bf16 bound


if __name__ == "__main__":
    sys.exit(main())
