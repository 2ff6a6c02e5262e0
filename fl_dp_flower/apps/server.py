"""ServerApp: validated config -> Noisy-FedAvg/FedProx rounds -> ledger, checkpoints, reports.

Outputs under ``<output-dir>/<run-name>/`` (a relative output-dir is resolved against the
ServerApp's working directory, which for ``flwr run`` is where the SuperLink was started;
the absolute path is logged):

- ``ledger.jsonl``: header + one fsynced line per accounted round (append-only);
- ``model-latest.pt``: ``{"round": t, "state_dict": ...}`` after every round (temp file +
  ``os.replace``), so a crashed run can resume;
- at the end: ``final_model.pt`` (state_dict), ``privacy.png``, ``summary.json`` and the
  summary table in the log.

Order per round: aggregate -> accountant.step -> central evaluation -> ledger append (fsync)
-> save model -> log line / Prometheus -> next round's broadcast. A crash between the ledger
line and the checkpoint leaves a ledger one round ahead of the model: on resume the round is
still accounted (conservative) and training continues from the older model.

Resume (``resume = true``): the ledger's header must match the accountant config; the
accountant is rebuilt from the ledger's round records; the remaining rounds are
``num-server-rounds`` minus the rounds accounted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fl_dp_flower.config import AppConfig, ConfigError
from fl_dp_flower.privacy.accountant import PrivacyAccountant, PrivacyReport
from fl_dp_flower.privacy.records import RoundRecord
from fl_dp_flower.reporting import PrivacyLedger, PrivacyMetricsExporter, format_round_line, plot_privacy_curve, render_summary
from fl_dp_flower.strategies import NoisyStrategyMixin, make_strategy
from fl_dp_flower.training.data import DEFAULT_DATA_SEED, load_dataset
from fl_dp_flower.training.local_update import evaluate_model
from fl_dp_flower.training.models import build_model
from fl_dp_flower.reporting.durable import fsync_dir as _fsync_dir
from fl_dp_flower.reporting.durable import json_safe as _json_safe

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: shows in `flwr log`

LEDGER = "ledger.jsonl"
CHECKPOINT = "model-latest.pt"
FINAL_MODEL = "final_model.pt"
PLOT = "privacy.png"
SUMMARY = "summary.json"
_LEDGER_DP_KEYS = ("dp-aggregated", "dp-dropped", "dp-echo-mismatch")

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower entry point: validate the run config (fails the run naming the key), then run."""
    try:
        config = AppConfig.from_run_config(context.run_config)
    except ConfigError as err:
        log.error("%s", err)
        raise
    run_server(grid, config)


