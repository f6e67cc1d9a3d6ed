"""The JAX Pallas kernels (interpret mode on CPU; natively where a GPU is present)."""

from __future__ import annotations

import numpy as np
import pytest
from contract_base import TOLERANCE, BackendContract, UnroutedRowsIsolated, random_inputs
from runners import run_jax

from qsa_common.errors import NoBackendAvailable, UnsupportedDevice, UnsupportedShape
from qsa_common.generators import adversarial_routes
from qsa_common.layouts import make_problem
from qsa_common.oracle import membership, oracle_forward_backward, relative_error


def pallas(*args, **kw):
    from qsa_jax import sparse_gqa_attention

    return sparse_gqa_attention(*args, implementation="pallas", interpret=True, **kw)


class TestPallasInterpret(UnroutedRowsIsolated, BackendContract):
    heads = ((4, 2), (3, 1))  # G = 2 and 3 (padded to 4)
    seq_len = 24

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_jax(pallas, q, k, v, routes, scale, grad_out, dtype)


class TestPallasInterpretBf16(TestPallasInterpret):
    dtypes = ("bfloat16",)
    heads = ((2, 2),)
    layouts = ("packed",)


def test_tile_union_matches_brute_force():
    import jax.numpy as jnp

    from qsa_jax.pallas_qsa import tile_route_union

    rng = np.random.default_rng()
    routes = adversarial_routes(21, width=7, rng=rng)[None]
    clipped = np.where((routes >= 0) & (routes < 21), routes, -1).astype(np.int32)
    rows, block_k = 4, 16
    union, bits, count = (np.asarray(x) for x in tile_route_union(jnp.asarray(clipped), rows, block_k))
    assert union.shape == bits.shape == (1, 6, 32) and count.shape == (1, 6, 1)
    for t in range(6):
        tile = clipped[0, t * rows : (t + 1) * rows]
        want = sorted({int(r) for r in tile.ravel() if r >= 0})
        n = len(want)
        assert count[0, t, 0] == n
        assert union[0, t, :n].tolist() == want and (union[0, t, n:] == -1).all()
        for u, ident in enumerate(want):
            expect = sum(1 << j for j, row in enumerate(tile) if ident in row)
            assert bits[0, t, u] == expect
        assert (bits[0, t, n:] == 0).all()


def test_grad_jit_vmap_and_block_sizes():
    import jax
    import jax.numpy as jnp

    from qsa_jax.pallas_qsa import BlockSizes

    rng = np.random.default_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=20, top_k=2)
    q, k, v, do = random_inputs(rng, problem.routes, 20, (2, 1), 8, "float32")
    routes = jnp.asarray(problem.routes.astype(np.int32))
    stack = lambda x: jnp.asarray(np.stack([x, -x]), jnp.float32)  # noqa: E731
    bs = BlockSizes(block_m=32, block_k=16, block_m_bwd=16, block_k_bwd=16)

    def loss(q, k, v):
        out = jax.vmap(lambda a, b, c: pallas(a, b, c, routes, 0.4, block_sizes=bs))(q, k, v)
        return jnp.sum(out * stack(do))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(stack(q), stack(k), stack(v))
    for i, sign in enumerate((1, -1)):
        want = oracle_forward_backward(sign * q, sign * k, sign * v, problem.routes, 0.4, sign * do)
        for g, w in zip(grads, want[1:]):
            assert relative_error(np.asarray(g[i]), w) < 1e-5


