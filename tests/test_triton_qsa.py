"""The token-gather Triton backend against the float64 oracle.

Without a CUDA GPU the kernels run in Triton's interpreter on CPU tensors: this
module sets TRITON_INTERPRET=1 for its process before the backend first loads
its kernels (Triton reads it when a kernel is decorated). It is left set: on a
machine without a GPU nothing else can run Triton kernels, and Triton's own
helpers decorated under it must keep it. With a GPU the same tests run the
compiled kernels on CUDA. Shapes are tiny: the interpreter runs every program
in Python.
"""

from __future__ import annotations

import dataclasses
import os
import sys

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
from qsa_common.oracle import membership, oracle_forward_backward, relative_error  # noqa: E402
from qsa_torch import triton_qsa  # noqa: E402
from qsa_torch.routes import normalize_routes, to_torch_routes  # noqa: E402
from qsa_torch.triton_qsa import (  # noqa: E402
    BlockSizes,
    build_tile_unions,
    _split_tile_unions,
    triton_sparse_gqa_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _chunk_atomic_add_kernel(IDS, VALS, OUT, BLOCK: tl.constexpr, D: tl.constexpr):
    """Each program adds a [BLOCK, D] chunk to rows IDS[pid] (distinct; -1 masked out)."""
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    ids = tl.load(IDS + pid * BLOCK + r)
    ok = ids >= 0
    vals = tl.load(VALS + (pid * BLOCK + r[:, None]) * D + d[None, :])
    rows = tl.where(ok, ids, 0)
    tl.atomic_add(OUT + rows[:, None] * D + d[None, :], vals, mask=ok[:, None], sem="relaxed")


# small tiles so that every tile walks several union chunks
SMALL = BlockSizes(block_m=16, block_k=16, num_warps=1, num_stages=1,
                   backward_block_m=16, backward_block_k=16, backward_num_warps=1,
                   backward_num_stages=1)


# the contract matrix: tiles of 16 rows (group 2) or 8 rows (group 3 padded to 4)
MEDIUM = BlockSizes(block_m=32, block_k=32, num_warps=2, num_stages=1,
                    backward_block_m=32, backward_block_k=16, backward_num_warps=2,
                    backward_num_stages=1)


def _fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def test_kernels_run_here():
    """On CPU the interpreter must be on (else TRITON_INTERPRET was set too late)."""
    _, interpreted = triton_qsa._load_kernels()
    assert interpreted or DEVICE == "cuda", "kernels were compiled, not interpreted, on a CPU machine"


class TestTritonContract(UnroutedRowsIsolated, BackendContract):
    dtypes = ("float32", "bfloat16")
    heads = ((4, 2), (6, 2))  # group 2 and a group of 3 padded to 4

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        fn = lambda *a: triton_sparse_gqa_attention(*a, block_sizes=MEDIUM)  # noqa: E731
        return run_torch(fn, q, k, v, routes, scale, grad_out, dtype, device=DEVICE)


def _check_against_oracle(routes, kv_length, heads, head_dim, dtype, blocks, rng, scale=None):
    q, k, v, do = random_inputs(rng, routes, kv_length, heads, head_dim, dtype)
    scale = head_dim ** -0.5 if scale is None else scale
    fn = lambda *a: triton_sparse_gqa_attention(*a, block_sizes=blocks)  # noqa: E731
    got = run_torch(fn, q, k, v, routes, scale, do, dtype, device=DEVICE)
    want = oracle_forward_backward(q, k, v, routes, scale, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = relative_error(g, w)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3e}"
    return got


@pytest.mark.parametrize("layout,family,heads,head_dim,blocks", [
    # MHA: 32 rows per tile and every row routed, so bit 31 (int32's sign bit) of rowbits is used
    ("packed", "random", (2, 2), 16,
     BlockSizes(block_m=32, block_k=32, backward_block_m=32, backward_block_k=16)),
    # 12:1 padded to 16 heads; the backward splits each tile's heads over 2 programs
    ("cp", "adversarial", (12, 1), 24,
     BlockSizes(block_m=32, block_k=16, backward_block_m=16, backward_block_k=32, backward_rows_per_tile=2)),
    # the same by default: backward tiles of 1 row x 16 heads cut from 2-row tiles
    ("padded", "adversarial", (12, 1), 24,
     BlockSizes(block_m=32, block_k=16, backward_block_m=16, backward_block_k=32)),
    # a group wider than block_m: two head chunks per tile, one row per tile
    ("cp", "adversarial", (32, 1), 8,
     BlockSizes(block_m=16, block_k=16, backward_block_m=16, backward_block_k=16)),
])
def test_tilings_head_groups_and_odd_head_dims(layout, family, heads, head_dim, blocks):
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=40, width=10)
    _check_against_oracle(problem.routes, problem.kv_length, heads, head_dim, "float32", blocks, rng)


