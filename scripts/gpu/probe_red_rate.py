"""How fast the GPU takes the Hopper backward's dK/dV adds alone, with nothing else running.

    python3 scripts/gpu/probe_red_rate.py --out DIR [--seq-lens 32768] [--overlaps 0.8 0.3]
        [--sm-fractions 0.5 0.25]

The backward (``qsa_triton.backward_sm90``) adds, per program and 64-ID union chunk, 16
[64, 32] fp32 blocks into dK and dV with relaxed v4 atomics, 8 lanes x 16 bytes per row
(whole 128-byte lines). This probe issues exactly those adds (the benchmark's QSA routes,
the default plan's backward unions at (24,2), D=256: every program, chunk, ID and column
block, ascending as the kernel walks them, each chunk's IDs loaded before the previous
chunk's adds; the values are ones) from kernels that do nothing else, and times them (CUDA
events), as:

* ``red_many``: one CTA of 4 warps per (program, KV head), as many per SM as fit;
* ``red_8warps``: one persistent CTA of 8 warps per SM (the backward's two consumer
  warpgroups' worth of issuing warps), walking the programs in the kernel's order;
  ``red_4warps`` / ``red_16warps``: the same with 4 warps (the producer's) or 16 per SM;
* ``red_8warps_sms<N>``: ``red_8warps`` on N SMs only (``--sm-fractions``): whether one
  SM's adds are capped below its share of the L2's rate (a per-SM cap shows as the same
  bytes per SM and second at every N);
* ``red_many_l2``: ``red_many`` with every ID folded into the first 2048 rows (dK and dV
  then fit in the L2: its reduction rate without misses);
* ``store_many``: ``red_many``'s pattern with plain stores (the L2's write rate, for scale);
* ``red_int64_many``: ``red_many`` with the deterministic mode's int64 adds (one column per
  lane, one 256-byte row per warp instruction; twice the bytes).

Bytes moved: 2 (dK, dV) x 64 IDs x 256 x 4 bytes per chunk (8 bytes per element in int64).
The fastest of these is a floor under the backward kernel's time at the same routes: the
kernel issues the same adds and does its products besides. Writes ``probe_red_rate.json``
under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import Record, log, probe_shape  # noqa: E402


L2_ROWS = 2048  # red_many_l2's rows: 2 x 2048 x 2 heads x 1 KiB = 8 MiB, held in the L2


def _kernels():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from qsa_triton.forward_sm90 import _chunk_ids

    @gluon.jit
    def _adds(DK, DV, UNION, union_base, count, kv_off, row_stride, ids_rows, cols, ones, STORE: gl.constexpr,
              ROW_MASK: gl.constexpr):
        # the chunk's IDs past the union's count repeat IDs of the union, as in the kernel; the next
        # chunk's IDs are loaded before this chunk's adds (the kernel's consumers load them a product ahead)
        ids = _chunk_ids(UNION, union_base, 0, count, ids_rows)
        for j in range(gl.cdiv(count, 64)):
            ids_next = _chunk_ids(UNION, union_base, (j + 1) * 64, count, ids_rows)
            rows = ids & ROW_MASK if ROW_MASK else ids
            for h in gl.static_range(16):
                acc = DV if h < 8 else DK
                row_ptr = acc + kv_off + (h % 8) * 32 + rows * row_stride
                ptr = gl.expand_dims(row_ptr, 1) + gl.expand_dims(cols, 0)
                if STORE:
                    gl.store(ptr, ones)
                else:
                    gl.atomic_add(ptr, ones, sem="relaxed")
            ids = ids_next

    @gluon.jit
    def red_many_kernel(DK, DV, UNION, COUNT, width, row_stride, head_stride, STORE: gl.constexpr,
                        INT64: gl.constexpr, ROW_MASK: gl.constexpr):
        tile = gl.program_id(0)
        head = gl.program_id(1)
        if INT64:
            # the deterministic mode's int64 adds: one column per lane, one 256-byte row per warp instruction
            layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [gl.num_warps(), 1], [1, 0])
            ones = gl.full([64, 32], 1, gl.int64, layout=layout)
        else:
            # [64, 32] fp32: 4 adjacent columns per thread, 8 lanes per row, 4 rows of 128 bytes per warp instruction
            layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
            ones = gl.full([64, 32], 1.0, gl.float32, layout=layout)
        ids_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
        count = gl.load(COUNT + tile)
        _adds(DK, DV, UNION, tile.to(gl.int64) * width, count, head.to(gl.int64) * head_stride, row_stride,
              ids_rows, cols, ones, STORE, ROW_MASK)

    @gluon.jit
    def red_persistent_kernel(DK, DV, UNION, COUNT, n_tiles, n_heads, width, row_stride, head_stride):
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
        ids_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
        ones = gl.full([64, 32], 1.0, gl.float32, layout=layout)
        # the backward's grid order: tiles fastest, then KV heads
        for job in range(gl.program_id(0), n_tiles * n_heads, gl.num_programs(0)):
            tile = job % n_tiles
            head = job // n_tiles
            count = gl.load(COUNT + tile)
            _adds(DK, DV, UNION, tile.to(gl.int64) * width, count, head.to(gl.int64) * head_stride, row_stride,
                  ids_rows, cols, ones, False, 0)

    return red_many_kernel, red_persistent_kernel


def flat_unions(routes, seq: int, plan, *, backward: bool = True):
    """``(union [programs, width], count [programs], chunks)``: ``plan``'s unions of
    ``routes`` (the backward's with ``backward``, else the forward's) with the batch and
    program dimensions merged, and their number of 64-ID chunks."""
    from qsa_torch import _triton_unions as unions

    tile = unions.build_unions(routes, seq, plan)
    if backward:
        tile = unions.backward_unions(tile, plan, routes.shape[2], routes.shape[1])
    union, count = tile.union.reshape(-1, tile.union.shape[-1]), tile.count.reshape(-1)
    return union, count, int(((count.long() + 63) // 64).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768])
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.8, 0.3])
    parser.add_argument("--sm-fractions", type=float, nargs="*", default=[],
                        help="also red_8warps on these fractions of the SMs")
    parser.add_argument("--budget-s", type=float, default=120.0)
    args = parser.parse_args(argv)

    import torch

    from qsa_triton.config import DEFAULT_BLOCK_SIZES
    from qsa_triton.plan import make_plan

    record = Record(os.path.join(args.out, "probe_red_rate.json"), args.budget_s)
    red_many, red_persistent = _kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for seq, overlap in [(s, j) for s in args.seq_lens for j in args.overlaps]:
        shape = probe_shape(False, seq, [overlap])
        hq, hkv = shape.heads
        plan = make_plan(hq // hkv, shape.head_dim, DEFAULT_BLOCK_SIZES)
        dk = torch.zeros((1, seq, hkv, shape.head_dim), device="cuda", dtype=torch.float32)
        dv = torch.zeros_like(dk)
        dk64, dv64 = (torch.zeros(dk.shape, device="cuda", dtype=torch.int64) for _ in range(2))
        routes = torch.as_tensor(shape.routes(overlap)).to("cuda")
        union, count, chunks = flat_unions(routes, seq, plan)
        n_tiles, width = union.shape
        gbytes = chunks * hkv * 2 * 64 * shape.head_dim * 4 / 1e9
        common = (dk, dv, union, count)
        strides = (dk.stride(1), dk.stride(2))

        def persistent(n_sms, warps):
            return lambda: red_persistent[(n_sms,)](*common, n_tiles, hkv, width, *strides, num_warps=warps)

        runs = {
            "red_many": lambda: red_many[(n_tiles, hkv)](*common, width, *strides, STORE=False, INT64=False,
                                                          ROW_MASK=0, num_warps=4),
            "store_many": lambda: red_many[(n_tiles, hkv)](*common, width, *strides, STORE=True, INT64=False,
                                                            ROW_MASK=0, num_warps=4),
            "red_8warps": persistent(sms, 8),
            "red_4warps": persistent(sms, 4),
            "red_16warps": persistent(sms, 16),
            "red_int64_many": lambda: red_many[(n_tiles, hkv)](dk64, dv64, union, count, width, *strides, STORE=False,
                                                                INT64=True, ROW_MASK=0, num_warps=4),
            "red_many_l2": lambda: red_many[(n_tiles, hkv)](*common, width, *strides, STORE=False, INT64=False,
                                                             ROW_MASK=L2_ROWS - 1, num_warps=4),
        }
        fewer = {f"red_8warps_sms{n}": n for n in (max(1, int(sms * f)) for f in args.sm_fractions)}
        runs.update({name: persistent(n, 8) for name, n in fewer.items()})
        for name, fn in runs.items():
            def measure(fn=fn, name=name):
                ms = shape.timer(fn)
                moved = gbytes * (2 if "int64" in name else 1)
                n_sms = fewer.get(name, sms)
                return {"ms": ms, "gbytes": moved, "tb_per_s": moved / ms, "chunks": chunks,
                        "sms": n_sms, "gb_per_s_per_sm": moved / ms * 1e3 / n_sms}
            record.run(f"S={seq}/J={overlap}", name, measure)
        del dk, dv, dk64, dv64
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