def test_poisoned_outputs_are_overwritten(monkeypatch):
    """Every output buffer starts as NaN (aliased in): the kernels must write every element."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from qsa_jax import pallas_qsa

    original = pl.pallas_call
    poisoned = []

    def poisoning_call(kernel, out_shape, *, in_specs, out_specs, input_output_aliases=None, **kw):
        aliases = dict(input_output_aliases or {})
        fresh = [j for j in range(len(out_shape)) if j not in aliases.values()]
        n_in = len(in_specs)

        def kernel_with_poison(*refs):
            kernel(*refs[:n_in], *refs[n_in + len(fresh):])

        aliases.update({n_in + i: j for i, j in enumerate(fresh)})
        call = original(kernel_with_poison, out_shape,
                        in_specs=list(in_specs) + [out_specs[j] for j in fresh],
                        out_specs=out_specs, input_output_aliases=aliases, **kw)
        poisoned.append(kw.get("name"))
        return lambda *args: call(*args, *(jnp.full(out_shape[j].shape, jnp.nan, out_shape[j].dtype)
                                           for j in fresh))

    monkeypatch.setattr(pallas_qsa.pl, "pallas_call", poisoning_call)
    rng = np.random.default_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=16, width=8)
    q, k, v, do = random_inputs(rng, problem.routes, 16, (4, 2), 8, "float32")
    out, vjp = jax.vjp(lambda a, b, c: pallas(a, b, c, problem.routes), *map(jnp.asarray, (q, k, v)))
    grads = vjp(jnp.asarray(do))
    assert set(poisoned) == {"qsa_forward", "qsa_backward"}
    want = oracle_forward_backward(q, k, v, problem.routes, 8**-0.5, do)
    for got, ref in zip((out, *grads), want):
        assert relative_error(np.asarray(got), ref) < 1e-5


def test_float64_and_large_head_dim_are_refused():
    """Declined with the common classes UnsupportedDtype (a TypeError) and UnsupportedShape
    (a ValueError), BackendDeclined both, which the dispatcher reads as declines."""
    import jax
    import jax.numpy as jnp

    from qsa_jax.pallas_qsa import pallas_sparse_gqa_attention
    from qsa_jax.routes import UnsupportedDtype, UnsupportedShape

    routes = np.zeros((1, 4, 2), np.int32)
    x = jnp.ones((1, 4, 1, 512), jnp.float32)
    with pytest.raises(ValueError, match="head dim") as err:
        pallas_sparse_gqa_attention(x, x, x, routes, interpret=True)
    assert isinstance(err.value, UnsupportedShape)
    with jax.enable_x64(True):
        x = jnp.ones((1, 4, 1, 16), jnp.float64)
        with pytest.raises(TypeError, match="float64") as err:
            pallas_sparse_gqa_attention(x, x, x, routes, interpret=True)
        assert isinstance(err.value, UnsupportedDtype)


def test_implementation_list_falls_back_with_reasons(monkeypatch, caplog):
    """A declined implementation is logged with its reason (INFO the first time, DEBUG
    after) when another is left to try; the last one's refusal raises instead."""
    import logging

    import jax.numpy as jnp

    from qsa_jax import attention, sparse_gqa_attention

    monkeypatch.setattr(attention, "_LOGGED", set())
    x = jnp.ones((1, 4, 1, 512), jnp.float32)
    routes = np.zeros((1, 4, 2), np.int32)
    for level in (logging.INFO, logging.DEBUG):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="qsa_jax"):
            out = sparse_gqa_attention(x, x, x, routes, implementation=["pallas", "xla"], interpret=True)
        assert out.shape == x.shape
        declined = [r for r in caplog.records if "'pallas' declined" in r.getMessage()]
        assert [r.levelno for r in declined] == [level], caplog.records
        assert "head dim" in declined[0].getMessage() and declined[0].name == "qsa_jax"
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="qsa_jax"):
        with pytest.raises(UnsupportedShape, match="head dim"):  # one name: its own decline
            sparse_gqa_attention(x, x, x, routes, implementation=["pallas"], interpret=True)
    assert not [r for r in caplog.records if "declined" in r.getMessage()]
    with pytest.raises(NoBackendAvailable, match="pallas: UnsupportedShape: .*head dim") as err:
        sparse_gqa_attention(x, x, x, routes, implementation=["pallas", "triton"], interpret=True)
    assert sorted(err.value.reasons) == ["pallas", "triton"]
    with pytest.raises(ValueError, match="unknown implementation"):
        sparse_gqa_attention(x, x, x, routes, implementation="cuda")


