"""Poisson batch sampling on the node (docs/MATH.md §23): the local update, the wire contract, the node's
guardrail, the server's record and an end-to-end run whose ledger certifies the amplified bound while no
reply, metric or ledger line says which samples were drawn."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import MetricRecord

from fl_dp_flower import protocol
from fl_dp_flower.node import check_node_policy
from fl_dp_flower.privacy.sample_sampling import BATCH_SAMPLED_BOUND
from fl_dp_flower.protocol import Refused, TrainInstruction
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.strategies.replies import Usable, batch_rate, parse_applied
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.training.local_update import local_update


class _Linear(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x @ self.w


def _linear_loss(out, _y):
    return out.mean()  # per sample: grad = x (clipped to V), the model's weights do not matter


def _draws(seed, n, q, steps):
    g = torch.Generator().manual_seed(seed)
    return [torch.nonzero(torch.rand(n, generator=g) < q).flatten() for _ in range(steps)]


def test_poisson_step_is_the_clipped_sum_over_the_expected_batch_size():
    """K = 2 on a linear loss: each step moves by -eta clip_V(sum_{j in S_k} clip_V(x_j) / B), S_k the
    Poisson draw of that step (rate B/n) with the same generator; the stats report B, not |S_k|."""
    torch.manual_seed(0)
    n, d, B, V, eta = 50, 3, 5, 1.0, 0.1
    x = torch.randn(n, d) * 0.3
    x[:3] *= 20  # a few gradients above V: clipped per sample
    model = _Linear(d)
    stats = local_update(model, x, torch.zeros(n), step_sizes=[eta, eta], clip_norm=V, clipping="per-sample",
                         batch_size=B, generator=torch.Generator().manual_seed(7), loss_fn=_linear_loss,
                         batch_sampling="poisson")
    expected = torch.zeros(d)
    for idx in _draws(7, n, B / n, 2):
        g = x[idx]
        g = g * torch.clamp(V / g.norm(dim=1, keepdim=True).clamp_min(1e-30), max=1.0)
        step = g.sum(0) / B
        step = step * min(1.0, V / max(float(step.norm()), 1e-30))
        expected -= eta * step
    assert torch.allclose(model.w.detach(), expected, atol=1e-6)
    assert stats.batch_size == B and stats.steps == 2


def test_poisson_outer_clip_bounds_a_large_draw_by_v():
    """A draw far larger than B (rate 1, B = n/... here B = n) of aligned gradients: the step is at most V."""
    n, d = 20, 2
    x = torch.ones(n, d)
    model = _Linear(d)
    local_update(model, x, torch.zeros(n), step_sizes=[1.0], clip_norm=1.0, clipping="per-sample", batch_size=n,
                 generator=torch.Generator().manual_seed(0), loss_fn=_linear_loss, batch_sampling="poisson")
    assert float(model.w.detach().norm()) <= 1.0 + 1e-6


def test_poisson_needs_per_sample_clipping_and_b_at_most_n():
    args = dict(step_sizes=[0.1], clip_norm=1.0, generator=torch.Generator(), loss_fn=_linear_loss,
                batch_sampling="poisson")
    with pytest.raises(ValueError, match="per-sample"):
        local_update(_Linear(2), torch.ones(4, 2), torch.zeros(4), clipping="per-batch", batch_size=2, **args)
    with pytest.raises(ValueError, match="batch_size"):
        local_update(_Linear(2), torch.ones(4, 2), torch.zeros(4), clipping="per-sample", batch_size=5, **args)


def _instruction(**kw):
    base = dict(round_index=0, algorithm="fedavg", schedule="constant", lr=0.1, local_steps=1, clip_norm=1.0,
                sigma=0.5, clipping="per-sample", batch_size=4, prox_alpha=0.0, seed=-1, batch_sampling="poisson")
    base.update(kw)
    return TrainInstruction(**base)


def test_wire_contract_key_is_optional_checked_and_echoed_with_the_rate_only():
    s = _instruction()
    cfg = s.to_config()
    assert cfg[protocol.BATCH_SAMPLING] == "poisson"
    assert TrainInstruction.from_config(cfg) == s
    fixed = _instruction(batch_sampling="fixed").to_config()
    assert protocol.BATCH_SAMPLING not in fixed  # what older nodes parse
    assert TrainInstruction.from_config(fixed).batch_sampling == "fixed"
    with pytest.raises(Refused, match="dp.batch-sampling"):
        TrainInstruction.from_config({**cfg, protocol.BATCH_SAMPLING: "shuffle"})
    with pytest.raises(Refused, match="per-sample"):
        TrainInstruction.from_config({**cfg, protocol.CLIPPING: "per-batch"})
    echoed = protocol.echo(s, local_steps=1, batch_size=4, samples=40)
    assert echoed[protocol.BATCH_RATE] == pytest.approx(0.1)
    assert set(echoed) == {*protocol.ECHO_KEYS.values(), protocol.BATCH_RATE}


def test_node_guardrail_refuses_another_batch_sampling():
    check_node_policy(_instruction(), {"batch-sampling": "poisson"})
    with pytest.raises(Refused, match="batch-sampling"):
        check_node_policy(_instruction(batch_sampling="fixed"), {"batch-sampling": "poisson"})
    with pytest.raises(Refused, match="must be one of"):
        check_node_policy(_instruction(), {"batch-sampling": "sometimes"})


def test_server_takes_the_largest_echoed_rate_and_no_amplification_without_an_echo():
    def usable(metrics):
        applied = parse_applied(MetricRecord(metrics), fedprox=False)
        return Usable(node_id=1, arrays=None, metrics=MetricRecord(metrics), applied=applied, num_examples=40)

    base = protocol.echo(_instruction(batch_sampling="fixed"), local_steps=1, batch_size=4)
    a = usable(protocol.echo(_instruction(), local_steps=1, batch_size=4, samples=40))
    b = usable(protocol.echo(_instruction(), local_steps=1, batch_size=4, samples=20))
    assert batch_rate([a, b]) == pytest.approx(0.2)
    assert batch_rate([a, usable(base)]) == 1.0
    with pytest.raises(ValueError, match="batch-rate"):
        usable({**base, protocol.BATCH_RATE: 1.5})


def test_run_certifies_the_amplified_bound_and_reveals_no_draw(tmp_path):
    cfg = tiny_config(tmp_path, **{"clipping": "per-sample", "batch-sampling": "poisson", "batch-rate": 0.2,
                                   "local-steps": 1, "batch-size": 16, "colluding-clients": 1})
    out, grid = run_local(cfg)
    ledger = read_ledger(out.run_dir / "ledger.jsonl")
    for entry in ledger.rounds:
        record = entry["record"]
        assert 0 < record["batch_rate"] < 0.2  # 16 / (the partition's size), echoed by every node
        assert entry["report"]["certified"]["bound"] == BATCH_SAMPLED_BOUND
        assert "honest node" in entry["report"]["certified"]["assumes"][-1]
    last = ledger.rounds[-1]["report"]
    assert last["certified"]["epsilon"] < last["bounds"]["composition"]["epsilon"]
    configs = [dict(m.content["config"]) for m in grid.sent if m.metadata.message_type == "train"]
    assert all(c[protocol.BATCH_SAMPLING] == "poisson" for c in configs)
    # nothing the server holds names a drawn sample: the replies' metrics are the echo, num-examples, partition
    text = (out.run_dir / "ledger.jsonl").read_text()
    assert "indices" not in text and "batch-sizes" not in text
    for round_metrics in out.result.train_metrics_clientapp.values():
        assert not any("draw" in k or "indices" in k for k in round_metrics)
    json.dumps(last)  # the report is plain JSON
    from fl_dp_flower.reporting.verify import verify_ledger

    verified = verify_ledger(out.run_dir / "ledger.jsonl")  # recomputed from the records, batch_rate included
    assert verified.ok and verified.rounds_verified == len(ledger.rounds), verified


@pytest.mark.parametrize("overrides, text", [
    ({"clipping": "per-batch"}, "per-sample"),
    ({"clients-per-node": 2, "clients-per-round": 6}, "'clients-per-node' = 1"),
    ({"client-sampling": "poisson", "sampling-rate": 0.5, "clipping": "per-batch"}, "per-sample"),
    ({"threat-model": "final-model", "colluding-clients": 0, "assume-smooth-losses": True}, "all-rounds"),
])
def test_run_config_refuses_what_the_amplification_is_not_analysed_for(tmp_path, overrides, text):
    from fl_dp_flower.app.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=text):
        tiny_config(tmp_path, **{"clipping": "per-sample", "batch-sampling": "poisson", "batch-rate": 0.2, **overrides})


def test_run_with_poisson_client_sampling_certifies_the_batch_sampled_bound_at_each_rounds_count(tmp_path):
    """Client sampling and batch sampling together (docs/MATH.md §23.4): every round's ledger report certifies the
    batch-sampled bound, equal to dp-accounting's PLD accountant on each round's PoissonSampledDpEvent(q_t,
    GaussianDpEvent(z_t)) with z_t = sigma sqrt(max(k_t - c, 1)) B / (eta V) from the round's own count k_t."""
    import math

    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from fl_dp_flower.privacy.accountant import PrivacyAccountant
    from fl_dp_flower.privacy.sample_sampling import NO_CLIENT_CREDIT

    cfg = tiny_config(tmp_path, **{"clipping": "per-sample", "batch-sampling": "poisson", "batch-rate": 0.2,
                                   "local-steps": 1, "batch-size": 256, "colluding-clients": 1,
                                   "client-sampling": "poisson", "sampling-rate": 0.7, "num-server-rounds": 2,
                                   "sigma": 6e-4})
    out, _ = run_local(cfg)
    ledger = read_ledger(out.run_dir / "ledger.jsonl")
    records = out.accountant.records
    assert len(records) == 2 and all(r.population == 3 for r in records)
    assert [r.clients for r in records] == [3, 2]  # seed 0: the counts differ, and each round is charged at its own
    acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-4)
    for r in records:
        if r.clients:
            z = r.sigma * math.sqrt(max(r.clients - 1, 1)) * 256 / (r.step_sizes[0] * r.clip_norm)
            acc.compose(dp_accounting.PoissonSampledDpEvent(r.batch_rate, dp_accounting.GaussianDpEvent(z)))
    last = ledger.rounds[-1]["report"]
    assert last["certified"]["bound"] == BATCH_SAMPLED_BOUND
    assert math.isfinite(last["certified"]["epsilon"]) and last["certified"]["epsilon"] > 0
    assert NO_CLIENT_CREDIT in last["certified"]["assumes"][-1]
    assert last["certified"]["epsilon"] == pytest.approx(acc.get_epsilon(cfg.delta), rel=2e-3)
    replay = PrivacyAccountant.from_records(out.accountant.config, records).report()
    assert last["certified"]["epsilon"] == replay.certified.epsilon
    assert last["certified"]["epsilon"] < last["bounds"]["sampled"]["epsilon"]
    from fl_dp_flower.reporting.verify import verify_ledger

    assert verify_ledger(out.run_dir / "ledger.jsonl").ok
