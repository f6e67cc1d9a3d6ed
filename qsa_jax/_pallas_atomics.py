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

import logging

import jax

__all__ = ["RELAXED", "relaxed_addupdate"]


def _build():
    import inspect

    from jax._src import core as jax_core
    from jax._src import tree_util
    from jax._src.pallas.triton import lowering
    from jax._src.state import discharge as state_discharge
    from jax._src.state import primitives as sp

    # Every private name the lowering uses is looked up here, at import, so a JAX that
    # changed them falls back now rather than failing later when a kernel compiles.
    abstract_eval = sp._addupdate_abstract_eval
    discharge = state_discharge._addupdate_discharge_rule
    get_ref_and_transforms = sp.get_ref_and_transforms
    is_pointer = lowering._is_triton_pointer_type
    pointers = lowering._compute_pointers_from_indices
    atomic_rmw = lowering._atomic_rmw
    fadd = lowering.tt_dialect.RMWOp.FADD
    relaxed = lowering.tt_dialect.MemSemantic.RELAXED
    if "semantic" not in inspect.signature(atomic_rmw).parameters:
        raise TypeError("jax's Pallas _atomic_rmw takes no memory-order argument")

    prim = jax_core.Primitive("qsa_relaxed_addupdate")
    prim.is_effectful = lambda params: True
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(abstract_eval)
    state_discharge.register_discharge_rule(prim)(discharge)

    @lowering.register_lowering(prim)
    def _lower(ctx, ptr, value, *idx, tree):
        block_info, *_ = ctx.block_infos
        indexers = tree_util.tree_unflatten(tree, idx)
        if len(indexers) != 1 or not is_pointer(ptr.type):
            raise NotImplementedError("relaxed_addupdate takes one indexer into a pointer ref")
        atomic_rmw(fadd, pointers(ptr, block_info, indexers[0]), value, semantic=relaxed)
        return []

    def bind(ref, idx, value):
        ref, transforms = get_ref_and_transforms(ref, idx, "relaxed_addupdate")
        flat, tree = tree_util.tree_flatten(transforms)
        prim.bind(ref, value, *flat, tree=tree)

    return bind


try:
    _bind = _build()
    RELAXED = True
except Exception as err:  # noqa: BLE001 - any mismatch of JAX internals: keep the public form
    _bind = None
    RELAXED = False
    logging.getLogger("qsa_jax").warning(
        "qsa_jax: relaxed atomic adds unavailable on this JAX (%s: %s); the Pallas backward "
        "uses jax.ref.addupdate (acquire-release atomics: same results, about 2x slower on "
        "the H200)", type(err).__name__, err)


def relaxed_addupdate(ref, idx, value) -> None:
    """``ref[idx] += value`` (floating point); atomic but unordered in the Triton lowering."""
    if _bind is None:
        jax.ref.addupdate(ref, idx, value)
    else:
        _bind(ref, idx, value)