def test_implementation_and_interpret_arguments_are_checked_first():
    """Every implementation name is checked before any runs; an empty list or a non-bool
    ``interpret`` is refused with the contract's types; off a GPU, ``interpret=False``
    makes Pallas decline (so a list falls through to the next implementation)."""
    import jax.numpy as jnp

    from qsa_jax import sparse_gqa_attention
    from qsa_jax.pallas_qsa import pallas_sparse_gqa_attention

    rng = np.random.default_rng()
    routes = np.where(rng.random((1, 6, 3)) < 0.8, rng.integers(0, 6, (1, 6, 3)), -1)
    q, k, v, _ = random_inputs(rng, routes, 6, (2, 1), 8, "float32")
    x = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    with pytest.raises(ValueError, match="no implementation"):
        sparse_gqa_attention(*x, routes, implementation=[])
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        sparse_gqa_attention(*x, routes, implementation=["xla", "nope"])
    with pytest.raises(TypeError, match="implementation"):
        sparse_gqa_attention(*x, routes, implementation=b"xla")
    for fn in (sparse_gqa_attention, pallas_sparse_gqa_attention):
        with pytest.raises(TypeError, match="interpret"):
            fn(*x, routes, interpret="False")
    want = oracle_forward_backward(q, k, v, routes, 8**-0.5)[0]
    out = sparse_gqa_attention(*x, routes, implementation=["pallas", "xla"], interpret=False)
    assert relative_error(np.asarray(out), want) < 1e-5
    if not any(d.platform == "gpu" for d in x[0].devices()):
        with pytest.raises(UnsupportedDevice, match="GPUs only"):
            sparse_gqa_attention(*x, routes, implementation=["pallas"], interpret=False)


@pytest.mark.parametrize("route_dtype", [np.int32, np.int64])
def test_kernels_with_x64_enabled(route_dtype):
    """With ``jax_enable_x64`` on, f32 inputs and int32 or int64 routes run through the
    Pallas kernels (their integer arithmetic stays int32) against the float64 oracle."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng()
    problem = make_problem("packed", "adversarial", seed=int(rng.integers(2**31)), seq_len=20, width=6)
    routes = problem.routes if route_dtype == np.int64 else np.where(
        np.abs(problem.routes) < 2**31, problem.routes, -1).astype(np.int32)
    q, k, v, do = random_inputs(rng, routes, 20, (2, 1), 8, "float32")
    with jax.enable_x64(True):
        out, vjp = jax.vjp(lambda a, b, c: pallas(a, b, c, jnp.asarray(routes), 0.4),
                           *(jnp.asarray(a, jnp.float32) for a in (q, k, v)))
        got = (out, *vjp(jnp.asarray(do, jnp.float32)))
        want = oracle_forward_backward(q, k, v, routes, 0.4, do)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert relative_error(np.asarray(g, np.float64), w) < 1e-5, name


def test_donated_and_sharded_inputs():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rng = np.random.default_rng()
    problem = make_problem("padded", "qsa", seed=int(rng.integers(2**31)), seq_len=16, top_k=2, batch=2)
    q, k, v, _ = random_inputs(rng, problem.routes, 16, (4, 2), 8, "float32")
    want = oracle_forward_backward(q, k, v, problem.routes, 0.5)[0]
    routes = jnp.asarray(problem.routes.astype(np.int32))
    donating = jax.jit(lambda a, b, c, r: pallas(a, b, c, r, 0.5), donate_argnums=(0, 1, 2))
    out = donating(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), routes)
    assert relative_error(np.asarray(out), want) < 1e-5
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    by_batch = NamedSharding(mesh, PartitionSpec("data"))
    sharded = [jax.device_put(jnp.asarray(x, jnp.float32), by_batch) for x in (q, k, v)]
    out = jax.jit(lambda a, b, c, r: pallas(a, b, c, r, 0.5))(*sharded, jax.device_put(routes, by_batch))
    assert relative_error(np.asarray(out), want) < 1e-5


def _capture_triton_lowerings(monkeypatch, keep) -> list:
    """``keep(result)`` of Pallas' Triton lowering of each kernel lowered from now on (read
    while the lowering's MLIR context is live), for kernels lowered for CUDA with
    ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``, no GPU needed."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    kept = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        kept.append(keep(result))
        return result

    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", capture)
    return kept


