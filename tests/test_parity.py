"""The parity suite: the CI-size run passes, and a wrong backend is reported as failing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from contract_base import TOLERANCE as CONTRACT_TOLERANCE  # noqa: E402

from parity import backends as parity_backends  # noqa: E402
from parity.__main__ import main  # noqa: E402
from parity.backends import Backend, Case, Environment, static_reason  # noqa: E402
from parity.runners import relative_error  # noqa: E402


def _report(out_dir) -> dict:
    return json.loads((out_dir / "parity.json").read_text())


def test_quick_parity_passes(tmp_path):
    """CI runs the --quick matrix: every available backend agrees with the oracle and each other."""
    assert main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    report = _report(tmp_path)
    assert report["complete"] and report["failures"] == 0
    assert set(report["backends"]) == set(parity_backends.BACKENDS)
    measured = [c for c in report["cells"] if c["status"] == "pass"]
    ran = {c["backend"] for c in measured}
    assert {"torch-reference", "jax-xla"} <= ran
    n_cases = 3 * 3  # layouts x families at one dtype and one head config
    for name in ("torch-reference", "jax-xla"):
        cells = [c for c in measured if c["backend"] == name]
        assert len(cells) == 4 * n_cases, f"{name}: out, dq, dk, dv of every case"
        # held to the contract's tolerance of the cell's dtype (the tests' own table), not a looser one
        assert all(c["tolerance"] == CONTRACT_TOLERANCE[c["case"]["dtype"]] and 0 <= c["error"] < c["tolerance"]
                   for c in cells)
    assert report["cross"], "backends were compared with each other"
    for c in report["cells"]:
        if c["status"] == "unavailable":
            assert c["reason"], "an unavailable cell says why"
    markdown = (tmp_path / "parity.md").read_text()
    assert "| backend | dtype | cases | out | dq | dk | dv | cross | result |" in markdown
    assert "PASS" in markdown


def _load_dropped_route():
    """The torch reference with each row's first route removed (one-route rows become empty)."""
    from qsa_torch import reference_sparse_gqa_attention
    from qsa_torch.routes import normalize_routes

    def dropped(query, key, value, routes, scale):
        canonical = normalize_routes(routes, key.shape[1])  # invalid and repeated IDs are -1
        valid = canonical >= 0
        first = valid & (valid.cumsum(-1) == 1)
        return reference_sparse_gqa_attention(query, key, value, canonical.masked_fill(first, -1), scale)

    return dropped


def _load_nan_backend():
    """The torch reference with NaN in the first query row."""
    import torch

    from qsa_torch import reference_sparse_gqa_attention

    def poisoned(query, key, value, routes, scale):
        out = reference_sparse_gqa_attention(query, key, value, routes, scale)
        return torch.cat([torch.full_like(out[:, :1], float("nan")), out[:, 1:]], dim=1)

    return poisoned


def _load_missing_module():
    import qsa_torch.no_such_backend  # noqa: F401


def _load_crashing():
    def crash(*args):
        raise RuntimeError("kernel exploded")

    return crash


def _load_refusing():
    def refuse(q, k, v, routes, scale):
        raise NotImplementedError("refused a case its static checks accept")

    return refuse


def _load_scale_ignoring():
    from qsa_torch import reference_sparse_gqa_attention

    return lambda q, k, v, routes, scale: reference_sparse_gqa_attention(q, k, v, routes)


