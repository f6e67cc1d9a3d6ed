"""One contract test base that every implementation's tests subclass.

A subclass names an implementation and says how to run it on numpy inputs
(:meth:`BackendContract.run`); the base then checks it against the float64
oracle of :mod:`qsa_common.oracle` on every layout and route family, for the
output and (where the backend has a backward) dq, dk and dv, with fresh random
inputs each run. Subclasses narrow the matrix through class attributes, never
by skipping assertions.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from qsa_common.generators import FAMILIES, adversarial_routes
from qsa_common.layouts import LAYOUTS, make_problem
from qsa_common.oracle import oracle_forward_backward, relative_error

# The contract's tolerances on ||x - ref|| / ||ref||.
TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "bfloat16": 1e-2, "float16": 5e-3}


def round_to(array: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 data to ``dtype`` and back, so the oracle sees what the kernel sees."""
    if dtype == "bfloat16":
        import ml_dtypes

        return array.astype(ml_dtypes.bfloat16).astype(np.float64)
    return array.astype(dtype).astype(np.float64)


def random_inputs(rng: np.random.Generator, routes: np.ndarray, kv_length: int, heads, head_dim, dtype):
    """Fresh q, k, v, grad_out (float64 arrays rounded to ``dtype``)."""
    b, s_q, _ = routes.shape
    hq, hkv = heads
    q = round_to(rng.standard_normal((b, s_q, hq, head_dim)), dtype)
    k = round_to(rng.standard_normal((b, kv_length, hkv, head_dim)), dtype)
    v = round_to(rng.standard_normal((b, kv_length, hkv, head_dim)), dtype)
    do = round_to(rng.standard_normal((b, s_q, hq, head_dim)), dtype)
    return q, k, v, do


