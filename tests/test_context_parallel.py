"""Context parallelism: the JAX shard_map wrapper on several host devices and the
torch.distributed wrapper on 2 gloo processes, each against the single-device
result and the float64 oracle (outputs and dq, dk, dv).

The JAX meshes are of the 4 host (CPU) devices conftest asks XLA for, on a machine with
GPUs too: the CP calls are left to pick their implementation for the mesh, while the
single-device references run on the host under ``jax.default_device``."""

from __future__ import annotations

import functools
import json
import os
import time

import numpy as np
import pytest
from contract_base import TOLERANCE, random_inputs

from qsa_common.errors import DeterminismUnavailable, UnsupportedDevice, UnsupportedOption
from qsa_common.layouts import make_problem
from qsa_common.oracle import oracle_forward_backward, relative_error

HEADS, DIM = (4, 2), 16


def problem_and_inputs(rng, layout, family, seq_len, dtype="float32", batch=2):
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=seq_len,
                           top_k=3, width=16, batch=batch)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, HEADS, DIM, dtype)
    return problem.routes, q, k, v, do


def assert_close(got, single, want, dtype, label):
    for name, g, s, w in zip(("out", "dq", "dk", "dv"), got, single, want):
        assert relative_error(g, w) < TOLERANCE[dtype], f"{label} {name} vs oracle"
        # same kernel, same rows: only the dK/dV summation order may differ
        assert relative_error(g, s) < (1e-6 if dtype == "float32" else 1e-2), f"{label} {name} vs single"


# ------------------------------------------------------------------------- JAX
@pytest.fixture
def host_devices():
    import jax

    devices = jax.devices("cpu")
    assert len(devices) >= 4, "conftest asks XLA for 4 host devices"
    return devices


def on_host(devices, fn, *args):
    """``fn(*args)`` with JAX's default device the first host device."""
    import jax

    with jax.default_device(devices[0]):
        return fn(*args)


def jax_vjp(fn, q, k, v, do, dtype):
    import jax
    import jax.numpy as jnp

    args = [jnp.asarray(x, jnp.dtype(dtype)) for x in (q, k, v)]
    out, pull = jax.vjp(fn, *args)
    grads = pull(jnp.asarray(do, jnp.dtype(dtype)))
    return out, tuple(np.asarray(t, np.float64) for t in (out, *grads))


@pytest.mark.parametrize("devices,layout,family", [
    (2, "packed", "qsa"), (4, "padded", "adversarial"), (4, "packed", "random"),
])
def test_jax_cp_matches_single_device(host_devices, devices, layout, family):
    import jax
    from jax.sharding import Mesh

    from qsa_jax import sparse_gqa_attention
    from qsa_jax.context_parallel import context_parallel_sparse_gqa_attention as cp

    rng = np.random.default_rng()
    routes, q, k, v, do = problem_and_inputs(rng, layout, family, 32)
    mesh = Mesh(np.array(host_devices[:devices]), ("cp",))
    cp_fn = jax.jit(lambda a, b, c: cp(a, b, c, routes, 0.4, mesh=mesh, implementation="xla"))
    out, got = jax_vjp(cp_fn, q, k, v, do, "float32")
    assert out.sharding.device_set == set(host_devices[:devices]) and not out.sharding.is_fully_replicated
    _, single = on_host(host_devices, jax_vjp,
                        lambda a, b, c: sparse_gqa_attention(a, b, c, routes, 0.4, implementation="xla"),
                        q, k, v, do, "float32")
    want = oracle_forward_backward(q, k, v, routes, 0.4, do)
    assert_close(got, single, want, "float32", f"jax cp x{devices} {layout}/{family}")


