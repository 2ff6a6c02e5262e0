"""Tests of fl_dp_flower.reporting: ledger durability, console, Prometheus, plot."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import urllib.request

import pytest

from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.reporting import (
    PrivacyLedger,
    PrivacyMetricsExporter,
    format_round_line,
    load_round_records,
    plot_privacy_curve,
    read_ledger,
    render_summary,
    scrape_config_snippet,
    summary_table,
)

INF = float("inf")
ACCT = AccountantConfig(clients=3).to_dict()
APP = {"run-name": "t", "lr": 0.1, "target-epsilon": 0.0}


SMOOTH = "L-smooth losses (L = 1)"


def make_report(t: int, eps: float, *, paper_eps: float | None = None, paper_sound: bool = False,
                clients: int = 3) -> dict:
    mu = eps / 4 if math.isfinite(eps) else INF
    pe = eps / 5 if paper_eps is None else paper_eps
    return {
        "round": t, "rounds": t, "delta": 1e-5, "threat_model": "all-rounds", "clients": clients,
        "bounds": {
            "paper": {"mu": pe / 4, "epsilon": pe, "sound": paper_sound, "assumes": [SMOOTH]},
            "composition": {"mu": mu, "epsilon": eps, "sound": True, "assumes": []},
            "final_model": {"mu": mu * 2, "epsilon": eps * 2, "sound": True, "assumes": [SMOOTH]},
            "local_dp": {"mu": INF, "epsilon": INF, "sound": True, "assumes": []},
        },
        "certified": {"bound": "composition", "mu": mu, "epsilon": eps, "assumes": []},
        "rdp": {"orders": [2.0, 4.0], "values": [0.1 * t, 0.2 * t], "epsilon": eps},
        "relation": "replace-one",
        "add_remove": {"bound": "composition", "mu": mu / 2, "epsilon": eps / 3},
    }


def make_record(t: int) -> dict:
    return AccountantConfig(clients=3).planned_round(t).to_dict()


def history(eps_values: list[float]) -> list[dict]:
    return [{"round": t, "report": make_report(t, e), "metrics": {"accuracy": 0.5 + 0.1 * t,
                                                                 "loss": 1.0 / t}}
            for t, e in enumerate(eps_values, start=1)]


# ------------------------------------------------------------------ ledger


def fill(ledger: PrivacyLedger, rounds: range) -> None:
    for t in rounds:
        ledger.append_round(round=t, record=make_record(t), report=make_report(t, 0.5 * t),
                            metrics={"accuracy": 0.9, "loss": 0.3})


def test_ledger_roundtrip_including_inf(tmp_path):
    path = tmp_path / "run" / "ledger.jsonl"
    ledger = PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP)
    reports = [make_report(1, 0.7), make_report(2, INF, paper_eps=float("nan"))]
    for t, rep in enumerate(reports, start=1):
        ledger.append_round(round=t, record=make_record(t), report=rep,
                            metrics={"accuracy": 0.8, "loss": None})
    ledger.append_event("end", {"reason": "done", "epsilon": INF})
    ledger.close()
    assert ledger.last_round == 2

    raw = path.read_text()
    assert "Infinity" not in raw and "NaN" not in raw  # strict JSON on disk
    for line in raw.splitlines():
        entry = json.loads(line)
        assert entry["schema"] == 2 and entry["time"].endswith("+00:00")

    contents = read_ledger(path)
    assert not contents.torn_tail
    assert contents.header["accountant_config"] == ACCT and contents.header["app_config"] == APP
    assert [r["round"] for r in contents.rounds] == [1, 2]
    assert contents.rounds[0]["report"] == reports[0]
    back = contents.rounds[1]["report"]
    assert back["certified"]["epsilon"] == INF and back["bounds"]["local_dp"]["mu"] == INF
    assert math.isnan(back["bounds"]["paper"]["epsilon"])
    assert contents.rounds[1]["metrics"] == {"accuracy": 0.8, "loss": None}
    assert contents.events[0]["event"] == "end" and contents.events[0]["data"]["epsilon"] == INF
    records = load_round_records(path)
    assert records == [RoundRecord.from_dict(make_record(1)), RoundRecord.from_dict(make_record(2))]


def test_create_refuses_existing_file(tmp_path):
    path = tmp_path / "ledger.jsonl"
    PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP).close()
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="resume") as err:
        PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP)
    assert str(path) in str(err.value) and "resume=True" in str(err.value) and "another ledger path" in str(err.value)
    assert "run-name" not in str(err.value)  # review O6: an app key; the library's words (the app adds its own)
    assert path.read_bytes() == before


def test_create_refuses_a_non_empty_file_without_hard_links(tmp_path, monkeypatch):
    """The ledger is created by a hard link (atomic, never over a file); where the file system has none,
    by a rename after checking: an existing ledger is still refused, a missing one created whole."""
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "ledger.jsonl"
    PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP).close()
    assert read_ledger(path).header["kind"] == "header" and oct(path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError, match="already exists"):
        PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP)
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.jsonl"]  # no temp file left


def test_resume_checks_accountant_config(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP) as ledger:
        fill(ledger, range(1, 3))
    other = dict(ACCT, sigma=2.0)
    with pytest.raises(ValueError, match="sigma"):
        PrivacyLedger.resume(path, accountant_config=other)
    with pytest.raises(FileNotFoundError):
        PrivacyLedger.resume(tmp_path / "missing.jsonl", accountant_config=ACCT)
    with PrivacyLedger.resume(path, accountant_config=ACCT) as ledger:
        assert ledger.last_round == 2 and [r["round"] for r in ledger.rounds] == [1, 2]
        fill(ledger, range(3, 4))
    assert [r["round"] for r in read_ledger(path).rounds] == [1, 2, 3]


def test_rounds_must_increase(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP) as ledger:
        fill(ledger, range(1, 3))
        size = path.stat().st_size
        for bad in (2, 1):
            with pytest.raises(ValueError, match="strictly increasing"):
                ledger.append_round(round=bad, record=make_record(bad),
                                    report=make_report(bad, 1.0), metrics={})
        with pytest.raises(ValueError, match="round 4"):  # record/round mismatch
            ledger.append_round(round=3, record=make_record(4), report=make_report(3, 1.0),
                                metrics={})
        assert path.stat().st_size == size  # nothing written by refused appends
        fill(ledger, range(5, 6))  # gaps are allowed
    assert [r["round"] for r in read_ledger(path).rounds] == [1, 2, 5]


def test_torn_tail_resume_keeps_prefix(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP) as ledger:
        fill(ledger, range(1, 3))
    intact = path.read_bytes()
    with open(path, "ab") as f:  # a crash in the middle of writing round 3
        f.write(b'{"kind":"round","schema":1,"round":3,"record":{"rou')
    torn = path.read_bytes()

    contents = read_ledger(path)
    assert contents.torn_tail and [r["round"] for r in contents.rounds] == [1, 2]
    with PrivacyLedger.resume(path, accountant_config=ACCT) as ledger:
        assert ledger.torn_tail and ledger.last_round == 2
        fill(ledger, range(3, 5))
    data = path.read_bytes()
    assert data.startswith(torn)  # nothing before was rewritten, the fragment is kept
    assert data[len(torn):len(torn) + 1] == b"\n"

    contents = read_ledger(path)
    assert not contents.torn_tail
    assert [r["round"] for r in contents.rounds] == [1, 2, 3, 4]
    torn_events = [e for e in contents.events if e["event"] == "torn-tail"]
    assert [e["data"]["line"] for e in torn_events] == [intact.count(b"\n") + 1]
    assert len(load_round_records(path)) == 4
    # a second resume of the repaired ledger works too
    with PrivacyLedger.resume(path, accountant_config=ACCT) as ledger:
        fill(ledger, range(5, 6))
    assert read_ledger(path).rounds[-1]["round"] == 5


def test_corruption_in_the_middle_raises_with_line_number(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP) as ledger:
        fill(ledger, range(1, 4))
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2][:40]  # line 3 (round 2) damaged, later lines intact
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match="line 3"):
        read_ledger(path)
    with pytest.raises(ValueError, match="line 3"):
        PrivacyLedger.resume(path, accountant_config=ACCT)


def test_invalid_complete_last_line_is_corruption(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP) as ledger:
        fill(ledger, range(1, 2))
    with open(path, "ab") as f:
        f.write(b"garbage\n")  # has its newline: not a torn write
    with pytest.raises(ValueError, match="line 3"):
        read_ledger(path)


def test_every_line_is_fsynced(tmp_path, monkeypatch):
    calls: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd))[1])
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.create(path, accountant_config=ACCT, app_config=APP)
    assert len(calls) == 2  # the header line and the directory
    fill(ledger, range(1, 4))
    assert len(calls) == 5
    ledger.append_event("budget-stop", {"epsilon": 8.0})
    assert len(calls) == 6
    ledger.close()


# ------------------------------------------------------------------ console


def test_round_line_says_conditional_and_final_model_assumptions():
    """issue 16 items 4, 5: a certified bound resting on L says so; under final-model the line has no
    accuracy and names what the threat model assumes."""
    report = make_report(3, 5.67)
    report["certified"]["assumes"] = [SMOOTH]
    report["threat_model"] = "final-model"
    line = format_round_line(report, accuracy=None, clients=10)
    assert "acc" not in line
    assert "conditional on L-smooth losses (L = 1)" in line
    assert "participants do not reveal the global models they receive" in line
    assert "add/remove-one mu=0.7087 eps=1.89" in line
    plain = format_round_line(make_report(3, 5.67), accuracy=0.5, clients=10)
    assert "conditional" not in plain and "acc 0.500" in plain


def test_round_line_marks_an_amplified_bounds_mu_unamplified():
    """sampled_secret's mu is the rounds' Gaussian-DP parameter without amplification, its epsilon the amplified
    one: the line says so rather than print a mu-GDP number that its epsilon contradicts."""
    report = make_report(3, 3.99)
    report["certified"] = {"bound": "sampled_secret", "mu": 7.61, "epsilon": 3.99, "assumes": []}
    report["add_remove"] = {"bound": "sampled_secret", "mu": 7.61, "epsilon": 3.99}
    line = format_round_line(report, accuracy=0.9, clients=400)
    assert "certified mu=7.61 (unamplified) eps=3.99 (delta=1e-05, sampled_secret, replace-one)" in line
    assert "add/remove-one mu=7.61 (unamplified) eps=3.99" in line
    assert "(unamplified)" not in format_round_line(make_report(3, 5.68), accuracy=0.9, clients=10)


def test_round_line_labels_unsound_paper_bound():
    line = format_round_line(make_report(3, 5.68, paper_eps=1.2), accuracy=0.912, clients=10)
    assert "\n" not in line
    assert line.startswith("round 3 | clients 10 | acc 0.912 |")
    assert "certified mu=1.42 eps=5.68 (delta=1e-05, composition, replace-one)" in line
    assert "paper bound (not a guarantee) mu=0.3 eps=1.2" in line
    sound = format_round_line(make_report(3, 5.67, paper_eps=1.2, paper_sound=True),
                              accuracy=None, clients=10)
    assert "not a guarantee" not in sound and "paper bound mu=0.3" in sound
    assert "acc n/a" in sound
    assert "eps=inf" in format_round_line(make_report(1, INF), accuracy=0.1, clients=3)


def test_summary_table_text():
    hist = history([0.5, 1.25, INF])
    text = render_summary(hist)
    assert "\x1b[" not in text
    assert summary_table(hist).row_count == 3
    assert "1.25" in text and "inf" in text and "0.700" in text
    assert "0.25*" in text and "not a guarantee" in text  # unsound paper bound marked
    assert "‡" not in text and "without amplification" not in text


def test_summary_table_marks_the_final_iterate_assumption_and_an_amplified_mu():
    """The summary says what the report says: final_model / paper outside the final-model threat model assume the
    released model is the last iterate (‡), and an amplified certified bound's mu is the unamplified one."""
    from fl_dp_flower.privacy.bounds import FINAL_ITERATE_ASSUMPTION

    hist = history([0.5, 1.25])
    for entry in hist:
        entry["report"]["bounds"]["final_model"]["assumes"] = [SMOOTH, FINAL_ITERATE_ASSUMPTION]
        entry["report"]["certified"] = {"bound": "sampled_secret", "mu": 7.61, "epsilon": 1.0, "assumes": []}
    text = " ".join(render_summary(hist, width=400).split())
    assert "†‡" in text and "‡ assumes the released model is the last noisy-GD iterate" in text
    assert "cert. mu of an amplified bound (batch_sampled, sampled, sampled_secret): the rounds' Gaussian-DP" in text


