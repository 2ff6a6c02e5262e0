"""What a secret sample's ledger may publish (docs/MATH.md §22): counts, never a statistic of who took part.

Issue 31 review (P31A): the ``sampled_secret`` bound amplifies by the sample's secrecy, so a ledger line that
tells its reader which clients entered a round voids it for that reader."""

from __future__ import annotations

import json

from fl_dp_flower.app.serverapp import LEDGER
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.reporting.ledger.events import MEMBERS_FILE
from fl_dp_flower.reporting.rounds import member_events
from fl_dp_flower.reporting.verify import verify_ledger

#: what a round line's metrics may hold in a secret run: the dp-* counts and numbers, the central evaluation
#: of the (public) global model
_PUBLIC_METRICS = {"accuracy", "loss", "val-accuracy", "val-loss"}


def test_a_secret_ledger_does_not_publish_the_contributors_num_examples(tmp_path):
    """Before: every round line carried ``num-examples``, the sum of the contributors' data sizes (1025, 1689, 1286
    with one client per round of three Dirichlet partitions: each names its partition), so a ledger reader learnt
    the sample the ``sampled_secret`` bound takes to be secret. Now the contributors' statistics go to the
    owner-only members file, and the ledger keeps counts."""
    cfg = tiny_config(tmp_path, **{"clients-per-round": 1, "sample-secrecy": "secret", "partitioning": "dirichlet",
                                   "num-server-rounds": 3, "colluding-clients": 0})
    out, _ = run_local(cfg)
    rounds = read_ledger(out.run_dir / LEDGER).rounds
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert out.accountant.report().certified_bound == "sampled_secret"  # the bound that needs the secrecy
    for r in rounds:
        leaked = {k for k in r["metrics"] if not k.startswith("dp-")} - _PUBLIC_METRICS
        assert not leaked, (r["round"], r["metrics"])
    owner = [json.loads(line) for line in (out.run_dir / MEMBERS_FILE).read_text().splitlines()]
    stats = {d["round"]: d["metrics"] for d in owner if "metrics" in d}
    assert sorted(stats) == [1, 2, 3] and all(s["num-examples"] > 0 for s in stats.values())
    assert len({s["num-examples"] for s in stats.values()}) == 3  # unequal partitions: the sizes told who it was
    v = verify_ledger(out.run_dir / LEDGER)
    assert v.ok and v.rounds_verified == 3, v.failure


def test_a_public_ledger_still_publishes_the_round_statistics(tmp_path):
    """The public sample names its members anyway: its round lines keep ``num-examples``."""
    cfg = tiny_config(tmp_path, **{"clients-per-round": 1, "num-server-rounds": 1, "colluding-clients": 0})
    out, _ = run_local(cfg)
    assert all(r["metrics"]["num-examples"] > 0 for r in read_ledger(out.run_dir / LEDGER).rounds)


def test_a_secret_sample_with_poisson_batches_is_refused_before_round_one(tmp_path):
    """Before: accepted, and every round record carried ``batch_rate``, the largest B/n_i its contributors echoed
    (16/1689, then 16/1286 with one client per round of Dirichlet partitions: each names its contributor's
    partition), in the ledger that the ``sampled_secret`` bound takes to hold counts only. The accountant needs
    that rate, so the combination is refused, naming both keys, before any round."""
    import pytest

    from fl_dp_flower.app.config import ConfigError
    from fl_dp_flower.privacy.records import AccountantConfig

    with pytest.raises(ConfigError, match="'sample-secrecy' 'secret' cannot be combined with 'batch-sampling' = 'poisson'"):
        tiny_config(tmp_path, **{"clients-per-round": 1, "sample-secrecy": "secret", "clipping": "per-sample",
                                 "batch-sampling": "poisson", "batch-rate": 0.1})
    with pytest.raises(ValueError, match=r"sample_secrecy 'secret'.*batch_rate"):
        AccountantConfig(sample_secrecy="secret", population=30, clients=3, clipping="per-sample", batch_size=16,
                         batch_rate=0.1)
    AccountantConfig(sample_secrecy="public", clients=3, clipping="per-sample", batch_size=16, batch_rate=0.1)
    AccountantConfig(sample_secrecy="secret", population=30, clients=3, clipping="per-sample", batch_size=16)