def test_float16_qsa_routes():
    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=48, top_k=3)
    _check_against_oracle(problem.routes, problem.kv_length, (4, 1), 32, "float16", SMALL, rng)


def _to_cpu(unions):
    return triton_qsa.TileUnions(unions.union.cpu(), unions.count.cpu(), unions.rowbits.cpu(),
                                 unions.rows_per_tile)


def _brute_force_unions(routes: np.ndarray, kv_length: int, rows_per_tile: int):
    """Per (batch, tile): the sorted set of valid IDs and, per ID, the bitmask of rows."""
    member = membership(routes, kv_length)  # [B, S_q, S_kv]
    b, s_q, _ = member.shape
    n_tiles = -(-s_q // rows_per_tile)
    result = {}
    for bi in range(b):
        for tile in range(n_tiles):
            rows = member[bi, tile * rows_per_tile:(tile + 1) * rows_per_tile]
            ids = np.nonzero(rows.any(0))[0]
            bits = [sum(1 << t for t in range(rows.shape[0]) if rows[t, i]) for i in ids]
            result[bi, tile] = (ids, bits)
    return result


@pytest.mark.parametrize("triton_unions", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("rows_per_tile", [1, 4, 32])
def test_tile_unions_match_brute_force(monkeypatch, rows_per_tile, triton_unions):
    """Both implementations of the steps after the sort (Triton kernel, torch ops)."""
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "triton_unions", triton_unions)
    rng = _fresh_rng()
    kv_length, width = 50, 9
    routes = np.concatenate([
        adversarial_routes(kv_length, width=width, rng=rng)[None, :45],
        random_routes(kv_length, width=width, rng=rng, causal=False)[None, :45],
    ])
    raw = torch.from_numpy(routes).to(DEVICE)
    unions = _to_cpu(build_tile_unions(raw, kv_length, rows_per_tile))
    # canonical routes (the references' form) and a strided view give the same unions
    canonical = _to_cpu(build_tile_unions(normalize_routes(raw, kv_length), kv_length, rows_per_tile))
    strided_view = raw.repeat_interleave(2, dim=2)[..., ::2]
    assert not strided_view.is_contiguous()
    strided = _to_cpu(build_tile_unions(strided_view, kv_length, rows_per_tile))
    for other in (canonical, strided):
        assert torch.equal(other.union, unions.union) and torch.equal(other.count, unions.count)
        assert torch.equal(other.rowbits, unions.rowbits)
    expect = _brute_force_unions(routes, kv_length, rows_per_tile)
    n_tiles = -(-45 // rows_per_tile)
    union_width = min(rows_per_tile * width, kv_length)
    assert unions.union.shape == unions.rowbits.shape == (2, n_tiles, union_width)
    assert unions.count.shape == (2, n_tiles) and unions.union.dtype == torch.int32
    for (bi, tile), (ids, bits) in expect.items():
        n = int(unions.count[bi, tile])
        assert n == len(ids)
        assert unions.union[bi, tile, :n].tolist() == ids.tolist()
        assert np.all(unions.union[bi, tile, n:].numpy() == -1)
        got_bits = unions.rowbits[bi, tile, :n].numpy().astype(np.int64) & 0xFFFFFFFF
        assert got_bits.tolist() == bits


def test_tile_unions_with_wide_keys():
    """kv_length * T past int32 range: the sort keys switch to int64."""
    rng = _fresh_rng()
    kv_length = 2**27
    routes = rng.integers(-5, kv_length + 5, size=(1, 70, 6))
    routes[0, 3] = routes[0, 2]  # two identical rows
    routes[0, 5, 1] = routes[0, 5, 0]  # a repeated ID within a row
    routes[0, 7, :3] = kv_length - 1
    unions = _to_cpu(build_tile_unions(torch.from_numpy(routes).to(DEVICE), kv_length, 32))
    valid = (routes >= 0) & (routes < kv_length)
    for tile in range(3):
        rows = slice(32 * tile, 32 * tile + 32)
        ids = np.unique(routes[0, rows][valid[0, rows]])
        n = int(unions.count[0, tile])
        assert unions.union[0, tile, :n].tolist() == ids.tolist()
        block = routes[0, rows]
        bits = [sum(1 << t for t in range(block.shape[0]) if x in block[t]) for x in ids]
        assert (unions.rowbits[0, tile, :n].numpy().astype(np.int64) & 0xFFFFFFFF).tolist() == bits


def test_atomic_chunk_adds_are_exact_in_interpreter():
    """Chunks of distinct rows added by many programs: equal to a sequential sum."""
    rng = np.random.default_rng()
    programs, block, d, rows = 6, 16, 16, 20
    ids = np.stack([rng.permutation(rows)[:block] for _ in range(programs)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.25] = -1
    vals = rng.standard_normal((programs, block, d)).astype(np.float32)
    out = torch.zeros(rows, d, device=DEVICE)
    _chunk_atomic_add_kernel[(programs,)](torch.from_numpy(ids).to(DEVICE),
                                          torch.from_numpy(vals).to(DEVICE), out, BLOCK=block, D=d)
    want = np.zeros((rows, d), dtype=np.float64)
    for p in range(programs):
        for r in range(block):
            if ids[p, r] >= 0:
                want[ids[p, r]] += vals[p, r]
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-6, atol=1e-6)


def test_poisoned_outputs_are_fully_overwritten(monkeypatch):
    """Output, LSE and dq buffers start as NaN: every element must be written."""
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_qsa, "_new_buffer", poisoned)
    rng = _fresh_rng()
    # 37 rows: the last tile is partial; (6, 2) pads 3 heads to 4
    routes = adversarial_routes(37, width=8, rng=rng)[None]
    got = _check_against_oracle(routes, 37, (6, 2), 16, "float32", SMALL, rng)
    empty = ~membership(routes, 37).any(-1)[0]
    assert empty.any() and np.all(got[0][0, empty] == 0.0) and np.all(got[1][0, empty] == 0.0)


def test_all_rows_empty():
    rng = _fresh_rng()
    routes = np.full((2, 9, 5), -1, dtype=np.int64)
    routes[1, :, 2] = 9 + np.arange(9)  # out of range only
    got = _check_against_oracle(routes, 9, (2, 1), 16, "bfloat16", SMALL, rng)
    for g in got:
        assert np.all(g == 0.0)


def test_non_contiguous_inputs_and_grad():
    rng = _fresh_rng()
    problem = make_problem("padded", "qsa", seed=int(rng.integers(2**31)), seq_len=24, top_k=2)
    q, k, v, do = random_inputs(rng, problem.routes, 24, (4, 2), 16, "float32")
    # [B,S,H,D] views over [B,H,S,D] storage; routes a strided slice; grad_out strided
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3).copy(), dtype=torch.float32, device=DEVICE)
                  .transpose(1, 2)
                  for x in (q, k, v))
    wide = torch.from_numpy(np.repeat(problem.routes, 2, axis=-1)).to(DEVICE)
    routes = wide[..., ::2]
    grad = torch.tensor(np.concatenate([do, 0 * do], axis=-1), dtype=torch.float32, device=DEVICE)[..., :16]
    assert not tq.is_contiguous() and not routes.is_contiguous() and not grad.is_contiguous()
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    out = triton_sparse_gqa_attention(tq, tk, tv, routes, block_sizes=SMALL)
    out.backward(grad)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.25, do)
    for got, ref in zip((out, tq.grad, tk.grad, tv.grad), want):
        assert relative_error(got.detach().double().cpu().numpy(), ref) < 1e-5


