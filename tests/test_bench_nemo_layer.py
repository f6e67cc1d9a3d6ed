"""scripts/gpu/bench_nemo_layer.py on CPU: the AR(1) hidden states and, through a dry run of
the upstream layer, the route statistics and the kernel-alone timing per hidden-state
correlation (the GPU figures come from the H200; see docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu",
                      "bench_nemo_layer.py")


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_nemo_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_hidden_states_follow_the_ar1_recursion(bench):
    seq, hidden = 8192, 96
    noise, grad0 = bench.hidden_states(seq, hidden, 0.0, seed=3)
    gen = torch.Generator().manual_seed(3 + seq)
    assert torch.equal(noise, torch.randn(1, seq, hidden, generator=gen))  # rho 0: independent draws
    for rho in (0.9, 0.99):
        x, grad = bench.hidden_states(seq, hidden, rho, seed=3)
        assert torch.equal(grad, grad0)  # the same grad_out for every rho
        x64, e64 = x.double(), noise.double()
        assert torch.equal(x[:, 0], noise[:, 0])
        innovation = x64[:, 1:] - rho * x64[:, :-1]
        torch.testing.assert_close(innovation, math.sqrt(1 - rho * rho) * e64[:, 1:], rtol=0, atol=1e-5)
        lag1 = float((x64[:, 1:] * x64[:, :-1]).sum() / (x64[:, :-1] ** 2).sum())
        assert abs(lag1 - rho) < 0.01, lag1
        assert abs(float(x64.var()) - 1.0) < 0.15  # unit stationary variance, as the independent inputs


def test_hidden_rho_must_lie_in_unit_interval(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--out", str(tmp_path), "--hidden-rho", "0", "1.0"])


def test_dry_run_reports_route_statistics_per_rho(bench, tmp_path):
    pytest.importorskip("nemo_automodel.components.models.qwen3_8_flash_next.layers",
                        reason="the layer benchmark needs nemo-automodel (pip install 'qsa-kernels[upstream]')")
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--hidden-rho", "0", "0.99",
                       "--variants", "qsa_torch", "flex", "--qsa-backend", "reference"]) == 0
    report = json.loads((tmp_path / "bench_nemo_layer.json").read_text())
    results = report["results"]
    assert [(r["hidden_rho"], r["variant"]) for r in results] == [
        (0.0, "qsa_torch"), (0.0, "flex"), (0.99, "qsa_torch"), (0.99, "flex")]
    stats = {}
    for r in results:
        assert r["seq_len"] == 150 and r["step_ms"] > 0 and r["breakdown_ms"]["attn"] > 0
        route = r["route_stats"]
        assert route["variant"] == "qsa_torch" and route["group"] == 2 and route["jaccard_first_row"] == 4 * 8 + 3
        assert 0.0 <= r["jaccard"] <= 1.0 and r["inflation"] >= 1.0
        assert (r["jaccard"], r["inflation"]) == (route["jaccard"], route["inflation"])
        stats.setdefault(r["hidden_rho"], set()).add((r["jaccard"], r["inflation"]))
        if r["variant"] == "qsa_torch":  # compared with the flex run of the same rho
            assert r["routes_identical"] and max(r["agreement"].values()) < 1e-5, r["agreement"]
            kernel = r["kernel_alone"]
            assert kernel["fwd_ms"] > 0 and kernel["fwdbwd_ms"] > 0 and "'reference'" in kernel["ran"]
            assert len(kernel["layer_qkv_contiguous"]) == 3
            assert r["attn_vs_kernel"] == pytest.approx(r["breakdown_ms"]["attn"] / kernel["fwdbwd_ms"])
    assert all(len(v) == 1 for v in stats.values())  # one route set per (S, rho)
    (j0, inf0), (j99, inf99) = stats[0.0].pop(), stats[0.99].pop()
    assert j99 > j0 + 0.2 and inf99 < inf0, (j0, j99, inf0, inf99)
    table = (tmp_path / "bench_nemo_layer.md").read_text()
    assert table.count("| 150 | qsa_torch | 0.99 |") == 1 and table.count("| 150 | flex | 0 |") == 1
    assert sum("S=150 rho=" in note and "sparse_gqa_attention alone" in note for note in report["notes"]) == 2