def _ttir(result) -> str:
    """The Triton IR text of a lowered kernel."""
    return result.module.operation.get_asm(enable_debug_info=False)


def test_backward_lowers_dkdv_adds_to_relaxed_atomics(monkeypatch):
    """On GPU the dK/dV adds must be relaxed-order atomics: Pallas' own addupdate
    lowers to acquire-release ones, which made the backward ~4x slower on the H200.
    Lowered here for CUDA without a GPU (Pallas falls back to SM90 for the lowering)."""
    import jax
    import jax.numpy as jnp

    from qsa_jax import _pallas_atomics
    from qsa_jax import pallas_qsa as pq

    assert _pallas_atomics.RELAXED, "the relaxed atomic primitive did not build on this JAX"
    modules = _capture_triton_lowerings(monkeypatch, _ttir)
    s, hq, hkv, d = 64, 4, 2, 64
    bs = pq.BlockSizes(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16)
    geo = pq._Geometry.make(hq // hkv, d, bs.block_m_bwd, bs.block_k_bwd)
    routes = jnp.asarray(np.random.default_rng(0).integers(-1, s, (1, s, 8)).astype(np.int32))
    q = jnp.zeros((1, s, hq, d), jnp.bfloat16)
    kv = jnp.zeros((1, s, hkv, d), jnp.bfloat16)

    def backward(q, k, v, do, routes):
        union, bits, count = pq.tile_route_union(routes, geo.rows, geo.block_k)
        rows = jnp.zeros((1, hkv, union.shape[1] * geo.block_m), jnp.float32)
        return pq._backward_call(q, k, v, do, rows, rows, union, bits, count, geo, 0.125, bs, False)

    jax.jit(backward).trace(q, kv, kv, q, routes).lower(lowering_platforms=("cuda",))
    atomics = [line for asm in modules for line in asm.splitlines() if "tt.atomic_rmw" in line]
    assert len(atomics) == 2, atomics
    assert all("fadd, relaxed" in line for line in atomics), atomics


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_default_block_sizes_in_interpret_mode(dtype):
    """The tile shapes the GPU runs by default (16-bit: flat programs of 128 (row, head)
    pairs forward and 64 backward, over 64-ID chunks, the backward sorting its own
    unions; fp32: smaller padded tiles), here through the interpreter at D=256 and
    G=12, so the default geometry's index arithmetic is checked against the oracle on
    CPU."""
    import jax.numpy as jnp

    from qsa_jax.pallas_qsa import BlockSizes

    rng = np.random.default_rng()
    bs = BlockSizes.default(256, interpret=False, dtype=jnp.dtype(dtype))
    if dtype == "bfloat16":
        assert (bs.block_m, bs.block_k, bs.block_m_bwd, bs.block_k_bwd) == (128, 64, 64, 64)
        assert bs.flatten_heads
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=40, top_k=6)
    q, k, v, do = random_inputs(rng, problem.routes, 40, (12, 1), 256, dtype)
    got = run_jax(lambda *a: pallas(*a, block_sizes=bs), q, k, v, problem.routes, 0.0625, do, dtype)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.0625, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < TOLERANCE[dtype], name


