"""What a backward whose programs own K/V tiles would pay, beside today's row-owning one (CPU).

    python3 scripts/key_tile_inflation.py --seq-len 32768 --overlaps 0.3 0.6 0.8 0.9

The benchmark's QSA routes (``parity.bench_routes``' top_k 512 routes at seed S, the ones
``python -m parity.bench`` times at S) at each adjacent-row Jaccard J:
:func:`qsa_common.route_stats.key_tile_inflation` for tiles of 16 / 32 / 64 / 128 K/V rows
(a K/V-owning program gathers the query rows routing into its tile and multiplies each
against every key of it: wgmma's M of 64 makes 64 the smallest tile a Hopper kernel fills),
and :func:`~qsa_common.route_stats.union_inflation` of the shipped flat programs of 128
(row, head) pairs at (24, 2). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from parity.bench_routes import _make_routes, overlap_label  # noqa: E402
from qsa_common.route_stats import FLAT_128, key_tile_inflation, mean_adjacent_jaccard, union_inflation  # noqa: E402

TILES = (16, 32, 64, 128)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--overlaps", type=float, nargs="+", default=[0.3, 0.6, 0.8, 0.9])
    parser.add_argument("--group", type=int, default=12, help="G = Hq / Hkv of the row-owning column")
    args = parser.parse_args(argv)
    print(f"S={args.seq_len}, top_k 512, QSA routes; K/V tiles of T rows; flat 128 pairs at G={args.group}\n")
    print("| J target | J measured | " + " | ".join(f"K/V tile {t}" for t in TILES) + " | row-owning flat 128 |")
    print("|---" * (len(TILES) + 3) + "|")
    for overlap in args.overlaps:
        t0 = time.time()
        routes = _make_routes(args.seq_len, overlap_label(overlap), 512, args.seq_len)  # parity.bench's seed at S
        jaccard = mean_adjacent_jaccard(routes, args.seq_len)
        keys = [key_tile_inflation(routes, args.seq_len, keys_per_tile=t) for t in TILES]
        rows = union_inflation(routes, args.seq_len, group=args.group, tiling=FLAT_128)
        print(f"| {overlap} | {jaccard:.2f} | " + " | ".join(f"{k:.2f}" for k in keys) + f" | {rows:.2f} |",
              f"<!-- {time.time() - t0:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
