"""The Triton backend's deterministic backwards, against the float64 oracle.

Two designs, kept apart so that the one the GPU timing rejects can be deleted whole:

* **Fixed point** (first section): the fused backward with int64 fixed-point dK/dV
  atomics (``qsa_triton.fixed_point``), the backend's deterministic mode
  (``deterministic=True``, or ``torch.use_deterministic_algorithms``).
* **KV-owning** (second section): ``qsa_triton.kv_backward``, dK/dV from key-block
  programs over an inverse route index, no atomics (a standalone function, not wired
  into the backend).

Without a CUDA GPU the kernels run in Triton's interpreter on CPU tensors (this module
sets TRITON_INTERPRET=1 before triton is first imported, as test_triton_qsa does).
Shapes are tiny.
"""

from __future__ import annotations

import contextlib
import functools
import os
from fractions import Fraction

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from contract_base import TOLERANCE, BackendContract, UnroutedRowsIsolated, random_inputs  # noqa: E402
from runners import run_torch  # noqa: E402
from qsa_common.generators import adversarial_routes, qsa_format_routes, random_routes  # noqa: E402
from qsa_common.layouts import make_problem  # noqa: E402
from qsa_common.oracle import membership, oracle_forward_backward, relative_error  # noqa: E402
from qsa_torch import _triton_deterministic as det  # noqa: E402
from qsa_torch import _triton_launch, triton_qsa  # noqa: E402
from qsa_torch._triton_deterministic import (  # noqa: E402
    KVBlockSizes,
    attention_delta,
    build_inverse_index,
    deterministic_dk_dv,
)
from qsa_triton import launch as spec  # noqa: E402
from qsa_triton.config import BlockSizes  # noqa: E402
from qsa_triton.fixed_point import add_fixed, fixed_point_exponents  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# 16 keys x 16 pairs: every block walks several chunks at these sizes
SMALL = KVBlockSizes(block_n=16, block_m=16, num_warps=1, num_stages=1)


def _fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def test_kernels_run_here():
    """On CPU the interpreter must be on (else TRITON_INTERPRET was set too late)."""
    _, interpreted = det._load_kernels()
    assert interpreted or DEVICE == "cuda", "kernels were compiled, not interpreted, on a CPU machine"


@contextlib.contextmanager
def deterministic_algorithms(warn_only: bool = False):
    """torch.use_deterministic_algorithms(True) for the block (restoring the previous mode):
    what selects the fixed-point backward; none of the torch ops either design uses may
    refuse to run under it."""
    before = torch.are_deterministic_algorithms_enabled()
    before_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)


# =========================================================================================
# Fixed point: the fused backward with int64 dK/dV sums (qsa_triton.fixed_point)
# =========================================================================================
# padded tiles of 16 pairs and 16-ID chunks: every program walks several chunks
FP_SMALL = BlockSizes(block_m=16, block_k=16, num_warps=1, num_stages=1, backward_block_m=16,
                      backward_block_k=16, backward_num_warps=1, backward_num_stages=1)
# flat programs of 32 (row, head) pairs (G = 3, 12: no padded heads)
FP_FLAT = BlockSizes(block_m=32, block_k=16, num_warps=2, num_stages=1, backward_block_m=32,
                     backward_block_k=16, backward_num_warps=2, backward_num_stages=1, flatten_heads=True)


@pytest.fixture
def poisoned_launch(monkeypatch):
    """Outputs the kernels write (DQ, the converted dK/dV) start as NaN: an element left
    unwritten fails the comparison."""
    def buffer(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else -77777
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)

    monkeypatch.setattr(_triton_launch, "new_buffer", buffer)


def _fixed_point(blocks):
    def fn(q, k, v, routes, scale):
        return triton_qsa.triton_sparse_gqa_attention(q, k, v, routes, scale, block_sizes=blocks, deterministic=True)
    return fn


def _grads(q, k, v, routes, scale, do, dtype, blocks, deterministic=True):
    """out, dq, dk, dv as torch tensors (the raw bits, for bitwise comparisons)."""
    tdtype = TORCH_DTYPES[dtype]
    leaves = [torch.tensor(x, dtype=tdtype, device=DEVICE, requires_grad=True) for x in (q, k, v)]
    out = triton_qsa.triton_sparse_gqa_attention(*leaves, torch.from_numpy(routes).to(DEVICE), scale,
                                                 block_sizes=blocks, deterministic=deterministic)
    out.backward(torch.tensor(do, dtype=tdtype, device=DEVICE))
    return (out.detach(), *(x.grad for x in leaves))


def _assert_oracle(got, want, dtype, label=""):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = relative_error(g.double().cpu().numpy(), w)
        assert err < TOLERANCE[dtype], f"{label} {name}: relative error {err:.3e} ({dtype})"


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (NaNs included)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


class TestFixedPointContract(UnroutedRowsIsolated, BackendContract):
    """The contract matrix through the deterministic backward (G = 3: padded heads)."""

    heads = ((3, 1),)
    dtypes = ("float32",)
    seq_len = 24

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_torch(_fixed_point(FP_SMALL), q, k, v, routes, scale, grad_out, dtype, device=DEVICE)