# ------------------------------------------------------------------ prometheus


def scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_prometheus_exporter_serves_report():
    a = PrivacyMetricsExporter(0, "127.0.0.1")
    b = PrivacyMetricsExporter(0, "127.0.0.1")
    try:
        assert a.port != b.port and a.port > 0
        before = scrape(a.port)
        assert math.isnan(before[("fl_dp_certified_epsilon", ())])
        assert not any(name.startswith("fl_dp_budget") for name, _ in before)

        a.update(make_report(4, 2.5, paper_eps=0.8), clients=7, accuracy=0.93, budget_epsilon=8.0)
        b.update(make_report(1, INF), clients=2, accuracy=None, budget_epsilon=None)
        va, vb = scrape(a.port), scrape(b.port)
        assert va[("fl_dp_rounds_completed", ())] == 4
        assert va[("fl_dp_clients_aggregated", ())] == 7
        assert va[("fl_dp_certified_epsilon", ())] == 2.5
        assert va[("fl_dp_certified_mu", ())] == 0.625
        assert va[("fl_dp_paper_epsilon", ())] == pytest.approx(0.8)
        assert va[("fl_dp_accuracy", ())] == pytest.approx(0.93)
        assert va[("fl_dp_budget_remaining_epsilon", ())] == pytest.approx(5.5)
        # every bound carries what it assumes (issue 16 item 4): "" for clipping-only bounds
        assert va[("fl_dp_bound_epsilon", (("assumes", SMOOTH), ("bound", "paper"), ("sound", "false")))] == \
            pytest.approx(0.8)
        assert va[("fl_dp_bound_mu", (("assumes", SMOOTH), ("bound", "final_model"), ("sound", "true")))] == 1.25
        assert va[("fl_dp_certified_info", (("assumes", ""), ("bound", "composition"),
                                            ("relation", "replace-one")))] == 1.0
        assert va[("fl_dp_bound_epsilon", (("assumes", ""), ("bound", "local_dp"), ("sound", "true")))] == INF
        assert va[("fl_dp_add_remove_mu", ())] == pytest.approx(0.3125)
        # b is independent: infinite epsilon exported as +Inf, no budget gauge
        assert vb[("fl_dp_certified_epsilon", ())] == INF
        assert vb[("fl_dp_clients_aggregated", ())] == 2
        assert math.isnan(vb[("fl_dp_accuracy", ())])
        assert not any(name.startswith("fl_dp_budget") for name, _ in vb)

        # a bound whose soundness flips leaves no stale series behind
        a.update(make_report(5, 3.0, paper_eps=0.9, paper_sound=True), clients=7, accuracy=0.94,
                 budget_epsilon=8.0)
        va = scrape(a.port)
        assert ("fl_dp_bound_epsilon", (("assumes", SMOOTH), ("bound", "paper"), ("sound", "false"))) not in va
        assert va[("fl_dp_bound_epsilon", (("assumes", SMOOTH), ("bound", "paper"), ("sound", "true")))] == \
            pytest.approx(0.9)
    finally:
        a.close()
        b.close()
    # the port is released: a new exporter can bind it again
    c = PrivacyMetricsExporter(a.port, "127.0.0.1")
    try:
        assert scrape(c.port)[("fl_dp_rounds_completed", ())] == 0
    finally:
        c.close()


