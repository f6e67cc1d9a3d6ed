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
from union_oracle import assert_unions_equal, flat_unions, tile_unions  # noqa: E402

from qsa_common.errors import MissingRuntime, UnsupportedDevice, UnsupportedDtype, UnsupportedShape  # noqa: E402
from qsa_common.generators import adversarial_routes, random_routes  # noqa: E402
from qsa_common.layouts import make_problem  # noqa: E402
from qsa_common.oracle import membership, oracle_forward_backward, relative_error  # noqa: E402
from qsa_torch import _triton_launch, triton_qsa  # noqa: E402
from qsa_torch.routes import normalize_routes, to_torch_routes  # noqa: E402
from qsa_torch.triton_qsa import (  # noqa: E402
    BlockSizes,
    build_tile_unions,
    triton_sparse_gqa_attention,
)
from qsa_triton import driver  # noqa: E402
from qsa_triton import launch as spec  # noqa: E402
from qsa_triton.plan import KeyPlan, SortStep, flat_span, flat_union_rows, fold_grid, make_plan, offsets_fit_int32  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ADAPTER = _triton_launch.adapter(DEVICE)  # the torch adapter of qsa_triton.driver


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
    assert _triton_launch.interpreted() or DEVICE == "cuda", "kernels were compiled, not interpreted, on a CPU machine"


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


def _numpy(unions):
    return tuple(x.cpu().numpy() for x in (unions.union, unions.count, unions.rowbits))


def _union_routes(rng, kv_length: int, width: int, s_q: int) -> np.ndarray:
    """Two batch rows: adversarial routes (padding, duplicates, huge IDs, empty rows)
    and random ones, every row routed."""
    return np.stack([
        np.resize(adversarial_routes(kv_length, width=width, rng=rng), (s_q, width)),
        rng.integers(0, kv_length, size=(s_q, width)),
    ])


@pytest.mark.parametrize("rows_per_tile", [1, 4, 32])
def test_tile_unions_match_the_oracle(rows_per_tile):
    """The union kernels' tile unions, element for element (the -1 and 0 padding past
    each count included), for raw, canonical and strided routes."""
    rng = _fresh_rng()
    kv_length, width = 50, 9
    routes = np.concatenate([
        adversarial_routes(kv_length, width=width, rng=rng)[None, :45],
        random_routes(kv_length, width=width, rng=rng, causal=False)[None, :45],
    ])
    raw = torch.from_numpy(routes).to(DEVICE)
    want = tile_unions(routes, kv_length, rows_per_tile)
    assert_unions_equal(_numpy(build_tile_unions(raw, kv_length, rows_per_tile)), want, "raw")
    # canonical routes (the references' form) and a strided view give the same unions
    canonical = build_tile_unions(normalize_routes(raw, kv_length), kv_length, rows_per_tile)
    assert_unions_equal(_numpy(canonical), want, "canonical")
    strided_view = raw.repeat_interleave(2, dim=2)[..., ::2]
    assert not strided_view.is_contiguous()
    assert_unions_equal(_numpy(build_tile_unions(strided_view, kv_length, rows_per_tile)), want, "strided")
    if rows_per_tile == 32:
        assert (want[2] < 0).any(), "row 31's bit (int32's sign) should be set somewhere"


def test_tile_unions_with_runs_across_merge_chunks():
    """Tiles of 32 rows x K = 100 routes: 3200 sorted keys per tile, merged in chunks of
    UNION_BLOCK; rows that share most IDs make runs of equal IDs (one key per row) that the
    chunk boundaries cut, and each run's bits must all reach its slot."""
    from qsa_triton.launch import UNION_BLOCK

    rng = _fresh_rng()
    kv_length, width, s_q = 400, 100, 56
    shared = rng.choice(kv_length, size=width, replace=False)
    routes = np.stack([rng.permutation(shared) for _ in range(s_q)])
    swap = rng.random(routes.shape) < 0.05  # some rows differ: runs of every length
    routes[swap] = rng.integers(-3, kv_length + 3, size=int(swap.sum()))
    routes[5, :10] = routes[5, 10:20]  # repeated IDs within a row
    assert 32 * width > 3 * UNION_BLOCK
    want = tile_unions(routes[None], kv_length, 32)
    assert_unions_equal(_numpy(build_tile_unions(torch.from_numpy(routes[None]).to(DEVICE), kv_length, 32)), want)
    ors = np.bitwise_or.reduce(want[2], axis=-1)
    assert list(ors[0]) == [-1, (1 << 24) - 1]  # every row of both tiles has a bit somewhere
    assert (want[2] == -1).any()  # and some ID is in all 32 rows of a tile: a run longer than a cut


def test_tile_unions_with_wide_keys():
    """kv_length * T past int32 range: the sort keys switch to int64."""
    rng = _fresh_rng()
    kv_length = 2**27
    routes = rng.integers(-5, kv_length + 5, size=(1, 70, 6))
    routes[0, 3] = routes[0, 2]  # two identical rows
    routes[0, 5, 1] = routes[0, 5, 0]  # a repeated ID within a row
    routes[0, 7, :3] = kv_length - 1
    assert KeyPlan.make(3, 32, 6, kv_length).dtype == "int64"
    unions = build_tile_unions(torch.from_numpy(routes).to(DEVICE), kv_length, 32)
    assert_unions_equal(_numpy(unions), tile_unions(routes, kv_length, 32))


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


