"""ServerApp: validated config -> Noisy-FedAvg/FedProx rounds -> ledger, checkpoints, reports.

Outputs under ``<output-dir>/<run-name>/`` (a relative output-dir is resolved against the
ServerApp's working directory, which for ``flwr run`` is where the SuperLink was started;
the absolute path is logged):

- ``ledger.jsonl``: header, then per round a write-ahead ``round-open`` event and one fsynced
  round line (append-only), plus events (resume, budget-stop, node-excluded, end);
- ``model-latest.pt``: ``{"round": t, "state_dict": ...}`` after every round (temp file +
  ``os.replace``), so a crashed run can resume;
- at the end: ``final_model.pt`` (state_dict), ``privacy.png``, ``summary.json`` and the
  summary table in the log.

Every file is written owner-only (0600) in an owner-only (0700) run folder.

Order per round: ledger ``round-open`` (fsync) -> broadcast -> replies -> budget check ->
aggregate -> accountant.step -> central evaluation -> ledger round line (fsync) -> save model
-> log line / Prometheus -> client evaluation broadcast (if any) -> next round. A round's
aggregate is never saved or broadcast before its round line is durable (the strategy closes
the round before any evaluation broadcast), so after a crash:

- a round with no round line released nothing to a global-model adversary;
- a round line without its checkpoint (a crash between the two) leaves the ledger ahead of
  the model: on resume training continues from the older model, and a ``rounds-not-applied``
  event marks the later rounds as not applied: they stay charged to composition and local DP
  but leave the final-model bound, which describes the model actually released
  (docs/MATH.md §14.3a). With no checkpoint at all, the run resumes from the initial model and
  every accounted round is marked so.

Resume (``resume = true``): the ledger must exist (a missing ledger fails the run, naming the
path it looked for: never a silent fresh start), its header must match the accountant config,
and the accountant is rebuilt from its round records; the remaining rounds are
``num-server-rounds`` minus the rounds accounted. A round that was broadcast but has no
complete round line (a crash before the line, or a torn line) may have been spent:
``resume-unfinished-round = "refuse"`` (default) refuses to resume, naming the ledger line,
and writes nothing; ``"account"`` charges it as the planned round, not applied: its uploads
may have reached the server (local DP of the planned round, which does not depend on how many
replied), its aggregate reached no one (composition counts it as planned, which only adds;
the final-model bound leaves it out). That is recorded in the ledger, and the run continues.
Any refused resume writes nothing.

A run that accounts no round (budget too small for any round, nothing left to resume) fails
(:class:`RunFailed`) after writing its summary: it never ends as a success. Every failure is
logged at ERROR (what `flwr log` shows), a full disk as one message saying how to resume
(:mod:`fl_dp_flower.app.recovery`); a resume keeps the nodes excluded earlier in the run.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fl_dp_flower.app.recovery import RunFailed, logged_failures, restore_exclusions
from fl_dp_flower.app.threat import (final_model_assumptions, node_assumptions, publishes_per_round_models,
                                      run_grid, start_warnings)
from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.app.preflight import chance_level_warning, log_preflight
from fl_dp_flower import ModelCheckpoint
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting import PrivacyLedger, PrivacyMetricsExporter, plot_privacy_curve, render_summary
from fl_dp_flower.reporting.console import conditional_note, delta_text
from fl_dp_flower.reporting.durable import atomic_write, write_json
from fl_dp_flower.reporting.ledger import FAILED_EVENT, LedgerContents, read_ledger
from fl_dp_flower.reporting.resume import ResumeRefused, resume_ledger
from fl_dp_flower.reporting.ledger.events import MEMBERS_FILE
from fl_dp_flower.reporting.logfilter import FlowerDumps
from fl_dp_flower.reporting.rounds import MembersSink, RoundSink, member_events
from fl_dp_flower.app.strategy import make_strategy
from fl_dp_flower.strategies import ModelNotFinite, NoisyStrategyMixin, NotEnoughNodes
from fl_dp_flower.strategies.shared_stats import shared_statistics_note
from fl_dp_flower.app.data_split import data_split_changes
from fl_dp_flower.training.data import DEFAULT_DATA_SEED, load_dataset, load_validation
from fl_dp_flower.training.local_update import evaluate_model
from fl_dp_flower.training.models import build_model

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: shows in `flwr log`

LEDGER = "ledger.jsonl"
CHECKPOINT = "model-latest.pt"
FINAL_MODEL = "final_model.pt"
PLOT = "privacy.png"
SUMMARY = "summary.json"
STRATEGY_LOG = "flower-strategy.log"  # Flower's per-round MetricRecord dumps and final results

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower entry point: validate the run config (fails the run naming the key), then run.

    Flower's strategy dumps go to ``<run dir>/flower-strategy.log`` instead of the log stream,
    and this package's own clean errors are logged without a traceback (:class:`FlowerDumps`).
    """
    flwr_logger = logging.getLogger("flwr")
    dumps = FlowerDumps(clean_errors=(ConfigError, RunFailed, FileExistsError)).install(flwr_logger)
    try:
        try:
            config = AppConfig.from_run_config(context.run_config)
        except ConfigError as err:
            log.error("%s", err)
            raise
        run_server(grid, config, on_run_dir=lambda d: dumps.attach_file(d / STRATEGY_LOG))
    finally:
        dumps.detach_file()