@pytest.mark.parametrize("heads", [(3, 1), (12, 1), (6, 2)])
@pytest.mark.parametrize("layout, family", [("packed", "adversarial"), ("cp", "qsa")])
def test_flattened_heads_against_the_oracle(heads, layout, family):
    """flatten_heads=True: programs take consecutive (row, head) pairs, spanning query
    rows across program boundaries; out and all gradients still match the oracle."""
    from qsa_jax.pallas_qsa import BlockSizes

    rng = np.random.default_rng()
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=26,
                           **(dict(top_k=3) if family == "qsa" else dict(width=7)))
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 16, "float32")
    bs = BlockSizes(block_m=32, block_k=16, block_m_bwd=16, block_k_bwd=16, flatten_heads=True)
    got = run_jax(lambda *a: pallas(*a, block_sizes=bs), q, k, v, problem.routes, 0.3, do, "float32")
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < 1e-5, name
    empty = ~membership(problem.routes, problem.kv_length).any(-1)
    assert np.all(got[0][empty] == 0) and np.all(got[1][empty] == 0)


def test_flat_route_union_matches_brute_force():
    import jax.numpy as jnp

    from qsa_jax.pallas_qsa import _Geometry, flat_route_union

    rng = np.random.default_rng()
    s_q, kv_length, group = 23, 30, 12
    routes = rng.integers(-3, kv_length + 3, size=(2, s_q, 5))
    routes[0, 4, 1] = routes[0, 4, 0]  # a repeated ID in a row
    clipped = np.where((routes >= 0) & (routes < kv_length), routes, -1).astype(np.int32)
    geo = _Geometry.make(group, 16, 32, 16, flat=True)
    assert geo.flat and geo.block_m == 32 and geo.rows == 4
    union, bits, count = (np.asarray(x) for x in flat_route_union(jnp.asarray(clipped), geo))
    n_blocks = -(-s_q * group // 32)
    assert union.shape[:2] == (2, n_blocks)
    for b in range(2):
        for p in range(n_blocks):
            first, last = 32 * p // group, min((32 * p + 31) // group, s_q - 1)
            rows = clipped[b, first:last + 1]
            ids = np.unique(rows[rows >= 0])
            n = int(count[b, p, 0])
            assert union[b, p, :n].tolist() == ids.tolist() and np.all(union[b, p, n:] == -1)
            want = [sum(1 << t for t in range(len(rows)) if x in rows[t]) for x in ids]
            assert bits[b, p, :n].tolist() == want


def test_flat_tiling_beyond_int32_pairs(monkeypatch):
    """flatten_heads indexes (row, head) pairs in int32: asked for explicitly past that
    range it raises NotImplementedError; the GPU default (flat for 16-bit D > 128)
    quietly falls back to padded tiles there."""
    import jax.numpy as jnp

    from qsa_jax import pallas_qsa as pq

    assert pq._pairs_fit_int32(2**31 - 1000, pq.BlockSizes())
    assert not pq._pairs_fit_int32(2**31 - 100, pq.BlockSizes())
    assert pq.BlockSizes.default(256, False).flatten_heads
    assert not pq.BlockSizes.default(256, True).flatten_heads
    q = jnp.zeros((1, 8, 3, 16), jnp.float32)
    kv = jnp.zeros((1, 8, 1, 16), jnp.float32)
    routes = jnp.zeros((1, 8, 2), jnp.int32)
    monkeypatch.setattr(pq, "_pairs_fit_int32", lambda pairs, bs: False)
    with pytest.raises(UnsupportedShape, match="int32"):
        pq.pallas_sparse_gqa_attention(q, kv, kv, routes, block_sizes=pq.BlockSizes(
            block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16, flatten_heads=True), interpret=True)
    seen = []
    real_run = pq._run
    monkeypatch.setattr(pq.BlockSizes, "default", classmethod(
        lambda cls, *a, **k: cls(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16, flatten_heads=True)))
    monkeypatch.setattr(pq, "_run", lambda *a, **kw: seen.append(kw["block_sizes"]) or real_run(*a, **kw))
    pq.pallas_sparse_gqa_attention(q, kv, kv, routes, interpret=True)
    assert seen and not seen[0].flatten_heads


@pytest.mark.parametrize("block_m_bwd, backward_sorts", [(16, 0), (32, 1)])
def test_backward_reuses_the_forward_unions_when_tiles_match(monkeypatch, block_m_bwd, backward_sorts):
    """Where the backward's geometry is the forward's, its unions are the forward's
    residuals; otherwise it sorts its own. Both give the oracle's gradients."""
    import jax
    import jax.numpy as jnp

    from qsa_jax import pallas_qsa

    jax.clear_caches()  # a cached trace would not call the patched functions
    in_backward, sorts = [], []
    route_union, backward = pallas_qsa._route_union, pallas_qsa._backward

    def counting_union(*args):
        sorts.extend(in_backward)
        return route_union(*args)

    def marked_backward(*args, **kwargs):
        in_backward.append(True)
        try:
            return backward(*args, **kwargs)
        finally:
            in_backward.clear()

    monkeypatch.setattr(pallas_qsa, "_route_union", counting_union)
    monkeypatch.setattr(pallas_qsa, "_backward", marked_backward)
    rng = np.random.default_rng()
    problem = make_problem("packed", "adversarial", seed=int(rng.integers(2**31)), seq_len=24, width=5)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (3, 1), 8, "float32")
    bs = pallas_qsa.BlockSizes(block_m=16, block_k=16, block_m_bwd=block_m_bwd, block_k_bwd=16,
                               flatten_heads=True)
    routes = np.asarray(problem.routes)

    def loss(q, k, v):
        return jnp.sum(pallas(q, k, v, routes, 0.3, block_sizes=bs) * jnp.asarray(do))

    grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    assert len(sorts) == backward_sorts
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for g, w in zip(grads, want[1:]):
        assert relative_error(np.asarray(g), w) < 1e-5