def test_a_secret_runs_failed_event_names_no_node(tmp_path):
    """Before: a secret run that ran out of nodes wrote ``failed`` with NotEnoughNodes' message, which names every
    excluded node and its refusal (``node 7000002: ...``): a node that refused was drawn, what the routed
    ``node-excluded`` events keep out of the ledger. Now the ledger's reason names counts; the node ids stay in the
    server's log and the owner-only members file."""
    import pytest

    from fl_dp_flower.app.recovery import RunFailed

    base = 7_000_001
    refusing = (base + 1, base + 2)
    settings = {"clients-per-round": 3, "min-replies": 2, "sample-secrecy": "secret", "max-node-refusals": 1,
                "num-server-rounds": 3, "colluding-clients": 0}
    with pytest.raises(RunFailed):
        run_local(tiny_config(tmp_path, **settings), first_node_id=base,
                  node_config={n: {"min-sigma": 5.0} for n in refusing})
    run_dir = tmp_path / "run"
    ledger_text = (run_dir / LEDGER).read_text()
    failed = [e["data"] for e in read_ledger(run_dir / LEDGER).events if e["event"] == "failed"]
    assert len(failed) == 1 and "eligible node" in failed[0]["reason"], failed
    assert not any(str(n) in ledger_text for n in range(base, base + 3)), failed
    named = member_events(run_dir / MEMBERS_FILE)
    assert sorted(e["data"]["node_id"] for e in named if e["event"] == "node-excluded") == list(refusing)


def test_a_secret_sample_needs_echoes_equal_to_the_plan(tmp_path):
    """Before: with echo-tolerance > 1 a node that echoes other settings (``dp.sigma`` 0.25 for a planned 0.5) was
    accepted and its round accounted least privately: the round record's ``sigma`` (and ``dp-echo-mismatch``) in the
    ledger then showed every round that node took part in, while ``sampled_secret`` still amplified those rounds by
    p_t as if nobody knew. With a secret sample the echo must equal the plan (a deviating reply is dropped as a
    refusal, its node excluded after max-node-refusals); the library and the app refuse anything else up front."""
    import pytest

    from fl_dp_flower.app.config import ConfigError
    from fl_dp_flower.reply_checks import ReplyChecks
    from fl_dp_flower.settings import DPSettings, FederationSettings
    from fl_dp_flower.strategies.sampling import check_plan

    with pytest.raises(ConfigError, match="'echo-tolerance' = 2.0.*'sample-secrecy' = 'secret'"):
        tiny_config(tmp_path, **{"clients-per-round": 1, "sample-secrecy": "secret", "echo-tolerance": 2.0})
    settings = DPSettings(sigma=1.0, clip_norm=1.0)
    federation = FederationSettings(clients_per_round=2, sample_secrecy="secret")
    config = settings.accountant_config(clients=2, population=8, sample_secrecy="secret")
    with pytest.raises(ValueError, match="echo_tolerance = 2.0.*sample_secrecy 'secret'"):
        check_plan(settings, config, federation, ReplyChecks(echo_tolerance=2.0))
    check_plan(settings, config, federation, ReplyChecks())
    public = FederationSettings(clients_per_round=2)
    check_plan(settings, settings.accountant_config(clients=2), public, ReplyChecks(echo_tolerance=2.0))


def test_a_secret_ledger_does_not_count_the_contributors_echo_mismatches(tmp_path):
    """Before: with per-batch clipping an honest node holding fewer samples than batch-size echoes min(B, n) (accepted
    at echo-tolerance 1, charged at the planned B), and the round line's ``dp-echo-mismatch`` counted it: 1 in the
    round that drew the 1025-sample partition (batch-size 1100), 0 in the others, so the ledger named the rounds that
    client took part in. Now that count (and ``dp-capped``) goes to the owner-only members file with the other
    statistics of the contributors' replies."""
    cfg = tiny_config(tmp_path, **{"clients-per-round": 1, "sample-secrecy": "secret", "partitioning": "dirichlet",
                                   "num-server-rounds": 3, "colluding-clients": 0, "batch-size": 1100,
                                   "local-steps": 1})
    out, _ = run_local(cfg)
    rounds = read_ledger(out.run_dir / LEDGER).rounds
    assert all("dp-echo-mismatch" not in r["metrics"] and "dp-capped" not in r["metrics"] for r in rounds), rounds
    owner = [json.loads(line) for line in (out.run_dir / MEMBERS_FILE).read_text().splitlines()]
    stats = {d["round"]: d["metrics"] for d in owner if "metrics" in d}
    assert sorted(s["dp-echo-mismatch"] for s in stats.values()) == [0, 0, 1]  # the small partition, once
    assert out.strategy.echo_mismatches == 1  # the run's total (summary.json, owner-only) is unchanged
