"""issue 16 items 2, 4, 10a, 10d: what certifies without the L-smoothness assertion, the add/remove-one
guarantee beside replace-one, and the planner against the accountant on planned rounds.

References are independent of the code under test: the kink loss's sensitivity measured through the
package's own ``training.local_update``, dp-accounting's PLD accountant for add/remove-one, and the
accountant's record-by-record replay for the planner.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from fl_dp_flower.app.cli import main
from fl_dp_flower.privacy import AccountantConfig, PrivacyAccountant
from fl_dp_flower.privacy.planning import plan

KINK = {"lr": 0.1, "local_steps": 5, "batch_size": 32, "clip_norm": 1.0, "smoothness": 1.0}


def _kink_sensitivity(sign_a: float, sign_b: float) -> float:
    """||w_a - w_b|| after one client's K local steps through ``training.local_update`` with
    per-sample clipping, from a common w_t = 0: B - 1 samples of the ReLU-like kink loss -|w|
    (gradient norm 1 = V, not L-smooth for any L) and one differing sample of loss s*w (s = +1, -1,
    or 0 for a removed sample)."""
    torch = pytest.importorskip("torch")
    from fl_dp_flower.training.local_update import local_update

    class Kink(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

        def forward(self, x):  # x[:, 0] = 0: kink sample, else the linear sample's slope
            kink = -self.w.abs().expand(len(x))
            return torch.where(x[:, 0] == 0, kink, x[:, 0] * self.w)

    B = KINK["batch_size"]
    finals = []
    for sign in (sign_a, sign_b):
        model = Kink()
        x = torch.zeros(B, 1, dtype=torch.float64)
        x[-1, 0] = sign
        local_update(model, x, torch.zeros(B), step_sizes=[KINK["lr"]] * KINK["local_steps"],
                     clip_norm=KINK["clip_norm"], clipping="per-sample", batch_size=B,
                     generator=torch.Generator().manual_seed(0), loss_fn=lambda out, y: out.mean())
        finals.append(float(model.w.detach()[0]))
    return abs(finals[0] - finals[1])


def _kink_config(**kw) -> AccountantConfig:
    return AccountantConfig(**{**KINK, "clients": 1, "sigma": 1.0, "clipping": "per-sample", **kw})


def test_kink_loss_sensitivity_is_covered_without_the_smoothness_assertion():
    """The kink instance of issue 16 item 2: true replace-one sensitivity 0.806 (0.1 * (4 + 1/32) * 2),
    the old theta-scaled value 0.0382 (21x too small); the certified one (clipping only) must cover it."""
    measured = _kink_sensitivity(+1.0, -1.0)
    assert measured == pytest.approx(2 * 0.1 * (4 + 1 / 32), rel=1e-9)  # 0.80625
    record = _kink_config().planned_round(1)
    plain = PrivacyAccountant(_kink_config()).step(record)
    # m = 1, sigma = 1: the certified mu is the client's sensitivity itself
    assert measured <= plain.certified.mu
    assert plain.certified.assumes == ()
    # only the operator's (here false) assertion brings the drift bound back, labelled as resting on it
    asserted = PrivacyAccountant(_kink_config(assume_smooth_losses=True)).step(record)
    assert asserted.certified.mu == pytest.approx(0.0381569, rel=1e-5)
    assert asserted.certified.assumes == ("L-smooth losses (L = 1)",)
    # add/remove-one (the differing sample removed: zero gradient) is covered too
    removed = _kink_sensitivity(+1.0, 0.0)
    assert removed <= plain.add_remove["mu"] < plain.certified.mu


def test_cli_privacy_per_sample_certifies_clipping_only_unless_asserted(capsys):
    """Done-when of issue 16 item 2, through the CLI: per-sample clipping, K 5, B 32."""
    argv = ["privacy", "--per-sample-clipping", "--local-steps", "5", "--batch-size", "32", "--lr", "0.1",
            "--clip-norm", "1", "--clients", "1", "--sigma", "1", "--rounds", "1", "--smoothness", "1", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["certified"]["mu"] == pytest.approx(2 * 0.1 * 5, rel=1e-12)  # 2 V K lr: clipping only
    assert plain["certified"]["mu"] >= _kink_sensitivity(+1.0, -1.0)
    assert plain["certified"]["assumes"] == []
    assert main([*argv, "--assume-smooth-losses"]) == 0
    asserted = json.loads(capsys.readouterr().out)
    assert asserted["certified"]["mu"] == pytest.approx(0.0381569, rel=1e-5)
    assert asserted["certified"]["assumes"] == ["L-smooth losses (L = 1)"]
    # --smoothness 0 asserted with per-sample clipping and K >= 2 is refused, naming the flags
    with pytest.raises(SystemExit):
        main([*argv[:-3], "--smoothness", "0", "--assume-smooth-losses", "--json"])
    err = capsys.readouterr().err
    assert "'smoothness' (--smoothness) = 0 with 'assume-smooth-losses' (--assume-smooth-losses)" in err, err


def test_k1_per_sample_divides_by_b_without_any_assertion():
    """K = 1: one step from a common point, theta = 1/B exactly (no L)."""
    cfg = _kink_config(local_steps=1)
    report = PrivacyAccountant(cfg).step(cfg.planned_round(1))
    assert report.certified.mu == 2 * 0.1 * 1.0 / 32
    assert report.certified.assumes == ()
    assert report.add_remove["mu"] == 0.1 * 1.0 / 32


def test_main_job_add_remove_epsilon_matches_dp_accounting():
    """The main job (K = 1, B = 1, lr 2, V 1, sigma 0.55, m 4000, 60 rounds): replace-one mu 0.8907,
    eps 3.8303; add/remove-one with zero substitution halves the sensitivity. Reference: dp-accounting's
    PLD accountant, add-or-remove relation, 60 Gaussian rounds of sensitivity eta V / m = 2/4000 against
    noise sigma / sqrt(m)."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    # c = 0 (an outside observer): the aggregate noise is sigma/sqrt(m), dp-accounting's setting
    cfg = AccountantConfig(schedule="constant", lr=2.0, local_steps=1, clip_norm=1.0, clients=4000, sigma=0.55,
                           batch_size=1, colluders=0)
    acct = PrivacyAccountant(cfg)
    for t in range(60):
        report = acct.step(cfg.planned_round(t + 1))
    d = report.to_dict()
    assert d["relation"] == "replace-one"
    assert d["certified"]["mu"] == pytest.approx(0.8907235428302466, rel=1e-12)
    noise_multiplier = (0.55 / 4000**0.5) / (2.0 * 1.0 / 4000)
    ref = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    ref.compose(dp_accounting.GaussianDpEvent(noise_multiplier), 60)
    assert d["add_remove"]["mu"] == pytest.approx(d["certified"]["mu"] / 2, rel=1e-12)
    assert d["add_remove"]["epsilon"] == pytest.approx(ref.get_epsilon(1e-5), abs=1e-5)
    # and dp-accounting's replace-one relation (twice the sensitivity) gives the replace-one epsilon
    ro = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4)
    ro.compose(dp_accounting.GaussianDpEvent(noise_multiplier), 60)
    assert d["certified"]["epsilon"] == pytest.approx(ro.get_epsilon(1e-5), abs=1e-5)
    assert round(d["add_remove"]["epsilon"], 2) == 1.75
    # against one participant (c = 1, the default) both move by the factor sqrt(m/(m - 1)): 3.8309, 1.7522
    participant = dataclasses.replace(cfg, colluders=1)
    p = PrivacyAccountant.from_records(participant, (participant.planned_round(t) for t in range(1, 61))).report()
    assert p.add_remove["mu"] == pytest.approx(d["add_remove"]["mu"] * (4000 / 3999) ** 0.5, rel=1e-12)
    # the planner reports the same
    assert plan(cfg, 60).to_dict()["add_remove"]["epsilon"] == pytest.approx(d["add_remove"]["epsilon"], rel=1e-12)


