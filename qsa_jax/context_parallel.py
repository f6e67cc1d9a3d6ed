"""Context parallelism for QSA in JAX with ``shard_map``.

The sequence axis of query, key, value and routes is split over one mesh axis.
Inside the map each device all-gathers K/V along the sequence (so it holds its
local query rows and the global K/V) and calls
:func:`qsa_jax.sparse_gqa_attention` with the routes in global coordinates.
Autodiff transposes the all-gather into a reduce-scatter: each device gets the
dK/dV of its own slice, summed over all devices' queries.

* :func:`context_parallel_sparse_gqa_attention`: global arrays in, global out.
* :func:`sparse_gqa_attention_shard`: the per-device body, for use inside a
  ``shard_map`` of your own.

Under plain ``jax.jit``, :func:`qsa_jax.sparse_gqa_attention` given inputs sharded along
the sequence partitions itself into the same algorithm (:mod:`qsa_jax.sharding`); this
module is the explicit form, for code that already maps over its mesh.

Inside the map the arrays are tracers, which do not say where they live, and
:func:`qsa_jax.sparse_gqa_attention` picks its implementation for the platform of
``jax.default_device`` (else the default backend): while the map is traced, the
wrapper sets ``jax.default_device`` to the mesh's platform where that differs (e.g. a
CPU mesh on a host with GPUs). Only the forward is traced there: rules traced later
(``custom_vjp`` backward rules, under ``jax.grad``) see the caller's default device, so
every choice a backward makes is taken with the forward (the implementation, tile
sizes, the Triton backward's Hopper kernel) and carried to it as a static argument.

Works with ``jax.shard_map`` (jax >= 0.6, so 0.10.2 and 0.11.2) and falls back to
``jax.experimental.shard_map`` where the former is missing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from .attention import sparse_gqa_attention
from .routes import _default_devices, prepare_routes, validate_inputs

__all__ = ["context_parallel_sparse_gqa_attention", "sparse_gqa_attention_shard", "shard_map"]


def shard_map(f, *, mesh: Mesh, in_specs, out_specs, check_vma: bool = False):
    """``jax.shard_map`` where it exists, else ``jax.experimental.shard_map.shard_map``
    (whose ``check_rep`` plays the part of ``check_vma``)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh, in_specs, out_specs, check_rep=check_vma)


def sparse_gqa_attention_shard(
    query,
    key,
    value,
    selected_token_ids,
    softmax_scale: float | None = None,
    *,
    axis_name: str,
    implementation: str | Sequence[str] | None = None,
    deterministic: bool | None = None,
    block_sizes=None,
    interpret: bool | None = None,
):
    """Per-device body: local query rows ``[B, S_q/n, Hq, D]``, local K/V
    ``[B, S_kv/n, Hkv, D]`` and local routes (global IDs) -> local output.

    Must run inside ``shard_map`` (or another map) that binds ``axis_name``.
    ``implementation``, ``block_sizes``, ``interpret`` and ``deterministic`` are
    :func:`qsa_jax.sparse_gqa_attention`'s. With ``deterministic`` each device's own
    gradients are bitwise reproducible; dK/dV are then their sum over devices by the
    all-gather's transpose (a reduce-scatter), reproducible as far as XLA's collectives are.
    """
    key = jax.lax.all_gather(key, axis_name, axis=1, tiled=True)
    value = jax.lax.all_gather(value, axis_name, axis=1, tiled=True)
    return sparse_gqa_attention(
        query, key, value, selected_token_ids, softmax_scale, implementation=implementation,
        block_sizes=block_sizes, interpret=interpret, deterministic=deterministic,
    )


def context_parallel_sparse_gqa_attention(
    query,
    key,
    value,
    selected_token_ids,
    softmax_scale: float | None = None,
    *,
    mesh: Mesh,
    axis_name: str = "cp",
    batch_axis: str | None = None,
    implementation: str | Sequence[str] | None = None,
    deterministic: bool | None = None,
    block_sizes=None,
    interpret: bool | None = None,
    check_vma: bool = False,
):
    """Route-sparse GQA with the sequence split over mesh axis ``axis_name``.

    The arguments are named and ordered as ``qsa_torch.context_parallel_sparse_gqa_attention``'s
    (docs/api-names.md): the four arrays, the scale, then where the sequence is split
    (``mesh``/``axis_name``/``batch_axis`` here, ``group`` there), the implementation,
    ``deterministic``, and each framework's extras. Unlike torch's per-rank slices, the
    arrays here are global.

    Args:
        query: ``[B, S_q, Hq, D]`` (global shape). Inputs are resharded onto the
            mesh as needed, but concrete arrays must all be on the same devices
            (all on the mesh, or all on one device): mixed placements are a ValueError.
        key, value: ``[B, S_kv, Hkv, D]``.
        selected_token_ids: ``[B, S_q, K]`` int routes in global K/V coordinates.
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        mesh: the device mesh; ``axis_name`` splits S_q and S_kv (device i holds
            rows ``i*S/n .. (i+1)*S/n - 1``), ``batch_axis`` (optional) splits B.
        implementation, deterministic, block_sizes, interpret: passed to
            :func:`qsa_jax.sparse_gqa_attention` on each device.
        check_vma: shard_map's replication check; off by default because
            custom kernels (Pallas calls) need not declare how they vary over axes.

    Returns:
        ``[B, S_q, Hq, D]``, sharded like the inputs (sequence over ``axis_name``).

    Raises:
        ValueError: the contract's shape errors (InvalidInput), an axis missing from the
            mesh, or S_q / S_kv / B not divisible by their mesh axis size.
        TypeError: what the per-device call raises (InvalidDtype, e.g. a non-bool
            ``deterministic``).
        BackendDeclined / NoBackendAvailable: no named implementation accepts the inputs
            (e.g. ``deterministic=True`` where only fp32-atomic kernels are named).
    """
    routes = prepare_routes(selected_token_ids)
    checked = validate_inputs(query, key, value, routes, softmax_scale)
    dims = checked.dims
    for name in (axis_name, batch_axis):
        if name is not None and name not in mesh.shape:
            raise ValueError(f"axis_name/batch_axis {name!r} is not an axis of the mesh {dict(mesh.shape)}")
    n = mesh.shape[axis_name]
    for what, size in (("query length S_q", dims.query_length), ("key/value length S_kv", dims.kv_length)):
        if size % n:
            raise ValueError(f"{what} = {size} is not divisible by mesh axis {axis_name!r} of size {n}")
    if batch_axis is not None and dims.batch % mesh.shape[batch_axis]:
        raise ValueError(
            f"batch {dims.batch} is not divisible by mesh axis {batch_axis!r} of size {mesh.shape[batch_axis]}"
        )
    spec = PartitionSpec(batch_axis, axis_name)
    body = functools.partial(
        sparse_gqa_attention_shard, softmax_scale=checked.scale, axis_name=axis_name,
        implementation=implementation, block_sizes=block_sizes, interpret=interpret, deterministic=deterministic,
    )
    mapped = shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=check_vma)
    platform = mesh.devices.flat[0].platform
    same = platform == _default_devices()[0].platform
    with contextlib.nullcontext() if same else jax.default_device(platform):
        return mapped(query, key, value, routes)
