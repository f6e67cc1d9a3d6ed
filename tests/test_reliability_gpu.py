"""Reliability on a GPU: FlexAttention over many shapes, big-batch launches, memory
ceilings of the token-gather backends, and the full-context refusal of FlexAttention.

Every test here needs a CUDA GPU (``gpu`` marker); the JAX ones a JAX GPU backend too.

Memory ceiling of one forward+backward of a token-gather backend (torch Triton, JAX's
default on a GPU: the Pallas kernels), bytes above what the caller holds (query, key,
value, routes, grad_out), derived from what the backends allocate:

    M <= a * B*S_q*K  +  b * e*B*S_q*Hq*D  +  c * B*S_kv*Hkv*D  +  d * B*S_q*Hq  +  256 MiB

with ``e`` the bytes of the compute dtype and, per backend:

* torch Triton: a = 64, b = 3, c = 16, d = 8. Route term: the sort keys of every route
  (4 or 8 bytes, 1 to ~1.5 keys per route where flat programs overlap), torch.sort's
  values, int64 indices and radix double buffers for one chunk of tiles, the tile unions
  and row bitmasks (int32, width min(T * K, S_kv) per tile of T rows: 8 bytes per route
  slot) and, for the backward's or the flat programs' tiles, a second set cut from them
  (~12 bytes per route at G = 12). Query term: the output and dq (the op pair's
  ``contiguous`` copies are no-ops). Key term: fp32 dK/dV accumulators (8 bytes) and
  their casts (2e). LSE: fp32 per (row, head).
* JAX default (Pallas): a = 96, b = 8, c = 16, d = 16. Route term: clipped int32 routes
  (kept for the backward), each program's span of routes gathered (~1.5x the routes at
  G = 12), the sort keys and the arrays the union scatter reads (slot, ID, bit, first
  flag), the unions and row bits (kept for the backward). Query term: the query, output,
  grad_out and dq in the kernels' tile arrangement and restored. Key term: fp32 dK/dV
  buffers and their casts. Row term: LSE and delta, in both arrangements.

There is no S_q * S_kv term: :func:`test_peak_memory_stays_within_the_formula` checks
the bound at sizes where one byte per (query, key) pair alone would break it, and that
peak memory grows linearly in S.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from qsa_common.layouts import make_problem
from qsa_common.oracle import oracle_forward_backward, relative_error

pytestmark = pytest.mark.gpu

MiB, GiB = 2**20, 2**30
# (a, b, c, d) of the module docstring's formula, per backend
MEMORY_CONSTANTS = {"torch-triton": (64, 3, 16, 8), "jax-default": (96, 8, 16, 16)}


def memory_bound(backend: str, batch, s_q, s_kv, hq, hkv, head_dim, width, element_bytes) -> int:
    """The module docstring's ceiling, in bytes."""
    a, b, c, d = MEMORY_CONSTANTS[backend]
    return int(a * batch * s_q * width + b * element_bytes * batch * s_q * hq * head_dim
               + c * batch * s_kv * hkv * head_dim + d * batch * s_q * hq + 256 * MiB)


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for torch")
    return torch


def _randn(torch, shape, gen, dtype):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def _check_against_reference(torch, fn, q, k, v, routes, do, scale, tolerance, label):
    """``fn``'s out, dq, dk, dv against the torch reference in fp32 on the same inputs."""
    from qsa_torch import reference_sparse_gqa_attention

    results = []
    for f, cast in ((fn, lambda t: t), (reference_sparse_gqa_attention, lambda t: t.float())):
        leaves = [cast(t).detach().requires_grad_(True) for t in (q, k, v)]
        out = f(*leaves, routes, scale)
        out.backward(cast(do))
        results.append([t.detach() for t in (out, *(x.grad for x in leaves))])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        err = relative_error(got.double().cpu().numpy(), want.double().cpu().numpy())
        assert err < tolerance, f"{label} {name}: relative error {err:.3e}"


# ----------------------------------------------------------------------------- flex
# (B, S_q, S_kv, layout): 13 shapes in 10 bucketed shapes (more than dynamo's default
# recompile_limit of 8), right-padded, packed and context-parallel (S_q = S_kv / 4)
_FLEX_SHAPES = [(1, 300, 300, "packed"), (1, 350, 350, "packed"), (1, 1000, 1000, "packed"),
                (1, 1020, 1020, "packed"), (2, 700, 700, "padded"), (1, 2100, 2100, "packed"),
                (1, 3000, 3000, "packed"), (1, 3072, 3072, "packed"), (1, 1024, 4096, "cp"),
                (3, 500, 500, "padded"), (1, 5000, 5000, "packed"), (1, 6500, 6500, "packed"),
                (2, 1500, 1500, "padded")]


