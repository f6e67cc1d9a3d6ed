"""Backward kernel for Hopper (sm_90a) in Gluon: warp-specialized token gathers, 64-ID chunks.

Both frameworks' backward on sm_90, default and deterministic, where
``qsa_triton.launch.backward_sm90_launch`` admits the operands; ``backward.py`` elsewhere.

The same program, unions and math as ``backward.py``: fp32 atomic dK/dV, or with
DETERMINISTIC its int64 fixed-point sums (``fixed_point.py``: the same scale, rounding and
NaN flags), split across warps as ``forward_sm90.py``. A 4-warp producer loads the program's Q
and dO once, then gathers each 64-ID chunk's K and V rows with cp.async into one stage.
Two consumer warpgroups each own 64 of the program's 128 (row, head) pairs; per chunk each
1. computes S = Q K^T, P, dP = dO V^T and dS for its pairs ([64, 64] fp32 each),
2. stores P and dS (16-bit) into the program's shared [128, 64] P and dS,
3. adds dS K into its dQ ([64, 256] fp32 in registers); it releases V to the producer
   once dP is done and K once dQ is, and the producer gathers the next chunk's V, then
   its K, meanwhile,
4. once both halves of P and dS are stored, builds one of the chunk's two [64 IDs, 256]
   gradient blocks over all 128 pairs, GRAD_COLS columns at a time, one block in flight
   (16 registers beside dQ's 128 and A's 32): the first consumer dV = P^T dO, the second
   dK = scale * dS^T Q (P^T or dS^T loaded into registers once per chunk, the A operand
   of every block's product; once both consumers hold theirs, P and dS are free for the
   next chunk's); each block is moved within its warps (shuffles) to a
   layout whose warp instructions add whole 128-byte lines, and added to DV / DK with
   relaxed v4 fp32 atomics (4 adjacent columns per thread), or with DETERMINISTIC one
   column per lane, rounded to int64 and added with scalar 64-bit atomics (64-bit adds
   have no vector form).
The producer loads each chunk's IDs once for its K and V gathers, a chunk ahead; a consumer
loads them for its adds while its dQ product runs, in the gradient blocks' row layout.
The S, dP and dQ products are at least m64n64 (docs/design-token-gather.md: the register
and shared memory budget). The loop takes its shared-memory views afresh per chunk, from an index
that is zero at run time but not provably so, which keeps ~70 wgmma descriptors from
being hoisted out of the loop and spilled (sm_90a, triton 3.6 and its ptxas: 12 bytes of
spills instead of ~1.9 KB). ptxas serializes the wgmma for want of registers (warning
C7512) when fed triton 3.9's PTX, or with a second 32-column block in flight beside v4 adds:
``scripts/ptxas_report.py`` prints the figures for the installed triton. Each chunk's dK/dV
rows are added once per program, as in ``backward.py``. Its dQ sums the chunks in
``backward.py``'s order at 64-ID chunks.

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .fixed_point import fixed_point_factors
from .forward_sm90 import _chunk_ids, _gather_to_shared, _pairs, _wgmma_layout

PRODUCER_WARPS = gl.constexpr(4)
# registers per thread (setmaxnreg): the producer gathers 16 rows at a time; a consumer holds
# dQ ([64, 256] fp32: 128) and either S and dP (2 x 32) or the gradient blocks' A operand
# ([64, 128] 16-bit: 32) and one [64, GRAD_COLS] block (16).
# The second consumer gets CONSUMER_REGS, the first (the default partition) what is left of
# 3 x 168: 224 (fewer spills in all than 40 / 232 / 232 at sm_90a, triton 3.6)
PRODUCER_REGS = gl.constexpr(48)
CONSUMER_REGS = gl.constexpr(232)
SUB_ROWS = gl.constexpr(16)  # K/V rows per producer gather step
GRAD_COLS = gl.constexpr(32)  # columns of a gradient block (m64n32 products, one in flight)
LOG2E = gl.constexpr(1.4426950408889634)

# barriers (indices into ``bars``): Q/dO loaded, K ready, V ready, K free, P/dS stored
# (both halves), P/dS read (both gradient blocks' A operands loaded), V free
QDO = gl.constexpr(0)
K_READY = gl.constexpr(1)
V_READY = gl.constexpr(2)
K_FREE = gl.constexpr(3)
PDS_STORED = gl.constexpr(4)
PDS_READ = gl.constexpr(5)
V_FREE = gl.constexpr(6)


@gluon.jit
def _producer(Q, DO, LSE, K, V, UNION, q_smem, do_smem, k_smem, v_smem, bars,
              tile, S_q, G, q_base, sq_s, sq_h, do_base, sdo_s, sdo_h, lse_base, sl_h, sl_s,
              kv_base_k, kv_base_v, sk_s, sv_s, union_base, count,
              PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr):
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q_smem, do_smem, k_smem, v_smem = q_smem.index(0), do_smem.index(0), k_smem.index(0), v_smem.index(0)
    # Q and dO of the program's pairs, once, 16 pairs at a time; a pair without routes (LSE
    # +inf) is not read (zero-filled), so whatever its q and dO hold cannot reach dK/dV
    for h in gl.static_range(PAIRS // SUB_ROWS):
        _, row64, head, row_ok = _pairs(tile, S_q, G, gl.SliceLayout(1, blk), PAIRS, h * SUB_ROWS, SUB_ROWS)
        lse = gl.load(LSE + lse_base + head * sl_h + row64 * sl_s, mask=row_ok, other=float("inf"))
        mask = gl.expand_dims(row_ok & (lse != float("inf")), 1) & gl.expand_dims(cols < D, 0)
        q_ptr = Q + gl.expand_dims(q_base + row64 * sq_s + head * sq_h, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(q_smem.slice(h * SUB_ROWS, SUB_ROWS, dim=0), q_ptr, mask)
        do_ptr = DO + gl.expand_dims(do_base + row64 * sdo_s + head * sdo_h, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(do_smem.slice(h * SUB_ROWS, SUB_ROWS, dim=0), do_ptr, mask)
    async_copy.mbarrier_arrive(bars.index(QDO), increment_count=False)
    gl.static_assert(BLOCK_K == 4 * SUB_ROWS, "a chunk is gathered in four steps")
    rows = gl.arange(0, SUB_ROWS, layout=gl.SliceLayout(1, blk))
    n_chunks = gl.cdiv(count, BLOCK_K)
    # each chunk's IDs are loaded once for its K and V gathers, one chunk ahead (past the
    # last chunk they repeat IDs of the union: in bounds, never used)
    ids0, ids1, ids2, ids3 = _step_ids(UNION, union_base, 0, count, rows)
    for j in range(n_chunks):
        # V is free once the previous chunk's dP is done, K only after its dQ: V first (a
        # fresh barrier counts as completed for parity 1: the first waits pass)
        mbarrier.wait(bars.index(V_FREE), (j & 1) ^ 1)
        _gather_rows(v_smem, V + kv_base_v, sv_s, ids0, ids1, ids2, ids3, cols)
        async_copy.mbarrier_arrive(bars.index(V_READY), increment_count=False)
        mbarrier.wait(bars.index(K_FREE), (j & 1) ^ 1)
        _gather_rows(k_smem, K + kv_base_k, sk_s, ids0, ids1, ids2, ids3, cols)
        async_copy.mbarrier_arrive(bars.index(K_READY), increment_count=False)
        ids0, ids1, ids2, ids3 = _step_ids(UNION, union_base, (j + 1) * BLOCK_K, count, rows)


@gluon.jit
def _step_ids(UNION, union_base, start, count, rows):
    """The IDs of the chunk at ``start``, SUB_ROWS (``rows``) per gather step, four steps."""
    return (_chunk_ids(UNION, union_base, start, count, rows),
            _chunk_ids(UNION, union_base, start + SUB_ROWS, count, rows),
            _chunk_ids(UNION, union_base, start + 2 * SUB_ROWS, count, rows),
            _chunk_ids(UNION, union_base, start + 3 * SUB_ROWS, count, rows))


@gluon.jit
def _gather_rows(smem, base, stride, ids0, ids1, ids2, ids3, cols):
    """The chunk's [4 * SUB_ROWS, D] rows ``base + id * stride`` into ``smem``, SUB_ROWS
    rows (one ``ids``) at a time."""
    for r in gl.static_range(4):
        ids = ids0 if r == 0 else (ids1 if r == 1 else (ids2 if r == 2 else ids3))
        ptr = base + gl.expand_dims(ids * stride, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(smem.slice(r * SUB_ROWS, SUB_ROWS, dim=0), ptr)


@gluon.jit
def _zero_non_finite(q_rows, do_rows, O, o_base, so_s, so_h, LSE, lse_base, sl_h, sl_s, tile, S_q, G,
                     PAIRS: gl.constexpr, FIRST: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr):
    """Sets the non-finite entries of the pairs' staged ``q_rows`` / ``do_rows`` (shared
    [ROWS, D], pairs FIRST...) to 0, and the whole dO row of a confined pair (LSE or
    delta = dO . O not finite, as the caller finds them), SUB_ROWS pairs at a time (few
    registers; each slice's delta again, from the same terms in the same order)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    for h in gl.static_range(ROWS // SUB_ROWS):
        rows = q_rows.slice(h * SUB_ROWS, SUB_ROWS, dim=0)
        x = rows.load(blk)
        rows.store(gl.where(gl.abs(x.to(gl.float32)) < float("inf"), x, 0.0).to(x.dtype))
        _, row64, head, ok = _pairs(tile, S_q, G, gl.SliceLayout(1, blk), PAIRS, FIRST + h * SUB_ROWS, SUB_ROWS)
        lse = gl.load(LSE + lse_base + head * sl_h + row64 * sl_s, mask=ok, other=float("inf"))
        o_ptr = O + gl.expand_dims(o_base + row64 * so_s + head * so_h, 1) + gl.expand_dims(cols, 0)
        o = gl.load(o_ptr, mask=gl.expand_dims(ok, 1) & gl.expand_dims(cols < D, 0), other=0.0)
        rows = do_rows.slice(h * SUB_ROWS, SUB_ROWS, dim=0)
        x = rows.load(blk)
        delta = gl.sum(x.to(gl.float32) * o.to(gl.float32), axis=1)
        kept = ((gl.abs(lse) < float("inf")) & (gl.abs(delta) < float("inf"))) | (lse == float("inf"))
        x_ok = (gl.abs(x.to(gl.float32)) < float("inf")) & gl.expand_dims(kept, 1)
        rows.store(gl.where(x_ok, x, 0.0).to(x.dtype))


@gluon.jit
def _flag_routed_keys(FLAG, UNION, ROWBITS, union_base, count, bad_bits, flag_base, flag_stride, cols,
                      BLOCK: gl.constexpr):
    """``backward.flag_routed_keys``: FLAG[flag_base + id * flag_stride] = 1 for every ID
    of the union whose rowbits meet ``bad_bits``, BLOCK entries (``cols``) at a time."""
    if bad_bits != 0:
        for start in range(0, count, BLOCK):
            u = start + cols
            u_ok = u < count
            ids = gl.load(UNION + union_base + u, mask=u_ok, other=0)
            hit = u_ok & ((gl.load(ROWBITS + union_base + u, mask=u_ok, other=0) & bad_bits) != 0)
            gl.store(FLAG + flag_base + ids.to(gl.int64) * flag_stride, gl.where(hit, 1, 0), mask=hit)


@gluon.constexpr_function
def _in_warps(rows, cols, reg, lane):
    """A [rows, cols] = [64, 32] layout on 4 warps, each warp the wgmma accumulator's 16 rows."""
    return gl.DistributedLinearLayout(reg, lane, [[16, 0], [32, 0]], [], [rows, cols])


@gluon.constexpr_function
def _add_steps(rows, cols, deterministic):
    """The layouts a [64, 32] gradient block passes through on its way from the m64n32
    accumulator's (registers: column 1, row 8, columns 8 and 16; lanes: columns 2 and 4,
    rows 1, 2 and 4) to the one it is added in, one lane bit exchanged with one register
    bit per step: a shuffle within each warp (Gluon converts layouts that differ in more
    bits at once through shared memory, of which there is none left). In the last layout
    each warp instruction adds whole 128-byte lines: fp32, 4 adjacent columns per thread
    (one v4 atomic) and 8 lanes per row, 4 rows x 128 bytes; int64 (64-bit adds have no
    vector form), one column per lane, one row of 256 bytes (in the accumulator's own
    layout an instruction touched 8 rows x 32 bytes, at half the speed)."""
    if not deterministic:
        return [_in_warps(rows, cols, [[0, 1], [0, 2], [8, 0], [0, 16]], [[0, 8], [0, 4], [1, 0], [2, 0], [4, 0]]),
                _in_warps(rows, cols, [[0, 1], [0, 2], [8, 0], [4, 0]], [[0, 8], [0, 4], [1, 0], [2, 0], [0, 16]])]
    return [_in_warps(rows, cols, [[1, 0], [8, 0], [0, 8], [0, 16]], [[0, 2], [0, 4], [0, 1], [2, 0], [4, 0]]),
            _in_warps(rows, cols, [[1, 0], [8, 0], [2, 0], [0, 16]], [[0, 2], [0, 4], [0, 1], [0, 8], [4, 0]]),
            _in_warps(rows, cols, [[1, 0], [8, 0], [2, 0], [4, 0]], [[0, 2], [0, 4], [0, 1], [0, 8], [0, 16]])]


@gluon.constexpr_function
def _add_layout(rows, cols, deterministic):
    """The layout the gradient blocks are added in (the last of :func:`_add_steps`)."""
    return _add_steps(rows, cols, deterministic)[-1]


@gluon.jit
def _add_block(ACC, acc_base, sdk_s, ids, a_t, b_smem, read_bar, scale, factor,
               D: gl.constexpr, BLOCK_K: gl.constexpr, COLS: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """ACC[id_u, :] += scale * (A^T B)[u, :] for the chunk's IDs, COLS columns at a time:
    ``a_t`` [BLOCK_K, PAIRS] (P^T or dS^T, a transposed view), B ``b_smem`` [PAIRS, D] (dO
    or Q). A is loaded into registers once and feeds every block's product (products
    reading A from shared memory re-read all of it per block, 2 KiB per k-step beside B's
    COLS * 32 bytes: bound by shared-memory reads). IDs past the union's count repeat routed IDs and
    add rows of zeros. With DETERMINISTIC, ACC holds int64 sums: each scaled product times
    ``factor`` (the fixed-point scale 2**e) rounded to the nearest integer, ties to even, as
    ``backward.py`` rounds them (``fixed_point.add_fixed``). Arrives on ``read_bar`` once A
    is in registers: the shared P / dS are not read again this chunk."""
    nw: gl.constexpr = gl.num_warps()
    gl.static_assert(nw == 4 and BLOCK_K == 64 and COLS == 32, "_add_steps is built for 4 warps, [64, 32] blocks")
    acc_layout: gl.constexpr = _wgmma_layout(nw, COLS)
    steps: gl.constexpr = _add_steps(BLOCK_K, COLS, DETERMINISTIC)
    add_layout: gl.constexpr = _add_layout(BLOCK_K, COLS, DETERMINISTIC)
    rows = gl.convert_layout(ids, gl.SliceLayout(1, add_layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, add_layout))
    zero = gl.zeros([BLOCK_K, COLS], gl.float32, layout=acc_layout)
    a_t = a_t.load(gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))  # [BLOCK_K, PAIRS]
    mbarrier.arrive(read_bar, count=1)
    # one block at a time: a second [64, COLS] block in flight makes ptxas serialize the
    # wgmma at COLS = 32 (C7512); the other consumer's products fill the tensor cores while
    # this one adds
    for h in gl.static_range(D // COLS):
        block = warpgroup_mma(a_t, b_smem.slice(h * COLS, COLS, dim=1), zero, use_acc=False, is_async=True)
        block = warpgroup_mma_wait(0, deps=[block])
        # one conversion step between products, so that the steps are not folded into one
        # conversion (through shared memory); the products in the same order as backward.py's
        values = gl.convert_layout(gl.convert_layout(block, steps[0]) * scale, steps[1])
        if DETERMINISTIC:
            values = gl.inline_asm_elementwise("cvt.rni.s64.f32 $0, $1;", "=l,f",
                                               [gl.convert_layout(values * factor, steps[2])],
                                               dtype=gl.int64, is_pure=True, pack=1)
        # the block's column offset goes into the row pointers, so the [BLOCK_K, COLS]
        # offsets are one loop-invariant set of int32 columns, not one int64 set per block
        row_ptr = ACC + (acc_base + h * COLS) + rows * sdk_s
        gl.atomic_add(gl.expand_dims(row_ptr, 1) + gl.expand_dims(cols, 0), values, sem="relaxed")


@gluon.jit
def _consumer(O, DQ, DK, DV, FLAG, MAXIMA, ROWBITS, UNION, LSE, q_smem, do_smem, k_smem, v_smem, p_smem,
              ds_smem, bars, scale, scale_log2, tile, S_q, G, o_base, so_s, so_h, dq_base, sdq_s, sdq_h, lse_base,
              sl_h, sl_s, dk_base, sdk_s, union_base, count, BOUND_K, BOUND_V,
              PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, HALF: gl.constexpr,
              DETERMINISTIC: gl.constexpr):
    """Pairs [HALF * 64, HALF * 64 + 64) of the program, on one warpgroup; the chunks' dV
    blocks where HALF is 0, their dK blocks where it is 1."""
    nw: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = PAIRS // 2
    s_layout: gl.constexpr = _wgmma_layout(nw, BLOCK_K)
    dq_layout: gl.constexpr = _wgmma_layout(nw, D)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [nw, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    t_s, row64, head, ok_s = _pairs(tile, S_q, G, row_s, PAIRS, HALF * ROWS, ROWS)
    lse = gl.load(LSE + lse_base + head * sl_h + row64 * sl_s, mask=ok_s, other=float("inf"))
    lse_log2 = lse * LOG2E
    do_rows = do_smem.index(0).slice(HALF * ROWS, ROWS, dim=0)
    mbarrier.wait(bars.index(QDO), 0)
    # delta = rowsum(dO * O) in fp32 over the routed pairs (dO as staged: zero elsewhere)
    _, row64_b, head_b, ok_b = _pairs(tile, S_q, G, gl.SliceLayout(1, blk), PAIRS, HALF * ROWS, ROWS)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    o_ptr = O + gl.expand_dims(o_base + row64_b * so_s + head_b * so_h, 1) + gl.expand_dims(cols, 0)
    o = gl.load(o_ptr, mask=gl.expand_dims(ok_b, 1) & gl.expand_dims(cols < D, 0), other=0.0)
    do = do_rows.load(blk)
    delta = gl.convert_layout(gl.sum(do.to(gl.float32) * o.to(gl.float32), axis=1), row_s)
    # backward.py's guard (qsa_triton.language.confine_non_finite): a pair whose LSE or
    # delta is not finite is confined (LSE NaN, delta 0, its dO row 0), and the non-finite
    # entries of this half's q and dO become 0 in shared memory, where every pair's dK/dV
    # products read them; both halves are rewritten before either consumer's first
    # PDS_STORED arrival, after which the gradient blocks read all 128 pairs
    finite = (gl.abs(lse) < float("inf")) & (gl.abs(delta) < float("inf"))  # False for NaN too
    lse_log2 = gl.where(finite | (lse == float("inf")), lse_log2, float("nan"))
    delta = gl.where(finite, delta, 0.0)
    _zero_non_finite(q_smem.index(0).slice(HALF * ROWS, ROWS, dim=0), do_rows, O, o_base, so_s, so_h, LSE, lse_base,
                     sl_h, sl_s, tile, S_q, G, PAIRS, HALF * ROWS, ROWS, D)
    fence_async_shared()  # the rewrites before the wgmma reads

    cols_k = gl.arange(0, BLOCK_K, layout=col_s)
    # the chunk IDs in the row layout of the gradient blocks' adds (``_add_block``)
    ids_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, _add_layout(BLOCK_K, GRAD_COLS, DETERMINISTIC)))
    zero_s = gl.zeros([ROWS, BLOCK_K], gl.float32, layout=s_layout)
    dq = gl.zeros([ROWS, D], gl.float32, layout=dq_layout)
    # dV = P^T dO, dK = scale * dS^T Q; with DETERMINISTIC int64 sums (in any 32-bit-word
    # buffer: JAX has no int64 without x64) of the products scaled by 2**e
    if HALF == 0:
        acc = DV.to(gl.pointer_type(gl.int64)) if DETERMINISTIC else DV
        block_scale = 1.0
    else:
        acc = DK.to(gl.pointer_type(gl.int64)) if DETERMINISTIC else DK
        block_scale = scale
    if DETERMINISTIC:
        # backward.py's scales (qsa_triton.fixed_point), which its conversion kernel inverts
        fix_k, fix_v = fixed_point_factors(MAXIMA, BOUND_K, BOUND_V)
        factor = fix_k if HALF == 1 else fix_v
    else:
        factor = 1.0
    n_chunks = gl.cdiv(count, BLOCK_K)
    for j in range(n_chunks):
        phase = j & 1
        # the shared-memory views from a zero the compiler cannot prove: their wgmma
        # descriptors are derived per chunk instead of hoisted out of the loop (and spilled)
        z = j >> 30
        q_all, do_all, k_smem_j, v_smem_j = q_smem.index(z), do_smem.index(z), k_smem.index(z), v_smem.index(z)
        p_all, ds_all = p_smem.index(z), ds_smem.index(z)
        q_rows = q_all.slice(HALF * ROWS, ROWS, dim=0)
        do_rows = do_all.slice(HALF * ROWS, ROWS, dim=0)
        my_p = p_all.slice(HALF * ROWS, ROWS, dim=0)
        my_ds = ds_all.slice(HALF * ROWS, ROWS, dim=0)
        u = j * BLOCK_K + cols_k
        bits = gl.load(ROWBITS + union_base + u, mask=u < count, other=0)
        mbarrier.wait(bars.index(K_READY), phase)
        fence_async_shared()
        scores = warpgroup_mma(q_rows, k_smem_j.permute([1, 0]), zero_s, use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(0, deps=[scores])
        member = (((gl.expand_dims(bits, 0) >> gl.expand_dims(t_s, 1)) & 1) != 0) & gl.expand_dims(ok_s, 1)
        p = gl.where(member, gl.exp2(scores * scale_log2 - gl.expand_dims(lse_log2, 1)), 0.0)
        # both consumers have loaded the previous chunk's P and dS (a fresh barrier counts as
        # completed for parity 1)
        mbarrier.wait(bars.index(PDS_READ), phase ^ 1)
        my_p.store(p.to(k_smem_j.dtype))
        mbarrier.wait(bars.index(V_READY), phase)
        fence_async_shared()
        dp = warpgroup_mma(do_rows, v_smem_j.permute([1, 0]), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma_wait(0, deps=[dp])
        mbarrier.arrive(bars.index(V_FREE), count=1)  # V of this chunk is read
        my_ds.store((p * (dp - gl.expand_dims(delta, 1))).to(k_smem_j.dtype))
        fence_async_shared()  # the stores before the wgmma reads below
        ids = _chunk_ids(UNION, union_base, j * BLOCK_K, count, ids_k)  # in flight during dQ
        dq = warpgroup_mma(my_ds, k_smem_j, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq])
        mbarrier.arrive(bars.index(K_FREE), count=1)  # K of this chunk is read
        mbarrier.arrive(bars.index(PDS_STORED), count=1)
        mbarrier.wait(bars.index(PDS_STORED), phase)
        # dV = P^T dO (HALF 0) or dK = scale * dS^T Q (HALF 1)
        a_all = p_all if HALF == 0 else ds_all
        b_all = do_all if HALF == 0 else q_all
        _add_block(acc, dk_base, sdk_s, ids, a_all.permute([1, 0]), b_all, bars.index(PDS_READ), block_scale, factor,
                   D, BLOCK_K, GRAD_COLS, DETERMINISTIC)

    if DETERMINISTIC:
        # backward.py's flags (qsa_triton.fixed_point): the keys that this half's confined
        # pairs route (below, after the dQ store), and FLAG[0] where another pair's dQ is
        # non-finite (its P or dS met a NaN/inf that may have reached any key)
        poisoned = gl.sum(dq * 0.0, axis=1)
        flag_layout: gl.constexpr = gl.SliceLayout(1, dq_layout)
        kept = gl.convert_layout(lse_log2 == lse_log2, flag_layout)
        gl.store(FLAG + gl.zeros([ROWS], gl.int32, layout=flag_layout),
                 gl.full([ROWS], 1, gl.int32, layout=flag_layout), mask=(poisoned != poisoned) & kept)
    cols_d = gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
    dq_off = gl.convert_layout(dq_base + row64 * sdq_s + head * sdq_h, gl.SliceLayout(1, dq_layout))
    dq_ok = gl.convert_layout(ok_s, gl.SliceLayout(1, dq_layout))
    gl.store(DQ + gl.expand_dims(dq_off, 1) + gl.expand_dims(cols_d, 0), (dq * scale).to(DQ.dtype.element_ty),
             mask=gl.expand_dims(dq_ok, 1) & gl.expand_dims(cols_d < D, 0))
    if DETERMINISTIC:
        confined = lse_log2 != lse_log2
        bad_bits = gl.reduce_or(gl.where(confined, gl.full([ROWS], 1, gl.int32, layout=row_s) << t_s, 0), axis=0)
        _flag_routed_keys(FLAG, UNION, ROWBITS, union_base, count, bad_bits, 1 + dk_base // D, sdk_s // D,
                          cols_k, BLOCK_K)


@gluon.jit
def qsa_backward_sm90_kernel(
    Q, K, V, O, DO, LSE, UNION, COUNT, ROWBITS, MAXIMA,
    scale, scale_log2,
    DQ, DK, DV, FLAG,
    sq_b, sq_s, sq_h,
    sk_b, sk_s, sk_h,
    sv_b, sv_s, sv_h,
    so_b, so_s, so_h,
    sdo_b, sdo_s, sdo_h,
    sl_b, sl_h, sl_s,
    sdq_b, sdq_s, sdq_h,
    sdk_b, sdk_s, sdk_h,
    S_q, N_TILES, UNION_WIDTH, HKV, G, BOUND_K, BOUND_V,
    PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, DETERMINISTIC: gl.constexpr,
):
    """``backward.py``'s ``qsa_backward_kernel`` for programs of 128 pairs: writes DQ (Q's
    dtype) and adds into DK/DV, zeroed ``[B, S_kv, Hkv, D]`` accumulators (DV with DK's
    strides, unit stride along D): fp32, or with DETERMINISTIC int64 fixed-point sums
    (``qsa_triton.fixed_point``; held in any 32-bit-word buffer, strides counting int64
    elements), scaled from MAXIMA (fp32 [3]) and BOUND_K / BOUND_V as ``backward.py``
    scales them, FLAG (int32 ``[1 + B * S_kv * Hkv]``, zero on entry) set as ``backward.py``
    sets it (the accumulator rows that confined pairs route; FLAG[0] where another pair's
    dQ is non-finite).
    MAXIMA, BOUND_K, BOUND_V and FLAG are read or written only with DETERMINISTIC. Unit
    stride along D and int32 element offsets within a head. Grid ``(N_TILES, B * HKV)``;
    num_warps = 4."""
    tile = gl.program_id(0)
    pid = gl.program_id(1)
    b64 = (pid // HKV).to(gl.int64)
    g = pid % HKV
    g0 = (g * G).to(gl.int64)
    q_base = b64 * sq_b + g0 * sq_h
    do_base = b64 * sdo_b + g0 * sdo_h
    o_base = b64 * so_b + g0 * so_h
    dq_base = b64 * sdq_b + g0 * sdq_h
    lse_base = b64 * sl_b + g0 * sl_h
    union_base = (b64 * N_TILES + tile) * UNION_WIDTH
    count = gl.load(COUNT + b64 * N_TILES + tile)
    kv_base_k = b64 * sk_b + g.to(gl.int64) * sk_h  # int64: the head stride times the head can pass int32
    kv_base_v = b64 * sv_b + g.to(gl.int64) * sv_h
    dk_base = b64 * sdk_b + g.to(gl.int64) * sdk_h

    dtype: gl.constexpr = Q.dtype.element_ty
    io_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAIRS, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D], dtype)
    pd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAIRS, BLOCK_K], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [1] + [PAIRS, D], io_layout)
    do_smem = gl.allocate_shared_memory(dtype, [1] + [PAIRS, D], io_layout)
    k_smem = gl.allocate_shared_memory(dtype, [1] + [BLOCK_K, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1] + [BLOCK_K, D], kv_layout)
    p_smem = gl.allocate_shared_memory(dtype, [1] + [PAIRS, BLOCK_K], pd_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [1] + [PAIRS, BLOCK_K], pd_layout)
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):  # completed by the producer's cp.async arrivals
        mbarrier.init(bars.index(i), count=32 * PRODUCER_WARPS)
    for i in gl.static_range(3, 7):  # one arrival per consumer
        mbarrier.init(bars.index(i), count=2)

    gl.warp_specialize([
        (_consumer, (O, DQ, DK, DV, FLAG, MAXIMA, ROWBITS, UNION, LSE, q_smem, do_smem, k_smem, v_smem, p_smem,
                     ds_smem, bars, scale, scale_log2, tile, S_q, G, o_base, so_s, so_h, dq_base, sdq_s, sdq_h,
                     lse_base, sl_h, sl_s, dk_base, sdk_s, union_base, count, BOUND_K, BOUND_V, PAIRS, D, BLOCK_K,
                     0, DETERMINISTIC)),
        (_consumer, (O, DQ, DK, DV, FLAG, MAXIMA, ROWBITS, UNION, LSE, q_smem, do_smem, k_smem, v_smem, p_smem,
                     ds_smem, bars, scale, scale_log2, tile, S_q, G, o_base, so_s, so_h, dq_base, sdq_s, sdq_h,
                     lse_base, sl_h, sl_s, dk_base, sdk_s, union_base, count, BOUND_K, BOUND_V, PAIRS, D, BLOCK_K,
                     1, DETERMINISTIC)),
        (_producer, (Q, DO, LSE, K, V, UNION, q_smem, do_smem, k_smem, v_smem, bars,
                     tile, S_q, G, q_base, sq_s, sq_h, do_base, sdo_s, sdo_h, lse_base, sl_h, sl_s,
                     kv_base_k, kv_base_v, sk_s, sv_s, union_base, count, PAIRS, D, BLOCK_K)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
