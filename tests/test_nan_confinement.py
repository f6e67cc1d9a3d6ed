"""A non-finite value in one query row stays where the contract lets it go.

The contract: an entry outside a row's routes contributes exactly 0. So a NaN or inf in
row i's query ``q[b, i, h, :]`` or output gradient ``dO[b, i, h, :]`` may reach only
``out[b, i, h]`` (query only), ``dq[b, i, h]`` and ``dk`` / ``dv`` at the keys row i
routes, for batch row b and KV head ``h // G``. Every other entry of every result must be
finite and equal what the same inputs give without the poison.

Hypothesis draws the problem (routes with empty rows, GQA groups of 1-3, one or two
batch rows), the poisoned (row, head) pairs, whether q or dO is poisoned, the lane and
the value (NaN, +inf, -inf). Each backend runnable here is checked against a float64
gather reference written below from the contract (one row at a time: only routed keys
enter its arithmetic), which says where non-finite values must appear:

(a) out finite except at q-poisoned (row, head) pairs, (b) dq finite except at poisoned
pairs, (c) dk/dv finite at every (b, key, KV head) that no poisoned pair of that KV
head's group routes, (d) every finite entry matches the reference, (e) every entry the
reference makes non-finite is non-finite.

An inf query lane gets the sign of one routed key's lane, so that row has a score of
+inf and goes NaN in any softmax; with every score -inf a kernel may treat the row as
one without routes (its output 0), which the contract leaves open.

Backends: torch reference, Triton (interpreted on CPU, compiled on a GPU), FlexAttention
(forward only on CPU), JAX xla, JAX Pallas (interpret mode on CPU, compiled on a GPU),
JAX Triton (GPU only).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from contract_base import TOLERANCE
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_common.generators import adversarial_routes, random_routes

_HEADS = ((1, 1), (2, 1), (4, 2), (3, 1))
_D = 16
_SCALE = 0.5
_ON_GPU = os.path.exists("/dev/nvidiactl")
# fp32 dots on a GPU may take TF32 (XLA's default precision)
_GPU_TOL = 5e-3
_TOL = _GPU_TOL if _ON_GPU else 10 * TOLERANCE["float32"]


@dataclasses.dataclass
class Case:
    q: np.ndarray = dataclasses.field(repr=False)
    k: np.ndarray = dataclasses.field(repr=False)
    v: np.ndarray = dataclasses.field(repr=False)
    do: np.ndarray = dataclasses.field(repr=False)
    routes: np.ndarray = dataclasses.field(repr=False)  # [B, S_q, K] int64
    pairs: list  # poisoned (b, i, h)
    target: str  # "q" or "do"
    poison: str  # the value and lane of each pair
    nan: bool  # NaN poison (inf otherwise)

    def _repr_pretty_(self, printer, cycle):  # hypothesis prints the case without its arrays
        printer.text(repr(self))


@st.composite
def cases(draw, max_len: int = 12):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    bsz = draw(st.integers(1, 2))
    s = draw(st.integers(2, max_len))
    hq, hkv = draw(st.sampled_from(_HEADS))
    width = draw(st.integers(4, 6))
    family = draw(st.sampled_from(("causal", "adversarial")))
    make = (lambda: random_routes(s, width=width, rng=rng)) if family == "causal" else (
        lambda: adversarial_routes(s, width=width, rng=rng))
    routes = np.stack([make() for _ in range(bsz)])
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32).astype(np.float64) for shape in (
        (bsz, s, hq, _D), (bsz, s, hkv, _D), (bsz, s, hkv, _D), (bsz, s, hq, _D)))
    target = draw(st.sampled_from(("q", "do")))
    value = draw(st.sampled_from((np.nan, np.inf, -np.inf)))
    n = draw(st.integers(1, 3))
    pairs = sorted({(int(rng.integers(bsz)), int(rng.integers(s)), int(rng.integers(hq))) for _ in range(n)})
    group = hq // hkv
    poison = []
    for b, i, h in pairs:
        lane = int(rng.integers(_D))
        x = q if target == "q" else do
        if target == "q" and np.isinf(value):
            ids = [r for r in routes[b, i] if 0 <= r < s]
            if ids:  # a score of +inf: the row goes NaN in every softmax
                value = np.inf * np.sign(k[b, ids[0], h // group, lane])
        x[b, i, h, lane] = value
        poison.append(f"{value}@{lane}")
    return Case(q, k, v, do, routes, pairs, target, f"seed={seed} shape={q.shape} Hkv={hkv} {poison}",
                bool(np.isnan(value)))


def gather_reference(q, k, v, routes, scale, do):
    """Float64 (out, dq, dk, dv), one (b, i, h) at a time over the row's distinct routed
    keys: entries outside a row's routes never enter the arithmetic."""
    bsz, s_q, hq, _ = q.shape
    s_kv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    with np.errstate(all="ignore"):
        for b in range(bsz):
            for i in range(s_q):
                ids = np.array(sorted({int(r) for r in routes[b, i] if 0 <= r < s_kv}), dtype=np.int64)
                if ids.size == 0:
                    continue
                for h in range(hq):
                    g = h // group
                    kk, vv = k[b, ids, g], v[b, ids, g]
                    s = scale * (kk @ q[b, i, h])
                    w = np.exp(s - s.max())
                    p = w / w.sum()
                    out[b, i, h] = p @ vv
                    dp = vv @ do[b, i, h]
                    ds = p * (dp - p @ dp)
                    dq[b, i, h] = scale * ds @ kk
                    dk[b, ids, g] += scale * ds[:, None] * q[b, i, h][None, :]
                    dv[b, ids, g] += p[:, None] * do[b, i, h][None, :]
    return out, dq, dk, dv