@pytest.mark.parametrize("layout,family,heads,dtype,blocks", [
    ("padded", "qsa", (12, 1), "bfloat16", FP_FLAT),
    ("packed", "adversarial", (3, 1), "bfloat16", FP_FLAT),
    ("cp", "random", (2, 2), "float32", FP_SMALL),
    ("cp", "qsa", (12, 1), "float32", FP_FLAT),
    ("packed", "random", (6, 2), "bfloat16", FP_SMALL),
])
def test_fixed_point_against_the_oracle_and_bitwise(poisoned_launch, layout, family, heads, dtype, blocks):
    """Layouts (padded rows all -1, packed documents, CP shards with S_q != S_kv), G in
    {1, 3, 12}, flat and padded programs: dq/dk/dv against the float64 oracle, the same
    bits over three runs, and within rounding of the default (atomic fp32) backward."""
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=24, top_k=2,
                           width=None if family == "qsa" else 7, batch=2 if layout == "padded" else 1)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 16, dtype)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    runs = [_grads(q, k, v, problem.routes, 0.3, do, dtype, blocks) for _ in range(3)]
    _assert_oracle(runs[0], want, dtype, layout)
    for run in runs[1:]:
        assert all(_bitwise_equal(a, b) for a, b in zip(run, runs[0]))
    default = _grads(q, k, v, problem.routes, 0.3, do, dtype, blocks, deterministic=False)
    assert _bitwise_equal(default[1], runs[0][1])  # dQ: the same kernel arithmetic
    for g, d in zip(runs[0][2:], default[2:]):
        err = relative_error(g.double().cpu().numpy(), d.double().cpu().numpy())
        assert err < TOLERANCE[dtype]


@pytest.mark.parametrize("group", [1, 3, 12])
def test_fixed_point_adversarial_routes(poisoned_launch, group):
    """Duplicates, -1, past the end, huge int64, empty rows, identical rows, one row routed
    everywhere, S_q != S_kv."""
    rng = _fresh_rng()
    s_q, kv_length = 13, 29
    routes = np.full((2, s_q, kv_length + 3), -1, dtype=np.int64)
    for b in range(2):
        routes[b, :, :8] = np.resize(adversarial_routes(kv_length, width=8, rng=rng), (s_q, 8))
    routes[0, 2] = routes[0, 3]  # identical rows
    routes[1, 4, :kv_length] = rng.permutation(kv_length)  # every key
    routes[1, 5] = -1
    routes[1, 5, :3] = [2**40, -(2**62), kv_length]  # nothing valid: an empty row
    routes[0, -1] = -1
    q, k, v, do = random_inputs(rng, routes, kv_length, (group, 1), 16, "float32")
    want = oracle_forward_backward(q, k, v, routes, 0.25, do)
    got = _grads(q, k, v, routes, 0.25, do, "float32", FP_FLAT if group > 1 else FP_SMALL)
    _assert_oracle(got, want, "float32")
    assert (got[1][1, 5] == 0).all() and (got[1][0, -1] == 0).all()  # empty rows: exact zero dq


def test_fixed_point_folded_grid_int64_offsets_strides():
    """Folded launch grids (y limit 2), 64-bit offsets, transposed views and an expanded
    output gradient (stride 0): the oracle's gradients, and the same bits as the plain
    launch on contiguous inputs (integer sums, whatever the programs' order)."""
    from qsa_torch import _triton_unions
    from qsa_torch._triton_autograd import TritonQSA
    from qsa_triton.plan import make_plan

    rng = _fresh_rng()
    bsz, s_q, kv_length = 5, 12, 20
    routes = rng.integers(-2, kv_length + 3, size=(bsz, s_q, 9))
    q, k, v, _ = random_inputs(rng, routes, kv_length, (6, 2), 16, "float32")
    do = np.ones_like(q)  # what out.sum().backward() hands in
    r = torch.from_numpy(routes).to(DEVICE)

    def run(plan, strided):
        leaves = [torch.tensor(x, dtype=torch.float32, device=DEVICE, requires_grad=True) for x in (q, k, v)]
        args = [x.transpose(1, 2).contiguous().transpose(1, 2) if strided else x for x in leaves]
        unions = _triton_unions.build_unions(r, kv_length, plan)
        out = TritonQSA.apply(*args, unions.union, unions.count, unions.rowbits, 0.3, plan, routes.shape[2], True)
        if strided:
            out.sum().backward()
        else:
            out.backward(torch.ones_like(out))
        return [x.grad for x in leaves]

    plain = run(make_plan(3, 16, FP_SMALL), False)
    odd = run(make_plan(3, 16, FP_SMALL, max_grid_y=2, offset_limit=0), True)
    want = oracle_forward_backward(q, k, v, routes, 0.3, do)
    for name, a, b, w in zip(("dq", "dk", "dv"), odd, plain, want[1:]):
        assert relative_error(a.double().cpu().numpy(), w) < TOLERANCE["float32"], name
        assert _bitwise_equal(a, b), name


def test_fixed_point_every_row_identical():
    rng = _fresh_rng()
    routes = np.broadcast_to(np.array([0, 5, 17, 31, -1, 5, 40]), (1, 20, 7)).copy()
    q, k, v, do = random_inputs(rng, routes, 32, (6, 2), 16, "bfloat16")
    _assert_oracle(_grads(q, k, v, routes, 0.25, do, "bfloat16", FP_SMALL),
                   oracle_forward_backward(q, k, v, routes, 0.25, do), "bfloat16")


# ---------------------------------------------------------------- the bound and its scale
@triton.jit
def _exponents_kernel(MAXIMA, OUT, BOUND_K, BOUND_V):
    e_k, e_v, ok_k, ok_v = fixed_point_exponents(MAXIMA, BOUND_K, BOUND_V)
    i = tl.arange(0, 4)
    values = tl.where(i == 0, e_k, tl.where(i == 1, e_v, tl.where(i == 2, ok_k.to(tl.int32), ok_v.to(tl.int32))))
    tl.store(OUT + i, values)


def _ceil_log2_ref(x: float) -> int | None:
    """ceil(log2 x) of a positive fp32 value by exact rationals; subnormals count as
    2**-126 (the kernels' upper bound); None for zero."""
    x = float(np.float32(x))
    if x == 0:
        return None
    x = max(x, 2.0**-126)
    k = 0
    frac = Fraction(x)
    while Fraction(2) ** k < frac:
        k += 1
    while Fraction(2) ** (k - 1) >= frac:
        k -= 1
    return k


