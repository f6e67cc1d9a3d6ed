"""``python -m parity.bench``'s overlap sweep, route statistics, pieces and report, on
the CPU with fake timings (the GPU numbers come from the H200; see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import numpy as np
import pytest

from parity import bench, bench_report, bench_routes
from qsa_common.route_stats import Tiling, route_stats


def _gpu_script(name: str) -> types.ModuleType:
    """A module of scripts/gpu/ (which the GPU scripts run as a directory on sys.path)."""
    import importlib

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)


# ------------------------------------------------------------------ planning
def test_overlap_sweep_plan():
    args = bench._parse(["--seq-lens", "8192,131072", "--heads", "24:2", "--overlaps", "0.8",
                         "--overlaps-at", "32768=0.3,0.6,0.8,0.9"])
    assert args.seq_lens == (8192, 32768, 131072) and args.families == ()
    assert bench._route_sets(args) == {8192: ["qsa@0.8"], 32768: ["qsa@0.3", "qsa@0.6", "qsa@0.8", "qsa@0.9"],
                                       131072: ["qsa@0.8"]}
    plan = [(s.family, s.seq_len) for s in bench._plan(args)]
    assert plan == [("qsa@0.8", 8192), ("qsa@0.8", 32768), ("qsa@0.8", 131072),
                    ("qsa@0.3", 32768), ("qsa@0.6", 32768), ("qsa@0.9", 32768)]
    default = bench._parse([])
    assert default.families == ("qsa", "random") and bench._route_sets(default)[8192] == ["qsa", "random"]
    both = bench._parse(["--seq-lens", "64", "--families", "qsa,qsa@0.5", "--overlaps", "0.25"])
    assert bench._route_sets(both) == {64: ["qsa", "qsa@0.5", "qsa@0.25"]}


@pytest.mark.parametrize("argv", [
    ["--overlaps", "0.3,1.2"], ["--overlaps", "0"], ["--overlaps", "x"], ["--overlaps-at", "32768"],
    ["--overlaps-at", "big=0.5"], ["--overlaps-at", "64=1"], ["--families", "qsa@2"],
    ["--families", "random@0.5"], ["--families", "zipf"], ["--families", ""],
])
def test_bad_sweep_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench._parse(argv)
    assert "error" in capsys.readouterr().err


def test_route_set_labels():
    assert bench_routes.parse_label("qsa@0.8") == ("qsa", 0.8)
    assert bench_routes.parse_label("random") == ("random", None)
    assert bench_routes.overlap_label(0.30) == "qsa@0.3"
    for bad in ("qsa@", "qsa@1", "random@0.5", "qsa@-0.1"):
        with pytest.raises(ValueError):
            bench_routes.parse_label(bad)


# ------------------------------------------------------------------ route files and statistics
def test_route_files_carry_their_statistics(tmp_path):
    path = bench_routes.routes_path(str(tmp_path), 640, "qsa@0.6", 8, 5)
    assert bench_routes.generate(path, 640, "qsa@0.6", 8, 5, (12,)) == path
    routes = np.load(path)
    assert routes.dtype == np.int32 and routes.shape == (1, 640, 36)
    stats = bench_routes.load_stats(path)
    tilings = [Tiling(**{kind: size}) for kind, size in bench_routes.TILINGS]
    want = route_stats(routes, 640, groups=(12,), tilings=tilings, first_row=4 * 8 + 3)
    assert stats["jaccard"] == pytest.approx(want["jaccard"]) and stats["target"] == 0.6
    assert stats["inflation"]["12"] == pytest.approx(want["inflation"][12])
    assert abs(stats["jaccard"] - 0.6) < 0.1
    # cached: the routes are not made again; a new head group only adds statistics
    stamp = os.stat(path).st_mtime_ns
    bench_routes.generate(path, 640, "qsa@0.6", 8, 5, (12, 1))
    assert os.stat(path).st_mtime_ns == stamp
    assert set(bench_routes.load_stats(path)["inflation"]) == {"12", "1"}
    # a lock left by a process that died is taken over
    other = bench_routes.routes_path(str(tmp_path), 64, "random", 2, 1)
    with open(other + ".lock", "w") as f:
        f.write("999999999")
    bench_routes.generate(other, 64, "random", 2, 1, (2,))
    assert bench_routes.load_stats(other)["target"] is None and not os.path.exists(other + ".lock")


# ------------------------------------------------------------------ backends
def test_jax_triton_shows_unavailable_with_the_reason(monkeypatch):
    shapes = [bench.Shape(64, (24, 2), "qsa@0.8")]
    args = argparse.Namespace(dtype="bfloat16", head_dim=256, top_k=512)
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax_triton" else real(name, *a))
    assert "jax_triton is not installed" in bench._statically_unavailable("jax-triton", shapes, args, (9, 0))
    assert "jax-triton" in bench._bench_backends() and "jax-triton" in bench.PRIORITY

    fake = types.ModuleType("qsa_jax.attention")
    fake.IMPLEMENTATIONS = {"xla": None}
    fake.sparse_gqa_attention = lambda *a, **k: ("called", k)
    monkeypatch.setitem(sys.modules, "qsa_jax.attention", fake)
    with pytest.raises(ImportError, match='implementation="triton"'):
        bench._jax_triton.__wrapped__()
    fake.IMPLEMENTATIONS["triton"] = None
    monkeypatch.setitem(sys.modules, "jax_triton", types.ModuleType("jax_triton"))
    assert bench._jax_triton.__wrapped__()(1, 2) == ("called", {"implementation": "triton"})


class _FakeTimer:
    """Calls the function and reports the milliseconds it returns (fake kernels return them)."""

    def time(self, fn, before=None):
        return float(fn()[0])


def test_triton_pieces_with_and_without_the_split_entry_points(monkeypatch):
    import qsa_torch

    calls = []
    fake = types.ModuleType("qsa_torch.triton_qsa")

    def forward_with_residuals(q, k, v, routes, scale):
        calls.append("unions+forward")
        return 7.0, "lse", "union", "count", "rowbits"

    def backward_from_residuals(do, q, k, v, out, lse, union, count, rowbits, scale, top_k):
        assert (out, lse, union, count, rowbits, top_k) == (7.0, "lse", "union", "count", "rowbits", 12)
        return (20.0,)

    fake.forward_with_residuals = forward_with_residuals
    fake.backward_from_residuals = backward_from_residuals
    monkeypatch.setitem(sys.modules, "qsa_torch.triton_qsa", fake)
    monkeypatch.setattr(qsa_torch, "triton_qsa", fake, raising=False)
    monkeypatch.setattr(bench, "_union_traffic", lambda q, k, count: {"union_ids": count})
    routes = np.zeros((1, 4, 12), dtype=np.int32)
    pieces = bench._triton_pieces(None, None, None, None, routes, 0.5, _FakeTimer(), float("inf"))
    assert pieces["piece_unions_fwd_ms"] == 7.0 and pieces["piece_bwd_ms"] == 20.0
    assert pieces["union_ids"] == "count"  # the forward's union counts
    assert "piece_unions_ms" not in pieces and "timed together" in pieces["pieces_note"]
    fake.route_unions = lambda q, k, routes: (2.5,)
    pieces = bench._triton_pieces(None, None, None, None, routes, 0.5, _FakeTimer(), float("inf"))
    assert pieces["piece_unions_ms"] == 2.5 and pieces["piece_fwd_ms"] == 4.5 and pieces["piece_fwd_by_difference"]
    fake.forward_from_unions = lambda q, k, v, union, count, rowbits, scale, top_k: (4.0,)
    pieces = bench._triton_pieces(None, None, None, None, routes, 0.5, _FakeTimer(), float("inf"))
    assert pieces["piece_fwd_ms"] == 4.0
    assert "piece_fwd_by_difference" not in pieces and "pieces_note" not in pieces


@pytest.mark.parametrize("heads,flat", [((12, 1), True), ((12, 1), False), ((8, 2), False)])
def test_union_traffic_counts_every_programs_gathers(heads, flat, monkeypatch):
    """_union_traffic on real unions (Triton's interpreter): one K and one V row per union ID
    of every program, per KV head, in the inputs' dtype; a flat plan's backward adds a
    [2, D] fp32 block per ID, a padded one's is not counted."""
    pytest.importorskip("triton")
    import torch

    from qsa_common.layouts import make_problem
    from qsa_torch import triton_qsa
    from qsa_triton import BlockSizes, make_plan

    if flat:  # the default configuration's shape (flat programs) at interpreter sizes
        blocks = BlockSizes(block_m=32, block_k=16, backward_block_k=16, flatten_heads=True)
        monkeypatch.setattr(triton_qsa, "default_block_sizes", lambda device, head_dim, dtype: blocks)

    problem = make_problem("padded", "qsa", seed=3, seq_len=48, top_k=4)
    hq, hkv = heads
    q = torch.zeros((problem.routes.shape[0], 48, hq, 32), dtype=torch.bfloat16)
    k = torch.zeros((problem.routes.shape[0], problem.kv_length, hkv, 32), dtype=torch.bfloat16)
    routes = torch.from_numpy(problem.routes)
    union, count, rowbits = triton_qsa.route_unions(q, k, routes)
    traffic = bench._union_traffic(q, k, count)
    ids = int(count.sum()) * hkv
    assert traffic["union_ids"] == ids > 0 and traffic["gather_bytes"] == ids * 2 * 32 * 2
    # every counted ID is a distinct valid route of the program's rows
    assert int((union >= 0).sum()) * hkv == ids
    assert make_plan(hq // hkv, 32, triton_qsa.default_block_sizes(q.device, 32, q.dtype)).flat == flat
    assert ("bwd_add_bytes" in traffic) == flat
    if flat:
        assert traffic["bwd_add_bytes"] == ids * 2 * 32 * 4


# ------------------------------------------------------------------ report
def _row(backend, framework, family="qsa@0.8", seq_len=32768, **kw):
    dense = backend in bench_report.DENSE
    family = "-" if dense else family
    return {"backend": backend, "framework": framework, "shape": f"S={seq_len}/24:2/{family}",
            "seq_len": seq_len, "heads": [24, 2], "family": family, "head_dim": 256, "dtype": "bfloat16",
            "status": "ok", **kw}


def _sweep_records() -> list[dict]:
    records = [_row("torch-dense-sdpa", "torch", fwd_ms=20.0, fwdbwd_ms=100.0),
               _row("jax-dense-cudnn", "jax", fwd_ms=21.0, fwdbwd_ms=102.0)]
    for target, jac, infl, ms in ((0.3, 0.31, 3.3, 80.0), (0.8, 0.80, 1.58, 40.0), (0.9, 0.90, 1.27, 30.0)):
        stats = {"overlap_target": target, "jaccard": jac, "jaccard_all": jac + 0.01,
                 "inflation": {"flat128": infl, "tile8": infl - 0.1}, "sum_routes": 6 * 10**7}
        family = f"qsa@{target}"
        records += [
            _row("triton", "torch", family, fwd_ms=ms / 5, fwdbwd_ms=ms, piece_unions_fwd_ms=ms / 5,
                 piece_unions_ms=ms / 20, piece_fwd_ms=ms / 5 - ms / 20, piece_fwd_by_difference=True,
                 piece_bwd_ms=ms * 0.7, gather_bytes=2 * 10**10, bwd_add_bytes=4 * 10**10, **stats),
            _row("jax-triton", "jax", family, fwd_ms=ms / 5 * 1.02, fwdbwd_ms=ms * 1.04, **stats),
            _row("jax-pallas", "jax", family, fwd_ms=ms / 4, fwdbwd_ms=ms * 1.1, **stats),
        ]
    return records


def test_report_with_fake_timings(tmp_path):
    records = _sweep_records()
    rows = {(r["backend"], r["family"]): r for r in bench_report.enrich(records)}
    triton, jax_triton = rows[("triton", "qsa@0.8")], rows[("jax-triton", "qsa@0.8")]
    flops = 4.0 * 6e7 * 24 * 256
    assert triton["piece_fwd_tflops"] == pytest.approx(flops / ((40 / 5 - 2) * 1e-3) / 1e12)
    assert triton["piece_bwd_tflops"] == pytest.approx(2.5 * flops / (28e-3) / 1e12)
    assert triton["piece_fwd_tbs"] == pytest.approx(2e10 / 6e-3 / 1e12)
    assert triton["piece_bwd_tbs"] == pytest.approx(6e10 / 28e-3 / 1e12)
    assert "piece_fwd_tbs" not in jax_triton
    assert triton["fwdbwd_vs_dense"] == pytest.approx(0.4)  # torch dense
    assert jax_triton["fwdbwd_vs_dense"] == pytest.approx(40 * 1.04 / 102)  # JAX dense
    assert jax_triton["fwdbwd_vs_triton"] == pytest.approx(1.04)
    assert jax_triton["fwd_vs_triton"] == pytest.approx(1.02)
    assert "fwd_vs_triton" not in triton and "fwd_vs_triton" not in rows[("jax-dense-cudnn", "-")]

    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    report = bench_report.write_outputs(str(tmp_path), {"command": "test", "head_dim": 256, "top_k": 512,
                                                        "dtype": "bfloat16"})
    assert "overlap_plot" not in report["meta"] and "plot" not in report["meta"]
    assert (tmp_path / "bench-overlap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "bench.md").read_text()
    assert "| 32768 | 24:2 | qsa@0.8 | triton | 8.00 |" in markdown
    assert "| 0.800 | 1.58 |" in markdown  # J and inflation columns of the main table
    assert "## Per piece" in markdown and "| 2.00 | 6.00 (diff.) |" in markdown
    assert "| 3.33 | 8.00 | 28.00 |" in markdown and "| 2.14 | 40.00 |" in markdown  # TB/s fwd, bwd
    assert "## JAX vs torch Triton" in markdown and "| jax-triton | 8.16 | 1.020 | 41.60 | 1.040 |" in markdown
    assert "| 32768 | qsa@0.3 | 12 | 0.3 | 0.310 | 0.320 |" in markdown
    main_rows = markdown.split("## Per piece")[0].splitlines()
    dense = [line for line in main_rows if "| dense causal |" in line]
    assert len(dense) == len(set(dense)) == 2, dense  # each dense baseline once, not once per route set
    first_sparse = next(i for i, line in enumerate(main_rows) if "| qsa@" in line)
    assert all(main_rows.index(line) < first_sparse for line in dense)  # above the rows it divides


def test_markdown_tables_are_well_formed(tmp_path):
    records = _sweep_records() + [_row("flex", "torch", "qsa@0.8", status="oom", reason="Out|Of|Memory")]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    bench_report.write_outputs(str(tmp_path), {"command": "test", "head_dim": 256, "top_k": 512})
    lines = (tmp_path / "bench.md").read_text().splitlines()
    tables, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            current.append(line.count("|"))
        elif current:
            tables.append(current)
            current = []
    assert len(tables) == 4
    for widths in tables:
        assert len(set(widths)) == 1, widths  # every row has the header's cells


def test_no_overlap_plot_without_a_sweep(tmp_path):
    records = [_row("torch-dense-sdpa", "torch", fwd_ms=2.0, fwdbwd_ms=8.0, seq_len=8192),
               _row("triton", "torch", "qsa", fwd_ms=1.0, fwdbwd_ms=2.0, seq_len=8192, sum_routes=10**6)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    bench_report.write_outputs(str(tmp_path), {"command": "test", "head_dim": 256, "top_k": 512})
    assert (tmp_path / "bench.png").exists() and not (tmp_path / "bench-overlap.png").exists()
    assert "## Per piece" not in (tmp_path / "bench.md").read_text()


def test_overlap_sweep_end_to_end_on_cpu(tmp_path):
    """Dense and reference torch backends in worker subprocesses on tiny shapes: route sets
    generated with their statistics, measured Jaccard in every row, both plots."""
    out = tmp_path / "bench"
    argv = ["--seq-lens", "96", "--overlaps-at", "160=0.4,0.9", "--families", "qsa", "--heads", "4:2",
            "--head-dim", "16", "--top-k", "4", "--backends", "torch-dense-sdpa,torch-reference",
            "--time-budget", "120", "--out", str(out), "--cache-dir", str(tmp_path / "routes")]
    assert bench.main(argv) == 0
    rows = json.loads((out / "bench.json").read_text())["results"]
    measured = [r for r in rows if r["backend"] == "torch-reference"]
    assert {(r["seq_len"], r["family"]) for r in measured if r["status"] == "ok"} == {
        (96, "qsa"), (160, "qsa"), (160, "qsa@0.4"), (160, "qsa@0.9")}
    for r in measured:
        stats = bench_routes.load_stats(bench_routes.routes_path(str(tmp_path / "routes"), r["seq_len"],
                                                                 r["family"], 4, r["seq_len"]))
        assert r["jaccard"] == stats["jaccard"] and r["inflation"] == stats["inflation"]["2"]
        assert r["fwdbwd_vs_dense"] > 0
    by_family = {r["family"]: r for r in measured if r["seq_len"] == 160}
    assert by_family["qsa@0.4"]["jaccard"] < by_family["qsa@0.9"]["jaccard"]
    assert by_family["qsa@0.4"]["inflation"]["flat128"] > by_family["qsa@0.9"]["inflation"]["flat128"]
    assert (out / "bench.png").exists() and (out / "bench-overlap.png").exists()
    assert "## Route sets" in (out / "bench.md").read_text()


def test_stress_bitwise_dry_run_and_its_mismatch_report(tmp_path):
    """scripts/gpu/stress_bitwise.py end to end on CPU (Triton's interpreter, a tiny case):
    its runs repeat the reference's bits; and a run whose bits differ from the reference in
    one element is reported with the result's name and the position."""
    pytest.importorskip("triton")
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "gpu", "stress_bitwise.py")
    done = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--dry-run"], capture_output=True,
                          text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with open(tmp_path / "stress_bitwise.json") as f:
        (case,) = json.load(f)["cases"]
    assert case["runs"] == 2 and case["mismatch_count"] == 0

    import torch

    stress_bitwise = _gpu_script("stress_bitwise")

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: conftest turned the interpreter on
    stress = stress_bitwise.Case("packed", (4, 2), 0.8, 64, 1, device, False)
    stress.reference["det_dk"] = stress.reference["det_dk"].copy()
    flipped = np.unravel_index(5, stress.reference["det_dk"].shape)
    stress.reference["det_dk"][flipped] ^= 1
    stress.check()
    assert [(m["result"], m["elements"], m["first"]) for m in stress.mismatches] == [("det_dk", 1, [list(flipped)])]


def test_gpu_run_summary_reports_skipped_parts_as_skipped(tmp_path):
    """scripts/gpu/run_parity_and_bench.py's summary: a part its flag skipped reads as
    skipped; a part that ran and left no report reads as missing, with the reason."""
    run = _gpu_script('run_parity_and_bench')

    run.summary(str(tmp_path), {"parity-padded": "exit 0"}, ran_parity=True, ran_bench=False)
    text = (tmp_path / "summary.md").read_text()
    assert "BENCH: skipped (--skip-bench)" in text and "BENCH: no report" not in text
    assert "PARITY: no merged report (FileNotFoundError" in text
    assert "| parity-padded | exit 0 |" in text
    assert json.loads((tmp_path / "summary.json").read_text()) == {"parity-padded": "exit 0"}
    run.summary(str(tmp_path), {}, ran_parity=False, ran_bench=True)
    text = (tmp_path / "summary.md").read_text()
    assert "PARITY: skipped (--skip-parity)" in text and "BENCH: no report (FileNotFoundError" in text
