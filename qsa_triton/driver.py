"""The steps around the kernels, written once for every framework: the driver.

Which union kernels run in which order with which sizes (the recipe of
:func:`qsa_triton.plan.union_recipe`), the Hopper-or-portable choice of the attention
kernels, the retry with narrower configurations where one needs more shared memory than
the device has, and the deterministic backward's fixed-point steps. A framework supplies
an :class:`Adapter`: how to launch one :class:`qsa_triton.launch.Launch` on its arrays
and the few array operations around launches (sort, concatenate, reshape, cast, maxima).
Both adapters (``qsa_torch._triton_launch``, ``qsa_jax._triton_call``) get their
launches from here, so the same shapes give the same kernels with the same arguments,
the precondition of bitwise-equal outputs across frameworks.

Framework-neutral: nothing here imports torch, jax or triton; inputs arrive checked (the
dispatchers validate them once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from . import launch as spec
from .plan import MAX_GRID_Y, CutStep, KeyPlan, Plan, SortStep, backward_cut, rank_recipe, tile_cut, union_recipe

__all__ = ["Adapter", "Unions", "backward", "backward_unions", "build_tile_unions", "build_unions", "cut_unions",
           "forward", "launch_fitting", "rank_unions", "sorted_unions", "split_tile_unions", "step_unions"]


class Adapter(Protocol):
    """What the driver asks of a framework. Hashable (a key of the retry's memory).

    ``interpreted``: the kernels run in Triton's interpreter. ``wide_keys``: int64 arrays
    exist (sort keys wider than int32). ``hopper_forward`` / ``hopper_backward``: compiled
    warp-specialized kernels (``forward_sm90``, ``backward_sm90``) launch on this device.
    """

    interpreted: bool
    wide_keys: bool
    hopper_forward: bool
    hopper_backward: bool

    def launch(self, launch: spec.Launch, arrays: dict[str, Any]) -> dict[str, Any]:
        """Allocate ``launch``'s outputs (zeroed ones zero), run its kernel on ``arrays`` (its
        inputs by name), return the outputs by name."""

    def operand(self, x) -> spec.Operand:
        """Shape and per-element strides of ``x`` as the kernels will read it."""

    def dtype(self, x) -> str:
        """``x``'s dtype name (``"bfloat16"``, ``"int32"``...)."""

    def aligned(self, *xs) -> bool:
        """Whether every base address is 16-byte aligned (the Hopper kernels' copies)."""

    def dense(self, x):
        """``x`` row-major with an aligned base (a copy only where it is not)."""

    def sort(self, keys, chunk: int):
        """1-D ``keys`` with each run of ``chunk`` consecutive keys sorted ascending."""

    def concat(self, parts: list):
        """``parts`` concatenated along their first axis."""

    def reshape(self, x, shape: tuple[int, ...]):
        ...

    def cast(self, x, like):
        """``x`` in ``like``'s dtype."""

    def maxima(self, q, do, v, lse):
        """MAXIMA of the deterministic backward (``qsa_triton.fixed_point``): fp32 ``[3]``,
        max|q| and max|do| over the (row, head) pairs whose ``lse`` is not +inf, max|v| over
        the ``[b, j, g, :]`` rows whose own maximum is finite."""


@dataclass(frozen=True)
class Unions:
    """Route unions: what the kernels walk.

    ``union`` int32 ``[B, n_tiles, W]``: the distinct valid IDs routed by the tile's rows
    (a flat program's rows), ascending, then -1. ``count`` int32 ``[B, n_tiles]``: how many
    entries of ``union`` are valid. ``rowbits`` int32 ``[B, n_tiles, W]``: bit t set iff
    row t of the tile routes to ``union[..., u]`` (0 past the count). Unpadded unions
    leave the entries past each count unwritten. ``rows_per_tile``: T (flat programs: the
    power of two bounding their rows).
    """

    union: Any
    count: Any
    rowbits: Any
    rows_per_tile: int


# ------------------------------------------------------------------------ unions
def sorted_unions(ad: Adapter, routes, kv_length: int, step: SortStep, max_grid_y: int = MAX_GRID_Y) -> Unions:
    """The unions of ``step``'s groups of rows: keys kernel, a sort of each ``per_sort``
    whole groups, merge kernel (always padded)."""
    bsz, _, k = ad.operand(routes)[0]
    keys = ad.launch(spec.keys_launch(step, ad.operand(routes), kv_length, max_grid_y), {"ROUTES": routes})["KEYS"]
    keys = ad.sort(keys, step.keys.per_sort * step.rows * k)
    merged = ad.launch(spec.merge_launch(step, bsz, k, interpreted=ad.interpreted), {"KEYS": keys})
    return Unions(merged["UNION"], merged["COUNT"], merged["ROWBITS"], step.rows)


