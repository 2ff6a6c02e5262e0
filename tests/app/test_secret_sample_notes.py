"""What the app prints next to a secret sample's certificate (docs/MATH.md §22; issue 31 review P31A)."""

from __future__ import annotations

from fl_dp_flower.app.testing import tiny_config


def test_the_cohort_warning_says_a_node_operator_sees_its_share_of_a_secret_sample(tmp_path):
    """Before: the warning said only that an operator knows its cohort's noise. Under a secret sample it also sees
    which of its members each round drew (it trains them), which the ``sampled_secret`` bound against fewer
    colluders than one operator takes to be unknown; the number against one operator (colluding-clients =
    clients-per-node) accounts for both."""
    from fl_dp_flower.app.threat import cohort_collusion_warning, node_assumptions

    settings = {"client-sampling": "poisson", "sampling-rate": 0.5, "clients-per-node": 4, "clients-per-round": 12,
                "colluding-clients": 1}
    secret = tiny_config(tmp_path, **settings, **{"sample-secrecy": "secret"})
    warning = cohort_collusion_warning(secret)
    assert warning is not None and "which of them each round drew" in warning and "colluding-clients = 4)" in warning
    assert warning in node_assumptions(secret)
    public = cohort_collusion_warning(tiny_config(tmp_path, **settings))
    assert public is not None and "drew" not in public  # a public sample names them anyway


def test_the_secret_sample_assumption_names_the_owner_only_records():
    """Before: the printed assumption said only that the ledger and metrics publish counts; the server's log and
    the app's summary.json name nodes (dropped replies, exclusions), so whoever reads them learns part of the
    sample (docs/MATH.md §22 said so; the number printed with the bound did not)."""
    from fl_dp_flower.privacy.client_sampling import secret_sample_assumption

    text = secret_sample_assumption()
    assert text.startswith("secret sample: an honest server-side sampler")
    assert all(name in text for name in ("log", "members.jsonl", "summary.json", "owner"))
