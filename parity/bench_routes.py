"""Route sets of ``python -m parity.bench``: names, the on-disk cache and their statistics.

A route set is named by a label: a route family of :mod:`qsa_common.generators`
(``"qsa"``, ``"random"``) or ``"qsa@J"``, QSA-format routes whose adjacent-row
Jaccard is set to the target J by the generator's ``overlap`` knob. Each (S, label)
is one full-length document (B = 1), generated once per seed into the cache
directory as int32 ``[1, S, 4*top_k+4]`` together with a statistics file
(:func:`qsa_common.route_stats.route_stats`): the measured adjacent-row Jaccard and
the tile-union inflation of the kernels' tilings for every head group G = Hq/Hkv the
run needs. Generation runs in spawned background processes (numpy only) while the
GPU is busy; the statistics file is written last and marks the set as ready.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import numpy as np

__all__ = ["TILINGS", "parse_label", "overlap_label", "routes_path", "stats_path", "generate", "load_stats",
           "pool"]

# Tilings whose union inflation is reported: flat programs of 64/128 (row, head) pairs
# (128: both kernels' default on SM90 at D > 128) and tiles of 8/16/32 rows.
TILINGS = (("pairs", 128), ("pairs", 64), ("rows", 8), ("rows", 16), ("rows", 32))


def parse_label(label: str) -> tuple[str, float | None]:
    """``"qsa@0.8"`` -> ``("qsa", 0.8)``; ``"random"`` -> ``("random", None)``."""
    family, sep, target = label.partition("@")
    if not sep:
        return family, None
    try:
        overlap = float(target)
    except ValueError:
        raise ValueError(f"route set {label!r}: the overlap after '@' must be a number") from None
    if family != "qsa" or not 0.0 < overlap < 1.0:
        raise ValueError(f"route set {label!r}: expected qsa@J with 0 < J < 1")
    return family, overlap


def overlap_label(overlap: float) -> str:
    """The label of QSA-format routes with adjacent-row Jaccard target ``overlap``."""
    label = f"qsa@{overlap:g}"
    parse_label(label)
    return label


def routes_path(cache_dir: str, seq_len: int, label: str, top_k: int, seed: int) -> str:
    return os.path.join(cache_dir, f"routes-S{seq_len}-{label}-k{top_k}-seed{seed}.npy")


def stats_path(path: str) -> str:
    return path[: -len(".npy")] + ".stats.json"


def load_stats(path: str) -> dict:
    """The statistics of the route file ``path`` (see :func:`generate`)."""
    with open(stats_path(path)) as f:
        return json.load(f)


def _has_stats(path: str, groups: tuple[int, ...]) -> bool:
    try:
        stats = load_stats(path)
    except (OSError, ValueError):
        return False
    return all(str(g) in stats.get("inflation", {}) for g in groups)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def generate(path: str, seq_len: int, label: str, top_k: int, seed: int, groups: tuple[int, ...]) -> str:
    """Make the route file ``path`` (one document of ``label`` routes, int32, -1 padding)
    unless it exists, then its statistics for head groups ``groups`` unless present;
    returns ``path``. Another process making the same file is waited for (lock file)."""
    if os.path.exists(path) and _has_stats(path, groups):
        return path
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    except FileExistsError:  # another process makes this file: wait while it is alive
        while not _has_stats(path, groups) and _lock_alive(lock):
            time.sleep(1.0)
        if os.path.exists(path) and _has_stats(path, groups):
            return path
        with contextlib.suppress(FileNotFoundError):  # its maker died: take over
            os.remove(lock)
        return generate(path, seq_len, label, top_k, seed, groups)
    try:
        if os.path.exists(path):
            routes = np.load(path)
        else:
            routes = _make_routes(seq_len, label, top_k, seed)
            tmp = f"{path}.{os.getpid()}.tmp.npy"
            np.save(tmp, routes)
            os.replace(tmp, path)
        _write_json(stats_path(path), _statistics(routes, seq_len, label, top_k, groups))
    finally:
        if os.path.exists(lock):
            os.remove(lock)
    return path


def _make_routes(seq_len: int, label: str, top_k: int, seed: int) -> np.ndarray:
    from qsa_common.layouts import make_problem

    family, overlap = parse_label(label)
    problem = make_problem("padded", family, seed=seed, seq_len=seq_len, top_k=top_k, batch=1,
                           overlap=overlap)
    routes = problem.routes
    return np.where((routes < 0) | (routes >= seq_len), -1, routes).astype(np.int32)


def _statistics(routes: np.ndarray, seq_len: int, label: str, top_k: int, groups: tuple[int, ...]) -> dict:
    """Jaccard over the rows past the QSA identity region (all rows for other families)
    and over all rows; inflation per G and tiling label."""
    from qsa_common.route_stats import Tiling, route_stats

    family, overlap = parse_label(label)
    first_row = min(4 * top_k + 3, seq_len - 1) if family == "qsa" else 0
    tilings = [Tiling(**{kind: size}) for kind, size in TILINGS]
    stats = route_stats(routes, seq_len, groups=groups, tilings=tilings, first_row=first_row)
    def number(x: float) -> float | None:  # JSON has no NaN
        return None if math.isnan(x) else x

    return {"label": label, "target": overlap, "jaccard": number(stats["jaccard"]),
            "jaccard_all": number(stats["jaccard_all"]), "jaccard_first_row": first_row,
            "useful": stats["useful"],
            "inflation": {str(g): {t: number(x) for t, x in values.items()}
                          for g, values in stats["inflation"].items()}}


def _lock_alive(lock: str) -> bool:
    """Whether the process named in ``lock`` still runs."""
    try:
        with open(lock) as f:
            os.kill(int(f.read().strip() or 0), 0)
        return True
    except (OSError, ValueError):  # no lock, no such process, or a half-written lock
        return False


def pool():
    """Processes for route generation (numpy only; spawned, so never a fork of a threaded process)."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(max(1, min(4, (os.cpu_count() or 2) // 2)))
