"""qsa_torch.api.sparse_gqa_attention: the dispatching custom op, its autograd and torch.compile."""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import pytest
from contract_base import BackendContract, random_inputs
from runners import run_torch

from qsa_common.errors import (
    BackendDeclined,
    DeterminismUnavailable,
    InvalidDtype,
    InvalidInput,
    MissingRuntime,
    NoBackendAvailable,
    UnsupportedDevice,
    UnsupportedShape,
)
from qsa_common.layouts import make_problem
from qsa_common.oracle import oracle_forward_backward, relative_error

torch = pytest.importorskip("torch")
api = pytest.importorskip("qsa_torch.api")


class TestAutoBackend(BackendContract):
    """The whole contract through the custom op with backend="auto" (the reference on CPU)."""

    dtypes = ("float32", "bfloat16")

    def run(self, q, k, v, routes, scale, grad_out, dtype):
        return run_torch(api.sparse_gqa_attention, q, k, v, routes, scale, grad_out, dtype)


def _problem(rng, layout="packed", family="adversarial", heads=(4, 2), seq_len=24, dtype="float32"):
    problem = make_problem(layout, family, seed=int(rng.integers(2**31)), seq_len=seq_len, width=10)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, heads, 16, dtype)
    return problem, q, k, v, do


def _leaves(q, k, v, dtype=torch.float32):
    return [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v)]


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def test_torch_compile_fullgraph_forward_and_backward(rng):
    """One graph, no breaks; compiled results equal the oracle (aot_eager: dynamo + AOTAutograd
    with the op's fake and autograd registrations, without inductor's slow C++ build)."""
    problem, q, k, v, do = _problem(rng, "cp")
    routes = torch.from_numpy(problem.routes)

    def loss(q_, k_, v_, r_):
        return (api.sparse_gqa_attention(q_, k_, v_, r_, 0.3) * torch.from_numpy(do).float()).sum()

    explanation = torch._dynamo.explain(loss)(*_leaves(q, k, v), routes)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = _leaves(q, k, v)
    compiled(*leaves, routes).backward()
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for got, ref in zip([x.grad.numpy() for x in leaves], want[1:]):
        assert relative_error(got, ref) < 1e-5
    out = torch.compile(lambda *a: api.sparse_gqa_attention(*a, softmax_scale=0.3),
                        fullgraph=True, backend="aot_eager")(*_leaves(q, k, v), routes)
    assert relative_error(out.detach().numpy(), want[0]) < 1e-5


def test_opcheck_forward_and_backward_ops(rng):
    """Schema, fake (meta) implementations and autograd registration of both ops."""
    problem, q, k, v, do = _problem(rng, seq_len=8)
    routes = torch.from_numpy(problem.routes)
    leaves = _leaves(q, k, v)
    torch.library.opcheck(torch.ops.qsa.sparse_gqa_attention.default,
                          (*leaves, routes, 0.25, "reference", False))
    torch.library.opcheck(torch.ops.qsa.sparse_gqa_attention_backward.default,
                          (torch.from_numpy(do).float(), *(x.detach() for x in leaves), routes,
                           0.25, "reference", False))


def test_meta_tensors_give_shapes_only(rng):
    problem, q, k, v, _ = _problem(rng, "cp")
    meta = [torch.empty(x.shape, device="meta") for x in (q, k, v)]
    out = api.sparse_gqa_attention(*meta, torch.from_numpy(problem.routes).to("meta"))
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == torch.float32


def test_explicit_reference_equals_auto_and_default_scale(rng):
    problem, q, k, v, _ = _problem(rng)
    from qsa_torch.routes import to_torch_routes

    routes = to_torch_routes(problem, dtype=torch.int32)  # huge int64 IDs become -1, not wrapped
    args = [torch.tensor(x, dtype=torch.float32) for x in (q, k, v)]
    auto = api.sparse_gqa_attention(*args, routes)
    ref = api.sparse_gqa_attention(*args, routes, 16 ** -0.5, backend="reference")
    want = oracle_forward_backward(q, k, v, problem.routes, 16 ** -0.5)[0]
    assert relative_error(auto.numpy(), want) < 1e-5
    assert torch.equal(auto, ref)


def test_cpu_preference_is_the_reference():
    assert api.device_class(torch.device("cpu")) == "cpu"
    assert api.candidate_backends(torch.device("cpu")) == ("reference",)
    for row in api.PREFERENCE.values():
        assert set(row) <= set(api.BACKENDS)


