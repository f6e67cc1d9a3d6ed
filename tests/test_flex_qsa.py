"""The FlexAttention backend (``qsa_torch.flex_qsa``).

On CPU (CI): the forward through the shared contract base (uncompiled
FlexAttention, every layout and route family), the membership table, the int64
flat offset and the BlockMask tile lists against brute force, every validation
path, and the CPU-backward error. Gradients need a GPU: the ``gpu`` tests run the
same contract with the backward, in bf16 and fp32.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from contract_base import TOLERANCE, BackendContract, random_inputs
from runners import run_torch
from test_validation import CASES, good

from qsa_common.generators import adversarial_routes
from qsa_common.layouts import make_problem
from qsa_common.oracle import membership, oracle_forward_backward, relative_error
from qsa_torch import flex_qsa
from qsa_torch.flex_qsa import flex_sparse_gqa_attention
from qsa_torch.routes import ProblemDims

T = flex_qsa._TILE


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


# ------------------------------------------------------------ contract (forward)


class TestFlexCpuForward(BackendContract):
    """Uncompiled FlexAttention on CPU: outputs only (no CPU backward in torch)."""

    dtypes = ("float32", "bfloat16")
    has_backward = False

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_torch(flex_sparse_gqa_attention, q, k, v, routes, scale, grad_out, dtype,
                         backward=False)


def test_cpu_forward_past_one_tile_and_strided_inputs(rng):
    """Several ragged 128-tiles, CP shape (S_q != S_kv), views and strided routes."""
    problem = make_problem("cp", "adversarial", seed=int(rng.integers(2**31)), seq_len=520,
                           width=24, world_size=2, rank=1)
    q, k, v, _ = random_inputs(rng, problem.routes, problem.kv_length, (6, 2), 16, "float32")
    # [B,S,H,D] views over [B,H,S,D] storage; routes as every other column of a wider array
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3).copy(), dtype=torch.float32).transpose(1, 2)
                  for x in (q, k, v))
    routes = torch.from_numpy(np.repeat(problem.routes, 2, axis=-1))[..., ::2]
    assert not tq.is_contiguous() and not routes.is_contiguous()
    out = flex_sparse_gqa_attention(tq, tk, tv, routes, 0.3)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3)[0]
    assert relative_error(out.double().numpy(), want) < 1e-5
    empty = ~membership(problem.routes, problem.kv_length).any(-1)
    assert empty.any() and torch.all(out[torch.from_numpy(empty)] == 0)


# ------------------------------------------------------------ membership and offsets


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_routes_to_membership_matches_brute_force(rng, dtype):
    routes = np.stack([adversarial_routes(40, width=9, rng=rng) for _ in range(2)])
    if dtype == torch.int32:
        routes = np.where((routes < -(2**31)) | (routes >= 2**31), -1, routes)
    kv_length = 37  # IDs 37..39 and doc-end padding are out of range here
    table, has_route = flex_qsa._routes_to_membership(torch.from_numpy(routes).to(dtype), kv_length)
    want = np.zeros((2, 40, kv_length), dtype=bool)
    for b, i, j in np.ndindex(routes.shape):
        r = int(routes[b, i, j])
        if 0 <= r < kv_length:
            want[b, i, r] = True
    assert table.dtype == torch.bool and table.is_contiguous()
    np.testing.assert_array_equal(table.numpy(), want)
    np.testing.assert_array_equal(has_route.numpy(), want.any(-1))
    assert not has_route.all() and has_route.any()


def test_flat_offset_is_int64_past_2_31(rng):
    shapes = [(1, 49152, 49152), (3, 46341, 46341), (2, 70001, 40009), (5, 1, 2**31 - 1)]
    for batch, s_q, s_kv in shapes:
        n = 500
        b = rng.integers(0, batch, n)
        q = rng.integers(0, s_q, n)
        kv = rng.integers(0, s_kv, n)
        # the corners, where the largest offsets are
        b[:2], q[:2], kv[:2] = batch - 1, s_q - 1, [s_kv - 1, 0]
        got = flex_qsa._membership_flat_offset(
            *(torch.from_numpy(x.astype(np.int32)) for x in (b, q, kv)), s_q, s_kv
        )
        want = [(int(bi) * s_q + int(qi)) * s_kv + int(ki) for bi, qi, ki in zip(b, q, kv)]
        assert got.dtype == torch.int64
        assert got.tolist() == want
        assert max(want) == batch * s_q * s_kv - 1 and max(want) >= 2**31
        # an int32 evaluation would have wrapped: the check above can fail
        wrapped = ((b.astype(np.int32) * np.int32(s_q) + q.astype(np.int32)) * np.int32(s_kv)
                   + kv.astype(np.int32))
        assert (wrapped.astype(np.int64) != np.array(want)).any()


def test_mask_mod_reads_the_table_and_clamps(rng):
    table = torch.from_numpy(rng.random((2, 19, 23)) < 0.4)
    mask_mod = flex_qsa._membership_mask_mod(table)
    b = torch.tensor(rng.integers(0, 2, 300), dtype=torch.int32)
    q = torch.tensor(rng.integers(0, 19 + 5, 300), dtype=torch.int32)  # some past the end
    kv = torch.tensor(rng.integers(0, 23 + 5, 300), dtype=torch.int32)
    got = mask_mod(b, torch.zeros_like(b), q, kv)
    want = table[b.long(), q.clamp(max=18).long(), kv.clamp(max=22).long()]
    assert torch.equal(got, want)


# ------------------------------------------------------------ BlockMask tile lists


def _brute_tiles(table: np.ndarray):
    """Python loops over tiles: (partial, full) bool [B, n_q, n_kv]."""
    bsz, s_q, s_kv = table.shape
    n_q, n_kv = -(-s_q // T), -(-s_kv // T)
    partial = np.zeros((bsz, n_q, n_kv), dtype=bool)
    full = np.zeros_like(partial)
    for b, i, j in np.ndindex(bsz, n_q, n_kv):
        cells = table[b, i * T:(i + 1) * T, j * T:(j + 1) * T]
        count = int(cells.sum())
        full[b, i, j] = count == T * T
        partial[b, i, j] = 0 < count < T * T
    return partial, full


def _tile_test_routes(rng, bsz, s_q, s_kv, width):
    routes = rng.integers(-3, s_kv + 3, size=(bsz, s_q, width))
    routes[rng.random((bsz, s_q, width)) < 0.7] = -1
    routes[(routes >= 0) & (routes < T)] = -1  # key tile 0 stays empty
    routes[:, 100:120] = -1  # empty rows
    # full tile (0, 1) in batch 0; the same tile minus one cell in the last batch row
    routes[0, :T, :T] = np.arange(T, 2 * T)
    routes[-1, :T, :T] = np.arange(T, 2 * T)
    routes[-1, 5, 7] = -1
    routes[-1, 5][routes[-1, 5] == T + 7] = -1  # no random slot may restore that cell
    # the ragged corner tile entirely covered where it exists: still only partial
    last_q, last_kv = (s_q // T) * T, (s_kv // T) * T
    if last_q < s_q and last_kv < s_kv:
        routes[:, last_q:, T:T + s_kv - last_kv] = np.arange(last_kv, s_kv)
    return routes


@pytest.mark.parametrize("bsz,s_q,s_kv", [(2, 300, 520), (2, 384, 256), (3, 130, 640)])
def test_block_mask_lists_match_brute_force(rng, bsz, s_q, s_kv):
    routes = _tile_test_routes(rng, bsz, s_q, s_kv, width=T + 40)
    table, _ = flex_qsa._routes_to_membership(torch.from_numpy(routes), s_kv)
    partial, full = _brute_tiles(table.numpy())
    assert full[0, 0, 1] and not full[-1, 0, 1] and partial[-1, 0, 1]
    assert partial.any() and (~partial & ~full).any()
    bm = flex_qsa._block_mask_from_table(table)
    assert bm.seq_lengths == (s_q, s_kv) and tuple(bm.BLOCK_SIZE) == (T, T)
    lists = {"kv": (bm.kv_num_blocks, bm.kv_indices, partial),
             "full_kv": (bm.full_kv_num_blocks, bm.full_kv_indices, full),
             "q": (bm.q_num_blocks, bm.q_indices, partial.transpose(0, 2, 1)),
             "full_q": (bm.full_q_num_blocks, bm.full_q_indices, full.transpose(0, 2, 1))}
    for name, (counts, indices, kinds) in lists.items():
        assert counts.dtype == torch.int32 and indices.dtype == torch.int32, name
        assert counts.shape == (bsz, 1, kinds.shape[1]), name
        assert indices.shape == (bsz, 1) + kinds.shape[1:], name
        for b, row in np.ndindex(kinds.shape[:2]):
            cols = np.nonzero(kinds[b, row])[0]
            n = int(counts[b, 0, row])
            assert n == cols.size, (name, b, row)
            assert indices[b, 0, row, :n].tolist() == cols.tolist(), (name, b, row)
    dense = bm.to_dense()[:, 0].numpy().astype(bool)
    np.testing.assert_array_equal(dense, partial | full)


def test_compiled_kernel_honours_the_tile_lists(rng):
    """The uncompiled CPU path ignores the tile lists; inductor's CPU kernel reads
    them as the CUDA one does, so compile it here (~20 s) to check them end to end."""
    from torch.nn.attention.flex_attention import BlockMask

    s_q, s_kv = 300, 520
    routes = _tile_test_routes(rng, 2, s_q, s_kv, width=T + 40)
    table, has_route = flex_qsa._routes_to_membership(torch.from_numpy(routes), s_kv)
    bm = flex_qsa._block_mask_from_table(table)
    q, k, v, _ = random_inputs(rng, routes, s_kv, (4, 2), 16, "float32")
    tensors = [torch.tensor(x, dtype=torch.float32).transpose(1, 2) for x in (q, k, v)]
    compiled = flex_qsa._compile_flex()

    def run(block_mask):
        out = compiled(*tensors, block_mask=block_mask, scale=0.25, enable_gqa=True).transpose(1, 2)
        return torch.where(has_route[:, :, None, None], out, 0).double().numpy()

    want = oracle_forward_backward(q, k, v, routes, 0.25)[0]
    assert relative_error(run(bm), want) < 1e-5
    # the same mask without its full tiles: the planted full tile's rows must change
    no_full = BlockMask.from_kv_blocks(
        kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
        full_kv_num_blocks=torch.zeros_like(bm.full_kv_num_blocks),
        full_kv_indices=bm.full_kv_indices, BLOCK_SIZE=T, mask_mod=bm.mask_mod,
        seq_lengths=bm.seq_lengths)
    assert relative_error(run(no_full)[0, :T], want[0, :T]) > 1e-2


def test_tile_counts_match_brute_force(rng):
    table = torch.from_numpy(rng.random((2, 290, 400)) < 0.6)
    table[0, :256, :256] = True
    counts = flex_qsa._tile_counts(table)
    want = np.zeros((2, 3, 4), dtype=np.int64)
    for b, i, j in np.ndindex(want.shape):
        want[b, i, j] = int(table[b, i * T:(i + 1) * T, j * T:(j + 1) * T].sum())
    np.testing.assert_array_equal(counts.numpy(), want)
    assert (counts[0, :2, :2] == T * T).all()


# ------------------------------------------------------------ bucketed compilation


def test_bucket_lengths():
    assert [flex_qsa.bucket_length(n) for n in (1, 128, 129, 2048, 2049, 4096, 4097)] == [
        128, 128, 256, 2048, 2304, 4096, 4608]
    assert flex_qsa.bucket_length(262144) == 262144 and flex_qsa.bucket_length(262145) == 294912
    assert [flex_qsa.bucket_batch(b) for b in (1, 16, 17, 33, 33000)] == [1, 16, 18, 36, 36864]
    for n in range(1, 20000, 37):
        padded = flex_qsa.bucket_length(n)
        assert padded >= n and padded % T == 0 and padded == flex_qsa.bucket_length(padded)
        assert n <= 2048 or padded <= 1.125 * n
        b = flex_qsa.bucket_batch(n)
        assert n <= b <= 1.125 * n and b == flex_qsa.bucket_batch(b)
    # 8 buckets per octave past 2048: a run over S in [128, 32768] needs 48
    assert len({flex_qsa.bucket_length(n) for n in range(1, 32769)}) == 48


# (B, S_q, S_kv): 12 shapes in 7 buckets, CP shapes (S_q != S_kv) and ragged batches among them
_SHAPES = [(1, 100, 100), (1, 130, 130), (1, 250, 256), (2, 40, 90), (2, 60, 128), (1, 64, 300),
           (3, 33, 33), (3, 128, 1), (17, 20, 20), (18, 7, 100), (1, 20, 2050), (1, 30, 2300)]


def _bucketed_case(rng, batch, s_q, s_kv, width=6):
    routes = rng.integers(-2, s_kv + 3, size=(batch, s_q, width))
    routes[:, ::5] = -1  # empty rows
    routes[:, 1::7, 0] = 2**40  # huge IDs
    q, k, v, _ = random_inputs(rng, routes, s_kv, (4, 2), 16, "float32")
    tensors = [torch.tensor(x, dtype=torch.float32) for x in (q, k, v)]
    return routes, (q, k, v), tensors


def test_bucketed_path_compiles_each_bucket_once_with_a_counting_compiler(rng, monkeypatch):
    """The CUDA path's mechanism on CPU: a stand-in compiler counts what it is asked to
    specialise (and runs FlexAttention eagerly); 12 shapes need 7 specialisations, all
    of bucketed shapes, and every result equals the oracle (forward only on CPU)."""
    import warnings

    built, seen = [], set()

    def counting_compiler(fn, **options):
        built.append(options)

        def run(q, k, v, **kwargs):
            seen.add((tuple(q.shape), tuple(k.shape), tuple(kwargs["block_mask"].kv_indices.shape)))
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*without torch.compile")
                return fn(q, k, v, **kwargs)

        return run

    cache = flex_qsa._CompiledFlex(counting_compiler)
    buckets = set()
    for batch, s_q, s_kv in _SHAPES:
        routes, arrays, tensors = _bucketed_case(rng, batch, s_q, s_kv)
        dims = ProblemDims(batch, s_q, s_kv, 4, 2, 16, routes.shape[2])
        with torch.no_grad():
            out = flex_qsa._attend_bucketed(*tensors, torch.from_numpy(routes), dims, 0.3, cache)
        want = oracle_forward_backward(*arrays, routes, 0.3)[0]
        assert out.shape == (batch, s_q, 4, 16)
        assert relative_error(out.numpy(), want) < 1e-5, (batch, s_q, s_kv)
        padded = flex_qsa._bucketed(dims)
        buckets.add((padded.batch, padded.query_length, padded.kv_length))
    assert built == [dict(fullgraph=True, dynamic=False)]  # one compiled function
    assert len(buckets) == 7 and len(seen) == len(buckets) == len(cache.shapes)
    for (qb, _, qs, _), (_, _, ks, _), _ in seen:
        assert (qb, qs, ks) in buckets and qs % T == 0 and ks % T == 0
    # a full cache refuses a new shape with a clear error and still runs the known ones
    monkeypatch.setattr(flex_qsa, "MAX_COMPILED_SHAPES", len(cache.shapes))
    routes, _, tensors = _bucketed_case(rng, 1, 600, 600)
    with pytest.raises(RuntimeError, match="MAX_COMPILED_SHAPES.*token-gather"), torch.no_grad():
        flex_qsa._attend_bucketed(*tensors, torch.from_numpy(routes),
                                  ProblemDims(1, 600, 600, 4, 2, 16, 6), 0.3, cache)
    routes, _, tensors = _bucketed_case(rng, 1, 99, 101)
    with torch.no_grad():
        flex_qsa._attend_bucketed(*tensors, torch.from_numpy(routes),
                                  ProblemDims(1, 99, 101, 4, 2, 16, 6), 0.3, cache)


def test_bucketed_path_compiles_each_bucket_once_with_dynamo(rng):
    """The same with real dynamo (aot_eager backend, so no inductor build): a new bucket
    adds exactly one compiled graph, a known one none (the fresh mask callback and table
    of each call do not recompile), more than dynamo's default limit of 8 shapes compile
    without an uncompiled fallback, and results equal the oracle."""
    import functools
    import warnings

    from torch._dynamo.utils import counters

    cache = flex_qsa._CompiledFlex(functools.partial(torch.compile, backend="aot_eager"))
    # 13 shapes, 11 buckets: past dynamo's default recompile_limit of 8
    shapes = [(b, 10 + b, 40 - b) for b in range(1, 12)] + [(1, 127, 128), (3, 100, 5)]
    for batch, s_q, s_kv in shapes:
        routes, arrays, tensors = _bucketed_case(rng, batch, s_q, s_kv)
        dims = ProblemDims(batch, s_q, s_kv, 4, 2, 16, routes.shape[2])
        known = len(cache.shapes)
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = flex_qsa._attend_bucketed(*tensors, torch.from_numpy(routes), dims, 0.3, cache)
        assert not [w for w in caught if "without torch.compile" in str(w.message)]
        assert counters["stats"]["unique_graphs"] - graphs == len(cache.shapes) - known
        want = oracle_forward_backward(*arrays, routes, 0.3)[0]
        assert relative_error(out.numpy(), want) < 1e-5, (batch, s_q, s_kv)
    assert len(cache.shapes) == 11 > torch._dynamo.config.recompile_limit


def test_a_refused_compile_raises_instead_of_running_uncompiled(rng):
    """What dynamo does past its recompile limit under fullgraph/fail_on_recompile_limit_hit
    reaches the caller as a RuntimeError; the settings of the call say so."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    settings = flex_qsa._dynamo_limits(100)
    assert settings["fail_on_recompile_limit_hit"] is True and settings["suppress_errors"] is False
    assert settings["recompile_limit"] >= 100 and settings["accumulated_recompile_limit"] >= 200

    def refusing_compiler(fn, **options):
        def run(*args, **kwargs):
            assert torch._dynamo.config.fail_on_recompile_limit_hit  # patched for the call
            raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")
        return run

    routes, _, tensors = _bucketed_case(rng, 1, 50, 50)
    with pytest.raises(RuntimeError, match="does not run uncompiled"), torch.no_grad():
        flex_qsa._attend_bucketed(*tensors, torch.from_numpy(routes), ProblemDims(1, 50, 50, 4, 2, 16, 6),
                                  0.3, flex_qsa._CompiledFlex(refusing_compiler))
    assert not torch._dynamo.config.fail_on_recompile_limit_hit  # restored