def _poisoned(shape, dtype, device):
    fill = float("nan") if dtype.is_floating_point else -123456789
    return torch.full(shape, fill, dtype=dtype, device=device)


def test_poisoned_outputs_are_fully_overwritten(monkeypatch):
    """Every buffer a kernel writes (out, LSE, dq, sort keys, unions, counts, row bits of
    cut unions) starts poisoned (NaN, or a huge int): every element must be written (the
    attention call's own unions up to each count, which is all its kernels read)."""
    monkeypatch.setattr(_triton_launch, "new_buffer", _poisoned)
    rng = _fresh_rng()
    # 37 rows: the last 8-row tile is partial; (6, 2) pads 3 heads to 4; the backward's
    # tiles of 4 rows are cut from the forward's
    routes = adversarial_routes(37, width=8, rng=rng)[None]
    blocks = dataclasses.replace(SMALL, block_m=32, backward_rows_per_tile=4)
    assert (make_plan(3, 16, blocks).rows_per_tile, make_plan(3, 16, blocks).backward_rows) == (8, 4)
    got = _check_against_oracle(routes, 37, (6, 2), 16, "float32", blocks, rng)
    empty = ~membership(routes, 37).any(-1)[0]
    assert empty.any() and np.all(got[0][0, empty] == 0.0) and np.all(got[1][0, empty] == 0.0)
    raw = torch.from_numpy(routes).to(DEVICE)
    assert_unions_equal(_numpy(build_tile_unions(raw, 37, 8)), tile_unions(routes, 37, 8))
    split = driver.split_tile_unions(ADAPTER, build_tile_unions(raw, 37, 8), 4, 8, 37)
    assert_unions_equal(_numpy(split), tile_unions(routes, 37, 4))


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

        def fn(q_, k_, v_, _r, s, routes=routes):
            return triton_sparse_gqa_attention(q_, k_, v_, routes, s, block_sizes=SMALL)

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
    with pytest.raises(UnsupportedDtype, match="float64"):  # a TypeError, and a decline
        triton_sparse_gqa_attention(q.double(), k.double(), v.double(), r)
    with pytest.raises(TypeError, match="query"):
        triton_sparse_gqa_attention(q.int(), k.int(), v.int(), r)
    with pytest.raises(TypeError, match="selected_token_ids"):
        triton_sparse_gqa_attention(q, k, v, r.float())
    with pytest.raises(ValueError, match="query heads"):
        triton_sparse_gqa_attention(q, k.expand(1, 6, 3, 16), v.expand(1, 6, 3, 16), r)
    with pytest.raises(ValueError, match="softmax_scale"):
        triton_sparse_gqa_attention(q, k, v, r, -1.0)
    with pytest.raises(UnsupportedShape, match="head dim <= 256, got 264"):  # a ValueError, and a decline
        triton_sparse_gqa_attention(*_small_tensors(head_dim=264))
    with pytest.raises(TypeError, match="block_sizes"):
        triton_sparse_gqa_attention(q, k, v, r, block_sizes=(64, 32))
    with pytest.raises(ValueError, match="block_k"):
        BlockSizes(block_k=48)
    with pytest.raises(ValueError, match="num_warps"):
        BlockSizes(num_warps=0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(spec, "interprets", lambda: False)
    args = _small_tensors(device="cpu")
    assert isinstance(triton_qsa.supports(*args), UnsupportedDevice)
    with pytest.raises(UnsupportedDevice, match="CUDA"):  # a RuntimeError, and a decline
        triton_sparse_gqa_attention(*args)


def test_missing_triton_raises_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(triton_qsa, "_HAS_TRITON", False)  # looked up at import
    for name in ("forward", "backward", "union_keys", "union_merge", "union_cut"):
        monkeypatch.delitem(sys.modules, f"qsa_triton.{name}", raising=False)
    _triton_launch.interpreted.cache_clear()
    try:
        assert isinstance(triton_qsa.supports(*_small_tensors()), MissingRuntime)
        with pytest.raises(MissingRuntime, match="'triton' package"):  # an ImportError, and a decline
            triton_sparse_gqa_attention(*_small_tensors())
    finally:
        _triton_launch.interpreted.cache_clear()


def _run_plan(plan, q, k, v, routes, scale, do):
    """out, dq, dk, dv (float64 numpy) of the kernels under an explicit ``plan``."""
    q, k, v, do = (torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k, v, do))
    r = torch.from_numpy(routes).to(DEVICE)
    unions = driver.build_unions(ADAPTER, r, k.shape[1], plan)
    out, lse = driver.forward(ADAPTER, q, k, v, unions, scale, plan)
    grads = driver.backward(ADAPTER, q, k, v, out, lse, do, driver.backward_unions(ADAPTER, unions, plan,
                                                                                    routes.shape[2], q.shape[1]),
                            scale, plan)
    return tuple(t.double().cpu().numpy() for t in (out, *grads))


def test_fold_grid():
    assert fold_grid(7, 5, 65535) == ((7, 5), 1)  # within the limit: the grid as it was
    assert fold_grid(7, 5, 2) == ((21, 2), 3)  # 6 slots along y, the last dead
    assert fold_grid(3, 200_000) == ((12, 50_000), 4)
    with pytest.raises(ValueError):
        fold_grid(2**30, 200_000)


