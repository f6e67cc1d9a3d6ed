"""Fixed-point dK/dV of the deterministic backward: the scale, the rounding, the conversion back.

The deterministic backward (``backward.py`` with ``DETERMINISTIC``, and on Hopper
``backward_sm90.py`` with it, which calls :func:`fixed_point_factors` from Gluon) is the
fused backward with one change: each program's fp32 dK/dV block contributions are multiplied by a power of
two ``2**e`` (exact in fp32), rounded to the nearest integer (ties to even), and added with
int64 atomics. Integer addition is associative, so the sums do not depend on the order in
which the GPU runs the atomics: dK/dV are bitwise reproducible, and equal across frameworks
that launch the same kernels (``qsa_torch``, ``qsa_jax``). dQ is stored once per (row,
head) by the one program that owns it, as in the default backward, so it is reproducible
already. :func:`fixed_point_kernel` turns the int64 sums into the output dtype.

**The bound.** For batch row b, KV head g, key j and lane d, with the N = S_q * G (row, head)
pairs (i, h) of (b, g), P the softmax probabilities (0 <= P <= 1, zero off the routes),
dP = dO . v_j and delta = dO . o (o = sum_j P v_j, a convex combination of routed V rows):

* |dV[j, d]| = |sum P dO[d]| <= N * max|dO|
* |dK[j, d]| = scale * |sum P (dP - delta) q[d]| <= scale * N * 2 * D * max|dO| * max|V| * max|Q|

since |dP| and |delta| are at most D * max|dO| * max|V|. Every partial sum of the
contributions (each program adds a partial sum of the same terms) obeys the same bound.
The maxima are over the rows ``[b, i, h, :]`` of Q and of dO whose own maximum is finite
and whose (row, head) pair has routes (LSE not +inf; the others are not read), and over
the rows of V whose own maximum is finite (rows that no route names may hold anything:
they must neither poison nor be needed; a non-finite V row that a route does name is
caught by the dQ check below). A row that holds a non-finite q or dO entry is confined
(``language.confine_non_finite``): it adds NaN at the keys it routes and exact zeros
elsewhere, so none of its finite entries enters a sum, and every row that does enter has
a finite q and dO (a finite LSE and delta). The launcher hands the maxima to the kernels
as ``MAXIMA`` (fp32 ``[3]``: max|Q|, max|dO|, max|V|), computed with framework reductions
that are exact (maxima round nothing, so both frameworks get the same bits). Exponents
are exact integers, so nothing overflows at any input magnitude:
``E = ceil(log2(2 * scale * N * D)) + ceil(log2 max|dO|) + ceil(log2 max|V|) +
ceil(log2 max|Q|)`` for dK (the first term on the host, exactly, from the fp32 scale:
``qsa_triton.launch.fixed_point_bounds``; the others here from the maxima's bits, 2**-126
standing for subnormals), ``E = ceil(log2 N) + ceil(log2 max|dO|)`` for dV, and

    e = min(61 - E, 126)        (a zero maximum: the bound is 0 and e = 126)

**No overflow.** With 2**E >= bound, every partial sum of the rounded contributions is at
most 2**e * bound * (1 + eps) + n / 2 <= 2**61 * (1 + eps) + n / 2 < 2**63, where (1 + eps) < 2
covers the kernel's own rounding (P from the fp32 LSE, the 16-bit operands of the dK/dV
products, fp32 accumulation) and n (the number of contributions) is far below 2**61. The
bound holds while the forward's LSE pins P <= 2, i.e. for scores below ~2**22 in magnitude
(beyond that fp32 softmax means nothing, in the default backward too). Bounds above 2**127
(gradients that may exceed fp32's range) are refused: that gradient comes out NaN. So an
element's sum never wraps, and 2**e and 2**-e are normal fp32 numbers (-66 <= e <= 126).

**Precision.** Each contribution is rounded to a multiple of 2**-e: an error of at most
2**-(e+1) <= 2**(E-62) (E < -65 has e = 126: at most 2**-127, still below fp32's resolution
of anything above 2**-103). A key element receives n contributions, one per backward
program whose union holds the key (n <= ceil(N / M) for M (row, head) pairs per program),
so its absolute error is at most n * 2**(E-62): n * 2**-62 of 2**E, which is at most 16
times the bound (each of the four ceilings adds at most a bit); the default fp32 atomics
err by up to n * 2**-24 of the running sum. The int64 sum is converted to
fp32 once (rounded to nearest), scaled by 2**-e (exact) and cast to the output dtype.

**Non-finite values.** The int64 sums cannot carry a NaN, so the kernels say where one
went in ``FLAG`` (int32 ``[1 + B * S_kv * Hkv]``, zeroed) and the conversion writes NaN
there instead of the sum; a NaN never becomes a finite number. A non-finite value in row
i's q or dO confines the row: its contributions are NaN at exactly the keys it routes
(every lane of their dK and dV, as in the default backward) and zero elsewhere, so the
kernel sets FLAG[1 + r] for the accumulator rows r = (b * S_kv + j) * Hkv + g of those
keys j (read from the union's rowbits: no per-element test) and only they come out NaN;
the rest of dK/dV keeps its finite value. Any other non-finite contribution (a routed K
or V row holding NaN/inf, an overflowing score) makes some unconfined pair's dQ
non-finite (its P or dS met the NaN/inf; 0 * inf is NaN too): the kernel sets FLAG[0]
and dK and dV are NaN everywhere, as it cannot tell which keys it reached. The kernels
read only K/V rows that the program's own rows route to, so unrouted rows never reach
either flag.

Signature order is the launchers' contract (``qsa_triton.launch``): array inputs, fp32
scalars, outputs, then integers and constexprs (by keyword).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .language import cast, load_count

TARGET_C = tl.constexpr(61)  # bound * 2**e <= 2**61: a factor 4 below int64's range
E_MAX_C = tl.constexpr(126)  # 2**e and 2**-e stay normal fp32 numbers
E_LIMIT_C = tl.constexpr(127)  # larger bounds may exceed fp32's range: refused
E_ZERO_C = tl.constexpr(-(1 << 20))  # the exponent of a zero maximum (a zero bound)
EXACT_C = tl.constexpr(8388608.0)  # 2**23: fp32 values this large are integers; (x + 2**23) - 2**23
# rounds 0 <= x < 2**23 to an integer by the fp32 adder (ties to even), likewise with -2**23 below 0
INT64_SAFE_C = tl.constexpr(4611686018427387904.0)  # 2**62


@triton.jit
def _ceil_log2(x):
    """ceil(log2 x) of fp32 x >= 0 from its bits (int32): -126 for subnormals (an
    upper bound), E_ZERO for zero; the caller checks finiteness."""
    bits = x.to(tl.int32, bitcast=True)
    expo = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    e = tl.where(mant != 0, expo - 126, expo - 127)
    return tl.where(expo == 0, tl.where(mant == 0, E_ZERO_C, -126), e)


@triton.jit
def _finite(x):
    """Whether fp32 x is finite, from its exponent bits."""
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) != 0xFF


@triton.jit
def _power_of_two(e):
    """2**e as fp32, for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fixed_point_exponents(MAXIMA, BOUND_K, BOUND_V):
    """``(e_k, e_v, ok_k, ok_v)``: the exponents of dK and dV, and whether each bound is
    usable (the maxima finite, the bound at most 2**127).

    ``MAXIMA``: fp32 [3], max|Q|, max|dO|, max|V| (finite rows). ``BOUND_K`` /
    ``BOUND_V``: the host's exact ceil(log2(2 * scale * N * D)) and ceil(log2 N). Scalar
    code only (no block layouts), so the Gluon kernels call it too."""
    m_q = tl.load(MAXIMA)
    m_do = tl.load(MAXIMA + 1)
    m_v = tl.load(MAXIMA + 2)
    inputs_ok = _finite(m_q) & _finite(m_do) & _finite(m_v)
    big_k = BOUND_K + _ceil_log2(m_q) + _ceil_log2(m_do) + _ceil_log2(m_v)
    big_v = BOUND_V + _ceil_log2(m_do)
    e_k = tl.minimum(TARGET_C - big_k, E_MAX_C)
    e_v = tl.minimum(TARGET_C - big_v, E_MAX_C)
    return e_k, e_v, inputs_ok & (big_k <= E_LIMIT_C), inputs_ok & (big_v <= E_LIMIT_C)