def test_table_is_refused_at_the_models_full_context():
    """S = 262144 (max_position_embeddings): 64 GiB of table, ~143 GiB while it is built,
    more than an H200 has (143771 MiB in all): refused before anything is allocated
    (meta tensors here; the memory query answers as an empty H200 would)."""
    s, h200 = 262144, 143771 * 2**20
    dims = ProblemDims(1, s, s, 24, 2, 256, 2052)
    assert flex_qsa._bucketed(dims) == dims
    with pytest.raises(torch.OutOfMemoryError, match=r"takes 64\.00 GiB.*about 14[0-9]\.\d\d GiB"):
        flex_qsa._check_table_fits(dims, h200)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(1, s, 24, 256, **meta)
    kv = torch.empty(1, s, 2, 256, **meta)
    routes = torch.empty(1, s, 2052, dtype=torch.int32, device="meta")
    original = flex_qsa._available_bytes
    flex_qsa._available_bytes = lambda device: h200
    try:
        with pytest.raises(torch.OutOfMemoryError, match="membership table"):
            flex_qsa._attend_bucketed(q, kv, kv, routes, dims, 1 / 16, flex_qsa._CompiledFlex(
                lambda *a, **k: pytest.fail("nothing may be compiled")))
    finally:
        flex_qsa._available_bytes = original