def allowed(case: Case, hkv: int):
    """Boolean masks broadcastable to out, dq, dk, dv: where non-finite may appear."""
    bsz, s_q, hq, _ = case.q.shape
    s_kv = case.k.shape[1]
    rows = np.zeros((bsz, s_q, hq, 1), dtype=bool)
    keys = np.zeros((bsz, s_kv, hkv, 1), dtype=bool)
    for b, i, h in case.pairs:
        rows[b, i, h] = True
        for r in case.routes[b, i]:
            if 0 <= r < s_kv:
                keys[b, r, h // (hq // hkv)] = True
    out_rows = rows if case.target == "q" else np.zeros_like(rows)
    return out_rows, rows, keys, keys


def check(case: Case, got, tol: float = _TOL):
    """(a)-(e) of the module docstring for ``got`` = (out,) or (out, dq, dk, dv).

    (e) holds entry by entry for NaN poison. With inf poison, a key whose score is -inf
    gets probability 0 in some softmaxes and NaN (inf - inf) in others, so there (e)
    asks only that each poisoned pair with routes has a non-finite dq (and out, for q)."""
    want = gather_reference(case.q, case.k, case.v, case.routes, _SCALE, case.do)
    names = ("out", "dq", "dk", "dv")[: len(got)]
    for name, g, w, may in zip(names, got, want, allowed(case, case.k.shape[2])):
        bad, want_bad = ~np.isfinite(g), ~np.isfinite(w)
        may = np.broadcast_to(may, g.shape)
        assert not np.any(want_bad & ~may), f"the reference itself leaks into {name}"
        leaked = bad & ~may
        assert not leaked.any(), f"{name}: non-finite outside the poisoned rows' reach at {np.argwhere(leaked)[:4]}"
        if case.nan:
            missing = want_bad & ~bad
            assert not missing.any(), f"{name}: finite where the reference is NaN, at {np.argwhere(missing)[:4]}"
        elif name in ("out", "dq") and (name == "dq" or case.target == "q"):
            for b, i, h in case.pairs:
                if np.any(~np.isfinite(w[b, i, h])):
                    assert np.any(bad[b, i, h]), f"{name}[{b}, {i}, {h}]: the inf vanished"
        ok = ~bad & ~want_bad
        scale = max(float(np.abs(w[ok]).max(initial=0.0)), 1.0)
        err = float(np.abs(g[ok] - w[ok]).max(initial=0.0)) / scale
        assert err < tol, f"{name}: finite entries off the reference by {err:.2e}"


# ------------------------------------------------------------------------------ torch


def _run_torch(fn, case: Case, device="cpu", backward=True, dtype="float32"):
    import torch

    dtype = getattr(torch, dtype)
    leaves = [torch.tensor(x, dtype=dtype, device=device, requires_grad=backward) for x in (case.q, case.k, case.v)]
    out = fn(*leaves, torch.from_numpy(case.routes).to(device), _SCALE)
    if not backward:
        return (out.detach().double().cpu().numpy(),)
    out.backward(torch.tensor(case.do, dtype=dtype, device=device))
    return tuple(t.detach().double().cpu().numpy() for t in (out, *(x.grad for x in leaves)))


@given(cases())
def test_gather_reference_confines_by_construction(case):
    """The judge: rows of the float64 gather reference never reach what they do not route."""
    got = gather_reference(case.q, case.k, case.v, case.routes, _SCALE, case.do)
    check(case, got)


@given(cases())
def test_torch_reference(case):
    from qsa_torch.reference import reference_sparse_gqa_attention

    check(case, _run_torch(reference_sparse_gqa_attention, case))


def _torch_triton(deterministic):
    from qsa_torch.triton_qsa import BlockSizes, triton_sparse_gqa_attention

    small = BlockSizes(block_m=16, block_k=16, num_warps=1, num_stages=1, backward_block_m=16,
                       backward_block_k=16, backward_num_warps=1, backward_num_stages=1)

    def fn(q, k, v, routes, scale):
        return triton_sparse_gqa_attention(q, k, v, routes, scale, block_sizes=small, deterministic=deterministic)

    return fn


@settings(max_examples=4)
@given(cases(max_len=10))
def test_torch_triton(case):
    """Interpreted on CPU (tiles of 16 pairs: several rows share each union chunk)."""
    pytest.importorskip("triton")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(case, _run_torch(_torch_triton(False), case, device))


def _poisoned_routed_row(seed: int, target: str) -> Case:
    """12 causal rows (every row routes), (4, 2) heads, NaN at one lane of row 7, head 3."""
    rng = np.random.default_rng(seed)
    routes = random_routes(12, width=5, rng=rng)[None]
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32).astype(np.float64) for shape in (
        (1, 12, 4, _D), (1, 12, 2, _D), (1, 12, 2, _D), (1, 12, 4, _D)))
    (q if target == "q" else do)[0, 7, 3, 5] = np.nan
    return Case(q, k, v, do, routes, [(0, 7, 3)], target, f"seed={seed}", True)