@pytest.mark.parametrize("head_dim, capability, tuned", [
    (256, None, True), (256, (9, 0), True), (256, (10, 0), True), (256, (8, 0), False), (256, (12, 0), False),
    (128, None, True), (128, (9, 0), True), (128, (8, 0), True), (128, (8, 6), False), (128, (12, 0), False),
    (128, (13, 0), False)])
def test_default_block_sizes_follow_the_gpu(head_dim, capability, tuned):
    """The tuned 16-bit tiles only where a block may take the shared memory their backward
    needs (192 KiB at D > 128: SM90, SM100; 144 KiB at D <= 128: SM80 too) or the GPU is
    unknown; elsewhere, an unlisted capability included, the small tiles fp32 uses."""
    import jax.numpy as jnp

    from qsa_jax.pallas_qsa import BlockSizes

    got = BlockSizes.default(head_dim, False, jnp.bfloat16, capability)
    small = BlockSizes.default(head_dim, False, jnp.float32)
    want = (128, 64, True) if head_dim > 128 else (128, 128, False)
    assert ((got.block_m, got.block_m_bwd, got.flatten_heads) == want) if tuned else got == small


def test_gpu_capability_of_where_an_array_lives():
    import jax
    import jax.numpy as jnp

    from qsa_jax.routes import gpu_capability

    cpu = jax.device_put(jnp.zeros(3), jax.devices("cpu")[0])
    assert gpu_capability(cpu) is None
    host = gpu_capability(np.zeros(3))  # a host array: the default backend's GPU, if any
    if jax.default_backend() == "gpu":
        assert isinstance(host, tuple) and len(host) == 2 and host[0] >= 5
    else:
        assert host is None


