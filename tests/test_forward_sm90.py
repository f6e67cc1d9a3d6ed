"""The warp-specialized Hopper forward (``qsa_triton.forward_sm90``), GPU only.

Gluon kernels do not run in Triton's interpreter, so these tests need an sm_90 GPU; the
CPU CI checks the launch description only. On the GPU: outputs against the float64
oracle and against ``forward.py`` on the same unions, over route families, head
configurations, both 16-bit dtypes, batch rows, an unrouted inf/NaN K/V row, and rows
without routes; and that the default torch path takes it on Hopper.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from qsa_common.generators import adversarial_routes, family  # noqa: E402
from qsa_common.oracle import oracle_forward_backward, relative_error  # noqa: E402
from qsa_triton import launch as spec  # noqa: E402
from qsa_triton.config import DEFAULT_BLOCK_SIZES, SAFE_BLOCK_SIZES, BlockSizes  # noqa: E402
from qsa_triton.plan import make_plan  # noqa: E402


def _operands(shape_q, shape_kv):
    q = (shape_q, spec.contiguous_strides(shape_q))
    kv = (shape_kv, spec.contiguous_strides(shape_kv))
    return q, kv


def test_launch_scope():
    """The Hopper launch is described for the default flat plan at D = 256 in 16-bit, with
    the kernel's exact arguments, and refused (None) outside its scope."""
    plan = make_plan(12, 256, DEFAULT_BLOCK_SIZES)
    q, kv = _operands((2, 300, 24, 256), (2, 300, 2, 256))
    n_tiles = plan.n_tiles(300)
    launch = spec.forward_sm90_launch(plan, q, kv, kv, (2, n_tiles, 2052), 0.0625, "bfloat16")
    assert launch is not None and launch.grid == (n_tiles, 4) and launch.num_warps == 4
    params = dict(launch.params)
    assert (params["PAIRS"], params["BLOCK_K"], params["D"]) == (128, 64, 256)
    assert launch.scalars == spec.forward_launch(plan, q, kv, kv, (2, n_tiles, 2052), 0.0625, "bfloat16",
                                                 interpreted=False).scalars
    assert spec.forward_sm90_launch(plan, q, kv, kv, (2, n_tiles, 2052), 0.0625, "float32") is None
    q128, kv128 = _operands((2, 300, 24, 128), (2, 300, 2, 128))
    assert spec.forward_sm90_launch(make_plan(12, 128, DEFAULT_BLOCK_SIZES), q128, kv128, kv128,
                                    (2, n_tiles, 2052), 0.0625, "bfloat16") is None
    assert spec.forward_sm90_launch(make_plan(12, 256, SAFE_BLOCK_SIZES), q, kv, kv, (2, 10, 2052), 0.0625,
                                    "bfloat16") is None
    # padded tiles of all 8 heads x 16 rows are the same programs; 3 heads take flat 64-pair ones
    q8, kv8 = _operands((2, 300, 8, 256), (2, 300, 1, 256))
    assert spec.forward_sm90_launch(make_plan(8, 256, DEFAULT_BLOCK_SIZES), q8, kv8, kv8, (2, 19, 2052), 0.0625,
                                    "bfloat16") is not None
    q3, kv3 = _operands((2, 300, 3, 256), (2, 300, 1, 256))
    assert spec.forward_sm90_launch(make_plan(3, 256, DEFAULT_BLOCK_SIZES), q3, kv3, kv3, (2, 15, 2052), 0.0625,
                                    "bfloat16") is None
    head_major = (kv[0], (300 * 2 * 256, 256, 300 * 256, 1))  # [B, Hkv, S, D] memory: in scope
    assert spec.forward_sm90_launch(plan, q, head_major, head_major, (2, n_tiles, 2052), 0.0625,
                                    "bfloat16") is not None
    odd = (kv[0], (kv[1][0], kv[1][1] + 8, kv[1][2], 1))  # a row stride that breaks 16-byte copies
    assert spec.forward_sm90_launch(plan, q, odd, kv, (2, n_tiles, 2052), 0.0625, "bfloat16") is None
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no Gluon: the kernel's signature cannot be read")
    assert launch.arg_names() == tuple(spec.kernel(launch.kernel).arg_names)