def test_auto_skips_unsupported_backends_with_a_logged_reason(rng, monkeypatch, caplog):
    """flex has no CPU backward: auto must skip it when gradients are needed, use it otherwise."""
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("fa4", "flex"))
    monkeypatch.setattr(api, "_LOGGED", set())
    problem, q, k, v, do = _problem(rng, "padded", "qsa")
    routes = torch.from_numpy(problem.routes)
    want = oracle_forward_backward(q, k, v, problem.routes, 0.25, do)
    leaves = _leaves(q, k, v)
    with caplog.at_level(logging.DEBUG, logger="qsa_torch"):
        out = api.sparse_gqa_attention(*leaves, routes, 0.25)
        out.backward(torch.from_numpy(do).float())
    text = caplog.text
    assert "skipping backend 'fa4': the FA4 backend needs CUDA tensors on an SM90" in text
    assert "skipping backend 'flex'" in text and "FlexAttention has no CPU backward" in text
    assert "ran backend 'reference'" in text
    for got, ref in zip([out.detach(), *(x.grad for x in leaves)], want):
        assert relative_error(got.numpy(), ref) < 1e-5
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="qsa_torch"), torch.no_grad():
        out = api.sparse_gqa_attention(*leaves, routes, 0.25)
    assert "ran backend 'flex'" in caplog.text
    assert relative_error(out.numpy(), want[0]) < 1e-5


def supports(query, key, value, selected_token_ids, *, softmax_scale=None, deterministic=False):
    """This module stands in for a backend module: its test backends accept every input."""
    return None


def _raising_backend(*args, **kwargs):
    raise UnsupportedShape("this test backend declines every input")


def _register(monkeypatch, name, function):
    """Backend ``name``: ``function`` of this module (its ``supports`` accepts all)."""
    import sys

    monkeypatch.setitem(api.BACKENDS, name, api._Backend("test_torch_api", function))
    monkeypatch.setitem(api._MODULES, name, sys.modules[__name__])


def test_auto_falls_back_when_a_backend_raises(rng, monkeypatch, caplog):
    _register(monkeypatch, "declines", "_raising_backend")
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("declines",))
    monkeypatch.setitem(api.VERIFIED, "declines", frozenset({"cpu"}))
    monkeypatch.setattr(api, "_LOGGED", set())
    problem, q, k, v, do = _problem(rng)
    leaves = _leaves(q, k, v)
    with caplog.at_level(logging.INFO, logger="qsa_torch"):
        out = api.sparse_gqa_attention(*leaves, torch.from_numpy(problem.routes), 0.5)
        out.backward(torch.from_numpy(do).float())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "declines every input" in warnings[0].getMessage()
    want = oracle_forward_backward(q, k, v, problem.routes, 0.5, do)
    for got, ref in zip([out.detach(), *(x.grad for x in leaves)], want):
        assert relative_error(got.numpy(), ref) < 1e-5


def test_explicit_backend_errors_propagate(rng, monkeypatch):
    problem, q, k, v, do = _problem(rng)
    routes = torch.from_numpy(problem.routes)
    args = [torch.tensor(x) for x in (q, k, v)]
    _register(monkeypatch, "declines", "_raising_backend")
    with pytest.raises(UnsupportedShape, match="declines"):
        api.sparse_gqa_attention(*args, routes, backend="declines")
    out = api.sparse_gqa_attention(*(a.float() for a in args), routes, backend="flex")  # CPU forward works
    assert relative_error(out.numpy(), oracle_forward_backward(q, k, v, problem.routes, 0.25)[0]) < 1e-5
    with pytest.raises(UnsupportedDevice, match="CPU backward"):  # flex's supports() declines at the call
        api.sparse_gqa_attention(*_leaves(q, k, v), routes, backend="flex")


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("out of memory for the test")


def _not_implemented(*args, **kwargs):
    raise NotImplementedError("not a decline")


@pytest.mark.parametrize("function,error", [("_out_of_memory", torch.OutOfMemoryError),
                                            ("_not_implemented", NotImplementedError)])
def test_auto_never_falls_back_after_other_errors(rng, monkeypatch, function, error):
    """Only a BackendDeclined moves "auto" on: out-of-memory and any other error propagate."""
    _register(monkeypatch, "raises", function)
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("raises",))
    monkeypatch.setitem(api.VERIFIED, "raises", frozenset({"cpu"}))
    problem, q, k, v, _ = _problem(rng)
    with pytest.raises(error):
        api.sparse_gqa_attention(*(torch.tensor(x) for x in (q, k, v)), torch.from_numpy(problem.routes))


