"""Library-user review O6-O8 and the share-metrics note: a refused construction leaves no ledger behind (the
corrected run just starts), a FedAvg keyword the strategy sets itself is refused naming where it belongs, a plain
Flower train reply is told it lacks the dp.* echo, and shared (un-noised) statistics get a WARNING once per run."""

from __future__ import annotations

import logging

import pytest
from flwr.app import ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp

from fl_dp_flower import Budget, DPSettings, FederationSettings, NoisyFedAvg, NoisyFedProx, PrivacyAccountant, dp_train, open_ledger
from fl_dp_flower.reporting.ledger import PrivacyLedger, read_ledger
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.strategies.echo import parse_applied
from fl_dp_flower.strategies.pending import BudgetFitsNoRound
from fl_dp_flower.strategies.shared_stats import shared_statistics_note
from fl_dp_flower.testing import LocalGrid, task_identity
from tests.test_public_api import NODES, TinyNet, load_data

SETTINGS = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1)
PLAN = SETTINGS.accountant_config(clients=NODES)
FEDERATION = FederationSettings(clients_per_round=NODES, num_server_rounds=1)


def _run(strategy: NoisyFedAvg, app: ClientApp | None = None):
    if app is None:
        app = ClientApp()
        app.train()(dp_train(TinyNet, load_data))
    with task_identity():
        return strategy.start(grid=LocalGrid(app, NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()))


def _refused_construction(path):
    ledger, accountant = open_ledger(path, DPSettings(sigma=0.4, clip_norm=1.0, local_steps=2, batch_size=8,
                                                      lr=0.1).accountant_config(clients=NODES))
    with pytest.raises(ValueError, match="sigma: accountant 0.4 != settings 0.5"):
        NoisyFedAvg(SETTINGS, accountant, federation=FEDERATION, sinks=[ledger])
    ledger.close()


def _refused_start(path):
    ledger, accountant = open_ledger(path, PLAN)
    strategy = NoisyFedAvg(SETTINGS, accountant, federation=FEDERATION, budget=Budget(1e-3, PLAN.delta), sinks=[ledger])
    with ledger, pytest.raises(BudgetFitsNoRound):
        _run(strategy)


@pytest.mark.parametrize("refused", [_refused_construction, _refused_start])
def test_a_run_refused_before_round_1_leaves_no_ledger_and_the_corrected_run_starts(tmp_path, refused):
    """O6. Before: open_ledger wrote the header first; the corrected run got FileExistsError (and resume=True
    'config differs'): the user had to delete the file by hand."""
    path = tmp_path / "ledger.jsonl"
    refused(path)
    assert not path.exists()
    ledger, accountant = open_ledger(path, PLAN)  # the corrected run
    with ledger:
        _run(NoisyFedAvg(SETTINGS, accountant, federation=FEDERATION, sinks=[ledger]))
    contents = read_ledger(path)
    assert [r["round"] for r in contents.rounds] == [1] and contents.events[0]["event"] == "round-open"
    assert verify_ledger(path).ok


def test_a_new_ledger_never_holds_its_header_alone_and_a_second_writer_is_refused_before_broadcasting(tmp_path):
    """Two runs opened on one path: the first line creates the ledger (header and line in one creation); the other
    run's first line is refused (FileExistsError) and the ledger stays byte for byte what the first run wrote."""
    path = tmp_path / "ledger.jsonl"
    first, _ = open_ledger(path, PLAN)
    second, _ = open_ledger(path, PLAN)
    assert not path.exists() and first.head_line_hash is None and first.last_round is None
    first.on_event("round-open", {"round": 1, "nodes": [1, 2, 3]})
    assert len(path.read_bytes().splitlines()) == 2 and first.head_line_hash is not None
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="another run writes the same ledger"):
        second.on_event("round-open", {"round": 1, "nodes": [4, 5, 6]})
    assert path.read_bytes() == before
    first.close()
    second.close()
    with pytest.raises(FileExistsError, match="already exists; a ledger is never overwritten") as err:
        open_ledger(path, PLAN)
    assert "resume=True" in str(err.value) and "run-name" not in str(err.value)


def test_a_header_only_ledger_is_kept_and_its_refusals_say_it_records_nothing(tmp_path):
    """A ledger with its header alone is never replaced (a live run waiting for its nodes may hold it: the reference
    app writes its header up front); the refusals say it records nothing and whether a live run holds it (its lock),
    and advise deleting it only when none does (review V1: the advice invited deleting a live run's ledger)."""
    path = tmp_path / "ledger.jsonl"
    live = PrivacyLedger.create(path, accountant_config=PLAN.to_dict(), app_config={})  # holds the writer's lock
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="holds only its header .*a live run is writing it"):
        open_ledger(path, PLAN)
    other = DPSettings(sigma=0.7, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1).accountant_config(clients=NODES)
    from fl_dp_flower.reporting.ledger.writer import LedgerInUse

    with pytest.raises(LedgerInUse, match="open for writing by another live run"):
        open_ledger(path, other, resume=True)
    live.close()
    with pytest.raises(FileExistsError, match="holds only its header .*no live run holds it: resume=True continues"):
        open_ledger(path, PLAN)
    with pytest.raises(ValueError, match="holds only its header: no round was ever opened.*unless a run still"):
        open_ledger(path, other, resume=True)
    assert path.read_bytes() == before