def test_a_perturbed_backend_is_reported_failing(tmp_path, monkeypatch):
    """Drop one route per row in one backend: its cells fail, the exit status is 1,
    and the honest backend still passes; NaN outputs and crashes fail too, while a
    backend that cannot be imported is only 'unavailable'."""
    for name, loader in (("dropped-route", _load_dropped_route), ("nan-output", _load_nan_backend),
                         ("crashing", _load_crashing), ("not-installed", _load_missing_module),
                         ("refusing", _load_refusing), ("scale-ignoring", _load_scale_ignoring)):
        monkeypatch.setitem(parity_backends.BACKENDS, name, Backend(name, "torch", loader))
    argv = ["--quick", "--layouts", "packed,cp", "--families", "qsa,adversarial",
            "--backends", "torch-reference,dropped-route,nan-output,crashing,not-installed,"
                          "refusing,scale-ignoring",
            "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 1
    report = _report(tmp_path)
    cells = report["cells"]

    def statuses(backend, quantity=None):
        return {c["status"] for c in cells
                if c["backend"] == backend and quantity in (None, c["quantity"])}

    assert statuses("torch-reference") == {"pass"}
    assert statuses("dropped-route", "out") == {"fail"}
    dropped = [c for c in cells if c["backend"] == "dropped-route" and c["quantity"] == "out"]
    assert all(c["error"] > 100 * c["tolerance"] for c in dropped)
    assert statuses("nan-output", "out") == {"fail"}
    assert all(c["error"] == float("inf") for c in cells
               if c["backend"] == "nan-output" and c["quantity"] == "out")
    assert statuses("crashing") == {"error"}
    assert all("kernel exploded" in c["reason"] for c in cells if c["backend"] == "crashing")
    assert statuses("refusing") == {"error"}
    assert statuses("scale-ignoring", "out") == {"fail"}
    assert statuses("not-installed") == {"unavailable"}
    assert "ModuleNotFoundError" in report["backends"]["not-installed"]["reason"]
    cross = {(x["first"], x["second"], x["status"]) for x in report["cross"]
             if x["quantity"] == "out"}
    assert ("torch-reference", "dropped-route", "fail") in cross
    markdown = (tmp_path / "parity.md").read_text()
    assert "FAIL" in markdown and "dropped-route" in markdown.split("## Failures")[1]


def test_relative_error_matches_the_numpy_rule():
    import torch

    from qsa_common.oracle import relative_error as numpy_rule

    rng = np.random.default_rng()
    a, b = rng.standard_normal((2, 5, 3, 4))
    assert relative_error(torch.from_numpy(a).float(), torch.from_numpy(b)) == pytest.approx(
        numpy_rule(a.astype(np.float32), b), rel=1e-12)
    a[0, 0, 0] = np.nan
    assert relative_error(torch.from_numpy(a), torch.from_numpy(b)) == float("inf")
    zero = torch.zeros(3, dtype=torch.float64)
    assert relative_error(torch.ones(3), zero) == pytest.approx(3 ** 0.5)


def _case(**kw):
    base = dict(layout="packed", family="qsa", dtype="bfloat16", heads=(24, 2), head_dim=256,
                batch=1, query_length=8192, kv_length=8192, width=2052)
    return Case(**{**base, **kw})


def test_static_availability_rules():
    backends = parity_backends.BACKENDS
    cpu = Environment("cpu", None, "cpu", False)
    h200 = Environment("cuda", (9, 0), "gpu", False)
    blackwell = Environment("cuda", (10, 0), "gpu", False)
    assert "SM90" in static_reason(backends["fa4"], cpu, _case())
    assert static_reason(backends["fa4"], h200, _case()) is None
    assert "bfloat16" in static_reason(backends["fa4"], h200, _case(dtype="float32"))
    assert "Blackwell" in static_reason(backends["cudnn"], h200, _case())
    assert static_reason(backends["cudnn"], blackwell, _case()) is None
    assert "QSA-format" in static_reason(backends["cudnn"], blackwell, _case(family="random"))
    assert "context-parallel" in static_reason(backends["cudnn"], blackwell,
                                               _case(layout="cp", query_length=4096))
    assert "GPU" in static_reason(backends["jax-pallas"], cpu, _case())
    assert static_reason(backends["jax-pallas"], h200, _case()) is None
    assert "small CPU shapes" in static_reason(backends["jax-pallas-interpret"], h200, _case())
    assert "TRITON_INTERPRET" in static_reason(backends["triton"], cpu, _case(query_length=8))
    assert static_reason(backends["torch-reference"], cpu, _case(dtype="float32")) is None


def test_cli_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        main(["--backends", "torch-reference,warp-drive"])
    assert "warp-drive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--heads", "5:2"])


def test_layers_section_reports_passes_failures_and_a_missing_upstream(tmp_path, monkeypatch, capsys):
    """``--layers`` runs the layer cases (here one small padded case), writes layers.md and
    layers.json and exits 0; a failing case exits 1; without the upstream package the
    section says why and nothing fails."""
    pytest.importorskip("nemo_automodel.components.models.qwen3_8_flash_next.layers",
                        reason="needs the upstream extra (nemo-automodel==0.7.0)")
    from parity import layers

    monkeypatch.setattr(layers, "default_cases",
                        lambda *a, **k: [layers.LayerCase("padded", "float32", "noise", 64, (64, 37))])
    argv = ["--layers", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "layers.json").read_text())
    assert report["failures"] == 0 and [c["pass"] for c in report["cases"]] == [True]
    case = report["cases"][0]
    assert case["routes"]["unexplained"] == 0 and case["routes"]["rows"] == 64 + 37
    markdown = (tmp_path / "layers.md").read_text()
    assert "| case | rows | identical | ties | rounding | unexplained |" in markdown and "PASS" in markdown
    assert "small/padded/float32/noise/S=64" in capsys.readouterr().out

    monkeypatch.setattr(layers, "run_case", lambda case, seed, **kw: {
        "case": {}, "label": case.label(), "seed": seed, "pass": False, "error": "RuntimeError: kernel exploded"})
    assert main(argv) == 1
    assert "FAIL: RuntimeError: kernel exploded" in (tmp_path / "layers.md").read_text()

    monkeypatch.setattr(layers, "upstream_missing", lambda: "nemo-automodel is not importable")
    assert main(argv) == 0
    assert "unavailable: nemo-automodel is not importable" in (tmp_path / "layers.md").read_text()