def test_no_backend_left_raises_every_reason(rng, monkeypatch):
    """When every candidate declines: NoBackendAvailable naming each with its reason."""
    _register(monkeypatch, "declines", "_raising_backend")
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("declines",))
    monkeypatch.setitem(api.VERIFIED, "declines", frozenset({"cpu"}))
    monkeypatch.setitem(api._BROKEN, "reference", MissingRuntime("reference broken for the test"))
    problem, q, k, v, _ = _problem(rng)
    with pytest.raises(NoBackendAvailable) as err:
        api.sparse_gqa_attention(*(torch.tensor(x) for x in (q, k, v)), torch.from_numpy(problem.routes))
    assert set(err.value.reasons) == {"declines", "reference"}
    assert "declines: UnsupportedShape: this test backend declines" in str(err.value)
    assert "reference: MissingRuntime: reference broken" in str(err.value)


def test_deterministic_argument(rng, monkeypatch):
    """deterministic=True makes backends without a deterministic backward decline when
    gradients are wanted; None follows torch.use_deterministic_algorithms; non-bools are
    refused with the contract's InvalidDtype."""
    from qsa_torch import fa4_qsa
    from qsa_torch.routes import resolve_deterministic

    problem, q, k, v, _ = _problem(rng)
    args = [torch.tensor(x) for x in (q, k, v)]
    with pytest.raises(InvalidDtype, match="deterministic must be a bool or None, got 1"):
        api.sparse_gqa_attention(*args, torch.from_numpy(problem.routes), deterministic=1)
    assert resolve_deterministic(True) is True and resolve_deterministic(False) is False
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (True, False):
            torch.use_deterministic_algorithms(flag)
            assert resolve_deterministic(None) is flag
    finally:
        torch.use_deterministic_algorithms(before)
    monkeypatch.setattr(fa4_qsa, "_device_declined", lambda device: None)
    monkeypatch.setattr(fa4_qsa, "_HAS_RUNTIME", True)
    x = torch.zeros(1, 4, 2, 256, dtype=torch.bfloat16, requires_grad=True)
    routes = torch.zeros(1, 4, 2, dtype=torch.int64)
    assert isinstance(fa4_qsa.supports(x, x, x, routes, deterministic=True), DeterminismUnavailable)
    assert fa4_qsa.supports(x, x, x, routes, deterministic=False) is None
    assert fa4_qsa.supports(x.detach(), x.detach(), x.detach(), routes, deterministic=True) is None


def _stand_ins(shape_q, shape_kv, k, dtype, device, requires_grad):
    """Objects with the attributes ``supports`` reads (device, dtype, shape,
    requires_grad), for devices this machine does not have."""
    from types import SimpleNamespace

    def one(shape, grad):
        return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=torch.Size(shape),
                               requires_grad=grad)

    q = one(shape_q, requires_grad)
    kv = one(shape_kv, requires_grad)
    return q, kv, kv, one(tuple(shape_q[:2]) + (k,), False)


def _declines(name, shapes=((1, 64, 24, 256), (1, 64, 2, 256), 2052), dtype=torch.float32, device="cpu",
              requires_grad=True, **kwargs):
    return api.backend_declines(name, *_stand_ins(*shapes, dtype, device, requires_grad), **kwargs)


def test_backend_declines():
    """Each backend module's supports() says why it declines, with the common classes."""
    assert _declines("reference") is None
    assert isinstance(_declines("fa4", dtype=torch.bfloat16, requires_grad=False), UnsupportedDevice)
    assert "SM90" in str(_declines("fa4", dtype=torch.bfloat16))
    assert "Blackwell" in str(_declines("cudnn", dtype=torch.bfloat16, route_format="qsa"))
    assert "'qsa'-format" in str(_declines("cudnn", dtype=torch.bfloat16))
    flex = _declines("flex")
    assert isinstance(flex, UnsupportedDevice) and "CPU backward" in str(flex)
    assert _declines("flex", requires_grad=False) is None
    assert "float64" in str(_declines("flex", dtype=torch.float64, requires_grad=False))
    for name in ("reference", "flex", "fa4", "cudnn", "triton"):  # the dispatcher holds no limits
        assert callable(api._module(name).supports)


def test_triton_on_cpu_follows_how_its_kernels_were_imported(monkeypatch):
    """Triton takes CPU tensors iff its kernels are interpreted: TRITON_INTERPRET decides
    when they are imported, not later (the reason must not promise kernels that refuse)."""
    pytest.importorskip("triton")
    from qsa_triton import launch

    interpreted = launch.interpreted()  # imports the kernels as this process's environment says
    monkeypatch.setenv("TRITON_INTERPRET", "0" if interpreted else "1")  # too late to matter
    reason = _declines("triton", ((1, 16, 4, 32), (1, 16, 2, 32), 8))
    assert (reason is None) == interpreted, reason