# ------------------------------------------------------------------ files
def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path``, atomically and owner-only (never half-written)."""
    atomic_write(path, lambda f: torch.save(obj, f))


# ------------------------------------------------------------------ evaluation
def make_evaluate_fn(config: AppConfig):
    """Central evaluation of the global model on the dataset's test split."""
    _, test = load_dataset(config.dataset, config.data_dir, config.test_fraction, DEFAULT_DATA_SEED)
    x, y = test.tensors
    val = load_validation(config.dataset, config.data_dir, config.test_fraction, DEFAULT_DATA_SEED,
                          config.validation_fraction).tensors if config.validation_fraction > 0 else None
    model = build_model(config.dataset, config.model)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate_model(model, x, y)
        metrics: dict[str, Any] = {"accuracy": float(acc), "loss": float(loss)}  # test (held-out) accuracy
        if val is not None:  # the split to tune on (validation-fraction)
            val_loss, val_acc = evaluate_model(model, val[0], val[1])
            metrics.update({"val-accuracy": float(val_acc), "val-loss": float(val_loss)})
        return MetricRecord(metrics)

    return evaluate_fn


# ------------------------------------------------------------------ run
@dataclass
class ServerOutcome:
    """What a finished server run produced (for tests and callers)."""

    run_dir: Path
    accountant: PrivacyAccountant
    strategy: NoisyStrategyMixin
    result: Result
    summary: dict[str, Any]


def _legacy_levels(config: AppConfig, header: dict[str, Any]) -> float:
    """The screening levels an open round of a ledger that predates their record is charged (docs/MATH.md §17.1):
    the larger of the levels the run started with (the header's app_config) and the resumed run's (review V1: the
    resumed run's alone may now be 0, update-bound-alpha 0 turning its check off)."""
    app_config = header.get("app_config")
    started: dict[str, Any] = app_config if isinstance(app_config, dict) else {}
    recorded = 0.0
    for key in ("noise-check-alpha", "update-bound-alpha"):
        value = started.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0:
            recorded += float(value)
    return max(config.noise_check_alpha + config.update_bound_alpha, recorded)


def _open_ledger(config: AppConfig, run_dir: Path) -> tuple[PrivacyLedger, PrivacyAccountant, ArrayRecord | None]:
    """Create a ledger, or resume one: (ledger, rebuilt accountant, saved model or None).

    Every check of a resume runs before anything is written: a refused resume leaves the
    ledger byte for byte as it was.
    """
    acct_cfg = config.accountant_config()
    path = run_dir / LEDGER
    if not config.resume or (path.exists() and path.stat().st_size == 0):  # empty: creation interrupted, nothing spent
        ledger = PrivacyLedger.create(path, accountant_config=acct_cfg.to_dict(), app_config=config.to_run_config())
        return ledger, PrivacyAccountant(acct_cfg), None
    _require_ledger(path)
    contents = PrivacyLedger.check_resumable(path, accountant_config=acct_cfg.to_dict())
    moved = data_split_changes(contents.header, config.to_run_config())  # review R1: the split is kept
    if moved is not None:
        log.error("cannot resume %s: %s", path, moved)
        raise RunFailed(f"cannot resume {path}: {moved}", logged=True)
    ckpt_round, arrays = _checkpoint(run_dir, contents)
    try:  # the library's one resume rule (reporting/resume.py): checks, then resume event, lost rounds, open round
        ledger, accountant, _ = resume_ledger(path, acct_cfg, checkpoint_round=ckpt_round,
                                              unfinished=config.resume_unfinished_round, plan=config.resumable_plan(),
                                              option="resume-unfinished-round",
                                              legacy_screening_levels=_legacy_levels(config, contents.header))
    except ResumeRefused as err:
        log.error("%s", err)
        raise RunFailed(str(err), logged=True) from None
    return ledger, accountant, arrays


