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
#: each method of ``scripts/side_by_side.py``: (the words its table column's header begins with, its curve's
#: label); both scripts draw with these, whether from RESULT lines or from the table
METHOD_COLUMNS = {"package": ("fl-dp-flower, every client every round", "fl-dp-flower, every client every round"),
                  "sampled": ("sampled, secret sample", "fl-dp-flower, sampled clients (secret sample)"),
                  "opacus": ("Opacus DP-SGD", "Opacus DP-SGD"),
                  "silo": ("cross-silo, Poisson batches", "fl-dp-flower cross-silo, Poisson batches")}
#: the curve of each method column, by the words its header begins with
LABELS = dict(METHOD_COLUMNS.values())
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


def draw(curves: dict[str, tuple[list[float], list[float], list[float]]], path: Path, model: str,
         source: str = "") -> Path:
    """The side-by-side figure of ``curves`` (label: epsilons, means, sds) at ``path``; one set of axis words for
    both scripts."""
    from fl_dp_flower.reporting.plot import plot_accuracy_against_epsilon

    return plot_accuracy_against_epsilon(curves, path, xlabel="replace-one epsilon (delta = 1e-5)",
                                         ylabel="held-out test accuracy (mean ± sd of the seeds)",
                                         title=f"{model} on the MNIST subset (3,600 training images), tuned on "
                                               f"validation{source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results.md")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "side-by-side.png")
    args = parser.parse_args()
    curves = table_curves(args.results.read_text())
    draw(curves, args.plot, "cnn-tanh", " (docs/results.md's table)")
    print(f"wrote {args.plot}: " + "; ".join(f"{k}: {len(v[0])} points" for k, v in curves.items()))


if __name__ == "__main__":
    main()
