"""scripts/side_by_side.py: both sides are held to the target epsilon, checked against outside references."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    if str(ROOT / "scripts") not in sys.path:  # side_by_side imports plot_side_by_side, as a script would
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("side_by_side", ROOT / "scripts" / "side_by_side.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_opacus_noise_multiplier_is_the_smallest_that_meets_the_target(script, epsilon):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    q, steps = 256 / 4000, 15 * 16
    z = script.opacus_noise_multiplier(epsilon, q, steps)

    def pld_eps(noise: float) -> float:
        acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise)), steps)
        return float(acc.get_epsilon(1e-5))

    assert pld_eps(z) <= epsilon < pld_eps(z * (1 - 2e-3))
    # an upper bound by another construction: the package's own pair (1-q) bottom + q N(2/z, 1)
    # (docs/MATH.md §19.1) dominates replace-one DP-SGD by joint convexity of the hockey-stick divergence
    from fl_dp_flower.privacy.sampled import composed_epsilon

    assert composed_epsilon(q, [2 / z] * steps, 1e-5) >= epsilon


def test_replace_one_means_a_shift_of_two_clip_norms():
    """At q = 1 dp-accounting's REPLACE_ONE Gaussian is mu-GDP with mu = 2 sqrt(T) / z (closed form): replacing
    one example moves the clipped sum by up to 2C, so the calibration counts the full replace-one shift."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from fl_dp_flower.privacy import gdp

    z, steps = 4.0, 10
    acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.GaussianDpEvent(z), steps)
    assert float(acc.get_epsilon(1e-5)) == pytest.approx(gdp.epsilon(2 * math.sqrt(steps) / z, 1e-5), rel=1e-4)


def test_replace_one_costs_more_than_add_remove_for_opacus(script):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    q, steps = 0.064, 240
    z = script.opacus_noise_multiplier(2.0, q, steps)
    acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    assert float(acc.get_epsilon(1e-5)) < 2.0


@pytest.mark.slow
def test_one_tiny_point_of_each_side(script):
    import torch

    torch.set_num_threads(1)
    ours = script.package_point(8.0, rounds=1, seed=1, lr=2.0, model="cnn-tanh")
    assert ours["epsilon"] <= 8.0 * (1 + 1e-6) and ours["epsilon"] > 7.9
    assert 0.0 <= ours["accuracy"] <= 1.0 and ours["epsilon_add_remove"] < ours["epsilon"]
    assert 0.0 <= ours["val_accuracy"] <= 1.0
    sampled = script.package_point(8.0, rounds=2, seed=1, lr=2.0, model="cnn-tanh", q=0.25)  # amplified bound
    # planned at floor(q N) contributors a round; the run charges the Poisson count that arrived (about q N)
    assert 7.5 < sampled["epsilon"] < 8.5 and 0.0 <= sampled["accuracy"] <= 1.0
    silo = script.silo_point(8.0, rounds=2, seed=1, lr=1.0, model="cnn-tanh")  # batch_sampled bound, calibrated
    assert 7.9 < silo["epsilon"] <= 8.0 * (1 + 1e-6) and silo["epsilon_add_remove"] < silo["epsilon"]
    theirs = script.opacus_point(8.0, seed=1, batch=256, epochs=1, lr=1.0, model_name="cnn-tanh")
    assert theirs["epsilon"] == 8.0 and 0.0 < theirs["epsilon_add_remove"] < 8.0
    assert theirs["accuracy"] > 0.2 and theirs["val_accuracy"] > 0.2  # one private epoch at eps 8 learns something
    assert math.isfinite(theirs["noise"]) and theirs["noise"] > 0


def test_opacus_lr_and_length_are_chosen_on_validation_never_on_test(script, monkeypatch):
    """The (lr, epochs) with the best validation accuracy win, even where another has the best test accuracy."""
    calls = []
    val = {(0.5, 2): 0.2, (0.5, 5): 0.3, (1.0, 2): 0.1, (1.0, 5): 0.8}
    test = {(0.5, 2): 0.9, (0.5, 5): 0.1, (1.0, 2): 0.95, (1.0, 5): 0.2}

    def fake_point(epsilon, seed, batch, epochs, lr, model_name):
        calls.append((seed, lr, epochs, model_name))
        return {"accuracy": test[lr, epochs], "val_accuracy": val[lr, epochs], "epochs": epochs, "lr": lr}

    monkeypatch.setattr(script, "opacus_point", fake_point)
    runs = script.opacus_runs(1.0, 3, 256, [2, 5], [0.5, 1.0], "cnn-tanh")
    assert [(r["lr"], r["epochs"]) for r in runs] == [(1.0, 5)] * 3
    assert calls == [(1, 0.5, 2, "cnn-tanh"), (1, 0.5, 5, "cnn-tanh"), (1, 1.0, 2, "cnn-tanh"), (1, 1.0, 5, "cnn-tanh"),
                     (2, 1.0, 5, "cnn-tanh"), (3, 1.0, 5, "cnn-tanh")]


