"""Issue 30 item 2: resume from the library's public API (open_ledger + ModelCheckpoint), after a
finished and after a killed run; both ledgers pass `fl-dp-flower verify`'s checks."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp

from fl_dp_flower import (ConsoleSink, DPSettings, FederationSettings, ModelCheckpoint, NoisyFedAvg, dp_train,
                          open_ledger)
from fl_dp_flower.reporting.ledger import read_ledger
from fl_dp_flower.reporting.resume import ResumeRefused
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.testing import LocalGrid, task_identity
from tests.test_public_api import NODES, TinyNet, load_data

SETTINGS = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1)
PLAN = SETTINGS.accountant_config(clients=NODES)


class Killed(Exception):
    """Stands for the server process dying while a round is out."""


class DyingGrid(LocalGrid):
    """Dies in the train round ``die_at`` (after its round-open line, before its round line)."""

    def __init__(self, *args, die_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.die_at, self.calls = die_at, 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.calls += bool(messages)  # train rounds only (an evaluation round without messages also calls)
        if messages and self.calls == self.die_at:
            raise Killed("server killed mid-round")
        return super().send_and_receive(messages, timeout=timeout)


def _app() -> ClientApp:
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    return app


def _run(tmp_path, rounds: int, *, resume: bool, grid=None, unfinished: str = "refuse", momentum: bool = False):
    federation = FederationSettings(clients_per_round=NODES, num_server_rounds=rounds,
                                    **({"server_optimizer": "momentum", "server_lr": 0.5} if momentum else {}))
    checkpoint = ModelCheckpoint(tmp_path / "model-latest.pt")
    ledger, accountant = open_ledger(tmp_path / "ledger.jsonl", PLAN, resume=resume, checkpoint=checkpoint,
                                     unfinished_round=unfinished)  # type: ignore[arg-type]
    strategy = NoisyFedAvg(SETTINGS, accountant, federation=federation, sinks=[ledger, checkpoint, ConsoleSink()])
    arrays = checkpoint.restore(strategy) or ArrayRecord(TinyNet().state_dict())
    with ledger, task_identity():
        strategy.start(grid=grid or LocalGrid(_app(), NODES), initial_arrays=arrays)
    return strategy, checkpoint


def test_resume_after_a_finished_run_continues_the_model_and_verifies(tmp_path):
    first, checkpoint = _run(tmp_path, 2, resume=False, momentum=True)
    assert checkpoint.saved_round() == 2 and verify_ledger(tmp_path / "ledger.jsonl").ok
    saved = torch.load(tmp_path / "model-latest.pt", weights_only=True)
    assert saved["server_update"]["steps"] == 2  # the server optimizer's state travels with the model
    second, _ = _run(tmp_path, 4, resume=True, momentum=True)
    assert second.accountant.num_releases == 4 and second.server_update.steps == 4
    contents = read_ledger(tmp_path / "ledger.jsonl")
    events = [e["event"] for e in contents.events]
    assert events.count("resume") == 1 and events.index("resume") > events.index("end")
    assert "rounds-not-applied" not in events  # the checkpoint holds round 2: every round reached the model
    result = verify_ledger(tmp_path / "ledger.jsonl")
    assert result.ok, result.failure
    assert result.rounds_verified == 4 and result.ended


def test_resume_after_a_killed_run_refuses_then_accounts_the_open_round(tmp_path):
    with pytest.raises(Killed):
        _run(tmp_path, 4, resume=False, grid=DyingGrid(_app(), NODES, die_at=2))
    before = (tmp_path / "ledger.jsonl").read_bytes()
    assert read_ledger(tmp_path / "ledger.jsonl").open_round == 2
    assert not verify_ledger(tmp_path / "ledger.jsonl").ok  # no end event: crashed (or cut)
    with pytest.raises(ResumeRefused, match="round 2 was broadcast.*unfinished_round = 'account'"):
        _run(tmp_path, 4, resume=True)
    assert (tmp_path / "ledger.jsonl").read_bytes() == before  # a refused resume writes nothing
    strategy, _ = _run(tmp_path, 5, resume=True, unfinished="account")
    assert strategy.accountant.num_releases == 5
    records = strategy.accountant.records
    assert [r.applied for r in records] == [True, False, True, True, True]  # round 2 charged, never applied
    result = verify_ledger(tmp_path / "ledger.jsonl")
    assert result.ok, result.failure
    assert result.rounds_verified == 5


def test_resume_without_a_checkpoint_marks_every_round_not_applied_and_verifies(tmp_path):
    federation = FederationSettings(clients_per_round=NODES, num_server_rounds=2)
    for resume in (False, True):
        ledger, accountant = open_ledger(tmp_path / "ledger.jsonl", PLAN, resume=resume)
        strategy = NoisyFedAvg(SETTINGS, accountant, federation=federation if not resume else
                               FederationSettings(clients_per_round=NODES, num_server_rounds=3), sinks=[ledger])
        with ledger, task_identity():
            strategy.start(grid=LocalGrid(_app(), NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()))
    assert [r.applied for r in strategy.accountant.records] == [False, False, True]
    assert verify_ledger(tmp_path / "ledger.jsonl").ok


def test_a_checkpoint_saved_before_its_ledger_line_or_from_another_run_is_refused(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path / "model-latest.pt")
    ledger, accountant = open_ledger(tmp_path / "ledger.jsonl", PLAN, checkpoint=checkpoint)
    strategy = NoisyFedAvg(SETTINGS, accountant, federation=FederationSettings(clients_per_round=NODES,
                           num_server_rounds=1), sinks=[checkpoint, ledger])  # wrong order
    checkpoint.restore(strategy)
    with ledger, task_identity(), pytest.raises(RuntimeError, match="list the ledger sink before the checkpoint"):
        strategy.start(grid=LocalGrid(_app(), NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()))
    checkpoint.save(1, ArrayRecord(TinyNet().state_dict()))
    with pytest.raises(FileExistsError, match="resume"):
        open_ledger(tmp_path / "other.jsonl", PLAN, checkpoint=checkpoint)