def test_folded_grids_against_the_oracle():
    """With the grid's y limit lowered to 2, every launch folds (forward and backward:
    batch * KV heads = 5 programs along y, fold 3, one dead slot; the key kernel's 3
    chunks per tile; the cut kernel's 5 batch rows): the results equal the unfolded
    launches' bit for bit (out, dq) and match the oracle."""
    rng = _fresh_rng()
    bsz, s_q, kv_length, width = 5, 20, 24, 140  # 16 rows x 140 routes: 3 key chunks per tile
    routes = rng.integers(-2, kv_length + 3, size=(bsz, s_q, width))
    routes[1, 3] = -1
    blocks = BlockSizes(block_m=32, block_k=16, num_warps=1, num_stages=1, backward_block_m=16,
                        backward_block_k=16, backward_num_warps=1, backward_num_stages=1,
                        backward_rows_per_tile=8)
    q, k, v, do = random_inputs(rng, routes, kv_length, (2, 1), 16, "float32")
    folded = make_plan(2, 16, blocks, max_grid_y=2)
    assert folded.backward_rows < folded.rows_per_tile  # the backward's unions are cut
    got = _run_plan(folded, q, k, v, routes, 0.3, do)
    plain = _run_plan(make_plan(2, 16, blocks), q, k, v, routes, 0.3, do)
    want = oracle_forward_backward(q, k, v, routes, 0.3, do)
    for name, g, p, w in zip(("out", "dq", "dk", "dv"), got, plain, want):
        assert relative_error(g, w) < 1e-5, name
        if name in ("out", "dq"):
            np.testing.assert_array_equal(g, p, err_msg=name)


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
    plan = make_plan(heads[0] // heads[1], 16, blocks)
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
    plan = make_plan(heads[0] // heads[1], 16, blocks)
    assert plan.flat and plan.rows_per_tile == 32
    assert flat_union_rows(plan.group, plan.fwd_heads, plan.rows_per_tile) is None
    _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks, rng, 0.3)


def test_plan_refuses_the_backward_tilings_that_read_past_shared_memory():
    """Backward programs of 64+ (row, head) pairs at D = 256 over chunks of fewer than 64
    IDs read past their shared memory in a tl.dot (compute-sanitizer on the H200, Triton
    3.6: flat 128- and 64-pair programs, padded 8 x 8 programs; scripts/gpu/probe_chunks.py):
    refused with the reason, flat or padded; 32-pair programs, narrower heads and the
    tuned 64-ID chunks plan as before, and no fallback ladder steps down to a refused one."""
    from qsa_triton.config import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES

    refused = [(12, dict(backward_block_k=32)), (12, dict(block_m=64, backward_block_k=32)),
               (8, dict(backward_block_k=32)), (8, dict(backward_block_k=16))]
    for group, changes in refused:
        with pytest.raises(ValueError, match=r"pairs at head dim 256 need backward_block_k >= 64, got"):
            make_plan(group, 256, dataclasses.replace(DEFAULT_BLOCK_SIZES, **changes))
    for group, head_dim, blocks in [(12, 256, DEFAULT_BLOCK_SIZES), (8, 256, DEFAULT_BLOCK_SIZES),
                                    (12, 128, dataclasses.replace(DEFAULT_BLOCK_SIZES, backward_block_k=32)),
                                    (12, 256, dataclasses.replace(DEFAULT_BLOCK_SIZES, block_m=32,
                                                                  backward_block_k=16)),
                                    (12, 256, SAFE_BLOCK_SIZES), (8, 256, SAFE_BLOCK_SIZES)]:
        plan = make_plan(group, head_dim, blocks)
        for attempt in spec.attempts(plan, True):
            rows = attempt.heads if plan.flat else plan.backward_rows * attempt.heads
            assert attempt.block_k >= (64 if rows >= 64 and head_dim > 128 else 16), (group, head_dim, attempt)
    flat, padded = make_plan(12, 256, DEFAULT_BLOCK_SIZES), make_plan(8, 256, DEFAULT_BLOCK_SIZES)
    assert flat.flat and not padded.flat and padded.backward_rows * padded.bwd_heads == 64
    assert {a.block_k for a in spec.attempts(flat, True)} == {64}
    assert {a.block_k for a in spec.attempts(flat, False)} == {64, 32, 16}
    # padded programs may still halve their heads to 32 pairs, which take narrower chunks
    assert {(a.heads, a.block_k) for a in spec.attempts(padded, True)} == {(8, 64), (4, 64), (4, 32), (4, 16),
                                                                          (2, 64), (2, 32), (2, 16)}


@pytest.mark.parametrize("group", [1, 3, 6, 12])
def test_residual_shapes_are_the_union_recipes(group):
    """The fake implementation's union shapes (plain ceil-division and ``sym_min``, so they
    stay symbolic under torch.compile) are those :func:`qsa_triton.plan.union_recipe`
    builds: padded and flat plans, with and without a cut, K small and large against S_kv."""
    from qsa_triton.config import DEFAULT_BLOCK_SIZES
    from qsa_triton.plan import union_recipe

    for blocks in (SMALL, dataclasses.replace(SMALL, block_m=32, flatten_heads=True), DEFAULT_BLOCK_SIZES):
        plan = make_plan(group, 16, blocks)
        for bsz, s_q, top_k, s_kv in ((1, 1, 1, 1), (2, 45, 7, 45), (1, 300, 2052, 600), (3, 129, 12, 4096),
                                      (1, 1000, 5, 40)):
            sort, cut = union_recipe(plan, s_q, top_k, s_kv, bsz)
            n_tiles, width = (cut.n_sub, cut.width) if cut is not None else (sort.n_groups, sort.width)
            want = [((bsz, n_tiles, width), torch.int32), ((bsz, n_tiles), torch.int32),
                    ((bsz, n_tiles, width), torch.int32)]
            assert triton_qsa._union_shapes(plan, bsz, s_q, top_k, s_kv) == want, (blocks, bsz, s_q, top_k, s_kv)


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
    assert triton_qsa._plan(q, k, None).flat
    results = triton_qsa.forward_with_residuals(q, k, v, routes, 0.3)
    assert [(tuple(x.shape), x.dtype) for x in results] == triton_qsa.residual_shapes(q, k, routes)
    grads = triton_qsa.backward_from_residuals(do, q, k, v, *results, 0.3, routes.shape[2])
    want = oracle_forward_backward(*(x.cpu().double().numpy() for x in (q, k, v)), problem.routes, 0.3,
                                   do.cpu().double().numpy())
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (results[0], *grads), want):
        assert relative_error(got.cpu().double().numpy(), ref) < 1e-5, name
    # the pieces apart: the unions alone, the forward kernel alone, the same bits
    unions = triton_qsa.route_unions(q, k, routes)
    for a, b in zip(unions, results[2:]):
        assert torch.equal(a, b)
    out, lse = triton_qsa.forward_from_unions(q, k, v, *unions, 0.3, routes.shape[2])
    assert torch.equal(out, results[0]) and torch.equal(lse, results[1])
    with pytest.raises(ValueError, match="not this plan's"):
        triton_qsa.forward_from_unions(q, k, v, *unions, 0.3, 1)


