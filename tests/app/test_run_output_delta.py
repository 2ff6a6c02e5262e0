"""``fl-dp-flower run``'s round lines name the delta when the screening drops' charge (docs/MATH.md §17.1)
is not negligible. Measured: the quick preset printed "certified eps 1649" under a header saying "epsilon
at delta 1e-05" while the ledger's certificate held at delta = 1e-5 + 1 (the charge (1 + e^eps) x the
summed check levels, capped at 1), i.e. no guarantee at all."""

from __future__ import annotations

from fl_dp_flower.app.run_output import round_line


def entry(screening: dict | None) -> dict:
    report = {"clients": 10, "delta": 1e-5, "certified": {"epsilon": 1649.0, "mu": 53.33, "bound": "composition"},
              "bounds": {"paper": {"epsilon": 933.2, "sound": False}}}
    if screening is not None:
        report["screening"] = screening
    return {"round": 4, "report": report, "metrics": {"accuracy": 0.332}, "time": "2026-11-28T08:37:00+00:00"}


def test_a_swamping_screening_charge_is_named_in_the_round_line():
    line = round_line(entry({"drop_probability": 8e-12, "delta": 1.0, "delta_total": 1.0}), 1, [], 10)
    assert "certified eps 1649 (composition) at delta 1e-05 + 1 (screening drops)" in line, line


def test_a_negligible_charge_or_none_keeps_the_line_short():
    small = {"drop_probability": 2e-12, "delta": 9.4e-9, "delta_total": 1e-5 + 9.4e-9}  # the main job's
    for screening in (None, small):
        line = round_line(entry(screening), 1, [], 10)
        assert "at delta" not in line and "certified eps 1649 (composition) | paper 933.2" in line, line