def test_scrape_config_snippet_is_valid_yaml():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load(scrape_config_snippet("fl-dp", ["server:9464", "localhost:9465"]))
    job = cfg["scrape_configs"][0]
    assert job["job_name"] == "fl-dp"
    assert job["static_configs"][0]["targets"] == ["server:9464", "localhost:9465"]


# ------------------------------------------------------------------ plot


@pytest.mark.parametrize("eps", [[0.3, 0.9, 1.8, 2.6], [0.01, 0.5, INF, 40.0], [INF, INF]])
def test_plot_writes_png(tmp_path, eps):
    path = tmp_path / "plots" / "privacy.png"
    out = plot_privacy_curve(history(eps), path, delta=1e-5)
    assert out == path
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in path.parent.iterdir()] == ["privacy.png"]  # no temp file left
    # atomic replace of an existing plot
    plot_privacy_curve(history(eps[:1]), path, delta=1e-5)
    assert path.read_bytes() != data


def test_frontier_plot_draws_every_curve_with_its_spread(tmp_path):
    from fl_dp_flower.reporting.plot import plot_accuracy_against_epsilon

    path = plot_accuracy_against_epsilon(
        {"ours": ([1.0, 4.0], [0.7, 0.9], [0.01, 0.02]), "theirs": ([1.0, 4.0], [0.6, 0.8], None)},
        tmp_path / "f" / "frontier.png", xlabel="epsilon", ylabel="accuracy", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in path.parent.iterdir()] == ["frontier.png"]


