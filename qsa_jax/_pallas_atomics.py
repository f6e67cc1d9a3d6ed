"""``ref[idx] += value`` with relaxed memory order, for the Pallas Triton kernels.

Pallas lowers ``jax.ref.addupdate`` on GPU to a Triton atomic add with
acquire-release order. The backward kernel's dK/dV accumulation needs atomicity
only, not ordering, and on the H200 the acquire-release form made that kernel
about four times slower than without its adds (see docs/benchmarks.md). This
module defines a primitive that behaves exactly like ``addupdate`` (same abstract
evaluation, same state discharge, so interpret mode is unchanged) but lowers to a
relaxed atomic add.

It relies on private JAX modules; when they are not what it expects, it falls back
to ``jax.ref.addupdate`` (same results, slower) and :data:`RELAXED` is False.
"""

from __future__ import annotations

import jax

__all__ = ["RELAXED", "relaxed_addupdate"]


def _build():
    from jax._src import core as jax_core
    from jax._src import tree_util
    from jax._src.pallas.triton import lowering
    from jax._src.state import discharge as state_discharge
    from jax._src.state import primitives as sp

    prim = jax_core.Primitive("qsa_relaxed_addupdate")
    prim.is_effectful = lambda params: True
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(sp._addupdate_abstract_eval)
    state_discharge.register_discharge_rule(prim)(state_discharge._addupdate_discharge_rule)
    relaxed = lowering.tt_dialect.MemSemantic.RELAXED

    @lowering.register_lowering(prim)
    def _lower(ctx, ptr, value, *idx, tree):
        block_info, *_ = ctx.block_infos
        indexers = tree_util.tree_unflatten(tree, idx)
        if len(indexers) != 1 or not lowering._is_triton_pointer_type(ptr.type):
            raise NotImplementedError("relaxed_addupdate takes one indexer into a pointer ref")
        ptr = lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
        op = lowering.tt_dialect.RMWOp.FADD
        lowering._atomic_rmw(op, ptr, value, semantic=relaxed)
        return []

    def bind(ref, idx, value):
        ref, transforms = sp.get_ref_and_transforms(ref, idx, "relaxed_addupdate")
        flat, tree = tree_util.tree_flatten(transforms)
        prim.bind(ref, value, *flat, tree=tree)

    return bind


try:
    _bind = _build()
    RELAXED = True
except Exception:  # noqa: BLE001 - any mismatch of JAX internals: keep the public form
    _bind = None
    RELAXED = False


def relaxed_addupdate(ref, idx, value) -> None:
    """``ref[idx] += value`` (floating point); atomic but unordered in the Triton lowering."""
    if _bind is None:
        jax.ref.addupdate(ref, idx, value)
    else:
        _bind(ref, idx, value)
