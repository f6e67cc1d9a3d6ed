"""Property-based tests: every backend that runs here, in both frameworks, against the
float64 oracle on random problems drawn by hypothesis.

Each example draws B, S_q and S_kv independently (so S_q != S_kv, the context-parallel
shape), Hkv and the GQA ratio, D in 16..256, the dtype, a scale, and routes mixing valid
IDs, repeated IDs, -1, other negatives, IDs just past S_kv and huge int64 values, as
drawn, with empty rows, or with all rows identical. Torch inputs arrive contiguous,
as transposed views, or as every other row of a larger tensor (whose other rows must
get exactly zero gradient), routes likewise; a context-parallel split runs the query
rows in 1-3 contiguous pieces against the whole K/V (torch) or through
``qsa_jax.context_parallel_sparse_gqa_attention`` on a mesh of host devices (JAX).
Outputs and dq, dk, dv must match the oracle at the contract's tolerances, in a relative
error whose denominator is floored at a fraction of the scale of the result's terms
(:func:`_error`), so that a result cancelling to almost zero is not judged against its
own rounding noise. For 16-bit dq and dk, whose terms cancel, that floor usually decides,
and the bound is then several times looser than the plain relative error (a 2% error in a
16-bit dk can pass here): the contract tests (``tests/contract_base.py``) judge the plain
relative error on their problems.

Backends: torch reference, FlexAttention (forward only on CPU), Triton (interpreted on
CPU), the dispatching API (``"auto"`` and ``"triton"``), JAX xla and pallas (interpret
mode on CPU). The ``ci`` hypothesis profile (default, tests/conftest.py) draws a few
fresh tiny examples per run; ``--hypothesis-profile=gpu`` on a GPU host runs more, larger
ones through the compiled kernels.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from contract_base import TOLERANCE, round_to
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_common.oracle import membership, oracle_forward_backward

_GPU_PROFILE = settings.get_current_profile_name() == "gpu"
_MAX_LENGTH = 300 if _GPU_PROFILE else 12
_PADDING = (-1, -7, 2**31, 2**40, 2**63 - 1, -(2**63))


def _examples(fraction: float = 1.0) -> settings:
    """The loaded profile's settings with ``fraction`` of its examples (at least 3)."""
    return settings(max_examples=max(3, int(settings.default.max_examples * fraction)))