@pytest.mark.parametrize("setting", ["1", "true", "On", "YES", "y", "0", "off", "2", None])
def test_triton_interprets_predicts_the_kernels_import(setting):
    """Before the kernels are imported, ``interprets`` reads TRITON_INTERPRET as Triton
    does, without importing them, and the import then agrees (a fresh process per setting)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    code = ("import sys\nfrom qsa_triton import launch\nguess = launch.interprets()\n"
            "assert 'qsa_triton.forward' not in sys.modules and 'triton' not in sys.modules\n"
            "assert launch.interpreted() == guess\nfrom triton import knobs\n"
            "assert knobs.runtime.interpret == guess\nprint(guess)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if setting is not None:
        env["TRITON_INTERPRET"] = setting
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(setting in ("1", "true", "On", "YES", "y"))


@pytest.mark.parametrize("capability,cls,order", [
    ((9, 0), "sm90", ("triton", "fa4", "flex", "reference")),
    ((10, 3), "sm100", ("triton", "flex", "cudnn", "reference")),
    ((10, 0), "sm100", ("triton", "flex", "cudnn", "reference")),
    ((8, 0), "cuda", ("triton", "flex", "reference")),
])
def test_gpu_preference_rows(monkeypatch, capability, cls, order):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    assert api.device_class(cuda) == cls
    assert api.candidate_backends(cuda) == order
    model = ((1, 64, 12, 256), (1, 64, 1, 256), 2052)
    fa4 = _declines("fa4", model, torch.bfloat16, "cuda")
    assert (fa4 is None or "not installed" in str(fa4)) if cls == "sm90" else "SM90" in str(fa4)
    cp = ((1, 32, 12, 256), (1, 64, 1, 256), 2052)
    if cls == "sm100":
        cudnn = str(_declines("cudnn", cp, torch.bfloat16, "cuda", route_format="qsa"))
        assert "Context parallelism" in cudnn or "not installed" in cudnn
        assert "'qsa'-format" in str(_declines("cudnn", model, torch.bfloat16, "cuda"))


def test_auto_puts_unverified_backends_last(monkeypatch):
    """Whatever PREFERENCE says, a backend verified on the device class comes before one
    verified only on another GPU class, which comes before one verified on none (cuDNN)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    cuda = torch.device("cuda")
    monkeypatch.setitem(api.PREFERENCE, "sm100", ("cudnn", "flex", "triton"))
    assert api.candidate_backends(cuda) == ("flex", "triton", "cudnn", "reference")
    monkeypatch.setitem(api.VERIFIED, "triton", frozenset({"sm90", "sm100"}))  # a recorded run
    assert api.candidate_backends(cuda) == ("triton", "flex", "cudnn", "reference")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(api.PREFERENCE, "sm90", ("cudnn", "fa4", "triton"))
    assert api.candidate_backends(cuda) == ("fa4", "triton", "cudnn", "reference")
    for name in api.BACKENDS:  # every backend states where it was verified
        assert name in api.VERIFIED
    assert api.VERIFIED["cudnn"] == frozenset()


def _stand_in_cudnn(monkeypatch):
    """On CPU tensors: the device class reads as SM100, and "cudnn" is the reference
    under that name (accepting every input, with cuDNN's route-format promise)."""
    from types import SimpleNamespace

    from qsa_torch import reference, routes

    monkeypatch.setattr(api, "device_class", lambda device: "sm100")
    monkeypatch.setitem(api.BACKENDS, "cudnn", api._Backend("stand-in", "reference_sparse_gqa_attention"))
    monkeypatch.setitem(api._MODULES, "cudnn", SimpleNamespace(
        supports=reference.supports, ROUTE_FORMAT="qsa",
        reference_sparse_gqa_attention=reference.reference_sparse_gqa_attention))
    monkeypatch.setattr(routes, "_UNVERIFIED_WARNED", set())