def _require_ledger(path: Path) -> None:
    """``resume = true`` needs the ledger: raise RunFailed naming the path it looked for."""
    if not path.exists():
        message = (
            f"resume = true but there is no privacy ledger at {path}; refusing to start a fresh run that "
            "would forget the privacy already spent. Check 'run-name' and 'output-dir' (a relative "
            "output-dir resolves against the ServerApp's working directory); set resume = false to start "
            "a new run."
        )
        log.error("%s", message)
        raise RunFailed(message, logged=True)


def _checkpoint(run_dir: Path, contents: LedgerContents) -> tuple[int, ArrayRecord | None]:
    """(round, model) of ``model-latest.pt`` (the library's :class:`ModelCheckpoint` format); (0, None)
    before any round. Reads only."""
    if not contents.rounds and contents.open_round is None:
        return 0, None
    checkpoint = ModelCheckpoint(run_dir / CHECKPOINT)
    if not checkpoint.path.exists():
        if contents.rounds:
            log.warning("%s is missing but the ledger has %d round(s) (a crash before the first checkpoint): "
                        "resuming from the initial model; every accounted round stays accounted",
                        checkpoint.path, len(contents.rounds))
        return 0, None
    return checkpoint.saved_round(), checkpoint.saved_model()


def run_server(grid: Grid, config: AppConfig, *, fraction_evaluate: float = 0.0,
               on_run_dir: Callable[[Path], None] | None = None) -> ServerOutcome:
    """Run the whole server side on ``grid``; returns the outcome after writing every output.
    A failure is logged at ERROR in one message, a full disk saying how to resume (:func:`logged_failures`)."""
    with logged_failures((Path(config.output_dir).expanduser() / config.run_name).resolve()):
        return _run_server(grid, config, fraction_evaluate, on_run_dir)