def _flat_routes(rng, s_q, kv_length, width=5):
    routes = rng.integers(-3, kv_length + 3, size=(2, s_q, width))
    routes[0, 4, 1] = routes[0, 4, 0]  # a repeated ID in a row
    routes[1, 7, 2] = 2**62 + 5  # huge int64: padding, never wrapped into range
    return routes


def test_flat_unions_match_the_oracle():
    """build_flat_unions gives each flat program's exact union (programs of 32 pairs at
    G = 12, spanning up to 4 rows), from non-contiguous int64 routes."""
    rng = _fresh_rng()
    s_q, kv_length, group = 23, 30, 12
    routes = _flat_routes(rng, s_q, kv_length)
    raw = torch.from_numpy(routes.transpose(0, 2, 1).copy()).to(DEVICE).transpose(1, 2)  # non-contiguous
    plan = make_plan(group, 16, BlockSizes(block_m=32, flatten_heads=True))
    unions = triton_qsa.build_flat_unions(raw, kv_length, plan)
    assert unions.rows_per_tile == 4
    assert_unions_equal(_numpy(unions), flat_unions(routes, kv_length, group, 32, 4))


@pytest.mark.parametrize("group, pairs, s_q", [
    (12, 64, 45),  # 192 pairs per 16-row tile = 3 programs of 64
    (6, 64, 70),  # 192 pairs per 32-row tile, row 31 routed
    (3, 16, 33),
])
def test_flat_unions_cut_from_tiles_equal_unions_sorted_per_program(group, pairs, s_q):
    """Both recipes of flat unions: cut out of taller tiles (where those hold whole
    programs; the default) and each program's rows sorted by the key kernel (PAIRS
    mode; else) give the oracle's unions, element for element."""
    rng = _fresh_rng()
    kv_length, width = 50, 7
    routes = _union_routes(rng, kv_length, width, s_q)
    raw = torch.from_numpy(routes).to(DEVICE)
    plan = make_plan(group, 16, BlockSizes(block_m=pairs, flatten_heads=True))
    assert plan.flat and plan.fwd_heads == pairs
    want = flat_unions(routes, kv_length, group, pairs, flat_span(pairs, group))
    _, cut = _recipe(plan, routes, kv_length)
    assert cut is not None  # the default recipe cuts tile unions
    assert_unions_equal(_numpy(triton_qsa.build_unions(raw, kv_length, plan)), want, "cut")
    n_programs = plan.n_tiles(s_q)
    per_program = SortStep(plan.rows_per_tile, n_programs, cut.width,
                           KeyPlan.make(2 * n_programs, plan.rows_per_tile, width, kv_length), pairs, group)
    assert_unions_equal(_numpy(driver.sorted_unions(ADAPTER, raw, kv_length, per_program)), want, "sorted")


def _recipe(plan, routes, kv_length):
    from qsa_triton.plan import union_recipe

    bsz, s_q, k = routes.shape
    return union_recipe(plan, s_q, k, kv_length, bsz)