def _hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qsa_torch import _triton_launch

    if not _triton_launch.hopper_forward(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and a triton with Gluon")


def _problem(rng, routes, heads, dtype):
    bsz, seq, _ = routes.shape
    hq, hkv = heads
    q = rng.standard_normal((bsz, seq, hq, 256))
    k = rng.standard_normal((bsz, seq, hkv, 256))
    v = rng.standard_normal((bsz, seq, hkv, 256))
    to = lambda x: torch.from_numpy(x).to("cuda", dtype)  # noqa: E731
    return q, k, v, to(q), to(k), to(v)


def _run_both(tq, tk, tv, routes, scale, group, blocks=DEFAULT_BLOCK_SIZES):
    from qsa_torch import _triton_launch as launcher
    from qsa_torch import triton_qsa

    plan = make_plan(group, 256, blocks)
    unions = triton_qsa.build_unions(torch.from_numpy(routes).cuda(), tk.shape[1], plan)
    arrays = dict(Q=tq, K=tk, V=tv, UNION=unions.union, COUNT=unions.count, ROWBITS=unions.rowbits)
    ops = [(tuple(x.shape), x.stride()) for x in (tq, tk, tv)]
    dtype = launcher.dtype_name(tq.dtype)
    hopper = spec.forward_sm90_launch(plan, *ops, tuple(unions.union.shape), scale, dtype)
    assert hopper is not None
    generic = spec.forward_launch(plan, *ops, tuple(unions.union.shape), scale, dtype, interpreted=False)
    return launcher.run(hopper, arrays, tq.device), launcher.run(generic, arrays, tq.device)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, dtype, kind", [
    ((24, 2), torch.bfloat16, "qsa"), ((24, 2), torch.bfloat16, "adversarial"),
    ((12, 1), torch.float16, "qsa"), ((12, 1), torch.bfloat16, "adversarial"), ((8, 1), torch.bfloat16, "qsa")])
