"""Forward kernel for Hopper (sm_90a) in Gluon: warp-specialized token gathers.

The same program, unions and math as ``forward.py`` (flat programs of ``PAIRS`` (row,
head) pairs of one KV head's group, the tile union walked in chunks of BLOCK_K IDs, an
fp32 online softmax in the log2 domain), split across warps as in FlashAttention-3 /
FlashMLA: a 4-warp producer partition gathers each chunk's K and V rows with cp.async
into two rings of shared-memory buffers (STAGES + 1 for K, STAGES for V) and signals an
mbarrier per buffer (one ``cp.async.mbarrier.arrive.noinc`` per producer thread, so a
barrier completes when all of the chunk's copies have landed); two consumer partitions of
one warpgroup each (64 matrix rows apiece) run the wgmma products and the softmax, and
release each buffer with one arrival each once the products that read it are done: a
chunk's K once its scores are, its V once its P V is, a turn later (hence K's extra
buffer). Gathers of the next chunks thus overlap the products of chunk j. The consumers
take turns issuing their products (FlashAttention-3's ping-pong schedule, two more
mbarriers): each turn issues one consumer's P V of a chunk and its scores of the next, so
that one consumer's softmax overlaps the other's products; the chunk's V is released once
its P V is done, while the next scores still run.

Scope (``qsa_triton.launch.forward_sm90_launch``): 16-bit inputs, D = 256 with unit
stride along D, programs of PAIRS = 128 (row, head) pairs (flat, or padded tiles of all G
heads), BLOCK_K = 64, an unfolded grid; everything else takes ``forward.py``. Both
kernels give the same bits (the same products in the same order). torch launches it
directly; JAX through jax-triton 0.3.1 with ``qsa_jax._triton_call.install_gluon_compile``. Gluon kernels do not run in
Triton's interpreter: this one is tested on the GPU only, against ``forward.py`` and the
float64 oracle (``tests/test_forward_sm90.py``).

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

# Gluon's cp.async gather: ``async_load`` (triton >= 3.7), ``async_copy_global_to_shared``
# before (triton 3.6, which removed nothing else this kernel uses)
_gather_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

PRODUCER_WARPS = gl.constexpr(4)
# registers per thread (setmaxnreg) of the producer (the addresses of its 16-byte copies)
# and of the second consumer warpgroup (its [64, 256] fp32 accumulator in flight beside the
# next chunk's scores: with 208, ptxas serializes the wgmma, C7512; the first consumer gets
# what is left of 3 x 168: 224)
PRODUCER_REGS = gl.constexpr(64)
CONSUMER_REGS = gl.constexpr(216)


@gluon.constexpr_function
def _wgmma_layout(num_warps, n):
    """The register layout of an m64nN wgmma accumulator (fp32 [64 * num_warps / 4, N]) on
    ``num_warps`` warps stacked along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _pairs(tile, S_q, G, layout: gl.constexpr, PAIRS: gl.constexpr, FIRST: gl.constexpr, ROWS: gl.constexpr):
    """Per matrix row m in [FIRST, FIRST + ROWS) (in ``layout``): its bit t in
    ``rowbits``, query row and head within the group (int64, 0 where invalid) and validity
    (``language.pair_coordinates``, flat)."""
    m = FIRST + gl.arange(0, ROWS, layout=layout)
    pair = tile * PAIRS + m
    row = pair // G
    t = row - (tile * PAIRS) // G
    row_ok = row < S_q
    head = gl.where(row_ok, pair % G, 0).to(gl.int64)
    row64 = gl.where(row_ok, row, 0).to(gl.int64)
    return t, row64, head, row_ok


@gluon.jit
def _chunk_ids(UNION, base, start, count, rows):
    """IDs of union chunk [start, start + len(rows)); entries past the count repeat IDs of
    the union (``language.gather_chunk``'s rule), so every gathered row is a routed one."""
    u = start + rows
    src = gl.where(u < count, u, u - count)
    return gl.load(UNION + base + gl.where(src < count, src, 0))


