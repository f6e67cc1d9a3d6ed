"""The docs state today's facts about this repository.

* Every repository path that README.md or docs/ names (in backticks or as a link
  target) exists.
* No prose in README.md, docs/ (raw GPU outputs under docs/gpu-runs aside) or any
  tracked ``.py`` file narrates the work's history: no ordinal sittings, no sittings
  named relative to now, no numbered device calls (the examples are in
  :func:`test_narration_pattern`, spelled in pieces so this file passes its own grep). Dates belong only
  beside a measurement's stamp, which this test does not police.
* docs/benchmarks.md stays under 500 lines and docs/ under 1 MB.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RAW = DOCS / "gpu-runs"

# paths that name outputs written by the tools or places outside the repository
OUTPUT_PREFIXES = ("/", "~", "$", "../shared/", "tmp/", "OUT/", "parity-report/", "bench-report/", "build/",
                   "dist/", ".venv/", "site/")
# files of the upstream package (nemo-automodel) that the docs name by their bare file name
UPSTREAM_FILES = {"qsa.py", "model.py", "backend.py"}
PATH_SUFFIXES = (".py", ".md", ".sh", ".toml")
PATH_CHARS = re.compile(r"^[A-Za-z0-9_.*\-/]+$")

_ORDINAL = (r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth"
            r"|twent[a-z-]*|thirt[a-z-]*|[0-9]+(st|nd|rd|th))")
NARRATION = re.compile(
    r"(" + _ORDINAL + r"\s+(session|sitting)s?"        # an ordinal sitting
    r"|\b(this|last|next|previous)\s+session\b"          # a sitting named relative to now
    r"|\bcall\s+[0-9]+\b"                                # a numbered device call
    r"|\b(eleventh|twelfth|[a-z]+teenth|twentieth|thirtieth"
    r"|(twenty|thirty)-?(first|second|third|[a-z]+th))\b"  # ordinals past ten name sittings here
    r")",
    re.I,
)


def tracked(pattern: str) -> list[Path]:
    """Tracked files matching ``pattern`` (a git pathspec); every file on disk without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob(pattern.lstrip("*/")) if ".venv" not in p.parts]


def doc_files() -> list[Path]:
    """README.md and every markdown file under docs/ except the raw GPU outputs."""
    docs = sorted(p for p in DOCS.rglob("*.md") if RAW not in p.parents)
    return [ROOT / "README.md", *docs]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------ (a) named paths exist
def named_paths(text: str) -> list[tuple[str, bool]]:
    """``(candidate, is_link)`` for every backticked span and link target of ``text``."""
    spans = [(m.group(1), False) for m in re.finditer(r"`([^`\n]+)`", text)]
    links = [(m.group(1), True) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    return spans + links


def looks_like_repo_path(candidate: str) -> bool:
    if "://" in candidate or candidate.startswith(("www.", "mailto:", "#")):
        return False
    if not PATH_CHARS.match(candidate) or "..." in candidate:
        return False
    if candidate.startswith(OUTPUT_PREFIXES) or not re.search(r"[A-Za-z]", candidate):
        return False
    return "/" in candidate or candidate.endswith(PATH_SUFFIXES)


def exists(candidate: str, doc: Path, is_link: bool, names: set[str], files: list[str]) -> bool:
    path = candidate.split("#")[0]
    if not path:
        return True
    if "/" not in path and not is_link:
        # a bare file name: some tracked file of that name (or an upstream file the docs discuss)
        return path in UPSTREAM_FILES or any(fnmatch.fnmatch(n, path) for n in names)
    path = path.rstrip("/")
    bases = [doc.parent] if is_link else [ROOT, doc.parent]
    for base in bases:
        target = (base / path).resolve()
        if not target.is_relative_to(ROOT):
            continue
        rel = str(target.relative_to(ROOT))
        if "*" in rel:
            if any(fnmatch.fnmatch(f, rel) for f in files):
                return True
        elif target.exists():
            return True
    return False


def test_every_named_repository_path_exists():
    files = [_rel(p) for p in tracked("*")]
    names = {Path(f).name for f in files}
    missing = []
    for doc in doc_files():
        for candidate, is_link in named_paths(doc.read_text()):
            if looks_like_repo_path(candidate) and not exists(candidate, doc, is_link, names, files):
                missing.append(f"{_rel(doc)}: {candidate}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize("candidate, expected", [
    ("qsa_torch/api.py", True), ("docs/contract.md", True), ("pyproject.toml", True),
    ("https://example.org/a/b.md", False), ("qsa-kernels[torch]", False), ("torch==2.13.0", False),
    ("make test", False), ("/tmp/out/x.md", False), ("parity-report/parity.md", False), ("1/sqrt(D)", False),
    ("$OUT/bench.json", False), ("jax.numpy", False),
])
def test_path_heuristic(candidate, expected):
    assert looks_like_repo_path(candidate) is expected


# ------------------------------------------------------------------ (b) no history narration
def test_no_history_narration():
    this_file = Path(__file__).resolve()
    sources = doc_files() + [p for p in tracked("*.py") if p.resolve() != this_file]
    hits = []
    for path in sources:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = NARRATION.search(line)
            if match:
                hits.append(f"{_rel(path)}:{number}: {match.group(0)!r}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} lines narrate the work's history:\n" + "\n".join(hits[:60])


@pytest.mark.parametrize("line, narrates", [
    ("2026-12-03, twenty" + "-sixth sess" + "ion, one run", True), ("the Twen" + "tieth Session's figures", True),
    ("measured in this sess" + "ion", True), ("raw s26 outputs of ca" + "ll 3", True),
    ("the nine" + "teenth's inside", True), ("a thi" + "rd sitting", True), ("the 14" + "th session", True),
    ("imported on the first call, never at import", False), ("thirty-two rows per tile", False),
    ("the second row is right-padded", False), ("recall" + " 3 rows", False),
])
def test_narration_pattern(line, narrates):
    assert bool(NARRATION.search(line)) is narrates


# ------------------------------------------------------------------ (c) sizes
def test_benchmarks_page_is_short():
    lines = (DOCS / "benchmarks.md").read_text().count("\n")
    assert lines < 500, f"docs/benchmarks.md has {lines} lines (limit 500): current results only"


def test_docs_directory_is_small():
    # disk usage as `du -s docs` counts it (allocated blocks of files and folders)
    size = sum(p.lstat().st_blocks * 512 for p in [DOCS, *DOCS.rglob("*")])
    assert size < 1_000_000, f"docs/ takes {size / 1e6:.2f} MB on disk (limit 1 MB, as `du -sh docs` shows)"