def test_plot_names_the_settings_and_draws_the_budget_and_local_dp(tmp_path):
    # issue 21.5: sigma, clients, rounds, threat model in the title; budget line; local-DP curve
    from fl_dp_flower.reporting.plot import privacy_figure

    run_config = {"sigma": 0.8, "clients-per-round": 10, "num-server-rounds": 5, "threat-model": "all-rounds",
                  "target-epsilon": 4.0}
    hist = history([0.5, 1.0, 2.0])
    for entry, local in zip(hist, (3.0, 6.0, 9.0)):
        entry["report"]["bounds"]["local_dp"] = {"mu": local / 4, "epsilon": local, "sound": True}
    ax = privacy_figure(hist, delta=1e-5, run_config=run_config).axes[0]
    assert "σ 0.8 · 10 clients/round · 3 of 5 rounds · threat model all-rounds" in ax.get_title()
    labels = [line.get_label() for line in ax.get_lines()]
    assert "budget ε = 4" in labels
    local = [line for line in ax.get_lines() if line.get_label().startswith("local DP")]
    assert len(local) == 1 and list(local[0].get_ydata()) == [3.0, 6.0, 9.0]
    budget = next(line for line in ax.get_lines() if line.get_label() == "budget ε = 4")
    assert set(budget.get_ydata()) == {4.0}
    assert "budget" not in " ".join(line.get_label() for line in privacy_figure(
        hist, delta=1e-5, run_config={**run_config, "target-epsilon": 0.0}).axes[0].get_lines())
    path = plot_privacy_curve(hist, tmp_path / "p.png", delta=1e-5, run_config=run_config)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_empty_history(tmp_path):
    with pytest.raises(ValueError):
        plot_privacy_curve([], tmp_path / "x.png", delta=1e-5)


