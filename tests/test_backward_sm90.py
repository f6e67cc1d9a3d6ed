"""The warp-specialized Hopper backward (``qsa_triton.backward_sm90``: torch's and JAX's
backward on sm_90, both modes); GPU only apart from its launch
description (Gluon kernels do not run in Triton's interpreter)."""

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
from qsa_triton.config import DEFAULT_BLOCK_SIZES  # noqa: E402
from qsa_triton.plan import make_plan  # noqa: E402


def _operand(shape):
    return shape, spec.contiguous_strides(shape)


def test_launch_scope():
    """Described for the forward's scope with the kernel's exact arguments; refused for
    operands outside it (fp32, a dO without unit stride along D). The deterministic form
    has backward.py's deterministic accumulators and bounds."""
    plan = make_plan(12, 256, DEFAULT_BLOCK_SIZES)
    q, kv = _operand((2, 300, 24, 256)), _operand((2, 300, 2, 256))
    n_tiles = plan.n_tiles(300)
    launch = spec.backward_sm90_launch(plan, q, kv, kv, q, q, (2, n_tiles, 2052), 0.0625, "bfloat16")
    assert launch is not None and launch.grid == (n_tiles, 4)
    assert [o.name for o in launch.outputs] == ["DQ", "DK", "DV", "FLAG"] and launch.outputs[1].zeroed
    assert launch.outputs[1].dtype == "float32" and dict(launch.params)["DETERMINISTIC"] is False
    fixed = spec.backward_sm90_launch(plan, q, kv, kv, q, q, (2, n_tiles, 2052), 0.0625, "bfloat16",
                                      deterministic=True)
    generic = spec.backward_launch(plan, q, kv, kv, q, q, (2, n_tiles, 2052), 0.0625, "bfloat16",
                                   interpreted=False, deterministic=True)
    assert [(o.name, o.shape, o.dtype, o.zeroed) for o in fixed.outputs] == \
        [(o.name, o.shape, o.dtype, o.zeroed) for o in generic.outputs]
    assert fixed.inputs == generic.inputs and dict(fixed.params)["DETERMINISTIC"] is True
    bounds = [dict(generic.params)[n] for n in ("BOUND_K", "BOUND_V")]
    assert [dict(fixed.params)[n] for n in ("BOUND_K", "BOUND_V")] == bounds
    assert bounds == list(spec.fixed_point_bounds(0.0625, 300 * 12, 256))
    assert spec.backward_sm90_launch(plan, q, kv, kv, q, q, (2, n_tiles, 2052), 0.0625, "float32") is None
    strided = (q[0], (q[1][0], q[1][1], q[1][2], 2))
    assert spec.backward_sm90_launch(plan, q, kv, kv, q, strided, (2, n_tiles, 2052), 0.0625, "bfloat16") is None
    pytest.importorskip("triton.experimental.gluon", reason="this triton has no Gluon")
    assert launch.arg_names() == fixed.arg_names() == tuple(spec.kernel(launch.kernel).arg_names)


def test_attention_input_dtypes():
    """The ahead-of-time compiles' input dtypes (``scripts/ptxas_report.py``, the jax-triton
    compile test): the compute dtype for Q/K/V/O/dO, fp32 LSE and maxima, int32 unions; an
    input of another kernel is refused."""
    plan = make_plan(12, 256, DEFAULT_BLOCK_SIZES)
    q, kv = _operand((1, 300, 24, 256)), _operand((1, 300, 2, 256))
    unions = (1, plan.n_tiles(300), 2052)
    launch = spec.backward_sm90_launch(plan, q, kv, kv, q, q, unions, 0.0625, "float16", deterministic=True)
    assert spec.attention_input_dtypes(launch, "float16") == dict(
        Q="float16", K="float16", V="float16", O="float16", DO="float16", LSE="float32", UNION="int32",
        COUNT="int32", ROWBITS="int32", MAXIMA="float32")
    forward = spec.forward_launch(plan, q, kv, kv, unions, 0.0625, "bfloat16", interpreted=False)
    assert set(spec.attention_input_dtypes(forward, "bfloat16").values()) == {"bfloat16", "int32"}
    other = spec.Launch(**{**launch.__dict__, "inputs": launch.inputs + ("ROUTES",)})
    with pytest.raises(ValueError, match="ROUTES"):
        spec.attention_input_dtypes(other, "bfloat16")


# The m64n32 wgmma accumulator's fragment (PTX ISA, "wgmma .m64nNk16 register fragment"),
# per warp of 16 rows as [row, column] bases: registers column 1, row 8, columns 8 and 16;
# lanes columns 2 and 4, rows 1, 2 and 4.
_ACC_REG = [[0, 1], [8, 0], [0, 8], [0, 16]]
_ACC_LANE = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]


def _one_exchange(reg, lane, new_reg, new_lane) -> bool:
    """Whether (new_reg, new_lane) is (reg, lane) with one lane basis exchanged for one
    register basis (registers in any order: renaming them costs nothing)."""
    changed = [i for i, (a, b) in enumerate(zip(lane, new_lane)) if a != b]
    if len(changed) != 1:
        return False
    out, into = lane[changed[0]], new_lane[changed[0]]
    return into in reg and sorted(map(tuple, new_reg)) == sorted(map(tuple, [out if r == into else r for r in reg]))


