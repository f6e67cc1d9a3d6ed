"""The cuDNN Frontend backend (``qsa_torch.cudnn_qsa``).

Its kernels run only on SM100/SM103, which this project does not have. So:

* on CPU: index packing against brute force, every error path, and the whole adapter
  (packing, head groups, strides, autograd, saved FP32 output/LSE) through the shared
  contract tests, with ``cudnn.ops`` replaced by :class:`StandInOps`, a CPU model of the
  two kernels written from their documentation that also asserts the buffers the
  adapter hands them are what the kernels require;
* on a GPU (``gpu`` marker): on SM100/SM103 the same contract tests and a full-width
  problem against the real kernels; on any other GPU, that the call raises RuntimeError
  naming the requirement.
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch
from contract_base import BackendContract, random_inputs
from runners import run_torch

from qsa_common.layouts import make_problem
from qsa_common.oracle import relative_error
from qsa_torch import cudnn_qsa
from qsa_torch.cudnn_qsa import _pack_indices, cudnn_sparse_gqa_attention
from qsa_torch.routes import dense_aligned

HUGE = [2**31, 2**32 + 3, 2**40, 2**62, 2**63 - 1, -(2**31) - 1, -(2**40), -(2**63)]


def _on_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) in ((10, 0), (10, 3))


def _fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------- packing


def _pack_brute_force(routes: np.ndarray, seq_len: int) -> np.ndarray:
    batch, rows, width = routes.shape
    out = np.full((batch * rows, -(-width // 4) * 4), -1, dtype=np.int64)
    for b in range(batch):
        for i in range(rows):
            for j in range(width):
                r = int(routes[b, i, j])
                if 0 <= r < seq_len:
                    out[b * rows + i, j] = b * rows + r
    return out


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("batch,seq_len,width", [(1, 9, 1), (2, 7, 3), (3, 5, 4), (2, 6, 5), (4, 3, 13)])
def test_pack_indices_matches_brute_force(dtype, batch, seq_len, width):
    rng = _fresh_rng()
    routes = rng.integers(-3, seq_len + 3, size=(batch, seq_len, width))
    if dtype == torch.int64:
        planted = rng.random(routes.shape) < 0.25
        routes = np.where(planted, rng.choice(np.array(HUGE, dtype=np.int64), routes.shape), routes)
    given = torch.from_numpy(routes).to(dtype)
    before = given.clone()
    packed = _pack_indices(given, seq_len)
    assert packed.dtype == torch.int32 and packed.is_contiguous()
    assert packed.shape == (batch * seq_len, -(-width // 4) * 4)
    np.testing.assert_array_equal(packed.numpy(), _pack_brute_force(routes, seq_len))
    assert torch.equal(given, before), "the input routes must not be modified"
    assert packed.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_pack_indices_keeps_qsa_groups(layout):
    """QSA routes: each packed row is the original row shifted by its batch row's origin."""
    rng = _fresh_rng()
    problem = make_problem(layout, "qsa", seed=int(rng.integers(2**31)), seq_len=40, top_k=3, batch=3)
    routes, seq_len = problem.routes, problem.kv_length
    packed = _pack_indices(torch.from_numpy(routes), seq_len).numpy().reshape(routes.shape[0], seq_len, -1)
    for b in range(routes.shape[0]):
        valid = routes[b] >= 0
        np.testing.assert_array_equal(packed[b][valid], routes[b][valid] + b * seq_len)
        assert np.all(packed[b][~valid] == -1)