@pytest.mark.parametrize("rows, sub_rows, s_q, kv_length", [
    (8, 4, 45, 50),  # last tile partly empty, widths T * K and T' * K
    (32, 4, 45, 30),  # row 31 (int32's sign bit) routed; both widths capped at S_kv
    (16, 1, 33, 200),
])
def test_split_unions_equal_unions_built_at_the_finer_tiling(rows, sub_rows, s_q, kv_length):
    """Cutting T-row unions into T'-row ones gives exactly what a sort at T' gives:
    the oracle's IDs, counts, row bits and -1 / 0 padding."""
    rng = _fresh_rng()
    width = 9
    routes = _union_routes(rng, kv_length, width, s_q)
    raw = torch.from_numpy(routes).to(DEVICE)
    coarse = build_tile_unions(raw, kv_length, rows)
    got = driver.split_tile_unions(ADAPTER, coarse, sub_rows, width, s_q)
    assert got.rows_per_tile == sub_rows
    assert_unions_equal(_numpy(got), tile_unions(routes, kv_length, sub_rows))
    assert driver.split_tile_unions(ADAPTER, coarse, rows, width, s_q) is coarse
    with pytest.raises(ValueError):
        driver.split_tile_unions(ADAPTER, coarse, rows * 2, width, s_q)
    if rows < coarse.union.shape[2]:  # a K of 1 cannot have made unions this wide
        with pytest.raises(ValueError, match="top_k"):
            driver.split_tile_unions(ADAPTER, coarse, sub_rows, 1, s_q)


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
    plan = make_plan(heads[0] // heads[1], 16, blocks)
    assert plan.backward_rows < plan.rows_per_tile
    assert plan.backward_rows * plan.bwd_heads >= 16
    _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks, rng, 0.3)


def test_backward_rows_per_tile_is_validated():
    for bad in (0, 3, 64, 2.0):
        with pytest.raises(ValueError):
            BlockSizes(backward_rows_per_tile=bad)


def test_int64_offsets_against_the_oracle():
    """With 32-bit offsets ruled out (what the kernels do when an offset could pass
    2**31) they compute the same function; every other test runs the 32-bit path."""
    rng = _fresh_rng()
    problem = make_problem("packed", "adversarial", seed=int(rng.integers(2**31)), seq_len=30, width=7)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (6, 2), 16, "float32")
    plan = make_plan(3, 16, MEDIUM, offset_limit=0)
    launch = spec.forward_launch(plan, ((1, 30, 6, 16), (1, 1, 1, 1)), ((1, 30, 2, 16), (1, 1, 1, 1)),
                                 ((1, 30, 2, 16), (1, 1, 1, 1)), (1, 4, 20), 0.3, "float32", interpreted=True)
    assert dict(launch.params)["OFFS32"] is False
    got = _run_plan(plan, q, k, v, problem.routes, 0.3, do)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < 1e-5, name


def _head_dim_outermost(values: np.ndarray, stride_d: int) -> torch.Tensor:
    """``values`` [B, S, H, D] as a view whose head-dim stride is ``stride_d`` elements,
    over storage of ``(D - 1) * stride_d + B * S * H`` fp32 elements (untouched pages
    are never committed, so a huge stride costs address space, not memory)."""
    b, s, h, d = values.shape
    storage = torch.empty((d - 1) * stride_d + b * s * h, dtype=torch.float32, device=DEVICE)
    view = torch.as_strided(storage, values.shape, (s * h, h, 1, stride_d))
    view.copy_(torch.from_numpy(values))
    return view


@pytest.mark.parametrize("outermost", ["q, dO", "k, v"])
def test_head_dim_strides_past_int32_against_the_oracle(outermost):
    """Operands with the head dim outermost, so that (D - 1) * stride passes 2**31 while the
    stride itself fits int32: no offset may wrap (the kernels read outside the tensors when
    the Q/dO offsets, or with 64-bit K/V offsets the K/V head-dim term, did)."""
    rng = _fresh_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=6, width=4)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (2, 1), 16, "float32")
    stride_d = 2**31 // 15 + 8  # < 2**31, while 15 * stride_d > 2**31
    wide = {"q, dO": ("q", "do"), "k, v": ("k", "v")}[outermost]
    values = {"q": q, "k": k, "v": v, "do": do}
    tensors = {name: _head_dim_outermost(x, stride_d) if name in wide
               else torch.tensor(x, dtype=torch.float32, device=DEVICE) for name, x in values.items()}
    for name in wide:
        t = tensors[name]
        assert t.stride(-1) < 2**31 <= (t.shape[-1] - 1) * t.stride(-1)
    tq, tk, tv = (tensors[n].requires_grad_(True) for n in ("q", "k", "v"))
    out = triton_sparse_gqa_attention(tq, tk, tv, torch.from_numpy(problem.routes).to(DEVICE),
                                      softmax_scale=0.3, block_sizes=SMALL)
    out.backward(tensors["do"])
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, tq.grad, tk.grad, tv.grad), want):
        assert relative_error(got.detach().double().cpu().numpy(), ref) < 1e-5, name


@pytest.mark.parametrize("layout, family, heads, blocks", [
    ("packed", "adversarial", (6, 2), MEDIUM),  # padded tiles, head padding
    ("padded", "qsa", (12, 1), dataclasses.replace(SMALL, block_m=32, flatten_heads=True)),  # flat
    ("cp", "random", (4, 1), SMALL),  # partial last chunk: masked transposed adds
])
def test_transposed_dkdv_adds_against_the_oracle(layout, family, heads, blocks):
    """The backward's transposed dK/dV blocks (dV^T = dO^T P, dK^T = Q^T dS, masked
    per key along their second axis) and its recomputed dQ-store coordinates give the
    oracle's gradients with head padding, flat programs and a partial last chunk."""
    rng = _fresh_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=30,
                           **(dict(top_k=3) if family == "qsa" else dict(width=7)))
    _check_against_oracle(problem.routes, problem.kv_length, heads, 16, "float32", blocks,
                          np.random.default_rng(int(rng.integers(2**31))), 0.3)


