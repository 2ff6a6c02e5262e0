"""Benchmark: the server's accounting of a sampled round (issue 33, "the ledger line not the bottleneck").

The cross-device preset's accountant (N = 3,600 one-image clients, q = 0.1, one colluder, secret sample,
delta 1e-5) accounts ``--rounds`` rounds whose counts are Poisson draws (fixed seed), asked per round what
the strategy asks: the certified epsilon before the round, the budget check before the broadcast and with
the replies that arrived (``--budget``), the expected increase of a planned round, and the report after the
round. Prints seconds per round and, per round, the PLD epsilon queries, convolutions and single-round
Gaussian PLD builds (counted with wrappers), and a digest of every number asked (equal digests: equal
numbers, e.g. before and after a change of this code).

Run: .venv/bin/python bench/sampled_round.py [--rounds 20] [--budget]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections import Counter

from dp_accounting.pld import privacy_loss_distribution as pld

from fl_dp_flower.privacy import AccountantConfig, Budget, PrivacyAccountant

COUNTS: Counter = Counter()


def _count(owner: object, name: str, label: str) -> None:
    original = getattr(owner, name)

    def counted(*args: object, **kwargs: object) -> object:
        COUNTS[label] += 1
        return original(*args, **kwargs)
    setattr(owner, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--budget", action="store_true", help="check a (large) budget twice a round, as a run does")
    args = parser.parse_args()
    _count(pld.PrivacyLossDistribution, "get_epsilon_for_delta", "epsilon queries")
    _count(pld.PrivacyLossDistribution, "compose", "convolutions")
    _count(pld, "_create_pld_pmf_from_monotone_privacy_loss", "Gaussian builds")
    config = AccountantConfig(lr=0.5, local_steps=1, clip_norm=1.0, clients=360, sigma=0.05113, clipping="per-batch",
                              batch_size=1, colluders=1, sampling_rate=0.1, sample_secrecy="secret", population=3600)
    budget = Budget(1e6, config.delta) if args.budget else None
    rng = random.Random(1)
    records = [config.planned_round(t, clients=sum(rng.random() < 0.1 for _ in range(3600)))
               for t in range(1, args.rounds + 1)]
    acct, digest = PrivacyAccountant(config), hashlib.sha256()
    start = time.perf_counter()
    for record in records:
        planned = config.planned_round(record.round)
        asked: list[object] = [acct.report().certified.epsilon]
        if budget is not None:
            asked += [acct.would_exceed(planned, budget), acct.would_exceed(record, budget)]
        peek_epsilon = getattr(acct, "peek_epsilon", None)  # absent before issue 33: the full peek
        asked.append(peek_epsilon(planned) if peek_epsilon else acct.peek(planned).certified.epsilon)
        asked.append(acct.step(record).to_dict())
        digest.update(json.dumps(asked, sort_keys=True).encode())
    seconds = time.perf_counter() - start
    per_round = ", ".join(f"{v / args.rounds:.2f} {k}" for k, v in sorted(COUNTS.items()))
    print(f"{args.rounds} rounds{' with a budget' if budget else ''}: {seconds / args.rounds:.3f} s/round; "
          f"per round {per_round}; certified epsilon {acct.report().certified.epsilon:.6f}; "
          f"digest {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