def _run_server(grid: Grid, config: AppConfig, fraction_evaluate: float,
                on_run_dir: Callable[[Path], None] | None) -> ServerOutcome:
    t0 = time.time()
    torch.set_num_threads(1)
    if config.seed >= 0:  # node sampling (random.sample) and model init become reproducible
        random.seed(config.seed)
        torch.manual_seed(config.seed)
    try:
        log_preflight(config, log)  # calibrated sigma, early budget stop, noise
    except ConfigError as err:  # the budget fits no round: said in the log that `flwr log` shows
        log.error("%s", err)
        raise
    for warning in start_warnings(config, grid):  # fixed seed; cohort collusion outside simulation (issue 28)
        log.warning("%s", warning)
    run_dir = (Path(config.output_dir).expanduser() / config.run_name).resolve()
    if config.resume:
        _require_ledger(run_dir / LEDGER)  # before any folder is made
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    log.info("run directory: %s", run_dir)
    if on_run_dir is not None:
        on_run_dir(run_dir)

    ledger, accountant, arrays = _open_ledger(config, run_dir)
    accounted_before = accountant.num_releases
    exporter = None
    try:
        if config.metrics_port > 0:
            exporter = _start_exporter(config)
        if arrays is None:
            arrays = ArrayRecord(build_model(config.dataset, config.model).state_dict())
        checkpoint = ModelCheckpoint(run_dir / CHECKPOINT)  # the released model and the server's state
        sink = RoundSink(ledger, checkpoint.save, log, exporter, config.budget_epsilon,
                         members=run_dir / MEMBERS_FILE if config.sample_secrecy == "secret" else None)
        per_round_eval = publishes_per_round_models(config)
        if not per_round_eval:  # docs/MATH.md §15
            log.info("final-model: no per-round evaluation is published; the released model is evaluated at the end")
        strategy = make_strategy(config, accountant, sinks=[sink],
                                 fraction_evaluate=fraction_evaluate if per_round_eval else 0.0)
        if config.resume:
            restore_exclusions(strategy, read_ledger(run_dir / LEDGER).events  # a secret sample's: members file
                               + (member_events(run_dir / MEMBERS_FILE) if config.sample_secrecy == "secret" else []))
            if config.sample_secrecy == "secret":  # this segment's claims apart from the last one's
                MembersSink(run_dir / MEMBERS_FILE).mark_resume(accountant.num_releases)
            checkpoint.restore(strategy)  # the server optimizer and average (server_opt.py); the model was read above
        else:
            checkpoint.attach(strategy)
        remaining = max(config.num_server_rounds - accountant.num_releases, 0)
        log.info("%s: %d rounds to run (%d already accounted)", type(strategy).__name__, remaining,
                 accountant.num_releases)
        try:
            result = strategy.start(grid=run_grid(grid, config), initial_arrays=arrays, num_rounds=remaining,
                                    evaluate_fn=make_evaluate_fn(config) if per_round_eval else None)
        except (NotEnoughNodes, ModelNotFinite) as exc:
            log.error("%s", exc)
            public = exc.counts if isinstance(exc, NotEnoughNodes) and config.sample_secrecy == "secret" else str(exc)
            ledger.append_event(FAILED_EVENT, {"reason": public, "rounds_accounted": accountant.num_releases})
            _finish(config, run_dir, ledger, accountant, strategy, strategy.partial_result(), time.time() - t0,
                    failure=str(exc))
            raise RunFailed(str(exc), logged=True) from None
        if strategy.stop_reason is not None and exporter is not None:
            exporter.mark_budget_exhausted()
        trained = accountant.num_releases - accounted_before  # the strategy wrote budget-stop and end events
        if exporter is not None:
            exporter.set_ledger_head(ledger.head_line_hash)
        summary = _finish(config, run_dir, ledger, accountant, strategy, result, time.time() - t0)
        if trained == 0:
            why = strategy.stop_reason or (f"all {config.num_server_rounds} rounds were already accounted (raise "
                                           "num-server-rounds to train more)" if remaining == 0
                                           else "no round could be accounted")
            raise RunFailed(f"the run accounted no round, so nothing was trained: {why}")  # logged by run_server
        if exporter is not None and config.metrics_linger > 0:
            log.info("serving the final metrics on port %d for %.0f s (metrics-linger)",
                     exporter.port, config.metrics_linger)
            time.sleep(config.metrics_linger)
    finally:
        ledger.close()
        if exporter is not None:
            exporter.close()
    return ServerOutcome(run_dir, accountant, strategy, result, summary)


def _start_exporter(config: AppConfig) -> PrivacyMetricsExporter:
    exporter = PrivacyMetricsExporter(config.metrics_port, config.metrics_host, certfile=config.metrics_certfile,
                                      keyfile=config.metrics_keyfile, auth_file=config.metrics_auth_file)
    exporter.set_min_replies(config.min_replies)
    scheme = "https" if exporter.tls else "http"
    log.info("Prometheus metrics at %s://%s:%d/metrics%s", scheme, config.metrics_host, exporter.port,
             " (basic auth)" if exporter.authenticated else "")
    if config.metrics_host not in ("127.0.0.1", "localhost", "::1") and not (exporter.tls and exporter.authenticated):
        log.warning("the metrics endpoint listens on %s without %s: anyone who can reach the port reads the "
                    "run's privacy numbers%s", config.metrics_host,
                    " and ".join(x for x, on in (("TLS", exporter.tls), ("basic auth", exporter.authenticated)) if not on),
                    "" if exporter.tls else " in clear text")
    return exporter