def test_offsets_fit_int32_checks_the_largest_offset():
    assert offsets_fit_int32([(8, 32, 16, 1)])
    assert offsets_fit_int32([(2**27, 16, 16, 1)])  # (2**27 - 1) * 16 + 15 == 2**31 - 1
    assert not offsets_fit_int32([(8, 32, 16, 1), (2**27 + 1, 16, 16, 1)])
    assert not offsets_fit_int32([(8, 32, 16, 1)], limit=0)


@pytest.mark.parametrize("group, rows, fwd_heads, bwd_rows, bwd_heads", [
    (12, 16, 128, 16, 128),  # the tuned H200 shape: flat programs of 128 pairs spanning <= 16 rows
    (2, 32, 2, 32, 2),  # small groups: 32-row tiles (rowbits' limit), no cut needed
    (1, 32, 1, 32, 1),
    (64, 2, 64, 1, 64),  # a group wider than backward_block_m: 1 row, all heads
])
def test_default_plans(group, rows, fwd_heads, bwd_rows, bwd_heads):
    plan = make_plan(group, 256, triton_qsa.DEFAULT_BLOCK_SIZES)
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
    ((12, 0), None, 256, torch.bfloat16, False),
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
    plan = make_plan(12, 256, triton_qsa.DEFAULT_BLOCK_SIZES)
    assert plan.flat and plan.fwd_heads == plan.bwd_heads == 128
    # on a GPU in the dtype the configuration is for: fp32 tiles of 128 x 256 do not fit
    dtype = "float32" if DEVICE == "cpu" else "bfloat16"
    _check_against_oracle(problem.routes, problem.kv_length, (12, 1), 256, dtype,
                          triton_qsa.DEFAULT_BLOCK_SIZES, rng, 0.1)


def test_tile_unions_over_several_sorts():
    """Keys of 28 bits leave room for 8 tiles per int32 sort: with the minimum lowered
    to 4, 10 one-row tiles take two sorts (one partial); the unions are still every
    row's sorted distinct IDs (at 256, the default minimum, they take one int64 sort)."""
    rng = _fresh_rng()
    kv_length = 2**28 - 3
    routes = rng.integers(-2, kv_length + 2, size=(1, 10, 4))
    routes[0, 7, 1] = routes[0, 7, 0]
    routes[0, 3, :] = kv_length - 1
    raw = torch.from_numpy(routes).to(DEVICE)
    assert KeyPlan.make(10, 1, 4, kv_length).dtype == "int64"
    keys = KeyPlan.make(10, 1, 4, kv_length, min_groups=4)
    assert (keys.dtype, keys.per_sort) == ("int32", 8)
    step = SortStep(1, 10, 4, keys)
    want = tile_unions(routes, kv_length, 1)
    assert_unions_equal(_numpy(driver.sorted_unions(ADAPTER, raw, kv_length, step)), want, "two sorts")
    assert_unions_equal(_numpy(build_tile_unions(raw, kv_length, 1)), want, "one sort")


def test_launches_name_every_kernel_argument():
    """Each launch description passes exactly the kernel's parameters, in its signature
    order (inputs, fp32 scalars, outputs, then the rest), which jax_triton's positional
    calling convention needs; keyword passing makes torch indifferent to the order."""
    plan = make_plan(12, 256, triton_qsa.DEFAULT_BLOCK_SIZES)
    q = ((2, 40, 12, 256), spec.contiguous_strides((2, 40, 12, 256)))
    kv = ((2, 40, 1, 256), spec.contiguous_strides((2, 40, 1, 256)))
    routes = ((2, 40, 20), spec.contiguous_strides((2, 40, 20)))
    step, cut = _recipe(plan, np.zeros((2, 40, 20)), 40)
    union_shape = (2, cut.n_sub, cut.width)
    launches = [
        spec.forward_launch(plan, q, kv, kv, union_shape, 0.0625, "bfloat16", interpreted=False),
        spec.backward_launch(plan, q, kv, kv, q, q, union_shape, 0.0625, "bfloat16", interpreted=False),
        spec.backward_launch(plan, q, kv, kv, q, q, union_shape, 0.0625, "bfloat16", interpreted=False,
                             deterministic=True),
        spec.fixed_point_launch(kv[0], "bfloat16", 0.0625, 40 * 12, interpreted=False),
        spec.keys_launch(step, routes, 40, 65535),
        spec.merge_launch(step, 2, 20, interpreted=False),
        spec.cut_launch(cut, (2, step.n_groups, step.width), 65535, interpreted=False, fill=True),
        spec.rank_launch(step, routes, 40, 1, 2, interpreted=False, fill=True),
    ]
    for launch in launches:
        assert launch.arg_names() == tuple(spec.kernel(launch.kernel).arg_names), launch.kernel
    forward = dict(launches[0].params)
    assert launches[0].grid == (plan.n_tiles(40), 2) and forward["FOLD"] == 1
    assert (forward["T"], forward["HB"], forward["BLOCK_K"], forward["FLAT"]) == (1, 128, 64, True)
    assert (launches[0].num_warps, launches[0].num_stages) == (8, 3)
    # the fp32 scalars are rounded once, on the host, identically for every launcher
    assert launches[0].scalars == (("scale_log2", float(np.float32(0.0625 * spec.LOG2E))),)