def test_int32_and_int64_routes_agree():
    rng = _fresh_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=20,
                           width=8, batch=2)
    q, k, v, do = random_inputs(rng, problem.routes, 20, (2, 1), 16, "float32")
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    results = []
    for dtype in (torch.int64, torch.int32):
        routes = to_torch_routes(problem, dtype=dtype, device=DEVICE)
        fn = lambda q_, k_, v_, _r, s: triton_sparse_gqa_attention(  # noqa: E731
            q_, k_, v_, routes, s, block_sizes=SMALL)
        results.append(run_torch(fn, q, k, v, problem.routes, 0.3, do, "float32", device=DEVICE))
        for got, ref in zip(results[-1], want):
            assert relative_error(got, ref) < 1e-5
    # the same unions, so the same out and dq bit for bit; dk/dv come from fp32 atomics,
    # whose order (and so last bits) varies from run to run on a GPU
    for a, b in zip(results[0][:2], results[1][:2]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(results[0][2:], results[1][2:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _small_tensors(dtype=torch.float32, head_dim=16, device=DEVICE):
    q = torch.randn(1, 4, 2, head_dim, dtype=dtype, device=device)
    k = torch.randn(1, 6, 1, head_dim, dtype=dtype, device=device)
    return q, k, k.clone(), torch.zeros(1, 4, 3, dtype=torch.int64, device=device)


def test_bad_input_raises_contract_errors():
    q, k, v, r = _small_tensors()
    with pytest.raises(TypeError, match="query"):
        triton_sparse_gqa_attention(q.double(), k.double(), v.double(), r)
    with pytest.raises(TypeError, match="selected_token_ids"):
        triton_sparse_gqa_attention(q, k, v, r.float())
    with pytest.raises(ValueError, match="query heads"):
        triton_sparse_gqa_attention(q, k.expand(1, 6, 3, 16), v.expand(1, 6, 3, 16), r)
    with pytest.raises(ValueError, match="softmax_scale"):
        triton_sparse_gqa_attention(q, k, v, r, -1.0)
    with pytest.raises(ValueError, match="head dim"):
        triton_sparse_gqa_attention(*_small_tensors(head_dim=264))
    with pytest.raises(TypeError, match="block_sizes"):
        triton_sparse_gqa_attention(q, k, v, r, block_sizes=(64, 32))
    with pytest.raises(ValueError, match="block_k"):
        BlockSizes(block_k=48)
    with pytest.raises(ValueError, match="num_warps"):
        BlockSizes(num_warps=0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    kernels, _ = triton_qsa._load_kernels()
    monkeypatch.setattr(triton_qsa, "_load_kernels", lambda: (kernels, False))
    with pytest.raises(ValueError, match="CUDA"):
        triton_sparse_gqa_attention(*_small_tensors(device="cpu"))


def test_missing_triton_raises_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "qsa_torch._triton_kernels")
    triton_qsa._load_kernels.cache_clear()
    try:
        with pytest.raises(ImportError, match="triton"):
            triton_sparse_gqa_attention(*_small_tensors())
    finally:
        triton_qsa._load_kernels.cache_clear()


def test_deterministic_backward_is_refused():
    """Atomic dK/dV: with torch.use_deterministic_algorithms a backward is refused up front."""
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    q = torch.randn(1, 8, 2, 16, device=DEVICE, requires_grad=True)
    k, v = torch.randn(2, 1, 8, 1, 16, device=DEVICE).unbind(0)
    routes = torch.randint(-1, 8, (1, 8, 4), device=DEVICE)
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="deterministic"):
            triton_sparse_gqa_attention(q, k, v, routes)
        with torch.no_grad():  # no backward wanted: runs
            assert triton_sparse_gqa_attention(q, k, v, routes).shape == q.shape
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="deterministic"):
            triton_sparse_gqa_attention(q, k, v, routes)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_grid_axis_limit_is_a_clear_error(monkeypatch):
    """batch * KV heads * head chunks goes on CUDA grid axis y (at most 65535): past it
    the backend refuses with ValueError instead of a launch failure."""
    monkeypatch.setattr(triton_qsa, "_MAX_GRID_Y", 3)
    q = torch.randn(2, 8, 4, 16, device=DEVICE)
    kv = torch.randn(2, 8, 2, 16, device=DEVICE)
    routes = torch.zeros(2, 8, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="grid axis y"):
        triton_sparse_gqa_attention(q, kv, kv, routes)
    monkeypatch.setattr(triton_qsa, "_MAX_GRID_Y", 4)
    assert triton_sparse_gqa_attention(q, kv, kv, routes).shape == q.shape


def test_skip_dkdv_measurement_hook():
    """The probe's hook masks every dK/dV add off at run time: dk/dv stay zero and dq
    is the same as with the adds."""
    torch.manual_seed(0)
    q, do = torch.randn(2, 2, 9, 4, 16, device=DEVICE).unbind(0)
    k, v = torch.randn(2, 2, 11, 2, 16, device=DEVICE).unbind(0)
    routes = torch.randint(-2, 13, (2, 9, 5), device=DEVICE)
    plan = triton_qsa._make_plan(2, 16, BlockSizes(block_m=16, block_k=16, backward_block_m=16,
                                                   backward_block_k=16))
    unions = build_tile_unions(routes, 11, plan.rows_per_tile)
    out, lse = triton_qsa._forward(q, k, v, unions, 0.25, plan)
    dq, dk, dv = triton_qsa._backward(q, k, v, out, lse, do, unions, 0.25, plan, 5)
    dq_skip, dk_skip, dv_skip = triton_qsa._backward(q, k, v, out, lse, do, unions, 0.25, plan, 5,
                                                     skip_dkdv=True)
    assert dk.abs().sum() > 0 and dv.abs().sum() > 0
    assert torch.equal(dq_skip, dq) and not dk_skip.any() and not dv_skip.any()


def test_tile_unions_validate_their_inputs():
    routes = torch.zeros(1, 4, 3, dtype=torch.int64)
    for bad in (routes.to(torch.int16), routes.to(torch.uint8), routes.float()):
        with pytest.raises(TypeError):
            build_tile_unions(bad, 40000, 4)
    for kv_length in (0, 2**31):
        with pytest.raises(ValueError):
            build_tile_unions(routes, kv_length, 4)
    with pytest.raises(ValueError):
        build_tile_unions(routes[0], 8, 4)
    with pytest.raises(ValueError):
        build_tile_unions(routes, 8, 3)


@pytest.mark.parametrize("heads", [(3, 1), (12, 1), (6, 2)])
@pytest.mark.parametrize("layout, family", [("packed", "adversarial"), ("cp", "qsa")])
def test_flattened_heads_against_the_oracle(heads, layout, family):
    """flatten_heads=True: a program's rows are consecutive (row, head) pairs, so its
    query rows straddle program boundaries; out and all gradients match the oracle and
    empty rows stay exact zeros."""
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=26,
                           **(dict(top_k=3) if family == "qsa" else dict(width=7)))
    blocks = dataclasses.replace(SMALL, block_m=32, flatten_heads=True)
    plan = triton_qsa._make_plan(heads[0] // heads[1], 16, blocks)
    assert plan.flat and plan.fwd_heads == 32
    got = _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks, rng, 0.3)
    empty = ~membership(problem.routes, problem.kv_length).any(-1)
    assert np.all(got[0][empty] == 0) and np.all(got[1][empty] == 0)


