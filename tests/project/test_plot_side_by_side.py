"""scripts/plot_side_by_side.py: the side-by-side plot is drawn from docs/results.md's table, cell by cell."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import plot_side_by_side

    return plot_side_by_side


TABLE = """text before

| replace-one ε (δ 1e-5) | fl-dp-flower, every client every round (lr) | Opacus DP-SGD (lr) | sampled, secret sample (q) |
|---|---|---|---|
| 0.5 | **0.523 ± 0.009** (lr 1) | 0.498 ± 0.024 (lr 0.5) | not run (time) |
| 2 | 0.821 ± 0.019 (lr 2) | 0.825 ± 0.008 (lr 1) | **0.838 ± 0.007** (q 0.25): at least |

after
"""


def test_each_method_column_becomes_a_curve_of_its_cells_means_and_sds(script):
    curves = script.table_curves(TABLE)
    assert curves["fl-dp-flower, every client every round"] == ([0.5, 2.0], [0.523, 0.821], [0.009, 0.019])
    assert curves["Opacus DP-SGD"] == ([0.5, 2.0], [0.498, 0.825], [0.024, 0.008])
    # "not run" is left out, not drawn as a zero
    assert curves["fl-dp-flower, sampled clients (secret sample)"] == ([2.0], [0.838], [0.007])


def test_an_unknown_column_or_a_missing_table_is_refused_by_name(script):
    with pytest.raises(SystemExit, match="unknown method column 'Someone else"):
        script.table_curves(TABLE.replace("Opacus DP-SGD (lr)", "Someone else (lr)"))
    with pytest.raises(SystemExit, match="no table headed"):
        script.table_curves("no table here")


def test_the_results_table_yields_every_column_and_the_plot_is_written(script, tmp_path):
    """The committed table parses (so docs/images/side-by-side.png can be redrawn from it) and draws."""
    from fl_dp_flower.reporting.plot import plot_accuracy_against_epsilon

    curves = script.table_curves((ROOT / "docs" / "results.md").read_text())
    assert set(curves) == {script.METHOD_COLUMNS[m][1] for m in ("package", "opacus", "sampled")}
    for eps, means, sds in curves.values():
        assert len(eps) >= 4 and all(0 < m < 1 for m in means) and all(0 <= s < 0.1 for s in sds)
    path = plot_accuracy_against_epsilon(curves, tmp_path / "x.png", xlabel="x", ylabel="y", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