def _exponents_ref(maxima, bound_k, bound_v):
    """(e_k, e_v, ok_k, ok_v) of ``qsa_triton.fixed_point``'s docstring, in Python (e is
    meaningless where its bound is refused)."""
    finite = bool(np.isfinite(np.asarray(maxima, np.float32)).all())
    logs = [_ceil_log2_ref(m) if np.isfinite(m) else 0 for m in maxima]
    big_k = None if None in logs else bound_k + sum(logs)
    big_v = None if logs[1] is None else bound_v + logs[1]
    e = [126 if big is None else min(61 - big, 126) for big in (big_k, big_v)]
    ok = [finite and (big is None or big <= 127) for big in (big_k, big_v)]
    return e[0], e[1], ok[0], ok[1]


@pytest.mark.parametrize("maxima", [
    (3.0, 4.5, 2.25),  # ordinary
    (1.0, 1.0, 1.0),  # exact powers of two: ceil(log2) is exact there
    (1e-30, 1e30, 3.0),  # extreme magnitudes, product in range
    (1e-30, 1e-30, 1e-30),  # a tiny bound: e clamped to 126
    (1e30, 1e30, 1e30),  # a bound beyond 2**127: refused
    (3e38, 1e-38, 1e-38),  # fp32's extremes
    (0.0, 2.0, 1.0),  # a zero maximum: the bound is zero
    (1.0, 0.0, 1.0),
    (1e-40, 5.0, 5.0),  # subnormal
    (float("inf"), 1.0, 1.0),  # non-finite inputs: refused
    (1.0, float("nan"), 1.0),
])
def test_fixed_point_exponents_against_numpy(maxima):
    """The device's exponents (exact integer arithmetic on the maxima's bits) against an
    exact rational reference, with the static part from the host, and the guarantee they
    stand for: the bound times 2**e stays below 2**61 whenever the bound is usable."""
    scale, n_pairs, head_dim = 0.0625, 3 * 37, 256
    bound_k, bound_v = spec.fixed_point_bounds(scale, n_pairs, head_dim)
    out = torch.full((4,), -999, dtype=torch.int32, device=DEVICE)
    _exponents_kernel[(1,)](torch.tensor(maxima, dtype=torch.float32, device=DEVICE), out, bound_k, bound_v)
    e_k, e_v, ok_k, ok_v = out.cpu().tolist()
    want = _exponents_ref(maxima, bound_k, bound_v)
    assert (bool(ok_k), bool(ok_v)) == want[2:]
    assert [e for e, ok in zip((e_k, e_v), want[2:]) if ok] == [e for e, ok in zip(want[:2], want[2:]) if ok]
    mq, mdo, mv = (Fraction(float(np.float32(m))) if np.isfinite(m) else None for m in maxima)
    if ok_k:
        bound = Fraction(scale) * 2 * n_pairs * head_dim * mq * mdo * mv
        assert bound * Fraction(2) ** e_k <= 2**61 and -66 <= e_k <= 126
    if ok_v:
        assert n_pairs * mdo * Fraction(2) ** e_v <= 2**61 and -66 <= e_v <= 126


def test_fixed_point_static_bounds_are_exact():
    """The host's ceil(log2(2 * scale * N * D)) and ceil(log2 N), exact for the fp32 scale
    (powers of two land exactly, one ulp more moves up), checked by rationals."""
    rng = _fresh_rng()
    cases = [(0.0625, 2**10, 256), (0.0625, 2**10 + 1, 256), (float(np.nextafter(np.float32(0.25), 1)), 8, 16),
             (1 / 3, 24, 40), (1e-30, 1, 1), (3e38, 2**20, 256)]
    cases += [(float(rng.uniform(1e-3, 10)), int(rng.integers(1, 10**6)), int(rng.integers(1, 300)))
              for _ in range(20)]
    for scale, n_pairs, head_dim in cases:
        bound_k, bound_v = spec.fixed_point_bounds(scale, n_pairs, head_dim)
        exact = Fraction(float(np.float32(scale))) * 2 * n_pairs * head_dim
        assert Fraction(2) ** (bound_k - 1) < exact <= Fraction(2) ** bound_k, (scale, n_pairs, head_dim)
        assert 2 ** (bound_v - 1) < n_pairs <= 2**bound_v
    for bad in ((0.0, 4, 4), (float("nan"), 4, 4), (1e-50, 4, 4), (1e39, 4, 4), (1.0, 0, 4)):
        with pytest.raises(ValueError):
            spec.fixed_point_bounds(*bad)


@triton.jit
def _add_fixed_kernel(X, ACC, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(X + i, mask=ok, other=0.0)
    acc = ACC.to(tl.pointer_type(tl.int64))
    add_fixed(acc + i, x, ok, INTERPRET)
    add_fixed(acc + i, x, ok, INTERPRET)  # twice: the second add lands on the first


def test_fixed_point_rounding_is_to_nearest_even():
    """``add_fixed`` rounds fp32 to the nearest int64, ties to even, at every magnitude
    (halves near 0, around 2**22 and 2**23 where fp32's spacing reaches 0.5 and 1, and
    large integers), and adds: two adds give twice the rounded value."""
    edges = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 3.7, -3.7, 2.0**22 + 0.5, 2.0**22 + 1.5, 2.0**22 + 1.0,
             -(2.0**22 + 0.5), -(2.0**22 + 1.0), 2.0**23 - 0.5, -(2.0**23 - 0.5), 2.0**23 - 1.5, 2.0**23 + 2.0,
             2.0**40 + 2.0**17, -(2.0**61), 0.0, -0.0, 1e-30]
    x = np.array(edges, dtype=np.float32)
    rng = _fresh_rng()
    x = np.concatenate([x, (rng.standard_normal(41) * 2.0 ** rng.integers(-3, 60, 41)).astype(np.float32)])
    acc = torch.zeros(x.size, 2, dtype=torch.int32, device=DEVICE)
    _add_fixed_kernel[(1,)](torch.from_numpy(x).to(DEVICE), acc, x.size, BLOCK=64,
                            INTERPRET=_triton_launch.interpreted())
    want = [2 * int(v) for v in np.rint(x.astype(np.float64))]  # numpy's rint: ties to even
    assert acc.cpu().view(torch.int64).flatten().tolist() == want