# ------------------------------------------------------------ errors


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation(case):
    args, scale, exc, text = CASES[case]
    if case == "unsigned routes":  # torch has no uint32 to hand over
        args = dict(args, selected_token_ids=np.abs(args["selected_token_ids"]).astype(np.uint8))
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in args.items()}
    with pytest.raises(exc, match=text):
        flex_sparse_gqa_attention(**tensors, softmax_scale=scale)


def _good_tensors(dtype=torch.float32):
    return {k: torch.from_numpy(v).to(dtype) if v.dtype.kind == "f" else torch.from_numpy(v)
            for k, v in good().items()}


def test_float64_is_not_accepted():
    with pytest.raises(TypeError, match="query"):
        flex_sparse_gqa_attention(**_good_tensors(torch.float64))


def test_mismatched_and_unsupported_devices():
    args = _good_tensors()
    args["value"] = args["value"].to("meta")
    with pytest.raises(ValueError, match="value is on meta"):
        flex_sparse_gqa_attention(**args)
    meta = {k: v.to("meta") for k, v in _good_tensors().items()}
    with pytest.raises(RuntimeError, match="CUDA or CPU"):
        flex_sparse_gqa_attention(**meta)


def test_cpu_backward_is_refused_clearly():
    for name in ("query", "key", "value"):
        args = _good_tensors()
        args[name].requires_grad_(True)
        with pytest.raises(RuntimeError, match="gradients need a CUDA device"):
            flex_sparse_gqa_attention(**args)
    # the same inputs run forward-only under no_grad
    args = _good_tensors()
    args["query"].requires_grad_(True)
    with torch.no_grad():
        out = flex_sparse_gqa_attention(**args)
    want = oracle_forward_backward(*(args[k].detach().double().numpy() for k in ("query", "key", "value")),
                                   args["selected_token_ids"].numpy(), 8**-0.5)[0]
    assert relative_error(out.double().numpy(), want) < 1e-5