@dataclasses.dataclass
class Case:
    """One drawn problem (float64 arrays already rounded to ``dtype``)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    routes: np.ndarray  # [B, S_q, K] int64
    scale: float
    dtype: str
    layout: str  # "contiguous", "transposed" or "strided"
    pieces: int  # contiguous query-row pieces of a context-parallel split

    def expected(self):
        return oracle_forward_backward(self.q, self.k, self.v, self.routes, self.scale, self.do)


@st.composite
def cases(draw, *, dtypes=("float32", "bfloat16"), head_dims=None, groups=(1, 2, 3, 5, 12),
          kv_heads=(1, 2), length_step=1, max_pieces=3) -> Case:
    """A random problem; ``length_step`` makes S_q and S_kv multiples of it."""
    batch = draw(st.integers(1, 3))
    steps = max(1, _MAX_LENGTH // length_step)
    s_q = length_step * draw(st.integers(1, steps))
    s_kv = length_step * draw(st.integers(1, steps))
    hkv = draw(st.sampled_from(kv_heads))
    hq = hkv * draw(st.sampled_from(groups))
    head_dim = draw(st.integers(16, 256) if head_dims is None else st.sampled_from(head_dims))
    width = draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    routes = rng.integers(0, s_kv, size=(batch, s_q, width))
    kind = rng.random(routes.shape)
    padding = np.array(_PADDING + (s_kv, s_kv + 3), dtype=np.int64)
    pad_fraction = draw(st.sampled_from([0.0, 0.3, 0.7]))
    routes = np.where(kind < pad_fraction, rng.choice(padding, size=routes.shape), routes)
    # repeated IDs: a third of the remaining slots copy another slot of their row
    copies = np.take_along_axis(routes, rng.integers(0, width, size=routes.shape), axis=-1)
    routes = np.where(kind > 1 - (1 - pad_fraction) / 3, copies, routes)
    shape = draw(st.sampled_from(["mixed", "empty rows", "identical rows"]))
    if shape == "empty rows":
        routes[:, draw(st.integers(0, s_q - 1))::draw(st.integers(1, 3))] = rng.choice(padding)
    elif shape == "identical rows":
        routes[:] = routes[:, :1]
    dtype = draw(st.sampled_from(dtypes))
    normal = lambda *shape_: round_to(rng.standard_normal(shape_), dtype)  # noqa: E731
    return Case(
        q=normal(batch, s_q, hq, head_dim), k=normal(batch, s_kv, hkv, head_dim),
        v=normal(batch, s_kv, hkv, head_dim), do=normal(batch, s_q, hq, head_dim),
        routes=routes, scale=draw(st.sampled_from([head_dim**-0.5, 0.05, 0.5])), dtype=dtype,
        layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        pieces=draw(st.integers(1, min(max_pieces, s_q))),
    )


def _magnitudes(case: Case) -> tuple[np.ndarray, ...]:
    """``out, dq, dk, dv`` of the oracle's formulas with every term's absolute value:
    P |V|, scale * P (|dP| + |delta|) |K|, its transpose against |Q|, P^T |dO|. Rounding
    errors of any fp32-accumulating kernel scale with these, not with the signed results,
    which cancel (a row with one route has dq = 0 exactly, while its terms do not)."""
    q, k, v, do = case.q, case.k, case.v, case.do
    bsz, s_q, hq, d = q.shape
    s_kv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    mask = membership(case.routes, s_kv)[:, None]
    qh, doh = q.transpose(0, 2, 1, 3), do.transpose(0, 2, 1, 3)
    kh, vh = (np.repeat(t.transpose(0, 2, 1, 3), group, axis=1) for t in (k, v))
    scores = np.where(mask, case.scale * qh @ kh.transpose(0, 1, 3, 2), -np.inf)
    top = scores.max(-1, keepdims=True)
    weights = np.where(mask, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    p = weights / np.where(total > 0, total, 1.0)
    dp = doh @ vh.transpose(0, 1, 3, 2)
    terms = p * (np.abs(dp) + np.abs((p * dp).sum(-1, keepdims=True)))

    def fold(t: np.ndarray) -> np.ndarray:  # [B,Hq,S_kv,D] -> [B,S_kv,Hkv,D]
        return t.reshape(bsz, hkv, group, s_kv, d).sum(2).transpose(0, 2, 1, 3)

    return ((p @ np.abs(vh)).transpose(0, 2, 1, 3),
            (case.scale * terms @ np.abs(kh)).transpose(0, 2, 1, 3),
            fold(case.scale * terms.transpose(0, 1, 3, 2) @ np.abs(qh)),
            fold(p.transpose(0, 1, 3, 2) @ np.abs(doh)))


# Floor of the error's denominator, as a fraction of the magnitude tensor's norm:
# above every rounding error seen (fp32 < 1e-6, bf16 < 2.1e-3 of it, all backends)
_FLOOR = {"float64": 1 / 8, "float32": 1 / 8, "bfloat16": 1 / 2, "float16": 1 / 2}


def _error(actual: np.ndarray, expected: np.ndarray, magnitude: np.ndarray, dtype: str) -> float:
    """``||a - e|| / max(||e||, floor * ||m||)``: the contract's relative error, except that
    a result that cancels to (almost) zero is judged against the scale of its terms
    (:func:`_magnitudes`) instead of against its own rounding noise. inf for NaN/inf."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    if not np.all(np.isfinite(a)):
        return float("inf")
    floor = _FLOOR[dtype] * np.linalg.norm(magnitude)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), floor, 1e-300))


def _check(case: Case, got, label: str) -> None:
    names = ("out", "dq", "dk", "dv")
    for name, g, w, m in zip(names, got, case.expected(), _magnitudes(case)):
        err = _error(g, w, m, case.dtype)
        assert err < TOLERANCE[case.dtype], f"{label} {name}: error {err:.3e} ({case.dtype})"


# --------------------------------------------------------------------------- torch
def _torch():
    import torch

    return torch, ("cuda" if torch.cuda.is_available() else "cpu")


def _torch_leaf(x: np.ndarray, layout: str, dtype, device):
    """``(view, grad_of_view)``: a ``[B, S, H, D]`` view of a leaf in ``layout``;
    ``grad_of_view()`` reads the leaf's gradient back (and checks the rows the view skips
    got exactly zero)."""
    torch, _ = _torch()
    if layout == "transposed":
        leaf = torch.tensor(x.transpose(0, 2, 1, 3), dtype=dtype, device=device, requires_grad=True)
        return leaf.transpose(1, 2), lambda: leaf.grad.transpose(1, 2)
    if layout == "strided":
        wide = np.repeat(x, 2, axis=1)
        wide[:, 1::2] = np.nan  # rows the view skips: never read
        leaf = torch.tensor(wide, dtype=dtype, device=device, requires_grad=True)

        def grad():
            assert torch.all(leaf.grad[:, 1::2] == 0), "a skipped row got a gradient"
            return leaf.grad[:, ::2]

        return leaf[:, ::2], grad
    leaf = torch.tensor(x, dtype=dtype, device=device, requires_grad=True)
    return leaf, lambda: leaf.grad


def _torch_routes(routes: np.ndarray, layout: str, device):
    torch, _ = _torch()
    if layout == "transposed":
        return torch.from_numpy(routes.transpose(0, 2, 1).copy()).to(device).transpose(1, 2)
    if layout == "strided":
        return torch.from_numpy(np.repeat(routes, 2, axis=-1)).to(device)[..., ::2]
    return torch.from_numpy(routes).to(device)