@pytest.mark.parametrize("which,factor", [("do", 1e-30), ("do", 1e30), ("q", 1e-30), ("v", 1e25)])
def test_fixed_point_extreme_magnitudes(which, factor):
    """Inputs scaled by 1e-30 / 1e30 (fp32): no overflow, the oracle's gradients."""
    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=20, top_k=2)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (4, 2), 16, "float32")
    inputs = dict(q=q, k=k, v=v, do=do)
    inputs[which] = (inputs[which] * factor).astype(np.float32).astype(np.float64)
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    got = _grads(q, k, v, problem.routes, 0.25, do, "float32", FP_SMALL)
    _assert_oracle(got, oracle_forward_backward(q, k, v, problem.routes, 0.25, do), "float32", which)


def test_fixed_point_refuses_a_bound_beyond_fp32():
    """|V| ~ 1e36: dK's bound exceeds 2**127, so dK is NaN (refused, never wrapped); dV,
    whose bound does not involve V, is right."""
    rng = _fresh_rng()
    problem = make_problem("padded", "random", seed=int(rng.integers(2**31)), seq_len=16, width=4)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (2, 1), 16, "float32")
    v = (v * 1e36).astype(np.float32).astype(np.float64)
    got = _grads(q, k, v, problem.routes, 0.25, do, "float32", FP_SMALL)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.25, do)
    assert torch.isnan(got[2]).all()
    assert relative_error(got[3].double().cpu().numpy(), want[3]) < TOLERANCE["float32"]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("where", ["q", "do", "routed_v", "routed_k"])
def test_fixed_point_nan_is_never_a_finite_number(where):
    """A NaN that the default backward carries into dK/dV (a routed row of Q, dO, K or V)
    makes the deterministic dK and dV NaN everywhere: it never becomes a finite number
    (the int64 sums cannot hold it, so the kernel flags it)."""
    rng = _fresh_rng()
    routes = random_routes(16, width=5, rng=rng)[None]
    routes[0, 3, 0] = 7  # row 3 routes key 7
    q, k, v, do = random_inputs(rng, routes, 16, (4, 2), 16, "float32")
    target = {"q": (q, (0, 3, 1, 5)), "do": (do, (0, 3, 1, 5)), "routed_v": (v, (0, 7, 0, 2)),
              "routed_k": (k, (0, 7, 0, 2))}
    array, index = target[where]
    array[index] = np.nan
    default = _grads(q, k, v, routes, 0.25, do, "float32", FP_SMALL, deterministic=False)
    got = _grads(q, k, v, routes, 0.25, do, "float32", FP_SMALL)
    assert torch.isnan(default[2]).any() or torch.isnan(default[3]).any()  # the default sees it too
    assert torch.isnan(got[2]).all() and torch.isnan(got[3]).all(), where
    assert torch.isnan(got[1][0, 3]).any()  # the row's own dq, as in the default backward


# ---------------------------------------------------------------- how the mode is selected
def _spy_backward(monkeypatch):
    """Records the ``deterministic`` argument of every backward launch."""
    seen = []
    original = _triton_launch.backward

    def spy(*args, deterministic=False, **kwargs):
        seen.append(deterministic)
        return original(*args, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(_triton_launch, "backward", spy)
    return seen


def test_global_flag_selects_the_fixed_point_backward_when_the_backward_runs(monkeypatch):
    """torch.use_deterministic_algorithms (warn-only too) selects the fixed-point backward,
    read when the backward runs, for the autograd function and the residual op pair;
    ``deterministic=True/False`` overrides it; a non-bool is a TypeError."""
    seen = _spy_backward(monkeypatch)
    rng = _fresh_rng()
    routes = random_routes(12, width=4, rng=rng)[None]
    q, k, v, do = random_inputs(rng, routes, 12, (2, 1), 16, "float32")
    t = lambda x: torch.tensor(x, dtype=torch.float32, device=DEVICE, requires_grad=True)  # noqa: E731
    r = torch.from_numpy(routes).to(DEVICE)
    grad = torch.tensor(do, dtype=torch.float32, device=DEVICE)

    def backward(deterministic=None, flag_during_backward=False, warn_only=False):
        out = triton_qsa.triton_sparse_gqa_attention(t(q), t(k), t(v), r, 0.3, block_sizes=FP_SMALL,
                                                     deterministic=deterministic)
        ctx = deterministic_algorithms(warn_only) if flag_during_backward else contextlib.nullcontext()
        with ctx:
            out.backward(grad)

    backward()
    backward(flag_during_backward=True)
    backward(flag_during_backward=True, warn_only=True)
    backward(deterministic=False, flag_during_backward=True)
    backward(deterministic=True)
    with deterministic_algorithms():  # on at the forward, off when the backward runs
        out = triton_qsa.triton_sparse_gqa_attention(t(q), t(k), t(v), r, 0.3, block_sizes=FP_SMALL)
    out.backward(grad)
    assert seen == [False, True, True, False, True, False]

    residuals = triton_qsa.forward_with_residuals(t(q), t(k), t(v), r, 0.3, block_sizes=FP_SMALL)
    args = (grad, t(q), t(k), t(v), *residuals, 0.3, routes.shape[2])
    seen.clear()
    plain = triton_qsa.backward_from_residuals(*args, block_sizes=FP_SMALL)
    with deterministic_algorithms():
        flagged = triton_qsa.backward_from_residuals(*args, block_sizes=FP_SMALL)
        forced_off = triton_qsa.backward_from_residuals(*args, block_sizes=FP_SMALL, deterministic=False)
    assert seen == [False, True, False]
    assert torch.equal(plain[0], flagged[0]) and torch.equal(plain[0], forced_off[0])  # dq: one kernel
    with pytest.raises(TypeError, match="deterministic"):
        triton_qsa.triton_sparse_gqa_attention(t(q), t(k), t(v), r, deterministic="yes")
    with pytest.raises(TypeError, match="deterministic"):
        triton_qsa.backward_from_residuals(*args, deterministic=1)


def test_dispatching_api_under_the_global_flag():
    """``qsa_torch.sparse_gqa_attention(backend="triton")`` under
    torch.use_deterministic_algorithms: while qsa_torch/api.py still marks the backend
    non-deterministic it refuses (RuntimeError); once it lets it through, the gradients
    are the oracle's and bitwise equal over two runs (the residual op pair reads the flag
    when its backward runs)."""
    from qsa_torch import api

    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=16, top_k=2)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (4, 2), 16, "float32")
    fn = lambda *a: api.sparse_gqa_attention(*a, backend="triton")  # noqa: E731
    with deterministic_algorithms():
        if not api.BACKENDS["triton"].deterministic_backward:
            with pytest.raises(RuntimeError, match="deterministic"):
                run_torch(fn, q, k, v, problem.routes, 0.3, do, "float32", device=DEVICE)
            return
        runs = [run_torch(fn, q, k, v, problem.routes, 0.3, do, "float32", device=DEVICE) for _ in range(2)]
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for g, w in zip(runs[0], want):
        assert relative_error(g, w) < TOLERANCE["float32"]
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