def _instruction_footprints(reg, lane, vector_bits):
    """Per warp instruction (one value of the register bits past the first ``vector_bits``,
    which one vector atomic carries): the [row, column] elements its 32 lanes add."""
    def element(bases, index):
        r = c = 0
        for bit, (dr, dc) in enumerate(bases):
            if index >> bit & 1:
                r, c = r ^ dr, c ^ dc
        return r, c

    vec, rest = reg[:vector_bits], reg[vector_bits:]
    return [{tuple(a ^ b for a, b in zip(element(rest, i), element(lane + vec, j)))
             for j in range(1 << (len(lane) + len(vec)))} for i in range(1 << len(rest))]


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradient_blocks_reach_whole_line_layouts_one_shuffle_at_a_time(deterministic):
    """``backward_sm90._add_steps``: each step exchanges one lane bit for one register bit
    (a shuffle; a conversion moving more bits at once goes through shared memory, which the
    kernel has none of), starting from the accumulator's fragment; each warp keeps its 16
    rows; in the last layout every warp instruction adds whole 128-byte lines (fp32: v4
    runs, 4 rows x 32 columns; int64: one row of 32 columns) and each element once."""
    pytest.importorskip("triton.experimental.gluon", reason="this triton has no Gluon")
    from qsa_triton.backward_sm90 import _add_layout, _add_steps

    steps = _add_steps(64, 32, deterministic)
    reg, lane = _ACC_REG, _ACC_LANE
    for layout in steps:
        assert layout.warp_bases == [[16, 0], [32, 0]] and list(layout.shape) == [64, 32]
        assert _one_exchange(reg, lane, layout.reg_bases, layout.lane_bases), (reg, lane, layout)
        reg, lane = layout.reg_bases, layout.lane_bases
    assert _add_layout(64, 32, deterministic) == steps[-1]
    vector_bits = 0 if deterministic else 2
    if not deterministic:  # the v4 atomic's four adjacent columns
        assert reg[:2] == [[0, 1], [0, 2]]
    seen = set()
    for elements in _instruction_footprints(reg, lane, vector_bits):
        assert len(elements) == 32 << vector_bits
        # all 32 columns of each row it touches: rows of 128 (fp32) or 256 (int64) bytes
        assert len({r for r, _ in elements}) * 32 == len(elements)
        seen |= elements
    assert len(seen) == 16 * 32  # the warp's 16 rows, each element in one instruction


