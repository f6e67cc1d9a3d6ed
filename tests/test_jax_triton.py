"""The JAX launch of the qsa_triton kernels (``implementation="triton"``), up to jax-triton.

jax-triton cannot run (or even import) without a CUDA build of jax, so on CPU this
module injects a launcher that does what ``jax_triton.triton_call`` does with a launch
(positional inputs and ``np.float32`` scalars, outputs appended after them and bound to
the kernel's next parameters by position, metaparameters by name, ``zeroed_outputs``
zeroed, every other output poisoned) and runs the kernel in Triton's interpreter on
host copies, inside ``jax.pure_callback``. Everything of the JAX path but the
jax-triton call itself therefore runs: plans, union building (key kernel, ``jnp.sort``,
merge and cut kernels), the forward and backward launches, the custom_vjp's residual
plumbing, under ``jax.jit`` and ``jax.grad``, against the float64 oracle, and, in the
same interpreter, bit for bit against the torch launch of the same kernels.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from contract_base import TOLERANCE, BackendContract, UnroutedRowsIsolated, random_inputs  # noqa: E402
from runners import run_jax  # noqa: E402
from union_oracle import assert_unions_equal, flat_unions, tile_unions  # noqa: E402

from qsa_common.errors import BackendDeclined, UnsupportedDtype, UnsupportedShape  # noqa: E402
from qsa_common.generators import adversarial_routes  # noqa: E402
from qsa_common.layouts import make_problem  # noqa: E402
from qsa_common.oracle import oracle_forward_backward, relative_error  # noqa: E402
from qsa_jax import triton_qsa as jt  # noqa: E402
from qsa_jax._triton_call import operand as jax_operand  # noqa: E402
from qsa_triton import driver  # noqa: E402
from qsa_triton import launch as spec  # noqa: E402
from qsa_triton.config import SAFE_BLOCK_SIZES, BlockSizes  # noqa: E402
from qsa_triton.plan import flat_span, make_plan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32,
          "int64": torch.int64}
_POISON = {"float32": float("nan"), "bfloat16": float("nan"), "float16": float("nan"), "int32": -123456789,
           "int64": -123456789}


def _to_torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype.name == "bfloat16":  # numpy has no bf16: move the bits
        return torch.from_numpy(np.array(x).view(np.uint16)).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(np.array(x)).to(DEVICE)  # a writable copy


def _to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return t.cpu().view(torch.uint16).numpy().view(jnp.bfloat16)
    return t.cpu().numpy()


def _output(out: spec.Output) -> torch.Tensor:
    if out.zeroed:
        return torch.zeros(out.shape, dtype=_TORCH[out.dtype], device=DEVICE)
    return torch.full(out.shape, _POISON[out.dtype], dtype=_TORCH[out.dtype], device=DEVICE)


def emulate_triton_call(launch: spec.Launch, *inputs: np.ndarray) -> list[np.ndarray]:
    """jax_triton.triton_call's contract, on host arrays, with the kernel interpreted."""
    kernel = spec.kernel(launch.kernel)
    positional = [_to_torch(x) for x in inputs] + [float(np.float32(v)) for _, v in launch.scalars]
    outputs = [_output(out) for out in launch.outputs]
    named = dict(zip(kernel.arg_names, positional + outputs))  # outputs follow the positional arguments
    params = dict(launch.params)
    assert not set(named) & set(params), set(named) & set(params)
    named.update(params)
    assert set(named) == set(kernel.arg_names), set(kernel.arg_names) ^ set(named)
    kernel[launch.grid](**named, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return [_to_numpy(t, out.dtype) for t, out in zip(outputs, launch.outputs)]


@dataclass(frozen=True)
class InterpretedLauncher:
    """The injected launcher: :func:`emulate_triton_call` through ``jax.pure_callback``."""

    interpreted: bool = spec.interpreted()

    def __call__(self, launch, arrays):
        shapes = [jax.ShapeDtypeStruct(out.shape, jnp.dtype(out.dtype)) for out in launch.outputs]
        results = jax.pure_callback(lambda *xs: emulate_triton_call(launch, *(np.asarray(x) for x in xs)),
                                    shapes, *(arrays[name] for name in launch.inputs))
        return {out.name: x for out, x in zip(launch.outputs, results)}


LAUNCHER = InterpretedLauncher()
SMALL = BlockSizes(block_m=16, block_k=16, num_warps=1, num_stages=1, backward_block_m=16, backward_block_k=16,
                   backward_num_warps=1, backward_num_stages=1)


def attention(*args, **kwargs):
    return jt.triton_sparse_gqa_attention(*args, launcher=LAUNCHER, **kwargs)


def _fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


class TestJaxTritonContract(UnroutedRowsIsolated, BackendContract):
    """The contract matrix (small: the interpreter runs every program in Python)."""

    heads = ((6, 2),)  # 3 heads padded to 4 (test_jit_grad_against_the_oracle: flat tilings)
    families = ("qsa", "adversarial")

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        fn = lambda *a: attention(*a, block_sizes=SMALL)  # noqa: E731
        return run_jax(fn, q, k, v, routes, scale, grad_out, dtype)


@pytest.mark.parametrize("heads, blocks", [
    ((12, 1), BlockSizes(block_m=32, block_k=16, backward_block_k=16, flatten_heads=True)),  # flat, cut from tiles
    ((3, 1), BlockSizes(block_m=64, block_k=16, backward_block_k=16, flatten_heads=True)),  # flat, sorted per program
    ((6, 2), BlockSizes(block_m=32, block_k=16, backward_block_m=16, backward_block_k=16,
                        backward_rows_per_tile=4)),  # padded, the backward's unions cut
])
def test_jit_grad_against_the_oracle(heads, blocks):
    """``jax.jit(jax.grad(...))`` through the custom_vjp (the way parity.bench calls the
    public entry point), bf16, every tiling the launchers plan."""
    rng = _fresh_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=26, top_k=3)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 16, "bfloat16")
    routes = jnp.asarray(problem.routes.astype(np.int32))

    def loss(q_, k_, v_, r):
        return jnp.sum(attention(q_, k_, v_, r, 0.3, block_sizes=blocks).astype(jnp.float32) * do)

    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args, routes)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[1:]):
        assert g.dtype == jnp.bfloat16
        assert relative_error(np.asarray(g, np.float64), w) < TOLERANCE["bfloat16"], name


