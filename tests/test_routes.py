"""Route generators, layouts and normalisation (numpy, torch and JAX)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qsa_common.generators import adversarial_routes, qsa_format_routes, qsa_width, random_routes
from qsa_common.layouts import context_parallel_shard, make_problem, packed_rows, padded_batch
from qsa_common.route_stats import adjacent_jaccard


def canonical_sets(routes: np.ndarray, kv_length: int) -> list[list[frozenset]]:
    """The contract's R(b, i) computed with Python sets."""
    return [[frozenset(int(r) for r in row if 0 <= r < kv_length) for row in rows] for rows in routes]


# ------------------------------------------------------------------ generators
def check_qsa_format(routes: np.ndarray, top_k: int) -> None:
    """Every row of doc-local routes obeys docs/contract.md's QSA format."""
    length, width = routes.shape
    assert width == qsa_width(top_k) and width % 4 == 0
    for p in range(length):
        visible = (p + 1) // 4
        groups = routes[p].reshape(-1, 4)
        blocks, tail = [], None
        for g in groups:
            if np.all(g == -1):
                continue
            if g[0] % 4 == 0 and np.array_equal(g, g[0] + np.arange(4)) and g[0] // 4 < visible:
                assert tail is None, "blocks come before the causal tail"
                blocks.append(int(g[0] // 4))
            else:
                n = p + 1 - 4 * visible
                want = np.concatenate([4 * visible + np.arange(n), -np.ones(4 - n, int)])
                assert np.array_equal(g, want), f"row {p}: bad group {g}"
                tail = g
        assert len(set(blocks)) == len(blocks) == min(visible, top_k)
        assert blocks == sorted(blocks)
        if visible <= top_k:
            assert blocks == list(range(visible)), "identity region selects all blocks"
        if (p + 1) % 4:
            assert tail is not None
        assert set(routes[p][routes[p] >= 0]) <= set(range(p + 1)), "routes are causal"


@pytest.mark.parametrize("top_k", [1, 3, 16])
def test_qsa_format(top_k):
    routes = qsa_format_routes(200, top_k=top_k, rng=np.random.default_rng())
    check_qsa_format(routes, top_k)


def test_qsa_neighbours_overlap_realistically():
    routes = qsa_format_routes(8192, top_k=512, rng=np.random.default_rng())
    jac = adjacent_jaccard(routes[4 * 512 + 64 :], 8192).mean()
    assert 0.8 <= jac <= 0.95, jac
    assert ((routes >= 0).sum(1)[-100:] >= 2048).all()


def test_random_and_adversarial_families():
    rng = np.random.default_rng()
    r = random_routes(50, width=16, rng=rng)
    for p, row in enumerate(r):
        valid = row[row >= 0]
        assert len(set(valid)) == len(valid) and (valid <= p).all()
    a = adversarial_routes(50, width=16, rng=rng)
    assert a.dtype == np.int64
    assert (a > 2**40).any() and (a < -(2**31)).any() and (a == -1).any() and (a >= 50).any()
    rows_valid = ((a >= 0) & (a < 50)).sum(1)
    assert (rows_valid == 0).any(), "some rows are empty"
    assert any(len(set(row[(row >= 0) & (row < 50)])) < rows_valid[i] for i, row in enumerate(a))


def test_same_seed_same_routes_across_frameworks():
    import torch

    from qsa_jax.routes import generate_problem as jax_problem
    from qsa_torch.routes import generate_problem as torch_problem

    for layout in ("padded", "packed", "cp"):
        for fam in ("qsa", "random", "adversarial"):
            t, tp = torch_problem(layout, fam, seed=11, seq_len=40, width=12)
            j, jp = jax_problem(layout, fam, seed=11, seq_len=40, width=12)
            # the wrapper hands over the numpy generator's routes unchanged (values and dtype)
            want = make_problem(layout, fam, seed=11, seq_len=40, width=12).routes
            assert t.dtype == torch.int64 and np.array_equal(t.numpy(), want)
            assert canonical_sets(np.asarray(j), jp.kv_length) == canonical_sets(tp.routes, tp.kv_length)


# --------------------------------------------------------------------- layouts
def test_padded_rows_are_all_padding():
    rng = np.random.default_rng()
    prob = padded_batch([20, 13, 7], 20, lambda n: adversarial_routes(n, width=8, rng=rng))
    for b, n in enumerate([20, 13, 7]):
        assert (prob.routes[b, n:] == -1).all()
        valid = prob.routes[b][(prob.routes[b] >= 0) & (prob.routes[b] < 20)]
        assert (valid < n).all(), "no route points into padding K/V"


@pytest.mark.parametrize("fam", ["qsa", "random", "adversarial"])
def test_packed_routes_never_cross_documents(fam):
    rng = np.random.default_rng()
    prob = make_problem("packed", fam, seed=int(rng.integers(2**31)), seq_len=97, width=12)
    seg = prob.segment_ids()[0]
    routes = prob.routes[0]
    for i in range(prob.query_length):
        ids = routes[i][(routes[i] >= 0) & (routes[i] < prob.kv_length)]
        assert (seg[ids] == seg[i]).all(), f"row {i} crosses a document"


def test_packed_qsa_blocks_restart_at_document_starts():
    prob = packed_rows([9, 14], lambda n: qsa_format_routes(n, top_k=8, rng=np.random.default_rng()))
    check_qsa_format(prob.routes[0, 9:] - np.where(prob.routes[0, 9:] >= 0, 9, 0), 8)


def test_cp_shards_reassemble_the_problem():
    full = make_problem("packed", "qsa", seed=5, seq_len=64, top_k=4)
    shards = [context_parallel_shard(full, 4, r) for r in range(4)]
    assert all(s.kv_length == 64 and s.query_length == 16 for s in shards)
    assert [s.query_offset for s in shards] == [0, 16, 32, 48]
    assert np.array_equal(np.concatenate([s.routes for s in shards], axis=1), full.routes)
    with pytest.raises(ValueError, match="divisible"):
        context_parallel_shard(full, 3, 0)
    assert np.array_equal(make_problem("cp", "qsa", seed=5, seq_len=64, top_k=4, rank=1).routes,
                          context_parallel_shard(full, 2, 1).routes)


# --------------------------------------------------------------- normalisation
route_arrays = hnp.arrays(
    np.int64, hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=6),
    elements=st.one_of(st.integers(-3, 12), st.sampled_from([2**31, 2**32 + 3, 2**63 - 1, -(2**63)])),
)


@settings(max_examples=60, deadline=None)
@given(routes=route_arrays, kv_length=st.integers(1, 10), sort=st.booleans())
def test_normalize_matches_set_semantics(routes, kv_length, sort):
    import jax.numpy as jnp
    import torch

    from qsa_jax.routes import normalize_routes as jax_norm
    from qsa_jax.routes import prepare_routes
    from qsa_torch.routes import normalize_routes as torch_norm

    want = canonical_sets(routes, kv_length)
    t = torch_norm(torch.from_numpy(routes), kv_length, sort=sort).numpy()
    j = np.asarray(jax_norm(jnp.asarray(prepare_routes(routes)), kv_length, sort=sort))
    for out in (t, j):
        assert out.dtype == np.int32 and out.shape == routes.shape
        assert ((out == -1) | ((out >= 0) & (out < kv_length))).all()
        valid = out[out >= 0]
        assert canonical_sets(out, kv_length) == want
        for row in out.reshape(-1, out.shape[-1]):
            v = row[row >= 0]
            assert len(set(v.tolist())) == len(v), "no duplicates remain"
        if sort:
            assert (np.diff(out, axis=-1) >= 0).all()
        else:  # valid IDs keep the slot of their first occurrence
            first = np.zeros_like(routes, dtype=bool)
            for idx in np.ndindex(routes.shape[:2]):
                seen = set()
                for s, r in enumerate(routes[idx]):
                    if 0 <= r < kv_length and r not in seen:
                        seen.add(int(r))
                        first[idx + (s,)] = True
            assert np.array_equal(out >= 0, first) and np.array_equal(out[first], routes[first])
        del valid
    assert np.array_equal(t, j)


def test_membership_tables_match_sets():
    import torch

    from qsa_common.oracle import membership
    from qsa_jax.routes import membership_table as jax_table
    from qsa_jax.routes import prepare_routes
    from qsa_torch.routes import membership_table as torch_table

    routes = adversarial_routes(30, width=10, rng=np.random.default_rng())[None]
    want = membership(routes, 30)
    for b, rows in enumerate(canonical_sets(routes, 30)):
        for i, s in enumerate(rows):
            assert set(np.nonzero(want[b, i])[0].tolist()) == s
    assert np.array_equal(torch_table(torch.from_numpy(routes), 30).numpy(), want)
    assert np.array_equal(np.asarray(jax_table(prepare_routes(routes), 30)), want)