@pytest.mark.parametrize("target", ["q", "do"])
def test_torch_triton_deterministic(target):
    """The fixed-point backward (qsa_triton.fixed_point): NaN at the routed keys' dK/dV
    rows (flagged), the finite sums elsewhere."""
    pytest.importorskip("triton")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _poisoned_routed_row(int(np.random.SeedSequence().entropy % 2**32), target)
    check(case, _run_torch(_torch_triton(True), case, device))


@settings(max_examples=3)
@given(cases(max_len=10))
def test_torch_triton_deterministic_drawn(case):
    """As above over drawn problems (empty rows, G of 1-3, inf poison)."""
    pytest.importorskip("triton")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(case, _run_torch(_torch_triton(True), case, device))


def _hopper_case(heads, target, seed):
    """The tuned problem's shape (D = 256, bf16-rounded inputs, QSA routes), two routed
    (row, head) pairs poisoned with NaN in q or dO."""
    from qsa_common.generators import family

    rng = np.random.default_rng(seed)
    s, (hq, hkv) = 300, heads
    routes = family("qsa", width=260, top_k=64, rng=rng)(s)[None]
    def bf16(shape):
        import torch

        return torch.from_numpy(rng.standard_normal(shape)).to(torch.bfloat16).double().numpy()

    q, k, v, do = bf16((1, s, hq, 256)), bf16((1, s, hkv, 256)), bf16((1, s, hkv, 256)), bf16((1, s, hq, 256))
    pairs = [(0, int(i), int(rng.integers(hq))) for i in rng.choice(np.arange(8, s), 2, replace=False)]
    for b, i, h in pairs:
        (q if target == "q" else do)[b, i, h, int(rng.integers(256))] = np.nan
    return Case(q, k, v, do, routes, pairs, target, f"seed={seed} heads={heads}", True)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("heads", [(24, 2), (12, 1)])