def test_flex_many_shapes_compile_once_per_bucket_and_never_run_uncompiled():
    """13 shapes, forward and backward in bf16 against the fp32 torch reference: each new
    bucketed shape adds exactly one dynamo graph, a known one none, no call warns that
    FlexAttention ran without torch.compile, and nothing runs out of memory."""
    torch = _torch_cuda()
    from torch._dynamo.utils import counters

    from qsa_torch import flex_qsa, flex_sparse_gqa_attention

    cache = flex_qsa._COMPILED
    gen = torch.Generator(device="cuda").manual_seed(0)
    buckets = set()
    for i, (batch, s_q, s_kv, layout) in enumerate(_FLEX_SHAPES):
        problem = make_problem(layout, "qsa", seed=i, seq_len=s_kv, top_k=32, batch=batch,
                               world_size=s_kv // s_q, rank=1)
        assert problem.routes.shape[:2] == (batch, s_q) and problem.kv_length == s_kv
        routes = torch.from_numpy(problem.routes).cuda()
        q = _randn(torch, (batch, s_q, 12, 128), gen, torch.bfloat16)
        k, v = (_randn(torch, (batch, s_kv, 1, 128), gen, torch.bfloat16) for _ in range(2))
        do = _randn(torch, (batch, s_q, 12, 128), gen, torch.bfloat16)
        known, graphs = len(cache.shapes), counters["stats"]["unique_graphs"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _check_against_reference(torch, flex_sparse_gqa_attention, q, k, v, routes, do,
                                     128**-0.5, 1e-2, f"flex {(batch, s_q, s_kv)}")
        uncompiled = [w for w in caught if "without torch.compile" in str(w.message)]
        assert not uncompiled, f"{(batch, s_q, s_kv)} ran FlexAttention uncompiled"
        assert counters["stats"]["unique_graphs"] - graphs == len(cache.shapes) - known <= 1
        buckets.add((flex_qsa.bucket_batch(batch), flex_qsa.bucket_length(s_q),
                     flex_qsa.bucket_length(s_kv)))
    assert len(buckets) == 10 > torch._dynamo.config.recompile_limit


def test_flex_refuses_the_models_full_context_before_allocating():
    """S = 262144: 64 GiB of membership table, ~143 GiB while built; where that does not
    fit the free memory (an H200) the call raises before allocating anything."""
    torch = _torch_cuda()
    from qsa_torch import flex_qsa, flex_sparse_gqa_attention
    from qsa_torch.routes import ProblemDims, available_device_bytes

    s = 262144
    dims = ProblemDims(1, s, s, 24, 2, 256, 2052)
    q = torch.empty(1, s, 24, 256, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(1, s, 2, 256, device="cuda", dtype=torch.bfloat16)
    routes = torch.full((1, s, 2052), -1, device="cuda", dtype=torch.int32)
    if flex_qsa._table_build_bytes(dims) <= available_device_bytes(q.device):
        pytest.skip("this GPU has the memory for the table")
    before = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError, match=r"takes 64\.00 GiB"):
        flex_sparse_gqa_attention(q, kv, kv, routes)
    assert torch.cuda.memory_allocated() == before


# ------------------------------------------------------------------------ big batch
# B * Hkv * head chunks = 132000 > 65535 (CUDA's grid y limit) for torch Triton, and
# B = 66000 > 65535 on the Pallas grid's batch axis
_BIG_BATCH = dict(batch=66000, seq_len=4, heads=(4, 2), head_dim=32, width=4)


def _big_batch_case():
    rng = np.random.default_rng(0)
    b, s, (hq, hkv), d = (_BIG_BATCH[n] for n in ("batch", "seq_len", "heads", "head_dim"))
    routes = rng.integers(-1, s + 1, size=(b, s, _BIG_BATCH["width"]))
    arrays = [rng.standard_normal(shape).astype(np.float32)
              for shape in ((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d))]
    want = oracle_forward_backward(*arrays[:3], routes, 0.3, arrays[3])
    return arrays, routes, want


def _assert_close(got, want, label):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = relative_error(np.asarray(g, np.float64), w)
        assert err < 1e-5, f"{label} {name}: relative error {err:.3e}"


def test_big_batch_launches_torch_triton():
    torch = _torch_cuda()
    from qsa_torch import triton_sparse_gqa_attention

    (q, k, v, do), routes, want = _big_batch_case()
    leaves = [torch.tensor(x, device="cuda", requires_grad=True) for x in (q, k, v)]
    out = triton_sparse_gqa_attention(*leaves, torch.from_numpy(routes).cuda(), 0.3)
    out.backward(torch.tensor(do, device="cuda"))
    got = [t.detach().double().cpu().numpy() for t in (out, *(x.grad for x in leaves))]
    _assert_close(got, want, "torch triton, B = 66000")


def _jax_gpu():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs a JAX GPU backend")
    return jax


def test_big_batch_launches_jax_default():
    """The implementation JAX's default picks on a GPU (Pallas), named so that a refusal
    cannot fall back to the XLA reference unseen."""
    jax = _jax_gpu()
    import jax.numpy as jnp

    from qsa_jax import sparse_gqa_attention

    (q, k, v, do), routes, want = _big_batch_case()

    def loss(q_, k_, v_):
        return sparse_gqa_attention(q_, k_, v_, routes, 0.3, implementation="pallas")

    out, vjp = jax.vjp(loss, *(jnp.asarray(x) for x in (q, k, v)))
    got = [np.asarray(t) for t in (out, *vjp(jnp.asarray(do)))]
    _assert_close(got, want, "jax pallas, B = 66000")


# --------------------------------------------------------------------------- memory
# (Hq, Hkv, D, S, top_k): two sizes with K = 68 where S^2 bytes would break the bound
# (4 GiB at S = 65536 against a ~1.3 GiB ceiling), and the model's shape at S = 32768
_MEMORY_SIZES = [(12, 1, 128, 16384, 16), (12, 1, 128, 65536, 16), (24, 2, 256, 32768, 512)]


def _memory_routes(s: int, top_k: int, directory) -> str:
    path = os.path.join(directory, f"routes-{s}-{top_k}.npy")
    if not os.path.exists(path):
        routes = make_problem("packed", "qsa", seed=s, seq_len=s, top_k=top_k).routes
        np.save(path, routes.astype(np.int32))
    return path


def _torch_peak(torch, hq, hkv, d, s, routes_path) -> int:
    from qsa_torch import triton_sparse_gqa_attention

    gen = torch.Generator(device="cuda").manual_seed(s)
    routes = torch.from_numpy(np.load(routes_path)).cuda()
    leaves = [_randn(torch, (1, s, h, d), gen, torch.bfloat16).requires_grad_(True) for h in (hq, hkv, hkv)]
    do = _randn(torch, (1, s, hq, d), gen, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = triton_sparse_gqa_attention(*leaves, routes, 1 / d**0.5)
    out.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out, leaves, do, routes
    torch.cuda.empty_cache()
    return peak


# Runs in a fresh process per size: JAX's peak counter never resets, and JAX must not
# preallocate memory next to torch. Prints the peak bytes above the inputs.
_JAX_PEAK = """
import json, sys
import numpy as np, jax, jax.numpy as jnp
from qsa_jax import sparse_gqa_attention
hq, hkv, d, s, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
routes = jnp.asarray(np.load(path))
keys = jax.random.split(jax.random.key(s), 4)
q, do = (jax.random.normal(key, (1, s, hq, d), jnp.bfloat16) for key in keys[:2])
k, v = (jax.random.normal(key, (1, s, hkv, d), jnp.bfloat16) for key in keys[2:])
step = jax.jit(lambda q, k, v, do, r: jax.vjp(
    lambda a, b, c: sparse_gqa_attention(a, b, c, r, d ** -0.5), q, k, v)[1](do))
compiled = step.lower(q, k, v, do, routes).compile()
jax.block_until_ready((q, k, v, do, routes))
device = jax.devices()[0]
before = device.memory_stats()["bytes_in_use"]
jax.block_until_ready(compiled(q, k, v, do, routes))
print(json.dumps({"peak": device.memory_stats()["peak_bytes_in_use"] - before}))
"""


def _jax_peak(hq, hkv, d, s, routes_path) -> int:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _JAX_PEAK, str(hq), str(hkv), str(d), str(s), routes_path],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.parametrize("backend", sorted(MEMORY_CONSTANTS))
def test_peak_memory_stays_within_the_formula(backend, tmp_path):
    if backend == "torch-triton":
        torch = _torch_cuda()
        measure = lambda *args: _torch_peak(torch, *args)  # noqa: E731
    else:
        _jax_gpu()
        measure = _jax_peak
    peaks = {}
    for hq, hkv, d, s, top_k in _MEMORY_SIZES:
        width = 4 * top_k + 4
        peak = measure(hq, hkv, d, s, _memory_routes(s, top_k, tmp_path))
        bound = memory_bound(backend, 1, s, s, hq, hkv, d, width, 2)
        peaks[(hq, s)] = peak
        print(f"{backend} (Hq,Hkv)=({hq},{hkv}) D={d} S={s} K={width}: peak {peak / GiB:.3f} GiB, "
              f"bound {bound / GiB:.3f} GiB ({peak / bound:.2f}), S^2 bytes {s * s / GiB:.2f} GiB")
        assert peak <= bound, f"{backend} S={s} K={width}: {peak / GiB:.3f} GiB > {bound / GiB:.3f} GiB"
        if (hq, s) == (12, 65536):
            assert bound < s * s  # one byte per (query, key) pair could not hide under it
    # four times the rows: at most ~4x the memory (a quadratic term would give 16x)
    assert peaks[(12, 65536)] <= 4.5 * peaks[(12, 16384)] + 256 * MiB
