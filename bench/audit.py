"""Benchmark: the privacy audit at 100,000 trials per world, T = 100, for the final-model and the
all-rounds adversary, and vectorised trials against one trial at a time, side by side.

Configuration: the README's audit example (constant schedule, m = 20, K = 5, lr = 0.05,
sigma = 0.5, V = 1, L = 1, T = 100, linear canary). Prints
1. the whole audit (canary run with 100,000 evaluation + 100,000 shadow trials per world, attack,
   verdicts) for each adversary: seconds, and the ratio to the 120 s target (<= 1 meets it). The
   all-rounds adversary runs the canary client's update in both worlds (one more local update per
   round);
2. trials per second of the vectorised canary run against the same code run one trial per world at
   a time (a few repetitions), and their ratio.

Run: .venv/bin/python bench/audit.py [--trials 100000] [--single 3]
No thresholds are asserted here.
"""

from __future__ import annotations

import argparse
import time

import torch

from fl_dp_flower.audit.canary import run_canary
from fl_dp_flower.audit.run import run_audit
from fl_dp_flower.privacy.records import AccountantConfig

TARGET_SECONDS = 120.0
CONFIG = AccountantConfig(algorithm="fedavg", schedule="constant", lr=0.05, local_steps=5, clip_norm=1.0,
                          clients=20, sigma=0.5, smoothness=1.0, delta=1e-5)
ROUNDS = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100_000)
    parser.add_argument("--single", type=int, default=3, help="repetitions of the one-trial run")
    args = parser.parse_args()
    torch.set_num_threads(2)

    seconds, canary_seconds = {}, {}
    for adversary in ("final-model", "all-rounds"):
        started = time.perf_counter()
        report = run_audit(CONFIG, ROUNDS, adversary=adversary, trials=args.trials)
        total = seconds[adversary] = time.perf_counter() - started
        canary_seconds[adversary] = report.seconds
        print(f"audit ({adversary}), {args.trials:,} trials/world (+ as many shadow), T = {ROUNDS}: {total:.1f} s "
              f"(canary run {report.seconds:.1f} s); target {TARGET_SECONDS:.0f} s; ratio "
              f"{total / TARGET_SECONDS:.2f} ({'meets' if total <= TARGET_SECONDS else 'misses'} the target)")
        print(f"  mu_lower {report.attack.mu_lower:.4f}, epsilon_lower {report.attack.epsilon_lower:.4f}; "
              + ", ".join(f"{v.bound} {v.outcome}" for v in report.verdicts))
    print(f"all-rounds / final-model time: {seconds['all-rounds'] / seconds['final-model']:.2f}")

    final_rate = 4 * args.trials / canary_seconds["final-model"]  # trials (both worlds, shadow + evaluation) per second
    single = []
    for rep in range(args.single):
        single.append(run_canary(CONFIG, ROUNDS, 1, 0, seed=rep, statistics=False).seconds)
    single_rate = 2 / (sum(single) / len(single))
    print(f"canary trials/s: vectorised {final_rate:,.0f}, one at a time {single_rate:,.1f}; "
          f"ratio {final_rate / single_rate:,.0f}x")


if __name__ == "__main__":
    main()
