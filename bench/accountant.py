"""Benchmark: per-round accountant update cost, side by side in one run.

For the same rounds (constant schedule, lr=0.1, K=5, V=1, m=20, sigma=1; the
aggregate of round t is a Gaussian mechanism with noise multiplier s/gamma) each
accountant accounts one more round and reports epsilon at delta=1e-5:

- ours:              PrivacyAccountant.step(record)  (all four bounds + certified eps)
- Flower RdpAccountant (flwr.serverapp, wraps dp-accounting RDP): compose + get_epsilon
- dp-accounting PLD: compose + get_epsilon

Then, over long runs (T = 1e4 and 1e5 rounds, stage-wise, some rounds with dropouts): the
per-round budget check (``would_exceed``, O(1) amortised: no copy of the accountant) and the
per-round replay of a ledger (``from_records``), each at the start and at the end of the run;
the time of a 1e6-round planned curve; and the final-model bound and planned terms at 1e5/1e6.
Prints ratios; no thresholds are asserted here (targets live in the README).

Run: .venv/bin/python bench/accountant.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import math
import time

from fl_dp_flower.privacy import AccountantConfig, Budget, PrivacyAccountant
from fl_dp_flower.privacy.final_model import final_model_mu
from fl_dp_flower.privacy.planned_bounds import planned_curve
from fl_dp_flower.privacy.planned_terms import planned_terms

DELTA = 1e-5


def _ours(config: AccountantConfig, rounds: int) -> float:
    acct = PrivacyAccountant(config)
    records = [config.planned_round(t + 1) for t in range(rounds)]
    start = time.perf_counter()
    for record in records:
        acct.step(record).certified.epsilon
    return (time.perf_counter() - start) / rounds


def _flower_rdp(noise_multiplier: float, m: int, rounds: int) -> float:
    from flwr.serverapp import RdpAccountant
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )

    acct = RdpAccountant(PrivacyConfig(target_delta=DELTA, population_size=m,
                                       neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                       sampling_method=SamplingMethod.NO_AMPLIFICATION))
    event = GaussianPrivacyEvent(noise_multiplier=noise_multiplier, sample_size=m, population_size=m)
    start = time.perf_counter()
    for _ in range(rounds):
        acct.compose(event)
        acct.get_epsilon(DELTA)
    return (time.perf_counter() - start) / rounds


def _pld(noise_multiplier: float, rounds: int) -> float:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.GaussianDpEvent(noise_multiplier=noise_multiplier)
    start = time.perf_counter()
    for _ in range(rounds):
        acct.compose(event)
        acct.get_epsilon(DELTA)
    return (time.perf_counter() - start) / rounds


def _long_run(rounds: int) -> tuple[float, float, float]:
    """(budget check s/round at the start, at the end, replay s/round) over ``rounds`` rounds."""
    cfg = AccountantConfig(schedule="stage", lr=0.1, local_steps=5, clip_norm=1.0, clients=20, sigma=1.0,
                           smoothness=1.0, threat_model="final-model")
    records = [cfg.planned_round(t + 1, clients=20 if t % 7 else 13) for t in range(rounds)]
    start = time.perf_counter()
    acct = PrivacyAccountant.from_records(cfg, records[:-1])
    replay = (time.perf_counter() - start) / (rounds - 1)
    budget = Budget(epsilon=1e9, delta=DELTA)
    early = PrivacyAccountant.from_records(cfg, records[:10])

    def per_check(a: PrivacyAccountant, rec) -> float:
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            a.would_exceed(rec, budget)
        return (time.perf_counter() - t0) / n

    return per_check(early, records[10]), per_check(acct, records[-1]), replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--pld-rounds", type=int, default=50)
    parser.add_argument("--curve-rounds", type=int, default=1_000_000)
    args = parser.parse_args()

    m, sigma = 20, 1.0
    config = AccountantConfig(schedule="constant", lr=0.1, local_steps=5, clip_norm=1.0,
                              clients=m, sigma=sigma, smoothness=1.0)
    gamma = 2 * 0.1 * 5 * 1.0 / m
    noise_multiplier = (sigma / math.sqrt(m)) / gamma

    ours = _ours(config, args.rounds)
    rdp = _flower_rdp(noise_multiplier, m, args.rounds)
    pld = _pld(noise_multiplier, args.pld_rounds)
    print("per-round update + epsilon report (seconds per round)")
    print(f"  ours (4 bounds, certified)      {ours * 1e3:10.3f} ms   ({args.rounds} rounds)")
    print(f"  Flower RdpAccountant            {rdp * 1e3:10.3f} ms   ({args.rounds} rounds)")
    print(f"  dp-accounting PLD               {pld * 1e3:10.3f} ms   ({args.pld_rounds} rounds)")
    print(f"  speed-up vs Flower RDP          {rdp / ours:10.1f}x")
    print(f"  speed-up vs dp-accounting PLD   {pld / ours:10.1f}x   (target >= 100x)")

    for rounds in (10_000, 100_000):
        early, late, replay = _long_run(rounds)
        print(f"T = {rounds:>7,}: budget check {early * 1e6:7.1f} us/round at t = 10, {late * 1e6:7.1f} us/round "
              f"at t = T ({late / early:.2f}x); replay {replay * 1e6:6.1f} us/round")

    c = AccountantConfig(schedule="stage", lr=0.1, local_steps=5, clip_norm=1.0, clients=m, sigma=sigma,
                         smoothness=1.0)
    log_rho, gamma = planned_terms(c, 100_000)
    start = time.perf_counter()
    final_model_mu(log_rho, gamma, [sigma / math.sqrt(m)] * 100_000)
    print(f"final-model bound over 100,000 stage-wise rounds: {time.perf_counter() - start:.3f} s")
    c = AccountantConfig(schedule="iterative", lr=0.1, local_steps=5, clip_norm=1.0, clients=m, sigma=sigma,
                         smoothness=1.0, clipping="per-sample", batch_size=8)
    start = time.perf_counter()
    planned_terms(c, 1_000_000)
    print(f"planned terms of 1,000,000 iterative per-sample rounds: {time.perf_counter() - start:.3f} s")

    for schedule in ("constant", "stage"):
        cfg = AccountantConfig(schedule=schedule, lr=0.1, local_steps=5, clip_norm=1.0,
                               clients=m, sigma=sigma, smoothness=1.0)
        start = time.perf_counter()
        curve = planned_curve(cfg, args.curve_rounds)
        elapsed = time.perf_counter() - start
        last = {k: float(v[-1]) for k, v in curve.items()}
        print(f"{args.curve_rounds:,}-round planned curve ({schedule}): {elapsed:.2f} s; "
              f"final mu: " + ", ".join(f"{k}={v:.4g}" for k, v in last.items()))


if __name__ == "__main__":
    main()