# ------------------------------------------------------------------ files
def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` via a temp file, fsync and ``os.replace`` (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Strict JSON (non-finite floats as strings), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------ evaluation
def make_evaluate_fn(config: AppConfig):
    """Central evaluation of the global model on the dataset's test split."""
    _, test = load_dataset(config.dataset, config.data_dir, config.test_fraction, DEFAULT_DATA_SEED)
    x, y = test.tensors
    model = build_model(config.dataset)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate_model(model, x, y)
        return MetricRecord({"accuracy": float(acc), "loss": float(loss)})

    return evaluate_fn


# ------------------------------------------------------------------ per-round sink
class RoundSink:
    """The strategy's reporter: ledger line, checkpoint, log line, Prometheus (in this order)."""

    def __init__(self, config: AppConfig, run_dir: Path, ledger: PrivacyLedger,
                 exporter: PrivacyMetricsExporter | None) -> None:
        self.config, self.run_dir, self.ledger, self.exporter = config, run_dir, ledger, exporter
        self.strategy: NoisyStrategyMixin | None = None

    def on_round(self, round_: int, record: RoundRecord, report: PrivacyReport, metrics: dict[str, Any]) -> None:
        report_d = report.to_dict()
        ledger_metrics = {k: v for k, v in metrics.items() if not k.startswith("dp-") or k in _LEDGER_DP_KEYS}
        self.ledger.append_round(round=round_, record=record.to_dict(), report=report_d, metrics=ledger_metrics)
        assert self.strategy is not None and self.strategy.global_arrays is not None
        atomic_torch_save({"round": round_, "state_dict": self.strategy.global_arrays.to_torch_state_dict()},
                          self.run_dir / CHECKPOINT)
        log.info(format_round_line(report_d, accuracy=metrics.get("accuracy"), clients=record.clients))
        if self.exporter is not None:
            self.exporter.update(report_d, clients=record.clients, accuracy=metrics.get("accuracy"),
                                 budget_epsilon=self.config.budget_epsilon)


# ------------------------------------------------------------------ run
@dataclass
class ServerOutcome:
    """What a finished server run produced (for tests and callers)."""

    run_dir: Path
    accountant: PrivacyAccountant
    strategy: NoisyStrategyMixin
    result: Result
    summary: dict[str, Any]


def _open_ledger(config: AppConfig, run_dir: Path) -> tuple[PrivacyLedger, PrivacyAccountant, ArrayRecord | None]:
    """Create a ledger, or resume one: (ledger, rebuilt accountant, saved model or None)."""
    acct_cfg = config.accountant_config()
    path = run_dir / LEDGER
    if not config.resume or not path.exists():
        if config.resume:
            log.warning("resume = true but %s does not exist: starting a new run", path)
        ledger = PrivacyLedger.create(path, accountant_config=acct_cfg.to_dict(), app_config=config.to_run_config())
        return ledger, PrivacyAccountant(acct_cfg), None
    ledger = PrivacyLedger.resume(path, accountant_config=acct_cfg.to_dict())
    records = [RoundRecord.from_dict(entry["record"]) for entry in ledger.rounds]
    accountant = PrivacyAccountant.from_records(acct_cfg, records)
    arrays = None
    ckpt_path = run_dir / CHECKPOINT
    if records:
        if not ckpt_path.exists():
            raise FileNotFoundError(f"cannot resume: {ckpt_path} is missing but the ledger has {len(records)} rounds")
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if ckpt["round"] > records[-1].round:
            raise ValueError(f"cannot resume: checkpoint round {ckpt['round']} is ahead of the ledger "
                             f"(last round {records[-1].round})")
        if ckpt["round"] < records[-1].round:
            log.warning("checkpoint is from round %d, ledger has round %d: continuing from the older model "
                        "(the later round stays accounted)", ckpt["round"], records[-1].round)
        arrays = ArrayRecord(ckpt["state_dict"])
    ledger.append_event("resume", {"rounds_accounted": len(records),
                                   "checkpoint_round": ckpt["round"] if records else 0})
    log.info("resuming %s: %d rounds accounted", path, len(records))
    return ledger, accountant, arrays


def run_server(grid: Grid, config: AppConfig, *, fraction_evaluate: float = 0.0) -> ServerOutcome:
    """Run the whole server side on ``grid``; returns the outcome after writing every output."""
    t0 = time.time()
    torch.set_num_threads(1)
    if config.seed >= 0:  # node sampling (random.sample) and model init become reproducible
        random.seed(config.seed)
        torch.manual_seed(config.seed)
    run_dir = (Path(config.output_dir).expanduser() / config.run_name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info("run directory: %s", run_dir)

    ledger, accountant, arrays = _open_ledger(config, run_dir)
    exporter = None
    try:
        if config.metrics_port > 0:
            exporter = PrivacyMetricsExporter(config.metrics_port)
            log.info("Prometheus metrics on port %d", config.metrics_port)
        if arrays is None:
            arrays = ArrayRecord(build_model(config.dataset).state_dict())
        sink = RoundSink(config, run_dir, ledger, exporter)
        strategy = make_strategy(config, accountant, reporters=[sink], fraction_evaluate=fraction_evaluate)
        sink.strategy = strategy
        remaining = max(config.num_server_rounds - accountant.num_releases, 0)
        log.info("%s: %d rounds to run (%d already accounted)", type(strategy).__name__, remaining,
                 accountant.num_releases)
        result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=remaining,
                                evaluate_fn=make_evaluate_fn(config))
        if strategy.stop_reason is not None:
            ledger.append_event("budget-stop", {"reason": strategy.stop_reason,
                                                "rounds_accounted": accountant.num_releases})
        summary = _finish(config, run_dir, ledger, accountant, strategy, result, time.time() - t0)
        ledger.append_event("end", {"rounds_accounted": accountant.num_releases,
                                    "stopped_by_budget": strategy.stop_reason is not None})
        if exporter is not None and config.metrics_linger > 0:
            log.info("serving the final metrics on port %d for %.0f s (metrics-linger)",
                     exporter.port, config.metrics_linger)
            time.sleep(config.metrics_linger)
    finally:
        ledger.close()
        if exporter is not None:
            exporter.close()
    return ServerOutcome(run_dir, accountant, strategy, result, summary)


def _finish(config: AppConfig, run_dir: Path, ledger: PrivacyLedger, accountant: PrivacyAccountant,
            strategy: NoisyStrategyMixin, result: Result, seconds: float) -> dict[str, Any]:
    """Final model, summary table, plot and summary.json."""
    final = strategy.global_arrays if strategy.global_arrays is not None else result.arrays
    atomic_torch_save(final.to_torch_state_dict(), run_dir / FINAL_MODEL)
    history = [{"round": e["round"], "report": e["report"], "metrics": e.get("metrics", {})} for e in ledger.rounds]
    plot = None
    if history:
        log.info("\n%s", render_summary(history))
        plot = str(plot_privacy_curve(history, run_dir / PLOT, delta=config.delta))
    last_metrics = history[-1]["metrics"] if history else {}
    summary = {
        "run_dir": str(run_dir),
        "rounds_accounted": accountant.num_releases,
        "num_server_rounds": config.num_server_rounds,
        "stopped_by_budget": strategy.stop_reason is not None,
        "stop_reason": strategy.stop_reason,
        "target_epsilon": config.target_epsilon,
        "final_report": accountant.report().to_dict(),
        "final_accuracy": last_metrics.get("accuracy"),
        "final_loss": last_metrics.get("loss"),
        "echo_mismatches": strategy.echo_mismatches,
        "wall_seconds": seconds,
        "files": {"ledger": str(run_dir / LEDGER), "final_model": str(run_dir / FINAL_MODEL), "plot": plot},
        "app_config": config.to_run_config(),
        "accountant_config": accountant.config.to_dict(),
    }
    write_json(run_dir / SUMMARY, summary)
    cert = summary["final_report"]["certified"]
    log.info("finished: %d rounds accounted, certified epsilon %s (mu %s, %s) at delta %g%s",
             accountant.num_releases, cert["epsilon"], cert["mu"], cert["bound"], config.delta,
             f"; stopped: {strategy.stop_reason}" if strategy.stop_reason else "")
    return summary
