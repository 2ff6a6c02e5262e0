"""The `fl-dp-flower` command line: JSON shapes, planned numbers, calibration, and bad input."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fl_dp_flower.app.cli import main

# --colluding-clients 0: the reference numbers (docs/MATH.md tables) are for an outside observer
BASE = ["--lr", "0.1", "--local-steps", "5", "--clip-norm", "1", "--clients", "20", "--smoothness", "1",
        "--colluding-clients", "0"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_privacy_json_constant_schedule(capsys):
    out = _json(capsys, ["privacy", *BASE, "--sigma", "1", "--rounds", "1000", "--json"])
    assert out["rounds"] == 1000 and out["delta"] == 1e-5
    assert set(out["bounds"]) == {"paper", "composition", "final_model", "local_dp"}
    # docs/MATH.md §7.3/§8.2: paper 0.4624 (not sound), composition sqrt(T)*mu_1 = 7.071, eps 54.4.
    assert out["bounds"]["paper"]["sound"] is False
    assert out["bounds"]["paper"]["mu"] == pytest.approx(0.4624, abs=1e-4)
    assert out["bounds"]["composition"]["mu"] == pytest.approx(math.sqrt(1000) * math.sqrt(20) * 0.05, rel=1e-9)
    assert out["certified"] == {
        "bound": "composition",
        "mu": out["bounds"]["composition"]["mu"],
        "epsilon": out["bounds"]["composition"]["epsilon"],
        "assumes": [],
    }
    assert out["relation"] == "replace-one"
    # add/remove-one: per-batch clipping with B unknown (> 1) keeps 2V for the first step and every
    # later one, so the guarantee is the same (docs/MATH.md §16)
    assert out["add_remove"]["mu"] == pytest.approx(out["certified"]["mu"], rel=1e-12)
    assert out["certified"]["epsilon"] == pytest.approx(54.4, rel=2e-3)


def test_calibrate_round_trips_through_privacy(capsys):
    cal = _json(capsys, ["calibrate", *BASE, "--schedule", "stage", "--rounds", "200",
                         "--target-epsilon", "2.0", "--json"])
    assert set(cal) >= {"sigma", "bound", "mu", "epsilon"}
    assert cal["epsilon"] == pytest.approx(2.0, rel=1e-8)
    out = _json(capsys, ["privacy", *BASE, "--schedule", "stage", "--rounds", "200",
                         "--sigma", repr(cal["sigma"]), "--json"])
    assert out["certified"]["epsilon"] == pytest.approx(2.0, rel=1e-8)


def test_calibrate_final_model_threat_needs_less_noise(capsys):
    args = [*BASE, "--schedule", "iterative", "--rounds", "1000", "--target-epsilon", "1", "--json"]
    allrounds = _json(capsys, ["calibrate", *args])
    final = _json(capsys, ["calibrate", *args, "--threat-model", "final-model", "--assume-smooth-losses"])
    assert final["bound"] == "final_model" and allrounds["bound"] == "composition"
    assert final["sigma"] < allrounds["sigma"]
    assert final["assumes"] == ["L-smooth losses (L = 1)"] and allrounds["assumes"] == []
    # without the assertion the final-model threat model is refused, naming the flag
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", *args, "--threat-model", "final-model"])
    assert exc.value.code == 2
    assert "--assume-smooth-losses" in capsys.readouterr().err


def test_per_sample_clipping_scales_by_theta_only_under_the_smoothness_assertion(capsys):
    # docs/MATH.md §13: C, lr=0.1, L=1, K=5, B=32, m=20, T=1000 -> composition 0.26981 when every
    # per-sample loss is asserted L-smooth; clipping alone gives sqrt(T m) 2 lr V K / m = 7.0711.
    args = ["privacy", *BASE, "--sigma", "1", "--rounds", "1000", "--batch-size", "32", "--per-sample-clipping",
            "--json"]
    out = _json(capsys, [*args, "--assume-smooth-losses"])
    assert out["bounds"]["composition"]["mu"] == pytest.approx(0.26981, abs=5e-6)
    assert out["certified"]["assumes"] == ["L-smooth losses (L = 1)"]
    plain = _json(capsys, args)
    assert plain["certified"]["mu"] == pytest.approx(math.sqrt(1000 * 20) * 2 * 0.1 * 5 / 20, rel=1e-12)
    assert plain["certified"]["assumes"] == []


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--sigma", "0"], "--sigma"),
        (["--sigma", "-1"], "--sigma"),
        (["--sigma", "nan"], "--sigma"),
        (["--sigma", "1", "--local-steps", "0"], "--local-steps"),
        (["--sigma", "1", "--delta", "1.5"], "--delta"),
        (["--sigma", "1", "--algorithm", "fedprox", "--prox-alpha", "0.5", "--assume-smooth-losses"], "--prox-alpha"),
        (["--sigma", "1", "--algorithm", "fedprox", "--prox-alpha", "20"], "--lr"),
        (["--sigma", "1", "--per-sample-clipping", "--batch-size", "0"], "--batch-size"),
        (["--sigma", "auto"], "--target-epsilon"),
        (["--run-config", "sigma=-1"], "--sigma"),
        (["--run-config", "lr2=0.1"], "lr"),
    ],
)
def test_bad_input_names_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["privacy", *BASE[:-2], *argv])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert flag in err


def test_console_script_is_installed():
    exe = shutil.which("fl-dp-flower") or str(__import__("pathlib").Path(sys.executable).with_name("fl-dp-flower"))
    proc = subprocess.run([exe, "privacy", *BASE, "--sigma", "1", "--rounds", "10"], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "composition" in proc.stdout and "NOT a guarantee" in proc.stdout
    bad = subprocess.run([exe, "calibrate", *BASE, "--rounds", "10", "--target-epsilon", "-1"], check=False,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--target-epsilon" in bad.stderr


def test_table_states_the_defaults_and_which_threat_model_chose_the_bound(capsys):
    # issue 21.3: the defaults are the run config's (pyproject: K 10, V 2, m 2, T 10), not the CLI's own
    assert main(["privacy", "--sigma", "1"]) == 0
    out = capsys.readouterr().out
    assert "m 2 clients/round, T 10 rounds" in out and "constant schedule, lr 0.1, K 10, V 2" in out
    assert "run config: " in out and "pyproject.toml + flags" in out
    assert "certified (composition, chosen by threat model all-rounds" in out
    assert main(["privacy", "--sigma", "1", "--threat-model", "curious-server"]) == 0
    assert "certified (local_dp, chosen by threat model curious-server" in capsys.readouterr().out


def test_help_shows_defaults_and_cites_no_document_a_user_cannot_open(capsys):
    with pytest.raises(SystemExit):
        main(["privacy", "--help"])
    text = capsys.readouterr().out
    assert "--num-server-rounds X, --rounds X" in text and "package default 10" in text
    with pytest.raises(SystemExit):
        main(["privacy", "--sigma", "1", "--algorithm", "fedprox", "--prox-alpha", "100"])
    err = capsys.readouterr().err
    assert "--prox-alpha" in err
    cited = re.findall(r"[\w./-]+\.md", err)  # a document the message cites is one the user has
    assert all((Path(__file__).resolve().parents[2] / doc).is_file() for doc in cited), cited


def test_every_run_config_key_a_plan_depends_on_is_a_flag(capsys):
    # issue 21.3: the flags are generated from AppConfig, so a key added to the run config is a flag
    from fl_dp_flower.app.config import AppConfig
    from fl_dp_flower.app.plan_flags import RUN_ONLY

    with pytest.raises(SystemExit):
        main(["privacy", "--help"])
    text = capsys.readouterr().out
    keys = [n.replace("_", "-") for n in AppConfig.model_fields if n not in RUN_ONLY]
    assert len(keys) >= 25 and all(f"--{key}" in text for key in keys)
    assert RUN_ONLY < set(AppConfig.model_fields)  # no stale exclusion


def test_flags_override_run_config_overrides_which_override_the_preset(capsys):
    out = _json(capsys, ["privacy", "--preset", "main", "--run-config", "sigma=0.9 num-server-rounds=3",
                         "--num-server-rounds", "2", "--json"])
    values = out["run_config"]["values"]
    assert values["clients-per-round"] == 4000 and values["sigma"] == 0.9 and values["num-server-rounds"] == 2
    assert out["rounds"] == 2 and len(out["per_round"]) == 2
    assert out["run_config"]["source"].endswith('+ preset main + --run-config "sigma=0.9 num-server-rounds=3" + flags')


def test_a_very_long_plan_skips_the_per_round_replay(capsys):
    out = _json(capsys, ["privacy", "--sigma", "1", "--rounds", "30000", "--json"])
    assert out["per_round"] == [] and out["stopped_by_budget"] is None and "30000" not in out["notes"][0]
    assert out["bounds"]["composition"]["mu"] > 0


def test_app_reads_another_projects_run_config(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.flwr.app.config]\n"local-steps" = 3\nsigma = 0.7\n')
    out = _json(capsys, ["privacy", "--app", str(tmp_path), "--json"])
    assert out["run_config"]["values"]["local-steps"] == 3 and out["sigma"] == 0.7
    with pytest.raises(SystemExit):
        main(["privacy", "--app", str(tmp_path / "nowhere")])
    assert "--app" in capsys.readouterr().err


def test_colluding_clients_default_counts_only_the_other_participants(capsys):
    """Issue 16 item 3: by default a participant knows its own upload: composition against
    sigma*sqrt(m - 1)/m, i.e. the outside observer's mu times sqrt(m/(m - 1)); m <= c is local DP."""
    args = [a for a in BASE if a not in ("--colluding-clients", "0")]
    outside = _json(capsys, ["privacy", *BASE, "--sigma", "1", "--rounds", "100", "--json"])
    participant = _json(capsys, ["privacy", *args, "--sigma", "1", "--rounds", "100", "--json"])
    ratio = participant["bounds"]["composition"]["mu"] / outside["bounds"]["composition"]["mu"]
    assert ratio == pytest.approx(math.sqrt(20 / 19), rel=1e-12)
    everyone = _json(capsys, ["privacy", *args, "--colluding-clients", "25", "--sigma", "1", "--rounds", "100", "--json"])
    assert everyone["bounds"]["composition"]["mu"] == pytest.approx(everyone["bounds"]["local_dp"]["mu"], rel=1e-12)
    calib = _json(capsys, ["calibrate", *args, "--target-epsilon", "2", "--rounds", "100", "--json"])
    calib0 = _json(capsys, ["calibrate", *BASE, "--target-epsilon", "2", "--rounds", "100", "--json"])
    assert calib["sigma"] == pytest.approx(calib0["sigma"] * math.sqrt(20 / 19), rel=1e-9)