@functools.cache
def _gpu_problem():
    """(24, 2), D = 256, bf16, QSA routes at S = 4096 (packed), on the GPU, and the torch
    deterministic backward's gradients over three runs."""
    s = 4096
    problem = make_problem("packed", "qsa", seed=7, seq_len=s, top_k=256)
    routes = torch.from_numpy(problem.routes.astype(np.int32)).cuda()
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(1, s, h, 256, device="cuda", generator=g).to(torch.bfloat16) for h in (24, 2, 2, 24))

    def grads():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        with deterministic_algorithms():
            triton_qsa.triton_sparse_gqa_attention(*leaves, routes, 1 / 16).backward(do)
        return [x.grad for x in leaves]

    return problem, (q, k, v, do, routes), [grads() for _ in range(3)]


@pytest.mark.gpu
def test_gpu_fixed_point_bitwise_over_three_runs():
    """The default (tuned) tiling at (24, 2), D = 256, bf16, S = 4096 under
    torch.use_deterministic_algorithms: the same bits three times, within bf16 tolerance
    of the fp32 torch reference."""
    from qsa_torch import reference_sparse_gqa_attention

    _, (q, k, v, do, routes), runs = _gpu_problem()
    for run in runs[1:]:
        assert all(_bitwise_equal(a, b) for a, b in zip(run, runs[0]))
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    reference_sparse_gqa_attention(*leaves, routes, 1 / 16).backward(do.float())
    for got, ref in zip(runs[0], leaves):
        assert relative_error(got.double().cpu().numpy(), ref.grad.double().cpu().numpy()) < TOLERANCE["bfloat16"]


@pytest.mark.gpu
def test_gpu_fixed_point_jax_equals_torch_bitwise():
    """The same problem through ``qsa_jax``'s triton implementation (jax-triton) with
    ``deterministic=True``: the same bits three times, and torch's bits."""
    pytest.importorskip("jax_triton", reason="the JAX launch needs jax-triton (and a CUDA build of jax)")
    import jax
    import jax.numpy as jnp

    from qsa_jax import triton_qsa as jt

    problem, (q, k, v, do, _), torch_runs = _gpu_problem()
    jq, jk, jv, jdo = (jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16) for x in (q, k, v, do))
    jroutes = jnp.asarray(problem.routes.astype(np.int32))

    def loss(a, b, c):
        out = jt.triton_sparse_gqa_attention(a, b, c, jroutes, 1 / 16, deterministic=True)
        return jnp.sum(out.astype(jnp.float32) * jdo.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    runs = [[np.asarray(x).view(np.uint16) for x in grad(jq, jk, jv)] for _ in range(3)]
    for run in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(run, runs[0]))
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], torch_runs[0]):
        assert np.array_equal(a, b.cpu().view(torch.int16).numpy().view(np.uint16)), name


