"""The FA4 (SM90) backend: its preprocessing against brute force, its glue, its errors.

On CPU: ``_block_kinds``, ``_compact_blocks`` and ``_preprocess`` against loop
implementations; the whole public function (chunking, strides, empty-row
guards, gradients) against the float64 oracle with FA4 replaced by
:class:`FakeFA4`, a dense torch emulation that also checks every argument FA4
receives; every validation path reachable without a GPU. On an SM90 GPU with
flash-attn-4: the real backend through the shared contract base.
"""

from __future__ import annotations

import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest
import torch
from contract_base import BackendContract, random_inputs
from runners import run_torch

from qsa_common.generators import FAMILIES
from qsa_common.layouts import LAYOUTS, make_problem
from qsa_common.oracle import membership, oracle_forward_backward, relative_error
from qsa_torch import fa4_qsa
from qsa_torch.fa4_qsa import (
    _block_kinds,
    _chunks,
    _compact_blocks,
    _MaskEmptyRows,
    _preprocess,
    fa4_sparse_gqa_attention,
)

QB, KB = fa4_qsa.QUERY_BLOCK, fa4_qsa.KEY_BLOCK


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


# --------------------------------------------------------------- brute force
def brute_kinds(table: np.ndarray, block_keys: int) -> np.ndarray:
    """Tile classes by looping over tiles (edge tiles are cut, never full)."""
    b, s_q, s_kv = table.shape
    rows, cols = -(-s_q // QB), -(-s_kv // block_keys)
    kinds = np.zeros((b, rows, cols), dtype=np.int32)
    for i in range(b):
        for r in range(rows):
            for c in range(cols):
                tile = table[i, r * QB : (r + 1) * QB, c * block_keys : (c + 1) * block_keys]
                n = int(tile.sum())
                kinds[i, r, c] = 0 if n == 0 else 2 if n == QB * block_keys else 1
    return kinds


def brute_lists(kinds: np.ndarray) -> list[list[list[list[int]]]]:
    """``[kind 1/2][b][row]`` -> ascending list of columns."""
    return [
        [[[c for c in range(row.size) if row[c] == kind] for row in per_b] for per_b in kinds]
        for kind in (1, 2)
    ]


def assert_lists(count, index, expected) -> None:
    """count [B,1,R], index [B,1,R,C] int32 hold exactly ``expected[b][r]``, zero-padded."""
    assert count.dtype == torch.int32 and index.dtype == torch.int32
    assert count.is_contiguous() and index.is_contiguous()
    b, one, rows = count.shape
    assert one == 1 and index.shape[:3] == (b, 1, rows)
    for i in range(b):
        for r in range(rows):
            want = expected[i][r]
            n = int(count[i, 0, r])
            assert n == len(want)
            assert index[i, 0, r, :n].tolist() == want
            assert not index[i, 0, r, n:].any()


def random_table(rng, b, s_q, s_kv, block_keys) -> np.ndarray:
    """uint8 membership with a mix of empty, full and partial tiles and rows."""
    density = rng.choice([0.0, 0.01, 0.3, 0.97, 1.0])
    table = (rng.random((b, s_q, s_kv)) < density).astype(np.uint8)
    rows, cols = -(-s_q // QB), -(-s_kv // block_keys)
    for _ in range(3):
        i, r, c = rng.integers(b), rng.integers(rows), rng.integers(cols)
        table[i, r * QB : (r + 1) * QB, c * block_keys : (c + 1) * block_keys] = rng.integers(2)
    table[rng.integers(b), rng.integers(s_q)] = 0  # an empty row
    return table


SHAPES = [(1, 1, 1), (2, 128, 64), (1, 300, 200), (3, 257, 129), (2, 130, 511), (1, 512, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_keys", [64, 128])
def test_block_kinds_match_brute_force(shape, block_keys, rng):
    for _ in range(3):
        table = random_table(rng, *shape, block_keys)
        got = _block_kinds(torch.from_numpy(table), block_keys)
        assert got.dtype == torch.int32
        np.testing.assert_array_equal(got.numpy(), brute_kinds(table, block_keys))


def test_block_kinds_edge_tiles_are_never_full():
    table = torch.ones(1, QB + 5, KB + 3, dtype=torch.uint8)
    np.testing.assert_array_equal(_block_kinds(table, KB).numpy(), [[[2, 1], [1, 1]]])


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 9), (3, 17, 64), (1, 64, 3)])
def test_compact_blocks_match_brute_force(shape, rng):
    for _ in range(4):
        kinds = rng.choice(3, size=shape, p=rng.dirichlet(np.ones(3))).astype(np.int32)
        kinds[0, 0] = rng.integers(3)  # one uniform row: all absent, partial or full
        got = _compact_blocks(torch.from_numpy(kinds))
        assert len(got) == 4
        partial, full = brute_lists(kinds)
        assert_lists(got[0], got[1], partial)
        assert_lists(got[2], got[3], full)
        assert got[1].shape[-1] == shape[-1]


def allowed_from_lists(table, count, index, full_count, full_index, transposed=False):
    """Bool [B, S_q_pad, S_kv_pad]: what FA4 may attend to given a table and one pair of lists."""
    b = table.shape[0]
    rows, cols = table.shape[1] // QB, table.shape[2] // KB
    shape = (b, cols, rows) if transposed else (b, rows, cols)
    tiles = []
    for cnt, idx in ((count, index), (full_count, full_index)):
        dense = torch.zeros(*shape[:2], shape[2] + 1, dtype=torch.bool)
        valid = torch.arange(idx.shape[-1]) < cnt[:, 0, :, None]
        dense.scatter_(-1, torch.where(valid, idx[:, 0].long(), shape[2]), True)
        dense = dense[..., : shape[2]]
        tiles.append(dense.transpose(1, 2) if transposed else dense)
    expand = lambda t: t.repeat_interleave(QB, 1).repeat_interleave(KB, 2)  # noqa: E731
    return (expand(tiles[0]) & table.bool()) | expand(tiles[1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_preprocess_matches_brute_force(layout, family, rng):
    seq_len = int(rng.choice([130, 200, 256]))
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=seq_len, top_k=6)
    s_q, s_kv = problem.query_length, problem.kv_length
    want = membership(problem.routes, s_kv)
    for dtype in (torch.int64, torch.int32):
        info = np.iinfo(np.int32)
        routes = problem.routes
        if dtype == torch.int32:  # out-of-int32 values are padding either way
            routes = np.where((routes < info.min) | (routes > info.max), -1, routes)
        out = _preprocess(torch.from_numpy(routes).to(dtype), s_kv)
        assert len(out) == 10
        table, has_route = out[0], out[1]
        s_q_pad, s_kv_pad = -(-s_q // QB) * QB, -(-s_kv // KB) * KB
        assert table.dtype == torch.uint8 and table.shape == (routes.shape[0], s_q_pad, s_kv_pad)
        np.testing.assert_array_equal(table[:, :s_q, :s_kv].numpy(), want)
        assert not table[:, s_q:].any() and not table[:, :, s_kv:].any()
        assert has_route.dtype == torch.bool
        np.testing.assert_array_equal(has_route.numpy(), want.any(-1))
        kinds = brute_kinds(table.numpy(), KB)
        for lists, k in ((out[2:6], kinds), (out[6:10], kinds.transpose(0, 2, 1))):
            partial, full = brute_lists(k)
            assert_lists(lists[0], lists[1], partial)
            assert_lists(lists[2], lists[3], full)
        # the forward lists and the backward lists each cover exactly the routes
        np.testing.assert_array_equal(allowed_from_lists(table, *out[2:6]).numpy(), table.bool().numpy())
        np.testing.assert_array_equal(
            allowed_from_lists(table, *out[6:10], transposed=True).numpy(), table.bool().numpy()
        )


def test_preprocess_drops_huge_and_negative_ids():
    s = 8
    routes = torch.full((1, s, 4), 2**32 + 3, dtype=torch.int64)
    routes[0, :, 1] = -(2**40)
    routes[0, :, 2] = s  # one past the end
    routes[0, 1:, 3] = 5
    table, has_route, *_ = _preprocess(routes, s)
    assert table.sum() == s - 1 and table[0, 1:s, 5].all()
    assert has_route.tolist() == [[False] + [True] * (s - 1)]


# ------------------------------------------------- the glue, with FA4 faked
SENTINEL_MASK = object()


class FakeSparse(NamedTuple):
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor | None = None
    full_block_idx: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None


class FakeFA4:
    """Dense torch stand-in for ``flash_attn.cute.flash_attn_func``.

    Checks what the real kernel relies on (dtypes, strides, padded table, list
    shapes and order, consistent forward/backward lists), attends to exactly the
    entries the lists and table allow, and, like a careless kernel, leaves NaN
    in rows with nothing to attend to. Counts its calls.
    """

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, *, softmax_scale, mask_mod, aux_tensors,
                 block_sparse_tensors, block_sparse_tensors_bwd):
        self.calls += 1
        assert mask_mod is SENTINEL_MASK
        for t in (q, k, v):
            assert t.dtype == torch.bfloat16 and t.stride(-1) == 1
        (table,) = aux_tensors
        b, s_q, hq, _ = q.shape
        s_kv, hkv = k.shape[1], k.shape[2]
        assert table.dtype == torch.uint8 and table.is_contiguous()
        assert table.shape == (b, -(-s_q // QB) * QB, -(-s_kv // KB) * KB)
        fwd, bwd = block_sparse_tensors, block_sparse_tensors_bwd
        assert fwd.block_size == bwd.block_size == (QB, KB)
        for lists, rows in ((fwd, table.shape[1] // QB), (bwd, table.shape[2] // KB)):
            for cnt, idx in ((lists.mask_block_cnt, lists.mask_block_idx),
                             (lists.full_block_cnt, lists.full_block_idx)):
                assert cnt.dtype == idx.dtype == torch.int32
                assert cnt.shape == (b, 1, rows) and idx.shape[:3] == (b, 1, rows)
                for i in range(b):
                    for r in range(rows):
                        got = idx[i, 0, r, : int(cnt[i, 0, r])]
                        assert bool((got[1:] > got[:-1]).all()), "lists must be ascending"
        allowed = allowed_from_lists(table, *fwd[:4])
        assert torch.equal(allowed, allowed_from_lists(table, *bwd[:4], transposed=True))
        allowed = allowed[:, :s_q, :s_kv]
        group = hq // hkv
        qf = q.float().transpose(1, 2)
        kf = k.float().transpose(1, 2).repeat_interleave(group, 1)
        vf = v.float().transpose(1, 2).repeat_interleave(group, 1)
        scores = (qf @ kf.transpose(-1, -2)) * softmax_scale
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        has = allowed.any(-1)[:, None, :, None]
        probs = torch.softmax(torch.where(has, scores, torch.zeros_like(scores)), dim=-1)
        out = (probs @ vf).transpose(1, 2)
        out = torch.where(has.transpose(1, 2), out, torch.full_like(out, float("nan")))
        lse = torch.logsumexp(scores, dim=-1)
        return out.to(torch.bfloat16), lse


@pytest.fixture
def fake_fa4(monkeypatch):
    fake = FakeFA4()
    monkeypatch.setattr(fa4_qsa, "_load_fa4", lambda: (fake, FakeSparse, SENTINEL_MASK))
    monkeypatch.setattr(fa4_qsa, "_check_device", lambda device: None)
    monkeypatch.setattr(fa4_qsa, "_compiled_preprocess", lambda: _preprocess)
    return fake


class TestGlueWithFakeFA4(BackendContract):
    """The public function on CPU, FA4 replaced by FakeFA4, against the oracle."""

    dtypes = ("bfloat16",)
    heads = ((4, 2), (3, 1))
    head_dim = 256
    seq_len = 136  # ragged: a partial last query tile
    top_k = 4
    families = ("qsa", "adversarial")  # "random" adds nothing here: see the preprocess tests

    @pytest.fixture(autouse=True)
    def _fake(self, fake_fa4):
        self.fake = fake_fa4

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_torch(fa4_sparse_gqa_attention, q, k, v, routes, scale, grad_out, dtype)


def test_chunked_calls_match_oracle(fake_fa4, monkeypatch, rng):
    problem = make_problem("padded", "random", seed=int(rng.integers(2**31)), seq_len=300, width=12)
    # room for 128 query rows of the 320-key padded table: 3 calls per batch row
    monkeypatch.setattr(fa4_qsa, "_TABLE_LIMIT", QB * 320 + 7)
    q, k, v, do = random_inputs(rng, problem.routes, 300, (4, 2), 256, "bfloat16")
    got = run_torch(fa4_sparse_gqa_attention, q, k, v, problem.routes, 0.1, do, "bfloat16")
    assert fake_fa4.calls == 2 * 3
    want = oracle_forward_backward(q, k, v, problem.routes, 0.1, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < 1e-2, name


def test_strided_inputs_and_routes(fake_fa4, rng):
    problem = make_problem("cp", "adversarial", seed=int(rng.integers(2**31)), seq_len=256, width=8)
    s_q, s_kv = problem.query_length, problem.kv_length
    q, k, v, do = random_inputs(rng, problem.routes, s_kv, (4, 2), 256, "bfloat16")
    bf = dict(dtype=torch.bfloat16)
    q_base = torch.tensor(q.transpose(0, 2, 1, 3).copy(), **bf, requires_grad=True)
    k_base = torch.tensor(np.repeat(k, 2, axis=-1), **bf, requires_grad=True)  # last stride 2
    v_base = torch.tensor(v.transpose(0, 2, 1, 3).copy(), **bf, requires_grad=True)
    tq, tk, tv = q_base.transpose(1, 2), k_base[..., ::2], v_base.transpose(1, 2)
    routes = torch.from_numpy(np.ascontiguousarray(problem.routes.transpose(0, 2, 1))).transpose(1, 2)
    assert not (tq.is_contiguous() or tk.is_contiguous() or tv.is_contiguous() or routes.is_contiguous())
    out = fa4_sparse_gqa_attention(tq, tk, tv, routes, 0.2)
    grads = torch.autograd.grad(out, (tq, tk, tv), torch.tensor(do, **bf))
    want = oracle_forward_backward(q, k, v, problem.routes, 0.2, do)
    for got, ref in zip((out, *grads), want):
        assert relative_error(got.detach().double().numpy(), ref) < 1e-2
    assert out.is_contiguous() and out.shape == (1, s_q, 4, 256)


def test_output_is_independent(fake_fa4, rng):
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=64, top_k=2)
    q, k, v, _ = (torch.tensor(x, dtype=torch.bfloat16)
                  for x in random_inputs(rng, problem.routes, 64, (2, 1), 256, "bfloat16"))
    routes = torch.from_numpy(problem.routes)
    out = fa4_sparse_gqa_attention(q, k, v, routes)
    before = [t.clone() for t in (q, k, v, routes)]
    out.fill_(7.0)
    for t, b in zip((q, k, v, routes), before):
        assert torch.equal(t, b)


# ------------------------------------------------------ empty rows, order 1
def test_mask_empty_rows_zeroes_nan_and_gradients():
    out = torch.randn(2, 5, 3, 4, requires_grad=True)
    has = torch.tensor([[True, False, True, True, False], [False, True, True, True, False]])
    junk = torch.tensor([float("nan"), float("inf")]).repeat(3)[:5]  # what a kernel may leave
    poisoned = torch.where(has[:, :, None, None], out, junk[None, :, None, None])
    got = _MaskEmptyRows.apply(poisoned, has)
    assert torch.isfinite(got[has]).all() and (got[~has] == 0).all()
    (grad,) = torch.autograd.grad(got, out, torch.randn_like(got))
    assert (grad[~has] == 0).all() and (grad[has] != 0).any()


def test_higher_order_gradients_raise():
    out = torch.randn(1, 3, 2, 4, requires_grad=True)
    got = _MaskEmptyRows.apply(out * 2, torch.tensor([[True, False, True]]))
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(got.sum(), out, create_graph=True)


# ----------------------------------------------------------------- errors
def _args(d=256, dtype=torch.bfloat16, device="cpu", b=1, s=8, hq=4, hkv=2):
    return dict(
        query=torch.randn(b, s, hq, d, dtype=dtype, device=device),
        key=torch.randn(b, s, hkv, d, dtype=dtype, device=device),
        value=torch.randn(b, s, hkv, d, dtype=dtype, device=device),
        selected_token_ids=torch.randint(-1, s, (b, s, 3), device=device),
    )


def _replace(**changes):
    args = _args()
    args.update({k: fn(args[k]) for k, fn in changes.items()})
    return args


ERRORS = {
    "float32": (_args(dtype=torch.float32), None, TypeError, "query"),
    "float16": (_args(dtype=torch.float16), None, TypeError, "query"),
    "key dtype": (_replace(key=lambda t: t.float()), None, TypeError, "key"),
    "head dim 128": (_args(d=128), None, ValueError, "head dim"),
    "cpu tensors": (_args(), None, RuntimeError, "CUDA"),
    "meta tensors": (_args(device="meta"), None, RuntimeError, "CUDA"),
    "uint8 routes": (_replace(selected_token_ids=lambda t: t.clamp_min(0).to(torch.uint8)), None,
                     TypeError, "selected_token_ids"),
    "float routes": (_replace(selected_token_ids=lambda t: t.float()), None, TypeError,
                     "selected_token_ids"),
    "routes device": (_replace(selected_token_ids=lambda t: t.to("meta")), None, ValueError,
                      "selected_token_ids is on"),
    "routes rows": (_replace(selected_token_ids=lambda t: t[:, :-1]), None, ValueError,
                    "selected_token_ids"),
    "heads": (_replace(query=lambda t: t[:, :, :3]), None, ValueError, "multiple"),
    "empty": (_replace(selected_token_ids=lambda t: t[..., :0]), None, ValueError, "empty"),
    "value shape": (_replace(value=lambda t: t[:, :-1]), None, ValueError, "value"),
    "nan scale": (_args(), float("nan"), ValueError, "softmax_scale"),
    "zero scale": (_args(), 0.0, ValueError, "softmax_scale"),
    "string scale": (_args(), "0.1", TypeError, "softmax_scale"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_validation(case):
    args, scale, exc, text = ERRORS[case]
    with pytest.raises(exc, match=text):
        fa4_sparse_gqa_attention(**args, softmax_scale=scale)


@pytest.fixture
def deterministic():
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    yield torch.use_deterministic_algorithms
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_deterministic_backward_is_refused(deterministic):
    deterministic(True)
    args = _args()
    args["key"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="deterministic"):
        fa4_sparse_gqa_attention(**args)
    with torch.no_grad():  # no backward wanted: the next check (device) speaks
        with pytest.raises(RuntimeError, match="CUDA"):
            fa4_sparse_gqa_attention(**args)
    deterministic(True, warn_only=True)
    with pytest.warns(UserWarning, match="deterministic"), pytest.raises(RuntimeError, match="CUDA"):
        fa4_sparse_gqa_attention(**args)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_non_sm90_gpus_are_refused(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with pytest.raises(RuntimeError, match="SM90"):
        fa4_qsa._check_device(torch.device("cuda", 0))


def test_sm90_is_accepted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fa4_qsa._check_device(torch.device("cuda", 0))


def test_missing_flash_attn_raises_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    fa4_qsa._load_fa4.cache_clear()
    try:
        with pytest.raises(ImportError, match="flash-attn-4"):
            fa4_qsa._load_fa4()
    finally:
        fa4_qsa._load_fa4.cache_clear()


def test_import_pulls_in_no_optional_runtime():
    code = (
        "import sys, qsa_torch.fa4_qsa\n"
        "bad = [m for m in ('flash_attn', 'cutlass', 'torch._inductor', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_chunks_cover_every_row_once(rng):
    for _ in range(20):
        b, s_q, s_kv = int(rng.integers(1, 4)), int(rng.integers(1, 700)), int(rng.integers(1, 700))
        kv_pad = -(-s_kv // KB) * KB
        limit = int(rng.integers(QB * kv_pad, 4 * QB * kv_pad * b + 2))
        plan = _chunks(b, s_q, s_kv, limit=limit)
        seen = np.zeros((b, s_q), dtype=int)
        for batch_rows, rows in plan:
            seen[batch_rows, rows] += 1
            n_b = batch_rows.stop - batch_rows.start
            n_q = rows.stop - rows.start
            assert n_b * -(-n_q // QB) * QB * kv_pad <= limit
            assert rows.start % QB == 0
        assert (seen == 1).all()
        starts = [(bs.start, rs.start) for bs, rs in plan]
        assert starts == sorted(starts)
    assert _chunks(2, 100, 100) == [(slice(0, 2), slice(0, 100))]
    with pytest.raises(ValueError, match="too long"):
        _chunks(1, 10, 2**24 + 1)


def test_memory_is_checked_before_anything_is_built(monkeypatch):
    """At S = 262144 (max_position_embeddings) the tables take 64 GiB, all kept for the
    backward: ~70 GiB with their construction, which an empty H200 (143771 MiB) holds,
    so FA4 is not refused there by memory; a smaller free budget is refused up front,
    before flash-attn-4 is imported or anything allocated (meta tensors, no GPU)."""
    from qsa_torch.routes import ProblemDims

    s, h200 = 262144, 143771 * 2**20
    dims = ProblemDims(1, s, s, 24, 2, 256, 2052)
    tables, need = fa4_qsa._memory_needed(dims, needs_grad=True)
    assert tables == s * s and 64 * 2**30 < need < 72 * 2**30
    forward_only = fa4_qsa._memory_needed(dims, needs_grad=False)[1]
    assert forward_only < 8 * 2**30  # one FA4 call's table (< 2 GiB) at a time
    fa4_qsa._check_memory(dims, True, h200)  # fits: no error
    fa4_qsa._check_memory(dims, True, None)  # off CUDA: not checked
    with pytest.raises(torch.OutOfMemoryError, match=r"take 64\.00 GiB.*kept for the backward.*7[01]\.\d\d GiB"):
        fa4_qsa._check_memory(dims, True, 64 * 2**30)
    fa4_qsa._check_memory(dims, False, 64 * 2**30)  # forward only fits there

    monkeypatch.setattr(fa4_qsa, "_check_device", lambda device: None)
    monkeypatch.setattr(fa4_qsa, "_available_bytes", lambda device: 40 * 2**30)
    monkeypatch.setattr(fa4_qsa, "_load_fa4", lambda: pytest.fail("FA4 must not load"))
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(1, s, 24, 256, requires_grad=True, **meta)
    kv = torch.empty(1, s, 2, 256, **meta)
    routes = torch.empty(1, s, 2052, dtype=torch.int32, device="meta")
    with pytest.raises(torch.OutOfMemoryError, match="fa4_sparse_gqa_attention: the membership tables"):
        fa4_sparse_gqa_attention(q, kv, kv, routes)


# --------------------------------------------------------------------- GPU
@pytest.mark.gpu
class TestFA4OnGPU(BackendContract):
    """The real backend (needs an SM90 GPU and flash-attn-4)."""

    dtypes = ("bfloat16",)
    heads = ((24, 2), (12, 1))
    head_dim = 256
    seq_len = 200
    top_k = 8

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_torch(fa4_sparse_gqa_attention, q, k, v, routes, scale, grad_out, dtype,
                         device="cuda")


@pytest.mark.parametrize("target", ["q", "do"])
def test_non_finite_rows_reach_only_their_routes(fake_fa4, target):
    """NaN in two routed rows' q or dO (tests/test_nan_confinement.py's float64 judge):
    FakeFA4's softmax over whole masked rows leaks a NaN query row into dV at every key
    (P^T dO with P NaN), which the wrapper around the kernel keeps to the row's routes."""
    from test_nan_confinement import _hopper_case, _run_torch, check

    case = _hopper_case((4, 2), target, int(np.random.SeedSequence().entropy % 2**32))
    check(case, _run_torch(fa4_sparse_gqa_attention, case, dtype="bfloat16"), tol=5e-2)