CASES = list(itertools.product(("constant", "cyclic", "stage", "iterative"), ("per-batch", "per-sample"),
                               (False, True)))


@pytest.mark.parametrize("schedule,clipping,asserted", CASES)
def test_planner_equals_accountant_on_planned_rounds(schedule, clipping, asserted):
    """issue 16 item 10d: the planner's certified bounds use the exact record terms, so a run that goes
    as planned gets the planner's numbers from the accountant (every bound but the paper's closed form,
    which keeps its Table 2 terms), under both relations, for FedAvg and FedProx."""
    for algorithm, prox in (("fedavg", None), ("fedprox", 2.0)):
        cfg = AccountantConfig(algorithm=algorithm, prox_alpha=prox, schedule=schedule, lr=0.1, local_steps=5,
                               clip_norm=1.0, clients=20, sigma=1.0, smoothness=1.0, clipping=clipping,
                               batch_size=8, threat_model="final-model" if asserted else "all-rounds",
                               colluders=0 if asserted else 1, assume_smooth_losses=asserted)
        T = 300
        acct = PrivacyAccountant.from_records(cfg, (cfg.planned_round(t) for t in range(1, T + 1)))
        got, want = plan(cfg, T).to_dict(), acct.report().to_dict()
        for name in ("composition", "final_model", "local_dp"):
            assert got["bounds"][name]["mu"] == pytest.approx(want["bounds"][name]["mu"], rel=1e-9), (algorithm, name)
            assert got["bounds"][name]["assumes"] == want["bounds"][name]["assumes"]
        assert got["bounds"]["paper"]["mu"] == pytest.approx(want["bounds"]["paper"]["mu"], rel=1e-12)
        # constant/cyclic: final model = composition exactly, so a tie may fall either way (last ulp)
        assert want["bounds"][got["certified"]["bound"]]["mu"] == pytest.approx(want["certified"]["mu"], rel=1e-9)
        assert got["certified"]["mu"] == pytest.approx(want["certified"]["mu"], rel=1e-9)
        assert got["add_remove"]["mu"] == pytest.approx(want["add_remove"]["mu"], rel=1e-9)