# =========================================================================================
# KV-owning: dK/dV from key-block programs over an inverse route index (qsa_triton.kv_backward)
# =========================================================================================
# ------------------------------------------------------------------------ the index
def _brute_force_index(routes: np.ndarray, kv_length: int, block_n: int):
    """Per (batch row, block): the list of (row, mask) pairs, straight from the sets."""
    table = membership(routes, kv_length)  # [B, S_q, S_kv]
    n_blocks = -(-kv_length // block_n)
    weights = np.array([1 << n for n in range(block_n)], dtype=object)
    index = []
    for b in range(table.shape[0]):
        for j in range(n_blocks):
            block = table[b, :, j * block_n:(j + 1) * block_n]
            rows = np.nonzero(block.any(1))[0]
            masks = [int((block[r] * weights[:block.shape[1]]).sum()) for r in rows]
            index.append(list(zip(rows.tolist(), masks)))
    return index


def _index_as_lists(index):
    start = index.start.cpu().tolist()
    rows = index.rows.cpu().tolist()
    bits = [b & (2**64 - 1) for b in index.bits.cpu().tolist()]  # bit 63 as unsigned
    return [list(zip(rows[a:z], bits[a:z])) for a, z in zip(start[:-1], start[1:])]


def _adversarial_batch(rng, b, s_q, kv_length, width, dtype):
    """Adversarial rows (duplicates, -1, past the end, huge int64, empty rows) with
    IDs in [0, kv_length), one all-padding row and two identical rows per batch row."""
    routes = np.stack([adversarial_routes(kv_length, width=width, rng=rng)[:s_q] for _ in range(b)])
    routes[:, -1] = -1
    routes[:, 1] = routes[:, 2]
    if dtype == torch.int32:
        routes = np.where(np.abs(routes) < 2**31, routes, -5)
    return torch.from_numpy(routes).to(dtype)


@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("route_dtype", [torch.int32, torch.int64])
def test_index_matches_brute_force(block_n, route_dtype):
    rng = _fresh_rng()
    s_q, kv_length = 23, 150  # S_q != S_kv, a partial last block
    routes = _adversarial_batch(rng, 2, s_q, kv_length, 9, route_dtype)
    # every row routes key 63 (bit 63 of a 64-key block, int64's sign bit) and key 0
    routes[0, :, 0], routes[1, :, 1] = 63, 0
    strided = torch.stack([routes, -routes], dim=3).flatten(2)[:, :, ::2]  # non-contiguous, same IDs
    for r in (routes, strided):
        index = build_inverse_index(r.to(DEVICE), kv_length, block_n)
        assert index.start.dtype == torch.int64 and index.rows.dtype == torch.int32
        assert _index_as_lists(index) == _brute_force_index(routes.numpy(), kv_length, block_n)
        _check_order(index)


def _check_order(index):
    """``order``: every segment once, by descending number of rows, ties ascending."""
    lengths = (index.start[1:] - index.start[:-1]).cpu().tolist()
    want = sorted(range(len(lengths)), key=lambda s: (-lengths[s], s))
    assert index.order.dtype == torch.int32 and index.order.cpu().tolist() == want


def test_index_of_qsa_and_random_routes():
    rng = _fresh_rng()
    for routes in (qsa_format_routes(96, top_k=6, rng=rng), random_routes(96, width=20, rng=rng)):
        routes = routes[None]
        index = build_inverse_index(torch.from_numpy(routes).to(DEVICE), 96, 32)
        assert _index_as_lists(index) == _brute_force_index(routes, 96, 32)
        _check_order(index)


def test_index_sort_per_batch_row_and_int64_keys(monkeypatch):
    """Sorts of single batch rows and int64 sort keys give the same index."""
    rng = _fresh_rng()
    routes = _adversarial_batch(rng, 3, 17, 70, 6, torch.int64).to(DEVICE)
    want = _brute_force_index(routes.cpu().numpy(), 70, 16)
    monkeypatch.setattr(det, "_MAX_SORT", 17 * 6)
    assert _index_as_lists(build_inverse_index(routes, 70, 16)) == want
    monkeypatch.setattr(det, "_MAX_INT32_KEY", 0)
    assert _index_as_lists(build_inverse_index(routes, 70, 16)) == want


def test_index_all_padding():
    routes = torch.tensor([[[-1, 5, 2**40], [-(2**62), 9, -1]]], dtype=torch.int64, device=DEVICE)
    index = build_inverse_index(routes, 5, 16)
    assert index.start.cpu().tolist() == [0, 0]


def test_index_rejects_bad_arguments():
    routes = torch.zeros(1, 4, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError):
        build_inverse_index(routes.float(), 8, 16)
    with pytest.raises(ValueError):
        build_inverse_index(routes[0], 8, 16)
    with pytest.raises(ValueError):
        build_inverse_index(routes, 0, 16)
    with pytest.raises(ValueError):
        build_inverse_index(routes, 8, 128)


# ------------------------------------------------------------------------- dK / dV
def _lse(q, k, routes, scale):
    """Float64 natural-log LSE ``[B, Hq, S_q]`` (inf for rows without routes)."""
    group = q.shape[2] // k.shape[2]
    mask = membership(routes, k.shape[1])[:, None]
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)
    scores = np.where(mask, scale * q.transpose(0, 2, 1, 3) @ kh.transpose(0, 1, 3, 2), -np.inf)
    top = scores.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(scores - top).sum(-1, keepdims=True)) + top)[..., 0]


def _inputs(rng, routes, kv_length, heads, head_dim, dtype, scale):
    """Torch q, k, v, dO, LSE, delta (as the forward hands them over) and the oracle's
    float64 dK, dV."""
    q, k, v, do = random_inputs(rng, routes, kv_length, heads, head_dim, dtype)
    out, _, dk, dv = oracle_forward_backward(q, k, v, routes, scale, do)
    tdtype = TORCH_DTYPES[dtype]
    t = lambda x: torch.tensor(x, dtype=tdtype, device=DEVICE)  # noqa: E731
    lse = torch.tensor(_lse(q, k, routes, scale), dtype=torch.float32, device=DEVICE)
    delta = attention_delta(t(out), t(do))
    return (t(q), t(k), t(v), t(do), lse, delta), (dk, dv)