def test_explicit_unverified_backend_runs_with_one_warning(rng, monkeypatch, recwarn):
    from qsa_torch.routes import UnverifiedBackendWarning

    _stand_in_cudnn(monkeypatch)
    problem, q, k, v, do = _problem(rng, "padded", "qsa")
    routes = torch.from_numpy(problem.routes)
    for _ in range(3):
        got = run_torch(lambda *a: api.sparse_gqa_attention(*a, backend="cudnn"), q, k, v,
                        problem.routes, 0.3, do, "float32")
        _assert_matches_oracle(got, q, k, v, problem.routes, 0.3, do)
    unverified = [w for w in recwarn.list if issubclass(w.category, UnverifiedBackendWarning)]
    assert len(unverified) == 1, [str(w.message) for w in unverified]
    assert "cudnn" in str(unverified[0].message) and "unverified on sm100" in str(unverified[0].message)
    # a verified backend (the reference everywhere) never warns
    recwarn.clear()
    api.sparse_gqa_attention(*_leaves(q, k, v), routes, backend="reference")
    assert not [w for w in recwarn.list if issubclass(w.category, UnverifiedBackendWarning)]


def test_auto_on_blackwell_reaches_cudnn_only_after_the_verified_backends(rng, monkeypatch):
    _stand_in_cudnn(monkeypatch)
    q = torch.zeros(1, 32, 24, 256, dtype=torch.bfloat16)
    kv = torch.zeros(1, 32, 2, 256, dtype=torch.bfloat16)
    routes = torch.zeros(1, 32, 2052, dtype=torch.int64)

    def pick(route_format):
        return api._candidates(q, kv, kv, routes, 0.1, False, route_format, log=False)[0][0]

    assert pick("qsa") == ("triton" if api._module("triton").supports(q, kv, kv, routes) is None else "flex")
    monkeypatch.setitem(api._BROKEN, "triton", MissingRuntime("broken for the test"))
    assert pick("qsa") == "flex"
    monkeypatch.setitem(api._BROKEN, "flex", MissingRuntime("broken for the test"))
    assert pick("qsa") == "cudnn"
    assert pick("any") == "reference"


_CALLS: list[tuple[str, bool]] = []


def _flaky_backend(*args, **kwargs):
    """Declines its first call only, as a backend whose runtime failed to load once would."""
    _CALLS.append(("flaky", torch.is_grad_enabled()))
    if sum(name == "flaky" for name, _ in _CALLS) == 1:
        raise UnsupportedShape("flaky declines its first call")
    from qsa_torch import reference_sparse_gqa_attention

    return reference_sparse_gqa_attention(*args, **kwargs)


def _steady_backend(*args, **kwargs):
    _CALLS.append(("steady", torch.is_grad_enabled()))
    from qsa_torch import reference_sparse_gqa_attention

    return reference_sparse_gqa_attention(*args, **kwargs)


def _register_flaky_and_steady(monkeypatch):
    for name in ("flaky", "steady"):
        _register(monkeypatch, name, f"_{name}_backend")
        monkeypatch.setitem(api.VERIFIED, name, frozenset({"cpu"}))
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("flaky", "steady"))
    monkeypatch.setattr(api, "_LOGGED", set())
    _CALLS.clear()


@pytest.mark.parametrize("compiled", [False, True])
def test_backward_runs_the_backend_the_forward_resolved(rng, monkeypatch, caplog, compiled):
    """"auto" resolves once: the forward falls back from "flaky" to "steady", and the
    backward recomputes with "steady" although "flaky" would accept it now. Compiled
    (aot_eager), "auto" traces its first supported backend and keeps it likewise."""
    _register_flaky_and_steady(monkeypatch)
    problem, q, k, v, do = _problem(rng, "cp", "adversarial")
    fn = api.sparse_gqa_attention
    if compiled:
        _CALLS.append(("flaky", False))  # flaky has "failed" already: the compiled call takes it
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with caplog.at_level(logging.DEBUG, logger="qsa_torch"):
        got = run_torch(fn, q, k, v, problem.routes, 0.3, do, "float32")
    _assert_matches_oracle(got, q, k, v, problem.routes, 0.3, do)
    forward, backward = ("flaky", "flaky") if compiled else ("steady", "steady")
    ran = [name for name, _ in _CALLS]
    if compiled:
        assert ran[1:] == ["flaky", "flaky"], ran
    else:
        assert ran == ["flaky", "steady", "steady"], ran
        assert "flaky declines its first call" in caplog.text
    assert f"ran backend {forward!r}" in caplog.text
    assert f"ran backend {backward!r} (backward)" in caplog.text


@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(backend="fastest"), InvalidInput, "backend"),
    (dict(deterministic="yes"), InvalidDtype, "deterministic"),
    (dict(route_format="blocks"), ValueError, "route_format"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(softmax_scale="0.5"), TypeError, "softmax_scale"),
])
def test_bad_arguments(rng, kwargs, exc, text):
    problem, q, k, v, _ = _problem(rng)
    args = [torch.tensor(x) for x in (q, k, v)]
    with pytest.raises(exc, match=text):
        api.sparse_gqa_attention(*args, torch.from_numpy(problem.routes), **kwargs)


