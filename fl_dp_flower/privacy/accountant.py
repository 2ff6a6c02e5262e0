"""The server-side f-DP accountant: one report per round, replayable and durable.

It consumes :class:`RoundRecord` s (each round as it actually ran) and keeps, in
amortized O(1) per round:

- ``composition``: sqrt(sum_t (gamma_t / s_t)^2)       -- every global model is visible
- ``local_dp``:    sqrt(sum_t (Gamma_t / sigma_t)^2)  -- a curious server sees each upload
- ``secure_aggregation``: composition's mu, only under that threat model (docs/MATH.md §20)
- ``final_model``: online PAVA optimum (docs/MATH.md §14.3)    -- only the last model is released
- ``paper``:       Theorem 3/4 closed form at the worst round's m and sigma (docs/MATH.md §5).
  Flagged ``sound=False`` for constant/cyclic FedAvg and FedProx (docs/MATH.md §7.3) and
  whenever the rounds did not run exactly as planned (the closed forms assume
  identical rounds).

The **certified** guarantee is the smallest sound bound that the configured threat
model admits; budgets are checked against it, never against an unsound number.

The public shape mirrors Flower's ``flwr.serverapp.PrivacyAccountant`` protocol
(``config``, ``num_releases``, ``get_epsilon``, ``get_delta``, ``get_privacy_spent``,
``would_exceed``; rebuilt from the ledger's records with ``from_records``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from . import gdp
from .bounds import ADD_REMOVE_RELATION, BoundValue, add_remove_certified, bound_assumptions, certified_bound, paper_is_sound
from .closed_forms import paper_mu
from .final_model import OnlineFinalModel
from .records import BOUND_NAMES, AccountantConfig, RoundRecord
from .client_sampling import CONDITIONED_BOUND, SecretSampleAccount
from .sampled import SAMPLED_BOUND, SampledAccount
from .screening_charge import screening_charge
from .sample_sampling import BATCH_SAMPLED_BOUND, BatchSampledAccount
from .running_sum import RunningSum
from .secure_aggregation import REAL_SUM_LABEL, SecureSumAccount, amend_secure_aggregation, rdp_delta, warn_planning_only
from .schedules import step_sizes
from .terms import RoundTerms, round_terms
from .report import ACCOUNTING_METHOD, REPORT_RDP_ORDERS, Budget, PrivacyReport, PrivacySpent

__all__ = ["ACCOUNTING_METHOD", "REPORT_RDP_ORDERS", "Budget", "PrivacyAccountant", "PrivacyReport", "PrivacySpent"]

def _ratio_sq(numerator: float, denominator: float) -> float:
    return (numerator / denominator) ** 2


class PrivacyAccountant:
    """Stateful accountant over a sequence of :class:`RoundRecord` s.

    Rounds must arrive in order (``record.round == previous + 1``; the first
    record may have any round number, e.g. 1). The accountant never forgets a
    round: there is no way to remove one.
    """

    def __init__(self, config: AccountantConfig) -> None:
        if not isinstance(config, AccountantConfig):
            raise TypeError("config must be an AccountantConfig")
        self._config = config
        self._records: list[RoundRecord] = []
        self._composition = RunningSum()
        self._local = RunningSum()
        self._final = OnlineFinalModel()
        # the same three bounds under add/remove-one (docs/MATH.md §16)
        self._composition_ar = RunningSum()
        self._local_ar = RunningSum()
        self._final_ar = OnlineFinalModel()
        self._uses_smoothness = False  # some round's sensitivity used the per-sample drift bound
        self._min_clients: int | None = None
        self._min_sigma: float | None = None
        self._as_planned = True
        self._applied = 0  # rounds whose aggregate reached the released model
        self._screening_drop = 0.0  # sum of the rounds' screening_drop (docs/MATH.md §17.1)
        q = config.sampling_rate  # Poisson client sampling: the amplified bound (docs/MATH.md §19)
        self._sampled = None if q is None else SampledAccount(q, config.colluders)
        # a secret sample: the bound conditioned on each round's count (docs/MATH.md §22)
        self._secret = SecretSampleAccount(config.colluders) if config.sample_secrecy == "secret" else None
        grid = config.sum_grid_step  # secure aggregation's integer sum (docs/MATH.md §20.4)
        warn_planning_only(config.threat_model, grid)
        self._secure = None if grid is None else SecureSumAccount(grid, config.sum_dimension or 0, config.colluders,
                                                                 config.sum_clients_per_upload)
        self._batch = None if config.batch_rate is None else BatchSampledAccount(  # docs/MATH.md §23
            config.threat_model, config.smoothness, config.colluders, client_sampled=q is not None)

    # ------------------------------------------------------------ protocol shape
    @property
    def config(self) -> AccountantConfig:
        return self._config

    @property
    def num_releases(self) -> int:
        """Number of rounds accounted."""
        return len(self._records)

    @property
    def records(self) -> tuple[RoundRecord, ...]:
        return tuple(self._records)

    def get_epsilon(self, delta: float) -> float:
        return self.report(delta).certified.epsilon

    def get_delta(self, epsilon: float) -> float:
        report = self.report()
        if report.certified_bound == SAMPLED_BOUND and self._sampled is not None:
            delta = self._sampled.replace_one.delta(epsilon)
        elif report.certified_bound == CONDITIONED_BOUND and self._secret is not None:
            delta = self._secret.composition.delta(epsilon)
        elif report.certified_bound == BATCH_SAMPLED_BOUND and self._batch is not None:
            delta = self._batch.replace_one.delta(epsilon)
        elif report.rdp_curve is not None and self._secure is not None:  # RDP -> delta (docs/MATH.md §20.4)
            delta = rdp_delta(report.rdp_curve[1], report.rdp_curve[0], epsilon, self._secure.log_clamp)
        else:
            delta = gdp.delta(report.certified.mu, epsilon)  # plus the screening drops' charge (MATH §17.1):
        return float(screening_charge(self._screening_drop, epsilon, delta, self._config.threat_model).get("delta_total", delta))

    def get_privacy_spent(self, delta: float | None = None) -> PrivacySpent:
        d = self._config.delta if delta is None else delta
        report = self.report(d)
        mu = report.certified.mu
        return PrivacySpent(
            epsilon=report.certified.epsilon,
            delta=report.delta_total,  # d plus the screening drops' charge (docs/MATH.md §17.1)
            num_releases=self.num_releases,
            accounting_method=ACCOUNTING_METHOD if report.rdp_curve is None else "skellam-rdp",
            mu=mu,
            bound=report.certified_bound,
            planning_only=REAL_SUM_LABEL in report.certified.assumes,  # no certificate (MATH §20.2)
        )

    # ------------------------------------------------------------------- rounds
    def step(self, record: RoundRecord) -> PrivacyReport:
        """Account one round as it ran and return the report after it."""
        terms = self._terms_for(record)
        self._apply(record, terms)
        return self.report()

    def extend(self, records: Iterable[RoundRecord]) -> None:
        """Account several rounds without building the intermediate reports (replay)."""
        for record in records:
            self._apply(record, self._terms_for(record))

    def would_exceed(self, record: RoundRecord, budget: Budget) -> bool:
        """Dry run: would accounting ``record`` push the guarantee past ``budget`` (:meth:`Budget.exceeded_by`: the
        certified epsilon, or the delta it holds at with the screening drops' charge)?

        O(1) amortised (no copy of the accountant): every bound is evaluated as it would be
        after the round, bit for bit, and nothing is changed.
        """
        return budget.exceeded_by(self._peek(record, budget.delta, certified_only=True))

    def peek(self, record: RoundRecord, delta: float | None = None) -> PrivacyReport:
        """The report :meth:`step` would return for ``record``, without accounting it."""
        return self._peek(record, delta)

    def peek_epsilon(self, record: RoundRecord, delta: float | None = None) -> float:
        """``peek(record, delta).certified.epsilon``, the same float, without what the certified epsilon does
        not read (the add/remove-one PLDs of the ``sampled`` and ``batch_sampled`` bounds: a convolution and an
        epsilon query less each). The budget check and the strategy's expected increase ask only this."""
        return self._peek(record, delta, certified_only=True).certified.epsilon

    def _peek(self, record: RoundRecord, delta: float | None = None, certified_only: bool = False) -> PrivacyReport:
        terms = self._terms_for(record)
        comp = _ratio_sq(terms.gamma, terms.target_noise_std)
        local = _ratio_sq(terms.client_sensitivity, terms.sigma) if record.weights else 0.0  # none uploaded
        composition = math.sqrt(max(self._composition.value_with(comp), 0.0))
        final = self._final.peek(terms.log_rho, terms.gamma, terms.noise_std) if record.applied else self._final.mu
        m = max(record.clients, 1)  # a sampled round with no contribution: the paper's form needs m >= 1
        clients = m if self._min_clients is None else min(self._min_clients, m)
        sigma = record.sigma if self._min_sigma is None else min(self._min_sigma, record.sigma)
        mus = {
            "paper": paper_mu(self._config, self.num_releases + 1, clients=clients, sigma=sigma),
            "composition": composition,
            "final_model": min(final, composition),
            "local_dp": math.sqrt(max(self._local.value_with(local), 0.0)),
        }
        comp_ar = math.sqrt(max(self._composition_ar.value_with(_ratio_sq(terms.gamma_add_remove,
                                                                          terms.target_noise_std)), 0.0))
        final_ar = (self._final_ar.peek(terms.log_rho, terms.gamma_add_remove, terms.noise_std) if record.applied
                    else self._final_ar.mu)
        ar_mus = {
            "composition": comp_ar,
            "final_model": min(final_ar, comp_ar),
            "local_dp": math.sqrt(max(self._local_ar.value_with(
                _ratio_sq(terms.client_sensitivity_add_remove, terms.sigma) if record.weights else 0.0), 0.0)),
        }
        first_round = self._records[0].round if self._records else record.round
        sound = self._soundness(as_planned=self._as_planned and self._matches_plan(record),
                                starts_at_one=first_round == 1)
        return self._report(mus, sound, record.round, self.num_releases + 1, record.clients, delta,
                            applied=self._applied + int(record.applied),
                            ar_mus=ar_mus, uses_smoothness=self._uses_smoothness or terms.uses_smoothness,
                            trial=self._sampled.peek(record, terms, not certified_only) if self._sampled else None,
                            secure_trial=self._secure_curves(record, terms),
                            secret_trial=self._secret.peek(record, terms) if self._secret else None,
                            batch_trial=self._batch.peek(record, terms, not certified_only) if self._batch else None,
                            screening_drop=self._screening_drop + record.screening_drop, certified_only=certified_only)

    def report(self, delta: float | None = None) -> PrivacyReport:
        """The running guarantee (epsilon at ``delta``, default the config's delta)."""
        last = self._records[-1] if self._records else None
        sound = self._soundness(self._as_planned, self._records_start_at_one())
        return self._report(self._mus(), sound, last.round if last else 0, self.num_releases,
                            last.clients if last else 0, delta, applied=self._applied, ar_mus=self._ar_mus(),
                            uses_smoothness=self._uses_smoothness, screening_drop=self._screening_drop)

    def _report(self, mus: dict[str, float], sound: dict[str, bool], round_: int, rounds: int, clients: int,
                delta: float | None = None, *, applied: int, ar_mus: dict[str, float],
                uses_smoothness: bool, trial: Any = None, secure_trial: Any = None,
                secret_trial: Any = None, batch_trial: Any = None, screening_drop: float = 0.0,
                certified_only: bool = False) -> PrivacyReport:
        d = self._config.delta if delta is None else delta
        asserted = self._config.assume_smooth_losses
        assumes = bound_assumptions(self._config.smoothness, uses_smoothness, self._config.threat_model)
        bounds = {
            name: BoundValue(mu=mus[name], epsilon=gdp.epsilon(mus[name], d), sound=sound[name],
                             assumes=assumes[name])
            for name in BOUND_NAMES
        }
        amend_secure_aggregation(self._config.threat_model, self._config.colluders, bounds, assumes, ar_mus,
                                 real_valued=self._secure is None)
        ar_name = add_remove_certified(self._config.threat_model, ar_mus, assumes, asserted)
        add_remove = {"bound": ar_name, "mu": ar_mus[ar_name], "epsilon": gdp.epsilon(ar_mus[ar_name], d),
                      "relation": ADD_REMOVE_RELATION}
        sampling = {} if self._sampled is None else self._sampled.amend(
            bounds, add_remove, self._config.threat_model, d, trial, add_remove_too=not certified_only)
        if self._secret is not None:
            sampling = self._secret.amend(bounds, add_remove, sampling, d, secret_trial)
        elif self._sampled is not None:
            sampling["secrecy"] = "public"
        curve = None if self._secure is None else self._secure.amend(bounds, add_remove, d, secure_trial)
        batch = {} if self._batch is None else self._batch.amend(bounds, add_remove, d, batch_trial, not certified_only)
        cert = certified_bound(self._config.threat_model, bounds, asserted)
        screening = screening_charge(screening_drop, bounds[cert].epsilon, d, self._config.threat_model,
                                     add_remove["epsilon"])
        return PrivacyReport(
            round=round_, rounds=rounds, delta=d, threat_model=self._config.threat_model, clients=clients,
            bounds=bounds, rounds_applied=applied, colluders=self._config.colluders,
            certified_bound=cert, add_remove=add_remove, sampling=sampling, rdp_curve=curve, screening=screening,
            batch_sampling=batch,
        )

    # -------------------------------------------------------------------- state
    @classmethod
    def from_records(cls, config: AccountantConfig, records: Iterable[RoundRecord]) -> "PrivacyAccountant":
        """Rebuild an accountant by replaying rounds.

        The one persisted form of an accountant is its configuration plus its round records, as
        the privacy ledger stores them (header + round lines, parsed with
        ``AccountantConfig.from_dict`` / ``RoundRecord.from_dict``); there is no separate state
        format to keep in step with it.
        """
        accountant = cls(config)
        accountant.extend(records)
        return accountant

    # ---------------------------------------------------------------- internals
    def _terms_for(self, record: RoundRecord) -> RoundTerms:
        if not isinstance(record, RoundRecord):
            raise TypeError("record must be a RoundRecord")
        if record.algorithm != self._config.algorithm:
            raise ValueError(
                f"record.algorithm {record.algorithm!r} does not match the accountant's {self._config.algorithm!r}"
            )
        if self._secret is not None and record.node_ids:  # the bound amplifies by the sample's secrecy (§22)
            raise ValueError("record.node_ids must be empty with sample_secrecy 'secret': a record that names its "
                             "members publishes the sample the sampled_secret bound takes to be secret (docs/MATH.md §22)")
        if self._records and record.round != self._records[-1].round + 1:
            raise ValueError(
                f"record.round must be {self._records[-1].round + 1} (rounds are accounted in order), got {record.round}"
            )
        # Poisson batches hold a random number of samples: the drift bound (B samples) does not apply (§23)
        return round_terms(record, self._config.smoothness, self._config.colluders,
                           self._config.assume_smooth_losses and record.batch_rate is None)

    def _apply(self, record: RoundRecord, terms: RoundTerms) -> None:
        self._records.append(record)
        self._composition.add(_ratio_sq(terms.gamma, terms.target_noise_std))
        self._local.add(_ratio_sq(terms.client_sensitivity, terms.sigma) if record.weights else 0.0)
        if record.applied:  # the released model saw only applied rounds (docs/MATH.md §14.3a)
            self._final.push(terms.log_rho, terms.gamma, terms.noise_std)
            self._final_ar.push(terms.log_rho, terms.gamma_add_remove, terms.noise_std)
            self._applied += 1
        self._composition_ar.add(_ratio_sq(terms.gamma_add_remove, terms.target_noise_std))
        self._local_ar.add(_ratio_sq(terms.client_sensitivity_add_remove, terms.sigma) if record.weights else 0.0)
        if self._sampled is not None:
            self._sampled.push(record, terms)
        if self._secret is not None:
            self._secret.push(record, terms)
        if self._secure is not None:
            self._secure.add(self._secure_curves(record, terms))
        if self._batch is not None:
            self._batch.push(record, terms)
        self._uses_smoothness = self._uses_smoothness or terms.uses_smoothness
        self._screening_drop += record.screening_drop
        m = max(record.clients, 1)
        self._min_clients = m if self._min_clients is None else min(self._min_clients, m)
        self._min_sigma = record.sigma if self._min_sigma is None else min(self._min_sigma, record.sigma)
        if self._as_planned:
            self._as_planned = self._matches_plan(record)

    def _secure_curves(self, record: RoundRecord, terms: RoundTerms) -> Any:
        """One round's Skellam RDP curves (replace-one, add/remove-one), or None without the integer sum."""
        if self._secure is None:
            return None
        return self._secure.curves(record.clients, terms.sigma, terms.client_sensitivity,
                                   terms.client_sensitivity_add_remove, record.clip_norm * math.fsum(record.step_sizes))

    def _matches_plan(self, record: RoundRecord) -> bool:
        """Whether ``record`` is the planned round (fields compared first; step sizes only then)."""
        c = self._config
        if not (
            record.clients == c.clients
            and record.local_steps == c.local_steps
            and record.clipping == c.clipping
            and record.batch_size == c.batch_size
            and record.prox_alpha == c.prox_alpha
            and math.isclose(record.sigma, c.sigma, rel_tol=1e-12)
            and math.isclose(record.clip_norm, c.clip_norm, rel_tol=1e-12)
            and all(math.isclose(p, 1.0 / record.clients, rel_tol=1e-12) for p in record.weights)
        ):
            return False
        planned = step_sizes(c.schedule, c.lr, record.round - 1, c.local_steps)
        return all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(record.step_sizes, planned))

    def _mus(self) -> dict[str, float]:
        if not self._records:
            return {name: 0.0 for name in BOUND_NAMES}
        composition = math.sqrt(max(self._composition.value, 0.0))
        return {
            "paper": paper_mu(
                self._config, self.num_releases, clients=self._min_clients, sigma=self._min_sigma
            ),
            "composition": composition,
            # The final-model optimum never exceeds composition (all-singleton PAVA);
            # the min guards against last-ulp rounding differences.
            "final_model": min(self._final.mu, composition),
            "local_dp": math.sqrt(max(self._local.value, 0.0)),
        }

    def _ar_mus(self) -> dict[str, float]:
        """composition, final_model and local_dp under add/remove-one (docs/MATH.md §16)."""
        composition = math.sqrt(max(self._composition_ar.value, 0.0))
        return {"composition": composition, "final_model": min(self._final_ar.mu, composition),
                "local_dp": math.sqrt(max(self._local_ar.value, 0.0))}

    def _soundness(self, as_planned: bool, starts_at_one: bool) -> dict[str, bool]:
        # with Poisson sampling the fixed-denominator aggregate breaks rho_t: no final-model analysis (§19.4)
        fixed = self._config.sampling_rate is None
        paper_sound = paper_is_sound(self._config.algorithm, self._config.schedule) and as_planned and starts_at_one
        return {"paper": paper_sound and fixed, "composition": True, "final_model": fixed, "local_dp": True}

    def _records_start_at_one(self) -> bool:
        return not self._records or self._records[0].round == 1

