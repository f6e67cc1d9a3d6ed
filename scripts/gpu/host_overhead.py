"""Host time of torch's Triton path: cProfile of forward+backward steps on the GPU host.

    python3 scripts/gpu/host_overhead.py [--seq-len 8192] [--steps 30]

The benchmark's QSA routes, B=1, (24,2), D=256, bf16. Prints the host milliseconds per step
(from the call to the last launch, GPU synchronised between steps) and the functions that
take them (cProfile, by own time and by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import probe_shape  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    shape = probe_shape(False, args.seq_len, [0.8])

    import torch

    from qsa_torch.triton_qsa import triton_sparse_gqa_attention

    q, k, v, do = shape.inputs()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    routes = shape.routes(0.8)
    scale = shape.head_dim ** -0.5

    def forward():
        return triton_sparse_gqa_attention(*leaves, routes, scale)

    forward().backward(do)
    torch.cuda.synchronize()
    fwd, bwd = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        out = forward()
        mid = time.perf_counter()
        out.backward(do)
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
        torch.cuda.synchronize()
    print(f"host ms per forward call {1e3 * sorted(fwd)[len(fwd) // 2]:.3f}, "
          f"per backward call {1e3 * sorted(bwd)[len(bwd) // 2]:.3f} (medians)")
    profiler = cProfile.Profile()
    for _ in range(args.steps):
        profiler.enable()
        forward().backward(do)
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