def test_bad_shapes_and_dtypes_are_the_contracts_errors(rng):
    problem, q, k, v, _ = _problem(rng)
    args = [torch.tensor(x, dtype=torch.float32) for x in (q, k, v)]
    routes = torch.from_numpy(problem.routes)
    with pytest.raises(InvalidInput, match="query"):
        api.sparse_gqa_attention(args[0][0], *args[1:], routes)
    with pytest.raises(InvalidDtype, match="selected_token_ids"):
        api.sparse_gqa_attention(*args, routes.float())
    with pytest.raises(InvalidDtype, match="key"):
        api.sparse_gqa_attention(args[0], args[1].double(), args[2], routes)


@pytest.mark.gpu
def test_auto_on_gpu_matches_the_oracle_and_compiles(rng, caplog):
    """On a GPU, "auto" picks a fast backend (logged); eager and inductor-compiled results
    agree with the float64 oracle within the bf16 tolerance, gradients included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for torch")
    problem = make_problem("packed", "qsa", seed=int(rng.integers(2**31)), seq_len=1024, top_k=64)
    q, k, v, do = random_inputs(rng, problem.routes, problem.kv_length, (12, 1), 256, "bfloat16")
    want = oracle_forward_backward(q, k, v, problem.routes, 1 / 16, do)
    routes = torch.from_numpy(problem.routes).cuda()

    def run(fn):
        leaves = [torch.tensor(x, dtype=torch.bfloat16, device="cuda", requires_grad=True) for x in (q, k, v)]
        out = fn(*leaves, routes)
        out.backward(torch.tensor(do, dtype=torch.bfloat16, device="cuda"))
        return [t.detach().double().cpu().numpy() for t in (out, *(x.grad for x in leaves))]

    attention = lambda *a: api.sparse_gqa_attention(*a, softmax_scale=1 / 16)  # noqa: E731
    with caplog.at_level(logging.DEBUG, logger="qsa_torch"):
        eager = run(attention)
    ran = [r.getMessage() for r in caplog.records if "ran backend" in r.getMessage()]
    print(ran)
    assert ran and "'reference'" not in ran[0], f"auto fell back to the reference: {caplog.text}"
    compiled = run(torch.compile(attention, fullgraph=True))
    for name, e, c, w in zip(("out", "dq", "dk", "dv"), eager, compiled, want):
        assert relative_error(e, w) < 1e-2, name
        assert relative_error(c, w) < 1e-2, name


# ---------------------------------------------------------------- the Triton op pair
# On CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1).
# These tests drive the op pair's mechanics with CPU tensors, so they need that
# interpreter; on a GPU host (compiled kernels, CPU tensors refused) the op pair is
# covered by test_auto_on_gpu_matches_the_oracle_and_compiles and the parity suite.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="drives the Triton op pair with CPU tensors through Triton's interpreter")
def _assert_matches_oracle(got, q, k, v, routes, scale, do):
    """out, dq, dk, dv of ``run_torch`` within 1e-5 of the float64 oracle's."""
    want = oracle_forward_backward(q, k, v, routes, scale, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < 1e-5, name


def _count_triton_forwards(monkeypatch):
    from qsa_torch import triton_qsa

    calls = []
    original = triton_qsa._forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_qsa, "_forward", counted)
    return calls


@needs_interpreter
def test_triton_pair_runs_the_forward_once_per_training_step(rng, monkeypatch):
    """backend="triton": the op pair saves LSE and tile unions, so forward+backward runs
    the forward kernel once (the generic op would run it twice) and matches the oracle."""
    calls = _count_triton_forwards(monkeypatch)
    problem, q, k, v, do = _problem(rng, "padded", "qsa", heads=(6, 2))
    got = run_torch(lambda *a: api.sparse_gqa_attention(*a, backend="triton"), q, k, v,
                    problem.routes, 0.3, do, "float32")
    assert len(calls) == 1
    _assert_matches_oracle(got, q, k, v, problem.routes, 0.3, do)


