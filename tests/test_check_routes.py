"""check_routes: the route checker of qsa_common and its torch and JAX wrappers, against a
per-entry loop (hypothesis draws routes, documents and offsets)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qsa_common.errors import InvalidDtype, InvalidInput
from qsa_common.layouts import LAYOUTS, make_problem
from qsa_common.route_check import FIRST, check_routes


def _loop(routes, kv_length, offset, causal, docs):
    """Per-entry counts and first offenders, written the obvious way."""
    found = {"out": [], "future": [], "cross": []}
    empty = 0
    for b in range(routes.shape[0]):
        for i in range(routes.shape[1]):
            any_valid = False
            for j in range(routes.shape[2]):
                r = int(routes[b, i, j])
                entry = (b, i, j, r)
                if not 0 <= r < kv_length:
                    if r != -1:
                        found["out"].append(entry)
                    continue
                any_valid = True
                if causal and r > offset + i:
                    found["future"].append(entry)
                if docs is not None and docs[b, r] != docs[b, offset + i]:
                    found["cross"].append(entry)
            empty += not any_valid
    return found, empty


@st.composite
def problems(draw):
    batch = draw(st.integers(1, 3))
    s_q = draw(st.integers(1, 12))
    kv_length = draw(st.integers(s_q, s_q + 8))
    k = draw(st.integers(1, 6))
    values = st.one_of(st.integers(-3, kv_length + 3), st.sampled_from([-1, -2**40, 2**40, 2**31]))
    routes = np.array(draw(st.lists(values, min_size=batch * s_q * k, max_size=batch * s_q * k)),
                      dtype=np.int64).reshape(batch, s_q, k)
    offset = draw(st.integers(0, kv_length - s_q))
    docs = None
    if draw(st.booleans()):
        docs = np.array(draw(st.lists(st.integers(-1, 2), min_size=batch * kv_length, max_size=batch * kv_length)),
                        dtype=np.int32).reshape(batch, kv_length)
        docs = np.sort(docs, axis=1)  # contiguous documents, as token ids along a row are
    return routes, kv_length, offset, draw(st.booleans()), docs


@given(problems())
def test_counts_and_first_rows_equal_the_loop(problem):
    routes, kv_length, offset, causal, docs = problem
    report = check_routes(routes, causal=causal, documents=docs, kv_length=kv_length, query_offset=offset)
    found, empty = _loop(routes, kv_length, offset, causal, docs)
    assert (report.out_of_range, report.future, report.cross_document) == tuple(
        len(found[key]) for key in ("out", "future", "cross"))
    assert report.first_out_of_range == tuple(found["out"][:FIRST])
    assert report.first_future == tuple(found["future"][:FIRST])
    assert report.first_cross_document == tuple(found["cross"][:FIRST])
    assert report.empty_rows == empty
    assert report.ok == (not any(found.values()))
    text = str(report)
    assert ("ok" if report.ok else "PROBLEMS") in text.splitlines()[0]
    for entry in found["out"][:FIRST]:
        assert f"batch {entry[0]}, row {entry[1]}, slot {entry[2]}: id {entry[3]}" in text


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["qsa", "random"])
def test_the_generators_routes_are_causal_and_stay_in_their_documents(layout, family):
    """The project's causal generators build causal, document-local routes (their padding may
    use any out-of-range value, which the contract allows and the report counts); the
    adversarial family's non-causal IDs are found."""
    problem = make_problem(layout, family, seed=int(np.random.default_rng().integers(2**31)), seq_len=24, top_k=2,
                           rank=1)
    report = check_routes(problem.routes, documents=problem.segment_ids(), kv_length=problem.kv_length,
                          query_offset=problem.query_offset)
    assert report.future == 0 and report.cross_document == 0, str(report)
    hostile = make_problem(layout, "adversarial", seed=int(np.random.default_rng().integers(2**31)), seq_len=24,
                           width=8, rank=1)
    assert check_routes(hostile.routes, documents=hostile.segment_ids(), kv_length=hostile.kv_length,
                        query_offset=hostile.query_offset).future > 0


def test_a_future_route_and_a_crossing_are_named():
    routes = np.array([[[0, -1], [1, 2], [0, 3]]])
    # rows at positions 1..3 (documents 0, 1, 1): rows 1 and 2 reach back into document 0
    report = check_routes(routes, documents=np.array([0, 0, 1, 1]), kv_length=4, query_offset=1)
    assert not report.ok and report.future == 0
    assert report.first_cross_document == ((0, 1, 0, 1), (0, 2, 0, 0))
    report = check_routes(routes, documents=np.array([0, 0, 1, 1]), kv_length=4, query_offset=0)
    assert report.first_future == ((0, 1, 1, 2), (0, 2, 1, 3))
    assert "routes to future tokens: 2" in str(report)
    assert check_routes(routes, causal=False, kv_length=4).ok
    assert "routes to future tokens: not checked" in str(check_routes(routes, causal=False, kv_length=4))


def test_bad_arguments():
    with pytest.raises(InvalidDtype, match="signed integers"):
        check_routes(np.zeros((1, 2, 2), np.float32))
    with pytest.raises(InvalidInput, match="rank 3"):
        check_routes(np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidInput, match="documents"):
        check_routes(np.zeros((2, 2, 2), np.int64), documents=np.zeros((3, 2), np.int64))
    with pytest.raises(InvalidInput, match="do not fit"):
        check_routes(np.zeros((1, 4, 2), np.int64), kv_length=4, query_offset=2)


def test_framework_wrappers_agree():
    torch = pytest.importorskip("torch")
    import qsa_jax
    import qsa_torch

    rng = np.random.default_rng()
    routes = rng.integers(-3, 12, (2, 8, 3))
    docs = np.sort(rng.integers(0, 3, (2, 10)), axis=1)
    want = check_routes(routes, documents=docs, kv_length=10)
    assert qsa_torch.check_routes(torch.from_numpy(routes), documents=torch.from_numpy(docs)) == want
    assert qsa_jax.check_routes(routes, documents=docs) == want
    import jax.numpy as jnp

    assert qsa_jax.check_routes(jnp.asarray(routes, jnp.int32), documents=jnp.asarray(docs)) == want