def test_package_rounds_and_lr_are_chosen_on_validation_never_on_test(script, monkeypatch):
    """As Opacus its epochs, the package searches its rounds with its lr (sigma calibrated per length)."""
    calls = []
    val = {(1.0, 20): 0.2, (2.0, 20): 0.8, (1.0, 40): 0.3, (2.0, 40): 0.1}
    test = {(1.0, 20): 0.9, (2.0, 20): 0.1, (1.0, 40): 0.95, (2.0, 40): 0.2}

    def fake_point(epsilon, seed, lr, rounds, model, q=1.0, secrecy="public"):
        calls.append((seed, lr, rounds, q, secrecy))
        return {"accuracy": test[lr, rounds], "val_accuracy": val[lr, rounds], "lr": lr, "rounds": rounds}

    monkeypatch.setattr(script, "package_point", fake_point)
    runs = script.package_runs(1.0, 3, [20, 40], [1.0, 2.0], "cnn-tanh")
    assert [(r["lr"], r["rounds"]) for r in runs] == [(2.0, 20)] * 3
    assert calls == [(1, 1.0, 20, 1.0, "public"), (1, 2.0, 20, 1.0, "public"), (1, 1.0, 40, 1.0, "public"),
                     (1, 2.0, 40, 1.0, "public"), (2, 2.0, 20, 1.0, "public"), (3, 2.0, 20, 1.0, "public")]
    calls.clear()  # the sampled column (another model): the same search over its grid, at its rates and secrecy
    grid = script.sampled_grid(["0.1", "0.25@40@2"], [40], [1.0, 2.0], [1.0])
    sampled = script.package_runs(1.0, 2, [], [], "cnn-tanh", "secret", grid)
    assert [(r["lr"], r["rounds"]) for r in sampled] == [(1.0, 40)] * 2
    assert calls == [(1, 1.0, 40, 0.1, "secret"), (1, 2.0, 40, 0.1, "secret"), (1, 2.0, 40, 0.25, "secret"),
                     (2, 1.0, 40, 0.1, "secret")]
    with pytest.raises(SystemExit, match="server-lr-ends"):  # only the secret cnn-tanh column searches the step
        script.package_runs(1.0, 2, [], [], "cnn-tanh", "public", script.sampled_grid(["0.1"], [40], [1.0], [0.5]))


def test_table_and_plot_from_the_result_lines_of_split_logs(script, tmp_path):
    """Runs split over epsilons merge through their RESULT lines into one table and one plot."""
    import json

    def line(epsilon, method, accs, **extra):
        points = [{"accuracy": a, "epsilon": epsilon, "epsilon_add_remove": epsilon / 2, "lr": 2.0, **extra} for a in accs]
        return script.RESULT + json.dumps({"epsilon": epsilon, "method": method, "points": points})

    (tmp_path / "a.log").write_text("noise\n" + line(1.0, "package", [0.6, 0.7, 0.8], rounds=20) + "\n"
                                    + line(1.0, "opacus", [0.5, 0.5, 0.5], epochs=5) + "\n")
    (tmp_path / "b.log").write_text(line(4.0, "sampled", [0.9, 0.8]) + "\n" + line(4.0, "silo", [0.88, 0.86]) + "\n")
    results = script.read_results([tmp_path / "a.log", tmp_path / "b.log"])
    assert [r["method"] for r in results] == ["package", "opacus", "sampled", "silo"]
    rows = script.table(results, 60, 120, 0.25).splitlines()
    assert rows[2] == "| 1 | 0.700 ± 0.100 (lr 2, 20 rounds; 0.5) | not run | 0.500 ± 0.000 (lr 2, 5; 0.5) | not run |"
    # a log without the rounds (before the rounds search) shows the run's one --rounds / --sampled-rounds
    # and the sampled column's one rate (the table's q) with the plain server step; its certified epsilon by seed
    assert rows[3] == ("| 4 | not run | 0.850 ± 0.071 (q 0.25, plain step, lr 2, 120 rounds; 4.0000 / 4.0000) | not run | "
                       "0.870 ± 0.014 (lr 2; 2) |")
    script.plot(results, tmp_path / "p.png", "cnn-tanh")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # the table this script writes is what scripts/plot_side_by_side.py reads: one label per method either way
    import plot_side_by_side

    curves = plot_side_by_side.table_curves(script.table(results, 60, 120, 0.25))
    assert curves == {script.METHODS["package"]: ([1.0], [0.7], [0.1]), script.METHODS["opacus"]: ([1.0], [0.5], [0.0]),
                      script.METHODS["sampled"]: ([4.0], [0.85], [0.071]), script.METHODS["silo"]: ([4.0], [0.87], [0.014])}


