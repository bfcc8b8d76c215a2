"""Plot point-to-point throughput against message size, ours vs raw gRPC vs gloo, from the CSV
that `bench/transfer.py --csv` writes (the figure in docs/performance.md).

    python bench/plot.py transfer.csv docs/throughput.png
"""

from __future__ import annotations

import argparse
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LABELS = {"ours_s": "ours (Peer.send: frames over gRPC)", "raw_s": "raw gRPC bytes stream",
          "gloo_s": "torch.distributed gloo send/recv"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="rows from bench/transfer.py --csv")
    parser.add_argument("png", help="where to write the plot")
    parser.add_argument("--title", default="Point-to-point throughput on 127.0.0.1 (2 cores)")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{args.csv}: no rows")
    sizes = [int(r["bytes"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in LABELS.items():
        ax.plot(sizes, [s / float(r[key]) / 1e9 for s, r in zip(sizes, rows, strict=True)],
                marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB" for s in sizes])
    ax.set_xlabel("message size (float32 tensor)")
    ax.set_ylabel("throughput, GB/s (1e9 bytes)")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