def test_two_runs_cannot_write_one_ledger(tmp_path):
    """Review V1: two resumes of one ledger were both accepted; both trained round 2 (each accountant counted 2
    releases where 3 were made) and verify found the chain broken. A writer holds the ledger's lock (flock)."""
    from fl_dp_flower.reporting.ledger.writer import LedgerInUse

    path = tmp_path / "ledger.jsonl"
    first = PrivacyLedger.create(path, accountant_config=PLAN.to_dict(), app_config={})
    first.append_event("end", {})
    first.close()
    sink, _ = open_ledger(path, PLAN, resume=True)
    before = path.read_bytes()
    with pytest.raises(LedgerInUse, match="open for writing by another live run"):
        open_ledger(path, PLAN, resume=True)
    assert path.read_bytes() == before  # the refused resume wrote nothing
    sink.close()
    again, _ = open_ledger(path, PLAN, resume=True)  # the lock goes with the writer
    again.close()


@pytest.mark.parametrize("cls, key, value, where", [
    (NoisyFedAvg, "fraction_train", 0.5, r"FederationSettings\(clients_per_round=k\).*client_sampling='poisson'"),
    (NoisyFedAvg, "min_train_nodes", 2, r"FederationSettings\(clients_per_round="),
    (NoisyFedAvg, "min_available_nodes", 2, r"FederationSettings\(clients_per_round="),
    (NoisyFedAvg, "min_evaluate_nodes", 2, r"fraction_evaluate"),
    (NoisyFedAvg, "train_metrics_aggr_fn", lambda records, key: None, r"FederationSettings\(weighting=\.\.\.\)"),
    (NoisyFedProx, "proximal_mu", 0.1, r"DPSettings\(algorithm='fedprox', prox_alpha=...\)"),
])
def test_a_flower_keyword_the_strategy_sets_itself_is_refused_naming_where_it_belongs(cls, key, value, where):
    """O7. Before: Python's "got multiple values for keyword argument 'fraction_train'"."""
    settings = SETTINGS if cls is NoisyFedAvg else DPSettings(sigma=0.5, clip_norm=1.0, local_steps=2, batch_size=8,
                                                              lr=0.1, algorithm="fedprox", prox_alpha=0.5)
    plan = settings.accountant_config(clients=NODES)
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\.\.\., {key}=\.\.\.\) is not accepted: .*{where}"):
        cls(settings, PrivacyAccountant(plan), federation=FEDERATION, **{key: value})


def test_a_plain_flower_train_reply_is_told_it_lacks_the_dp_echo():
    """O8. Before: "metrics lack 'dp.sigma'"."""
    with pytest.raises(ValueError, match=r"lack the dp\.\* echo .*fl_dp_flower\.client\.dp_train.*train_reply"):
        parse_applied(MetricRecord({"num-examples": 40, "train-loss": 0.3}), fedprox=False)
    with pytest.raises(ValueError, match="metrics lack 'dp.sigma'"):  # a partial echo still names the key
        parse_applied(MetricRecord({"num-examples": 40, "dp.lr": 0.1}), fedprox=False)


def _shared_app(share: bool) -> ClientApp:
    train = dp_train(TinyNet, load_data)

    def with_config(msg, context):
        context.node_config["share-metrics"] = share
        return train(msg, context)

    app = ClientApp()
    app.train()(with_config)
    return app


@pytest.mark.parametrize("share, poisson", [(True, False), (True, True), (False, False)])
def test_shared_statistics_are_warned_about_once_per_run(share, poisson, caplog):
    """Shared statistics: un-noised, averaged into every round line, ledger and Result. Before: no runtime word
    (under Poisson batches none either, though they void the node's batch amplification)."""
    caplog.set_level(logging.INFO)
    settings, plan = SETTINGS, PLAN
    if poisson:  # B = 8 of each node's 40 samples
        settings = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1, clipping="per-sample",
                              batch_sampling="poisson")
        plan = settings.accountant_config(clients=NODES, batch_rate=0.2)
    federation = FederationSettings(clients_per_round=NODES, num_server_rounds=2)
    strategy = NoisyFedAvg(settings, PrivacyAccountant(plan), federation=federation)
    result = _run(strategy, _shared_app(share))
    notes = [r for r in caplog.records if "outside the privacy certificate" in r.getMessage()]
    assert len(notes) == int(share) and all(r.levelno == logging.WARNING for r in notes)  # once, not every round
    assert ("train-loss" in result.train_metrics_clientapp[1]) == share  # what the note is about
    assert len(strategy.shared_statistics.nodes) == (NODES if share else 0)
    if share:
        assert "train-seconds" in notes[0].getMessage()
        assert ("voids that node's batch amplification" in notes[0].getMessage()) == poisson


def test_the_note_under_poisson_batches_says_the_batch_amplification_is_void():
    text = shared_statistics_note(batch_sampled=True)
    assert "outside the privacy certificate" in text and "train-seconds grows with the batch sizes" in text
    assert "voids that node's batch amplification" in text
    assert "batch amplification" not in shared_statistics_note(batch_sampled=False)
