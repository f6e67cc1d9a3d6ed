"""``qsa_jax.sparse_gqa_attention`` under ``jax.jit`` with sharded inputs (qsa_jax.sharding).

The sharded cases need 8 host devices, which XLA fixes when JAX starts, so they run in
one subprocess (tests/sharding_cases.py) whose JSON the tests below read: collectives
counted in the compiled forward and gradient, the output's and gradients' shardings,
errors against the float64 oracle and the same call on one device, and the warnings.
The layout rules themselves are checked in this process on stand-in meshes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOLERANCE = 1e-5  # fp32, the contract's
NONE = {"all-gather": 0, "all-reduce": 0, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}


def _run_cases(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, os.path.join(HERE, "sharding_cases.py"), *args], env=env,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.fixture(scope="module")
def cases():
    pytest.importorskip("flax", reason="the Flax port case needs flax")
    return _run_cases()


def _assert_close(result):
    for name in ("out", "dq", "dk", "dv"):
        assert result["error_vs_oracle"][name] < TOLERANCE, (name, result["error_vs_oracle"])
        assert result["error_vs_single"][name] < TOLERANCE, (name, result["error_vs_single"])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_batch_and_head_sharding_runs_locally(cases, impl):
    result = cases[f"probe_{impl}"]
    assert result["fwd_collectives"] == NONE
    assert result["grad_collectives"] == NONE
    assert result["input_specs"]["query"] == ["data", None, "model"]
    for name in ("out", "dq"):
        assert result["specs"][name] == result["input_specs"]["query"], name
    for name in ("dk", "dv"):
        assert result["specs"][name] == result["input_specs"]["key"], name
    assert result["warnings"] == []
    _assert_close(result)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sequence_sharding_is_context_parallel(cases, impl):
    result = cases[f"sequence_{impl}"]
    fwd, grad = result["fwd_collectives"], result["grad_collectives"]
    # forward: the K/V all-gathers and nothing else
    assert 1 <= fwd["all-gather"] <= 2 and sum(fwd.values()) == fwd["all-gather"], fwd
    # gradient: the same gathers, then dK/dV summed back to their shards
    reduce = grad["reduce-scatter"] + grad["all-reduce"]
    assert 1 <= grad["all-gather"] <= 2 and 1 <= reduce <= 2, grad
    assert grad["all-to-all"] == grad["collective-permute"] == 0, grad
    assert result["input_specs"]["query"] == ["data", "seq"]
    for name in ("out", "dq", "dk", "dv"):
        assert result["specs"][name] == ["data", "seq"], name
    assert result["warnings"] == []
    _assert_close(result)


def test_heads_not_splitting_kv_heads_gather_them_with_one_warning(cases):
    result = cases["heads_not_divisible_xla"]  # (Hq, Hkv) = (8, 2), heads over 4 devices
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "Hkv = 2" in result["warnings"][0] and "gathering" in result["warnings"][0]
    assert result["fwd_collectives"]["all-gather"] >= 1  # the query's heads, gathered
    assert result["specs"]["out"] == result["input_specs"]["query"]
    assert result["specs"]["dk"] == result["input_specs"]["key"]
    _assert_close(result)


@pytest.mark.parametrize("case", ["flax_port", "flax_port_sequence"])
def test_flax_port_under_nnx_jit_partitions_attention(cases, case):
    result = cases[case]
    assert result["kernel_specs"] == {"q_proj": [None, "model"], "k_proj": [None, "model"], "o_proj": ["model"]}
    assert result["global_attention_shapes"] == []  # no device holds all heads of the whole batch
    assert result["has_local_query_shape"]
    attention = result["attention_collectives"]
    if case == "flax_port":  # batch and heads: the attention itself communicates nothing
        assert attention == NONE, attention
        # the rest: tensor parallelism's all-reduces (o_proj's partial sums, the weights'
        # gradients) and the indexer's top-k
        assert result["grad_collectives"]["all-to-all"] == result["grad_collectives"]["collective-permute"] == 0
    else:  # and the sequence: K/V gathered (forward, and again in the backward), dK/dV reduce-scattered
        assert attention["all-gather"] == 4 and attention["reduce-scatter"] + attention["all-reduce"] == 2, attention
        assert attention["all-to-all"] == attention["collective-permute"] == 0, attention
    assert result["warnings"] == []
    assert result["error_value"] < TOLERANCE
    for name, err in result["error_grads"].items():
        assert err < TOLERANCE, name


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "pallas"])
def test_gpu_kernels_partition(impl):
    import jax

    if len(jax.devices("gpu")) < 2:
        pytest.skip("sharding needs at least 2 GPUs")
    if impl == "triton":
        pytest.importorskip("jax_triton", reason="implementation='triton' needs jax-triton")
    results = _run_cases("--gpu", f"probe_{impl}", f"sequence_{impl}")
    probe, seq = results[f"probe_{impl}"], results[f"sequence_{impl}"]
    assert probe["fwd_collectives"] == NONE and probe["grad_collectives"] == NONE
    assert probe["specs"]["out"] == probe["input_specs"]["query"]
    assert sum(seq["fwd_collectives"].values()) == seq["fwd_collectives"]["all-gather"] >= 1
    for result in (probe, seq):
        _assert_close(result)


# ------------------------------------------------------------------ the layout rules
def _plan(mesh_shape, shapes, specs):
    from jax.sharding import PartitionSpec as P

    from qsa_jax import sharding

    mesh = types.SimpleNamespace(shape=dict(mesh_shape))
    return sharding._plan(mesh, shapes, [types.SimpleNamespace(spec=P(*s)) for s in specs])


QSHAPE, KVSHAPE, RSHAPE = (4, 64, 8, 16), (4, 64, 4, 16), (4, 64, 8)


@pytest.fixture
def warnings_seen(caplog):
    from qsa_jax import sharding

    sharding._LOGGED.clear()
    caplog.set_level(logging.WARNING, logger="qsa_jax")
    return caplog


def test_plan_keeps_batch_heads_and_sequence(warnings_seen):
    plan = _plan({"d": 2, "m": 4}, [QSHAPE, KVSHAPE, KVSHAPE, RSHAPE],
                 [("d", None, "m"), ("d", None, "m"), ("d", None, "m"), ("d",)])
    assert plan == (("d",), (), ("m",), False)
    plan = _plan({"d": 2, "s": 4}, [QSHAPE, KVSHAPE, KVSHAPE, RSHAPE],
                 [("d", "s"), ("d", "s"), ("d", "s"), ("d", "s")])
    assert plan == (("d",), ("s",), (), True)
    # K/V heads unsplit follow the query's (a local slice, no warning)
    plan = _plan({"m": 4}, [QSHAPE, KVSHAPE, KVSHAPE, RSHAPE], [(None, None, "m"), (), (), ()])
    assert plan.heads == ("m",)
    assert warnings_seen.records == []


@pytest.mark.parametrize("specs, says", [
    ([(None, None, "m"), (None, None, "d"), (None, None, "d"), ()], "key/value heads over"),
    ([(), (None, None, "m"), (None, None, "m"), ()], "while the query's heads are not split"),
    ([(), (None, "s"), (None, "s"), ()], "key sequence over"),
    ([(None, None, None, "m"), (), (), ()], "query head dim over"),
    ([(), (), (), (None, None, "m")], "routes' K dim"),
    ([("d",), ("m",), ("m",), ("d",)], "key batch over"),
    ([(None, "s"), (), (), (None, "d")], "routes' rows over"),
])
def test_plan_gathers_what_it_cannot_keep_and_says_so_once(warnings_seen, specs, says):
    mesh = {"d": 2, "m": 4, "s": 2}
    for _ in range(2):
        plan = _plan(mesh, [QSHAPE, KVSHAPE, KVSHAPE, RSHAPE], specs)
    assert plan.heads == ()
    warned = [r.getMessage() for r in warnings_seen.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and says in warned[0], warned


def test_single_device_arrays_call_the_implementation_directly():
    import jax
    import jax.numpy as jnp

    import qsa_jax
    from qsa_common.layouts import make_problem
    from qsa_common.oracle import oracle_forward_backward, relative_error
    from qsa_jax import sharding

    rng = np.random.default_rng()
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=32, top_k=2)
    q, k, v = (rng.standard_normal((1, 32, h, 8)).astype(np.float32) for h in (4, 2, 2))
    arrays = [jnp.asarray(x) for x in (q, k, v)]
    assert sharding.wants_partitioning(*arrays, problem.routes) is False
    jitted = jax.jit(lambda *a: qsa_jax.sparse_gqa_attention(*a, problem.routes, 0.3))(*arrays)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3)[0]
    assert relative_error(np.asarray(jitted), want) < TOLERANCE
    assert relative_error(np.asarray(qsa_jax.sparse_gqa_attention(*arrays, problem.routes, 0.3)), want) < TOLERANCE