@needs_interpreter
def test_auto_takes_the_triton_pair_where_triton_comes_first(rng, monkeypatch, caplog):
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("triton",))
    calls = _count_triton_forwards(monkeypatch)
    problem, q, k, v, do = _problem(rng, "cp", "random")
    got = run_torch(api.sparse_gqa_attention, q, k, v, problem.routes, 0.3, do, "float32")
    assert len(calls) == 1
    _assert_matches_oracle(got, q, k, v, problem.routes, 0.3, do)

    # a decline from the pair: "auto" falls back to the next backend, logged
    from qsa_torch import triton_qsa

    def declines(*args, **kwargs):
        raise UnsupportedShape("declined for the test")

    monkeypatch.setattr(triton_qsa, "forward_with_residuals", declines)
    with caplog.at_level(logging.WARNING, logger="qsa_torch"):
        again = run_torch(api.sparse_gqa_attention, q, k, v, problem.routes, 0.3, do, "float32")
    assert "declined for the test" in caplog.text
    _assert_matches_oracle(again, q, k, v, problem.routes, 0.3, do)
    with pytest.raises(BackendDeclined):  # a named backend does not fall back
        api.sparse_gqa_attention(*_leaves(q, k, v), torch.from_numpy(problem.routes), backend="triton")


@needs_interpreter
def test_auto_choosing_triton_traces_without_graph_breaks(rng, monkeypatch):
    """The static choice of "auto" runs in Python before the op: dynamo must trace it
    (device class, runtime lookup, static reasons) without breaking the graph."""
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("triton", "flex"))
    calls = _count_triton_forwards(monkeypatch)
    problem, q, k, v, do = _problem(rng, "padded", "qsa", seq_len=16)
    routes = torch.from_numpy(problem.routes)
    grad = torch.from_numpy(do).float()

    def loss(q_, k_, v_, r_):
        return (api.sparse_gqa_attention(q_, k_, v_, r_, 0.3) * grad).sum()

    explanation = torch._dynamo.explain(loss)(*_leaves(q, k, v), routes)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    calls.clear()
    leaves = _leaves(q, k, v)
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves, routes).backward()
    assert len(calls) == 1  # the Triton pair, not the generic op's recomputation
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for got, ref in zip([x.grad.numpy() for x in leaves], want[1:]):
        assert relative_error(got, ref) < 1e-5


@needs_interpreter
def test_triton_pair_compiles_fullgraph_and_passes_opcheck(rng):
    problem, q, k, v, do = _problem(rng, "packed", "adversarial", seq_len=16)
    routes = torch.from_numpy(problem.routes)
    grad = torch.from_numpy(do).float()

    def loss(q_, k_, v_, r_):
        return (api.sparse_gqa_attention(q_, k_, v_, r_, 0.3, backend="triton") * grad).sum()

    explanation = torch._dynamo.explain(loss)(*_leaves(q, k, v), routes)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    leaves = _leaves(q, k, v)
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves, routes).backward()
    want = oracle_forward_backward(q, k, v, problem.routes, 0.3, do)
    for got, ref in zip([x.grad.numpy() for x in leaves], want[1:]):
        assert relative_error(got, ref) < 1e-5
    detached = [x.detach() for x in leaves]
    torch.library.opcheck(torch.ops.qsa.triton_sparse_gqa_attention.default,
                          (*leaves, routes, 0.3))
    residuals = torch.ops.qsa.triton_sparse_gqa_attention.default(*detached, routes, 0.3)
    torch.library.opcheck(torch.ops.qsa.triton_sparse_gqa_attention_backward.default,
                          (grad, *detached, *residuals, 0.3, routes.shape[2]))


@needs_interpreter
def test_auto_fallback_from_the_triton_pair_skips_triton_everywhere(rng, monkeypatch, caplog):
    """A broken Triton runtime (ImportError) under "auto": logged, remembered in _BROKEN,
    and neither the generic forward nor its backward tries Triton again."""
    from qsa_torch import triton_qsa

    monkeypatch.setitem(api.PREFERENCE, "cpu", ("triton",))
    monkeypatch.setattr(api, "_BROKEN", {})

    def broken(*args, **kwargs):
        raise ImportError("libcuda went missing for the test")

    generic_calls = []
    monkeypatch.setattr(triton_qsa, "forward_with_residuals", broken)
    monkeypatch.setattr(triton_qsa, "triton_sparse_gqa_attention",
                        lambda *a, **k: generic_calls.append(1) or broken())
    problem, q, k, v, do = _problem(rng)
    with caplog.at_level(logging.DEBUG, logger="qsa_torch"):
        got = run_torch(api.sparse_gqa_attention, q, k, v, problem.routes, 0.3, do, "float32")
    assert "libcuda went missing" in caplog.text and "triton" in api._BROKEN
    assert not generic_calls
    _assert_matches_oracle(got, q, k, v, problem.routes, 0.3, do)