@triton.jit
def fixed_point_factors(MAXIMA, BOUND_K, BOUND_V):
    """``(2**e_k, 2**e_v)`` (fp32), 0 for a refused bound (the conversion writes NaN there)."""
    e_k, e_v, ok_k, ok_v = fixed_point_exponents(MAXIMA, BOUND_K, BOUND_V)
    f_k = tl.where(ok_k, _power_of_two(tl.maximum(e_k, -126)), 0.0)
    f_v = tl.where(ok_v, _power_of_two(tl.maximum(e_v, -126)), 0.0)
    return f_k, f_v


@triton.jit
def add_fixed(ptr, x, mask, INTERPRET: tl.constexpr):
    """``*ptr += round(x)`` for the int64 accumulators ``ptr`` where ``mask``: fp32 ``x``
    (already scaled by 2**e) rounded to the nearest integer, ties to even, and added
    with relaxed int64 atomics.

    On the GPU the rounding is one pure inline ``cvt.rni.s64.f32`` per element and the add
    ``tl.atomic_add``, which adds each element once whatever the block's layout (an inline
    side-effecting add would run once per thread that holds the element, and small tiles'
    layouts hold elements in several threads). The interpreter has no PTX (and no
    libdevice): there
    the fp32 adder rounds the same way ((x + 2**23) - 2**23 for 0 <= x < 2**23, the same
    with -2**23 below 0; larger fp32 values are integers already) and ``tl.atomic_add``
    adds; values outside (-2**62, 2**62), NaN included, become 0 there, as numpy's cast of
    them is undefined (they occur only where the conversion writes NaN anyway)."""
    if INTERPRET:
        shift = tl.where(x < 0, -EXACT_C, EXACT_C)
        r = tl.where(tl.abs(x) < EXACT_C, (x + shift) - shift, x)
        r = tl.where(tl.abs(r) < INT64_SAFE_C, r, 0.0)
        tl.atomic_add(ptr, r.to(tl.int64), mask=mask, sem="relaxed")
    else:
        r = tl.inline_asm_elementwise("cvt.rni.s64.f32 $0, $1;", "=l,f", [x], dtype=tl.int64,
                                      is_pure=True, pack=1)
        tl.atomic_add(ptr, r, mask=mask, sem="relaxed")