def _check(routes, kv_length, heads, head_dim, dtype, blocks, rng, scale=None):
    scale = head_dim ** -0.5 if scale is None else scale
    args, want = _inputs(rng, routes, kv_length, heads, head_dim, dtype, scale)
    got = deterministic_dk_dv(*args, torch.from_numpy(routes).to(DEVICE), scale, block_sizes=blocks)
    for name, g, w, like in zip(("dk", "dv"), got, want, args[1:3]):
        assert g.dtype == like.dtype and g.shape == like.shape
        err = relative_error(g.double().cpu().numpy(), w)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3e} ({dtype})"
    return args, got


@pytest.fixture
def poisoned(monkeypatch):
    """Every uninitialised buffer starts as NaN / garbage: unwritten outputs and index
    slots read by mistake fail the comparison."""
    def buffer(shape, dtype, device):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.full(shape, -77777, dtype=dtype, device=device)

    monkeypatch.setattr(_triton_launch, "new_buffer", buffer)


@pytest.mark.parametrize("layout,family,heads,head_dim,dtype,blocks", [
    ("padded", "qsa", (4, 2), 16, "float32", SMALL),
    ("packed", "random", (12, 1), 24, "float32", KVBlockSizes(block_n=32, block_m=32)),
    ("cp", "adversarial", (10, 2), 40, "float32", KVBlockSizes(block_n=64, block_m=16)),
    ("padded", "adversarial", (3, 1), 16, "bfloat16", SMALL),
    ("packed", "qsa", (7, 1), 24, "bfloat16", KVBlockSizes(block_n=32, block_m=16)),
    ("cp", "random", (2, 2), 8, "float16", SMALL),
    ("padded", "random", (6, 6), 16, "bfloat16", KVBlockSizes(block_n=64, block_m=64)),
])
def test_dk_dv_against_oracle(poisoned, layout, family, heads, head_dim, dtype, blocks):
    """Layouts (padded rows all -1, packed documents, CP shards with S_q != S_kv), GQA
    groups 1..12 (non-powers of two), head dims that are not powers of two."""
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=48, width=12, top_k=2)
    _check(problem.routes, problem.kv_length, heads, head_dim, dtype, blocks, rng)


@pytest.mark.parametrize("group", [1, 5, 12])
def test_adversarial_route_sets(poisoned, group):
    """Duplicates, -1, past the end, huge int64, empty rows, identical rows, one row
    routed everywhere (a block's rows span many chunks), S_q != S_kv."""
    rng = _fresh_rng()
    s_q, kv_length = 21, 37
    routes = _adversarial_batch(rng, 2, s_q, kv_length, 8, torch.int64).numpy()
    wide = np.full((2, s_q, kv_length + 2), -1, dtype=np.int64)
    wide[..., :8] = routes
    wide[1, 3, :kv_length] = np.arange(kv_length)
    _check(wide, kv_length, (group, 1), 24, "float32", SMALL, rng, scale=0.3)


def test_every_row_identical():
    rng = _fresh_rng()
    routes = np.broadcast_to(np.array([0, 5, 31, 63, 64, 65, 70, -1, 5]), (1, 40, 9)).copy()
    _check(routes, 72, (6, 2), 16, "bfloat16", KVBlockSizes(block_n=64, block_m=16), rng)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy dots
def test_unrouted_kv_rows_may_hold_anything(poisoned):
    """K/V rows that no query routes to hold inf/NaN: the routed gradients are right
    and theirs are exactly zero."""
    rng = _fresh_rng()
    routes = random_routes(30, width=6, rng=rng)[None]
    routed = membership(routes, 30)[0].any(0)
    args, want = _inputs(rng, routes, 30, (4, 2), 16, "float32", 0.25)
    q, k, v, do, lse, delta = args
    k[0, ~torch.from_numpy(routed)] = float("inf")
    v[0, ~torch.from_numpy(routed)] = float("nan")
    dk, dv = deterministic_dk_dv(q, k, v, do, lse, delta, torch.from_numpy(routes).to(DEVICE), 0.25,
                                 block_sizes=SMALL)
    assert not routed.all()
    for g, w in zip((dk, dv), want):
        g = g.cpu().numpy()
        assert (g[0, ~routed] == 0).all()
        assert relative_error(g, w) < TOLERANCE["float32"]


def test_bitwise_reproducible():
    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=64, width=16, top_k=3)
    routes = torch.from_numpy(problem.routes).to(DEVICE)
    args, _ = _inputs(rng, problem.routes, problem.kv_length, (12, 1), 24, "bfloat16", 0.2)
    blocks = KVBlockSizes(block_n=32, block_m=16)
    with deterministic_algorithms():
        runs = [deterministic_dk_dv(*args, routes, 0.2, block_sizes=blocks) for _ in range(3)]
        index = build_inverse_index(routes, problem.kv_length, 32)
        runs.append(deterministic_dk_dv(*args, routes, 0.2, block_sizes=blocks, index=index))
    for dk, dv in runs[1:]:
        assert torch.equal(dk.view(torch.int16), runs[0][0].view(torch.int16))
        assert torch.equal(dv.view(torch.int16), runs[0][1].view(torch.int16))


def test_strided_inputs():
    """Views with any strides (transposed heads/rows, sliced head dim, routes slice)."""
    rng = _fresh_rng()
    routes = random_routes(20, width=5, rng=rng)[None]
    args, want = _inputs(rng, routes, 20, (6, 3), 16, "float32", 0.25)
    q, k, v, do, lse, delta = args
    spread = lambda x: torch.stack([x, -x], dim=-1).flatten(-2)[..., ::2]  # noqa: E731
    q, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, do))
    k, v = spread(k), spread(v)
    lse_t = lse.transpose(1, 2).contiguous().transpose(1, 2)
    r = spread(torch.from_numpy(routes)).to(DEVICE)
    got = deterministic_dk_dv(q, k, v, do, lse_t, delta, r, 0.25, block_sizes=SMALL)
    for g, w in zip(got, want):
        assert relative_error(g.cpu().numpy(), w) < TOLERANCE["float32"]