@needs_interpreter
def test_triton_pair_compiles_once_for_varying_batch_and_length(rng, monkeypatch):
    """torch.compile over a new (B, S) every step, as training on packed or ragged batches
    does: the Triton pair's fake (its residuals' shapes) stays symbolic in B, S_q and S_kv,
    so dynamo's automatic dynamic shapes settle after a few recompiles (B, S, and B = 1,
    which dynamo always specializes, with dynamic S) instead of compiling every shape
    until its recompile limit (8) fails the call."""
    from torch._dynamo.utils import counters

    monkeypatch.setitem(api.PREFERENCE, "cpu", ("triton",))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: api.sparse_gqa_attention(*a), fullgraph=True, backend="aot_eager")
    before = counters["stats"]["unique_graphs"]
    shapes = [(1, 16), (2, 16), (1, 24), (1, 40), (2, 48), (3, 56), (1, 72), (2, 80), (1, 88), (2, 96), (1, 104),
              (3, 120)]
    for bsz, seq in shapes:
        routes = rng.integers(-1, seq, (bsz, seq, 6)).astype(np.int64)
        q, k, v, do = random_inputs(rng, routes, seq, (6, 2), 16, "float32")
        got = run_torch(lambda *a: compiled(*a), q, k, v, routes, 0.3, do, "float32")
        _assert_matches_oracle(got, q, k, v, routes, 0.3, do)
    assert counters["stats"]["unique_graphs"] - before <= 4


@needs_interpreter
def test_triton_pair_logs_its_run_and_gives_a_deterministic_backward(rng, monkeypatch, caplog):
    """Under torch.use_deterministic_algorithms ``auto`` keeps picking the Triton pair, whose
    backward (the fixed-point one, read when the backward runs) gives the oracle's gradients
    with the same bits every run, eager and compiled, with no warning in warn-only mode."""
    from qsa_torch import triton_qsa

    monkeypatch.setitem(api.PREFERENCE, "cpu", ("triton",))
    problem, q, k, v, do = _problem(rng)
    routes = torch.from_numpy(problem.routes)
    with caplog.at_level(logging.DEBUG, logger="qsa_torch"):
        api.sparse_gqa_attention(*_leaves(q, k, v), routes)
    assert "ran backend 'triton'" in caplog.text
    modes = []
    original = triton_qsa.backward_from_residuals

    def spy(*args, **kwargs):  # the flag as the pair's backward sees it
        modes.append(torch.are_deterministic_algorithms_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_qsa, "backward_from_residuals", spy)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        runs = [run_torch(api.sparse_gqa_attention, q, k, v, problem.routes, 0.3, do, "float32") for _ in range(2)]
        torch.use_deterministic_algorithms(True, warn_only=True)
        compiled = torch.compile(lambda *a: api.sparse_gqa_attention(*a, backend="triton"),
                                 fullgraph=True, backend="aot_eager")
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*deterministic")  # no such warning any more
            runs.append(run_torch(compiled, q, k, v, problem.routes, 0.3, do, "float32"))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert modes == [True, True, True]
    _assert_matches_oracle(runs[0], q, k, v, problem.routes, 0.3, do)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            np.testing.assert_array_equal(a, b)


def test_deterministic_reaches_the_triton_backend(rng, monkeypatch):
    """The dispatcher hands the resolved ``deterministic`` to the Triton op pair: an
    explicit value as given, None as torch's deterministic-algorithms flag reads."""
    from qsa_torch import reference_sparse_gqa_attention, triton_qsa

    seen = []

    def spy(query, key, value, routes, scale, *, deterministic=None, block_sizes=None):
        seen.append(deterministic)
        return reference_sparse_gqa_attention(query, key, value, routes, scale)

    monkeypatch.setattr(triton_qsa, "checked_attention", spy)
    monkeypatch.setattr(triton_qsa, "supports", lambda *a, **k: None)
    problem, q, k, v, do = _problem(rng)
    assert not torch.are_deterministic_algorithms_enabled()
    for deterministic in (True, False, None):
        def call(*a, deterministic=deterministic):
            return api.sparse_gqa_attention(*a, backend="triton", deterministic=deterministic)

        got = run_torch(call, q, k, v, problem.routes, 0.3, do, "float32")
        _assert_matches_oracle(got, q, k, v, problem.routes, 0.3, do)
    torch.use_deterministic_algorithms(True)
    try:
        run_torch(lambda *a: api.sparse_gqa_attention(*a, backend="triton"), q, k, v, problem.routes, 0.3, do,
                  "float32")
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [True, False, False, True]