@pytest.mark.parametrize("heads", [(3, 1), (6, 2)])
def test_flat_programs_sorted_per_program_against_the_oracle(heads):
    """G = 3 with 64-pair programs: 3 * T is never a multiple of 64 for T <= 32, so no
    tile holds whole programs and the key kernel sorts each program's span of rows (32
    rows, so rowbits' bit 31 is used); out and all gradients match the oracle."""
    rng = _fresh_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=45, width=7)
    blocks = dataclasses.replace(SMALL, block_m=64, flatten_heads=True)
    plan = triton_qsa._make_plan(heads[0] // heads[1], 16, blocks)
    assert plan.flat and plan.rows_per_tile == 32
    assert triton_qsa._flat_union_rows(plan.group, plan.fwd_heads, plan.rows_per_tile) is None
    _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks, rng, 0.3)


def test_residual_form_with_a_flat_default(monkeypatch):
    """The custom ops' residual form (forward_with_residuals / residual_shapes /
    backward_from_residuals) under a flat default plan, as on SM90: the residuals have
    the shapes the fake implementation announces and the backward from them matches the
    oracle."""
    blocks = dataclasses.replace(SMALL, block_m=32, flatten_heads=True)
    monkeypatch.setattr(triton_qsa, "default_block_sizes", lambda *a: blocks)
    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=30, top_k=3)
    q, k, v, do = (torch.from_numpy(x).float().to(DEVICE)
                   for x in random_inputs(rng, problem.routes, problem.kv_length, (12, 1), 16, "float32"))
    routes = torch.from_numpy(problem.routes).to(DEVICE)
    assert triton_qsa._default_plan(q, k).flat
    results = triton_qsa.forward_with_residuals(q, k, v, routes, 0.3)
    assert [(tuple(x.shape), x.dtype) for x in results] == triton_qsa.residual_shapes(q, k, routes)
    grads = triton_qsa.backward_from_residuals(do, q, k, v, *results, 0.3, routes.shape[2])
    want = oracle_forward_backward(*(x.cpu().double().numpy() for x in (q, k, v)), problem.routes, 0.3,
                                   do.cpu().double().numpy())
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (results[0], *grads), want):
        assert relative_error(got.cpu().double().numpy(), ref) < 1e-5, name