# ------------------------------------------------------------------ Flower's log dumps
def _record(pathname: str, level: int, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("flwr", level, pathname, 1, msg, (), exc_info)


def test_flower_dumps_go_to_a_file_and_clean_errors_lose_their_traceback(tmp_path):
    from fl_dp_flower.reporting.logfilter import FlowerDumps

    class Clean(RuntimeError):
        pass

    f = FlowerDumps(clean_errors=(Clean,))
    strategy = os.path.join("site-packages", "flwr", "serverapp", "strategy", "strategy.py")
    dump = _record(strategy, logging.INFO, "\t└──> Aggregated MetricRecord: {...}")
    assert f.filter(dump) is False  # dropped, nowhere to write yet
    f.attach_file(tmp_path / "dumps.log")
    assert f.filter(dump) is False and f.filter(_record(strategy, logging.WARNING, "fraction_evaluate")) is False
    assert f.filter(_record(strategy, logging.ERROR, "a real strategy error")) is True
    ours = _record(os.path.join("fl_dp_flower", "apps", "server.py"), logging.INFO, "round 1 | ...")
    assert f.filter(ours) is True
    clean = _record("run_serverapp.py", logging.ERROR, "ServerApp raised an exception", Clean("named key"))
    assert f.filter(clean) is True and clean.exc_info is None
    other = _record("run_serverapp.py", logging.ERROR, "ServerApp raised an exception", KeyError("bug"))
    assert f.filter(other) is True and other.exc_info is not None  # real bugs keep their traceback
    name = f"{Clean.__module__}.{Clean.__qualname__}"
    assert f.filter(_record("run_simulation.py", logging.ERROR, f"Traceback (most recent call last):\n...\n{name}: x")) is False
    f.detach_file()
    text = (tmp_path / "dumps.log").read_text()
    assert "Aggregated MetricRecord" in text and "fraction_evaluate" in text and "round 1" not in text
    assert oct((tmp_path / "dumps.log").stat().st_mode & 0o777) == "0o600"


def test_torn_round_line_leaves_that_round_open_also_without_round_open_events(tmp_path):
    """A ledger written before round-open events existed: a torn round line still opens its round."""
    path = tmp_path / "ledger.jsonl"
    with PrivacyLedger.create(path, accountant_config=ACCT, app_config={}) as ledger:
        ledger.append_round(round=1, record=AccountantConfig(clients=3).planned_round(1).to_dict(), report=make_report(1, 1.0), metrics={})
    line = b'{"kind":"round","schema":1,"round":2,"record":{"round":2,"algo'
    with open(path, "ab") as f:
        f.write(line)
    contents = read_ledger(path)
    assert contents.torn_tail and contents.torn_kind == "round"
    assert (contents.open_round, contents.torn_round, contents.last_round) == (2, 2, 1)
    # a torn *event* line opens nothing
    path2 = tmp_path / "ledger2.jsonl"
    with PrivacyLedger.create(path2, accountant_config=ACCT, app_config={}):
        pass
    with open(path2, "ab") as f:
        f.write(b'{"kind":"event","schema":1,"event":"en')
    c2 = read_ledger(path2)
    assert c2.torn_kind == "event" and c2.open_round is None
    # too short to tell: assumed to be the next round line (conservative)
    path3 = tmp_path / "ledger3.jsonl"
    with PrivacyLedger.create(path3, accountant_config=ACCT, app_config={}):
        pass
    with open(path3, "ab") as f:
        f.write(b'{"ki')
    assert read_ledger(path3).open_round == 1