@pytest.mark.parametrize("target", ["q", "do"])
def test_torch_triton_hopper_gpu(monkeypatch, heads, target, deterministic):
    """The default configuration on an sm_90 GPU: the Gluon kernels (forward_sm90.py,
    backward_sm90.py, default and fixed-point backward) where the launch scope admits the
    problem, asserted."""
    import torch

    from qsa_torch.triton_qsa import triton_sparse_gqa_attention
    from qsa_triton import launch as spec

    admitted = []
    hopper = spec.backward_sm90_launch
    monkeypatch.setattr(spec, "backward_sm90_launch",
                        lambda *a, **kw: admitted.append(hopper(*a, **kw)) or admitted[-1])
    case = _hopper_case(heads, target, int(np.random.SeedSequence().entropy % 2**32))

    def fn(q, k, v, routes, scale):
        return triton_sparse_gqa_attention(q, k, v, routes, scale, deterministic=deterministic)

    got = _run_torch(fn, case, "cuda", dtype="bfloat16")
    if torch.cuda.get_device_capability() == (9, 0):
        assert admitted and all(launch is not None for launch in admitted), "the sm90 backward did not run"
    check(case, got, tol=5e-2)


@settings(max_examples=4)
@given(cases())
def test_torch_flex_forward(case):
    """FlexAttention's forward (uncompiled on CPU; its backward needs a GPU, see below)."""
    from qsa_torch.flex_qsa import flex_sparse_gqa_attention

    check(case, _run_torch(flex_sparse_gqa_attention, case, backward=False))


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["q", "do"])
def test_torch_flex_gpu(target):
    """FlexAttention's backward multiplies whole tiles (dK = dS^T Q, dV = P^T dO: 0 * NaN
    at keys a poisoned row does not route); qsa_torch._nonfinite keeps the row confined."""
    from qsa_torch.flex_qsa import flex_sparse_gqa_attention

    case = _poisoned_routed_row(int(np.random.SeedSequence().entropy % 2**32), target)
    check(case, _run_torch(flex_sparse_gqa_attention, case, "cuda"), tol=_GPU_TOL)


# -------------------------------------------------------------------------------- JAX


def _run_jax(case: Case, **kw):
    import jax
    import jax.numpy as jnp

    from qsa_jax import sparse_gqa_attention

    args = [jnp.asarray(x, dtype=jnp.float32) for x in (case.q, case.k, case.v)]

    def call(q, k, v):
        return sparse_gqa_attention(q, k, v, case.routes, _SCALE, **kw)

    out, vjp = jax.vjp(call, *args)
    grads = vjp(jnp.asarray(case.do, dtype=jnp.float32))
    return tuple(np.asarray(t, dtype=np.float64) for t in (out, *grads))


@given(cases())
def test_jax_xla(case):
    pytest.importorskip("jax")
    check(case, _run_jax(case, implementation="xla"))


@settings(max_examples=4)
@given(cases(max_len=10))
def test_jax_pallas(case):
    """Interpret mode on CPU, the compiled kernels on a GPU."""
    pytest.importorskip("jax")
    check(case, _run_jax(case, implementation="pallas", interpret=not _ON_GPU))


@pytest.mark.gpu
@given(cases())
def test_jax_triton_gpu(case):
    pytest.importorskip("jax_triton")
    check(case, _run_jax(case, implementation="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["q", "do"])
def test_jax_triton_gpu_deterministic(target):
    pytest.importorskip("jax_triton")
    case = _poisoned_routed_row(int(np.random.SeedSequence().entropy % 2**32), target)
    check(case, _run_jax(case, implementation="triton", deterministic=True))


# ------------------------------------------------- the wrapper for tile-kernel backends


def _leaky_tile_backend(q, k, v, routes, scale):
    """Dense masked softmax over whole rows with an additive -inf mask: its autograd
    backward multiplies every key of a row (dK = dS^T Q, dV = P^T dO) as a tile kernel
    does, so a non-finite row reaches keys it does not route. Rows without routes get 0."""
    import torch

    from qsa_torch.routes import membership_table

    group = q.shape[2] // k.shape[2]
    member = membership_table(routes, k.shape[1]).bool()
    has_route = member.any(-1)
    bias = torch.zeros(member.shape, dtype=q.dtype).masked_fill(~member, float("-inf"))
    bias = bias.masked_fill(~has_route[..., None], 0)
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k, v))
    p = (torch.einsum("bihd,bjhd->bhij", q, kk) * scale + bias[:, None]).softmax(-1)
    out = torch.einsum("bhij,bjhd->bihd", p, vv)
    return torch.where(has_route[:, :, None, None], out, out.new_zeros(()))


def _confined_leaky(q, k, v, routes, scale):
    from qsa_torch._nonfinite import confine_nonfinite

    return confine_nonfinite(lambda a, b, c: _leaky_tile_backend(a, b, c, routes, scale), q, k, v, routes)