def test_jax_cp_on_a_2d_mesh_with_vma_check_and_bf16(host_devices):
    import jax
    from jax.sharding import Mesh

    from qsa_jax import sparse_gqa_attention
    from qsa_jax.context_parallel import context_parallel_sparse_gqa_attention as cp

    rng = np.random.default_rng()
    routes, q, k, v, do = problem_and_inputs(rng, "padded", "qsa", 32, dtype="bfloat16")
    mesh = Mesh(np.array(host_devices[:4]).reshape(2, 2), ("dp", "cp"))
    fn = jax.jit(lambda a, b, c: cp(a, b, c, routes, mesh=mesh, batch_axis="dp", check_vma=True))
    out, got = jax_vjp(fn, q, k, v, do, "bfloat16")
    assert out.sharding.device_set == set(host_devices[:4])
    _, single = on_host(host_devices, jax_vjp, lambda a, b, c: sparse_gqa_attention(a, b, c, routes),
                        q, k, v, do, "bfloat16")
    want = oracle_forward_backward(q, k, v, routes, DIM ** -0.5, do)
    assert_close(got, single, want, "bfloat16", "jax cp 2x2 bf16")


def test_jax_cp_passes_deterministic_and_kernel_options_through(host_devices):
    """``deterministic`` (and ``interpret``, ``block_sizes``) reach every device's call:
    the xla implementation (deterministic on CPU) gives the same bits twice and the
    oracle's values; Pallas (fp32 atomics) declines deterministic=True."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from qsa_jax.context_parallel import context_parallel_sparse_gqa_attention as cp
    from qsa_jax.pallas_qsa import BlockSizes

    rng = np.random.default_rng()
    routes, q, k, v, do = problem_and_inputs(rng, "packed", "adversarial", 32)
    mesh = Mesh(np.array(host_devices[:2]), ("cp",))
    fn = jax.jit(lambda a, b, c: cp(a, b, c, routes, 0.4, mesh=mesh, implementation="xla", deterministic=True))
    runs = [jax_vjp(fn, q, k, v, do, "float32")[1] for _ in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    want = oracle_forward_backward(q, k, v, routes, 0.4, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), runs[0], want):
        assert relative_error(g, w) < 1e-5, name
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    with pytest.raises(DeterminismUnavailable, match="deterministic"):
        cp(*args, routes, 0.4, mesh=mesh, implementation="pallas", interpret=True, deterministic=True)
    bs = BlockSizes(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16)
    out = cp(*args, routes, 0.4, mesh=mesh, implementation="pallas", interpret=True, block_sizes=bs)
    assert relative_error(np.asarray(out, np.float64), want[0]) < 1e-5
    with pytest.raises(TypeError, match="deterministic"):
        cp(*args, routes, mesh=mesh, deterministic="yes")
    # interpret and block_sizes reach the devices' calls: on the host mesh, interpret=False
    # makes Pallas decline; a block-size class of another implementation does too
    with pytest.raises(UnsupportedDevice, match="GPUs only"):
        cp(*args, routes, 0.4, mesh=mesh, implementation="pallas", interpret=False)
    from qsa_triton.config import BlockSizes as TritonBlockSizes

    with pytest.raises(UnsupportedOption, match="block_sizes"):
        cp(*args, routes, 0.4, mesh=mesh, implementation="pallas", interpret=True, block_sizes=TritonBlockSizes())


def test_jax_cp_rejects_bad_layouts(host_devices):
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from qsa_jax.context_parallel import context_parallel_sparse_gqa_attention as cp

    rng = np.random.default_rng()
    routes, q, k, v, _ = problem_and_inputs(rng, "packed", "qsa", 30, batch=1)
    mesh = Mesh(np.array(host_devices[:4]), ("cp",))
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    with pytest.raises(ValueError, match="S_q = 30 is not divisible"):
        cp(*args, routes, mesh=mesh)
    with pytest.raises(ValueError, match="not an axis"):
        cp(*args, routes, mesh=mesh, axis_name="sp")
    with pytest.raises(ValueError, match="selected_token_ids"):
        cp(*args, routes[:, :-2], mesh=mesh)


# ----------------------------------------------------------------------- torch
_CALLS: list[str] = []


def supports(query, key, value, selected_token_ids, *, softmax_scale=None, deterministic=False):
    """This module stands in for a backend module: its spy backends accept every input."""
    return None


def _flaky_backend(*args, **kwargs):
    """Declines its first call (as a backend whose runtime failed to load once would), then works."""
    from qsa_common.errors import UnsupportedShape

    _CALLS.append("flaky")
    if _CALLS.count("flaky") == 1:
        raise UnsupportedShape("flaky declines its first call")
    from qsa_torch import reference_sparse_gqa_attention

    return reference_sparse_gqa_attention(*args, **kwargs)


def _steady_backend(*args, **kwargs):
    _CALLS.append("steady")
    from qsa_torch import reference_sparse_gqa_attention

    return reference_sparse_gqa_attention(*args, **kwargs)


def _install_spies(api, dtype):
    """"auto" on CPU over the two spies: "flaky" fails its first forward, so "auto"
    falls back to "steady"; a backward that resolved "auto" again would take "flaky"."""
    import sys

    for name in ("flaky", "steady"):
        api.BACKENDS[name] = api._Backend("test_context_parallel", f"_{name}_backend")
        api._MODULES[name] = sys.modules[__name__]
        api.VERIFIED[name] = frozenset({"cpu"})
    api.PREFERENCE["cpu"] = ("flaky", "steady")


def _torch_worker(rank, world, init_file, case_file, out_dir):
    """One gloo rank: its slice of queries and K/V through the CP wrapper: with its
    defaults ("auto": the reference on CPU), a group and a function, and "auto" over
    spy backends (the backends that ran are saved)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    from qsa_torch import api, reference_sparse_gqa_attention
    from qsa_torch.context_parallel import context_parallel_sparse_gqa_attention as cp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        case = np.load(case_file)
        s_loc, kv_loc = case["q"].shape[1] // world, case["k"].shape[1] // world
        rows, kv_rows = slice(rank * s_loc, (rank + 1) * s_loc), slice(rank * kv_loc, (rank + 1) * kv_loc)
        dtype = getattr(torch, str(case["dtype"]))
        q, k, v = (torch.tensor(case[n][:, r], dtype=dtype, requires_grad=True)
                   for n, r in (("q", rows), ("k", kv_rows), ("v", kv_rows)))
        routes = torch.from_numpy(case["routes"][:, rows])
        results = {}
        for label, kwargs in (
            ("default", {}),
            ("group+fn", dict(group=dist.new_group([0, 1]),
                              attention_fn=functools.partial(reference_sparse_gqa_attention, chunk_rows=3))),
            ("spies", {}),
        ):
            if label == "spies":
                _install_spies(api, dtype)
            out = cp(q, k, v, routes, float(case["scale"]), **kwargs)
            forward_calls = list(_CALLS)
            out.backward(torch.tensor(case["do"][:, rows], dtype=dtype))
            results[f"{label}/forward"] = np.array(forward_calls)
            results[f"{label}/backward"] = np.array(_CALLS[len(forward_calls):])
            for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
                results[f"{label}/{name}"] = t.detach().double().numpy()
            for t in (q, k, v):
                t.grad = None
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
    finally:
        dist.destroy_process_group()