# ------------------------------------------------------------------ the benchmark
def _record(backend, framework, seq_len, **kw):
    return {"backend": backend, "framework": framework, "shape": f"S={seq_len}", "seq_len": seq_len,
            "heads": [24, 2], "family": "-" if "dense" in backend else "qsa", "head_dim": 256,
            "dtype": "bfloat16", "status": "ok", **kw}


def test_bench_tflops_ratio_and_outputs(tmp_path):
    from parity import bench

    records = [
        _record("torch-dense-sdpa", "torch", 8192, fwd_ms=2.0, fwdbwd_ms=8.0, fwdbwd_peak_bytes=2**31),
        _record("jax-dense-cudnn", "jax", 8192, fwd_ms=4.0, fwdbwd_ms=10.0),
        _record("triton", "torch", 8192, sum_routes=10**6, fwd_ms=1.0, fwdbwd_ms=2.0),
        _record("jax-pallas", "jax", 8192, sum_routes=10**6, fwd_ms=1.0, fwdbwd_ms=5.0),
        _record("flex", "torch", 32768, status="oom", reason="OutOfMemoryError"),
    ]
    rows = {r["backend"]: r for r in bench._enrich(records)}
    flops = 4.0 * 10**6 * 24 * 256
    assert rows["triton"]["fwd_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert rows["triton"]["fwdbwd_tflops"] == pytest.approx(3.5 * flops / 2e-3 / 1e12)
    assert rows["triton"]["fwd_vs_dense"] == pytest.approx(0.5)  # torch backend vs torch dense
    assert rows["jax-pallas"]["fwdbwd_vs_dense"] == pytest.approx(0.5)  # JAX vs JAX dense
    dense_flops = 4.0 * 8192 * 8193 / 2 * 24 * 256
    assert rows["torch-dense-sdpa"]["fwd_tflops"] == pytest.approx(dense_flops / 2e-3 / 1e12)
    assert "fwd_tflops" not in rows["flex"]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{cut")
    report = bench._write_outputs(str(tmp_path), {"command": "test", "head_dim": 256, "top_k": 512,
                                                  "dtype": "bfloat16"})
    assert len(report["rows"]) == len(records), "a truncated last line is ignored"
    markdown = (tmp_path / "bench.md").read_text()
    assert "| 8192 | 24:2 | qsa | triton | 1.00 |" in markdown
    assert "oom: OutOfMemoryError" in markdown
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench.json").read_text())["results"][2]["backend"] == "triton"


def test_bench_worker_is_killed_and_its_shapes_recorded(tmp_path):
    import argparse
    import sys

    from parity import bench

    status = bench._run_worker([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                               str(tmp_path), timeout=1.0)
    assert status.startswith("killed")
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_record("triton", "torch", 64, shape="S=64/24:2/qsa")) + "\n")
    shapes = [bench.Shape(64, (24, 2), "qsa"), bench.Shape(128, (24, 2), "qsa")]
    args = argparse.Namespace(head_dim=256, dtype="bfloat16")
    bench._mark_missing(str(results), "triton", shapes, args, "not run", f"worker {status}")
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert [(x["seq_len"], x["status"]) for x in lines] == [(64, "ok"), (128, "not run")]


def test_bench_end_to_end_on_cpu(tmp_path):
    """Two torch backends in worker subprocesses on tiny shapes: results, table and plot."""
    from parity import bench

    out = tmp_path / "bench"
    argv = ["--seq-lens", "32,64", "--heads", "4:2", "--head-dim", "16", "--top-k", "2",
            "--families", "qsa", "--backends", "torch-dense-sdpa,torch-reference",
            "--time-budget", "120", "--out", str(out), "--cache-dir", str(tmp_path / "routes")]
    assert bench.main(argv) == 0
    rows = json.loads((out / "bench.json").read_text())["results"]
    ok = {(r["backend"], r["seq_len"]) for r in rows if r["status"] == "ok"}
    assert {("torch-dense-sdpa", 32), ("torch-dense-sdpa", 64), ("torch-reference", 32),
            ("torch-reference", 64)} <= ok
    reference = [r for r in rows if r["backend"] == "torch-reference"]
    assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["sum_routes"] > 0 for r in reference)
    assert all("fwd_vs_dense" in r for r in reference)
    assert (out / "bench.png").exists() and "torch-reference" in (out / "bench.md").read_text()
