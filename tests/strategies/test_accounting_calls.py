"""The server's accounting work per round stays bounded (issue 33, "the ledger line not the bottleneck").

A sampled round is dominated by privacy accounting: each epsilon query of a composed PLD walks its whole grid
(tens of milliseconds), each convolution is an FFT of it. The strategy asks the accountant, per round, for the
epsilon before the round, the budget checks (before the broadcast, with the replies that arrived), the expected
increase of a planned round and the report after the round; the accountant remembers each composed PLD's
epsilons and keeps every peeked trial of the round, so these questions cost 5 epsilon queries and 5
convolutions a round with a secret sample (the public ``sampled`` pair under both relations and the conditioned
``sampled_secret`` bound), budget or not. Before: 9 queries and 6 convolutions a round without a budget, 15
and 12 with one.
Counted with wrappers (not timed)."""

from __future__ import annotations

from collections import Counter

import pytest
from dp_accounting.pld import privacy_loss_distribution as pld

from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.strategies.noisy import NoisyStrategyMixin

SECRET = {"client-sampling": "poisson", "sampling-rate": 0.5, "clients-per-node": 4, "clients-per-round": 12,
          "colluding-clients": 0, "sample-secrecy": "secret", "num-server-rounds": 3}


def _counted(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, dict[int, Counter]]:
    """Count the PLD epsilon queries and convolutions, in all and inside each round's configure + aggregate."""
    calls: Counter = Counter()
    per_round: dict[int, Counter] = {}
    for name in ("get_epsilon_for_delta", "compose"):
        original = getattr(pld.PrivacyLossDistribution, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(pld.PrivacyLossDistribution, name, counting)
    for name in ("configure_train", "aggregate_train"):
        original = getattr(NoisyStrategyMixin, name)

        def in_round(self, server_round, *args, _original=original, **kwargs):
            before = Counter(calls)
            try:
                return _original(self, server_round, *args, **kwargs)
            finally:
                per_round.setdefault(server_round, Counter()).update(calls - before)
        monkeypatch.setattr(NoisyStrategyMixin, name, in_round)
    return calls, per_round


@pytest.mark.parametrize("budget", [None, 1e6])
def test_a_secret_sample_round_costs_five_epsilon_queries_and_five_convolutions(tmp_path, monkeypatch, budget):
    _, per_round = _counted(monkeypatch)
    off = {"noise-check-alpha": 0.0, "update-bound-alpha": 0.0}  # a budget of 1e6 fits no screening charge
    overrides = {} if budget is None else {"target-epsilon": budget, **off}
    out, _ = run_local(tiny_config(tmp_path, **SECRET, **overrides))
    report = out.accountant.report()
    assert out.accountant.num_releases == 3 and report.certified_bound == "sampled_secret"
    assert all(0 < report.bounds[b].epsilon < float("inf") for b in ("sampled", "sampled_secret"))  # PLDs composed
    assert report.add_remove["bound"] in ("sampled", "sampled_secret")
    for t in (2, 3):  # round 1 composes nothing (the first round's PLD is the composition)
        assert per_round[t]["get_epsilon_for_delta"] == 5, (t, per_round)
        assert per_round[t]["compose"] == 5, (t, per_round)
