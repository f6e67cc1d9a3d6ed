"""numpy oracle of the route unions the token-gather kernels walk.

Per group of query rows (a tile of T rows, or the rows of a flat program of (row, head)
pairs), straight from the definition: the ascending distinct valid IDs, -1 after them,
the count, and per ID the bitmask of the group's rows that route to it (0 after the
count). Framework-free, so the torch-built and JAX-built unions are both checked
against it, element for element and in the kernels' exact layout.
"""

from __future__ import annotations

import numpy as np


def _unions(routes: np.ndarray, kv_length: int, windows: list[tuple[int, int]], width: int):
    """Unions of row ``windows`` ``(first, n_rows)`` of every batch row."""
    bsz, s_q, _ = routes.shape
    union = np.full((bsz, len(windows), width), -1, np.int64)
    rowbits = np.zeros((bsz, len(windows), width), np.int64)
    count = np.zeros((bsz, len(windows)), np.int64)
    for b in range(bsz):
        for w, (first, n_rows) in enumerate(windows):
            rows = routes[b, first:min(first + n_rows, s_q)]
            valid = (rows >= 0) & (rows < kv_length)
            ids = np.unique(rows[valid])
            count[b, w] = len(ids)
            union[b, w, :len(ids)] = ids
            for t, row in enumerate(rows):
                member = np.isin(ids, row[valid[t]])
                rowbits[b, w, :len(ids)] |= member.astype(np.int64) << t
    as_int32 = lambda x: x.astype(np.uint32).view(np.int32)  # noqa: E731 - bit 31 is int32's sign
    return as_int32(union), count.astype(np.int32), as_int32(rowbits)


def tile_unions(routes: np.ndarray, kv_length: int, rows: int):
    """``(union, count, rowbits)`` of tiles of ``rows`` rows, ``min(rows * K, S_kv)`` wide."""
    s_q, k = routes.shape[1:]
    windows = [(first, rows) for first in range(0, s_q, rows)]
    return _unions(routes, kv_length, windows, min(rows * k, kv_length))


def flat_unions(routes: np.ndarray, kv_length: int, group: int, pairs: int, span: int):
    """Unions of flat programs of ``pairs`` consecutive (row, head) pairs over ``group``
    heads (bit t: the program's t-th query row), ``min(span * K, S_kv)`` wide."""
    s_q, k = routes.shape[1:]
    windows = []
    for first_pair in range(0, s_q * group, pairs):
        first, last = first_pair // group, (first_pair + pairs - 1) // group
        windows.append((first, last - first + 1))
    return _unions(routes, kv_length, windows, min(span * k, kv_length))


def assert_unions_equal(got, want, label: str = "", *, up_to_count: bool = False) -> None:
    """``got``: (union, count, rowbits) arrays of any framework, element for element; with
    ``up_to_count`` (unpadded unions, whose entries past each count are never written),
    shapes, dtypes, counts and the entries up to each count."""
    live = np.arange(want[0].shape[-1]) < np.asarray(want[1])[..., None]
    for name, g, w in zip(("union", "count", "rowbits"), got, want):
        g = np.asarray(g)
        assert g.shape == w.shape, f"{label} {name}: shape {g.shape} != {w.shape}"
        assert g.dtype == np.int32, f"{label} {name}: dtype {g.dtype}"
        if up_to_count and name != "count":
            g, w = np.where(live, g, 0), np.where(live, w, 0)
        np.testing.assert_array_equal(g, w, err_msg=f"{label} {name}")