@pytest.mark.parametrize("deterministic", [False, True])
def test_last_chunk_columns_past_the_union_add_nothing(deterministic):
    """A union's last chunk fills its columns past the count with IDs of the same union (no
    membership bits), so the loads and the adds run unmasked. Two tiles of 16-ID chunks: one
    whose union is one ID longer than a chunk (15 columns wrap to the union's start) and one
    of at most 4 IDs (most columns fall back to its first ID), next to an unrouted K/V row
    holding inf/NaN: every output and gradient is the float64 oracle's, in both backward
    modes."""
    rng = _fresh_rng()
    blocks = BlockSizes(block_m=16, block_k=16, backward_block_m=16, backward_block_k=16)
    seq_len, kv_length, width = 20, 80, 17
    long_pool = rng.choice(np.arange(1, kv_length), 17, replace=False)
    short_pool = rng.choice(np.arange(1, kv_length), 4, replace=False)
    routes = np.full((1, seq_len, width), -1, np.int32)
    for row in range(seq_len):
        if row < 16:  # the first 16-row tile: every row routes to all 17 IDs, in its own order
            routes[0, row] = rng.permutation(long_pool)
        else:  # the second tile (rows 16-19): 3 of the 4 IDs each
            routes[0, row, :3] = rng.choice(short_pool, 3, replace=False)
    counts = [len(np.unique(routes[0, rows][routes[0, rows] >= 0])) for rows in (slice(0, 16), slice(16, 20))]
    assert counts[0] == 17 and counts[1] <= 4, counts
    q, k, v, do = random_inputs(rng, routes, kv_length, (2, 2), 16, "float32")
    k[:, 0], v[:, 0] = np.inf, np.nan  # nobody routes to K/V row 0
    fn = lambda *a: triton_sparse_gqa_attention(*a, block_sizes=blocks, deterministic=deterministic)  # noqa: E731
    got = run_torch(fn, q, k, v, routes, 0.25, do, "float32", device=DEVICE)
    k[:, 0], v[:, 0] = 0.0, 0.0
    want = oracle_forward_backward(q, k, v, routes, 0.25, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        if name in ("dk", "dv"):  # row 0's own gradient: nobody routes to it, so it must be 0
            assert np.all(g[:, 0] == 0), f"{name} of the unrouted row is not 0"
        err = relative_error(g, w)
        assert err < TOLERANCE["float32"], f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("rows, pairs, group", [(32, 0, 1), (4, 0, 1), (4, 32, 12)])
def test_rank_unions_equal_sorted_unions(monkeypatch, window, rows, pairs, group, padded):
    """qsa_triton.union_rank: the unions of the keys / sort / merge recipe, element for
    element (unpadded: up to each count), from raw int64 routes with padding, out-of-range
    and repeated IDs, two batch rows, tiles (row 31's bit used) or flat programs (PAIRS),
    with every output and scratch buffer poisoned (the kernel zeroes its own marks), at
    an S_kv that is no multiple of 32 (a partial last word of IDs) and over more than one
    step of words per group, in one window of groups or several (each window's unions
    land at its own groups)."""
    from qsa_triton import launch as launch_spec
    from qsa_triton.launch import UNION_BLOCK

    if window is not None:
        monkeypatch.setattr(launch_spec, "rank_window", lambda *a: window)
    monkeypatch.setattr(_triton_launch, "new_buffer", _poisoned)
    rng = _fresh_rng()
    kv_length, width, s_q = 4 * UNION_BLOCK + 45, 9, 45
    assert -(-kv_length // 32) > UNION_BLOCK // 8  # words per step of the kernel's word pass
    routes = np.concatenate([adversarial_routes(kv_length, width=width, rng=rng)[None, :s_q],
                             random_routes(kv_length, width=width, rng=rng, causal=False)[None, :s_q]])
    routes[0, 3, :4] = routes[0, 3, 4:8]  # repeated IDs within a row
    routes[1, 7, 2] = 2**40  # past kv_length: padding, must not wrap
    routes[1, 9, :3] = [kv_length - 1, 31, 32]  # the last word's last ID, a word's top bit, the next word
    raw = torch.from_numpy(routes).to(DEVICE)
    n_groups = -(-s_q // rows) if not pairs else -(-s_q * group // pairs)
    step = SortStep(rows, n_groups, min(rows * width, kv_length), KeyPlan.make(2 * n_groups, rows, width, kv_length),
                    pairs, group)
    got = _numpy(driver.rank_unions(ADAPTER, raw, kv_length, step, padded=padded))
    assert_unions_equal(got, _numpy(driver.sorted_unions(ADAPTER, raw, kv_length, step)), up_to_count=not padded)
    want = tile_unions(routes, kv_length, rows) if not pairs else flat_unions(routes, kv_length, group, pairs, rows)
    assert_unions_equal(got, want, up_to_count=not padded)
    if rows == 32:
        assert (want[2] < 0).any(), "row 31's bit (int32's sign) should be set somewhere"


def test_rank_unions_over_many_route_steps(monkeypatch):
    """Groups of 32 rows x K = 40 routes (more than one step of UNION_BLOCK routes per
    pass) with IDs shared between rows (every rank placed by several routes), poisoned
    buffers: the sorted recipe's unions and the oracle's."""
    from qsa_triton.launch import UNION_BLOCK

    monkeypatch.setattr(_triton_launch, "new_buffer", _poisoned)
    rng = _fresh_rng()
    kv_length, width, s_q, rows = 200, 40, 70, 32
    assert rows * width > UNION_BLOCK
    routes = rng.integers(-3, kv_length + 3, size=(1, s_q, width))
    raw = torch.from_numpy(routes).to(DEVICE)
    n_groups = -(-s_q // rows)
    step = SortStep(rows, n_groups, min(rows * width, kv_length), KeyPlan.make(n_groups, rows, width, kv_length))
    want = _numpy(driver.sorted_unions(ADAPTER, raw, kv_length, step))
    assert_unions_equal(_numpy(driver.rank_unions(ADAPTER, raw, kv_length, step)), want, "rank")
    assert_unions_equal(want, tile_unions(routes, kv_length, rows))


def test_unpadded_flat_unions_from_poisoned_buffers(monkeypatch):
    """build_unions(padded=False), as the attention call builds them for its kernels alone:
    tile unions cut into flat programs, every buffer poisoned, neither the tiles' nor the
    programs' entries past their counts written; up to the counts, the oracle's unions."""
    monkeypatch.setattr(_triton_launch, "new_buffer", _poisoned)
    rng = _fresh_rng()
    s_q, kv_length, group, pairs = 40, 60, 12, 32
    routes = _flat_routes(rng, s_q, kv_length)
    plan = make_plan(group, 16, BlockSizes(block_m=pairs, flatten_heads=True))
    assert _recipe(plan, routes, kv_length)[1] is not None, "the tile-then-cut recipe"
    got = _numpy(triton_qsa.build_unions(torch.from_numpy(routes).to(DEVICE), kv_length, plan, padded=False))
    assert_unions_equal(got, flat_unions(routes, kv_length, group, pairs, flat_span(pairs, group)), up_to_count=True)
    assert (got[0] == -123456789).any(), "entries past the counts were written"


@pytest.mark.parametrize("capability, tuned", [((9, 0), True), ((10, 0), True), ((10, 3), True), ((8, 0), False),
                                               ((8, 6), False), ((11, 0), False), ((12, 0), False)])
def test_default_block_sizes_by_capability(capability, tuned):
    """Without the driver's figure (JAX), the tuned tiles go where the capability's blocks
    may take TUNED_SHARED_MEMORY (SM90, SM100); on SM90+ a driver's figure decides instead,
    and before SM90 the tiles are the safe ones whatever the figure."""
    from qsa_triton.config import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, TUNED_SHARED_MEMORY, default_block_sizes

    got = default_block_sizes(capability, 256, "bfloat16")
    assert got == (DEFAULT_BLOCK_SIZES if tuned else SAFE_BLOCK_SIZES)
    enough = DEFAULT_BLOCK_SIZES if capability >= (9, 0) else SAFE_BLOCK_SIZES
    assert default_block_sizes(capability, 256, "bfloat16", TUNED_SHARED_MEMORY) == enough
    assert default_block_sizes(capability, 256, "bfloat16", TUNED_SHARED_MEMORY - 1) == SAFE_BLOCK_SIZES


def test_driver_retries_narrower_configurations_that_fit():
    """``qsa_triton.driver.launch_fitting``: a configuration Triton cannot load for lack of
    shared memory (OutOfResources) gives way to the next of ``launch.attempts`` (one stage
    first); the attempt that fit is remembered per adapter, so the failing one is not tried
    again; other errors, and the last attempt's, propagate."""
    class OutOfResources(Exception):  # what triton.runtime.errors names it
        pass

    tried = []

    @dataclasses.dataclass(frozen=True)
    class Fake:
        most_stages: int
        fail_with: type = OutOfResources
        interpreted = False

        def launch(self, launch, arrays):
            tried.append((launch.num_stages, dict(launch.params)["BLOCK_K"]))
            if launch.num_stages > self.most_stages:
                raise self.fail_with("out of shared memory")
            return {"O": launch.kernel}

    plan = make_plan(3, 64, dataclasses.replace(SMALL, num_stages=3, block_k=64))
    q, kv = ((1, 40, 6, 64), (15360, 384, 64, 1)), ((1, 40, 2, 64), (5120, 128, 64, 1))

    def build(attempt):
        return spec.forward_launch(plan, q, kv, kv, (1, 10, 40), 0.125, "bfloat16", interpreted=False, attempt=attempt)

    assert driver.launch_fitting(Fake(1), build, plan, False, {}) == {"O": "forward"}
    assert tried == [(3, 64), (1, 64)]
    tried.clear()
    driver.launch_fitting(Fake(1), build, plan, False, {})
    assert tried == [(1, 64)]  # remembered
    tried.clear()
    with pytest.raises(OutOfResources):
        driver.launch_fitting(Fake(0), build, plan, False, {})
    assert tried[0] == (3, 64) and len(tried) == len(spec.attempts(plan, False))
    with pytest.raises(ValueError):
        driver.launch_fitting(Fake(1, ValueError), build, plan, False, {})
