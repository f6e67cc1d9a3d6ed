"""Every ```python block of README.md runs as written, each in a fresh interpreter.

A block runs with the repository root on ``PYTHONPATH`` and a temporary directory as
its working directory, and must exit 0. An HTML comment directly above a block,
``<!-- requires: torch jax upstream gpu -->``, names what it needs; a block whose
requirement is missing here is skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!--\s*requires:\s*(?P<req>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)\n```", re.S)
# what each requirement needs: importable modules, or a CUDA GPU
REQUIREMENTS = {
    "torch": ("torch",),
    "jax": ("jax", "flax"),
    "upstream": ("nemo_automodel",),
}


def blocks() -> list[tuple[int, tuple[str, ...], str]]:
    """(line number, requirements, code) of every ```python block of README.md."""
    text = README.read_text()
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code"))
        found.append((line, tuple((match.group("req") or "").split()), match.group("code")))
    return found


def _has_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def missing(requirement: str) -> str | None:
    """Why ``requirement`` is not met here (None when it is)."""
    if requirement == "gpu":
        return None if _has_gpu() else "needs a CUDA GPU"
    if requirement not in REQUIREMENTS:
        return f"unknown requirement {requirement!r} in README.md"
    absent = [m for m in REQUIREMENTS[requirement] if importlib.util.find_spec(m) is None]
    return f"needs the {requirement!r} extra ({', '.join(absent)} not installed)" if absent else None


def test_readme_has_python_blocks():
    assert len(blocks()) >= 4, "README.md should hold the PyTorch, JAX, Flax and NeMo quick starts"


@pytest.mark.parametrize("line, requires, code", [pytest.param(*b, id=f"line{b[0]}") for b in blocks()])
def test_readme_block_runs(line, requires, code, tmp_path):
    for requirement in requires:
        if requirement not in REQUIREMENTS and requirement != "gpu":
            pytest.fail(f"README.md line {line}: unknown requirement {requirement!r}")
        reason = missing(requirement)
        if reason:
            pytest.skip(f"README.md line {line}: {reason}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (f"README.md block at line {line} exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")


def test_missing_requirement_gives_a_reason(monkeypatch):
    monkeypatch.setitem(REQUIREMENTS, "absent", ("a_module_that_is_not_installed",))
    assert "a_module_that_is_not_installed" in missing("absent")
    assert missing("torch") is None or "torch" in missing("torch")
    assert "unknown requirement" in missing("no-such-requirement")