@gluon.jit
def _producer(Q, K, V, UNION, q_smem, k_bufs, v_bufs, ready, empty,
              tile, S_q, G, q_base, sq_s, sq_h, kv_base_k, kv_base_v, sk_s, sv_s, union_base, count,
              PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              KS: gl.constexpr):
    # [rows, D] pointer tiles: 8 lanes of 16 bytes per thread per row, one warp per row
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    # the program's Q rows, once (rows past S_q are zero-filled)
    _, row64, head, row_ok = _pairs(tile, S_q, G, gl.SliceLayout(1, blk), PAIRS, 0, PAIRS)
    q_ptr = Q + gl.expand_dims(q_base + row64 * sq_s + head * sq_h, 1) + gl.expand_dims(cols, 0)
    q_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < D, 0)
    _gather_to_shared(q_smem, q_ptr, q_mask)
    async_copy.mbarrier_arrive(ready.index(KS + STAGES), increment_count=False)
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, blk))
    n_chunks = gl.cdiv(count, BLOCK_K)
    for j in range(n_chunks):
        sk = j % KS
        sv = j % STAGES
        # a fresh barrier counts as released for parity 1: each ring's first round of waits
        # passes
        mbarrier.wait(empty.index(sk), ((j // KS) & 1) ^ 1)
        ids = _chunk_ids(UNION, union_base, j * BLOCK_K, count, rows)
        k_ptr = K + kv_base_k + gl.expand_dims(ids * sk_s, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(k_bufs.index(sk), k_ptr)
        async_copy.mbarrier_arrive(ready.index(sk), increment_count=False)
        # V's buffer is released a turn after K's (once the chunk's P V is done)
        mbarrier.wait(empty.index(KS + sv), ((j // STAGES) & 1) ^ 1)
        v_ptr = V + kv_base_v + gl.expand_dims(ids * sv_s, 1) + gl.expand_dims(cols, 0)
        _gather_to_shared(v_bufs.index(sv), v_ptr)
        async_copy.mbarrier_arrive(ready.index(KS + sv), increment_count=False)


@gluon.jit
def _consumer(ROWBITS, O, LSE, q_smem, k_bufs, v_bufs, ready, empty, turn, scale_log2,
              tile, S_q, G, o_base, so_s, so_h, lse_base, sl_h, sl_s, union_base, count,
              PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              KS: gl.constexpr, HALF: gl.constexpr):
    """Matrix rows [HALF * 64, HALF * 64 + 64) of the program, on one warpgroup.

    The two consumers take turns issuing their products (FlashAttention-3's ping-pong
    schedule): in turn t a consumer issues chunk t - 1's P V and chunk t's scores, then
    runs chunk t's softmax while the other consumer's turn t fills the tensor cores; the
    first consumer's turn t comes after the second's turn t - 1. ``turn.index(h)``
    completes when consumer h may start its next turn."""
    nw: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = PAIRS // 2
    gl.static_assert(STAGES >= 2, "chunk j + 1's scores are issued before chunk j's buffer is released")
    # [ROWS, BLOCK_K] scores and [ROWS, D] output
    s_layout: gl.constexpr = _wgmma_layout(nw, BLOCK_K)
    o_layout: gl.constexpr = _wgmma_layout(nw, D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    t_s, row64, head, ok_s = _pairs(tile, S_q, G, row_s, PAIRS, HALF * ROWS, ROWS)
    q_rows = q_smem.slice(HALF * ROWS, ROWS, dim=0)
    cols_k = gl.arange(0, BLOCK_K, layout=col_s)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_K], gl.float32, layout=s_layout)
    mine = turn.index(HALF)
    other = turn.index(1 - HALF)
    mbarrier.wait(ready.index(KS + STAGES), 0)
    n_chunks = gl.cdiv(count, BLOCK_K)
    # turn 0: chunk 0's scores (without chunks the product reads a buffer nobody filled and
    # nothing reads its result)
    bits = gl.load(ROWBITS + union_base + cols_k, mask=cols_k < count, other=0)
    mbarrier.wait(mine, 0, pred=HALF == 1)
    mbarrier.wait(ready.index(0), 0, pred=n_chunks > 0)
    fence_async_shared()  # cp.async (generic proxy) writes before wgmma (async proxy) reads
    scores = warpgroup_mma(q_rows, k_bufs.index(0).permute([1, 0]), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(other, count=1)
    scores = warpgroup_mma_wait(0, deps=[scores])
    mbarrier.arrive(empty.index(0), count=1, pred=n_chunks > 0)  # chunk 0's K is read
    for j in range(n_chunks):
        sv = j % STAGES
        phase = (j // STAGES) & 1
        member = (((gl.expand_dims(bits, 0) >> gl.expand_dims(t_s, 1)) & 1) != 0) & gl.expand_dims(ok_s, 1)
        scores = gl.where(member, scores * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
        # rows with nothing seen yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(scores - gl.expand_dims(m_shift, 1))
        alpha = gl.exp2(m_i - m_shift)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(k_bufs.dtype), p_layout)
        # turn j + 1: chunk j's P V, then chunk j + 1's scores (the last turn repeats chunk
        # j's scores, which nobody reads: every product is unconditional; their K buffer was
        # released a turn earlier, but the producer gathers nothing after the last chunk)
        nxt = gl.minimum(j + 1, n_chunks - 1)
        s_next = nxt % KS
        u = nxt * BLOCK_K + cols_k
        bits = gl.load(ROWBITS + union_base + u, mask=u < count, other=0)
        mbarrier.wait(ready.index(KS + sv), phase)
        mbarrier.wait(mine, (j + HALF) & 1)
        fence_async_shared()
        acc = warpgroup_mma(p_op, v_bufs.index(sv), acc, is_async=True)
        mbarrier.wait(ready.index(s_next), (nxt // KS) & 1)
        fence_async_shared()
        scores = warpgroup_mma(q_rows, k_bufs.index(s_next).permute([1, 0]), zero_s, use_acc=False, is_async=True)
        mbarrier.arrive(other, count=1)
        # chunk j's P V first (wgmma groups retire in order): its V buffer is free while the
        # scores still run
        acc = warpgroup_mma_wait(1, deps=[acc])
        mbarrier.arrive(empty.index(KS + sv), count=1)  # chunk j's V is read
        scores = warpgroup_mma_wait(0, deps=[scores])
        mbarrier.arrive(empty.index(s_next), count=1, pred=j + 1 < n_chunks)  # chunk j + 1's K is read

    # l_i is 0 exactly for a row without routes; NaN counts as routed (forward.py)
    has = l_i != 0.0
    inv = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), gl.SliceLayout(1, o_layout))
    out = acc * gl.expand_dims(inv, 1)
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_off = gl.convert_layout(o_base + row64 * so_s + head * so_h, gl.SliceLayout(1, o_layout))
    o_ok = gl.convert_layout(ok_s, gl.SliceLayout(1, o_layout))
    o_ptr = O + gl.expand_dims(o_off, 1) + gl.expand_dims(cols_o, 0)
    gl.store(o_ptr, out.to(O.dtype.element_ty), mask=gl.expand_dims(o_ok, 1) & gl.expand_dims(cols_o < D, 0))
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("inf"))
    gl.store(LSE + lse_base + head * sl_h + row64 * sl_s, lse, mask=ok_s)


@gluon.jit
def qsa_forward_sm90_kernel(
    Q, K, V, UNION, COUNT, ROWBITS,
    scale_log2,
    O, LSE,
    sq_b, sq_s, sq_h,
    sk_b, sk_s, sk_h,
    sv_b, sv_s, sv_h,
    so_b, so_s, so_h,
    sl_b, sl_h, sl_s,
    S_q, N_TILES, UNION_WIDTH, HKV, G,
    PAIRS: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
):
    """``forward.py``'s ``qsa_forward_kernel`` for flat programs (same arguments, less
    the unit D strides, the sizes it fixes and the constexprs of its other cases):
    writes O [B,S_q,Hq,D] (input dtype) and LSE [B,Hq,S_q] (fp32, +inf for rows without
    routes). Q [B,S_q,Hq,D], K/V [B,S_kv,Hkv,D] with unit stride along D and row offsets
    (ID * row stride) that fit int32 (batch and head offsets are int64); UNION/ROWBITS
    int32 [B, N_TILES, UNION_WIDTH], COUNT int32 [B, N_TILES]. Grid ``(N_TILES, B * HKV)``;
    launch with num_warps = 4 (the first consumer; the other partitions' warps come on top)."""
    tile = gl.program_id(0)
    pid = gl.program_id(1)
    b64 = (pid // HKV).to(gl.int64)
    g = pid % HKV
    # bases of the group's first head (int64: a head stride times the head can pass
    # int32); the partitions add each pair's row and head
    q_base = b64 * sq_b + (g * G).to(gl.int64) * sq_h
    o_base = b64 * so_b + (g * G).to(gl.int64) * so_h
    lse_base = b64 * sl_b + (g * G).to(gl.int64) * sl_h
    union_base = (b64 * N_TILES + tile) * UNION_WIDTH
    count = gl.load(COUNT + b64 * N_TILES + tile)
    kv_base_k = b64 * sk_b + g.to(gl.int64) * sk_h
    kv_base_v = b64 * sv_b + g.to(gl.int64) * sv_h

    io_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAIRS, D], Q.dtype.element_ty)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D], K.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [PAIRS, D], io_layout)
    KS: gl.constexpr = STAGES + 1  # K is released a turn before V: one more K buffer
    k_bufs = gl.allocate_shared_memory(K.dtype.element_ty, [KS, BLOCK_K, D], kv_layout)
    v_bufs = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, BLOCK_K, D], kv_layout)
    # ready: K buffer s (s < KS), V buffer s (KS + s), Q (KS + STAGES); each completes on one
    # noinc cp.async arrival per producer thread. empty: K and V buffers, indexed alike; one
    # arrival per consumer.
    ready = gl.allocate_shared_memory(gl.int64, [KS + STAGES + 1, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [KS + STAGES, 1], mbarrier.MBarrierLayout())
    # turn.index(h): consumer h may issue its next products (_consumer)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(KS + STAGES + 1):
        mbarrier.init(ready.index(i), count=32 * PRODUCER_WARPS)
    for i in gl.static_range(KS + STAGES):
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    gl.warp_specialize([
        (_consumer, (ROWBITS, O, LSE, q_smem, k_bufs, v_bufs, ready, empty, turn, scale_log2, tile, S_q, G, o_base,
                     so_s, so_h, lse_base, sl_h, sl_s, union_base, count, PAIRS, D, BLOCK_K, STAGES, KS, 0)),
        (_consumer, (ROWBITS, O, LSE, q_smem, k_bufs, v_bufs, ready, empty, turn, scale_log2, tile, S_q, G, o_base,
                     so_s, so_h, lse_base, sl_h, sl_s, union_base, count, PAIRS, D, BLOCK_K, STAGES, KS, 1)),
        (_producer, (Q, K, V, UNION, q_smem, k_bufs, v_bufs, ready, empty,
                     tile, S_q, G, q_base, sq_s, sq_h, kv_base_k, kv_base_v, sk_s, sv_s, union_base, count,
                     PAIRS, D, BLOCK_K, STAGES, KS)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