def test_tracers_follow_the_default_device():
    """Tracers say nothing of where they live: on_gpu / gpu_capability answer for
    ``jax.default_device`` where it is set (a device or a platform name), else for the
    default backend, both in and out of jit."""
    import jax
    import jax.numpy as jnp

    from qsa_jax.routes import gpu_capability, on_gpu

    seen = []

    @jax.jit
    def probe(x):
        seen.append((on_gpu(x), gpu_capability(x)))
        return x

    gpu = jax.default_backend() == "gpu"
    for pinned in (None, jax.devices("cpu")[0], "cpu"):
        seen.clear()
        with jax.default_device(pinned):
            probe(jnp.zeros(3))  # the default device is part of jit's cache key: traced each time
            assert on_gpu(np.zeros(3)) == (gpu and pinned is None)
        assert seen and seen[0][0] == (gpu and pinned is None)
        assert (seen[0][1] is not None) == (gpu and pinned is None)


def test_host_arrays_follow_the_default_device_beside_a_gpu(monkeypatch):
    """As if the host had a GPU (``jax.devices()`` reporting one): host arrays are on it
    unless ``jax.default_device`` pins the CPU."""
    import jax

    from qsa_jax import routes

    class FakeGpu:
        platform, compute_capability = "gpu", "9.0"

    monkeypatch.setattr(routes.jax, "devices", lambda *backend: [FakeGpu()] if not backend else jax.local_devices(
        backend=backend[0]))
    assert routes.on_gpu(np.zeros(3)) and routes.gpu_capability(np.zeros(3)) == (9, 0)
    for pinned in (jax.local_devices(backend="cpu")[0], "cpu"):
        with jax.default_device(pinned):
            assert not routes.on_gpu(np.zeros(3)) and routes.gpu_capability(np.zeros(3)) is None


@pytest.mark.parametrize("heads, flat", [((3, 1), True), ((4, 2), False)])
def test_transposed_dkdv_adds_against_the_oracle(heads, flat):
    """The backward's dK/dV blocks, computed and added transposed, give the oracle's
    gradients with flat programs and with padded heads, on adversarial routes."""
    from qsa_jax.pallas_qsa import BlockSizes

    rng = np.random.default_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=24, width=6)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 16, "float32")
    blocks = BlockSizes(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16, flatten_heads=flat)
    got = run_jax(lambda *a: pallas(*a, block_sizes=blocks), q, k, v, problem.routes, 0.3, do, "float32")
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < TOLERANCE["float32"], name


def test_launch_grid_folds_past_cuda_limits(monkeypatch):
    """Grids are (tiles, batch, KV heads): a batch past CUDA's 65535 along y still
    launches, Pallas' Triton lowering folding y into x (lowered for CUDA, no GPU needed;
    shapes only, nothing allocated)."""
    import math

    import jax
    import jax.numpy as jnp

    from qsa_jax import pallas_qsa as pq

    grids = _capture_triton_lowerings(monkeypatch, lambda result: tuple(result.grid))
    bsz, s, hq, hkv, d = 70_000, 16, 2, 1, 16
    bs = pq.BlockSizes(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16)
    geo = pq._Geometry.make(hq // hkv, d, bs.block_m, bs.block_k)
    n_tiles = -(-s // geo.rows)
    shape = jax.ShapeDtypeStruct
    q, kv = shape((bsz, s, hq, d), jnp.bfloat16), shape((bsz, s, hkv, d), jnp.bfloat16)
    union = shape((bsz, n_tiles, 32), jnp.int32)
    count = shape((bsz, n_tiles, 1), jnp.int32)

    def forward(q, k, v, union, bits, count):
        return pq._forward_call(q, k, v, union, bits, count, geo, 0.25, bs, False)

    jax.jit(forward).trace(q, kv, kv, union, union, count).lower(lowering_platforms=("cuda",))
    assert grids and all(max(g[1:], default=1) <= 65535 for g in grids), grids
    assert math.prod(grids[-1]) == n_tiles * bsz * hkv


@pytest.mark.gpu
def test_default_tiles_at_head_dim_256_run_forward_and_backward():
    """The tuned defaults (flat programs of 128 pairs forward, 64 backward, 64-ID chunks)
    at the model's shape, against the float64 oracle."""
    import jax
    import jax.numpy as jnp

    from qsa_jax import sparse_gqa_attention

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("the tuned tiles compile for GPUs only")
    rng = np.random.default_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=512, top_k=16)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (24, 2), 256, "bfloat16")
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]

    def grads(implementation):
        out, pull = jax.vjp(lambda a, b, c: sparse_gqa_attention(a, b, c, problem.routes,
                                                                 implementation=implementation), *args)
        return [np.asarray(t, np.float64) for t in (out, *pull(jnp.asarray(do, jnp.bfloat16)))]

    want = oracle_forward_backward(q, k, v, problem.routes, 256 ** -0.5, do)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), grads("pallas"), want):
        assert relative_error(got, ref) < 1e-2, name