@pytest.mark.parametrize("target", ["q", "do"])
def test_leaky_tile_backend_leaks_without_the_wrapper(target):
    """The stand-in kernel does leak (so the next test can fail), and only outside the routes."""
    case = _poisoned_routed_row(int(np.random.SeedSequence().entropy % 2**32), target)
    with pytest.raises(AssertionError, match="non-finite outside"):
        check(case, _run_torch(_leaky_tile_backend, case))


@given(cases())
def test_wrapper_confines_a_leaky_tile_backend(case):
    check(case, _run_torch(_confined_leaky, case))


@settings(max_examples=10)
@given(cases())
def test_wrapper_is_bitwise_a_no_op_on_finite_rows(case):
    """Finite inputs: out, dq, dk, dv bitwise equal to the bare kernel's."""
    def clean(x):
        return np.nan_to_num(x, nan=0.5, posinf=1.0, neginf=-1.0)

    finite = dataclasses.replace(case, q=clean(case.q), do=clean(case.do), pairs=[])
    bare, wrapped = (_run_torch(fn, finite) for fn in (_leaky_tile_backend, _confined_leaky))
    for b, w in zip(bare, wrapped):
        assert np.all(np.isfinite(w)) and np.array_equal(b, w)


def test_wrapper_routed_key_flags_ignore_padding_and_duplicates():
    """IDs outside [0, S_kv) flag nothing, duplicates flag once, other KV heads' groups
    and other batch rows stay clear; checked against a loop over random routes."""
    import torch

    from qsa_torch._nonfinite import routed_key_flags

    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    bsz, s_q, s_kv, hq, hkv, width = 2, 9, 7, 4, 2, 6
    routes = rng.integers(-3, s_kv + 3, (bsz, s_q, width))
    routes[0, 0, 1] = 2**40
    bad = rng.random((bsz, s_q, hq)) < 0.2
    want = np.zeros((bsz, s_kv, hkv), dtype=bool)
    for b, i, h in zip(*np.nonzero(bad)):
        for r in routes[b, i]:
            if 0 <= r < s_kv:
                want[b, r, h // (hq // hkv)] = True
    got = routed_key_flags(torch.from_numpy(bad), torch.from_numpy(routes), s_kv, hkv)
    assert got.shape == (bsz, s_kv, hkv, 1) and np.array_equal(got[..., 0].numpy(), want)


@pytest.mark.parametrize("target", ["q", "do"])
def test_wrapper_traces_whole_under_torch_compile(target):
    """One graph (fullgraph=True) around the wrapper and the stand-in kernel, and the
    same confinement as eager."""
    import torch

    case = _poisoned_routed_row(int(np.random.SeedSequence().entropy % 2**32), target)
    compiled = torch.compile(_confined_leaky, backend="aot_eager", fullgraph=True)
    check(case, _run_torch(compiled, case))


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["q", "do"])
def test_wrapper_never_synchronises_with_the_gpu(target):
    """No host synchronisation in the wrapper's forward or backward (sync debug mode
    "error" raises on one), and the same confinement on the GPU."""
    import torch

    from qsa_torch._nonfinite import confine_nonfinite
    from qsa_torch.routes import membership_table

    case = _poisoned_routed_row(int(np.random.SeedSequence().entropy % 2**32), target)
    routes = torch.from_numpy(case.routes).cuda()
    member = membership_table(routes, case.k.shape[1]).bool()
    bias = torch.zeros(member.shape, device="cuda").masked_fill(~member, float("-inf"))[:, None]
    q, k, v = (torch.tensor(x, dtype=torch.float32, device="cuda", requires_grad=True)
               for x in (case.q, case.k, case.v))
    do = torch.tensor(case.do, dtype=torch.float32, device="cuda")
    group = q.shape[2] // k.shape[2]

    def kernel(q, k, v):  # every route row here is non-empty: a whole-row softmax that leaks
        kk, vv = (t[:, :, :, None].expand(-1, -1, -1, group, -1).flatten(2, 3) for t in (k, v))
        p = (torch.einsum("bihd,bjhd->bhij", q, kk) * _SCALE + bias).softmax(-1)
        return torch.einsum("bhij,bjhd->bihd", p, vv)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = confine_nonfinite(kernel, q, k, v, routes)
        out.backward(do)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check(case, tuple(t.detach().double().cpu().numpy() for t in (out, q.grad, k.grad, v.grad)), tol=_GPU_TOL)