def test_sampled_column_runs_once_per_setting_and_chooses_the_release_on_validation(script, monkeypatch, tmp_path):
    """The secret sampled column: one search run per (seed, lr, rounds) serves every release replayed from its
    iterates; (rounds, lr, release) are chosen on seed 1's validation accuracy, never on test."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import cross_device_sweep

    calls = []
    val = {(0.5, "ema:0.8"): 0.80, (0.5, "none"): 0.85, (1, "ema:0.8"): 0.70, (1, "none"): 0.60}
    test = {(0.5, "ema:0.8"): 0.99, (0.5, "none"): 0.90, (1, "ema:0.8"): 0.98, (1, "none"): 0.97}

    def fake_search_run(out, overrides, seed, validation, epsilon, releases):
        calls.append((seed, overrides, validation, epsilon))
        lr = overrides["lr"]
        return {"sigma": 0.1, "epsilon": epsilon - 0.01, "seconds": 1.0, "epsilon_add_remove": epsilon - 0.01,
                "finals": {r: {"val": val[lr, r] - seed / 100, "test": test[lr, r] - seed / 100} for r in releases}}

    monkeypatch.setattr(cross_device_sweep, "search_run", fake_search_run)
    runs = script.sampled_runs(2.0, 3, script.sampled_grid(["0.1"], [250], [0.5, 1.0], [1.0]), ["ema:0.8", "none"],
                               tmp_path)
    assert [(r["lr"], r["rounds"], r["release"]) for r in runs] == [(0.5, 250, "none")] * 3
    assert [r["accuracy"] for r in runs] == pytest.approx([0.89, 0.88, 0.87])
    # lr 1.0 names the run as the sweep's --set lr=1 (with the same server step); q 0.1 is the preset's own rate
    step = script.SAMPLED_SERVER_STEP  # the frontier's plain aggregate, not the preset's decaying server step
    assert step == {"server-optimizer": "none", "server-lr-end": 1.0}
    assert calls == [(1, {"lr": 0.5, "num-server-rounds": 250, **step}, 0.1, 2.0),
                     (1, {"lr": 1, "num-server-rounds": 250, **step}, 0.1, 2.0),
                     (2, {"lr": 0.5, "num-server-rounds": 250, **step}, 0.1, 2.0),
                     (3, {"lr": 0.5, "num-server-rounds": 250, **step}, 0.1, 2.0)]
    row = script.table([script.result(2.0, "sampled", runs)], 60, 250, 0.1).splitlines()[2]
    assert row == ("| 2 | not run | 0.880 ± 0.010 (q 0.1, plain step, lr 0.5, 250 rounds, none; 1.9900 / 1.9900 / 1.9900) "
                   "| not run | not run |")
    calls.clear()  # a margin plans sigma a little below the target (the Poisson counts may certify above the plan)
    script.sampled_runs(2.0, 1, script.sampled_grid(["0.1"], [250], [0.5], [1.0]), ["none"], tmp_path, margin=0.01)
    assert calls == [(1, {"lr": 0.5, "num-server-rounds": 250, **step}, 0.1, pytest.approx(1.98))]


def test_sampled_column_searches_the_rate_and_the_server_step_on_validation(script, monkeypatch, tmp_path):
    """q and the server step are search axes as (rounds, lr, release): each rate with its own rounds and lrs, every
    server step named by all its run-config keys (a decaying step: the cross-device preset's, momentum 0), the
    winner chosen on seed 1's validation accuracy and named in its table cell."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import cross_device_sweep

    calls = []
    val = {(0.1, 1.0): 0.70, (0.25, 1.0): 0.72, (0.25, 0.25): 0.75, (0.5, 1.0): 0.74, (0.5, 0.25): 0.73}

    def fake_search_run(out, overrides, seed, validation, epsilon, releases):
        calls.append((seed, overrides))
        key = (overrides.get("sampling-rate", 0.1), overrides["server-lr-end"])
        return {"sigma": 0.1, "epsilon": epsilon, "seconds": 1.0, "epsilon_add_remove": epsilon,
                "finals": {r: {"val": val[key], "test": 1 - val[key]} for r in releases}}

    monkeypatch.setattr(cross_device_sweep, "search_run", fake_search_run)
    grid = script.sampled_grid(["0.1@250@0.75@1", "0.25@250", "0.5@150@1.5"], [100], [1.0], [1.0, 0.25])
    assert [(s["q"], s["rounds"], s["lr"], s["server_lr_end"]) for s in grid] == [
        (0.1, 250, 0.75, 1.0), (0.25, 250, 1.0, 1.0), (0.25, 250, 1.0, 0.25), (0.5, 150, 1.5, 1.0), (0.5, 150, 1.5, 0.25)]
    runs = script.sampled_runs(4.0, 2, grid, ["ema:0.8"], tmp_path, margin=0.01)
    assert [(r["q"], r["server_lr_end"], r["rounds"], r["lr"]) for r in runs] == [(0.25, 0.25, 250, 1.0)] * 2
    decaying = {"server-optimizer": "momentum", "server-momentum": 0.0, "server-lr": 1.0, "server-lr-end": 0.25}
    assert calls[0] == (1, {"lr": 0.75, "num-server-rounds": 250, **script.SAMPLED_SERVER_STEP})  # the preset's q
    assert calls[2] == (1, {"lr": 1, "num-server-rounds": 250, "sampling-rate": 0.25, **decaying})
    assert calls[-1] == (2, calls[2][1]) and len(calls) == 6
    row = script.table([script.result(4.0, "sampled", runs)], 60, 250, 0.1).splitlines()[2]
    assert "(q 0.25, step 1 → 0.25, lr 1, 250 rounds, ema:0.8; 3.9600 / 3.9600)" in row
    for bad in (["1"], ["0.5@100@1@0"], ["0.5@100@1@1.5"], ["0.5@1@1@1@1"]):
        with pytest.raises(SystemExit, match="sampled-qs"):
            script.sampled_grid(bad, [100], [1.0], [1.0])


def test_sampled_column_searches_the_server_weight_decay_and_keeps_the_old_runs_names(script, monkeypatch, tmp_path):
    """An end END:WD adds the decoupled server weight decay (momentum 0, lr 1, the step falling to END) as one more
    search axis chosen on validation; an end without WD names its run exactly as before, so saved runs are reused."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import cross_device_sweep

    calls = []

    def fake_search_run(out, overrides, seed, validation, epsilon, releases):
        calls.append((seed, overrides))
        val = 0.9 + overrides.get("server-weight-decay", 0.0) - (overrides["server-lr-end"] < 1) / 100
        return {"sigma": 0.1, "epsilon": epsilon, "seconds": 1.0, "epsilon_add_remove": epsilon,
                "finals": {r: {"val": val, "test": val} for r in releases}}

    monkeypatch.setattr(cross_device_sweep, "search_run", fake_search_run)
    grid = script.sampled_grid(["0.5@100@3@1,1:0.003,0.25:0.001"], [250], [1.0], ["1"])
    assert [(s["server_lr_end"], s.get("server_weight_decay")) for s in grid] == [(1.0, None), (1.0, 0.003),
                                                                                 (0.25, 0.001)]
    assert script.sampled_grid(["0.5"], [100], [3.0], [1.0, 0.25]) == script.sampled_grid(["0.5"], [100], [3.0],
                                                                                          ["1", "0.25"])
    runs = script.sampled_runs(8.0, 2, grid, ["ema:0.9"], tmp_path)
    base = {"lr": 3, "num-server-rounds": 100, "sampling-rate": 0.5}
    assert calls[0] == (1, {**base, **script.SAMPLED_SERVER_STEP})  # no WD: the plain step's keys, unchanged
    step = {"server-optimizer": "momentum", "server-momentum": 0.0, "server-lr": 1.0}
    assert calls[1] == (1, {**base, **step, "server-lr-end": 1.0, "server-weight-decay": 0.003})
    assert calls[2] == (1, {**base, **step, "server-lr-end": 0.25, "server-weight-decay": 0.001})
    assert calls[3] == (2, calls[1][1]) and len(calls) == 4  # the winner on validation: constant step + WD 0.003
    assert [r["server_weight_decay"] for r in runs] == [0.003, 0.003]
    row = script.table([script.result(8.0, "sampled", runs)], 60, 250, 0.1).splitlines()[2]
    assert "(q 0.5, plain step + WD 0.003, lr 3, 100 rounds, ema:0.9; 8.0000 / 8.0000)" in row
    assert script.server_step(0.25) == {**step, "server-lr-end": 0.25}  # the decaying step as before: no WD key
    for bad in (["0.5@100@1@1:-0.1"], ["0.5@100@1@1:1"], ["0.5@100@1@0:0.003"]):
        with pytest.raises(SystemExit, match="sampled-qs"):
            script.sampled_grid(bad, [100], [1.0], ["1"])
    with pytest.raises(SystemExit, match="only the secret sampled column"):
        script.package_runs(1.0, 2, [], [], "cnn-tanh", "public", grid[1:2])
