"""Partitioning rules of :func:`qsa_jax.sparse_gqa_attention` under ``jax.jit``.

Every implementation (``"xla"``, ``"pallas"``, ``"triton"``) is a computation XLA's
partitioner cannot see into (custom calls) or would replicate, so the call is wrapped
in ``jax.experimental.custom_partitioning``, forward and backward alike (a
``jax.custom_vjp`` whose two rules are each a partitioned call). At compile time the
partitioner hands the operands' shardings to :func:`_plan`, which picks the layout each
device computes on:

* **batch** (query's dim 0): every operand takes the query's batch axes; local, no
  collective.
* **heads** (query dim 2 with K/V dim 2): the query-head and KV-head dims are split over
  the same mesh axes, whose total size must divide Hkv, so every device holds whole GQA
  groups (Hq/n query heads with their Hkv/n KV heads); local, no collective. K/V whose
  heads are unsharded are sliced to match (no communication).
* **sequence** (query dim 1, routes dim 1): the context-parallel algorithm. K/V are
  split over the query's sequence axes (where S_kv divides), all-gathered along the
  sequence inside the partitioned call, each device attends its local query rows with
  their global route IDs, and the backward reduce-scatters dK/dV (all-reduces them
  where S_kv does not divide).
* **head dim** (dim 3) and the routes' K dim are gathered: each device needs whole rows.

Where a sharding cannot be kept (heads sharded over axes whose size does not divide
Hkv, query and K/V heads sharded over different axes, K/V sharded along the sequence
while the query is not, a sharded head dim; the full list is in docs/sharding.md), the
layout the partitioner would have to gather is taken instead: those dims are gathered (replicated) and the ``"qsa_jax"``
logger says so once per layout at WARNING. This is what ``jax.jit`` does with any
operation it cannot partition, made visible; it never raises.

The backward recomputes the forward inside its partitioned call (its residuals are the
inputs only), so a differentiated call costs one more forward than the
implementation's own ``custom_vjp``. For that reason the wrapper is used only when the
process sees more than one device and the inputs are not concrete single-device
arrays: with one device nothing can be partitioned.

Under the wrapper ``jax.vmap`` folds the mapped axis into the batch (``custom_partitioning``
has no batching rule), and there is no forward-mode derivative (``jax.jvp``): the call is
a ``custom_vjp``. The routes never get a gradient. Works with the Shardy partitioner (the
default of jax 0.10 and 0.11; ``sharding_rule``) and with GSPMD
(``infer_sharding_from_operands``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from qsa_common.log_once import log_once

__all__ = ["Plan", "partitioned", "wants_partitioning"]

logger = logging.getLogger("qsa_jax")
_LOGGED: set[str] = set()


def wants_partitioning(*arrays) -> bool:
    """Whether the call goes through the partitioned wrapper: more than one device
    visible (of the default backend, or host devices), and some input a tracer
    (``jax.jit``, ``jax.grad``...) or a concrete array spread over several devices."""
    if jax.device_count() < 2 and len(jax.devices("cpu")) < 2:  # host devices: a CPU mesh beside one GPU
        return False
    for x in arrays:
        if isinstance(x, jax.core.Tracer):
            return True
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            return True
    return False


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec_axes(sharding, ndim: int) -> list[tuple[str, ...]]:
    spec = tuple(getattr(sharding, "spec", None) or ())
    spec = spec + (None,) * (ndim - len(spec))
    return [_axes(e) for e in spec[:ndim]]


class Plan(NamedTuple):
    """The per-device layout: mesh axes of batch, sequence (query rows) and heads;
    ``kv_seq`` whether K/V are split along the sequence (gathered inside the call)."""

    batch: tuple[str, ...]
    seq: tuple[str, ...]
    heads: tuple[str, ...]
    kv_seq: bool

    def specs(self):
        """PartitionSpecs of query (and output, dQ), key/value (and dK/dV), routes."""
        b, s, h = _entry(self.batch), _entry(self.seq), _entry(self.heads)
        return (PartitionSpec(b, s, h, None), PartitionSpec(b, s if self.kv_seq else None, h, None),
                PartitionSpec(b, s, None))


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _plan(mesh, shapes, shardings) -> Plan:
    """The layout for operands of ``shapes`` (query, key, value, routes) arriving with
    ``shardings``; logs once what it has to gather."""
    (bsz, s_q, _, _), (_, s_kv, hkv, _) = shapes[0], shapes[1]
    q, k, v, r = (_spec_axes(sh, len(shape)) for sh, shape in zip(shardings, shapes))
    gathered = []
    batch, seq = q[0], q[1]
    if batch and bsz % _size(mesh, batch):
        gathered.append(f"batch: B = {bsz} over {batch} (size {_size(mesh, batch)})")
        batch = ()
    if seq and s_q % _size(mesh, seq):
        gathered.append(f"query sequence: S_q = {s_q} over {seq} (size {_size(mesh, seq)})")
        seq = ()
    heads = q[2]
    if heads:
        if hkv % _size(mesh, heads):
            gathered.append(f"heads: query heads over {heads} (size {_size(mesh, heads)}) do not split "
                            f"Hkv = {hkv} KV heads into whole GQA groups")
            heads = ()
        elif any(kv[2] and kv[2] != heads for kv in (k, v)):
            gathered.append(f"heads: query heads over {heads}, key/value heads over {k[2]}/{v[2]}")
            heads = ()
    elif k[2] or v[2]:
        gathered.append(f"heads: key/value heads over {k[2]}/{v[2]} while the query's heads are not split")
    for name, axes in (("key", k[0]), ("value", v[0]), ("routes", r[0])):
        if axes and axes != batch:
            gathered.append(f"{name} batch over {axes} (query batch over {batch or 'none'})")
    if r[1] and r[1] != seq:
        gathered.append(f"routes' rows over {r[1]} (query sequence over {seq or 'none'})")
    kv_seq = bool(seq) and s_kv % _size(mesh, seq) == 0
    for name, dims in (("key", k), ("value", v)):
        if dims[1] and not (kv_seq and dims[1] == seq):
            gathered.append(f"{name} sequence over {dims[1]} (query sequence over {seq or 'none'})")
    for name, dims in (("query", q), ("key", k), ("value", v)):
        if dims[3]:
            gathered.append(f"{name} head dim over {dims[3]}")
    if r[2]:
        gathered.append(f"routes' K dim over {r[2]}")
    if gathered:
        log_once(logger, _LOGGED, "sparse_gqa_attention: sharding not partitionable as given, gathering "
                 + "; ".join(gathered), logging.WARNING)
    return Plan(batch, seq, heads, kv_seq)


def _gather_kv(plan: Plan, key, value):
    if plan.kv_seq:
        key = jax.lax.all_gather(key, plan.seq, axis=1, tiled=True)
        value = jax.lax.all_gather(value, plan.seq, axis=1, tiled=True)
    return key, value


def _reduce_kv_grad(plan: Plan, grad):
    if plan.kv_seq:
        return jax.lax.psum_scatter(grad, plan.seq, scatter_dimension=1, tiled=True)
    if plan.seq:
        return jax.lax.psum(grad, plan.seq)
    return grad


def _shardings(mesh, plan: Plan):
    return tuple(NamedSharding(mesh, spec) for spec in plan.specs())


# ------------------------------------------------------------------ forward
def _fwd_impl(impl, scale, options, query, key, value, routes):
    return impl(query, key, value, routes, scale, **dict(options))


def _fwd_partition(impl, scale, options, mesh, arg_shapes, result_shape):
    del result_shape
    plan = _plan(mesh, [a.shape for a in arg_shapes], [a.sharding for a in arg_shapes])
    q_sh, kv_sh, r_sh = _shardings(mesh, plan)

    def lower(query, key, value, routes):
        key, value = _gather_kv(plan, key, value)
        return impl(query, key, value, routes, scale, **dict(options))

    return mesh, lower, q_sh, (q_sh, kv_sh, kv_sh, r_sh)


def _fwd_infer(impl, scale, options, mesh, arg_shapes, result_shape):
    del impl, scale, options, result_shape
    plan = _plan(mesh, [a.shape for a in arg_shapes], [a.sharding for a in arg_shapes])
    return _shardings(mesh, plan)[0]


_FWD_RULE = "b s h d, b t k d, b t k d, b s r -> b s h d"
_BWD_RULE = "b s h d, b t k d, b t k d, b s r, b s h d -> b s h d, b t k d, b t k d"

_forward = custom_partitioning(_fwd_impl, static_argnums=(0, 1, 2))
_forward.def_partition(partition=_fwd_partition, infer_sharding_from_operands=_fwd_infer,
                       sharding_rule=_FWD_RULE)


# ------------------------------------------------------------------ backward
def _local_vjp(impl, scale, options, query, key, value, routes, grad):
    def fn(q, k, v):
        return impl(q, k, v, routes, scale, **dict(options))

    return jax.vjp(fn, query, key, value)[1](grad)


def _bwd_impl(impl, scale, options, query, key, value, routes, grad):
    return _local_vjp(impl, scale, options, query, key, value, routes, grad)


def _bwd_partition(impl, scale, options, mesh, arg_shapes, result_shape):
    del result_shape
    plan = _plan(mesh, [a.shape for a in arg_shapes[:4]], [a.sharding for a in arg_shapes[:4]])
    q_sh, kv_sh, r_sh = _shardings(mesh, plan)

    def lower(query, key, value, routes, grad):
        key, value = _gather_kv(plan, key, value)
        dq, dk, dv = _local_vjp(impl, scale, options, query, key, value, routes, grad)
        return dq, _reduce_kv_grad(plan, dk), _reduce_kv_grad(plan, dv)

    return mesh, lower, (q_sh, kv_sh, kv_sh), (q_sh, kv_sh, kv_sh, r_sh, q_sh)


def _bwd_infer(impl, scale, options, mesh, arg_shapes, result_shape):
    del impl, scale, options, result_shape
    plan = _plan(mesh, [a.shape for a in arg_shapes[:4]], [a.sharding for a in arg_shapes[:4]])
    q_sh, kv_sh, _ = _shardings(mesh, plan)
    return q_sh, kv_sh, kv_sh


_backward = custom_partitioning(_bwd_impl, static_argnums=(0, 1, 2))
_backward.def_partition(partition=_bwd_partition, infer_sharding_from_operands=_bwd_infer,
                        sharding_rule=_BWD_RULE)


# ------------------------------------------------------------------ vmap
def _fold(x, batched: bool, axis_size: int):
    """A vmapped operand with its mapped axis folded into the batch axis."""
    if not batched:
        x = jax.numpy.broadcast_to(x[None], (axis_size, *x.shape))
    return x.reshape(axis_size * x.shape[1], *x.shape[2:])


def _batchable(call, *statics):
    """``call(*statics, *arrays)`` under ``jax.vmap``: the mapped axis is folded into the
    batch axis (B of every operand), as batch elements never interact; ``custom_partitioning``
    has no batching rule of its own."""

    @jax.custom_batching.custom_vmap
    def run(*arrays):
        return call(*statics, *arrays)

    @run.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        out = run(*(_fold(x, b, axis_size) for x, b in zip(arrays, in_batched)))
        def unfold(y):
            return y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:])

        out = jax.tree.map(unfold, out)
        return out, jax.tree.map(lambda _: True, out)

    return run


# ------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(impl, scale, options, query, key, value, routes):
    return _batchable(_forward, impl, scale, options)(query, key, value, routes)


def _attention_fwd(impl, scale, options, query, key, value, routes):
    out = _batchable(_forward, impl, scale, options)(query, key, value, routes)
    return out, (query, key, value, routes)


def _attention_bwd(impl, scale, options, residuals, grad):
    query, key, value, routes = residuals
    dq, dk, dv = _batchable(_backward, impl, scale, options)(query, key, value, routes, grad)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def partitioned(impl: Callable[..., Any], query, key, value, routes, scale: float, **options):
    """``impl(query, key, value, routes, scale, **options)`` partitioned by the inputs'
    shardings under ``jax.jit`` (module docstring); called directly where
    :func:`wants_partitioning` says no. ``impl`` must be a module-level function and
    ``options`` hashable: both are static arguments of the partitioned call."""
    if not wants_partitioning(query, key, value, routes):
        return impl(query, key, value, routes, scale, **options)
    routes = jax.numpy.asarray(routes)
    return _attention(impl, scale, tuple(sorted(options.items())), query, key, value, routes)
