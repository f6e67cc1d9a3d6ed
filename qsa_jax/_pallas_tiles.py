"""Tiles of the Pallas kernels: geometry, route unions, the queries' tile arrangement.

Per tile of T consecutive query rows (or, with flattened heads, per program of
``block_m`` consecutive (row, head) pairs), the union of its rows' routes (ascending,
-1 padded to a multiple of ``block_k``), the per-ID row bitmask and the count, built with
JAX ops; queries, their gradients, LSE and delta are laid out ``[B, Hkv, rows, D_pad]``
so that a program's block is contiguous. The tiling arithmetic it shares with the
Triton kernels (power-of-two padding, flat programs' pairs and spans) is
``qsa_triton.plan``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qsa_triton.plan import flat_pairs, flat_span, next_pow2, program_rows

__all__ = ["Geometry", "MAX_ROWS", "arrange_queries", "flat_route_union", "pad_head_dim", "restore_queries",
           "route_union", "tile_route_union"]

MAX_ROWS = 16  # query rows per tile or flat program
_NO_ID = jnp.iinfo(jnp.int32).max  # sorts after every valid ID


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes derived from the inputs and a (block_m, block_k) choice.

    Padded (default): a program's ``block_m`` rows are T query rows x G_pad heads.
    Flat: they are ``block_m`` consecutive (query row, head) pairs of one KV head's
    group (no head padding); ``rows`` then bounds how many query rows one program spans.
    """

    group: int  # G = Hq // Hkv
    group_pad: int  # padded: G rounded up to a power of two; flat: G
    rows: int  # padded: T, query rows per tile; flat: most query rows one program spans
    block_m: int
    head_dim_pad: int
    block_k: int
    flat: bool = False

    @staticmethod
    def make(group: int, head_dim: int, block_m: int, block_k: int, flat: bool = False) -> Geometry:
        head_dim_pad = max(16, next_pow2(head_dim))
        group_pad = next_pow2(group)
        if flat and group != group_pad:
            block_m = flat_pairs(block_m, group, MAX_ROWS)
            return Geometry(group, group, flat_span(block_m, group), block_m, head_dim_pad, block_k, True)
        rows = max(1, min(MAX_ROWS, block_m // group_pad))
        if rows * group_pad < 16:  # dots need M >= 16
            rows = -(-16 // group_pad)
        return Geometry(group, group_pad, rows, rows * group_pad, head_dim_pad, block_k)


def tile_route_union(routes: jax.Array, rows: int, block_k: int):
    """Per tile of ``rows`` consecutive query rows: the union of their routes.

    Args:
        routes: ``[B, S_q, K]`` int32 routes; IDs < 0 are padding (call with
            IDs already clipped to ``[-1, S_kv)``, S_kv * rows < 2**31).
            Duplicates are allowed.
        rows: T, query rows per tile (<= 32).
        block_k: the union width is padded to a multiple of this.

    Returns:
        ``union [B, n_tiles, U]`` int32 ascending distinct IDs then -1,
        ``rowbits [B, n_tiles, U]`` int32 (bit t: row t of the tile routes to
        the ID), ``count [B, n_tiles, 1]`` int32 number of distinct IDs, with
        ``n_tiles = ceil(S_q / T)`` and ``U = round_up(T * K, block_k)``.
    """
    bsz, s_q, width = routes.shape
    n_tiles = -(-s_q // rows)
    r = jnp.pad(routes, ((0, 0), (0, n_tiles * rows - s_q), (0, 0)), constant_values=-1)
    return _union_of_row_groups(r.reshape(bsz, n_tiles, rows * width), rows, width, block_k)


def _flat_blocks(s_q: int, geo: Geometry):
    """Flat geometry: per program, the query rows ``[n, rows]`` it may touch and which
    of them it does."""
    n_blocks = -(-s_q * geo.group // geo.block_m)
    first_row, last_row = program_rows(jnp.arange(n_blocks, dtype=jnp.int32) * geo.block_m, geo.block_m, geo.group)
    row = first_row[:, None] + jnp.arange(geo.rows, dtype=jnp.int32)[None, :]
    return row, row <= jnp.minimum(last_row, s_q - 1)[:, None]


def flat_route_union(routes: jax.Array, geo: Geometry):
    """:func:`tile_route_union` for a flat geometry: per program, the union of the
    routes of the query rows its ``block_m`` (row, head) pairs touch; bit t of
    ``rowbits`` is row ``first_row + t`` of the program."""
    bsz, s_q, width = routes.shape
    row, ok = _flat_blocks(s_q, geo)
    r = jnp.where(ok[None, :, :, None], routes[:, jnp.minimum(row, s_q - 1), :], -1)
    return _union_of_row_groups(r.reshape(bsz, row.shape[0], geo.rows * width), geo.rows, width,
                                geo.block_k)


def route_union(routes: jax.Array, geo: Geometry):
    return flat_route_union(routes, geo) if geo.flat else tile_route_union(routes, geo.rows, geo.block_k)


def _union_of_row_groups(r: jax.Array, rows: int, width: int, block_k: int):
    """Union, row bits and count of each group ``r[b, g]`` of ``rows`` route rows
    (``[B, n, rows * width]``, row t's routes at ``[t * width, (t + 1) * width)``)."""
    bsz, n_tiles, _ = r.shape
    # One int32 sort key per (ID, row) pair: a single-operand sort (XLA can hand
    # it to a radix sort) instead of a two-key comparator sort.
    tok = jnp.broadcast_to(jnp.repeat(jnp.arange(rows, dtype=jnp.int32), width), r.shape)
    keys = jnp.sort(jnp.where(r >= 0, r * rows + tok, _NO_ID), axis=2)
    valid = keys != _NO_ID
    ids, tok = keys // rows, keys % rows
    prev_key = jnp.pad(keys[..., :-1], ((0, 0), (0, 0), (1, 0)), constant_values=-1)
    first = valid & (ids != prev_key // rows)
    # a repeated (ID, row) pair adds its bit once
    fresh = valid & (keys != prev_key)
    slot = jnp.cumsum(first, axis=2, dtype=jnp.int32) - 1
    width_pad = -(-rows * width // block_k) * block_k
    slot = jnp.where(valid, slot, width_pad)  # out of bounds: dropped

    def scatter(slot_t, ids_t, bits_t, first_t):
        union = jnp.full((width_pad,), -1, jnp.int32).at[jnp.where(first_t, slot_t, width_pad)].set(
            ids_t, mode="drop"
        )
        rowbits = jnp.zeros((width_pad,), jnp.int32).at[slot_t].add(bits_t, mode="drop")
        return union, rowbits

    bits = jnp.where(fresh, jnp.left_shift(jnp.int32(1), tok), 0)
    flat = lambda x: x.reshape(bsz * n_tiles, -1)  # noqa: E731
    union, rowbits = jax.vmap(scatter)(flat(slot), flat(ids), flat(bits), flat(first))
    count = jnp.sum(first, axis=2, dtype=jnp.int32)[..., None]
    return union.reshape(bsz, n_tiles, width_pad), rowbits.reshape(bsz, n_tiles, width_pad), count


def arrange_queries(x: jax.Array, geo: Geometry, kv_heads: int) -> jax.Array:
    """``[B, S_q, Hq, D]`` -> ``[B, Hkv, n_tiles * block_m, D_pad]`` (zero padded)."""
    bsz, s_q, _, d = x.shape
    if geo.flat:
        x = x.reshape(bsz, s_q, kv_heads, geo.group, d).transpose(0, 2, 1, 3, 4)
        x = x.reshape(bsz, kv_heads, s_q * geo.group, d)
        total = -(-s_q * geo.group // geo.block_m) * geo.block_m
        return jnp.pad(x, ((0, 0), (0, 0), (0, total - s_q * geo.group), (0, geo.head_dim_pad - d)))
    n_tiles = -(-s_q // geo.rows)
    x = jnp.pad(x, ((0, 0), (0, n_tiles * geo.rows - s_q), (0, 0), (0, geo.head_dim_pad - d)))
    x = x.reshape(bsz, n_tiles, geo.rows, kv_heads, geo.group, geo.head_dim_pad)
    x = jnp.pad(x, ((0, 0),) * 4 + ((0, geo.group_pad - geo.group), (0, 0)))
    x = x.transpose(0, 3, 1, 2, 4, 5)
    return x.reshape(bsz, kv_heads, n_tiles * geo.block_m, geo.head_dim_pad)


def restore_queries(x: jax.Array, geo: Geometry, s_q: int, head_dim: int) -> jax.Array:
    """Inverse of :func:`arrange_queries`."""
    bsz, kv_heads, total, _ = x.shape
    if geo.flat:
        x = x[:, :, : s_q * geo.group, :head_dim].reshape(bsz, kv_heads, s_q, geo.group, head_dim)
        return x.transpose(0, 2, 1, 3, 4).reshape(bsz, s_q, kv_heads * geo.group, head_dim)
    n_tiles = total // geo.block_m
    x = x.reshape(bsz, kv_heads, n_tiles, geo.rows, geo.group_pad, geo.head_dim_pad)
    x = x[:, :, :, :, : geo.group, :head_dim].transpose(0, 2, 3, 1, 4, 5)
    return x.reshape(bsz, n_tiles * geo.rows, kv_heads * geo.group, head_dim)[:, :s_q]


def pad_head_dim(x: jax.Array, head_dim_pad: int) -> jax.Array:
    d = x.shape[-1]
    return x if d == head_dim_pad else jnp.pad(x, ((0, 0),) * 3 + ((0, head_dim_pad - d),))