def spawn(fn, world, args, timeout=300.0):
    """Run ``fn`` on ``world`` spawned processes; fail (naming the exit codes) if one
    fails or they are not done in ``timeout`` s (each imports torch: slow on a loaded
    2-core CI machine)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"distributed workers did not finish in {timeout}s "
                        f"(exit codes {[p.exitcode for p in ctx.processes]})")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_cp_gloo_two_processes(tmp_path, dtype):
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    rng = np.random.default_rng()
    routes, q, k, v, do = problem_and_inputs(rng, "packed", "adversarial" if dtype == "float32" else "qsa",
                                             40, dtype=dtype, batch=1)
    scale = 0.3
    np.savez(tmp_path / "case.npz", q=q, k=k, v=v, do=do, routes=routes, scale=scale, dtype=dtype)
    spawn(_torch_worker, 2, (str(tmp_path / "init"), str(tmp_path / "case.npz"), str(tmp_path)))
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]

    tdtype = getattr(torch, dtype)
    leaves = [torch.tensor(x, dtype=tdtype, requires_grad=True) for x in (q, k, v)]
    out = reference_sparse_gqa_attention(*leaves, torch.from_numpy(routes), scale)
    out.backward(torch.tensor(do, dtype=tdtype))
    single = [t.detach().double().numpy() for t in (out, *(x.grad for x in leaves))]
    want = oracle_forward_backward(q, k, v, routes, scale, do)
    for r in ranks:  # CP runs "auto" by default; its backward keeps the forward's backend
        assert r["default/forward"].size == 0 and r["default/backward"].size == 0
        assert r["spies/forward"].tolist() == ["flaky", "steady"]
        assert r["spies/backward"].tolist() == ["steady"]
    for label in ("default", "group+fn", "spies"):
        got = [np.concatenate([r[f"{label}/{n}"] for r in ranks], axis=1) for n in ("out", "dq", "dk", "dv")]
        assert_close(got, single, want, dtype, f"torch cp gloo {label} {dtype}")


def _mismatch_worker(rank, world, init_file, out_dir):
    """One gloo rank of :func:`test_torch_cp_ranks_that_disagree_all_raise`: each case's
    exception (class and message) on this rank, or "accepted"."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    from qsa_torch.context_parallel import context_parallel_sparse_gqa_attention as cp
    from qsa_torch.context_parallel import gather_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        q = torch.randn(1, 4, 2, 8)
        routes = torch.zeros(1, 4, 3, dtype=torch.int64)
        kv = torch.randn(1, 4, 1, 8)
        swapped = torch.randn(1, 2, 2, 8)  # as many elements, another shape
        cases = {
            "same numel, other shape": lambda: cp(q, *(2 * [swapped if rank == 1 else kv]), routes),
            "one rank refused": lambda: cp(q, kv, kv, routes.float() if rank == 1 else routes),
            "gather dtype": lambda: gather_sequence(kv.double() if rank == 1 else kv),
            "agreeing": lambda: cp(q, kv, kv, routes),
        }
        results = {}
        for name, fn in cases.items():
            try:
                fn()
                results[name] = "accepted"
            except Exception as err:  # noqa: BLE001 - the test reads the class and message
                results[name] = f"{type(err).__name__}: {err}"
        with open(os.path.join(out_dir, f"mismatch{rank}.json"), "w") as fh:
            json.dump(results, fh)
    finally:
        dist.destroy_process_group()