def test_a_users_app_keys_are_ignored_with_a_note_and_known_keys_are_listed_cleanly(tmp_path, capsys):
    """Issue 30 item 7: a user's own app (the digits example's keys: secure-aggregation, resume, ...) is planned,
    its own keys ignored with a note on stderr; an unknown key typed on the command line is still refused, and
    the list of known keys is not garbled ('clients-per-round (--clients-per-round)-per-node')."""
    (tmp_path / "pyproject.toml").write_text('[tool.flwr.app.config]\n"local-steps" = 3\nsigma = 0.7\n'
                                             'secagg = true\n"my-data-dir" = "/data"\n')
    out = _json(capsys, ["calibrate", "--app", str(tmp_path), "--target-epsilon", "2", "--json"])
    assert out["sigma"] > 0
    assert main(["privacy", "--app", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["run_config"]["values"]["local-steps"] == 3 and out["sigma"] == 0.7
    assert "note: ignoring run-config key(s) my-data-dir, secagg" in captured.err
    with pytest.raises(SystemExit):
        main(["privacy", "--run-config", "zzz-unknown=1"])
    err = capsys.readouterr().err
    assert "unknown run-config key 'zzz-unknown'" in err
    assert "clients-per-node" in err and ")-per-node" not in err and ")-per-" not in err


def test_calibrate_says_what_an_amplified_bounds_mu_is(capsys):
    """calibrate prints the secret-sample bound's mu beside its epsilon: the line after says that mu is the
    unamplified Gaussian-DP parameter and epsilon comes from the conditioned rounds' PLD (a mu of 4.6 beside
    epsilon 4 read as mu-GDP would be wrong), and that the bound needs the sample kept secret."""
    assert main(["calibrate", "--lr", "0.1", "--local-steps", "1", "--clip-norm", "1", "--clients-per-round", "20",
                 "--clients-per-node", "2", "--num-partitions", "10", "--client-sampling", "poisson",
                 "--sampling-rate", "0.5", "--sample-secrecy", "secret", "--num-server-rounds", "1",
                 "--target-epsilon", "8"]) == 0
    out = capsys.readouterr().out
    assert "gives sampled_secret: mu = " in out
    assert ("sampled_secret: epsilon from the PLD of the rounds conditioned on their counts (docs/MATH.md §22); its mu "
            "is the Gaussian-DP parameter the rounds have without amplification; it holds only while nobody") in out


def test_privacy_plans_every_preset_and_names_each_bounds_adversary(capsys):
    """`privacy --preset cross-silo` used to stop with a KeyError: the plan's table had no adversary for the
    batch_sampled bound. Every bound a report can carry has a row text, and the cross-silo plan (here against a
    curious server, where batch_sampled amplifies local_dp) prints its amplified bound with its mu marked
    unamplified."""
    from fl_dp_flower.app import cli
    from fl_dp_flower.privacy.client_sampling import CONDITIONED_BOUND
    from fl_dp_flower.privacy.sample_sampling import BATCH_SAMPLED_BOUND
    from fl_dp_flower.privacy.sampled import SAMPLED_BOUND
    from fl_dp_flower.privacy.secure_aggregation import SECURE_AGGREGATION_BOUND
    from fl_dp_flower.vocabulary import BOUND_NAMES

    names = {*BOUND_NAMES, SAMPLED_BOUND, CONDITIONED_BOUND, BATCH_SAMPLED_BOUND, SECURE_AGGREGATION_BOUND}
    assert names <= set(cli._ADVERSARY)
    from fl_dp_flower.reporting.console import AMPLIFIED_BOUNDS

    assert set(cli._AMPLIFIED) == AMPLIFIED_BOUNDS  # each bound marked "(unamplified)" has its explanation
    assert main(["privacy", "--preset", "cross-silo", "--threat-model", "curious-server"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(unamplified), epsilon = " in out
    assert "batch_sampled: epsilon from the PLD of the rounds amplified by each site's Poisson batch" in out
    # batch_sampled also amplifies local_dp against a curious server: the rule and the row say so
    assert "certified (batch_sampled, chosen by threat model curious-server: local_dp, amplified by the sites' Poisson" in out
    assert "every upload (curious-server)" in cli._ADVERSARY["batch_sampled"]

