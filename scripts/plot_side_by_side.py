"""Draw docs/images/side-by-side.png from the side-by-side table of docs/results.md.

The table is the record: each cell of its method columns begins with the test accuracy "mean ± sd" of three
seeds (``scripts/side_by_side.py`` wrote or merged it from its runs' RESULT lines), and the per-seed logs of
every column are not all kept. So the plot is drawn from the table itself, one curve per method column, and a
cell without "mean ± sd" (e.g. "not run") is left out. Nothing is recomputed.
Run: .venv/bin/python scripts/plot_side_by_side.py [--results docs/results.md] [--plot docs/images/side-by-side.png]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = "| replace-one ε (δ 1e-5) |"
#: the curve of each method column, by the words its header begins with
LABELS = {"fl-dp-flower, every client every round": "fl-dp-flower, every client every round",
          "Opacus DP-SGD": "Opacus DP-SGD",
          "sampled, secret sample": "fl-dp-flower, sampled clients (secret sample)"}
CELL = re.compile(r"^\**(\d\.\d+) ± (\d\.\d+)\**")


def table_curves(markdown: str) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """The (epsilons, means, sds) of each method column of the first table whose header is :data:`HEADER`."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER)), None)
    if start is None:
        raise SystemExit(f"no table headed {HEADER!r} in the results")
    columns = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    labels = []
    for column in columns:
        label = next((v for k, v in LABELS.items() if column.startswith(k)), None)
        if label is None:
            raise SystemExit(f"unknown method column {column[:60]!r}: add it to LABELS")
        labels.append(label)
    curves: dict[str, tuple[list[float], list[float], list[float]]] = {label: ([], [], []) for label in labels}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        epsilon = float(cells[0])
        for label, cell in zip(labels, cells[1:]):
            if found := CELL.match(cell):
                eps, means, sds = curves[label]
                eps.append(epsilon)
                means.append(float(found.group(1)))
                sds.append(float(found.group(2)))
    return {label: curve for label, curve in curves.items() if curve[0]}


def main() -> None:
    from fl_dp_flower.reporting.plot import plot_accuracy_against_epsilon

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results.md")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "side-by-side.png")
    args = parser.parse_args()
    curves = table_curves(args.results.read_text())
    plot_accuracy_against_epsilon(curves, args.plot, xlabel="replace-one epsilon (delta = 1e-5)",
                                  ylabel="held-out test accuracy (mean ± sd of 3 seeds)",
                                  title="cnn-tanh on the MNIST subset (3,600 training images), tuned on validation "
                                        "(docs/results.md's table)")
    print(f"wrote {args.plot}: " + "; ".join(f"{k}: {len(v[0])} points" for k, v in curves.items()))


if __name__ == "__main__":
    main()