def rank_unions(ad: Adapter, routes, kv_length: int, step: SortStep, *, padded: bool = True) -> Unions:
    """:func:`sorted_unions` without the sort (``union_rank.py``): the same unions element
    for element (``padded`` False: up to each count only), window by window
    (:func:`qsa_triton.launch.rank_window`); the scratch outputs are dropped."""
    bsz, _, k = ad.operand(routes)[0]
    groups = bsz * step.n_groups
    window = spec.rank_window(step, bsz, k, kv_length)
    parts = []
    for first in range(0, groups, window):
        launch = spec.rank_launch(step, ad.operand(routes), kv_length, first, min(window, groups - first),
                                  interpreted=ad.interpreted, fill=padded)
        ranked = ad.launch(launch, {"ROUTES": routes})
        parts.append([ranked[name] for name in ("UNION", "COUNT", "ROWBITS")])
        del ranked
    union, count, rowbits = (parts[0][i] if len(parts) == 1 else ad.concat([p[i] for p in parts]) for i in range(3))
    shape = (bsz, step.n_groups, step.width)
    return Unions(ad.reshape(union, shape), ad.reshape(count, shape[:2]), ad.reshape(rowbits, shape), step.rows)


def step_unions(ad: Adapter, routes, kv_length: int, step: SortStep, max_grid_y: int = MAX_GRID_Y, *,
                padded: bool = True) -> Unions:
    """``step``'s unions by the recipe :func:`qsa_triton.plan.rank_recipe` picks."""
    if rank_recipe(step, ad.operand(routes)[0][2], kv_length):
        return rank_unions(ad, routes, kv_length, step, padded=padded)
    return sorted_unions(ad, routes, kv_length, step, max_grid_y)


def cut_unions(ad: Adapter, unions: Unions, step: CutStep, max_grid_y: int = MAX_GRID_Y, *,
               padded: bool = True) -> Unions:
    """``step``'s sub-unions of ``unions`` (read up to their counts; no sort)."""
    launch = spec.cut_launch(step, ad.operand(unions.union)[0], max_grid_y, interpreted=ad.interpreted, fill=padded)
    cut = ad.launch(launch, {"UNION": unions.union, "ROWBITS": unions.rowbits, "COUNT": unions.count})
    return Unions(cut["SUB_UNION"], cut["SUB_COUNT"], cut["SUB_ROWBITS"], step.rows_per_tile)


def build_unions(ad: Adapter, routes, kv_length: int, plan: Plan, *, padded: bool = True) -> Unions:
    """The forward's unions of ``plan`` (:func:`qsa_triton.plan.union_recipe`): one sort
    or rank step, then at most one cut. ``routes``: int32/int64 ``[B, S_q, K]``; IDs
    outside ``[0, kv_length)`` are padding, repeats count once. ``padded`` False leaves
    the entries past each count unwritten (unions only the kernels read)."""
    bsz, s_q, k = ad.operand(routes)[0]
    step, cut = union_recipe(plan, s_q, k, kv_length, bsz, wide_keys=ad.wide_keys)
    unions = step_unions(ad, routes, kv_length, step, plan.max_grid_y, padded=padded and cut is None)
    return unions if cut is None else cut_unions(ad, unions, cut, plan.max_grid_y, padded=padded)