def _run_torch(fn, case: Case, *, backward: bool = True):
    """``fn`` on the case in torch (its layout and context-parallel pieces): float64
    numpy ``(out, dq, dk, dv)``, or ``(out,)`` without ``backward``."""
    torch, device = _torch()
    dtype = getattr(torch, case.dtype)
    (q, dq), (k, dk), (v, dv) = (_torch_leaf(x, case.layout, dtype, device)
                                 for x in (case.q, case.k, case.v))
    routes = _torch_routes(case.routes, case.layout, device)
    bounds = np.linspace(0, q.shape[1], case.pieces + 1).astype(int)
    with torch.set_grad_enabled(backward):
        outs = [fn(q[:, a:b], k, v, routes[:, a:b], case.scale) for a, b in zip(bounds, bounds[1:])]
        out = torch.cat(outs, dim=1)
    assert out.dtype == dtype and out.shape == q.shape
    numpy = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    if not backward:
        return (numpy(out),)
    out.backward(torch.tensor(case.do, dtype=dtype, device=device))
    return tuple(numpy(t) for t in (out, dq(), dk(), dv()))


def _torch_backend(name: str):
    if name == "reference":
        from qsa_torch import reference_sparse_gqa_attention as fn
    elif name == "flex":
        from qsa_torch import flex_sparse_gqa_attention as fn
    elif name == "triton":
        from qsa_torch import triton_sparse_gqa_attention as fn
    else:
        from qsa_torch import sparse_gqa_attention

        backend = name.partition(":")[2] or "auto"
        return lambda *args: sparse_gqa_attention(*args, backend=backend)
    return fn


# flex compiles one kernel per bucketed shape on a GPU: few examples, few head dims there
_FLEX_DIMS = (16, 32, 64, 128, 256)


@pytest.mark.parametrize("backend", ["reference", "triton", "api", "api:triton"])
@_examples()
@given(case=cases(dtypes=("float32", "bfloat16", "float16")))
def test_torch_backends(backend, case):
    _check(case, _run_torch(_torch_backend(backend), case), f"torch {backend}")


@_examples(0.5)
@given(case=cases(dtypes=("float64",)))
def test_torch_reference_float64(case):
    _check(case, _run_torch(_torch_backend("reference"), case), "torch reference fp64")


@_examples(0.25 if _GPU_PROFILE else 1.0)
@given(case=cases(dtypes=("float32", "bfloat16"), head_dims=_FLEX_DIMS))
def test_torch_flex(case):
    torch, device = _torch()
    # FlexAttention has no CPU backward: forward only there
    got = _run_torch(_torch_backend("flex"), case, backward=device == "cuda")
    _check(case, got, f"torch flex ({device})")


# ----------------------------------------------------------------------------- JAX
def _run_jax(fn, case: Case):
    """``fn(q, k, v, routes, scale)`` under ``jax.vjp``: float64 numpy ``(out, dq, dk, dv)``.
    The strided layout hands JAX every other row of a larger query array instead."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(case.dtype)
    q = np.repeat(case.q, 2, axis=1) if case.layout == "strided" else case.q
    args = [jnp.asarray(x, dtype) for x in (q, case.k, case.v)]

    def call(q_, k_, v_):
        if case.layout == "strided":
            q_ = q_[:, ::2]
        return fn(q_, k_, v_, case.routes, case.scale)

    out, vjp = jax.vjp(call, *args)
    assert out.dtype == dtype and out.shape == case.q.shape
    dq, dk, dv = (np.asarray(g, np.float64) for g in vjp(jnp.asarray(case.do, dtype)))
    if case.layout == "strided":
        assert np.all(dq[:, 1::2] == 0), "a skipped row got a gradient"
        dq = dq[:, ::2]
    return np.asarray(out, np.float64), dq, dk, dv


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@_examples()
@given(case=cases(dtypes=("float32", "bfloat16")))
def test_jax_implementations(implementation, case):
    from qsa_jax import sparse_gqa_attention

    fn = lambda *a: sparse_gqa_attention(*a, implementation=implementation)  # noqa: E731
    _check(case, _run_jax(fn, case), f"jax {implementation}")


def _mesh_sizes():
    import jax

    return [n for n in (1, 2, 4) if n <= len(jax.devices())]


@_examples(0.5)
@given(data=st.data())
def test_jax_context_parallel(data):
    """The shard_map wrapper on a mesh of 1, 2 or 4 devices (host devices on CPU), the
    default implementation (xla on CPU; pallas, xla on a GPU)."""
    import jax
    from jax.sharding import Mesh

    from qsa_jax import context_parallel_sparse_gqa_attention

    n = data.draw(st.sampled_from(_mesh_sizes()), label="devices")
    case = data.draw(cases(length_step=n, max_pieces=1), label="case")
    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    fn = lambda *a: context_parallel_sparse_gqa_attention(*a, mesh=mesh)  # noqa: E731
    _check(case, _run_jax(fn, case), f"jax cp over {n} devices")
