"""scripts/ptxas_report.py: ptxas's register, spill and serialization figures for the Hopper
kernels, compiled for sm_90a on this CPU."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from qsa_triton import launch as spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "ptxas_report.py")


def _module():
    spec = importlib.util.spec_from_file_location("ptxas_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_ptxas_reads_registers_spills_and_serialization():
    report = _module()
    text = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized "
            "due to insufficient register resources for the function 'k'\n"
            "ptxas info    : Function properties for k\n"
            "    840 bytes stack frame, 1520 bytes spill stores, 1548 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 4 barriers, 840 bytes cumulative stack size\n")
    assert report.parse_ptxas(text) == {"registers": 168, "stack_frame_bytes": 840, "spill_store_bytes": 1520,
                                        "spill_load_bytes": 1548, "wgmma_serialized": True,
                                        "wgmma_serialized_by": ["C7512"]}
    clean = text.split("\n", 1)[1].replace("840", "48").replace("1520", "64").replace("1548", "76")
    assert report.parse_ptxas(clean)["wgmma_serialized"] is False
    assert report.parse_ptxas(clean)["wgmma_serialized_by"] == []
    # any reason ptxas gives counts, e.g. an accumulator written while its wgmma is in flight
    in_flight = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                 "due to non wgmma instructions defining accumulator registers of a wgmma between start and end of "
                 "the pipeline stage in the function 'k'\n") + clean
    assert report.parse_ptxas(in_flight)["wgmma_serialized_by"] == ["C7515"]
    assert report.parse_ptxas(clean)["spill_load_bytes"] == 76
    with pytest.raises(ValueError, match="no register report"):
        report.parse_ptxas("ptxas fatal   : Unsupported .version 9.4")


def _report(tmp_path, kernels):
    """The script's JSON report of ``kernels`` and its stdout (skips where Triton cannot
    compile for sm_90a)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--kernels", *kernels, "--json", str(out)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=ROOT)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip(f"Triton cannot compile for sm_90a here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_hopper_forward_compiles_and_reports(tmp_path):
    """The tuned Hopper forward compiled for sm_90a with the installed triton and its ptxas:
    the report names its registers (within sm_90's 255), its wgmma and its shared memory
    (Q, three 64-ID K and two V buffers: ~224 KiB), which the launcher's constant states (the
    dispatch reads it)."""
    report, stdout = _report(tmp_path, ["forward"])
    got = report["forward"]
    assert 0 < got["registers"] <= 255 and got["wgmma"] > 0, got
    assert 225_000 < got["shared_bytes"] <= 232_448, got
    assert got["shared_bytes"] == spec.SM90_FORWARD_SHARED, (got, spec.SM90_FORWARD_SHARED)
    assert "forward" in stdout and "registers" in stdout


def test_the_hopper_backward_fits_shared_memory(tmp_path):
    """Both modes of the tuned Hopper backward: shared memory within sm_90's 227 KiB per
    block (Q, dO, one K/V stage, P and dS: ~224 KiB; a gradient block's layout conversion
    through shared memory instead of shuffles would not fit), as the launcher's constant states."""
    report, _ = _report(tmp_path, ["backward", "backward-deterministic"])
    for name in ("backward", "backward-deterministic"):
        got = report[name]
        assert 220_000 < got["shared_bytes"] <= 232_448, (name, got)
        assert got["shared_bytes"] == spec.SM90_BACKWARD_SHARED, (name, got, spec.SM90_BACKWARD_SHARED)
        assert 0 < got["registers"] <= 255 and got["wgmma"] > 0, (name, got)
