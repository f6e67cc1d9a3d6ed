"""The QSA route indexer: torch and JAX against a brute-force float64 oracle.

Exact parity is tested on inputs from a coarse integer grid: every product and
partial sum of a score is then exact in float32 (and float64), so the oracle,
torch and JAX all see bit-identical scores and must return identical routes,
including on the many ties such inputs produce (ties go to the smaller block).
Arbitrary float inputs are checked for being a true top-k up to rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_routes import check_qsa_format

HEADS, DIM = 3, 8


def segments(rng, batch, seq, layout):
    """``(lengths, segment_ids)`` for one layout; the other is None."""
    if layout == "full":
        return None, None
    if layout == "padded":
        lengths = rng.integers(0, seq + 1, batch)
        lengths[0] = seq
        return lengths.astype(np.int64), None
    seg = np.full((batch, seq), -1, dtype=np.int32)
    for b in range(batch):
        pos, doc = 0, int(rng.integers(0, 5))
        end = seq - int(rng.integers(0, 5)) if b else seq  # some rows end in padding
        while pos < end:  # the first document is long enough to select among blocks
            n = int(rng.choice([1, 2, 3, 4, 5, 9, int(rng.integers(6, 30))])) if pos else 24
            seg[b, pos : min(end, pos + n)] = doc
            pos, doc = pos + n, doc + int(rng.integers(1, 3))
    return None, seg


def doc_bounds(batch, seq, lengths, segment_ids):
    """Per row: (document start, is a real token), written out with loops."""
    start = np.zeros((batch, seq), dtype=np.int64)
    valid = np.ones((batch, seq), dtype=bool)
    for b in range(batch):
        for t in range(seq):
            if lengths is not None:
                valid[b, t] = t < lengths[b]
            if segment_ids is not None:
                valid[b, t] = segment_ids[b, t] >= 0
                new = t == 0 or segment_ids[b, t] != segment_ids[b, t - 1]
                start[b, t] = t if new else start[b, t - 1]
    return start, valid


def oracle(qi, k, top_k, scale, lengths=None, segment_ids=None):
    """``(routes, scores)``: float64 brute force; ``scores[b][t]`` maps block start -> score.

    The raw sum is rounded to float32 and scaled in float32, as the frameworks do;
    for grid inputs the raw sum is exact, so this reproduces their scores bit for bit.
    """
    batch, seq = qi.shape[:2]
    start, valid = doc_bounds(batch, seq, lengths, segment_ids)
    routes = np.full((batch, seq, 4 * top_k + 4), -1, dtype=np.int64)
    scores = [[{} for _ in range(seq)] for _ in range(batch)]
    for b in range(batch):
        for t in range(seq):
            if not valid[b, t]:
                continue
            s = start[b, t]
            n_vis = (t - s + 1) // 4
            for blk in range(n_vis):
                j = s + 4 * blk
                kbar = k[b, j : j + 4].astype(np.float64).mean(0)
                raw = np.maximum(qi[b, t].astype(np.float64) @ kbar, 0).sum()
                scores[b][t][j] = float(np.float32(raw) * np.float32(scale))
            best = sorted(scores[b][t], key=lambda j: (-scores[b][t][j], j))[:top_k]
            ids = [j + i for j in sorted(best) for i in range(4)]
            ids += list(range(s + 4 * n_vis, t + 1))
            routes[b, t, : len(ids)] = ids
    return routes, scores


def grid(rng, shape):
    """Small integers: all score arithmetic is exact and ties are frequent."""
    return rng.integers(-2, 3, shape).astype(np.float32)


def run_both(qi, k, top_k, *, lengths=None, segment_ids=None, scale=None, chunks=(None, None)):
    import jax.numpy as jnp
    import torch

    from qsa_jax.indexer import qsa_indexer_routes as jax_routes
    from qsa_torch.indexer import qsa_indexer_routes as torch_routes

    t = torch_routes(
        torch.from_numpy(qi), torch.from_numpy(k), top_k, scale=scale,
        lengths=None if lengths is None else torch.from_numpy(lengths),
        segment_ids=None if segment_ids is None else torch.from_numpy(segment_ids),
        chunk_rows=chunks[0],
    ).numpy()
    j = np.asarray(jax_routes(
        jnp.asarray(qi), jnp.asarray(k), top_k, scale=scale,
        lengths=None if lengths is None else jnp.asarray(lengths),
        segment_ids=None if segment_ids is None else jnp.asarray(segment_ids),
        chunk_rows=chunks[1],
    ))
    assert t.dtype == j.dtype == np.int32
    return t, j


def check_format(routes, top_k, lengths, segment_ids):
    """QSA format per document (doc-local IDs), padding rows all -1, no route leaves its document."""
    batch, seq, _ = routes.shape
    start, valid = doc_bounds(batch, seq, lengths, segment_ids)
    for b in range(batch):
        assert (routes[b, ~valid[b]] == -1).all(), "padding rows are all -1"
        for s in np.unique(start[b, valid[b]]):
            rows = np.nonzero(valid[b] & (start[b] == s))[0]
            assert np.array_equal(rows, np.arange(s, s + len(rows))), "documents are contiguous"
            doc = routes[b, rows].astype(np.int64)
            check_qsa_format(np.where(doc >= 0, doc - s, doc), top_k)
            ids = doc[doc >= 0]
            assert ((ids >= s) & (ids < s + len(rows))).all(), "routes stay in their document"


@pytest.mark.parametrize("layout", ["full", "padded", "packed"])
@pytest.mark.parametrize("top_k", [1, 3, 16])
def test_frameworks_identical_and_equal_to_oracle(layout, top_k):
    rng = np.random.default_rng()
    batch, seq = 3, int(rng.integers(40, 70))
    qi, k = grid(rng, (batch, seq, HEADS, DIM)), grid(rng, (batch, seq, DIM))
    lengths, seg = segments(rng, batch, seq, layout)
    scale = 2.0 ** -int(rng.integers(0, 4))
    t, j = run_both(qi, k, top_k, lengths=lengths, segment_ids=seg, scale=scale,
                    chunks=(int(rng.integers(1, 9)), int(rng.integers(1, 9))))
    want, scores = oracle(qi, k, top_k, scale, lengths, seg)
    assert np.array_equal(t, want), "torch differs from the oracle"
    assert np.array_equal(j, want), "JAX differs from the oracle"
    check_format(want, top_k, lengths, seg)


@pytest.mark.parametrize("layout", ["full", "padded", "packed"])
def test_ties_go_to_the_smaller_block(layout):
    """Every third block of each document scores high, all others score 0: the
    selection among equal scores must be the smallest block ids."""
    rng = np.random.default_rng()
    batch, seq, top_k = 2, 57, 3
    lengths, seg = segments(rng, batch, seq, layout)
    start, valid = doc_bounds(batch, seq, lengths, seg)
    k = np.zeros((batch, seq, DIM), np.float32)
    for b in range(batch):
        for t in range(seq):
            if valid[b, t] and ((t - start[b, t]) // 4) % 3 == 0:
                k[b, t] = 1.0
    qi = rng.integers(1, 3, (batch, seq, HEADS, DIM)).astype(np.float32)  # positive
    t, j = run_both(qi, k, top_k, lengths=lengths, segment_ids=seg, chunks=(5, 9))
    want, _ = oracle(qi, k, top_k, DIM ** -0.5, lengths, seg)
    assert np.array_equal(t, want) and np.array_equal(j, want)
    for b in range(batch):  # spelled out for long-enough documents
        for i in np.nonzero(valid[b] & (np.arange(seq) - start[b] >= 35))[0]:
            n_vis = (i - start[b, i] + 1) // 4
            assert n_vis >= 9
            assert list(t[b, i, : 4 * top_k : 4] - start[b, i]) == [0, 12, 24], (b, i)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_inputs_give_a_true_top_k(dtype):
    import ml_dtypes

    rng = np.random.default_rng()
    batch, seq, top_k = 2, 61, 4
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    qi = rng.standard_normal((batch, seq, HEADS, DIM)).astype(np_dtype)
    k = rng.standard_normal((batch, seq, DIM)).astype(np_dtype)
    lengths, seg = segments(rng, batch, seq, "packed")
    if dtype == "bfloat16":
        import jax.numpy as jnp
        import torch

        from qsa_jax.indexer import qsa_indexer_routes as jax_routes
        from qsa_torch.indexer import qsa_indexer_routes as torch_routes

        t = torch_routes(torch.from_numpy(qi.astype(np.float32)).bfloat16(),
                         torch.from_numpy(k.astype(np.float32)).bfloat16(), top_k,
                         segment_ids=torch.from_numpy(seg)).numpy()
        j = np.asarray(jax_routes(jnp.asarray(qi), jnp.asarray(k), top_k, segment_ids=jnp.asarray(seg)))
    else:
        t, j = run_both(qi, k, top_k, segment_ids=seg)
    _, scores = oracle(qi.astype(np.float64), k.astype(np.float64), top_k, DIM ** -0.5,
                       segment_ids=seg)
    for routes in (t, j):
        check_format(routes, top_k, None, seg)
        for b in range(batch):
            for i in range(seq):
                sc = scores[b][i]
                chosen = {int(r) for r in routes[b, i, : 4 * top_k : 4] if r >= 0 and int(r) in sc}
                assert len(chosen) == min(len(sc), top_k)
                rest = [v for j_, v in sc.items() if j_ not in chosen]
                if rest:
                    worst = min(sc[c] for c in chosen)
                    assert worst >= max(rest) - 1e-5 * max(1.0, abs(worst)), (b, i)


def test_chunking_and_jit_do_not_change_routes():
    import jax
    import jax.numpy as jnp

    from qsa_jax.indexer import qsa_indexer_routes as jax_routes

    rng = np.random.default_rng()
    batch, seq, top_k = 2, 201, 8
    qi, k = grid(rng, (batch, seq, 2, 4)), grid(rng, (batch, seq, 4))
    lengths, seg = segments(rng, batch, seq, "packed")
    base_t, base_j = run_both(qi, k, top_k, segment_ids=seg, chunks=(seq, seq))
    assert np.array_equal(base_t, base_j)
    for chunks in ((5, 1), (37, 64), (None, None)):
        t, j = run_both(qi, k, top_k, segment_ids=seg, chunks=chunks)
        assert np.array_equal(t, base_t) and np.array_equal(j, base_t), chunks
    jitted = jax.jit(lambda a, b, s: jax_routes(a, b, top_k, segment_ids=s, chunk_rows=50))
    assert np.array_equal(np.asarray(jitted(jnp.asarray(qi), jnp.asarray(k), jnp.asarray(seg))), base_t)
    check_format(base_t, top_k, None, seg)


def test_long_sequence_matches_across_frameworks():
    """S = 2048 in chunks of 256 rows: the frameworks still agree exactly."""
    rng = np.random.default_rng()
    batch, seq, top_k = 1, 2048, 32
    qi, k = grid(rng, (batch, seq, 2, 4)), grid(rng, (batch, seq, 4))
    t, j = run_both(qi, k, top_k, chunks=(256, 256))
    assert np.array_equal(t, j)
    check_qsa_format(t[0].astype(np.int64), top_k)


def test_short_rows_have_only_tails():
    rng = np.random.default_rng()
    qi, k = grid(rng, (2, 3, 1, 4)), grid(rng, (2, 3, 4))
    t, j = run_both(qi, k, 2)
    want = np.full((2, 3, 12), -1)
    for p in range(3):
        want[:, p, : p + 1] = np.arange(p + 1)
    assert np.array_equal(t, want) and np.array_equal(j, want)


BAD = {
    "query rank": (dict(qi=lambda x: x[0]), ValueError, "index_query"),
    "key shape": (dict(k=lambda x: x[:, :-1]), ValueError, "index_key"),
    "int query": (dict(qi=lambda x: x.astype(np.int32)), TypeError, "index_query"),
    "top_k zero": (dict(top_k=lambda x: 0), ValueError, "top_k"),
    "top_k float": (dict(top_k=lambda x: 2.0), ValueError, "top_k"),
    "scale": (dict(scale=lambda x: -1.0), ValueError, "scale"),
    "chunk_rows zero": (dict(chunk_rows=lambda x: 0), ValueError, "chunk_rows"),
    "chunk_rows negative": (dict(chunk_rows=lambda x: -1), ValueError, "chunk_rows"),
    "chunk_rows float": (dict(chunk_rows=lambda x: 2.5), TypeError, "chunk_rows"),
    "chunk_rows bool": (dict(chunk_rows=lambda x: True), TypeError, "chunk_rows"),
    "lengths shape": (dict(lengths=lambda x: np.array([3, 3, 3])), ValueError, "lengths"),
    "lengths dtype": (dict(lengths=lambda x: np.array([3.0, 3.0])), TypeError, "lengths"),
    "segments shape": (dict(segment_ids=lambda x: np.zeros((2, 5), np.int32)), ValueError, "segment_ids"),
    "both layouts": (dict(lengths=lambda x: np.array([3, 3]),
                          segment_ids=lambda x: np.zeros((2, 8), np.int32)), ValueError, "not both"),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input(framework, case):
    changes, exc, text = BAD[case]
    rng = np.random.default_rng()
    args = dict(qi=grid(rng, (2, 8, 2, 4)), k=grid(rng, (2, 8, 4)), top_k=2, scale=None,
                lengths=None, segment_ids=None, chunk_rows=None)
    for name, fn in changes.items():
        args[name] = fn(args[name])
    if framework == "torch":
        import torch

        from qsa_torch.indexer import qsa_indexer_routes as fn
        conv = torch.from_numpy
    else:
        import jax.numpy as jnp

        from qsa_jax.indexer import qsa_indexer_routes as fn
        conv = jnp.asarray
    arrays = {n: None if args[n] is None else conv(np.ascontiguousarray(args[n]))
              for n in ("qi", "k", "lengths", "segment_ids")}
    with pytest.raises(exc, match=text):
        fn(arrays["qi"], arrays["k"], args["top_k"], scale=args["scale"],
           lengths=arrays["lengths"], segment_ids=arrays["segment_ids"], chunk_rows=args["chunk_rows"])