def test_torch_cp_ranks_that_disagree_all_raise(tmp_path):
    """K/V of different shapes (even with as many elements) or dtypes across ranks, or one
    rank's refused input, raise on every rank before any data moves: no silent misread
    of another rank's bytes, no rank left waiting in a collective."""
    spawn(_mismatch_worker, 2, (str(tmp_path / "init"), str(tmp_path)))
    ranks = [json.load(open(tmp_path / f"mismatch{r}.json")) for r in range(2)]
    for r in ranks:
        assert r["same numel, other shape"].startswith("ValueError") and "differ" in r["same numel, other shape"]
        assert r["gather dtype"].startswith("ValueError") and "differ" in r["gather dtype"]
        assert r["agreeing"] == "accepted"
    assert ranks[1]["one rank refused"].startswith("InvalidDtype")
    assert ranks[0]["one rank refused"].startswith("ValueError") and "rank(s) [1]" in ranks[0]["one rank refused"]


def test_torch_cp_backend_and_attention_fn_are_exclusive():
    import torch

    from qsa_torch import reference_sparse_gqa_attention
    from qsa_torch.context_parallel import context_parallel_sparse_gqa_attention as cp

    t = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="not both"):
        cp(t, t[:, :, :1], t[:, :, :1], torch.zeros(1, 4, 3, dtype=torch.int64), backend="reference",
           attention_fn=reference_sparse_gqa_attention)


def test_torch_cp_needs_an_initialised_process_group():
    import torch

    from qsa_torch.context_parallel import context_parallel_sparse_gqa_attention as cp

    t = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        cp(t, t[:, :, :1], t[:, :, :1], torch.zeros(1, 4, 3, dtype=torch.int64))