class BackendContract:
    """Subclass and implement :meth:`run`; set the class attributes to narrow the matrix."""

    dtypes: tuple[str, ...] = ("float32",)
    heads: tuple[tuple[int, int], ...] = ((4, 2), (2, 1))
    head_dim: int = 16
    seq_len: int = 32
    top_k: int = 2
    layouts: tuple[str, ...] = LAYOUTS
    families: tuple[str, ...] = FAMILIES
    has_backward: bool = True

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        """Return ``(out, dq, dk, dv)`` (or ``(out,)`` without backward) as numpy arrays.

        ``q, k, v, grad_out`` are float64 arrays already rounded to ``dtype``;
        ``routes`` is an int64 array ``[B, S_q, K]``.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def check(self, routes, kv_length, heads, dtype, rng, scale=None, label=""):
        q, k, v, do = random_inputs(rng, routes, kv_length, heads, self.head_dim, dtype)
        scale = self.head_dim ** -0.5 if scale is None else scale
        got = self.run(q, k, v, routes, scale, do, dtype)
        want = oracle_forward_backward(q, k, v, routes, scale, do)
        names = ("out", "dq", "dk", "dv")[: len(got)]
        if self.has_backward:
            assert len(got) == 4, "a backend with a backward must return out, dq, dk, dv"
        for name, g, w in zip(names, got, want):
            err = relative_error(g, w)
            assert err < TOLERANCE[dtype], f"{label} {name}: relative error {err:.3e} ({dtype})"
        return got, want

    # -------------------------------------------------------------------- tests
    @pytest.fixture
    def rng(self):
        seed = int(np.random.SeedSequence().entropy % 2**32)
        print(f"seed={seed}")
        return np.random.default_rng(seed)

    def cases(self):
        return itertools.product(self.layouts, self.families, self.dtypes, self.heads)

    def test_layouts_and_families(self, rng):
        for layout, fam, dtype, heads in self.cases():
            seed = int(rng.integers(2**31))
            # "cp": the last rank, whose queries sit past the start of the global K/V (rank 0's
            # are a packed prefix)
            problem = make_problem(
                layout, fam, seed=seed, seq_len=self.seq_len, top_k=self.top_k, rank=1
            )
            self.check(problem.routes, problem.kv_length, heads, dtype, rng,
                       label=f"{layout}/{fam}/{heads}/seed={seed}")

    def test_empty_rows_are_exact_zeros(self, rng):
        heads, dtype = self.heads[0], self.dtypes[0]
        routes = adversarial_routes(self.seq_len, width=4 * self.top_k + 4, rng=rng)[None]
        empty = np.zeros(self.seq_len, dtype=bool)
        empty[::3] = True
        routes[0, empty] = -1
        got, want = self.check(routes, self.seq_len, heads, dtype, rng, label="empty rows")
        assert np.all(got[0][0, empty] == 0.0), "empty rows must give exact zeros"
        if self.has_backward:
            assert np.all(got[1][0, empty] == 0.0), "empty rows must have exact zero dq"

    def test_duplicates_count_once(self, rng):
        """Unequal repeats: one valid ID of each row three times (in slots apart), every
        other ID once. Counting repeats would give that key three times the weight, which
        the set-semantics oracle does not (doubling every ID equally would leave the
        softmax unchanged and prove nothing)."""
        heads, dtype = self.heads[0], self.dtypes[0]
        base = make_problem("padded", "random", seed=int(rng.integers(2**31)),
                            seq_len=self.seq_len, width=6, batch=1).routes
        valid = (base >= 0) & (base < self.seq_len)
        assert valid.any(axis=-1).mean() > 0.5, "most rows must have a route to repeat"
        first = np.take_along_axis(base, valid.argmax(axis=-1)[..., None], axis=-1)
        first = np.where(valid.any(axis=-1, keepdims=True), first, -1)
        tripled = np.concatenate([first, base, first], axis=-1)
        self.check(tripled, self.seq_len, heads, dtype, rng, label="duplicates")
        q, k, v, do = random_inputs(rng, base, self.seq_len, heads, self.head_dim, dtype)
        once = self.run(q, k, v, base, 0.3, do, dtype)
        thrice = self.run(q, k, v, tripled, 0.3, do, dtype)
        for a, b in zip(once, thrice):
            assert relative_error(b, a) < TOLERANCE[dtype]

    def test_scale_and_int32_routes(self, rng):
        heads, dtype = self.heads[-1], self.dtypes[0]
        problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)),
                               seq_len=self.seq_len, top_k=self.top_k)
        self.check(problem.routes.astype(np.int32), problem.kv_length, heads, dtype, rng,
                   scale=0.77, label="int32 routes, scale 0.77")


class UnroutedRowsIsolated:
    """Mixin for gather-based backends (references, token-gather kernels): K/V rows that
    no route names never enter the arithmetic. Tile-based backends (flex, FA4, cuDNN)
    multiply masked probabilities by whole V tiles, so 0 * NaN reaches them: they do not
    take this mixin."""

    def test_unrouted_non_finite_rows_do_not_leak(self, rng):
        """K/V rows that no route names may hold NaN/inf: no output or gradient may see them
        (padding IDs must not read a real row into the arithmetic)."""
        heads, dtype = self.heads[0], self.dtypes[0]
        problem = make_problem("packed", self.families[0], seed=int(rng.integers(2**31)),
                               seq_len=self.seq_len, top_k=self.top_k)
        routes = problem.routes.copy()
        routes[(routes == 0)] = -1  # nobody routes to K/V row 0
        q, k, v, do = random_inputs(rng, routes, problem.kv_length, heads, self.head_dim, dtype)
        k[:, 0], v[:, 0] = np.inf, np.nan
        got = self.run(q, k, v, routes, 0.5, do, dtype)
        k[:, 0], v[:, 0] = 0.0, 0.0
        want = oracle_forward_backward(q, k, v, routes, 0.5, do)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            if name in ("dk", "dv"):  # nothing depends on the poisoned row: exactly zero gradient
                assert np.all(g[:, 0] == 0.0), f"{name} of the unrouted NaN/inf row is not exactly 0"
            assert relative_error(g, w) < TOLERANCE[dtype], f"{name} saw the unrouted NaN/inf row"

    def test_query_rows_without_routes_add_nothing_whatever_they_hold(self, rng):
        """A query row without routes contributes exactly zero to every gradient, even where
        its q and dO hold NaN/inf (a padding row's garbage): out and dq of the row are 0 and
        dk/dv equal the oracle's on clean inputs."""
        heads, dtype = self.heads[0], self.dtypes[0]
        problem = make_problem("packed", self.families[0], seed=int(rng.integers(2**31)),
                               seq_len=self.seq_len, top_k=self.top_k)
        routes = problem.routes.copy()
        routes[:, 1] = -1  # query row 1 has no routes
        q, k, v, do = random_inputs(rng, routes, problem.kv_length, heads, self.head_dim, dtype)
        q[:, 1, 0, 0], do[:, 1, -1, -1] = np.nan, np.inf
        got = self.run(q, k, v, routes, 0.5, do, dtype)
        q[:, 1], do[:, 1] = 0.0, 0.0
        want = oracle_forward_backward(q, k, v, routes, 0.5, do)
        assert np.all(got[0][:, 1] == 0) and np.all(got[1][:, 1] == 0), "the row without routes is not zero"
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert relative_error(g, w) < TOLERANCE[dtype], f"{name} saw the NaN/inf of a row without routes"
