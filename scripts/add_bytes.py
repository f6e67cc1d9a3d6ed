"""What the backward adds and multiplies under other program shapes, beside today's (CPU).

    python3 scripts/add_bytes.py --seq-len 32768 --overlaps 0.8 0.3

A row-owning backward adds one [2, D] fp32 block of dK/dV per union entry per program, and
multiplies each union entry against every (row, head) pair of the program. On the
benchmark's QSA routes (``parity.bench_routes``' top_k 512 routes at seed S, the ones
``python -m parity.bench`` times at S), per tiling of
:class:`qsa_common.route_stats.Tiling` at G = 12 ((24, 2) heads): the union inflation
(products per useful product) and the bytes added relative to today's flat programs of 128
pairs (sum over programs of the union's size; ``inflation / matrix rows`` up to a constant).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np  # noqa: E402

from parity.bench_routes import _make_routes, overlap_label  # noqa: E402
from qsa_common.route_stats import FLAT_128, Tiling, mean_adjacent_jaccard, route_stats  # noqa: E402

TILINGS = (FLAT_128, Tiling(pairs=64), Tiling(rows=10), Tiling(pairs=256), Tiling(rows=21))


def _matrix_rows(tiling: Tiling, group: int) -> int:
    return tiling.pairs if tiling.pairs is not None else tiling.rows * group


def table(routes: np.ndarray, kv_length: int, group: int, tilings=TILINGS) -> dict:
    """``{label: (inflation, bytes added relative to the first tiling)}``."""
    inflation = route_stats(routes, kv_length, groups=(group,), tilings=tilings)["inflation"][group]
    base = inflation[tilings[0].label] / _matrix_rows(tilings[0], group)
    return {t.label: (inflation[t.label], inflation[t.label] / _matrix_rows(t, group) / base) for t in tilings}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.8, 0.3])
    parser.add_argument("--group", type=int, default=12, help="G = Hq / Hkv")
    args = parser.parse_args(argv)
    print(f"S={args.seq_len}, top_k 512, QSA routes, G={args.group}: inflation / bytes added (x flat128's)\n")
    print("| J target | J measured | " + " | ".join(t.label for t in TILINGS) + " |")
    print("|---" * (len(TILINGS) + 2) + "|")
    for overlap in args.overlaps:
        routes = _make_routes(args.seq_len, overlap_label(overlap), 512, args.seq_len)  # parity.bench's seed at S
        rows = table(routes, args.seq_len, args.group)
        cells = " | ".join(f"{inf:.2f} / {added:.2f}" for inf, added in rows.values())
        print(f"| {overlap} | {mean_adjacent_jaccard(routes, args.seq_len):.2f} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