def test_matches_the_oracle_and_forward_py(heads, dtype, kind):
    """O against the float64 oracle within the contract's 16-bit bound, O and LSE equal to
    forward.py's bit for bit, on two batch rows of 700 query rows (a partial last
    program), with K/V row 0 unrouted and holding inf/NaN, and (adversarial) rows without
    routes (O exactly 0, LSE +inf)."""
    _hopper()
    rng = np.random.default_rng()
    seq = 700
    if kind == "qsa":
        routes = np.stack([family("qsa", width=260, top_k=64, overlap=0.8, rng=rng)(seq) for _ in range(2)])
    else:
        routes = np.stack([adversarial_routes(seq, width=96, rng=rng)[:seq] for _ in range(2)])
    routes = np.where(routes == 0, -1, routes)  # int64: huge IDs are padding, never row 0
    q, k, v, tq, tk, tv = _problem(rng, routes, heads, dtype)
    tk[:, 0], tv[:, 0] = float("inf"), float("nan")
    scale = 256 ** -0.5
    got, generic = _run_both(tq, tk, tv, routes, scale, heads[0] // heads[1])
    want = oracle_forward_backward(q, k, v, routes, scale, np.zeros_like(q))[0]
    out = got["O"].double().cpu().numpy()
    assert np.isfinite(out).all()
    assert relative_error(out, want) < 1e-2
    # the same products in the same order as forward.py: the same bits
    assert torch.equal(got["O"], generic["O"]) and torch.equal(got["LSE"], generic["LSE"])
    lse = got["LSE"].cpu()
    empty = ~((routes >= 0) & (routes < seq)).any(axis=2)  # [B, S]: rows without routes: 0 and LSE +inf
    if kind == "adversarial":
        assert empty.any(), "adversarial routes make some rows empty"
    assert np.all(out[empty] == 0)
    assert torch.isinf(lse.transpose(1, 2)[torch.from_numpy(empty)]).all()


@pytest.mark.gpu
def test_default_torch_path_takes_it(monkeypatch):
    """``triton_sparse_gqa_attention`` on Hopper launches the sm90 forward for the default
    configuration (its output equals the sm90 launch's bit for bit) and forward.py for
    others (``BlockSizes()``: padded tiles of 2 heads), both within tolerance of each other."""
    _hopper()
    from qsa_torch import _triton_launch
    from qsa_torch.triton_qsa import triton_sparse_gqa_attention

    launched = []
    run = _triton_launch.run
    monkeypatch.setattr(_triton_launch, "run", lambda launch, *a: launched.append(launch.kernel) or run(launch, *a))

    rng = np.random.default_rng()
    routes = family("qsa", width=260, top_k=64, rng=rng)(600)[None]
    _, _, _, tq, tk, tv = _problem(rng, routes, (24, 2), torch.bfloat16)
    troutes = torch.from_numpy(routes).cuda()
    out = triton_sparse_gqa_attention(tq, tk, tv, troutes, 0.0625)
    assert "forward_sm90" in launched and "forward" not in launched, launched
    got, _ = _run_both(tq, tk, tv, routes, 0.0625, 12)
    assert torch.equal(out, got["O"])
    launched.clear()
    safe = triton_sparse_gqa_attention(tq, tk, tv, troutes, 0.0625, block_sizes=BlockSizes())
    assert "forward" in launched and "forward_sm90" not in launched, launched
    assert (safe.float() - out.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_jax_launches_it_through_jax_triton(monkeypatch):
    """qsa_jax's default launcher launches the Gluon kernel through jax-triton
    (``install_gluon_compile``; the launch it picks is recorded), and its forward equals
    torch's bit for bit (the same kernel on the same unions), within the contract's bound
    of the float64 oracle."""
    _hopper()
    from qsa_jax import _triton_call

    try:  # through qsa_jax's loader, which keeps Triton's cache directory
        _triton_call.jax_triton()
    except ImportError as err:
        pytest.skip(f"the JAX launch needs jax-triton (and a CUDA build of jax): {err}")
    import jax.numpy as jnp

    from qsa_jax.triton_qsa import triton_sparse_gqa_attention as jax_attention
    from qsa_torch.triton_qsa import triton_sparse_gqa_attention

    assert _triton_call.default_launcher().gluon
    chosen = []
    launch = _triton_call.JaxAdapter.launch
    monkeypatch.setattr(_triton_call.JaxAdapter, "launch",
                        lambda self, spec_, arrays: chosen.append(spec_.kernel) or launch(self, spec_, arrays))
    rng = np.random.default_rng()
    routes = family("qsa", width=260, top_k=64, overlap=0.6, rng=rng)(900)[None]
    q, k, v, tq, tk, tv = _problem(rng, routes, (24, 2), torch.bfloat16)
    want = triton_sparse_gqa_attention(tq, tk, tv, torch.from_numpy(routes).cuda(), 0.0625)
    as_jax = lambda t: jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16)  # noqa: E731 - exact
    got = jax_attention(as_jax(tq), as_jax(tk), as_jax(tv), jnp.asarray(routes.astype(np.int32)), 0.0625)
    got = torch.from_numpy(np.asarray(got.astype(jnp.float32)))
    # traced once here (a shape no other test uses)
    assert [k for k in chosen if k.startswith("forward")] == ["forward_sm90"], chosen
    assert torch.equal(got, want.float().cpu())
    oracle = oracle_forward_backward(q, k, v, routes, 0.0625, np.zeros_like(q))[0]
    assert relative_error(got.double().numpy(), oracle) < 1e-2


@pytest.mark.gpu
def test_head_major_kv():
    """K/V laid out [B, Hkv, S_kv, D] and viewed as [B, S_kv, Hkv, D] (head stride S_kv * D,
    row stride D: in scope, the head offset taken in int64): the same bits as forward.py."""
    _hopper()
    rng = np.random.default_rng()
    routes = family("qsa", width=260, top_k=64, rng=rng)(500)[None]
    _, _, _, tq, tk, tv = _problem(rng, routes, (24, 2), torch.bfloat16)
    tk, tv = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (tk, tv))
    assert tk.stride()[2] == 500 * 256
    got, generic = _run_both(tq, tk, tv, routes, 0.0625, 12)
    assert torch.equal(got["O"], generic["O"]) and torch.equal(got["LSE"], generic["LSE"])