@pytest.mark.parametrize("heads, blocks", [
    ((6, 2), SMALL),
    ((12, 1), BlockSizes(block_m=32, block_k=16, backward_block_k=16, flatten_heads=True)),
])
def test_forward_and_lse_equal_torch_bit_for_bit(heads, blocks):
    """The same kernels with the same launches: torch's and JAX's out and LSE are the
    same bits (here in the interpreter; scripts/gpu/check_jax_triton.py on the GPU)."""
    from qsa_torch import _triton_launch
    from qsa_torch import triton_qsa as tt

    rng = _fresh_rng()
    problem = make_problem("padded", "adversarial", seed=int(rng.integers(2**31)), seq_len=24, width=7, batch=2)
    q, k, v, _ = random_inputs(rng, problem.routes, problem.kv_length, heads, 16, "bfloat16")
    scale = 0.77 * 16**-0.5
    out, lse = jt.forward_with_lse(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), problem.routes, scale,
                                   block_sizes=blocks, launcher=LAUNCHER)
    tq, tk, tv = (torch.tensor(x, dtype=torch.bfloat16, device=DEVICE) for x in (q, k, v))
    plan = make_plan(heads[0] // heads[1], 16, blocks)
    unions = tt.build_unions(torch.from_numpy(problem.routes).to(DEVICE), problem.kv_length, plan)
    t_out, t_lse = driver.forward(_triton_launch.adapter(tq.device), tq, tk, tv, unions, scale, plan)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), t_out.cpu().view(torch.uint16).numpy())
    np.testing.assert_array_equal(np.asarray(lse), t_lse.cpu().numpy())


