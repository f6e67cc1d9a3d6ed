"""scripts/gpu/run.sh, the GPU runner, on the CPU: its syntax, its phases' commands (dry run)
and what they name: every script, test file and parity.bench flag exists, and nothing outside
the repository is needed beyond the documented environment variables."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "scripts", "gpu", "run.sh")
PHASES = ("check", "bench", "lowoverlap", "layer", "soak")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args, env=None, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QSA_")} | (env or {})
    return subprocess.run(["bash", RUNNER, *args], capture_output=True, text=True, env=env, timeout=60, **kw)


def _dry(phase: str, tmp_path) -> list[list[str]]:
    """The commands of ``phase``, parsed back from the dry run's lines."""
    done = _run(phase, env={"QSA_DRY_RUN": "1", "OUT": str(tmp_path / "out")}, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    commands = []
    for line in done.stdout.splitlines():
        match = re.match(rf"\[{phase}\] (\w+) \(limit (\d+)s\): (.*)$", line)
        assert match, line
        assert 0 < int(match.group(2)) <= 600
        commands.append(shlex.split(match.group(3)))
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    return commands


def test_runner_syntax():
    assert subprocess.run(["bash", "-n", RUNNER]).returncode == 0


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_names_existing_files(phase, tmp_path):
    commands = _dry(phase, tmp_path)
    assert commands
    out = str(tmp_path / "out" / phase)
    for argv in commands:
        for arg in argv:
            if re.match(r"(scripts|tests)/", arg):
                assert os.path.isfile(os.path.join(ROOT, arg)), arg
            if arg.startswith("/") and not arg.startswith(out):
                pytest.fail(f"{phase}: {arg} is outside the repository and $OUT")
        if argv[:3] == ["python3", "-m", "parity.bench"]:
            from parity import bench

            bench._parse(argv[3:])  # the flags exist and parse


def test_all_runs_every_phase_in_order(tmp_path):
    done = _run("all", env={"QSA_DRY_RUN": "1", "OUT": str(tmp_path)})
    phases = [re.match(r"\[(\w+)\]", line).group(1) for line in done.stdout.splitlines()]
    assert list(dict.fromkeys(phases)) == list(PHASES)
    done = _run("all", env={"QSA_DRY_RUN": "1", "OUT": str(tmp_path), "QSA_WHEELS": str(tmp_path)})
    assert done.stdout.startswith("[setup] ") and str(tmp_path) in done.stdout.splitlines()[0]


def test_unknown_phase_and_setup_without_wheels_are_refused(tmp_path):
    done = _run("benchmark", env={"QSA_DRY_RUN": "1", "OUT": str(tmp_path)})
    assert done.returncode == 2 and "unknown phase: benchmark" in done.stderr
    done = _run("setup", env={"OUT": str(tmp_path)})
    assert done.returncode == 1 and "QSA_WHEELS" in done.stderr


def test_failed_step_fails_the_run(tmp_path):
    """A step's exit status reaches steps.log and the runner's own status (a stub python)."""
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\nexit 3\n")
    stub.chmod(0o755)
    done = _run("bench", env={"OUT": str(tmp_path / "out"), "PYTHON": str(stub)})
    assert done.returncode == 1
    steps = (tmp_path / "out" / "bench" / "steps.log").read_text()
    assert "FAILED bench_24x2 rc=3" in steps and "FAILED deterministic rc=3" in steps


def test_documented_environment_variables():
    """Every variable the runner reads is in its header and in scripts/README.md."""
    text = open(RUNNER).read()
    header = text.split("\nset -u\n")[0]
    readme = open(os.path.join(ROOT, "scripts", "README.md")).read()
    for name in ("OUT", "QSA_WHEELS", "QSA_SITE", "PYTHON", "QSA_DRY_RUN"):
        assert re.search(rf"\b{name}\b", header) and f"`{name}`" in readme, name
    read = set(re.findall(r"\$\{([A-Z_]+)[:}]", text)) - {"PYTHONPATH", "NCCL_NVLS_ENABLE"}
    assert read <= {"OUT", "QSA_WHEELS", "QSA_SITE", "PYTHON", "QSA_DRY_RUN"}, read