def _finish(config: AppConfig, run_dir: Path, ledger: PrivacyLedger, accountant: PrivacyAccountant,
            strategy: NoisyStrategyMixin, result: Result, seconds: float, failure: str | None = None) -> dict[str, Any]:
    """Final model, summary table, plot and summary.json."""
    final = strategy.global_arrays if strategy.global_arrays is not None else result.arrays
    atomic_torch_save(final.to_torch_state_dict(), run_dir / FINAL_MODEL)
    history = [{"round": e["round"], "report": e["report"], "metrics": e.get("metrics", {})} for e in ledger.rounds]
    plot = None
    if history:
        log.info("\n%s", render_summary(history))
        plot = str(plot_privacy_curve(history, run_dir / PLOT, delta=config.delta, run_config=config.to_run_config()))
    last_metrics = history[-1]["metrics"] if history else {}
    if not publishes_per_round_models(config):  # evaluate only the released model (docs/MATH.md §15)
        last_metrics = dict(make_evaluate_fn(config)(accountant.num_releases, final))
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "rounds_accounted": accountant.num_releases,
        "num_server_rounds": config.num_server_rounds,
        "planned_rounds": config.num_server_rounds,
        "accounted_rounds": accountant.num_releases,
        "stopped_by_budget": strategy.stop_reason is not None,
        "stop_reason": strategy.stop_reason,
        "failure": failure,
        "target_epsilon": config.target_epsilon,
        "final_report": accountant.report().to_dict(),
        "threat_model_assumes": final_model_assumptions(config) if config.threat_model == "final-model" else [],
        "final_accuracy": last_metrics.get("accuracy"),
        "final_loss": last_metrics.get("loss"),
        "final_val_accuracy": last_metrics.get("val-accuracy"),  # validation-fraction > 0
        "warnings": [w for w in [chance_level_warning(config, last_metrics.get("accuracy"))] if w],  # near chance
        "echo_mismatches": strategy.echo_mismatches,
        "node_assumptions": node_assumptions(config) + ([shared_statistics_note(config.batch_sampling == "poisson")]
                                                        if strategy.shared_statistics.nodes else []),
        "node_refusals": {str(n): r.to_dict() for n, r in sorted(strategy.refusals.items())},
        "excluded_nodes": {str(n): why for n, why in sorted(strategy.excluded_nodes.items())},
        "wall_seconds": seconds,
        "ledger_head": ledger.head_line_hash,  # SHA-256 of the ledger's last line: compare with `verify`
        "files": {"ledger": str(run_dir / LEDGER), "final_model": str(run_dir / FINAL_MODEL), "plot": plot},
        "app_config": config.to_run_config(),
        "accountant_config": accountant.config.to_dict(),
    }
    write_json(run_dir / SUMMARY, summary)
    for warning in summary["warnings"]:
        log.warning("%s", warning)
    cert, assumes = summary["final_report"]["certified"], summary["threat_model_assumes"]
    log.info("finished: %d of %d planned rounds accounted, certified epsilon %s (mu %s, %s, replace-one%s) at "
             "delta %s; add/remove-one epsilon %s%s%s", accountant.num_releases, config.num_server_rounds,
             cert["epsilon"], cert["mu"], cert["bound"], conditional_note(cert), delta_text(summary["final_report"]),
             summary["final_report"]["add_remove"]["epsilon"],
             f"; final-model bound assumes {'; '.join(assumes)}; released model accuracy {summary['final_accuracy']}"
             if assumes else "", f"; stopped: {strategy.stop_reason}" if strategy.stop_reason else "")
    log.info("every bound assumes %s", "; ".join(summary["node_assumptions"]))
    if accountant.num_releases < config.num_server_rounds:
        log.warning("the run ends with %d of its %d planned rounds accounted%s", accountant.num_releases,
                    config.num_server_rounds, f" ({failure or strategy.stop_reason})"
                    if (failure or strategy.stop_reason) else "")
    log.info("ledger %s head (SHA-256 of its last line, for `fl-dp-flower verify`): %s",
             run_dir / LEDGER, ledger.head_line_hash)
    if strategy.excluded_nodes:
        log.error("nodes no longer sampled after %d consecutive refusals: %s", config.max_node_refusals,
                  "; ".join(f"node {n} ({why})" for n, why in sorted(strategy.excluded_nodes.items())))
    return summary