def test_final_model_run_publishes_no_per_round_model_outputs(tmp_path):
    """issue 16 item 5, through the real ServerApp and ClientApp on the in-process grid: under
    final-model no round line of the ledger (hence no log line, Prometheus gauge, summary table or plot)
    carries an accuracy or loss; the released model is evaluated once, and the summary names what the
    final-model certificate assumes. The same run under all-rounds publishes per-round accuracy."""
    from fl_dp_flower.app.testing import run_local, tiny_config

    final_cfg = tiny_config(tmp_path / "final", **{"threat-model": "final-model", "assume-smooth-losses": True, "colluding-clients": 0,
                                                 "schedule": "stage"})
    outcome, _ = run_local(final_cfg)
    rounds = [json.loads(line) for line in (outcome.run_dir / "ledger.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "round"]
    assert rounds and all("accuracy" not in r["metrics"] and "loss" not in r["metrics"] for r in rounds)
    summary = json.loads((outcome.run_dir / "summary.json").read_text())
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    assert summary["threat_model_assumes"] == ["participants do not reveal the global models they receive",
                                               "L-smooth losses (L = 1)"]
    assert summary["final_report"]["certified"]["assumes"] == ["L-smooth losses (L = 1)"]
    assert summary["final_report"]["relation"] == "replace-one"

    all_cfg = tiny_config(tmp_path / "all")
    outcome, _ = run_local(all_cfg)
    rounds = [json.loads(line) for line in (outcome.run_dir / "ledger.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "round"]
    assert all("accuracy" in r["metrics"] for r in rounds)


def test_per_batch_record_takes_the_largest_echoed_batch_size():
    """Per-batch clipping: B = 1 halves the add/remove-one sensitivity, so a record keeps the largest
    batch size of the plan and the echoes (per-sample keeps the smallest, for replace-one)."""
    from fl_dp_flower.strategies.echo import Applied
    from fl_dp_flower.strategies.replies import reconcile

    planned = Applied(sigma=1.0, clip_norm=1.0, local_steps=1, lr=0.1, round_index=0, batch_size=1)
    echoed = [Applied(sigma=1.0, clip_norm=1.0, local_steps=1, lr=0.1, round_index=0, batch_size=32)]
    assert reconcile(planned, echoed, "constant", per_sample=False)[0].batch_size == 32
    assert reconcile(planned, echoed, "constant", per_sample=True)[0].batch_size == 1


def test_the_add_remove_guarantee_names_its_convention():
    """Review of issue 16: the add/remove-one number holds only under zero substitution (batch
    indices, B and weights fixed); every report names that, and the log line prints it."""
    from fl_dp_flower.reporting.console import add_remove_note

    cfg = _kink_config(local_steps=1)
    report = PrivacyAccountant(cfg).step(cfg.planned_round(1)).to_dict()
    assert report["add_remove"]["relation"] == "add/remove-one (zero substitution)"
    assert add_remove_note(report).startswith("add/remove-one (zero substitution) mu=")
