"""The KV-owning deterministic dK/dV backward (qsa_triton.kv_backward) and its inverse
route index, against the float64 oracle and brute force.

Without a CUDA GPU the kernels run in Triton's interpreter on CPU tensors (this module
sets TRITON_INTERPRET=1 before triton is first imported, as test_triton_qsa does). The
forward's LSE and output come from float64 numpy here, rounded as a kernel would hand
them over, except in the test that chains the Triton forward. Shapes are tiny.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from contract_base import TOLERANCE, random_inputs  # noqa: E402
from qsa_common.generators import adversarial_routes, qsa_format_routes, random_routes  # noqa: E402
from qsa_common.layouts import make_problem  # noqa: E402
from qsa_common.oracle import membership, oracle_forward_backward, relative_error  # noqa: E402
from qsa_torch import _triton_deterministic as det  # noqa: E402
from qsa_torch import _triton_launch  # noqa: E402
from qsa_torch._triton_deterministic import (  # noqa: E402
    KVBlockSizes,
    attention_delta,
    build_inverse_index,
    deterministic_dk_dv,
)

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


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) (what selects this backward): none of the
    torch ops used may refuse to run."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


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