@pytest.mark.parametrize("path", ["cut_from_tiles", "sorted_per_program", "torch"])
def test_flat_unions_match_brute_force(monkeypatch, path):
    """Every way build_flat_unions has (tile unions cut into programs, each program's
    rows sorted by the key kernel, torch ops) gives each program's exact union."""
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "triton_unions", path != "torch")
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "flat_unions_from_tiles", path == "cut_from_tiles")
    rng = _fresh_rng()
    s_q, kv_length, group = 23, 30, 12
    routes = rng.integers(-3, kv_length + 3, size=(2, s_q, 5))
    routes[0, 4, 1] = routes[0, 4, 0]  # a repeated ID in a row
    routes[1, 7, 2] = 2**62 + 5  # huge int64: padding, never wrapped into range
    raw = torch.from_numpy(routes.transpose(0, 2, 1).copy()).to(DEVICE).transpose(1, 2)  # non-contiguous
    plan = triton_qsa._make_plan(group, 16, BlockSizes(block_m=32, flatten_heads=True))
    unions = _to_cpu(triton_qsa.build_flat_unions(raw, kv_length, plan))
    n_blocks = -(-s_q * group // 32)
    assert unions.union.shape[:2] == (2, n_blocks) and unions.rows_per_tile == 4
    for b in range(2):
        for p in range(n_blocks):
            first, last = 32 * p // group, min((32 * p + 31) // group, s_q - 1)
            rows = routes[b, first:last + 1]
            ids = np.unique(rows[(rows >= 0) & (rows < kv_length)])
            n = int(unions.count[b, p])
            assert unions.union[b, p, :n].tolist() == ids.tolist()
            want = [sum(1 << t for t in range(len(rows)) if x in rows[t]) for x in ids]
            assert unions.rowbits[b, p, :n].tolist() == want


@pytest.mark.parametrize("rows, sub_rows, s_q, kv_length", [
    (8, 4, 45, 50),  # last tile partly empty, widths T * K and T' * K
    (32, 4, 45, 30),  # row 31 (int32's sign bit) routed; both widths capped at S_kv
    (16, 1, 33, 200),
])
@pytest.mark.parametrize("triton_unions", [True, False], ids=["triton", "torch"])
def test_split_unions_equal_unions_built_at_the_finer_tiling(monkeypatch, rows, sub_rows, s_q, kv_length,
                                                             triton_unions):
    """Cutting T-row unions into T'-row ones gives exactly what a sort at T' gives:
    the same IDs, counts, row bits and -1 padding (routes with every adversarial ID,
    every row routed so the top row bit is used), in the Triton kernel and in torch."""
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "triton_unions", triton_unions)
    rng = _fresh_rng()
    width = 9
    routes = np.stack([  # adversarial rows repeated down to s_q rows, and every row routed
        np.resize(adversarial_routes(kv_length, width=width, rng=rng), (s_q, width)),
        rng.integers(0, kv_length, size=(s_q, width)),
    ])
    raw = torch.from_numpy(routes).to(DEVICE)
    coarse = build_tile_unions(raw, kv_length, rows)
    if rows == 32:
        assert (coarse.rowbits < 0).any(), "row 31's bit (int32's sign) should be set somewhere"
    want = build_tile_unions(raw, kv_length, sub_rows)
    got = _split_tile_unions(coarse, sub_rows, width, s_q)
    assert got.rows_per_tile == sub_rows
    assert torch.equal(got.count, want.count)
    assert got.union.shape == want.union.shape
    assert torch.equal(got.union, want.union)
    assert torch.equal(got.rowbits, want.rowbits)
    assert _split_tile_unions(coarse, rows, width, s_q) is coarse
    with pytest.raises(ValueError):
        _split_tile_unions(coarse, rows * 2, width, s_q)