def test_after_the_triton_forward():
    """The forward's own out/LSE (+inf LSE for rows without routes), into this backward:
    the oracle's gradients, and the fused atomic backward's within rounding."""
    from qsa_torch import triton_qsa

    rng = _fresh_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=32, width=8)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (6, 2), 24, "float32")
    _, _, dk_want, dv_want = oracle_forward_backward(q, k, v, problem.routes, 0.2, do)
    t = lambda x: torch.tensor(x, dtype=torch.float32, device=DEVICE)  # noqa: E731
    routes = torch.from_numpy(problem.routes).to(DEVICE)
    out, lse, *_ = triton_qsa.forward_with_residuals(t(q), t(k), t(v), routes, 0.2)
    dk, dv = deterministic_dk_dv(t(q), t(k), t(v), t(do), lse, attention_delta(out, t(do)), routes, 0.2,
                                 block_sizes=SMALL)
    for g, w in zip((dk, dv), (dk_want, dv_want)):
        assert relative_error(g.cpu().numpy(), w) < TOLERANCE["float32"]


def test_launch_falls_back_where_shared_memory_is_short(monkeypatch):
    """A tiling the device cannot load (Triton's OutOfResources) is retried with one
    stage, then narrower row chunks; what loaded is remembered; other errors propagate."""
    class OutOfResources(Exception):
        pass

    calls = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(**kwargs):
                calls.append((kwargs["BLOCK_M"], kwargs["num_stages"]))
                if kwargs["BLOCK_M"] > 32:
                    raise OutOfResources("shared memory")
            return launch

    monkeypatch.setattr(det, "_FITTING", {})
    blocks = KVBlockSizes(block_n=32, block_m=128, num_stages=2)
    det._launch(Kernel(), (1,), {}, dict(D_PAD=256), blocks, torch.device("cpu"))
    assert calls == [(128, 2), (128, 1), (64, 1), (32, 1)]
    det._launch(Kernel(), (1,), {}, dict(D_PAD=256), blocks, torch.device("cpu"))
    assert calls[4:] == [(32, 1)]

    class Broken:
        def __getitem__(self, grid):
            def launch(**kwargs):
                raise RuntimeError("not a resource problem")
            return launch

    with pytest.raises(RuntimeError, match="not a resource"):
        det._launch(Broken(), (1,), {}, dict(D_PAD=128), blocks, torch.device("cpu"))


def test_rejects_bad_inputs():
    rng = _fresh_rng()
    routes = random_routes(8, width=3, rng=rng)[None]
    args, _ = _inputs(rng, routes, 8, (4, 2), 16, "float32", 0.25)
    q, k, v, do, lse, delta = args
    r = torch.from_numpy(routes).to(DEVICE)
    call = lambda *a, **kw: deterministic_dk_dv(*a, **kw)  # noqa: E731
    with pytest.raises(TypeError):  # grad_out dtype
        call(q, k, v, do.double(), lse, delta, r)
    with pytest.raises(ValueError):  # grad_out shape
        call(q, k, v, do[:, :4], lse, delta, r)
    with pytest.raises(TypeError):  # LSE dtype
        call(q, k, v, do, lse.double(), delta, r)
    with pytest.raises(ValueError):  # delta shape
        call(q, k, v, do, lse, delta.transpose(1, 2), r)
    with pytest.raises(TypeError):  # float routes
        call(q, k, v, do, lse, delta, r.float())
    with pytest.raises(ValueError):  # non-positive scale
        call(q, k, v, do, lse, delta, r, -1.0)
    with pytest.raises(TypeError):
        call(q, k, v, do, lse, delta, r, block_sizes=(16, 16))
    with pytest.raises(ValueError):  # an index of another block size
        call(q, k, v, do, lse, delta, r, block_sizes=SMALL, index=build_inverse_index(r, 8, 32))
    wide = torch.zeros(1, 8, 4, 320, device=DEVICE)
    with pytest.raises(ValueError):  # D > 256
        call(wide, wide[:, :, :2], wide[:, :, :2], wide, lse, delta, r)
    with pytest.raises(ValueError):
        KVBlockSizes(block_n=128)
    with pytest.raises(ValueError):
        KVBlockSizes(block_m=24)


@pytest.mark.gpu
def test_gpu_model_shapes_bitwise_and_against_reference():
    """(24, 2), D = 256, bf16, QSA routes at S = 2048 with the default tiling: bitwise
    equal over 3 runs, and within bf16 tolerance of the fp32 torch reference."""
    from qsa_torch import reference_sparse_gqa_attention, triton_qsa

    problem = make_problem("packed", "qsa", seed=5, seq_len=2048, top_k=64)
    routes = torch.from_numpy(problem.routes.astype(np.int32)).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(1, 2048, h, 256, device="cuda", generator=g).to(torch.bfloat16)
                   for h in (24, 2, 2, 24))
    out, lse, *_ = triton_qsa.forward_with_residuals(q, k, v, routes, 1 / 16)
    delta = attention_delta(out, do)
    with deterministic_algorithms():
        runs = [deterministic_dk_dv(q, k, v, do, lse, delta, routes, 1 / 16) for _ in range(3)]
    for dk, dv in runs[1:]:
        assert torch.equal(dk.view(torch.int16), runs[0][0].view(torch.int16))
        assert torch.equal(dv.view(torch.int16), runs[0][1].view(torch.int16))
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    reference_sparse_gqa_attention(*leaves, routes, 1 / 16).backward(do.float())
    for got, want in zip(runs[0], (leaves[1].grad, leaves[2].grad)):
        err = relative_error(got.double().cpu().numpy(), want.double().cpu().numpy())
        assert err < TOLERANCE["bfloat16"], err