def build_tile_unions(ad: Adapter, routes, kv_length: int, rows_per_tile: int) -> Unions:
    """Sorted unions of tiles of ``rows_per_tile`` consecutive rows (the last tile padded
    with empty rows)."""
    bsz, s_q, k = ad.operand(routes)[0]
    n_tiles = -(-s_q // rows_per_tile)
    keys = KeyPlan.make(bsz * n_tiles, rows_per_tile, k, kv_length, wide_keys=ad.wide_keys)
    return sorted_unions(ad, routes, kv_length, SortStep(rows_per_tile, n_tiles, min(rows_per_tile * k, kv_length),
                                                         keys))


def backward_unions(ad: Adapter, unions: Unions, plan: Plan, top_k: int, query_length: int) -> Unions:
    """The backward's unions: the forward's, or cut into the backward's shorter tiles
    (``top_k``: K of the routes they came from)."""
    width = ad.operand(unions.union)[0][2]
    cut = backward_cut(plan, query_length, top_k, unions.rows_per_tile, width)
    return unions if cut is None else cut_unions(ad, unions, cut, plan.max_grid_y, padded=False)


def split_tile_unions(ad: Adapter, unions: Unions, rows_per_tile: int, top_k: int, query_length: int) -> Unions:
    """Tile unions cut into tiles of ``rows_per_tile`` rows (a power of two dividing
    theirs): what :func:`build_tile_unions` gives at that height, without a sort."""
    cut = tile_cut(unions.rows_per_tile, ad.operand(unions.union)[0][2], rows_per_tile, top_k, query_length)
    return unions if cut is None else cut_unions(ad, unions, cut)


# ------------------------------------------------------------------ attention
# (kernel, plan, dtype, head dim, 32-bit offsets, deterministic, adapter) -> the attempt that fit
_FITTED: dict[tuple, spec.Attempt] = {}


def launch_fitting(ad: Adapter, build: Callable[[spec.Attempt], spec.Launch], plan: Plan, backward: bool,
                   arrays: dict[str, Any]) -> dict[str, Any]:
    """Run ``build(attempt)``, the plan's own attempt first; where a configuration needs
    more shared memory than the device has (Triton raises OutOfResources when it loads
    the kernel), the next of :func:`qsa_triton.launch.attempts`. The attempt that fit is
    remembered, so a failing compile is not repeated. (A framework that compiles its
    kernels later than it launches them, as jax-triton does, always runs the first.)"""
    options = spec.attempts(plan, backward)
    first = build(options[0])
    params = dict(first.params)
    key = (first.kernel, plan, first.outputs[0].dtype, params["D"], params["OFFS32"], params.get("DETERMINISTIC"), ad)
    if key in _FITTED:
        options = [_FITTED[key]]
    for i, attempt in enumerate(options):
        try:
            result = ad.launch(build(attempt), arrays)
        except Exception as exc:  # triton.runtime.errors.OutOfResources (triton is not imported here)
            if type(exc).__name__ != "OutOfResources" or i == len(options) - 1:
                raise
            continue
        _FITTED[key] = attempt
        return result
    raise AssertionError("unreachable")  # pragma: no cover


def forward(ad: Adapter, q, k, v, unions: Unions, scale: float, plan: Plan):
    """``(out, lse)``: the forward kernel over the forward's unions; out ``[B, S_q, Hq, D]``
    in q's dtype, the natural-log LSE ``[B, Hq, S_q]`` fp32. Where the adapter has the
    Hopper kernels, operands in their scope take the warp-specialized forward
    (:func:`qsa_triton.launch.forward_sm90_launch`; the same bits)."""
    dtype, ops, shape = ad.dtype(q), (ad.operand(q), ad.operand(k), ad.operand(v)), ad.operand(unions.union)[0]
    arrays = dict(Q=q, K=k, V=v, UNION=unions.union, COUNT=unions.count, ROWBITS=unions.rowbits)
    if not ad.interpreted and ad.hopper_forward:
        launch = spec.forward_sm90_launch(plan, *ops, shape, scale, dtype)
        if launch is not None and ad.aligned(q, k, v):
            outputs = ad.launch(launch, arrays)
            return outputs["O"], outputs["LSE"]

    def build(attempt):
        return spec.forward_launch(plan, *ops, shape, scale, dtype, interpreted=ad.interpreted, attempt=attempt)

    outputs = launch_fitting(ad, build, plan, False, arrays)
    return outputs["O"], outputs["LSE"]


def backward(ad: Adapter, q, k, v, out, lse, do, unions: Unions, scale: float, plan: Plan, *,
             deterministic: bool = False):
    """``(dq, dk, dv)``: the backward kernel over the backward's unions (``lse`` row-major).
    dq in q's dtype; dk, dv in k's, from fp32 atomic accumulators, or (``deterministic``)
    from int64 fixed-point sums that ``fixed_point.py``'s kernel converts: bitwise
    reproducible, and equal across frameworks."""
    hopper = not ad.interpreted and ad.hopper_backward
    if hopper and deterministic:
        # the kernel must follow from shapes, dtype and device alone: the fixed-point
        # gradients are then bitwise equal across operand layouts and frameworks
        q, k, v, out, do = (ad.dense(x) for x in (q, k, v, out, do))
    dtype = ad.dtype(q)
    ops = tuple(ad.operand(x) for x in (q, k, v, out, do))
    shape = ad.operand(unions.union)[0]
    # MAXIMA is read by the deterministic kernels only (LSE stands in for it otherwise)
    maxima = ad.maxima(q, do, v, lse) if deterministic else lse
    arrays = dict(Q=q, K=k, V=v, O=out, DO=do, LSE=lse, UNION=unions.union, COUNT=unions.count,
                  ROWBITS=unions.rowbits, MAXIMA=maxima)
    outputs = None
    if hopper:
        launch = spec.backward_sm90_launch(plan, *ops, shape, scale, dtype, deterministic=deterministic)
        if launch is not None and ad.aligned(q, k, v, out, do):
            outputs = ad.launch(launch, arrays)
    if outputs is None:
        def build(attempt):
            return spec.backward_launch(plan, *ops, shape, scale, dtype, interpreted=ad.interpreted,
                                        attempt=attempt, deterministic=deterministic)

        outputs = launch_fitting(ad, build, plan, True, arrays)
    if not deterministic:
        return outputs["DQ"], ad.cast(outputs["DK"], k), ad.cast(outputs["DV"], v)
    kv_shape, s_q = ops[1][0], ops[0][0][1]
    convert = spec.fixed_point_launch(kv_shape, ad.dtype(k), scale, s_q * plan.group, interpreted=ad.interpreted)
    grads = ad.launch(convert, dict(DK_FIXED=outputs["DK"], DV_FIXED=outputs["DV"], MAXIMA=maxima,
                                    FLAG=outputs["FLAG"]))
    return outputs["DQ"], grads["DK"], grads["DV"]