@pytest.mark.parametrize("layout, heads, blocks", [
    ("cp", (12, 1), BlockSizes(block_m=32, block_k=16, backward_block_k=16, flatten_heads=True)),
    ("padded", (6, 2), SMALL),
])
def test_deterministic_gradients_equal_torch_bit_for_bit(layout, heads, blocks):
    """``deterministic=True`` under ``jax.jit(jax.grad(...))``: the float64 oracle's
    gradients, the same bits on a second run, and the same bits as torch's deterministic
    backward (same kernels, launches and maxima; integer sums), here in the interpreter."""
    rng = _fresh_rng()
    problem = make_problem(layout, "adversarial", seed=int(rng.integers(2**31)), seq_len=20, width=6)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 16, "bfloat16")
    scale = 0.77 * 16**-0.5

    def loss(q_, k_, v_):  # int64 numpy routes (huge IDs included), checked on the host
        out = attention(q_, k_, v_, problem.routes, scale, block_sizes=blocks, deterministic=True)
        return jnp.sum(out.astype(jnp.float32) * do)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    runs = [[np.asarray(g).view(np.uint16) for g in grad(*args)] for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    want = oracle_forward_backward(q, k, v, problem.routes, scale, do)
    for name, g, w in zip(("dq", "dk", "dv"), runs[0], want[1:]):
        err = relative_error(g.view(jnp.bfloat16).astype(np.float64), w)
        assert err < TOLERANCE["bfloat16"], name

    from qsa_torch import triton_qsa as tt

    leaves = [torch.tensor(x, dtype=torch.bfloat16, device=DEVICE, requires_grad=True) for x in (q, k, v)]
    out = tt.triton_sparse_gqa_attention(*leaves, torch.from_numpy(problem.routes).to(DEVICE), scale,
                                         block_sizes=blocks, deterministic=True)
    out.backward(torch.tensor(do, dtype=torch.bfloat16, device=DEVICE))
    for name, g, t in zip(("dq", "dk", "dv"), runs[0], leaves):
        np.testing.assert_array_equal(g, t.grad.cpu().view(torch.uint16).numpy(), err_msg=name)


def _on_cpu(x):
    """``x`` on the host: these tests check host-side logic against torch's CPU path,
    also on a machine whose default JAX device is a GPU."""
    return jax.device_put(x, jax.devices("cpu")[0])


def test_deterministic_input_maxima_match_torch():
    """MAXIMA (max|q| and max|do| over routed (row, head) pairs, max|v| over finite rows)
    are the same fp32 bits in both frameworks: a NaN/inf row of V, q or do is skipped (the
    kernels confine such a q/do row), a NaN in a pair without routes (LSE +inf) too."""
    from qsa_torch import _triton_launch

    rng = _fresh_rng()
    q, do = (rng.standard_normal((1, 5, 4, 8)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    v[0, 2, 1, 3], v[0, 4, 0, 0] = np.inf, np.nan
    q[0, 1, 2, 3] = -1e30
    lse = rng.standard_normal((1, 4, 5)).astype(np.float32)
    lse[0, :, 3] = np.inf  # row 3 has no routes
    q[0, 3, 0, 0] = np.nan  # never read by the backward
    for do_case in (do, np.where(np.arange(8) == 5, np.nan, do).astype(np.float32)):
        args = (q, do_case, v)
        got = np.asarray(jt.input_maxima(*(_on_cpu(jnp.asarray(x, jnp.bfloat16)) for x in args),
                                         _on_cpu(jnp.asarray(lse))))
        want = _triton_launch.input_maxima(*(torch.tensor(x, dtype=torch.bfloat16) for x in args),
                                           torch.from_numpy(lse))
        np.testing.assert_array_equal(got.view(np.uint32), want.numpy().view(np.uint32))
        assert got[0] == np.float32(torch.tensor(-1e30, dtype=torch.bfloat16).abs().item())
        rows = np.abs(do_case[:, [0, 1, 2, 4]]).max(axis=-1)
        want_do = rows[np.isfinite(rows)].max(initial=0.0)
        assert np.isfinite(got).all() and got[1] == np.float32(torch.tensor(want_do, dtype=torch.bfloat16).item())


def test_deterministic_dispatch(monkeypatch):
    """``qsa_jax.sparse_gqa_attention(deterministic=True)``: "triton" passes it on, "pallas"
    declines (so a sequence falls through), "xla" runs on CPU and, on GPUs, only with
    XLA's deterministic-ops flag in XLA_FLAGS."""
    from qsa_common.errors import DeterminismUnavailable, InvalidDtype
    from qsa_jax import attention as dispatch
    from qsa_jax import pallas_qsa, sparse_gqa_attention, xla_reference

    x = _on_cpu(jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 2, 16)), jnp.float32))
    routes = np.array([[[0, 1], [1, -1], [2, 0], [3, 5], [-1, -1], [4, 2]]])
    seen = []
    monkeypatch.setattr(jt, "checked_attention", lambda *a, deterministic, **kw: seen.append(deterministic) or a[0])
    monkeypatch.setattr(jt, "supports", lambda *a, **kw: None)  # as on a GPU with jax-triton
    sparse_gqa_attention(x, x, x, routes, implementation="triton", deterministic=True)
    assert seen == [True]
    with pytest.raises(DeterminismUnavailable, match="deterministic"):
        sparse_gqa_attention(x, x, x, routes, implementation="pallas", deterministic=True)
    with pytest.raises(DeterminismUnavailable, match="deterministic"):
        pallas_qsa.pallas_sparse_gqa_attention(x, x, x, routes, deterministic=True)
    want = sparse_gqa_attention(x, x, x, routes, implementation="xla")
    got = sparse_gqa_attention(x, x, x, routes, implementation=("pallas", "xla"), deterministic=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(InvalidDtype, match="deterministic"):
        sparse_gqa_attention(x, x, x, routes, deterministic=1)

    monkeypatch.setattr(xla_reference, "on_gpu", lambda _: True)  # as if x lived on a GPU
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    sparse_gqa_attention(x, x, x, routes, implementation="xla", deterministic=None)  # None: not asked
    with pytest.raises(DeterminismUnavailable, match="xla_gpu_deterministic_ops"):
        sparse_gqa_attention(x, x, x, routes, implementation="xla", deterministic=True)
    sparse_gqa_attention(x, x, x, routes, implementation="xla")  # not asked: runs
    for flag in dispatch.DETERMINISTIC_XLA_FLAGS:
        monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=4 {flag}")
        sparse_gqa_attention(x, x, x, routes, implementation="xla", deterministic=True)
        # None follows the flag: Pallas (fp32 atomics) declines as for True
        with pytest.raises(DeterminismUnavailable):
            sparse_gqa_attention(x, x, x, routes, implementation="pallas")


@pytest.mark.parametrize("recipe", ["rank", "sorted"])
@pytest.mark.parametrize("group, pairs", [(12, 32), (3, 64), (1, 0), (3, 0)])
def test_unions_equal_torch_and_the_oracle(monkeypatch, group, pairs, recipe):
    """JAX-built unions (padded tiles, flat programs cut from tiles, flat programs
    built per program), by either recipe (``qsa_triton.plan.rank_recipe``'s limit
    moved to force it), equal the oracle's, and torch's, element for element, on
    adversarial and random int64 routes (huge IDs included)."""
    from qsa_torch import triton_qsa as tt
    from qsa_triton import plan as plan_module

    rng = _fresh_rng()
    s_q, kv_length, width = 37, 40, 6
    routes = np.stack([np.resize(adversarial_routes(kv_length, width=width, rng=rng), (s_q, width)),
                       rng.integers(-3, kv_length + 3, size=(s_q, width))])
    routes[1, 5, 2] = 2**40 + 3  # huge int64: padding
    blocks = BlockSizes(block_m=pairs or 16, flatten_heads=pairs > 0)
    plan = make_plan(group, 16, blocks)
    monkeypatch.setattr(plan_module, "RANK_IDS_PER_KEY", 10**9 if recipe == "rank" else 0)
    step, _ = plan_module.union_recipe(plan, s_q, width, kv_length, 2)
    assert plan_module.rank_recipe(step, width, kv_length) == (recipe == "rank")
    want = (flat_unions(routes, kv_length, group, pairs, flat_span(pairs, group)) if plan.flat
            else tile_unions(routes, kv_length, plan.rows_per_tile))
    from qsa_jax.routes import prepare_routes

    got = jt.build_unions(jnp.asarray(prepare_routes(routes)), kv_length, plan, LAUNCHER)
    assert_unions_equal(got, want, "jax")
    torch_unions = tt.build_unions(torch.from_numpy(routes).to(DEVICE), kv_length, plan)
    assert_unions_equal(tuple(x.cpu().numpy() for x in (torch_unions.union, torch_unions.count,
                                                       torch_unions.rowbits)), want, "torch")


def test_both_defaults_fall_back_to_padded_tiles_past_int32_pairs(monkeypatch):
    """Where flat programs would index (row, head) pairs past int32 (S_q * G near 2**31),
    both frameworks' default plans take the same blocks as padded tiles (the launch would
    refuse the flat ones); below that both stay flat; chosen flat blocks are refused there.
    Shapes only: meta tensors and ShapeDtypeStructs hold no memory."""
    from qsa_torch import triton_qsa as tt
    from qsa_triton.plan import default_plan

    blocks = tt.DEFAULT_BLOCK_SIZES
    monkeypatch.setattr(tt, "default_block_sizes", lambda device, head_dim, dtype: blocks)
    monkeypatch.setattr(jt, "default_block_sizes", lambda capability, head_dim, dtype: blocks)
    last = (2**31 - 1) // 128 * 128 // 12  # 12 * last pairs: whole 128-pair programs, the last below 2**31
    assert 12 * last == (2**31 - 1) // 128 * 128
    for s_q, flat in ((last, True), (last + 1, False), (2**28, False)):
        torch_plan = tt._plan(torch.empty((1, s_q, 12, 256), device="meta"),
                              torch.empty((1, 8, 1, 256), device="meta"), None)
        jax_plan = jt.plan_for(jax.ShapeDtypeStruct((1, s_q, 12, 256), jnp.bfloat16),
                               jax.ShapeDtypeStruct((1, 8, 1, 256), jnp.bfloat16))
        assert torch_plan == jax_plan == default_plan(12, 256, blocks, s_q) and torch_plan.flat == flat, s_q
        if not flat:
            assert torch_plan == make_plan(12, 256, dataclasses.replace(blocks, flatten_heads=False))
            with pytest.raises(UnsupportedShape, match="int32"):
                jt.plan_for(jax.ShapeDtypeStruct((1, s_q, 12, 256), jnp.bfloat16),
                            jax.ShapeDtypeStruct((1, 8, 1, 256), jnp.bfloat16), blocks)


def test_launches_and_plans_match_torch():
    """Both launchers' descriptions for one problem: the same kernels, grids, warps,
    stages, fp32 scalars and integer/constexpr arguments (strides included, for
    contiguous torch tensors)."""
    from qsa_torch import triton_qsa as tt

    q = _on_cpu(jnp.zeros((2, 40, 12, 256), jnp.bfloat16))
    kv = _on_cpu(jnp.zeros((2, 40, 1, 256), jnp.bfloat16))
    tq, tkv = torch.zeros(2, 40, 12, 256, dtype=torch.bfloat16), torch.zeros(2, 40, 1, 256, dtype=torch.bfloat16)
    blocks = tt.DEFAULT_BLOCK_SIZES
    assert jt.plan_for(q, kv, blocks) == tt.make_plan(12, 256, blocks)
    assert jt.plan_for(q, kv) == make_plan(12, 256, SAFE_BLOCK_SIZES)  # a CPU array: no GPU row
    plan = jt.plan_for(q, kv, blocks)
    jax_launch = spec.forward_launch(plan, jax_operand(q), jax_operand(kv), jax_operand(kv), (2, 30, 80), 0.0625,
                                     "bfloat16", interpreted=False)
    torch_launch = spec.forward_launch(plan, (tuple(tq.shape), tq.stride()), (tuple(tkv.shape), tkv.stride()),
                                       (tuple(tkv.shape), tkv.stride()), (2, 30, 80), 0.0625, "bfloat16",
                                       interpreted=False)
    assert jax_launch == torch_launch


def test_host_side_launch_description():
    """What the JAX launcher hands jax_triton for the default H200 forward: inputs and
    np.float32 scalars in signature order, outputs' shapes/dtypes, the grid."""
    calls = []

    @dataclass(frozen=True)
    class Recorder:
        interpreted: bool = False

        def __call__(self, launch, arrays):
            calls.append((launch, {n: (a.shape, a.dtype) for n, a in arrays.items()}))
            return {o.name: jnp.zeros(o.shape, o.dtype) for o in launch.outputs}

    q = jax.ShapeDtypeStruct((1, 64, 24, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 256), jnp.bfloat16)
    routes = jax.ShapeDtypeStruct((1, 64, 20), jnp.int32)
    plan = make_plan(12, 256, jt.BlockSizes(num_stages=3, backward_block_k=64, flatten_heads=True))
    jax.eval_shape(lambda a, b, c, r: jt._forward(a, b, c, r, 0.0625, plan, jt._adapter(a, Recorder())),
                   q, kv, kv, routes)
    kernels = [launch.kernel for launch, _ in calls]
    # 64 IDs against 32-row groups of 20 routes: the rank recipe (qsa_triton.plan.rank_recipe)
    assert kernels == ["union_rank", "union_cut", "forward"]
    forward, arrays = calls[-1]
    assert forward.inputs == ("Q", "K", "V", "UNION", "COUNT", "ROWBITS") and set(arrays) == set(forward.inputs)
    assert [(o.name, o.shape, o.dtype) for o in forward.outputs] == [
        ("O", (1, 64, 24, 256), "bfloat16"), ("LSE", (1, 24, 64), "float32")]
    assert forward.grid == (-(-64 * 12 // 128), 2) and (forward.num_warps, forward.num_stages) == (8, 3)
    assert arrays["UNION"][1] == jnp.int32 and arrays["COUNT"][0] == (1, forward.grid[0])


@pytest.mark.parametrize("before", [None, "/tmp/some-triton-cache"])
def test_importing_jax_triton_keeps_tritons_cache_directory(monkeypatch, before):
    """jax-triton 0.3.1 empties TRITON_CACHE_DIR on import, after which any other
    triton.jit compile in the process fails ("Could not create or locate cache dir", seen
    with torch Triton beside JAX on the H200); the loader puts the caller's value back."""
    import types

    from qsa_jax import _triton_call

    stand_in = types.ModuleType("jax_triton")

    class Finder:  # imports a module that clobbers the variable, as jax-triton does
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "jax_triton":
                return None
            import importlib.machinery

            class Loader:
                def create_module(self, spec):
                    os.environ["TRITON_CACHE_DIR"] = ""
                    return stand_in

                def exec_module(self, module):
                    pass

            return importlib.machinery.ModuleSpec(name, Loader())

    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder()] + sys.meta_path)
    if before is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", before)
    try:
        assert _triton_call.jax_triton() is stand_in
        assert os.environ.get("TRITON_CACHE_DIR") == before
    finally:  # later tests import the real module, where there is one
        sys.modules.pop("jax_triton", None)


def test_missing_jax_triton_raises_import_error_on_first_use(monkeypatch, caplog):
    """The first call without jax-triton raises ImportError naming it; a list of
    implementations moves on to the next, with a WARNING on the "qsa_jax" logger
    (test_imports checks that importing the module needs nothing optional)."""
    from qsa_jax import _triton_call, attention, sparse_gqa_attention

    monkeypatch.setitem(sys.modules, "jax_triton", None)
    _triton_call.default_launcher.cache_clear()
    x = jnp.ones((1, 4, 2, 16), jnp.float32)
    routes = np.zeros((1, 4, 2), np.int32)
    try:
        with pytest.raises(ImportError, match="jax-triton"):
            jt.triton_sparse_gqa_attention(x, x, x, routes)
        with pytest.raises(ImportError, match="jax-triton"):
            sparse_gqa_attention(x, x, x, routes, implementation="triton")
        monkeypatch.setattr(attention, "_LOGGED", set())
        with caplog.at_level(logging.INFO, logger="qsa_jax"):
            out = sparse_gqa_attention(x, x, x, routes, implementation=("triton", "xla"))
        assert out.shape == x.shape
        declined = [r for r in caplog.records if "'triton' declined" in r.getMessage()]
        assert [r.levelno for r in declined] == [logging.WARNING] and "jax-triton" in declined[0].getMessage()
    finally:
        _triton_call.default_launcher.cache_clear()


def test_declines_what_it_cannot_run():
    x = jnp.ones((1, 4, 2, 16), jnp.float32)
    routes = np.zeros((1, 4, 2), np.int32)
    with pytest.raises(UnsupportedShape, match="head dim <= 256, got 264"):  # a ValueError, and a decline
        attention(*(jnp.ones((1, 4, 2, 264), jnp.float32),) * 3, routes)
    with jax.enable_x64(True):
        wide = jnp.ones((1, 4, 2, 16), jnp.float64)
        with pytest.raises(UnsupportedDtype, match="float64"):  # a TypeError, and a decline
            attention(wide, wide, wide, routes)
    with pytest.raises(TypeError, match="BlockSizes"):
        attention(x, x, x, routes, block_sizes=(64, 32))
    with pytest.raises(TypeError, match="selected_token_ids"):
        attention(x, x, x, routes.astype(np.float32))
    from qsa_jax import sparse_gqa_attention

    with pytest.raises(BackendDeclined, match="interpret"):
        sparse_gqa_attention(x, x, x, routes, implementation="triton", interpret=True)


def test_parity_suite_bitwise_column(monkeypatch, tmp_path):
    """The parity suite's bitwise comparison of torch triton and jax-triton (here with
    the interpreted launcher standing in for jax-triton): forward out and LSE max |diff|
    0, reported in its own table with the backward's differences; a perturbed LSE fails
    the run."""
    import functools

    from parity import backends as pb
    from parity.report import markdown
    from parity.suite import Config, run_suite

    fake = pb.Backend("jax-triton", "jax",
                      lambda: functools.partial(jt.triton_sparse_gqa_attention, launcher=LAUNCHER),
                      forward_lse=lambda: functools.partial(jt.forward_with_lse, launcher=LAUNCHER))
    monkeypatch.setitem(pb.BACKENDS, "jax-triton", fake)
    config = Config(layouts=("packed",), families=("qsa", "adversarial"), dtypes=("float32",), heads=((4, 2),),
                    head_dim=16, seq_len=16, top_k=2, seed=3, backends=("triton", "jax-triton"))
    env = pb.Environment.detect()
    result = run_suite(config, env=env)
    assert result.failures == 0, [c for c in result.cells if c.status != "pass"]
    assert len(result.bitwise) == 2 and all(b.status == "pass" and b.out == b.lse == 0 for b in result.bitwise)
    text = markdown(result)
    assert "## Bitwise: triton vs jax-triton" in text and "| out max|diff| | LSE max|diff| |" in text

    def shifted(*args, **kwargs):
        out, lse = jt.forward_with_lse(*args, launcher=LAUNCHER, **kwargs)
        return out, lse + 1e-6

    monkeypatch.setitem(pb.BACKENDS, "jax-triton", pb.Backend("jax-triton", "jax", fake.load,
                                                              forward_lse=lambda: shifted))
    failing = run_suite(dataclasses.replace(config, families=("qsa",)), env=env)
    assert failing.failures == 1 and failing.bitwise[0].status == "fail" and failing.bitwise[0].lse > 0
    assert "forward not bitwise equal" in markdown(failing)


_PTX_CHECK = r'''
import os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from qsa_triton import DEFAULT_BLOCK_SIZES, make_plan
from qsa_triton import launch as spec
from qsa_triton.plan import union_recipe

plan = make_plan(12, 256, DEFAULT_BLOCK_SIZES)
q = ((1, 512, 24, 256), spec.contiguous_strides((1, 512, 24, 256)))
kv = ((1, 512, 2, 256), spec.contiguous_strides((1, 512, 2, 256)))
step, cut = union_recipe(plan, 512, 2052, 512)
unions = (1, cut.n_sub, cut.width)
LAUNCHES = {
    "forward": spec.forward_launch(plan, q, kv, kv, unions, 0.0625, "bfloat16", interpreted=False),
    "backward (deterministic)": spec.backward_launch(plan, q, kv, kv, q, q, unions, 0.0625, "bfloat16",
                                                   interpreted=False, deterministic=True),
    # the Hopper kernels (Gluon), which both launchers take on sm_90
    "forward_sm90": spec.forward_sm90_launch(plan, q, kv, kv, unions, 0.0625, "bfloat16"),
    "backward_sm90": spec.backward_sm90_launch(plan, q, kv, kv, q, q, unions, 0.0625, "bfloat16"),
    "backward_sm90 (deterministic)": spec.backward_sm90_launch(plan, q, kv, kv, q, q, unions, 0.0625, "bfloat16",
                                                               deterministic=True),
}
assert all(launch is not None for launch in LAUNCHES.values()), LAUNCHES


def compile_ptx(launch, jax_triton):
    # compiled for sm_90a as each launcher specialises it: torch's JIT (runtime integers, 1
    # as a constant, multiples of 16 marked divisible), jax-triton (integers as constants)
    fn = spec.kernel(launch.kernel)
    sig, constexprs, attrs = spec.compile_signature(launch, spec.attention_input_dtypes(launch, "bfloat16"),
                                                    integers_constant=jax_triton)
    # a Gluon kernel from Gluon's source, as qsa_jax's install_gluon_compile tells them apart
    source = (GluonASTSource(fn, sig, constexprs, attrs) if isinstance(fn, GluonJITFunction)
              else ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs))
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    return kernel.asm["ptx"], kernel.asm["ttgir"]


def float_ops(ptx):
    ops = []
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@%p\d+\s+)?([a-z][\w.]*)", line)
        if m and not m.group(1).startswith(("ld", "st", "mov", "cvt.u", "cvt.s")) and any(
                t in m.group(1) for t in (".f32", ".bf16", "wgmma", "mma", "ex2", "lg2", "rcp")):
            ops.append(m.group(1))
    return ops


def float_ir(ttgir):
    # the floating-point ops of the TTGIR in program order, with their result layouts
    # (which fix each reduction's and dot's order of accumulation) spelled out in place of
    # the module's layout aliases (#blocked, #blocked1, ... number differently when one
    # module defines an extra layout), SSA names dropped
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))
    spell = lambda text: re.sub(r"#\w+", lambda a: aliases.get(a.group(0), a.group(0)), text)  # noqa: E731
    ops = []
    for line in ttgir.splitlines():
        m = re.search(r"= ((?:arith|math)\.\w+f\b|arith\.(?:truncf|extf|sitofp|fptosi)|math\.\w+|"
                      r"ttng\.warp_group_dot|tt\.dot|tt\.reduce|tt\.elementwise_inline_asm)[^:]*:(.*)", line)
        if m:
            ops.append(m.group(1) + spell(re.sub(r"%[\w]+|loc\(.*", "", m.group(2))))
    return ops


for name, launch in LAUNCHES.items():
    (torch_ptx, torch_ir), (jax_ptx, jax_ir) = compile_ptx(launch, False), compile_ptx(launch, True)
    torch_ops, jax_ops = float_ops(torch_ptx), float_ops(jax_ptx)
    assert any("wgmma" in op for op in torch_ops), (name, torch_ops[:20])
    ir = float_ir(torch_ir)
    assert any("warp_group_dot" in op for op in ir) and ir == float_ir(jax_ir), name
    if name.startswith("forward"):  # the same instructions in the same order
        assert torch_ops == jax_ops, (name, len(torch_ops), len(jax_ops))
    elif triton.__version__.startswith("3.6."):  # ptxas schedules independent instructions apart; the same ones
        assert sorted(torch_ops) == sorted(jax_ops), (name, len(torch_ops), len(jax_ops))
    if name.endswith("(deterministic)"):
        for ptx in (torch_ptx, jax_ptx):  # int64 fixed point, rounded to nearest; no fp32 atomics
            assert "cvt.rni.s64.f32" in ptx and re.search(r"(red|atom)\.global\.gpu\.relaxed\.add\.u64", ptx)
            assert not re.search(r"(red|atom)[.\w]*\.f32", ptx)
    print("SAME", name, len(torch_ops))
'''


def test_kernels_compile_to_the_same_float_instructions_for_both_launchers():
    """The tuned forward and the deterministic backward (sm_90a, D=256, bf16), and the Hopper
    (Gluon) forward and backward in both modes, compiled as
    torch's JIT specialises them and as jax-triton does (integers as constants): the same
    floating-point ops with the same layouts in the TTGIR, and the same floating-point
    PTX instructions (in the same order for the forward; for the backward the same
    multiset, checked with triton 3.6, the GPU host's version: triton 3.9 lowers the
    Hopper backward's confinement loop differently for the two specialisations, while
    its TTGIR stays equal), so the two launches compute the same bits (compiled on this
    CPU; the GPU checks are scripts/gpu/check_jax_triton.py and the gpu test of
    tests/test_triton_deterministic.py). The deterministic backward adds int64 sums
    (round to nearest, then a relaxed 64-bit atomic add), no fp32 atomics."""
    import subprocess

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PTX_CHECK], capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0 and ("ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower()):
        pytest.skip(f"Triton cannot compile for sm_90a here: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and proc.stdout.count("SAME") == 5, proc.stderr[-3000:]


_GLUON_COMPILE_CHECK = """
import json, types
from qsa_jax import _jax_triton_patch as patch
from qsa_triton import launch as spec
from qsa_triton.config import BlockSizes
from qsa_triton.plan import make_plan

seen = []

def get_or_create_triton_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps,
                                num_stages, num_ctas, compute_capability, enable_fp_fusion, metaparams, dump):
    seen.append(fn.__name__)
    return "own", {}

calls = types.SimpleNamespace(TritonKernel=lambda *args: args, get_compute_capability=lambda device: 90)
lib = types.SimpleNamespace(get_or_create_triton_kernel=get_or_create_triton_kernel, triton_kernel_call_lib=calls)
installed = [patch.install_gluon_compile(lib), patch.install_gluon_compile(lib)]
plan = make_plan(12, 256, BlockSizes(num_stages=3, backward_block_k=64, flatten_heads=True))
q = ((1, 256, 24, 256), spec.contiguous_strides((1, 256, 24, 256)))
kv = ((1, 256, 2, 256), spec.contiguous_strides((1, 256, 2, 256)))
launch = spec.forward_sm90_launch(plan, q, kv, kv, (1, 24, 2052), 0.0625, "bfloat16")
dtypes = ["*bf16"] * 3 + ["*i32"] * 3 + ["fp32", "*bf16", "*fp32"]
kernel, attrs = lib.get_or_create_triton_kernel(
    None, "cuda", spec.kernel(launch.kernel), dtypes, [(6, "fp32", launch.scalars[0][1])],
    num_warps=launch.num_warps, num_stages=launch.num_stages, num_ctas=1, compute_capability=90,
    enable_fp_fusion=True, metaparams=dict(launch.params), dump=False)
name, warps, ctas, shared, ptx, _, capability = kernel
own = lib.get_or_create_triton_kernel(None, "cuda", spec.kernel("forward"), [], [], num_warps=8, num_stages=3,
                                      num_ctas=1, compute_capability=90, enable_fp_fusion=True, metaparams={},
                                      dump=False)
print(json.dumps(dict(installed=installed, name=name, warps=warps, ctas=ctas, shared=shared,
                      capability=capability, setmaxnreg="setmaxnreg" in ptx, wgmma="wgmma" in ptx,
                      attrs={str(k[0]): v for k, v in attrs.items()}, own=own[0], seen=seen,
                      other=patch.install_gluon_compile(types.SimpleNamespace(
                          get_or_create_triton_kernel=lambda fn, **kw: None)),
                      missing=patch.install_gluon_compile(types.SimpleNamespace()))))
"""


def test_gluon_kernels_compile_through_jax_triton():
    """install_gluon_compile, on a stand-in for jax-triton 0.3.1's ``triton_lib`` (CPU
    jaxlib has no TritonKernel) in a process without Triton's interpreter (this one may
    have it on): the Hopper forward (a Gluon kernel) is compiled from Gluon's source for
    sm_90 and handed over with all its partitions' warps (12: the 4 the launch asks for
    plus the other partitions'); a Triton-language kernel still goes to jax-triton's own
    compile; installing twice wraps once; an entry point with another signature, or none,
    is left alone; the same with Triton's file cache switched off (TRITON_CACHE_DIR="")."""
    import json
    import subprocess

    pytest.importorskip("triton.experimental.gluon", reason="this triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _GLUON_COMPILE_CHECK], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # with Triton's file cache switched off (what importing jax-triton 0.3.1 first does)
    off = subprocess.run([sys.executable, "-c", _GLUON_COMPILE_CHECK], capture_output=True, text=True,
                         env=dict(env, TRITON_CACHE_DIR=""), timeout=300)
    assert off.returncode == 0, off.stderr[-3000:]
    assert json.loads(off.stdout.strip().splitlines()[-1]) == got
    assert got["installed"] == [True, True] and not got["other"] and not got["missing"]
    assert (got["name"], got["warps"], got["ctas"], got["capability"]) == ("qsa_forward_sm90_kernel", 12, 1, 90)
    assert 0 < got["shared"] <= spec.SM90_FORWARD_SHARED and got["setmaxnreg"] and got["wgmma"]
    assert got["attrs"]["6"] == [] and all(got["attrs"][i] == [["tt.divisibility", 16]] for i in "0578")
    assert got["own"] == "own" and got["seen"] == ["qsa_forward_kernel"]


@pytest.mark.parametrize("heads", [(24, 2), (12, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("gluon, capability", [(True, (9, 0)), (False, (9, 0)), (True, (10, 0))])
def test_backward_takes_the_hopper_kernel_where_it_launches(monkeypatch, heads, deterministic, gluon, capability):
    """qsa_jax's backward, with the default Hopper plan (both head configurations the
    benchmark times): the warp-specialized kernel where the launcher launches compiled
    Gluon kernels on an sm_90 GPU, in both modes; backward.py otherwise; the fixed-point
    conversion after either in the deterministic mode (kernels recorded by a stand-in
    launcher)."""
    from qsa_triton.config import default_block_sizes

    seen = []

    @dataclass(frozen=True)
    class Launcher:
        gluon: bool
        interpreted: bool = False
        max_grid_y: int = 65535

        def __call__(self, launch, arrays):
            seen.append(launch.kernel)
            return {o.name: jnp.zeros(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs}

    monkeypatch.setattr(jt, "gpu_capability", lambda x: capability)
    (hq, hkv), seq = heads, 512
    plan = make_plan(hq // hkv, 256, default_block_sizes((9, 0), 256, "bfloat16", 232448))
    q, kv = jnp.zeros((1, seq, hq, 256), jnp.bfloat16), jnp.zeros((1, seq, hkv, 256), jnp.bfloat16)
    n_tiles = plan.n_tiles(seq)
    unions = (jnp.zeros((1, n_tiles, 2052), jnp.int32), jnp.zeros((1, n_tiles), jnp.int32),
              jnp.zeros((1, n_tiles, 2052), jnp.int32))
    driver.backward(jt._adapter(q, Launcher(gluon)), q, kv, kv, q, jnp.zeros((1, hq, seq), jnp.float32), q,
                    driver.Unions(*unions, plan.rows_per_tile), 0.0625, plan, deterministic=deterministic)
    hopper = gluon and capability == (9, 0)
    assert seen == ["backward_sm90" if hopper else "backward"] + (["fixed_point"] if deterministic else [])


@pytest.mark.parametrize("gluon, interpreted, capability, want", [
    (True, False, (9, 0), "forward_sm90"), (False, False, (9, 0), "forward"), (True, True, (9, 0), "forward"),
    (True, False, (10, 0), "forward"), (True, False, None, "forward")])
def test_forward_takes_the_hopper_kernel_where_it_launches(monkeypatch, gluon, interpreted, capability, want):
    """qsa_jax's forward takes the warp-specialized kernel (as qsa_torch does) only with
    a launcher that launches Gluon kernels, compiled, on an sm_90 GPU; else forward.py."""
    seen = []

    @dataclass(frozen=True)
    class Launcher:
        gluon: bool
        interpreted: bool

        def __call__(self, launch, arrays):
            seen.append(launch.kernel)
            return {o.name: jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs}

    monkeypatch.setattr(jt, "gpu_capability", lambda x: capability)
    q = jax.ShapeDtypeStruct((1, 256, 24, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16)
    unions = driver.Unions(*(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((1, 24, 2052), (1, 24), (1, 24, 2052))),
                           32)
    plan = make_plan(12, 256, jt.BlockSizes(num_stages=3, backward_block_k=64, flatten_heads=True))
    driver.forward(jt._adapter(q, Launcher(gluon, interpreted)), q, kv, kv, unions, 0.0625, plan)
    assert seen == [want]


def test_backward_takes_the_forwards_hopper_choice(monkeypatch):
    """The Hopper choice is made with the forward and carried to the backward rule, which
    JAX may trace later under another default device (so the tracers' GPU differs): here
    the forward sees an sm_90 GPU and the backward rule, traced by ``pull``, none."""
    seen = []

    @dataclass(frozen=True)
    class Launcher:
        gluon: bool = True
        interpreted: bool = False
        max_grid_y: int = 65535

        def __call__(self, launch, arrays):
            seen.append(launch.kernel)
            return {o.name: jnp.zeros(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs}

    capability = {"now": (9, 0)}
    monkeypatch.setattr(jt, "gpu_capability", lambda x: capability["now"])
    (hq, hkv), seq = (24, 2), 512
    q, kv = jnp.zeros((1, seq, hq, 256), jnp.bfloat16), jnp.zeros((1, seq, hkv, 256), jnp.bfloat16)
    routes = jnp.zeros((1, seq, 2052), jnp.int32)

    def run(q, k, v):
        return jt.triton_sparse_gqa_attention(q, k, v, routes, 0.0625, launcher=Launcher())

    _, pull = jax.vjp(run, q, kv, kv)
    assert "forward_sm90" in seen and not any(name.startswith("backward") for name in seen), seen
    capability["now"] = None
    pull(q)
    assert [name for name in seen if name.startswith("backward")] == ["backward_sm90"], seen


def _stub(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps, num_stages, num_ctas,
          compute_capability, enable_fp_fusion, metaparams, dump):
    """jax-triton 0.3.1's ``get_or_create_triton_kernel`` signature, without its body."""
    return "own", {}


def test_jax_triton_patch_checks_the_patched_signature():
    """The patch (qsa_jax._jax_triton_patch) wraps a function with the supported
    signature and leaves any other alone: a parameter removed, renamed or moved."""
    import types

    from qsa_jax import _jax_triton_patch as patch

    pytest.importorskip("triton.experimental.gluon", reason="this triton has no Gluon")
    assert patch.signature_matches(_stub)

    def dropped(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps, num_stages, num_ctas,
                compute_capability, enable_fp_fusion, metaparams):
        return "own", {}

    def moved(platform, backend_init_func, fn, arg_dtypes, scalar_args, *, num_warps, num_stages, num_ctas,
              compute_capability, enable_fp_fusion, metaparams, dump):
        return "own", {}

    for other in (dropped, moved):
        assert not patch.signature_matches(other)
        lib = types.SimpleNamespace(get_or_create_triton_kernel=other)
        assert patch.install_gluon_compile(lib) is False and lib.get_or_create_triton_kernel is other
    lib = types.SimpleNamespace(get_or_create_triton_kernel=_stub)
    assert patch.install_gluon_compile(lib) is True and lib.get_or_create_triton_kernel is not _stub


def test_installed_jax_triton_has_the_patched_signature():
    """Where jax-triton is installed: its version is in the supported range and the patched
    function still takes the parameters the patch passes on (fails on a jax-triton whose
    private helper changed, rather than silently losing the Hopper kernels). Where it is
    installed but cannot load (a CPU build of jax), the function's parameters are read
    from its source."""
    import ast
    import importlib.metadata
    import importlib.util
    import inspect
    import pathlib

    from qsa_jax import _jax_triton_patch as patch
    from qsa_jax import _triton_call

    try:
        found = importlib.util.find_spec("jax_triton")
    except ValueError:  # a stand-in module without a spec
        found = None
    if found is None or not found.submodule_search_locations:
        pytest.skip("jax-triton is not installed")
    specifiers = pytest.importorskip("packaging.specifiers")
    installed = importlib.metadata.version("jax-triton")
    assert installed in specifiers.SpecifierSet(patch.SUPPORTED_VERSIONS), installed
    try:  # through the loader, which keeps Triton's cache directory
        _triton_call.jax_triton()
        function = importlib.import_module("jax_triton.triton_lib").get_or_create_triton_kernel
        names = tuple(inspect.signature(getattr(function, "__wrapped__", function)).parameters)
    except ImportError:  # installed, but it needs a CUDA build of jax to load: read the source
        source = pathlib.Path(next(iter(found.submodule_search_locations)), "triton_lib.py").read_text()
        definition = next(node for node in ast.walk(ast.parse(source))
                          if isinstance(node, ast.FunctionDef) and node.name == "get_or_create_triton_kernel")
        arguments = definition.args
        names = tuple(a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs)
    assert names == patch.EXPECTED_PARAMETERS


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_both_adapters_make_the_same_launches(monkeypatch, hopper, deterministic):
    """``qsa_triton.driver`` through the torch and the JAX adapter, forward and backward,
    for one problem: the same launches (kernels, grids, warps, stages, fp32 scalars,
    integer and constexpr arguments, outputs) in the same order, with the portable kernels
    and, as on an sm_90 GPU, the Hopper ones (the precondition of bitwise-equal results
    across frameworks; recorded by stand-in launchers, nothing runs)."""
    from qsa_torch import _triton_launch
    from qsa_triton.config import DEFAULT_BLOCK_SIZES

    torch_launches, jax_launches = [], []

    def torch_run(launch, arrays, device):
        torch_launches.append(launch)
        return {o.name: torch.zeros(o.shape, dtype=_TORCH[o.dtype]) for o in launch.outputs}

    @dataclass(frozen=True)
    class Recorder:
        interpreted: bool = False

        def __call__(self, launch, arrays):
            jax_launches.append(launch)
            return {o.name: jnp.zeros(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs}

    monkeypatch.setattr(_triton_launch, "run", torch_run)
    monkeypatch.setattr(_triton_launch, "interpreted", lambda: False)
    monkeypatch.setattr(_triton_launch, "hopper_forward", lambda device: hopper)
    monkeypatch.setattr(_triton_launch, "hopper_backward", lambda device: hopper)
    rng = _fresh_rng()
    (hq, hkv), seq, width = (24, 2), 256, 20
    routes = rng.integers(-1, seq, size=(1, seq, width))
    plan = make_plan(hq // hkv, 256, DEFAULT_BLOCK_SIZES)
    shapes = {"q": (1, seq, hq, 256), "k": (1, seq, hkv, 256), "v": (1, seq, hkv, 256)}
    shapes["o"] = shapes["do"] = shapes["q"]
    lse_shape = (1, hq, seq)

    def run(ad, zeros, routes_):
        x = {name: zeros(shape) for name, shape in shapes.items()}
        unions = driver.build_unions(ad, routes_, seq, plan, padded=False)
        driver.forward(ad, x["q"], x["k"], x["v"], unions, 0.0625, plan)
        unions = driver.backward_unions(ad, unions, plan, width, seq)
        driver.backward(ad, x["q"], x["k"], x["v"], x["o"], zeros(lse_shape, "float32"), x["do"], unions, 0.0625,
                        plan, deterministic=deterministic)

    run(_triton_launch.adapter("cpu"), lambda s, d="bfloat16": torch.zeros(s, dtype=_TORCH[d]),
        torch.from_numpy(routes.astype(np.int32)))
    run(driver_jax_adapter(Recorder(), hopper), lambda s, d="bfloat16": jnp.zeros(s, jnp.dtype(d)),
        jnp.asarray(routes.astype(np.int32)))
    kernels = [launch.kernel for launch in jax_launches]
    assert ("forward_sm90" in kernels) == hopper and ("backward_sm90" in kernels) == hopper, kernels
    assert ("fixed_point" in kernels) == deterministic, kernels
    assert torch_launches == jax_launches


def driver_jax_adapter(launcher, hopper):
    from qsa_jax._triton_call import JaxAdapter

    return JaxAdapter(launcher, hopper, jax.config.jax_enable_x64)


def test_both_frameworks_decline_alike(monkeypatch):
    """``supports`` of the torch and the JAX Triton backend: the same class and message for
    the same inputs (limits written once, in ``qsa_triton.limits``): D > 256, float64,
    inputs off a GPU with compiled kernels, a missing runtime (named with its pip extra)."""
    import importlib.util

    from qsa_common.errors import MissingRuntime, UnsupportedDevice
    from qsa_torch import triton_qsa as tt

    def both(head_dim, dtype):
        with jax.enable_x64(True):
            x = _on_cpu(jnp.zeros((1, 4, 2, head_dim), dtype))
            got_jax = jt.supports(x, x, x, None)
        t = torch.zeros((1, 4, 2, head_dim), dtype=getattr(torch, dtype))
        return tt.supports(t, t, t, None), got_jax

    for head_dim, dtype, cls in ((264, "float32", UnsupportedShape), (16, "float64", UnsupportedDtype)):
        got_torch, got_jax = both(head_dim, dtype)
        assert type(got_torch) is type(got_jax) is cls and str(got_torch) == str(got_jax), (got_torch, got_jax)
    monkeypatch.setattr(spec, "interprets", lambda: False)  # compiled kernels, every runtime present
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    monkeypatch.setattr(tt, "_HAS_TRITON", True)  # torch looks it up at import (dynamo traces supports)
    got_torch, got_jax = both(16, "bfloat16")
    assert type(got_torch) is type(got_jax) is UnsupportedDevice and str(got_torch) == str(got_jax)
    assert "CUDA" in str(got_torch) and "cpu" in str(got_torch)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # no runtime
    monkeypatch.setattr(tt, "_HAS_TRITON", False)
    got_torch, got_jax = both(16, "bfloat16")
    assert isinstance(got_torch, MissingRuntime) and isinstance(got_jax, MissingRuntime)
    assert "'triton' package" in str(got_torch) and "'jax_triton' package" in str(got_jax)
    assert all("pip install" in str(e) and "qsa-kernels[" in str(e) for e in (got_torch, got_jax))