def test_table_memory_is_checked_before_allocating():
    dims = ProblemDims(batch=1, query_length=49152, kv_length=49152, query_heads=12,
                       kv_heads=1, head_dim=256, routes_per_query=2052)
    table = 49152 * 49152
    need = flex_qsa._table_build_bytes(dims)
    assert need >= 2 * table  # the table and its scatter buffer at least
    flex_qsa._check_table_fits(dims, need)  # exactly enough: no error
    with pytest.raises(RuntimeError, match=r"selected_token_ids.*B\*S_q\*S_kv bytes") as err:
        flex_qsa._check_table_fits(dims, need - 1)
    assert isinstance(err.value, torch.OutOfMemoryError)
    assert "2.25 GiB" in str(err.value)  # the table's own size, 49152**2 bytes


def test_import_does_not_load_the_compiler():
    code = (
        "import sys, qsa_torch.flex_qsa\n"
        "bad = [m for m in ('torch._inductor', 'triton', 'torch.nn.attention.flex_attention')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------ GPU


@pytest.mark.gpu
class TestFlexCuda(BackendContract):
    """Compiled FlexAttention on CUDA: outputs and dq, dk, dv (bf16; fp32 below)."""

    dtypes = ("bfloat16",)
    has_backward = True

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_torch(flex_sparse_gqa_attention, q, k, v, routes, scale, grad_out, dtype,
                         device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_empty_rows_and_empty_tiles_give_exact_zeros(rng, dtype):
    s = 300
    routes = adversarial_routes(s, width=40, rng=rng)[None]
    routes[0, 128:256] = -1  # a whole empty query tile
    routes[0, ::7] = 2**40  # scattered rows with only padding
    q, k, v, do = random_inputs(rng, routes, s, (4, 2), 64, dtype)
    tdtype = getattr(torch, dtype)
    leaves = [torch.tensor(x, dtype=tdtype, device="cuda", requires_grad=True) for x in (q, k, v)]
    out = flex_sparse_gqa_attention(*leaves, torch.from_numpy(routes).cuda())
    out.backward(torch.tensor(do, dtype=tdtype, device="cuda"))
    empty = torch.from_numpy(~membership(routes, s).any(-1)).cuda()
    assert torch.all(out[empty] == 0) and torch.all(leaves[0].grad[empty] == 0)
    want = oracle_forward_backward(q, k, v, routes, 64**-0.5, do)
    got = [t.detach().double().cpu().numpy() for t in (out, *(x.grad for x in leaves))]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < TOLERANCE[dtype], name


@pytest.mark.gpu
def test_gpu_refuses_a_table_that_cannot_fit():
    s = 2**21  # a 4 TiB table
    q = torch.randn(1, s, 1, 16, device="cuda", dtype=torch.bfloat16)
    routes = torch.zeros(1, s, 1, dtype=torch.int32, device="cuda")
    before = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError, match="membership table"):
        flex_sparse_gqa_attention(q, q, q, routes)
    assert torch.cuda.memory_allocated() == before