@pytest.mark.parametrize("heads, layout, family", [
    ((6, 2), "padded", "adversarial"),
    ((12, 1), "packed", "qsa"),
    ((2, 2), "cp", "random"),  # MHA: the backward rows are raised until M >= 16
])
def test_shorter_backward_tiles_against_the_oracle(heads, layout, family):
    """backward_rows_per_tile < T: the backward walks split unions of shorter tiles;
    out and every gradient still match the oracle."""
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=38,
                           **(dict(top_k=3) if family == "qsa" else dict(width=7)))
    blocks = BlockSizes(block_m=128, block_k=16, num_warps=2, num_stages=1, backward_block_m=32,
                        backward_block_k=16, backward_num_warps=2, backward_num_stages=1,
                        backward_rows_per_tile=4)
    plan = triton_qsa._make_plan(heads[0] // heads[1], 16, blocks)
    assert plan.backward_rows < plan.rows_per_tile
    assert plan.backward_rows * plan.bwd_heads >= 16
    _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks, rng, 0.3)


def test_backward_rows_per_tile_is_validated():
    for bad in (0, 3, 64, 2.0):
        with pytest.raises(ValueError):
            BlockSizes(backward_rows_per_tile=bad)


def test_int64_offsets_against_the_oracle(monkeypatch):
    """With 32-bit offsets off (what the kernels do when an offset could pass 2**31)
    they compute the same function; every other test runs the 32-bit path."""
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "offs32", False)
    rng = _fresh_rng()
    problem = make_problem("packed", "adversarial", seed=int(rng.integers(2**31)), seq_len=30, width=7)
    _check_against_oracle(problem.routes, problem.kv_length, (6, 2), 16, "float32", MEDIUM, rng, 0.3)


@pytest.mark.parametrize("layout, family, heads, blocks", [
    ("packed", "adversarial", (6, 2), MEDIUM),  # padded tiles, head padding
    ("padded", "qsa", (12, 1), dataclasses.replace(SMALL, block_m=32, flatten_heads=True)),  # flat
    ("cp", "random", (4, 1), SMALL),  # partial last chunk: masked transposed adds
])
def test_lean_backward_against_the_oracle(monkeypatch, layout, family, heads, blocks):
    """KERNEL_OPTIONS["lean_backward"] (transposed dK/dV products, dQ-store
    coordinates recomputed) computes the same gradients: against the oracle, and to
    fp32 rounding against the default backward (the same products; only the order in
    which the interpreter's matmul sums them may differ)."""
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=30,
                           **(dict(top_k=3) if family == "qsa" else dict(width=7)))
    seed = int(rng.integers(2**31))
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "lean_backward", True)
    lean = _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks,
                                 np.random.default_rng(seed), 0.3)
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "lean_backward", False)
    default = _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks,
                                    np.random.default_rng(seed), 0.3)
    assert np.array_equal(lean[0], default[0])  # the forward is untouched
    for a, b in zip(lean[1:], default[1:]):
        assert relative_error(a, b) < 1e-6


