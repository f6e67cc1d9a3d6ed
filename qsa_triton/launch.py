"""What every kernel launch passes, as data: the one source of both launchers' calls.

A :class:`Launch` names the kernel, its grid, warps and stages, and its arguments in the
kernels' signature order: array inputs, fp32 scalars, outputs, then integers and
constexprs by keyword. ``qsa_torch`` passes everything by keyword to
``kernel[grid](...)``; ``qsa_jax`` passes the inputs and scalars positionally to
``jax_triton.triton_call`` (which appends the outputs, and takes the rest as
compile-time constants). Both build their launches with the functions below from the
same plan, so the same shapes give the same grids, tiles, constexprs and fp32 scalars
(``scale * log2(e)`` rounded to fp32 once, here), the precondition of bitwise-equal
forward outputs across frameworks.

Strides are per-element integers; the torch launcher hands the tensors' own (any
strides), the JAX launcher row-major ones. Pure Python apart from :func:`kernel`, which
imports triton and the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from qsa_common.errors import InvalidInput, UnsupportedShape

from .plan import (
    INT32_MAX,
    MAX_GRID_X,
    CutStep,
    Plan,
    SortStep,
    fold_grid,
    min_backward_block_k,
    offsets_fit_int32,
    rank_words,
)

__all__ = ["Output", "Launch", "Attempt", "Operand", "UNION_BLOCK", "UNION_WARPS", "UNION_STAGES", "RANK_WARPS",
           "RANK_SCRATCH_BYTES",
           "LOG2E", "FIXED_POINT_BLOCK", "fp32", "contiguous_strides", "attempts", "forward_launch",
           "backward_launch", "forward_sm90_launch", "SM90_FORWARD_SHARED", "backward_sm90_launch",
           "attention_input_dtypes",
           "SM90_BACKWARD_SHARED",
           "fixed_point_bounds", "fixed_point_launch", "keys_launch", "merge_launch", "rank_window", "rank_launch",
           "cut_launch", "kernel", "compile_signature", "interpreted", "interprets"]

LOG2E = 1.4426950408889634
UNION_BLOCK = 1024  # keys (IDs) per step of the union kernels
# the union kernels' launch options: Triton's defaults on CUDA, stated once for both launchers
UNION_WARPS, UNION_STAGES = 4, 3
FIXED_POINT_BLOCK = 1024  # elements per program of the fixed-point conversion
# the rank kernel runs one program per group through four dependent passes: 8 warps keep more
# of each pass's memory operations in flight
RANK_WARPS = 8
RANK_SCRATCH_BYTES = 40  # the rank kernel's scratch per word of 32 IDs: 32 mark bytes, PRESENT, PREFIX

Operand = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, per-element strides)


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32, as a Python float (exact in fp32)."""
    return float(np.float32(x))


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= int(size)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Output:
    """An output buffer: ``zeroed`` ones are accumulated into and must be zero on entry;
    the kernels write every element of the others."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    zeroed: bool = False


@dataclass(frozen=True)
class Launch:
    """One kernel call: ``kernel`` (a name for :func:`kernel`), its ``grid``, ``num_warps``
    and ``num_stages``; ``inputs`` (array argument names), ``scalars`` ((name, fp32 value)),
    ``outputs`` and ``params`` ((name, int or bool): sizes, strides, constexprs), each
    group in the kernel's signature order."""

    kernel: str
    grid: tuple[int, ...]
    inputs: tuple[str, ...]
    scalars: tuple[tuple[str, float], ...]
    outputs: tuple[Output, ...]
    params: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int

    def arg_names(self) -> tuple[str, ...]:
        """Every argument name, in the order the kernel's signature must have them."""
        return (self.inputs + tuple(n for n, _ in self.scalars) + tuple(o.name for o in self.outputs)
                + tuple(n for n, _ in self.params))


@dataclass(frozen=True)
class Attempt:
    """The per-launch choices that may be narrowed when a configuration does not fit the
    device's shared memory: heads per program, union IDs per step, pipeline stages."""

    heads: int
    block_k: int
    stages: int


