"""Whether two programs of a cluster can add their dK/dV blocks once for both, for less than the
adds they save (issue 18's paired-program backward, measured on its adds alone).

    python3 scripts/gpu/probe_pair_adds.py --out DIR [--seq-len 32768] [--overlaps 0.8 0.3]

Needs triton >= 3.9 (Gluon's ``num_ctas`` and layouts with a ``cga_layout``, which spread a
tensor over the CTAs of a cluster); refuses older ones. On the benchmark's QSA routes at
(24,2), D=256 it issues the Hopper backward's dK/dV adds (16 [64, 32] fp32 blocks per 64-ID
union chunk, relaxed v4 atomics on whole 128-byte lines, ones for values; as
``probe_red_rate.py``) in three ways, each timed alone (CUDA events):

* ``single``: every program of 128 (row, head) pairs adds its own union's blocks (today's
  backward, one CTA per program);
* ``pair_sum``: a cluster of two CTAs per program of 256 pairs walks that program's union;
  each CTA holds a partial [64, COLS] block (its 128 pairs' share), the pair sums them over
  the cluster (Gluon's reduction over the CTA dimension: distributed shared memory reads
  between cluster barriers) and the block is added once (by rank 0);
* ``pair_split``: the same, the partial blocks exchanged so that each CTA sums and adds
  half of the columns.

``single`` adds ``sum |U_128|`` rows, the pairs ``sum |U_256|`` (0.60x at J 0.8, 0.55x at J
0.3: ``scripts/add_bytes.py``). A pair variant faster than ``single`` means the exchange costs
less than the adds it saves; the backward's products over the 256-pair unions (1.20x / 1.11x)
are not in this probe. Writes ``probe_pair_adds.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import Record, log, probe_shape  # noqa: E402


def supported() -> str | None:
    """Why this triton cannot build the pair kernels (None when it can)."""
    try:
        from triton.experimental.gluon import language as gl

        gl.BlockedLayout([1], [32], [4], [0], cga_layout=[])
        gl.num_ctas  # noqa: B018
    except (ImportError, TypeError, AttributeError) as err:
        import triton

        return f"triton {triton.__version__}'s Gluon has no cluster layouts ({type(err).__name__}: {err}); need >= 3.9"
    return None


def _kernels():
    """``(single, pair)``: ``single`` is ``probe_red_rate.py``'s many-CTA adds kernel."""
    from probe_red_rate import _kernels as red_rate_kernels
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from qsa_triton.forward_sm90 import _chunk_ids

    @gluon.jit
    def pair_kernel(DK, DV, UNION, COUNT, width, row_stride, head_stride, COLS: gl.constexpr,
                    SPLIT: gl.constexpr):
        # [2, 64, COLS]: dimension 0 is the cluster's CTA (each CTA's partial block), then as
        # probe_red_rate's blocks
        nw: gl.constexpr = gl.num_warps()
        part: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [1, nw, 1], [2, 1, 0], cga_layout=[[1, 0, 0]])
        if SPLIT:
            # both partials in each CTA's registers, the columns split between the CTAs (each CTA's
            # COLS / 2 columns 4 per lane, as many lanes per row as they fill)
            lanes_c: gl.constexpr = min(8, COLS // 8)
            add: gl.constexpr = gl.BlockedLayout([2, 1, 4], [1, 32 // lanes_c, lanes_c], [1, nw, 1], [2, 1, 0],
                                                 cga_layout=[[0, 0, 1]])
        else:
            add: gl.constexpr = part
        out: gl.constexpr = gl.SliceLayout(0, add)
        tile = gl.program_id(0)
        kv_off = gl.program_id(1).to(gl.int64) * head_stride
        base = tile.to(gl.int64) * width
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, out))
        c = gl.arange(0, COLS, layout=gl.SliceLayout(0, out))
        count = gl.load(COUNT + tile)
        ones = gl.full([2, 64, COLS], 1.0, gl.float32, layout=part)
        ids = _chunk_ids(UNION, base, 0, count, rows)
        for j in range(gl.cdiv(count, 64)):
            ids_next = _chunk_ids(UNION, base, (j + 1) * 64, count, rows)
            for h in gl.static_range(512 // COLS):
                acc = DV if h < 256 // COLS else DK
                # a partial per block (not hoisted out of the loop), summed over the pair: [64, COLS]
                block = gl.sum(gl.convert_layout(ones * (j * 16 + h).to(gl.float32), add), axis=0)
                col0 = (h % (256 // COLS)) * COLS
                ptr = gl.expand_dims(acc + kv_off + col0 + ids * row_stride, 1) + gl.expand_dims(c, 0)
                gl.atomic_add(ptr, block, sem="relaxed")
            ids = ids_next

    return red_rate_kernels()[0], pair_kernel


def _unions(routes, seq, pairs, shape):
    """``probe_red_rate.flat_unions`` of flat programs of ``pairs`` pairs, the forward's
    unions (the programs the pairs' adds are walked over, uncut)."""
    from probe_red_rate import flat_unions

    from qsa_triton.config import DEFAULT_BLOCK_SIZES
    from qsa_triton.plan import make_plan

    hq, hkv = shape.heads
    plan = make_plan(hq // hkv, shape.head_dim, dataclasses.replace(DEFAULT_BLOCK_SIZES, block_m=pairs))
    assert plan.flat and plan.fwd_heads == pairs, plan
    return flat_unions(routes, seq, plan, backward=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.8, 0.3])
    parser.add_argument("--cols", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args(argv)
    record = Record(os.path.join(args.out, "probe_pair_adds.json"), args.budget_s)
    why = supported()
    if why:
        def refuse():
            raise RuntimeError(why)
        record.run("setup", "triton", refuse)
        return 2

    import torch
    import triton

    record.run("setup", "triton", lambda: triton.__version__)
    shape = probe_shape(False, args.seq_len, args.overlaps)
    hkv = shape.heads[1]
    seq = args.seq_len
    dk = torch.zeros((1, seq, hkv, shape.head_dim), device="cuda", dtype=torch.float32)
    dv = torch.zeros_like(dk)
    strides = (dk.stride(1), dk.stride(2))
    for overlap in args.overlaps:
        routes = torch.as_tensor(shape.routes(overlap)).to("cuda")
        u128, c128, chunks128 = _unions(routes, seq, 128, shape)
        u256, c256, chunks256 = _unions(routes, seq, 256, shape)
        per_chunk = hkv * 2 * 64 * shape.head_dim * 4 / 1e9
        single, pair = _kernels()
        runs = {"single": (lambda: single[(u128.shape[0], hkv)](dk, dv, u128, c128, u128.shape[1], *strides,
                                                                  STORE=False, INT64=False, ROW_MASK=0,
                                                                  num_warps=4), chunks128)}
        for cols in args.cols:
            for split in (False, True):
                name = f"pair_{'split' if split else 'sum'}_{cols}"
                runs[name] = (lambda cols=cols, split=split: pair[(u256.shape[0], hkv)](
                    dk, dv, u256, c256, u256.shape[1], *strides, COLS=cols, SPLIT=split, num_warps=4, num_ctas=2),
                    chunks256)
        for name, (fn, chunks) in runs.items():
            def measure(fn=fn, chunks=chunks):
                ms = shape.timer(fn)
                return {"ms": ms, "gbytes": chunks * per_chunk, "tb_per_s": chunks * per_chunk / ms,
                        "chunks": chunks}
            record.run(f"S={seq}/J={overlap}", name, measure)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