@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("capability, limit_kib", [((9, 0), 227), ((8, 0), 163), ((12, 0), 99)])
def test_default_tiles_fit_shared_memory(monkeypatch, tmp_path, kernel, head_dim, dtype, capability, limit_kib):
    """Each default kernel for a GPU, lowered for CUDA (no GPU needed) and compiled for its
    architecture by the installed Triton, asks for at most the shared memory one of its
    blocks may take (a 128-pair 16-bit backward at D=256 keeps Q and dO twice, as they are
    and transposed: 320 KiB; a 3-stage forward there asks Triton 3.9 for 257 KiB)."""
    triton = pytest.importorskip("triton", reason="compiling the kernels for a GPU architecture needs Triton")
    import jax
    import jax.numpy as jnp
    from triton.backends.compiler import GPUTarget

    from qsa_jax import pallas_qsa as pq

    modules = _capture_triton_lowerings(monkeypatch, _ttir)
    dt = jnp.dtype(dtype)
    bs = pq.BlockSizes.default(head_dim, False, dt, capability)
    (hq, hkv), d, s, width = (24, 2), head_dim, 64, 2052
    make_geometry = pq._forward_geometry if kernel == "forward" else pq._backward_geometry
    geo = make_geometry(hq // hkv, d, bs)
    shape = jax.ShapeDtypeStruct
    # the unions' shapes as the kernel receives them, from the routes' [B, S, width]
    union, bits, count = jax.eval_shape(lambda r: pq._route_union(r, geo), shape((1, s, width), jnp.int32))
    rows = shape((1, hkv, union.shape[1] * geo.block_m), jnp.float32)
    q, kv = shape((1, s, hq, d), dt), shape((1, s, hkv, d), dt)
    if kernel == "forward":
        def call(q, k, v, union, bits, count):
            return pq._forward_call(q, k, v, union, bits, count, geo, 0.0625, bs, False)

        args, options = (q, kv, kv, union, bits, count), dict(num_warps=bs.num_warps, num_stages=bs.num_stages)
    else:
        def call(q, k, v, do, lse, delta, union, bits, count):
            return pq._backward_call(q, k, v, do, lse, delta, union, bits, count, geo, 0.0625, bs, False)

        args = (q, kv, kv, q, rows, rows, union, bits, count)
        options = dict(num_warps=bs.num_warps_bwd, num_stages=bs.num_stages_bwd)
    jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(modules) == 1
    path = tmp_path / f"qsa_{kernel}.ttir"
    path.write_text(modules[0])
    try:
        arch = capability[0] * 10 + capability[1]
        compiled = triton.compile(str(path), target=GPUTarget("cuda", arch, 32), options=options)
    except RuntimeError as err:  # IR of jax's Triton dialect that the installed Triton cannot read
        if "Parse MLIR file failed" not in str(err):
            raise
        pytest.skip(f"the installed Triton {triton.__version__} does not parse jax's Triton IR")
    assert compiled.metadata.shared <= limit_kib * 1024, (compiled.metadata.shared, bs)