@triton.jit
def fixed_point_kernel(DK_FIXED, DV_FIXED, MAXIMA, FLAG, DK, DV, n, D, BOUND_K, BOUND_V,
                       BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """DK, DV (the output dtype, ``n`` elements each, contiguous rows of ``D``) from the
    int64 sums DK_FIXED, DV_FIXED (any 32-bit-word buffer holding ``n`` int64,
    contiguous): each sum rounded to fp32, times 2**-e (exact), cast to the output
    dtype; NaN in every row r whose FLAG[1 + r] is set, everywhere where FLAG[0] is set
    or the tensor's bound was refused (FLAG: int32 ``[1 + n / D]``, as the backward wrote
    it). ``MAXIMA``, ``BOUND_K``, ``BOUND_V``: as the backward got them. Grid:
    ``ceil(n / BLOCK)``."""
    e_k, e_v, ok_k, ok_v = fixed_point_exponents(MAXIMA, BOUND_K, BOUND_V)
    clean = load_count(FLAG, 0) == 0
    inv_k = tl.where(ok_k & clean, _power_of_two(-tl.maximum(e_k, -126)), float("nan"))
    inv_v = tl.where(ok_v & clean, _power_of_two(-tl.maximum(e_v, -126)), float("nan"))
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    flagged = tl.load(FLAG + 1 + offs // D, mask=ok, other=0) != 0
    dk = tl.load(DK_FIXED.to(tl.pointer_type(tl.int64)) + offs, mask=ok, other=0)
    dk = tl.where(flagged, float("nan"), dk.to(tl.float32) * inv_k)
    tl.store(DK + offs, cast(dk, DK.dtype.element_ty, INTERPRET), mask=ok)
    dv = tl.load(DV_FIXED.to(tl.pointer_type(tl.int64)) + offs, mask=ok, other=0)
    dv = tl.where(flagged, float("nan"), dv.to(tl.float32) * inv_v)
    tl.store(DV + offs, cast(dv, DV.dtype.element_ty, INTERPRET), mask=ok)