def test_offsets_fit_int32_checks_the_largest_offset(monkeypatch):
    small = torch.empty(1, 8, 2, 16)
    assert triton_qsa._offsets_fit_int32((8, small))
    wide = torch.empty(1, 2**27, 1, 16, device="meta")  # strides (2**31, 16, 16, 1)
    assert triton_qsa._offsets_fit_int32((2**27, wide))  # (2**27 - 1) * 16 + 15 == 2**31 - 1
    wider = torch.empty(1, 2**27 + 1, 1, 16, device="meta")
    assert not triton_qsa._offsets_fit_int32((2**27 + 1, wider))
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "offs32", False)
    assert not triton_qsa._offsets_fit_int32((8, small))


@pytest.mark.parametrize("group, rows, fwd_heads, bwd_rows, bwd_heads", [
    (12, 16, 128, 16, 128),  # the tuned H200 shape: flat programs of 128 pairs spanning <= 16 rows
    (2, 32, 2, 32, 2),  # small groups: 32-row tiles (rowbits' limit), no cut needed
    (1, 32, 1, 32, 1),
    (64, 2, 64, 1, 64),  # a group wider than backward_block_m: 1 row, all heads
])
def test_default_plans(group, rows, fwd_heads, bwd_rows, bwd_heads):
    plan = triton_qsa._make_plan(group, 256, triton_qsa.DEFAULT_BLOCK_SIZES)
    assert (plan.rows_per_tile, plan.fwd_heads, plan.backward_rows, plan.bwd_heads) == (
        rows, fwd_heads, bwd_rows, bwd_heads)


@pytest.mark.parametrize("capability, shared_memory, head_dim, dtype, tuned", [
    ((9, 0), 232448, 256, torch.bfloat16, True),  # H100 / H200
    ((10, 0), 232448, 256, torch.float16, True),  # B200
    ((12, 0), 101376, 256, torch.bfloat16, False),  # consumer Blackwell: 99 KiB per block
    ((8, 0), 166912, 256, torch.bfloat16, False),  # A100
    ((9, 0), 232448, 256, torch.float32, False),  # fp32 operands take twice the bytes
    ((9, 0), 232448, 128, torch.bfloat16, False),  # tuned at D = 256 only
    ((9, 0), None, 256, torch.bfloat16, True),  # a torch without the property: capability decides
])
def test_default_block_sizes_follow_the_device(monkeypatch, capability, shared_memory, head_dim, dtype, tuned):
    from types import SimpleNamespace

    props = SimpleNamespace() if shared_memory is None else SimpleNamespace(
        shared_memory_per_block_optin=shared_memory)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    got = triton_qsa.default_block_sizes(torch.device("cuda", 0), head_dim, dtype)
    assert got == (triton_qsa.DEFAULT_BLOCK_SIZES if tuned else triton_qsa.SAFE_BLOCK_SIZES)
    assert triton_qsa.default_block_sizes(torch.device("cpu"), 256, torch.bfloat16) == triton_qsa.SAFE_BLOCK_SIZES


def test_default_block_sizes_in_interpret_mode():
    """The GPU's default tiling (flat programs of 128 (row, head) pairs over 64-ID
    chunks, forward and backward) at D=256 and G=12 through the interpreter, so its
    index arithmetic is checked against the oracle on CPU (20 rows: two programs, the
    second partly past the end)."""
    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=20, top_k=5)
    plan = triton_qsa._make_plan(12, 256, triton_qsa.DEFAULT_BLOCK_SIZES)
    assert plan.flat and plan.fwd_heads == plan.bwd_heads == 128
    # on a GPU in the dtype the configuration is for: fp32 tiles of 128 x 256 do not fit
    dtype = "float32" if DEVICE == "cpu" else "bfloat16"
    _check_against_oracle(problem.routes, problem.kv_length, (12, 1), 256, dtype,
                          triton_qsa.DEFAULT_BLOCK_SIZES, rng, 0.1)


