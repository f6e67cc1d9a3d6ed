"""Backward kernel for Hopper (sm_90a) in Gluon: warp-specialized token gathers.

EXPERIMENT (branch ``next/backward-sm90``): compiled for sm_90a on CPU only; never run on a
GPU. On the branch it is both frameworks' default non-deterministic backward on sm_90 where
``qsa_triton.launch.backward_sm90_launch`` admits the operands. Its dQ sums in a different
order from ``backward.py``'s (16-ID chunks), so the two modes' dQ are no longer equal bit
for bit in 16-bit (each stays reproducible run to run: dQ has no atomics).

The same program, unions and math as ``backward.py`` (non-deterministic mode: fp32 atomic
dK/dV), split across warps as ``forward_sm90.py``: a 4-warp producer gathers each chunk's
K and V rows with cp.async into a ring of STAGES buffers (after loading the program's Q
and dO once); two consumer partitions of one warpgroup each own 64 of the program's 128
(row, head) pairs. Per chunk a consumer computes S = Q K^T, P, dP = dO V^T, dS, adds
dS K into its dQ (registers), stages P and dS in its own shared memory, and computes
dV^T = dO^T P and dK^T = Q^T dS a quarter of D at a time (an [64, BLOCK_K] fp32 block
each), moved to 4 lanes of D per thread and added to DK/DV with relaxed v4 fp32 atomics. Each consumer adds its own 64
pairs' blocks, so the atomics' count is twice ``backward.py``'s at 128 pairs.

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .forward_sm90 import _chunk_ids, _gather_to_shared, _pairs

PRODUCER_WARPS = gl.constexpr(4)
PRODUCER_REGS = gl.constexpr(96)
CONSUMER_REGS = gl.constexpr(208)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _producer(Q, DO, LSE, K, V, UNION, q_smem, do_smem, k_bufs, v_bufs, ready, empty,
              tile, S_q, G, q_base, sq_s, sq_h, do_base, sdo_s, sdo_h, lse_base, sl_h, sl_s,
              kv_base_k, kv_base_v, sk_s, sv_s, union_base, count,
              PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    # Q and dO of the program's pairs, once, 64 pairs at a time (fewer live addresses); a
    # pair without routes (LSE +inf) is not read (zero-filled), so whatever its q and dO
    # hold cannot reach dK/dV (backward.py)
    HALF_ROWS: gl.constexpr = PAIRS // 2
    for h in gl.static_range(2):
        _, row64, head, row_ok = _pairs(tile, S_q, G, gl.SliceLayout(1, blk), PAIRS, h * HALF_ROWS, HALF_ROWS)
        lse = gl.load(LSE + lse_base + head * sl_h + row64 * sl_s, mask=row_ok, other=float("inf"))
        mask = gl.expand_dims(row_ok & (lse != float("inf")), 1) & gl.expand_dims(cols < D, 0)
        q_ptr = Q + gl.expand_dims(q_base + row64 * sq_s + head * sq_h, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(q_smem.slice(h * HALF_ROWS, HALF_ROWS, dim=0), q_ptr, mask)
        do_ptr = DO + gl.expand_dims(do_base + row64 * sdo_s + head * sdo_h, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(do_smem.slice(h * HALF_ROWS, HALF_ROWS, dim=0), do_ptr, mask)
    async_copy.mbarrier_arrive(ready.index(2 * STAGES), increment_count=False)
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, blk))
    n_chunks = gl.cdiv(count, BLOCK_K)
    for j in range(n_chunks):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        ids = _chunk_ids(UNION, union_base, j * BLOCK_K, count, rows)
        k_ptr = K + kv_base_k + gl.expand_dims(ids * sk_s, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(k_bufs.index(s), k_ptr)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        v_ptr = V + kv_base_v + gl.expand_dims(ids * sv_s, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(v_bufs.index(s), v_ptr)
        async_copy.mbarrier_arrive(ready.index(STAGES + s), increment_count=False)


@gluon.jit
def _add_transposed(ACC, acc_base, sdk_s, ids, a_smem, b_smem, factor,
                    ROWS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, DQ: gl.constexpr):
    """ACC[id_u, d] += factor * (A^T B)[d, u] for the chunk's IDs, a quarter of D at a time:
    A ``a_smem`` [ROWS, D] (dO or Q), B ``b_smem`` [ROWS, BLOCK_K] (P or dS)."""
    nw: gl.constexpr = gl.num_warps()
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    # the adds take 4 consecutive lanes of D per thread (vector atomics): [DQ, BLOCK_K]
    add_layout: gl.constexpr = gl.BlockedLayout([4, 1], [DQ // 4, 32 * 4 // DQ], [1, nw], [0, 1])
    d_rows = gl.arange(0, DQ, layout=gl.SliceLayout(1, add_layout))
    ids_t = gl.convert_layout(ids, gl.SliceLayout(0, add_layout))
    a_t = a_smem.permute([1, 0])  # [D, ROWS]
    zero = gl.zeros([DQ, BLOCK_K], gl.float32, layout=t_layout)
    for q in gl.static_range(D // DQ):
        block = warpgroup_mma(a_t.slice(q * DQ, DQ, dim=0), b_smem, zero, use_acc=False, is_async=True)
        block = warpgroup_mma_wait(0, deps=[block])
        ptr = ACC + acc_base + gl.expand_dims(ids_t * sdk_s, 0) + gl.expand_dims(q * DQ + d_rows, 1)
        gl.atomic_add(ptr, gl.convert_layout(block * factor, add_layout), sem="relaxed")


@gluon.jit
def _consumer(O, DQ, DK, DV, ROWBITS, UNION, LSE, q_smem, do_smem, k_bufs, v_bufs, p_smem, ds_smem, ready, empty,
              scale, scale_log2, tile, S_q, G, o_base, so_s, so_h, dq_base, sdq_s, sdq_h, lse_base, sl_h, sl_s,
              dk_base, sdk_s, union_base, count,
              PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              HALF: gl.constexpr):
    """Pairs [HALF * 64, HALF * 64 + 64) of the program, on one warpgroup."""
    nw: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = PAIRS // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                        instr_shape=[16, D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [nw, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    t_s, row64, head, ok_s = _pairs(tile, S_q, G, row_s, PAIRS, HALF * ROWS, ROWS)
    lse = gl.load(LSE + lse_base + head * sl_h + row64 * sl_s, mask=ok_s, other=float("inf"))
    routed = lse != float("inf")
    lse_log2 = lse * LOG2E
    q_rows = q_smem.slice(HALF * ROWS, ROWS, dim=0)
    do_rows = do_smem.slice(HALF * ROWS, ROWS, dim=0)
    mbarrier.wait(ready.index(2 * STAGES), 0)
    # delta = rowsum(dO * O) in fp32 over the routed pairs (dO as staged: zero elsewhere)
    _, row64_b, head_b, ok_b = _pairs(tile, S_q, G, gl.SliceLayout(1, blk), PAIRS, HALF * ROWS, ROWS)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    o_ptr = O + gl.expand_dims(o_base + row64_b * so_s + head_b * so_h, 1) + gl.expand_dims(cols, 0)
    o = gl.load(o_ptr, mask=gl.expand_dims(ok_b, 1) & gl.expand_dims(cols < D, 0), other=0.0)
    do = do_rows.load(blk)
    delta = gl.convert_layout(gl.sum(do.to(gl.float32) * o.to(gl.float32), axis=1), row_s)
    delta = gl.where(routed, delta, 0.0)

    cols_k = gl.arange(0, BLOCK_K, layout=col_s)
    zero_s = gl.zeros([ROWS, BLOCK_K], gl.float32, layout=s_layout)
    dq = gl.zeros([ROWS, D], gl.float32, layout=dq_layout)
    my_p = p_smem.index(HALF)
    my_ds = ds_smem.index(HALF)
    n_chunks = gl.cdiv(count, BLOCK_K)
    for j in range(n_chunks):
        s = j % STAGES
        phase = (j // STAGES) & 1
        u = j * BLOCK_K + cols_k
        bits = gl.load(ROWBITS + union_base + u, mask=u < count, other=0)
        ids = _chunk_ids(UNION, union_base, j * BLOCK_K, count, cols_k)
        member = (((gl.expand_dims(bits, 0) >> gl.expand_dims(t_s, 1)) & 1) != 0) & gl.expand_dims(ok_s, 1)
        mbarrier.wait(ready.index(s), phase)
        fence_async_shared()
        k_buf = k_bufs.index(s)
        scores = warpgroup_mma(q_rows, k_buf.permute([1, 0]), zero_s, use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(0, deps=[scores])
        p = gl.where(member, gl.exp2(scores * scale_log2 - gl.expand_dims(lse_log2, 1)), 0.0)
        mbarrier.wait(ready.index(STAGES + s), phase)
        fence_async_shared()
        v_buf = v_bufs.index(s)
        dp = warpgroup_mma(do_rows, v_buf.permute([1, 0]), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma_wait(0, deps=[dp])
        ds = p * (dp - gl.expand_dims(delta, 1))
        ds16 = ds.to(k_bufs.dtype)
        dq = warpgroup_mma(gl.convert_layout(ds16, ds_layout), k_buf, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq])
        mbarrier.arrive(empty.index(s), count=1)  # K and V of this stage are read
        my_p.store(p.to(k_bufs.dtype))
        my_ds.store(ds16)
        fence_async_shared()  # the stores before the wgmma reads below
        _add_transposed(DV, dk_base, sdk_s, ids, do_rows, my_p, 1.0, ROWS, D, BLOCK_K, 64)
        _add_transposed(DK, dk_base, sdk_s, ids, q_rows, my_ds, scale, ROWS, D, BLOCK_K, 64)

    cols_d = gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
    dq_off = gl.convert_layout(dq_base + row64 * sdq_s + head * sdq_h, gl.SliceLayout(1, dq_layout))
    dq_ok = gl.convert_layout(ok_s, gl.SliceLayout(1, dq_layout))
    gl.store(DQ + gl.expand_dims(dq_off, 1) + gl.expand_dims(cols_d, 0), (dq * scale).to(DQ.dtype.element_ty),
             mask=gl.expand_dims(dq_ok, 1) & gl.expand_dims(cols_d < D, 0))


@gluon.jit
def qsa_backward_sm90_kernel(
    Q, K, V, O, DO, LSE, UNION, COUNT, ROWBITS,
    scale, scale_log2,
    DQ, DK, DV,
    sq_b, sq_s, sq_h,
    sk_b, sk_s, sk_h,
    sv_b, sv_s, sv_h,
    so_b, so_s, so_h,
    sdo_b, sdo_s, sdo_h,
    sl_b, sl_h, sl_s,
    sdq_b, sdq_s, sdq_h,
    sdk_b, sdk_s, sdk_h,
    S_q, N_TILES, UNION_WIDTH, HKV, G,
    PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
):
    """``backward.py``'s ``qsa_backward_kernel`` (non-deterministic) for programs of 128
    pairs: writes DQ (Q's dtype) and adds into DK/DV, fp32 ``[B, S_kv, Hkv, D]`` zeroed
    accumulators (DV with DK's strides, unit stride along D). Unit stride along D and
    int32 element offsets everywhere. Grid ``(N_TILES, B * HKV)``; num_warps = 4."""
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
    pd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAIRS // 2, BLOCK_K], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [PAIRS, D], io_layout)
    do_smem = gl.allocate_shared_memory(dtype, [PAIRS, D], io_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D], kv_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D], kv_layout)
    p_smem = gl.allocate_shared_memory(dtype, [2, PAIRS // 2, BLOCK_K], pd_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, PAIRS // 2, BLOCK_K], pd_layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES + 1, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * STAGES + 1):
        mbarrier.init(ready.index(i), count=32 * PRODUCER_WARPS)
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=2)

    gl.warp_specialize([
        (_consumer, (O, DQ, DK, DV, ROWBITS, UNION, LSE, q_smem, do_smem, k_bufs, v_bufs, p_smem, ds_smem, ready,
                     empty, scale, scale_log2, tile, S_q, G, o_base, so_s, so_h, dq_base, sdq_s, sdq_h, lse_base,
                     sl_h, sl_s, dk_base, sdk_s, union_base, count, PAIRS, D, BLOCK_K, STAGES, 0)),
        (_consumer, (O, DQ, DK, DV, ROWBITS, UNION, LSE, q_smem, do_smem, k_bufs, v_bufs, p_smem, ds_smem, ready,
                     empty, scale, scale_log2, tile, S_q, G, o_base, so_s, so_h, dq_base, sdq_s, sdq_h, lse_base,
                     sl_h, sl_s, dk_base, sdk_s, union_base, count, PAIRS, D, BLOCK_K, STAGES, 1)),
        (_producer, (Q, DO, LSE, K, V, UNION, q_smem, do_smem, k_bufs, v_bufs, ready, empty,
                     tile, S_q, G, q_base, sq_s, sq_h, do_base, sdo_s, sdo_h, lse_base, sl_h, sl_s,
                     kv_base_k, kv_base_v, sk_s, sv_s, union_base, count, PAIRS, D, BLOCK_K, STAGES)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