def attempts(plan: Plan, backward: bool) -> list[Attempt]:
    """The plan's own choice first, then the narrower fallbacks in order: one stage,
    narrower union chunks, then (padded tiles only; flat programs own fixed pair ranges,
    the unions depend on them) fewer heads per program."""
    b = plan.blocks
    rows = plan.backward_rows if backward else plan.rows_per_tile
    heads = plan.bwd_heads if backward else plan.fwd_heads
    block_k, stages = (b.backward_block_k, b.backward_num_stages) if backward else (b.block_k, b.num_stages)
    head_options = [heads] if plan.flat else [h for h in (heads, heads // 2, heads // 4) if h >= 1 and rows * h >= 16]
    chunk_options = [(block_k, stages), (block_k, 1)] + [(bk, 1) for bk in (block_k // 2, block_k // 4)]

    def allowed(h: int, bk: int) -> bool:  # flat programs: h is their pair count
        return not backward or bk >= min_backward_block_k(h if plan.flat else rows * h, plan.head_dim_pad)

    return list(dict.fromkeys(Attempt(h, bk, st) for h in head_options for bk, st in chunk_options
                              if bk >= 16 and allowed(h, bk)))


def _strides(prefix: str, strides, names) -> list[tuple[str, int]]:
    return [(prefix + n, int(s)) for n, s in zip(names, strides)]


_BSHD, _BHS, _BSH = ("b", "s", "h", "d"), ("b", "h", "s"), ("b", "s", "h")


def _kernel_shape(plan: Plan, q: Operand, k: Operand, union_shape, backward: bool, dtype: str,
                  interpreted: bool, attempt: Attempt | None):
    """Grid, integer arguments and constexprs shared by the forward and backward kernels."""
    (bsz, s_q, _, d), (_, _, hkv, _) = q[0], k[0]
    _, n_tiles, width = union_shape
    if not plan.pairs_fit(s_q):
        raise UnsupportedShape("the flat tiling indexes (row, head) pairs in int32: "
                         f"S_q * G = {s_q * plan.group} is too many; use flatten_heads=False")
    attempt = attempt or attempts(plan, backward)[0]
    chunks = 1 if plan.flat else -(-plan.group // attempt.heads)
    grid, fold = fold_grid(n_tiles, bsz * hkv * chunks, plan.max_grid_y)
    rows = 1 if plan.flat else (plan.backward_rows if backward else plan.rows_per_tile)
    ints = [("B", bsz), ("S_q", s_q), ("N_TILES", n_tiles), ("UNION_WIDTH", width), ("HKV", hkv),
            ("G", plan.group), ("D", d), ("N_CHUNKS", chunks)]
    constexprs = [("T", rows), ("HB", attempt.heads), ("D_PAD", plan.head_dim_pad), ("BLOCK_K", attempt.block_k),
                  ("IEEE", interpreted or dtype == "float32"), ("INTERPRET", interpreted), ("FLAT", plan.flat),
                  ("EVEN_D", d == plan.head_dim_pad)]
    return grid, fold, ints, constexprs, attempt


def _kv_extents(*operands: Operand):
    """(rows, row stride, cols, col stride) of K/V-like ``[B, S_kv, Hkv, D]`` operands."""
    return [(shape[1], strides[1], shape[3], strides[3]) for shape, strides in operands]


def forward_launch(plan: Plan, q: Operand, k: Operand, v: Operand, union_shape: tuple[int, int, int],
                   scale: float, dtype: str, *, interpreted: bool, attempt: Attempt | None = None) -> Launch:
    """The forward kernel over unions of shape ``union_shape`` = ``[B, n_tiles, width]``
    (the recipe's result). Outputs: O ``[B, S_q, Hq, D]`` in ``dtype`` (the inputs'),
    LSE fp32 ``[B, Hq, S_q]``, both row-major and written in full."""
    bsz, s_q, hq, d = q[0]
    grid, fold, ints, constexprs, attempt = _kernel_shape(plan, q, k, union_shape, False, dtype, interpreted,
                                                          attempt)
    o_shape, lse_shape = (bsz, s_q, hq, d), (bsz, hq, s_q)
    strides = (_strides("sq_", q[1], _BSHD) + _strides("sk_", k[1], _BSHD) + _strides("sv_", v[1], _BSHD)
               + _strides("so_", contiguous_strides(o_shape), _BSHD)
               + _strides("sl_", contiguous_strides(lse_shape), _BHS))
    offs32 = offsets_fit_int32(_kv_extents(k, v), plan.offset_limit)
    return Launch(
        "forward", grid, ("Q", "K", "V", "UNION", "COUNT", "ROWBITS"), (("scale_log2", fp32(scale * LOG2E)),),
        (Output("O", o_shape, dtype), Output("LSE", lse_shape, "float32")),
        tuple(strides + ints + constexprs + [("OFFS32", offs32), ("FOLD", fold)]),
        plan.blocks.num_warps, attempt.stages)


# The Hopper forward (forward_sm90.py): its fixed tiling (STAGES: V buffers; K has one
# more), and the shared memory of its sm_90a compile (Q, three K and two V buffers,
# barriers; triton 3.6's and 3.9's alike).
SM90_FORWARD_PAIRS, SM90_FORWARD_BLOCK_K, SM90_FORWARD_STAGES, SM90_FORWARD_WARPS = 128, 64, 2, 4
SM90_FORWARD_SHARED = 229752
# The Hopper backward (backward_sm90.py): its union chunk and the shared memory
# of its sm_90a compile (Q, dO, one K/V stage, P, dS, barriers; triton 3.6's and 3.9's alike).
SM90_BACKWARD_BLOCK_K = 64
SM90_BACKWARD_SHARED = 229952


def _copies_aligned(*operands: Operand) -> bool:
    """Whether the Hopper kernels' 16-byte copies can read each operand: unit stride along
    D, every other stride a multiple of 16 elements."""
    return all(st[3] == 1 and all(int(x) % 16 == 0 for x in st[:3]) for _, st in operands)


def forward_sm90_launch(plan: Plan, q: Operand, k: Operand, v: Operand, union_shape: tuple[int, int, int],
                        scale: float, dtype: str) -> Launch | None:
    """:func:`forward_launch` for the warp-specialized Hopper kernel (``forward_sm90.py``;
    same outputs, bitwise the same unions and order of the softmax updates), or None where
    the operands are outside its scope: programs of 128 (row, head) pairs (flat, or padded
    tiles holding all G heads) and 64-ID chunks, 16-bit inputs, D = 256 with unit stride
    along D, every other stride a multiple of 16 (the 16-byte copies' alignment), K/V row
    offsets within int32, an unfolded grid. The caller checks the device (sm_90) and the
    base pointers' 16-byte alignment."""
    (bsz, s_q, hq, d), (_, _, hkv, _) = q[0], k[0]
    _, n_tiles, width = union_shape
    # flat programs of 128 pairs, or padded tiles of all G heads x 128 / G rows: the same
    # programs (pair p * 128 + m is row (p * 128 + m) // G, head (p * 128 + m) % G)
    pairs = plan.fwd_heads if plan.flat else plan.rows_per_tile * plan.group
    if not plan.flat and plan.fwd_heads != plan.group:
        return None
    if (dtype not in ("bfloat16", "float16") or d != 256 or pairs != SM90_FORWARD_PAIRS
            or s_q * plan.group > INT32_MAX - pairs or plan.blocks.block_k != SM90_FORWARD_BLOCK_K):
        return None
    if not _copies_aligned(q, k, v):
        return None
    if not offsets_fit_int32(_kv_extents(k, v), plan.offset_limit) or bsz * hkv > plan.max_grid_y:
        return None
    o_shape, lse_shape = (bsz, s_q, hq, d), (bsz, hq, s_q)
    params = (_strides("sq_", q[1], _BSH) + _strides("sk_", k[1], _BSH) + _strides("sv_", v[1], _BSH)
              + _strides("so_", contiguous_strides(o_shape), _BSH)
              + _strides("sl_", contiguous_strides(lse_shape), _BHS)
              + [("S_q", s_q), ("N_TILES", n_tiles), ("UNION_WIDTH", width), ("HKV", hkv), ("G", plan.group),
                 ("PAIRS", SM90_FORWARD_PAIRS), ("D", d), ("BLOCK_K", SM90_FORWARD_BLOCK_K),
                 ("STAGES", SM90_FORWARD_STAGES)])
    return Launch(
        "forward_sm90", (n_tiles, bsz * hkv), ("Q", "K", "V", "UNION", "COUNT", "ROWBITS"),
        (("scale_log2", fp32(scale * LOG2E)),),
        (Output("O", o_shape, dtype), Output("LSE", lse_shape, "float32")),
        tuple(params), SM90_FORWARD_WARPS, 1)


def _gradient_accumulators(dk_shape: tuple[int, ...], scale: float, n_pairs: int,
                           deterministic: bool) -> tuple[tuple[int, int], tuple[Output, Output, Output]]:
    """The backward kernels' ``(BOUND_K, BOUND_V)`` and DK / DV / FLAG outputs: fp32
    ``dk_shape`` (bounds unused, 0; FLAG int32 ``[1]``, unused), or int64 fixed-point sums
    allocated as int32 ``dk_shape + (2,)`` with :func:`fixed_point_bounds` and FLAG int32
    ``[1 + B * S_kv * Hkv]`` (``qsa_triton.fixed_point``: one flag for all of dK/dV, then
    one per accumulator row); all zeroed."""
    if deterministic:
        sums = dk_shape + (2,)
        rows = int(np.prod(dk_shape[:3]))
        return (fixed_point_bounds(scale, n_pairs, dk_shape[3]),
                (Output("DK", sums, "int32", zeroed=True), Output("DV", sums, "int32", zeroed=True),
                 Output("FLAG", (1 + rows,), "int32", zeroed=True)))
    return (0, 0), (Output("DK", dk_shape, "float32", zeroed=True), Output("DV", dk_shape, "float32", zeroed=True),
                    Output("FLAG", (1,), "int32", zeroed=True))


def backward_launch(plan: Plan, q: Operand, k: Operand, v: Operand, o: Operand, do: Operand,
                    union_shape: tuple[int, int, int], scale: float, dtype: str, *, interpreted: bool,
                    attempt: Attempt | None = None, deterministic: bool = False) -> Launch:
    """The backward kernel over the backward's unions (``union_shape``); ``o`` is the
    forward's output and ``do`` its gradient, LSE the forward's (row-major). Outputs: DQ
    like q in ``dtype``, DK and DV fp32 ``[B, S_kv, Hkv, D]`` accumulators (zeroed), and
    FLAG (int32 ``[1]``, zeroed; unused).

    Inputs also name MAXIMA, which only the deterministic kernel reads: fp32 ``[3]``,
    max|Q| and max|dO| over the routed rows whose maximum is finite, and max|V| over the V
    rows whose maximum is finite (the launchers pass LSE in its place otherwise).
    ``deterministic``: the bitwise-reproducible kernel (``qsa_triton.fixed_point``): DK
    and DV are int64 ``[B, S_kv, Hkv, D]`` sums, allocated as int32 ``[B, S_kv, Hkv, D,
    2]``, FLAG int32 ``[1 + B * S_kv * Hkv]`` says where they hold NaN, the integers
    BOUND_K / BOUND_V come from :func:`fixed_point_bounds`; :func:`fixed_point_launch`
    converts the sums."""
    (bsz, s_q, hq, d), (_, s_kv, hkv, _) = q[0], k[0]
    grid, fold, ints, constexprs, attempt = _kernel_shape(plan, q, k, union_shape, True, dtype, interpreted,
                                                          attempt)
    dq_shape, dk_shape = (bsz, s_q, hq, d), (bsz, s_kv, hkv, d)
    dk_strides = contiguous_strides(dk_shape)
    strides = (_strides("sq_", q[1], _BSHD) + _strides("sk_", k[1], _BSHD) + _strides("sv_", v[1], _BSHD)
               + _strides("so_", o[1], _BSHD) + _strides("sdo_", do[1], _BSHD)
               + _strides("sl_", contiguous_strides((bsz, hq, s_q)), _BHS)
               + _strides("sdq_", contiguous_strides(dq_shape), _BSHD) + _strides("sdk_", dk_strides, _BSH))
    offs32 = offsets_fit_int32(_kv_extents(k, v, (dk_shape, dk_strides)), plan.offset_limit)
    bounds, accumulators = _gradient_accumulators(dk_shape, scale, s_q * plan.group, deterministic)
    tail = [("OFFS32", offs32), ("FOLD", fold), ("DETERMINISTIC", deterministic)]
    return Launch(
        "backward", grid, ("Q", "K", "V", "O", "DO", "LSE", "UNION", "COUNT", "ROWBITS", "MAXIMA"),
        (("scale", fp32(scale)), ("scale_log2", fp32(scale * LOG2E))),
        (Output("DQ", dq_shape, dtype), *accumulators),
        tuple(strides + ints + [("BOUND_K", bounds[0]), ("BOUND_V", bounds[1])] + constexprs + tail),
        plan.blocks.backward_num_warps, attempt.stages)


def backward_sm90_launch(plan: Plan, q: Operand, k: Operand, v: Operand, o: Operand, do: Operand,
                         union_shape: tuple[int, int, int], scale: float, dtype: str, *,
                         deterministic: bool = False) -> Launch | None:
    """:func:`backward_launch` for the warp-specialized Hopper kernel (``backward_sm90.py``;
    torch's and JAX's backward on sm_90), or None outside the scope of
    :func:`forward_sm90_launch` (plus O and dO with unit stride along D and strides that
    are multiples of 16). The same inputs and outputs as :func:`backward_launch`'s: DQ like
    q in ``dtype``; DK and DV fp32 zeroed, or (``deterministic``) int64 fixed-point sums
    allocated as int32 ``[B, S_kv, Hkv, D, 2]`` that :func:`fixed_point_launch` converts;
    MAXIMA read and FLAG (``[1 + B * S_kv * Hkv]``) written only when deterministic."""
    if forward_sm90_launch(plan, q, k, v, union_shape, scale, dtype) is None:
        return None
    # the backward's programs must be the forward's (128 pairs each)
    if plan.flat and plan.bwd_heads != SM90_FORWARD_PAIRS:
        return None
    if not plan.flat and (plan.backward_rows != plan.rows_per_tile or plan.bwd_heads != plan.group):
        return None
    if not _copies_aligned(o, do):
        return None
    (bsz, s_q, hq, d), (_, s_kv, hkv, _) = q[0], k[0]
    _, n_tiles, width = union_shape
    dq_shape, dk_shape = (bsz, s_q, hq, d), (bsz, s_kv, hkv, d)
    # the dK/dV adds index rows by ID * row stride in int32 too
    if not offsets_fit_int32(_kv_extents((dk_shape, contiguous_strides(dk_shape))), plan.offset_limit):
        return None
    params = (_strides("sq_", q[1], _BSH) + _strides("sk_", k[1], _BSH) + _strides("sv_", v[1], _BSH)
              + _strides("so_", o[1], _BSH) + _strides("sdo_", do[1], _BSH)
              + _strides("sl_", contiguous_strides((bsz, hq, s_q)), _BHS)
              + _strides("sdq_", contiguous_strides(dq_shape), _BSH)
              + _strides("sdk_", contiguous_strides(dk_shape), _BSH)
              + [("S_q", s_q), ("N_TILES", n_tiles), ("UNION_WIDTH", width), ("HKV", hkv), ("G", plan.group)])
    bounds, accumulators = _gradient_accumulators(dk_shape, scale, s_q * plan.group, deterministic)
    params += [("BOUND_K", bounds[0]), ("BOUND_V", bounds[1]), ("PAIRS", SM90_FORWARD_PAIRS), ("D", d),
               ("BLOCK_K", SM90_BACKWARD_BLOCK_K), ("DETERMINISTIC", deterministic)]
    return Launch(
        "backward_sm90", (n_tiles, bsz * hkv),
        ("Q", "K", "V", "O", "DO", "LSE", "UNION", "COUNT", "ROWBITS", "MAXIMA"),
        (("scale", fp32(scale)), ("scale_log2", fp32(scale * LOG2E))),
        (Output("DQ", dq_shape, dtype), *accumulators),
        tuple(params), SM90_FORWARD_WARPS, 1)


def _ceil_log2(x: Fraction) -> int:
    """The smallest integer k with ``x <= 2**k`` (exact; ``x`` > 0)."""
    num, den = x.numerator, x.denominator
    k = num.bit_length() - den.bit_length()  # 2**(k-1) < x < 2**(k+1)
    fits = num <= den << k if k >= 0 else num << -k <= den
    return k if fits else k + 1


def fixed_point_bounds(scale: float, n_pairs: int, head_dim: int) -> tuple[int, int]:
    """``(BOUND_K, BOUND_V)``: the static parts of the deterministic backward's gradient
    bounds (``qsa_triton.fixed_point``), exactly: ceil(log2(2 * scale * N * D)) and
    ceil(log2 N), for the fp32-rounded ``scale`` the kernels get and N = ``n_pairs``
    (row, head) pairs per batch row and KV head (S_q * G)."""
    with np.errstate(over="ignore"):  # a scale past fp32's range is refused below
        scale32 = fp32(scale)
    if n_pairs < 1 or head_dim < 1 or not 0 < scale32 < float("inf"):
        raise InvalidInput("the deterministic backward needs positive sizes and a scale that is positive and "
                         f"finite in fp32, got N = {n_pairs}, D = {head_dim}, scale = {scale!r}")
    return _ceil_log2(Fraction(scale32) * 2 * n_pairs * head_dim), _ceil_log2(Fraction(n_pairs))


def fixed_point_launch(kv_shape: tuple[int, ...], dtype: str, scale: float, n_pairs: int, *,
                       interpreted: bool) -> Launch:
    """The conversion of the deterministic backward's int64 sums DK_FIXED / DV_FIXED (as
    it wrote them) to DK, DV ``kv_shape`` = ``[B, S_kv, Hkv, D]`` in ``dtype``, row-major,
    written in full; MAXIMA and FLAG (``[1 + B * S_kv * Hkv]``) are the backward's,
    ``scale`` and ``n_pairs`` its :func:`fixed_point_bounds` arguments."""
    n = int(np.prod(kv_shape))
    bound_k, bound_v = fixed_point_bounds(scale, n_pairs, kv_shape[3])
    return Launch(
        "fixed_point", (-(-n // FIXED_POINT_BLOCK),), ("DK_FIXED", "DV_FIXED", "MAXIMA", "FLAG"), (),
        (Output("DK", tuple(kv_shape), dtype), Output("DV", tuple(kv_shape), dtype)),
        (("n", n), ("D", int(kv_shape[3])), ("BOUND_K", bound_k), ("BOUND_V", bound_v), ("BLOCK", FIXED_POINT_BLOCK),
         ("INTERPRET", interpreted)),
        UNION_WARPS, UNION_STAGES)


# ------------------------------------------------------------------------ unions
def keys_launch(step: SortStep, routes: Operand, kv_length: int, max_grid_y: int) -> Launch:
    """Sort keys of ``step``'s groups from routes ``[B, S_q, K]``: KEYS flat, in the key
    dtype, ``rows * K`` per group (group = batch row * n_groups + group)."""
    (bsz, s_q, k), strides = routes
    n_groups, per_group = bsz * step.n_groups, step.rows * k
    n_chunks = -(-per_group // UNION_BLOCK)
    grid, fold = fold_grid(n_groups, n_chunks, max_grid_y)
    keys = step.keys
    params = _strides("sr_", strides, ("b", "s", "k")) + [
        ("s_q", s_q), ("k", k), ("kv_length", kv_length), ("n_tiles", step.n_groups), ("n_groups", n_groups),
        ("n_chunks", n_chunks), ("per_sort", keys.per_sort), ("sentinel", keys.sentinel), ("group_size", step.group),
        ("T", step.rows), ("SHIFT", keys.shift), ("KEY_BITS", keys.key_bits), ("BLOCK", UNION_BLOCK),
        ("PAIRS", step.pairs), ("FOLD", fold)]
    return Launch("union_keys", grid, ("ROUTES",), (), (Output("KEYS", (n_groups * per_group,), keys.dtype),),
                  tuple(params), UNION_WARPS, UNION_STAGES)


def merge_launch(step: SortStep, batch: int, k: int, *, interpreted: bool) -> Launch:
    """Unions from the sorted keys: UNION / ROWBITS int32 ``[B, n_groups, width]``, COUNT
    int32 ``[B, n_groups]``."""
    shape = (batch, step.n_groups, step.width)
    keys = step.keys
    return Launch(
        "union_merge", (batch * step.n_groups,), ("KEYS",), (),
        (Output("UNION", shape, "int32"), Output("ROWBITS", shape, "int32", zeroed=True),
         Output("COUNT", shape[:2], "int32")),
        (("n_keys", step.rows * k), ("width", step.width), ("low_mask", (1 << keys.key_bits) - 1),
         ("sentinel", keys.sentinel), ("SHIFT", keys.shift), ("BLOCK", UNION_BLOCK), ("INTERPRET", interpreted)),
        UNION_WARPS, UNION_STAGES)


def rank_window(step: SortStep, batch: int, k: int, kv_length: int) -> int:
    """Groups per launch of the rank kernel (``union_rank.py``): as many as keep its scratch
    (``RANK_SCRATCH_BYTES`` per word of 32 IDs per group) within the bytes the sort
    recipe's int32 keys of all groups would take (``4 * groups * rows * K``), at least one."""
    groups = batch * step.n_groups
    return max(1, min(groups, (4 * groups * step.rows * k) // (RANK_SCRATCH_BYTES * rank_words(kv_length))))


def rank_launch(step: SortStep, routes: Operand, kv_length: int, first_group: int, n_window: int, *,
                interpreted: bool, fill: bool) -> Launch:
    """Unions of groups ``[first_group, first_group + n_window)`` (group = batch row *
    n_groups + group) by ID ranks (``union_rank.py``): UNION / ROWBITS int32
    ``[n_window, width]`` written up to COUNT int32 ``[n_window]`` and, with ``fill``,
    in full (-1 / 0 past the count); PRESENT / PREFIX / MARKS are scratch."""
    (bsz, s_q, k), strides = routes
    words = rank_words(kv_length)
    if n_window > MAX_GRID_X:
        raise UnsupportedShape(f"{n_window} union groups do not fit a CUDA launch grid")
    shape = (n_window, step.width)
    outputs = (Output("UNION", shape, "int32"), Output("ROWBITS", shape, "int32"),
               Output("COUNT", (n_window,), "int32"), Output("PRESENT", (n_window, words), "int32"),
               Output("PREFIX", (n_window, words), "int32"), Output("MARKS", (n_window, 8 * words), "int32"))
    params = _strides("sr_", strides, ("b", "s", "k")) + [
        ("s_q", s_q), ("k", k), ("kv_length", kv_length), ("n_tiles", step.n_groups), ("first_group", first_group),
        ("width", step.width), ("words", words), ("group_size", step.group), ("T", step.rows),
        ("BLOCK", UNION_BLOCK), ("PAIRS", step.pairs), ("INTERPRET", interpreted), ("FILL", fill)]
    return Launch("union_rank", (n_window,), ("ROUTES",), (), outputs, tuple(params), RANK_WARPS, UNION_STAGES)


def cut_launch(step: CutStep, parent_shape: tuple[int, int, int], max_grid_y: int, *,
               interpreted: bool, fill: bool) -> Launch:
    """Sub-unions of parents ``[B, n_tiles, width]`` (read up to their counts): SUB_UNION /
    SUB_ROWBITS int32 ``[B, n_sub, width]`` written up to SUB_COUNT ``[B, n_sub]`` and, with
    ``fill``, in full (-1 / 0 past the count)."""
    bsz, n_tiles, width = parent_shape
    grid, fold = fold_grid(step.n_sub, bsz, max_grid_y)
    shape = (bsz, step.n_sub, step.width)
    return Launch(
        "union_cut", grid, ("UNION", "ROWBITS", "COUNT"), (),
        (Output("SUB_UNION", shape, "int32"), Output("SUB_ROWBITS", shape, "int32"),
         Output("SUB_COUNT", shape[:2], "int32")),
        (("B", bsz), ("n_tiles", n_tiles), ("width", width), ("n_sub", step.n_sub), ("sub_width", step.width),
         ("group", step.group), ("SUB_T", step.sub_rows), ("PARTS", step.parts), ("PAIRS", step.pairs),
         ("BLOCK", UNION_BLOCK), ("INTERPRET", interpreted), ("FOLD", fold), ("FILL", fill)),
        UNION_WARPS, UNION_STAGES)


from .kernels import attention_input_dtypes, compile_signature, interpreted, interprets, kernel  # noqa: E402