@pytest.mark.parametrize("triton_unions", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("group, rows, pairs, s_q", [
    (12, 16, 64, 45),  # the H200 shape: 192 pairs per 16-row tile = 3 programs of 64
    (6, 32, 64, 70),  # 192 pairs per 32-row tile, row 31 routed
    (3, 16, 16, 33),
])
def test_flat_unions_cut_from_tile_unions(monkeypatch, group, rows, pairs, s_q, triton_unions):
    """Where a tile's rows x G pairs hold whole flat programs, cutting the tile unions
    gives exactly the unions build_flat_unions sorts for those programs."""
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "triton_unions", triton_unions)
    rng = _fresh_rng()
    kv_length, width = 50, 7
    routes = np.stack([
        np.resize(adversarial_routes(kv_length, width=width, rng=rng), (s_q, width)),
        rng.integers(0, kv_length, size=(s_q, width)),
    ])
    raw = torch.from_numpy(routes).to(DEVICE)
    plan = triton_qsa._make_plan(group, 16, BlockSizes(block_m=pairs, flatten_heads=True))
    assert plan.flat and plan.fwd_heads == pairs
    with monkeypatch.context() as sorted_per_program:
        sorted_per_program.setitem(triton_qsa.KERNEL_OPTIONS, "flat_unions_from_tiles", False)
        want = _to_cpu(triton_qsa.build_flat_unions(raw, kv_length, plan))
    tiles = build_tile_unions(raw, kv_length, rows)
    got = _to_cpu(triton_qsa._split_flat_unions(tiles, pairs, group, width, s_q, plan.rows_per_tile))
    assert got.rows_per_tile == want.rows_per_tile
    assert got.union.shape == want.union.shape
    assert torch.equal(got.count, want.count)
    assert torch.equal(got.union, want.union)
    assert torch.equal(got.rowbits, want.rowbits)
    with pytest.raises(ValueError, match="whole programs"):
        triton_qsa._split_flat_unions(build_tile_unions(raw, kv_length, 1), 64, 12, width, s_q, 8)


def test_flat_backward_plans():
    blocks = dataclasses.replace(triton_qsa.DEFAULT_BLOCK_SIZES, flatten_heads=False, backward_flatten_heads=True)
    plan = triton_qsa._make_plan(12, 256, blocks)  # padded forward tiles of the H200 shape
    assert (plan.rows_per_tile, plan.fwd_heads, plan.union_rows, plan.bwd_pairs, plan.bwd_span) == (
        8, 16, 16, 64, 8)
    plan = triton_qsa._make_plan(6, 256, blocks)  # 16-row tiles, unions of 32 rows
    assert (plan.rows_per_tile, plan.union_rows, plan.bwd_pairs) == (16, 32, 64)
    for group in (3, 4):  # no tile of <= 32 rows holds whole 64-pair programs / no padding
        plan = triton_qsa._make_plan(group, 256, blocks)
        assert plan.bwd_pairs == 0 and plan.union_rows == 0


@pytest.mark.parametrize("heads, layout, family", [
    ((12, 1), "packed", "qsa"),
    ((24, 2), "padded", "adversarial"),
    ((6, 2), "cp", "random"),
])
def test_flat_backward_against_the_oracle(heads, layout, family):
    """backward_flatten_heads: padded forward tiles cut from taller unions, flat backward
    programs cut from the same unions; out and every gradient match the oracle and
    empty rows stay exact zeros."""
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=42,
                           **(dict(top_k=3) if family == "qsa" else dict(width=7)))
    blocks = BlockSizes(block_m=64, block_k=16, num_warps=2, num_stages=1, backward_block_m=32,
                        backward_block_k=16, backward_num_warps=2, backward_num_stages=1,
                        backward_flatten_heads=True)
    plan = triton_qsa._make_plan(heads[0] // heads[1], 16, blocks)
    assert plan.bwd_pairs == 32 and plan.union_rows > plan.rows_per_tile
    got = _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks, rng, 0.3)
    empty = ~membership(problem.routes, problem.kv_length).any(-1)
    assert np.all(got[0][empty] == 0) and np.all(got[1][empty] == 0)


@pytest.mark.parametrize("triton_unions", [True, False], ids=["triton", "torch"])
def test_tile_unions_over_several_sorts(monkeypatch, triton_unions):
    """Keys of 29 bits leave room for 4 tiles per int32 sort: with the minimum lowered
    to 4, 10 one-row tiles take three sorts; the unions are still every row's sorted
    distinct IDs (at 256, the default minimum, they take one int64 sort)."""
    monkeypatch.setitem(triton_qsa.KERNEL_OPTIONS, "triton_unions", triton_unions)
    rng = _fresh_rng()
    kv_length = 2**28 - 3
    routes = rng.integers(-2, kv_length + 2, size=(1, 10, 4))
    routes[0, 7, 1] = routes[0, 7, 0]
    routes[0, 3, :] = kv_length - 1
    raw = torch.from_numpy(routes).to(DEVICE)
    once = _to_cpu(build_tile_unions(raw, kv_length, 1))
    monkeypatch.setattr(triton_qsa, "_MIN_GROUPS_PER_SORT", 4)
    unions = _to_cpu(build_tile_unions(raw, kv_length, 1))
    for row in range(10):
        ids = np.unique(routes[0, row][(routes[0, row] >= 0) & (routes[0, row] < kv_length)])
        n = int(unions.count[0, row])
        assert unions.union[0, row, :n].tolist() == ids.tolist()
        assert np.all(unions.rowbits[0, row, :n].numpy() == 1)
        assert np.all(unions.union[0, row, n:].numpy() == -1)
    for a, b in zip((once.union, once.count, once.rowbits), (unions.union, unions.count, unions.rowbits)):
        assert torch.equal(a, b)
