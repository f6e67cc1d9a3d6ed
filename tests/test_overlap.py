"""The QSA generator's overlap knob and the route overlap statistics (numpy only)."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from qsa_common.generators import adversarial_routes, qsa_format_routes, qsa_width, random_routes
from qsa_common.layouts import context_parallel_shard, make_problem
from qsa_common.route_stats import (
    FLAT_128,
    Tiling,
    adjacent_jaccard,
    key_tile_inflation,
    mean_adjacent_jaccard,
    route_stats,
    union_inflation,
)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


# ------------------------------------------------------------------ default output is frozen
# sha256 prefixes of the generators' output at commit 041ff7d, before the overlap knob
# existed: the default routes (and so benchmark history) must not change.
_QSA_DIGESTS = {
    (200, 1, 0): "da076a8835223619",
    (200, 3, 1): "09a6ddfbde88df70",
    (200, 16, 2): "51c3d5f2bc4956ce",
    (1000, 64, 3): "0b60d3f49bf403a1",
    (3000, 512, 4): "d8cdc841da30196f",
    (9000, 512, 5): "a5242c30eec93a6e",
    (4100, 512, 6): "76104067867fef6a",
}
# make_problem(layout, family, seed=11, seq_len=96, width=20) and (seed=3, seq_len=300, top_k=8)
_PROBLEM_DIGESTS = {
    ("padded", "qsa"): ("3f240ad4b18e8722", "83083bbd8dedfbc1"),
    ("padded", "random"): ("741ff8c6547454eb", "a547f850ca92ff85"),
    ("padded", "adversarial"): ("eb78a119c10414da", "62ef2e6d1806d4b8"),
    ("packed", "qsa"): ("d1a7e5bdea06acb4", "d7aae85a4d4ec1c8"),
    ("packed", "random"): ("d7dc47aa3b371444", "91fa5d7996f04302"),
    ("packed", "adversarial"): ("77b36359bbf19b2e", "a6ad1443362b463e"),
    ("cp", "qsa"): ("5e9662c23346a40b", "0d678f3fbeb2efc4"),
    ("cp", "random"): ("c3e9e949f7176c36", "258d300fbd06aac8"),
    ("cp", "adversarial"): ("d275e9b5a9a850bb", "5dd9deceb0ac85e4"),
}


def test_default_qsa_routes_are_unchanged():
    for (n, k, seed), want in _QSA_DIGESTS.items():
        assert _digest(qsa_format_routes(n, top_k=k, rng=np.random.default_rng(seed))) == want, (n, k, seed)
    for (layout, fam), (want, want_k) in _PROBLEM_DIGESTS.items():
        assert _digest(make_problem(layout, fam, seed=11, seq_len=96, width=20).routes) == want
        assert _digest(make_problem(layout, fam, seed=3, seq_len=300, top_k=8).routes) == want_k


# ------------------------------------------------------------------ the knob
def assert_qsa_format(routes: np.ndarray, top_k: int, local: int | None = None) -> None:
    """Every row of document-local ``routes`` ``[L, W]`` keeps docs/contract.md's QSA format
    (vectorised, so it runs on long documents); ``local``: the newest visible blocks
    every selecting row must keep."""
    length, width = routes.shape
    assert width >= qsa_width(top_k) and width % 4 == 0
    groups = routes.reshape(length, -1, 4)
    p = np.arange(length)
    visible = (p + 1) // 4
    n_blocks = np.minimum(visible, top_k)
    slot = np.arange(groups.shape[1])
    is_block = slot[None, :] < n_blocks[:, None]
    starts = groups[:, :, 0]
    # block groups: 4 consecutive IDs from a multiple of 4, ascending, visible
    assert (np.where(is_block[:, :, None], groups - starts[:, :, None], np.arange(4)) == np.arange(4)).all()
    assert (np.where(is_block, starts % 4, 0) == 0).all()
    assert (np.where(is_block, starts // 4, 0) < np.maximum(visible, 1)[:, None]).all()
    ascending = np.diff(np.where(is_block, starts, np.iinfo(np.int64).max), axis=1)
    assert (np.where(is_block[:, 1:], ascending, 1) > 0).all()
    # identity region: blocks 0 .. visible-1
    ident = visible <= top_k
    assert (np.where(is_block[ident], starts[ident] // 4, slot) == slot).all()
    # the tail group right after the blocks: 4*visible .. p, then -1; every later group -1
    tail = groups[p, n_blocks]
    want_tail = np.where(np.arange(4)[None, :] < (p + 1 - 4 * visible)[:, None],
                         4 * visible[:, None] + np.arange(4), -1)
    assert (tail == want_tail).all()
    assert (np.where(slot[None, :, None] > n_blocks[:, None, None], groups, -1) == -1).all()
    if local:
        selecting = np.nonzero(~ident)[0]
        ids = set()
        for i in selecting[:: max(1, selecting.size // 64)]:  # a sample of rows
            ids = set(starts[i, : n_blocks[i]] // 4)
            assert set(range(visible[i] - local, visible[i])) <= ids, f"row {i} lost its local window"


@pytest.mark.parametrize("top_k", [1, 3, 16])
def test_overlap_routes_keep_the_format(top_k):
    rng = np.random.default_rng()
    for overlap in (0.2, 0.8, 0.97):
        routes = qsa_format_routes(600, top_k=top_k, overlap=overlap, rng=rng)
        assert_qsa_format(routes, top_k, local=min(8, top_k // 2))
    wide = qsa_format_routes(300, top_k=4, width=40, overlap=0.5, rng=rng)
    assert wide.shape == (300, 40) and (wide[:, qsa_width(4):] == -1).all()
    assert_qsa_format(qsa_format_routes(3, top_k=2, overlap=0.5, rng=rng), 2)  # no selecting row


@pytest.mark.parametrize("layout", ["padded", "packed", "cp"])
def test_overlap_in_every_layout(layout):
    seed = int(np.random.default_rng().integers(2**31))
    prob = make_problem(layout, "qsa", seed=seed, seq_len=512, top_k=8, overlap=0.6, batch=3)
    packed = make_problem("packed", "qsa", seed=seed, seq_len=512, top_k=8, overlap=0.6)
    if layout == "cp":
        assert np.array_equal(prob.routes, context_parallel_shard(packed, 2, 0).routes)
        prob = packed
    for b, (starts, lengths) in enumerate(zip(prob.doc_starts, prob.doc_lengths)):
        for s, n in zip(starts, lengths):
            rows = prob.routes[b, s : s + n]
            valid = (rows >= 0) & (rows < prob.kv_length)
            assert ((rows[valid] >= s) & (rows[valid] < s + n)).all(), "routes stay in their document"
            assert_qsa_format(np.where(valid, rows - s, -1), 8, local=4)
        if layout == "padded":
            assert (prob.routes[b, lengths[0] :] == -1).all()


def test_overlap_hits_its_targets():
    """Past the identity region the token-level adjacent-row Jaccard is within 0.03 of
    the target; inflation falls as overlap grows. S=8192, top_k=128 has the ratio of
    visible to selected blocks of S=32768, top_k=512."""
    rng = np.random.default_rng()
    inflation = []
    for target in (0.3, 0.6, 0.8, 0.9):
        routes = qsa_format_routes(8192, top_k=128, overlap=target, rng=rng)
        stats = route_stats(routes, 8192, groups=(12,), first_row=4 * 128 + 3)
        assert abs(stats["jaccard"] - target) < 0.03, (target, stats)
        inflation.append(stats["inflation"][12]["flat128"])
    assert inflation == sorted(inflation, reverse=True) and inflation[-1] > 1.0


def test_overlap_at_the_benchmark_width():
    routes = qsa_format_routes(8192, top_k=512, overlap=0.8, rng=np.random.default_rng())
    assert abs(mean_adjacent_jaccard(routes, 8192, first_row=4 * 512 + 3) - 0.8) < 0.03
    assert ((routes >= 0).sum(1)[-100:] >= 2048).all()


def test_overlap_memory_is_bounded():
    """Peak numpy allocation stays within twice the routes themselves (no S x blocks scores)."""
    tracemalloc.start()
    try:
        routes = qsa_format_routes(16384, top_k=64, overlap=0.7, rng=np.random.default_rng(0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    scores = 16384 * (16384 // 4) * 4  # float32 scores of every row and block
    assert peak < 2 * routes.nbytes < scores, (peak, routes.nbytes)


@pytest.mark.parametrize("overlap", [0, 1, -0.2, 1.5, True, "0.5", float("nan")])
def test_overlap_is_validated(overlap):
    with pytest.raises(ValueError, match="overlap"):
        qsa_format_routes(64, top_k=4, overlap=overlap, rng=np.random.default_rng(0))


def test_overlap_is_for_the_qsa_family_only():
    with pytest.raises(ValueError, match="qsa"):
        make_problem("padded", "random", seed=0, seq_len=64, width=8, overlap=0.5)


# ------------------------------------------------------------------ statistics vs brute force
def _sets(routes: np.ndarray, kv_length: int) -> list[frozenset]:
    return [frozenset(int(x) for x in row if 0 <= x < kv_length) for row in routes]


def _brute_inflation(routes: np.ndarray, kv_length: int, group: int, tiling: Tiling) -> float:
    gathered = useful = 0
    for batch_row in routes:
        sets = _sets(batch_row, kv_length)
        useful += group * sum(map(len, sets))
        if tiling.rows:
            programs = [(a, min(a + tiling.rows, len(sets)), tiling.rows * group)
                        for a in range(0, len(sets), tiling.rows)]
        else:
            pairs = [(r, h) for r in range(len(sets)) for h in range(group)]
            programs = [(chunk[0][0], chunk[-1][0] + 1, tiling.pairs)
                        for chunk in (pairs[i : i + tiling.pairs] for i in range(0, len(pairs), tiling.pairs))]
        gathered += sum(len(frozenset().union(*sets[a:b])) * m for a, b, m in programs)
    return gathered / useful if useful else float("nan")


def _hostile_routes(rng: np.random.Generator, batch: int, s_q: int, kv_length: int) -> np.ndarray:
    width = int(rng.integers(4, 12))
    parts = [adversarial_routes(s_q, width=width, rng=rng) for _ in range(batch)]
    routes = np.stack(parts) % (kv_length + 6) - 3  # many repeats and near-range padding
    keep = rng.random(routes.shape) < 0.5
    return np.where(keep, np.stack(parts), routes)


def test_statistics_match_brute_force():
    rng = np.random.default_rng()
    tilings = (Tiling(pairs=5), Tiling(pairs=16), FLAT_128, Tiling(rows=1), Tiling(rows=4), Tiling(rows=7))
    for _ in range(12):
        batch, s_q, kv = int(rng.integers(1, 3)), int(rng.integers(1, 50)), int(rng.integers(1, 60))
        routes = _hostile_routes(rng, batch, s_q, kv)
        for group in (1, 3, 12):
            for tiling in tilings:
                got = union_inflation(routes, kv, group=group, tiling=tiling)
                want = _brute_inflation(routes, kv, group, tiling)
                assert (np.isnan(got) and np.isnan(want)) or got == pytest.approx(want, rel=1e-12)
                assert np.isnan(got) or got >= 1.0
        jac = adjacent_jaccard(routes, kv)
        for b in range(batch):
            sets = _sets(routes[b], kv)
            want = [len(x & y) / len(x | y) if x | y else 1.0 for x, y in zip(sets, sets[1:])]
            assert np.allclose(jac[b], want)
        if s_q > 3:
            stats = route_stats(routes, kv, groups=(3,), tilings=(Tiling(rows=4),), first_row=2)
            assert stats["jaccard"] == pytest.approx(jac[:, 2:].mean())
            assert stats["jaccard_all"] == pytest.approx(jac.mean())
            assert stats["useful"] == sum(len(s) for b in range(batch) for s in _sets(routes[b], kv))


def test_key_tile_inflation_matches_brute_force():
    """Against sets: sum over tiles of (rows routing into the tile) * T / useful entries,
    hostile routes (padding, repeats, out-of-range IDs); structured cases exactly."""
    rng = np.random.default_rng()
    for _ in range(12):
        batch, s_q, kv = int(rng.integers(1, 3)), int(rng.integers(1, 600)), int(rng.integers(1, 60))
        routes = _hostile_routes(rng, batch, s_q, kv)
        for tile in (1, 3, 4, 16):
            sets = [s for b in range(batch) for s in _sets(routes[b], kv)]
            useful = sum(len(s) for s in sets)
            touched = sum(len({i // tile for i in s}) for s in sets)
            got = key_tile_inflation(routes, kv, keys_per_tile=tile)
            assert (np.isnan(got) and useful == 0) or got == pytest.approx(touched * tile / useful, rel=1e-12)
    assert key_tile_inflation(np.arange(64 * 4).reshape(64, 4), 256, keys_per_tile=4) == 1.0  # aligned blocks
    assert key_tile_inflation(np.arange(64 * 4).reshape(64, 4), 256, keys_per_tile=16) == 4.0
    assert key_tile_inflation(np.arange(64 * 4).reshape(64, 4) + 2, 258, keys_per_tile=4) == 2.0  # straddling
    with pytest.raises(ValueError):
        key_tile_inflation(np.zeros((4, 2), dtype=np.int64), 4, keys_per_tile=0)


def test_statistics_on_structured_cases():
    identical = np.tile(np.arange(10), (64, 1))
    assert union_inflation(identical, 10, group=12) == 1.0
    assert (adjacent_jaccard(identical, 10) == 1.0).all()
    disjoint = np.arange(64 * 4).reshape(64, 4)  # every row its own four IDs
    assert union_inflation(disjoint, 256, group=1, tiling=Tiling(rows=8)) == 8.0
    assert union_inflation(disjoint, 256, group=128, tiling=FLAT_128) == 1.0  # one row per program
    assert (adjacent_jaccard(disjoint, 256) == 0.0).all()
    empty = np.full((5, 3), -1)
    assert np.isnan(union_inflation(empty, 4, group=2)) and (adjacent_jaccard(empty, 4) == 1.0).all()
    rng = np.random.default_rng()
    routes = random_routes(300, width=32, rng=rng)
    assert mean_adjacent_jaccard(routes, 300) < 0.2
    assert np.array_equal(adjacent_jaccard(routes[None], 300)[0], adjacent_jaccard(routes, 300))


def test_statistics_reject_bad_input():
    with pytest.raises(ValueError):
        Tiling(pairs=128, rows=8)
    with pytest.raises(ValueError):
        Tiling()
    with pytest.raises(ValueError):
        Tiling(rows=0)
    with pytest.raises(TypeError):
        adjacent_jaccard(np.zeros((4, 2), dtype=np.float32), 4)
    with pytest.raises(ValueError):
        adjacent_jaccard(np.zeros((2, 2, 2, 2), dtype=np.int64), 4)
    with pytest.raises(ValueError):
        union_inflation(np.zeros((4, 2), dtype=np.int64), 0, group=1)
    with pytest.raises(ValueError):
        mean_adjacent_jaccard(np.zeros((4, 2), dtype=np.int64), 4, first_row=3)
