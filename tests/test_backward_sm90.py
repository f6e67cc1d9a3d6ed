"""The warp-specialized Hopper backward (``qsa_triton.backward_sm90``: the default
non-deterministic backward on sm_90); GPU only apart from its launch
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
    operands outside it (fp32, a dO without unit stride along D)."""
    plan = make_plan(12, 256, DEFAULT_BLOCK_SIZES)
    q, kv = _operand((2, 300, 24, 256)), _operand((2, 300, 2, 256))
    n_tiles = plan.n_tiles(300)
    launch = spec.backward_sm90_launch(plan, q, kv, kv, q, q, (2, n_tiles, 2052), 0.0625, "bfloat16")
    assert launch is not None and launch.grid == (n_tiles, 4)
    assert [o.name for o in launch.outputs] == ["DQ", "DK", "DV"] and launch.outputs[1].zeroed
    assert spec.backward_sm90_launch(plan, q, kv, kv, q, q, (2, n_tiles, 2052), 0.0625, "float32") is None
    strided = (q[0], (q[1][0], q[1][1], q[1][2], 2))
    assert spec.backward_sm90_launch(plan, q, kv, kv, q, strided, (2, n_tiles, 2052), 0.0625, "bfloat16") is None
    pytest.importorskip("triton.experimental.gluon", reason="this triton has no Gluon")
    assert launch.arg_names() == tuple(spec.kernel(launch.kernel).arg_names)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kind", [((24, 2), "qsa"), ((24, 2), "adversarial"), ((12, 1), "qsa")])
def test_gradients_match_the_oracle(heads, kind):
    """dQ/dK/dV within the contract's bf16 bound of the float64 oracle, on two batch rows
    of 700 rows, int64 routes (huge padding IDs included), an unrouted inf/NaN K/V row."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qsa_torch import _triton_launch as launcher
    from qsa_torch import _triton_unions as unions

    if not launcher.hopper_forward(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and a triton with Gluon")
    rng = np.random.default_rng()
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
    tile = unions.build_unions(troutes, seq, plan)
    out, lse = launcher.forward(t["q"], t["k"], t["v"], tile, 0.0625, plan)
    ops = [(tuple(a.shape), a.stride()) for a in (t["q"], t["k"], t["v"], out, t["do"])]
    launch = spec.backward_sm90_launch(plan, *ops, tuple(tile.union.shape), 0.0625, "bfloat16")
    got = launcher.run(launch, dict(Q=t["q"], K=t["k"], V=t["v"], O=out, DO=t["do"], LSE=lse, UNION=tile.union,
                                    COUNT=tile.count, ROWBITS=tile.rowbits), t["q"].device)
    ref = {n: t[n].double().cpu().numpy() for n in x}
    ref["k"][:, 0], ref["v"][:, 0] = 0.0, 0.0
    want = oracle_forward_backward(ref["q"], ref["k"], ref["v"], routes, 0.0625, ref["do"])[1:]
    for name, w in zip(("DQ", "DK", "DV"), want):
        g = got[name].double().cpu().numpy()
        assert np.isfinite(g).all(), name
        assert relative_error(g, w) < 1e-2, name
