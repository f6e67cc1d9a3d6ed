"""The Triton backend's deterministic backward, against the float64 oracle: the fused
backward with int64 fixed-point dK/dV atomics (``qsa_triton.fixed_point``), the backend's
deterministic mode (``deterministic=True``, or ``torch.use_deterministic_algorithms``).

Without a CUDA GPU the kernels run in Triton's interpreter on CPU tensors (this module
sets TRITON_INTERPRET=1 before triton is first imported, as test_triton_qsa does).
Shapes are tiny.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
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

from qsa_common.generators import adversarial_routes, random_routes  # noqa: E402
from qsa_common.layouts import make_problem  # noqa: E402
from qsa_common.oracle import oracle_forward_backward, relative_error  # noqa: E402
from qsa_torch import _triton_launch, triton_qsa  # noqa: E402
from qsa_triton import driver  # noqa: E402
from qsa_triton import launch as spec  # noqa: E402
from qsa_triton.config import BlockSizes  # noqa: E402
from qsa_triton.fixed_point import add_fixed, fixed_point_exponents  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def test_kernels_run_here():
    """On CPU the interpreter must be on (else TRITON_INTERPRET was set too late)."""
    interpreted = _triton_launch.interpreted()
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


@pytest.fixture
def shuffled_programs(monkeypatch):
    """Every interpreted launch runs its programs in a fresh random order (one permutation
    of its grid per launch), as a GPU may schedule them; yields the orders run. Triton's
    interpreter otherwise runs them in one fixed order, under which repeated runs agree
    whatever the backward adds. Test-only: it wraps the interpreter's grid-index setter
    (``GridExecutor`` sets the grid, then each program's index, in order). Compiled
    kernels: None, nothing changed (the GPU schedules the programs itself)."""
    if not _triton_launch.interpreted():
        yield None
        return
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is None or not hasattr(builder, "set_grid_dim") or not hasattr(builder, "set_grid_idx"):
        pytest.skip("this triton's interpreter sets program indices differently")
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    orders, position = [], [0]

    def shuffled_dim(nx, ny, nz):
        set_dim(nx, ny, nz)
        grid = list(itertools.product(range(nx), range(ny), range(nz)))
        orders.append([grid[i] for i in rng.permutation(len(grid))])
        position[0] = 0

    def shuffled_idx(x, y, z):
        set_idx(*orders[-1][position[0]])
        position[0] += 1

    monkeypatch.setattr(builder, "set_grid_dim", shuffled_dim)
    monkeypatch.setattr(builder, "set_grid_idx", shuffled_idx)
    yield orders


@pytest.mark.parametrize("heads, blocks", [((6, 2), FP_SMALL), ((12, 1), FP_FLAT)])
def test_fixed_point_bits_survive_shuffled_program_orders(shuffled_programs, heads, blocks):
    """Bitwise reproducibility the interpreter can disprove: every launch's programs run in
    a new random order (:func:`shuffled_programs`). The fixed-point backward gives the same
    bits under every order; the fp32-atomic backward, over keys that every tile routes to,
    gives different dK/dV bits under some of the orders (so the shuffle reaches the adds
    this test is about, and a backward that ignored ``deterministic=True`` would fail)."""
    if shuffled_programs is None:
        pytest.skip("compiled kernels: the gpu tests prove reproducibility under the GPU's own schedules")
    rng = _fresh_rng()
    s_q, kv_length = 32, 6
    routes = np.stack([rng.permutation(kv_length) for _ in range(s_q)])[None]  # every row: every key
    q, k, v, do = random_inputs(rng, routes, kv_length, heads, 16, "float32")
    fixed = [_grads(q, k, v, routes, 0.3, do, "float32", blocks) for _ in range(3)]
    assert len({tuple(order) for order in shuffled_programs}) > 1  # the orders differ
    _assert_oracle(fixed[0], oracle_forward_backward(q, k, v, routes, 0.3, do), "float32")
    for run in fixed[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), run, fixed[0]):
            assert _bitwise_equal(a, b), f"{name}: the fixed-point backward's bits depend on the programs' order"
    atomic = [_grads(q, k, v, routes, 0.3, do, "float32", blocks, deterministic=False) for _ in range(4)]
    assert all(_bitwise_equal(run[1], atomic[0][1]) for run in atomic)  # dQ: no atomics, one order
    assert any(not (_bitwise_equal(run[2], atomic[0][2]) and _bitwise_equal(run[3], atomic[0][3]))
               for run in atomic[1:]), "fp32 atomic dK/dV did not change with the programs' order"


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
def test_fixed_point_against_the_oracle_and_bitwise(poisoned_launch, shuffled_programs, layout, family, heads, dtype,
                                                    blocks):
    """Layouts (padded rows all -1, packed documents, CP shards with S_q != S_kv), G in
    {1, 3, 12}, flat and padded programs: dq/dk/dv against the float64 oracle, the same
    bits over three runs (each launch's programs in a new order on CPU:
    :func:`shuffled_programs`), and within rounding of the default (atomic fp32) backward."""
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
    from qsa_triton.plan import make_plan

    rng = _fresh_rng()
    bsz, s_q, kv_length = 5, 12, 20
    routes = rng.integers(-2, kv_length + 3, size=(bsz, s_q, 9))
    q, k, v, _ = random_inputs(rng, routes, kv_length, (6, 2), 16, "float32")
    do = np.ones_like(q)  # what out.sum().backward() hands in
    r = torch.from_numpy(routes).to(DEVICE)

    def run(plan, strided):  # the driver under an explicit plan, as the op pair runs it
        ad = _triton_launch.adapter(DEVICE)
        args = [torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k, v)]
        args = [x.transpose(1, 2).contiguous().transpose(1, 2) if strided else x for x in args]
        unions = driver.build_unions(ad, r, kv_length, plan)
        out, lse = driver.forward(ad, *args, unions, 0.3, plan)
        grad = torch.ones((), device=DEVICE).expand_as(out) if strided else torch.ones_like(out)
        return driver.backward(ad, *args, out, lse, grad, driver.backward_unions(ad, unions, plan, 9, s_q), 0.3, plan,
                               deterministic=True)

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
    """A NaN that the default backward carries into dK/dV stays NaN in the deterministic
    dK and dV (the int64 sums cannot hold it, so the kernel flags it): one in a routed row
    of Q or dO exactly at the (key, KV head) rows that row routes, every lane, the rest
    finite and within rounding of the default backward; one in a routed K or V row at
    least wherever the default backward has one."""
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
    for g, d in zip(got[2:], default[2:]):
        assert not (torch.isnan(d) & ~torch.isnan(g)).any(), where
    assert torch.isnan(got[1][0, 3]).any()  # the row's own dq, as in the default backward
    if where in ("q", "do"):  # pair (row 3, head 1) of KV head 0
        keys = torch.zeros(got[2].shape, dtype=torch.bool, device=got[2].device)
        keys[0, sorted({int(r) for r in routes[0, 3] if 0 <= r < 16}), 0] = True
        for name, g, d in zip(("dk", "dv"), got[2:], default[2:]):
            assert torch.equal(torch.isnan(g), keys), f"{name}: NaN off the poisoned row's keys"
            assert torch.equal(torch.isnan(d), keys), f"default {name}: NaN off the poisoned row's keys"
            err = relative_error(g[~keys].double().cpu().numpy(), d[~keys].double().cpu().numpy())
            assert err < TOLERANCE["float32"], name


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
def test_fixed_point_confined_nan_bits_survive_shuffled_program_orders(shuffled_programs):
    """A NaN in a routed dO row and one in another row's q: the flagged dK/dV rows and
    the finite sums elsewhere are the same bits under every order of the programs."""
    if shuffled_programs is None:
        pytest.skip("compiled kernels: the gpu tests prove reproducibility under the GPU's own schedules")
    rng = _fresh_rng()
    routes = random_routes(24, width=5, rng=rng)[None]
    q, k, v, do = random_inputs(rng, routes, 24, (6, 2), 16, "float32")
    do[0, 9, 4, 3], q[0, 17, 0, 6] = np.nan, np.nan
    runs = [_grads(q, k, v, routes, 0.3, do, "float32", FP_SMALL) for _ in range(3)]
    assert len({tuple(order) for order in shuffled_programs}) > 1
    keys = torch.zeros(runs[0][2].shape, dtype=torch.bool, device=runs[0][2].device)
    for row, kv_head in ((9, 1), (17, 0)):
        keys[0, sorted({int(r) for r in routes[0, row] if 0 <= r < 24}), kv_head] = True
    for run in runs:
        assert torch.equal(torch.isnan(run[2]), keys) and torch.equal(torch.isnan(run[3]), keys)
        assert all(_bitwise_equal(a, b) for a, b in zip(run[1:], runs[0][1:]))


# ---------------------------------------------------------------- how the mode is selected
def _spy_backward(monkeypatch):
    """Records the ``deterministic`` argument of every backward launch."""
    seen = []
    original = driver.backward

    def spy(*args, deterministic=False, **kwargs):
        seen.append(deterministic)
        return original(*args, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(driver, "backward", spy)
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
    torch.use_deterministic_algorithms (``deterministic=None`` reads the flag): the
    gradients are the oracle's and bitwise equal over two runs."""
    from qsa_torch import api

    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=16, top_k=2)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (4, 2), 16, "float32")
    fn = lambda *a: api.sparse_gqa_attention(*a, backend="triton")  # noqa: E731
    with deterministic_algorithms():
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
    ``deterministic=True``: the forward output has torch's bits, and the gradients the same
    bits three times, and torch's bits (each failure says how many elements differ)."""
    from qsa_jax import _triton_call

    try:  # through qsa_jax's loader, which keeps Triton's cache directory (a plain import empties it)
        _triton_call.jax_triton()
    except ImportError as err:
        pytest.skip(f"the JAX launch needs jax-triton (and a CUDA build of jax): {err}")
    import jax
    import jax.numpy as jnp

    from qsa_jax import triton_qsa as jt

    problem, (q, k, v, do, routes), torch_runs = _gpu_problem()
    jq, jk, jv, jdo = (jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16) for x in (q, k, v, do))
    jroutes = jnp.asarray(problem.routes.astype(np.int32))

    def bits(x):
        return x.cpu().view(torch.int16).numpy().view(np.uint16)

    def differing(name, a, b):
        return f"{name}: {int(np.sum(a != b))} of {a.size} elements differ"

    with torch.no_grad():
        torch_out = bits(triton_qsa.triton_sparse_gqa_attention(q, k, v, routes, 1 / 16))
    jax_out = np.asarray(jax.jit(lambda a, b, c: jt.triton_sparse_gqa_attention(a, b, c, jroutes, 1 / 16))(
        jq, jk, jv)).view(np.uint16)
    assert np.array_equal(jax_out, torch_out), differing("forward output, JAX against torch", jax_out, torch_out)

    def loss(a, b, c):
        out = jt.triton_sparse_gqa_attention(a, b, c, jroutes, 1 / 16, deterministic=True)
        return jnp.sum(out.astype(jnp.float32) * jdo.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    runs = [[np.asarray(x).view(np.uint16) for x in grad(jq, jk, jv)] for _ in range(3)]
    for i, run in enumerate(runs[1:], start=2):
        for name, a, b in zip(("dq", "dk", "dv"), run, runs[0]):
            assert np.array_equal(a, b), differing(f"{name}, JAX run {i} against run 1", a, b)
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], torch_runs[0]):
        assert np.array_equal(a, bits(b)), differing(f"{name}, JAX against torch", a, bits(b))