def test_pack_indices_errors():
    with pytest.raises(TypeError, match="selected_token_ids"):
        _pack_indices(torch.zeros(1, 4, 4, dtype=torch.uint8), 4)
    with pytest.raises(TypeError, match="selected_token_ids"):
        _pack_indices(torch.zeros(1, 4, 4), 4)
    with pytest.raises(ValueError, match="rank 3"):
        _pack_indices(torch.zeros(4, 4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="sequence_length"):
        _pack_indices(torch.zeros(1, 4, 4, dtype=torch.int64), 5)
    too_many = torch.zeros(1, 1, 1, dtype=torch.int32).expand(2**16, 2**15 + 1, 1)  # no memory
    with pytest.raises(ValueError, match="int32"):
        _pack_indices(too_many, 2**15 + 1)


# ----------------------------------------------------------------------- error paths

S, W = 8, 5


def _args(heads=(12, 1), head_dim=256, q_len=S, kv_len=S, width=W, dtype=torch.bfloat16, grad=False):
    hq, hkv = heads
    q = torch.randn(1, q_len, hq, head_dim).to(dtype).requires_grad_(grad)
    k = torch.randn(1, kv_len, hkv, head_dim).to(dtype).requires_grad_(grad)
    v = torch.randn(1, kv_len, hkv, head_dim).to(dtype).requires_grad_(grad)
    routes = torch.randint(-1, kv_len, (1, q_len, width))
    return [q, k, v, routes]


def _with(index, fn, **kw):
    args = _args(**kw)
    args[index] = fn(args[index])
    return args


# name: (arguments, softmax_scale, exception, text the message must contain)
ERRORS = {
    "float32 compute": (_args(dtype=torch.float32), None, TypeError, "query"),
    "float16 key": (_with(1, lambda t: t.half()), None, TypeError, "key"),
    "float16 value": (_with(2, lambda t: t.half()), None, TypeError, "value"),
    "uint8 routes": (_with(3, lambda t: t.clamp_min(0).to(torch.uint8)), None, TypeError, "selected_token_ids"),
    "float routes": (_with(3, lambda t: t.float()), None, TypeError, "selected_token_ids"),
    "int16 routes": (_with(3, lambda t: t.short()), None, TypeError, "selected_token_ids"),
    "bool routes": (_with(3, lambda t: t > 0), None, TypeError, "selected_token_ids"),
    "string scale": (_args(), "0.1", TypeError, "softmax_scale"),
    "query rank": (_with(0, lambda t: t[0]), None, ValueError, "query"),
    "value shape": (_with(2, lambda t: t[:, :-1]), None, ValueError, "value"),
    "routes rows": (_with(3, lambda t: t[:, :-1]), None, ValueError, "selected_token_ids"),
    "empty width": (_with(3, lambda t: t[..., :0]), None, ValueError, "empty"),
    "heads 24:1": (_args(heads=(24, 1)), None, ValueError, "heads"),
    "heads 12:2": (_args(heads=(12, 2)), None, ValueError, "heads"),
    "heads 8:1": (_args(heads=(8, 1)), None, ValueError, "heads"),
    "heads 36:3": (_args(heads=(36, 3)), None, ValueError, "heads"),
    "head dim 128": (_args(head_dim=128), None, ValueError, "head dim"),
    "width 2053": (_args(width=2053), None, ValueError, "width"),
    "context parallel": (_args(q_len=4, kv_len=8), None, ValueError, "S_q == S_kv"),
    "zero scale": (_args(), 0.0, ValueError, "softmax_scale"),
    "negative scale": (_args(), -0.5, ValueError, "softmax_scale"),
    "nan scale": (_args(), math.nan, ValueError, "softmax_scale"),
    "inf scale": (_args(), math.inf, ValueError, "softmax_scale"),
    "key on another device": (_with(1, lambda t: t.to("meta")), None, ValueError, "key is on meta"),
    "routes on another device": (_with(3, lambda t: t.to("meta")), None, ValueError, "selected_token_ids is on meta"),
    "not CUDA": (_args(), None, RuntimeError, "CUDA"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors(case):
    """Every check that needs no GPU fires on CPU, before the device check where it should."""
    args, scale, error, text = ERRORS[case]
    with pytest.raises(error, match=text):
        cudnn_sparse_gqa_attention(*args, softmax_scale=scale)


def test_width_limits_are_inclusive():
    """W = 1 and W = 2052 pass the shape checks (and stop at the device check on CPU)."""
    for width in (1, 2052):
        with pytest.raises(RuntimeError, match="CUDA"):
            cudnn_sparse_gqa_attention(*_args(width=width))
        with pytest.raises(RuntimeError, match="CUDA"):
            cudnn_sparse_gqa_attention(*_args(heads=(24, 2), width=width))


class _Deterministic:
    def __init__(self, warn_only=False):
        self.warn_only = warn_only

    def __enter__(self):
        self.saved = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True, warn_only=self.warn_only)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.saved[0], warn_only=self.saved[1])


def test_deterministic_backward_is_refused():
    with _Deterministic(), pytest.raises(RuntimeError, match="deterministic"):
        cudnn_sparse_gqa_attention(*_args(grad=True))
    # without a backward to come, the flag does not matter: the next check (device) fires
    with _Deterministic(), pytest.raises(RuntimeError, match="CUDA"):
        cudnn_sparse_gqa_attention(*_args(grad=False))
    with _Deterministic(), torch.no_grad(), pytest.raises(RuntimeError, match="CUDA"):
        cudnn_sparse_gqa_attention(*_args(grad=True))
    with _Deterministic(warn_only=True), pytest.warns(UserWarning, match="deterministic"):
        with pytest.raises(RuntimeError, match="CUDA"):
            cudnn_sparse_gqa_attention(*_args(grad=True))


@pytest.mark.parametrize("capability,name", [((9, 0), "NVIDIA H200"), ((8, 0), "NVIDIA A100"),
                                             ((12, 0), "NVIDIA RTX 5090"), ((10, 1), "sm101")])
def test_other_gpus_are_refused(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with pytest.raises(RuntimeError, match="SM100/SM103") as info:
        cudnn_qsa._check_gpu(torch.device("cuda", 0))
    assert name in str(info.value) and f"{capability[0]}.{capability[1]}" in str(info.value)


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])
def test_blackwell_is_accepted(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert cudnn_qsa._check_gpu(torch.device("cuda", 0)) is None


def _hide_cudnn(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)
    monkeypatch.setitem(sys.modules, "cudnn.ops", None)


def test_missing_runtime_raises_import_error(monkeypatch):
    _hide_cudnn(monkeypatch)
    with pytest.raises(ImportError, match="nvidia-cudnn-frontend"):
        cudnn_qsa._load_cudnn()
    monkeypatch.setattr(cudnn_qsa, "_check_gpu", lambda device: None)
    with pytest.raises(ImportError, match="qsa_indexed_forward"):
        cudnn_sparse_gqa_attention(*_args())


def test_old_runtime_without_qsa_raises_import_error(monkeypatch):
    package, ops = types.ModuleType("cudnn"), types.ModuleType("cudnn.ops")
    ops.causal_conv1d = object()  # a cudnn.ops from before the QSA kernels
    package.ops = ops
    monkeypatch.setitem(sys.modules, "cudnn", package)
    monkeypatch.setitem(sys.modules, "cudnn.ops", ops)
    with pytest.raises(ImportError, match=">= 1.32"):
        cudnn_qsa._load_cudnn()


def test_device_is_checked_before_cudnn_is_imported(monkeypatch):
    _hide_cudnn(monkeypatch)  # an import attempt would now raise ImportError
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    real_check = cudnn_qsa._check_gpu
    # the tensors stay on CPU; the device check is shown an (SM90) CUDA device instead
    monkeypatch.setattr(cudnn_qsa, "_check_gpu", lambda device: real_check(torch.device("cuda", 0)))
    with pytest.raises(RuntimeError, match="SM100/SM103"):
        cudnn_sparse_gqa_attention(*_args())


# ------------------------------------------------------- the adapter on a CPU stand-in


class StandInOps:
    """CPU model of ``cudnn.ops.qsa_indexed_forward/backward`` (FP32 math, BF16 I/O).

    Semantics from the cuDNN / FlashInfer documentation of the indexed kernels:
    ``indices [T, W]`` is read in groups of four slots; a group whose first slot ``s`` is
    ``>= 0`` covers tokens ``s .. s+3`` clipped to the query's own packed position ``t``;
    other slots are not read. LSE is ``[12, T]``, natural log, ``-inf`` for empty rows,
    whose output is 0. Every call asserts what the real kernels demand of their buffers.
    """

    def __init__(self):
        self.forward_calls = 0
        self.backward_calls = 0
        self.issued: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def _check_buffers(q, k, v, indices, scale):
        tokens = q.shape[0]
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        assert q.shape == (tokens, 12, 256) and k.shape == v.shape == (tokens, 1, 256)
        assert indices.dtype == torch.int32 and indices.shape[0] == tokens
        width = indices.shape[1]
        assert width % 4 == 0 and 4 <= width <= 2052, width
        for t in (q, k, v, indices):
            assert t.is_contiguous() and t.data_ptr() % 16 == 0
        assert isinstance(scale, float) and math.isfinite(scale) and scale > 0

    @staticmethod
    def _attend(q, k, v, indices, scale):
        tokens, width = indices.shape
        start = indices.view(tokens, width // 4, 4)[..., 0].long()
        ids = start[..., None] + torch.arange(4)
        own = torch.arange(tokens)[:, None, None]
        valid = ((start[..., None] >= 0) & (ids <= own)).reshape(tokens, -1)
        ids = torch.where(valid, ids.reshape(tokens, -1), 0)
        keys, values = k[:, 0].float()[ids], v[:, 0].float()[ids]  # [T, N, D]
        scores = scale * torch.einsum("thd,tnd->thn", q.float(), keys)
        scores = scores.masked_fill(~valid[:, None], -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # [T, 12]
        finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        probs = torch.exp(scores - finite[..., None]).masked_fill(~valid[:, None], 0.0)
        return ids, valid, keys, values, probs, lse

    def qsa_indexed_forward(self, q, k, v, indices, scale):
        self._check_buffers(q, k, v, indices, scale)
        self.forward_calls += 1
        _, _, _, values, probs, lse = self._attend(q, k, v, indices, scale)
        out_fp32 = torch.einsum("thn,tnd->thd", probs, values)
        lse = lse.t().contiguous()
        self.issued.append((out_fp32, lse))
        return out_fp32.to(torch.bfloat16), out_fp32, lse

    def qsa_indexed_backward(self, grad_out, q, k, v, out_fp32, lse, indices, scale, selection_mode):
        self._check_buffers(q, k, v, indices, scale)
        assert selection_mode == "general"
        assert grad_out.dtype == torch.bfloat16 and grad_out.shape == q.shape
        assert grad_out.is_contiguous()
        assert any(o is out_fp32 and s is lse for o, s in self.issued), \
            "backward must get the forward's own FP32 output and LSE"
        self.backward_calls += 1
        ids, valid, keys, values, probs, _ = self._attend(q, k, v, indices, scale)
        do = grad_out.float()
        dp = torch.einsum("thd,tnd->thn", do, values)
        ds = probs * (dp - (do * out_fp32).sum(-1, keepdim=True))
        dq = scale * torch.einsum("thn,tnd->thd", ds, keys)
        dk_rows = scale * torch.einsum("thn,thd->tnd", ds, q.float())
        dv_rows = torch.einsum("thn,thd->tnd", probs, do)
        dk = torch.zeros(q.shape[0], 256).index_add_(0, ids[valid], dk_rows[valid])
        dv = torch.zeros(q.shape[0], 256).index_add_(0, ids[valid], dv_rows[valid])
        bf16 = torch.bfloat16
        return dq.to(bf16), dk[:, None].to(bf16), dv[:, None].to(bf16)


def _install_stand_in(monkeypatch, stand_in: StandInOps | None = None) -> StandInOps:
    stand_in = StandInOps() if stand_in is None else stand_in
    package, ops = types.ModuleType("cudnn"), types.ModuleType("cudnn.ops")
    ops.qsa_indexed_forward = stand_in.qsa_indexed_forward
    ops.qsa_indexed_backward = stand_in.qsa_indexed_backward
    package.ops = ops
    monkeypatch.setitem(sys.modules, "cudnn", package)
    monkeypatch.setitem(sys.modules, "cudnn.ops", ops)
    monkeypatch.setattr(cudnn_qsa, "_check_gpu", lambda device: None)
    return stand_in


class _CudnnContract(BackendContract):
    """The shared contract, narrowed to what the cuDNN indexed kernels support."""

    dtypes = ("bfloat16",)
    heads = ((12, 1), (24, 2))
    head_dim = 256
    seq_len = 32
    top_k = 2
    layouts = ("padded", "packed")  # no CP: S_q != S_kv is refused
    families = ("qsa",)  # QSA route format only
    device = "cpu"

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_torch(cudnn_sparse_gqa_attention, q, k, v, routes, scale, grad_out, dtype,
                         device=self.device)

    def test_empty_rows_are_exact_zeros(self, rng):
        """QSA routes with every third row replaced by padding only (-1, >= S, huge)."""
        heads, dtype = self.heads[-1], self.dtypes[0]
        routes = make_problem("packed", "qsa", seed=int(rng.integers(2**31)),
                              seq_len=self.seq_len, top_k=self.top_k).routes
        empty = np.zeros(self.seq_len, dtype=bool)
        empty[::3] = True
        padding = np.array([-1, self.seq_len, self.seq_len + 5, *HUGE], dtype=np.int64)
        routes[0, empty] = rng.choice(padding, size=routes[0, empty].shape)
        got, _ = self.check(routes, self.seq_len, heads, dtype, rng, label="empty rows")
        assert np.all(got[0][0, empty] == 0.0), "empty rows must give exact zeros"
        assert np.all(got[1][0, empty] == 0.0), "empty rows must have exact zero dq"

    def test_duplicates_count_once(self, rng):
        """Replaces the base test: QSA routes hold no duplicates (the kernels do not take
        them); the set invariance they owe is to the order of four-slot groups."""
        heads, dtype = self.heads[0], self.dtypes[0]
        routes = make_problem("padded", "qsa", seed=int(rng.integers(2**31)),
                              seq_len=self.seq_len, top_k=self.top_k, batch=2).routes
        b, s, width = routes.shape
        order = np.argsort(rng.random((b, s, width // 4)), axis=-1)
        shuffled = np.take_along_axis(routes.reshape(b, s, -1, 4), order[..., None], axis=2)
        shuffled = shuffled.reshape(b, s, width)
        assert not np.array_equal(shuffled, routes)
        got, _ = self.check(shuffled, self.seq_len, heads, dtype, rng, label="shuffled groups")
        q, k, v, do = random_inputs(rng, routes, self.seq_len, heads, self.head_dim, dtype)
        ordered = self.run(q, k, v, routes, 0.3, do, dtype)
        permuted = self.run(q, k, v, shuffled, 0.3, do, dtype)
        for a, c in zip(ordered, permuted):
            assert relative_error(c, a) < 1e-2


class TestCudnnAdapterOnStandIn(_CudnnContract):
    """The adapter end to end on CPU, with the kernels replaced by :class:`StandInOps`."""

    @pytest.fixture(autouse=True)
    def stand_in(self, monkeypatch):
        return _install_stand_in(monkeypatch)

    def test_partial_width_is_padded(self, rng, stand_in):
        """W = 3 (only causal tails) and W = 14 reach the kernels padded to 4 and 16."""
        tails = np.full((1, self.seq_len, 3), -1, dtype=np.int64)
        for i in range(self.seq_len):
            tail = np.arange(4 * ((i + 1) // 4), i + 1)
            tails[0, i, : tail.size] = tail
        wide = make_problem("padded", "qsa", seed=int(rng.integers(2**31)), seq_len=self.seq_len,
                            width=14, top_k=2, batch=2).routes
        for routes in (tails, wide):
            self.check(routes, self.seq_len, self.heads[-1], "bfloat16", rng, label=f"W={routes.shape[-1]}")
        assert stand_in.forward_calls == 4 and stand_in.backward_calls == 4

    def test_strided_inputs_and_grads(self, rng, stand_in):
        problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=16, top_k=1)
        routes = torch.from_numpy(problem.routes)
        base = torch.randn(1, 24, 16, 2 * 256).to(torch.bfloat16)
        q = base[..., ::2].transpose(1, 2).detach().requires_grad_(True)  # [1, 16, 24, 256], strided
        kv = torch.randn(1, 2, 16, 2, 256).to(torch.bfloat16)
        k = kv[:, :, :, 0].transpose(1, 2).detach().requires_grad_(True)
        v = kv[:, :, :, 1].transpose(1, 2).detach().requires_grad_(True)
        dense = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v)]
        assert not any(t.is_contiguous() for t in (q, k, v))
        grad = torch.randn(1, 16, 24, 256).to(torch.bfloat16)
        out = cudnn_sparse_gqa_attention(q, k, v, routes)
        out.backward(grad.transpose(1, 2).contiguous().transpose(1, 2))  # strided upstream grad
        ref = cudnn_sparse_gqa_attention(*dense, routes)
        ref.backward(grad)
        assert torch.equal(out, ref)
        for a, b in zip((q, k, v), dense):
            assert a.grad.shape == a.shape and torch.equal(a.grad, b.grad)

    def test_misaligned_buffers_are_copied(self):
        flat = torch.randn(12 * 256 * 4 + 1).to(torch.bfloat16)
        view = flat[1:].view(4, 12, 256)  # contiguous, 2 bytes past an aligned address
        assert view.is_contiguous() and view.data_ptr() % 16 != 0
        dense = dense_aligned(view)
        assert dense.data_ptr() % 16 == 0 and torch.equal(dense, view)
        aligned = torch.randn(4, 12, 256).to(torch.bfloat16)
        assert dense_aligned(aligned) is aligned

    def test_deterministic_flag_set_after_forward(self, monkeypatch, stand_in):
        q, k, v, routes = _args(grad=True)
        out = cudnn_sparse_gqa_attention(q, k, v, routes.clamp(-1, 0))
        # the flag as torch.use_deterministic_algorithms(True) would set it
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
        with pytest.raises(RuntimeError, match="deterministic"):
            out.sum().backward()
        assert stand_in.backward_calls == 0

    def test_forward_only_keeps_no_graph(self, stand_in):
        q, k, v, routes = _args(grad=False)
        out = cudnn_sparse_gqa_attention(q, k, v, routes.clamp(-1, 0))
        assert out.grad_fn is None and stand_in.forward_calls == 1


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not _on_blackwell(), reason="needs an SM100/SM103 GPU for the cuDNN indexed QSA kernels")
class TestCudnnOnBlackwell(_CudnnContract):
    """The real kernels against the float64 oracle (runs only on SM100/SM103)."""

    device = "cuda"

    @pytest.mark.parametrize("layout,heads,batch", [("packed", (24, 2), 1), ("padded", (12, 1), 2)])
    def test_full_width_against_torch_reference(self, rng, layout, heads, batch):
        """W = 2052 (top_k 512) at S = 2048 against the fp32 torch reference on the GPU."""
        from qsa_torch import reference_sparse_gqa_attention

        problem = make_problem(layout, "qsa", seed=int(rng.integers(2**31)), seq_len=2048,
                               top_k=512, batch=batch)
        routes = torch.from_numpy(problem.routes).cuda()
        gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
        hq, hkv = heads
        shapes = [(batch, 2048, hq, 256), (batch, 2048, hkv, 256), (batch, 2048, hkv, 256)]
        leaves = [torch.randn(s, generator=gen, device="cuda").bfloat16().requires_grad_(True) for s in shapes]
        grad = torch.randn(shapes[0], generator=gen, device="cuda").bfloat16()
        out = cudnn_sparse_gqa_attention(*leaves, routes, 1 / 16)
        out.backward(grad)
        ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
        ref = reference_sparse_gqa_attention(*ref_leaves, routes, 1 / 16)
        ref.backward(grad.float())
        pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
        for name, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
            err = relative_error(got.double().cpu().numpy(), want.double().cpu().numpy())
            assert err < 1e-2, f"{layout} {heads} {name}: relative error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(_on_blackwell(), reason="this GPU is SM100/SM103: the backend runs here")
@pytest.mark.parametrize("heads", [(12, 1), (24, 2)])
def test_other_gpu_raises_runtime_error(heads):
    q, k, v, routes = (t.detach().cuda() for t in _args(heads=heads))
    with pytest.raises(RuntimeError, match="SM100/SM103") as info:
        cudnn_sparse_gqa_attention(q, k, v, routes)
    assert torch.cuda.get_device_name(0) in str(info.value)


def test_first_call_warns_that_the_numerics_are_unverified(monkeypatch, recwarn):
    from qsa_torch import routes as routes_module
    from qsa_torch.routes import UnverifiedBackendWarning

    _install_stand_in(monkeypatch)
    monkeypatch.setattr(routes_module, "_UNVERIFIED_WARNED", set())
    q, k, v, routes = _args(grad=False)
    for _ in range(2):
        cudnn_sparse_gqa_attention(q, k, v, routes.clamp(-1, 0))
    warned = [w for w in recwarn.list if issubclass(w.category, UnverifiedBackendWarning)]
    assert len(warned) == 1 and "cudnn backend's numerics are unverified on sm100" in str(warned[0].message)


class _NanOnEmptyRows(StandInOps):
    """A kernel that leaves NaN in the output and dq of rows without routes."""

    @staticmethod
    def _empty(indices):
        return (indices.view(indices.shape[0], -1, 4)[..., 0] < 0).all(-1)

    def qsa_indexed_forward(self, q, k, v, indices, scale):
        out, out_fp32, lse = super().qsa_indexed_forward(q, k, v, indices, scale)
        return out.masked_fill(self._empty(indices)[:, None, None], float("nan")), out_fp32, lse

    def qsa_indexed_backward(self, grad_out, q, k, v, out_fp32, lse, indices, scale, selection_mode):
        dq, dk, dv = super().qsa_indexed_backward(grad_out, q, k, v, out_fp32, lse, indices, scale,
                                                  selection_mode)
        return dq.masked_fill(self._empty(indices)[:, None, None], float("nan")), dk, dv


def test_empty_rows_are_zero_whatever_the_kernel_leaves(monkeypatch):
    _install_stand_in(monkeypatch, _NanOnEmptyRows())
    rng = np.random.default_rng()
    routes = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=16, top_k=2).routes
    routes[0, ::4] = -1
    q = torch.randn(1, 16, 12, 256, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 16, 1, 256, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = cudnn_sparse_gqa_attention(q, k, v, torch.from_numpy(routes))
    out.backward(torch.randn_like(out))
    assert torch.all(out[0, ::4] == 0) and torch.isfinite(out).all()
    assert torch.all(q.grad[0, ::4] == 0) and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("heads", [(12, 1), (24, 2)])
@pytest.mark.parametrize("target", ["q", "do"])
def test_non_finite_rows_reach_only_their_routes(monkeypatch, heads, target):
    """NaN in two routed rows' q or dO, through the stand-in kernels (QSA routes): out,
    dq, dk, dv non-finite exactly where tests/test_nan_confinement.py's float64 judge
    allows and asks. The stand-in gathers its routes (it does not leak as a tile kernel
    does); this checks that the wrapper's NaN writes land on the right rows and keys."""
    from test_nan_confinement import _hopper_case, _run_torch, check

    _install_stand_in(monkeypatch)
    case = _hopper_case(heads, target, int(np.random.SeedSequence().entropy % 2**32))
    check(case, _run_torch(cudnn_sparse_gqa_attention, case, dtype="bfloat16"), tol=5e-2)