def _fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _problem(heads, kind, rng):
    """Two batch rows of 700 rows, int64 routes (huge padding IDs included), an unrouted
    inf/NaN K/V row; the forward's output, LSE and unions from the launcher."""
    from qsa_torch import _triton_launch as launcher
    from qsa_torch import triton_qsa
    from qsa_triton import driver

    seq, (hq, hkv) = 700, heads
    if kind == "qsa":
        routes = np.stack([family("qsa", width=260, top_k=64, overlap=0.8, rng=rng)(seq) for _ in range(2)])
    else:
        routes = np.stack([adversarial_routes(seq, width=96, rng=rng)[:seq] for _ in range(2)])
    routes = np.where(routes == 0, -1, routes)
    x = {n: rng.standard_normal((2, seq, h, 256)) for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("do", hq))}
    t = {n: torch.from_numpy(a).to("cuda", torch.bfloat16) for n, a in x.items()}
    t["k"][:, 0], t["v"][:, 0] = float("inf"), float("nan")
    plan = make_plan(hq // hkv, 256, DEFAULT_BLOCK_SIZES)
    troutes = torch.from_numpy(routes).cuda()
    tile = triton_qsa.build_unions(troutes, seq, plan)
    out, lse = driver.forward(launcher.adapter(troutes.device), t["q"], t["k"], t["v"], tile, 0.0625, plan)
    ops = [(tuple(a.shape), a.stride()) for a in (t["q"], t["k"], t["v"], out, t["do"])]
    arrays = dict(Q=t["q"], K=t["k"], V=t["v"], O=out, DO=t["do"], LSE=lse, UNION=tile.union, COUNT=tile.count,
                  ROWBITS=tile.rowbits, MAXIMA=lse)
    return routes, x, t, plan, ops, tile, arrays


def _hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qsa_torch import _triton_launch as launcher

    if not launcher.hopper_forward(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and a triton with Gluon")
    return launcher


def _oracle(routes, t):
    """float64 dQ, dK, dV of the bf16 inputs, the unrouted inf/NaN row zeroed."""
    ref = {n: a.double().cpu().numpy() for n, a in t.items()}
    ref["k"][:, 0], ref["v"][:, 0] = 0.0, 0.0
    return oracle_forward_backward(ref["q"], ref["k"], ref["v"], routes, 0.0625, ref["do"])[1:]


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kind", [((24, 2), "qsa"), ((24, 2), "adversarial"), ((12, 1), "qsa")])
def test_gradients_match_the_oracle(heads, kind):
    """dQ/dK/dV within the contract's bf16 bound of the float64 oracle."""
    launcher = _hopper()
    routes, x, t, plan, ops, tile, arrays = _problem(heads, kind, _fresh_rng())
    launch = spec.backward_sm90_launch(plan, *ops, tuple(tile.union.shape), 0.0625, "bfloat16")
    got = launcher.run(launch, arrays, t["q"].device)
    for name, w in zip(("DQ", "DK", "DV"), _oracle(routes, t)):
        g = got[name].double().cpu().numpy()
        assert np.isfinite(g).all(), name
        assert relative_error(g, w) < 1e-2, name


def _fixed_point_grads(launcher, launch, arrays, t, plan):
    """dQ, dK, dV of a deterministic launch: the kernel, then the fixed-point conversion."""
    got = launcher.run(launch, arrays, t["q"].device)
    convert = spec.fixed_point_launch(tuple(t["k"].shape), "bfloat16", 0.0625, t["q"].shape[1] * plan.group,
                                      interpreted=False)
    fixed = launcher.run(convert, dict(DK_FIXED=got["DK"], DV_FIXED=got["DV"], MAXIMA=arrays["MAXIMA"],
                                       FLAG=got["FLAG"]), t["q"].device)
    return got["DQ"], fixed["DK"], fixed["DV"]


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kind", [((24, 2), "qsa"), ((12, 1), "adversarial")])
def test_deterministic_gradients_are_bitwise_reproducible(heads, kind):
    """The fixed-point form: dQ/dK/dV bitwise equal over three runs, within the bf16 bound
    of the float64 oracle, and within rounding of backward.py's fixed-point gradients."""
    launcher = _hopper()
    routes, x, t, plan, ops, tile, arrays = _problem(heads, kind, _fresh_rng())
    arrays = dict(arrays, MAXIMA=launcher.input_maxima(t["q"], t["do"], t["v"], arrays["LSE"]))
    launch = spec.backward_sm90_launch(plan, *ops, tuple(tile.union.shape), 0.0625, "bfloat16", deterministic=True)
    runs = [_fixed_point_grads(launcher, launch, arrays, t, plan) for _ in range(3)]
    for again in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], again):
            assert torch.equal(a, b), name
    for name, g, w in zip(("dq", "dk", "dv"), runs[0], _oracle(routes, t)):
        g = g.double().cpu().numpy()
        assert np.isfinite(g).all(), name
        assert relative_error(g, w) < 1e-2, name
    generic = spec.backward_launch(plan, *ops, tuple(tile.union.shape), 0.0625, "bfloat16", interpreted=False,
                                   deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], _fixed_point_grads(launcher, generic, arrays, t, plan)):
        assert relative_error(a.double().cpu().numpy(), b.double().cpu().numpy()) < 1e-3, name


@pytest.mark.gpu
def test_deterministic_poisoned_sums_come_out_nan():
    """A routed K row holding inf makes those pairs' dQ non-finite: the fixed-point sums
    cannot carry it, so dK and dV come out NaN everywhere (backward.py's rule), never finite."""
    launcher = _hopper()
    routes, x, t, plan, ops, tile, arrays = _problem((24, 2), "qsa", _fresh_rng())
    routed = int(np.unique(routes[0][routes[0] > 0])[0])
    t["k"][0, routed, 1, 3] = float("inf")
    arrays = dict(arrays, MAXIMA=launcher.input_maxima(t["q"], t["do"], t["v"], arrays["LSE"]))
    launch = spec.backward_sm90_launch(plan, *ops, tuple(tile.union.shape), 0.0625, "bfloat16", deterministic=True)
    _, dk, dv = _fixed_point_grads(launcher, launch, arrays, t, plan)
    assert torch.isnan(dk).all() and torch.isnan(dv).all()


@pytest.mark.gpu
def test_deterministic_bits_do_not_depend_on_the_gradient_layout():
    """Through the torch API: out.sum() (an expanded, stride-0 grad_out) and the same ones
    as a dense tensor give bitwise equal fixed-point gradients (the kernel follows from
    the shapes alone, as in JAX)."""
    _hopper()
    from qsa_torch.triton_qsa import triton_sparse_gqa_attention

    rng = _fresh_rng()
    seq, (hq, hkv) = 300, (24, 2)
    routes = torch.from_numpy(family("qsa", width=260, top_k=64, overlap=0.8, rng=rng)(seq)[None]).cuda()
    inputs = [torch.from_numpy(rng.standard_normal((1, seq, h, 256))).to("cuda", torch.bfloat16)
              for h in (hq, hkv, hkv)]

    def grads(expanded):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = triton_sparse_gqa_attention(*leaves, routes, 0.0625, deterministic=True)
        if expanded:
            out.sum().backward()  # grad_out: a stride-0 expand of one bf16 1.0
        else:
            out.backward(torch.ones_like(out))
        return [x.grad for x in leaves]

    for name, a, b in zip(("dq", "dk", "dv"), grads(True), grads(False)):
        assert torch.equal(a, b), name
