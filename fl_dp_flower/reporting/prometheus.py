"""Prometheus endpoint for the privacy accountant (prometheus-client, private registry).

Each :class:`PrivacyMetricsExporter` owns its own ``CollectorRegistry`` and HTTP server, so
several exporters can live in one process and :meth:`~PrivacyMetricsExporter.close` frees
the port. Exported metrics (all gauges, prefix ``fl_dp_``):

- ``fl_dp_rounds_completed``, ``fl_dp_last_round``, ``fl_dp_clients_aggregated``, ``fl_dp_delta``
- ``fl_dp_certified_mu``, ``fl_dp_certified_epsilon``,
  ``fl_dp_certified_info{bound, relation, assumes}`` (``assumes``: e.g. "L-smooth losses (L = 1)",
  empty for a clipping-only bound: a non-empty value means conditional on L-smooth losses)
- ``fl_dp_add_remove_mu``, ``fl_dp_add_remove_epsilon`` (the certified guarantee under add/remove-one)
- ``fl_dp_paper_mu``, ``fl_dp_paper_epsilon`` (the paper's closed form; see ``bound_*`` for ``sound``)
- ``fl_dp_bound_mu{bound, sound, assumes}``, ``fl_dp_bound_epsilon{bound, sound, assumes}``
- ``fl_dp_accuracy`` (NaN until known)
- ``fl_dp_budget_epsilon`` and ``fl_dp_budget_remaining_epsilon`` (only once a budget is given),
  ``fl_dp_stopped_by_budget`` (1 once the run stopped because the next round would exceed it)
- ``fl_dp_last_round_timestamp_seconds`` (Unix time of the last accounted round), ``fl_dp_min_replies``
- ``fl_dp_round_epsilon_increase`` (what the last round added to the certified epsilon) and
  ``fl_dp_expected_round_epsilon_increase`` (what it would have added had it run as planned)
- ``fl_dp_ledger_head_info{sha256=...}``: the ledger's head hash after the last round line and
  after the run's ``end`` event (``fl-dp-flower verify --expected-head``)

docker/prometheus/alerts.yml turns these into alerts (docs/operating.md).

An infinite epsilon or mu is exported as ``+Inf``; values not yet known are ``NaN``.

Exposure: the endpoint binds ``127.0.0.1`` unless told otherwise. ``certfile``/``keyfile``
serve it over HTTPS (TLS 1.2+), and ``auth_file`` (lines ``user:password``, owner-only)
requires HTTP basic auth; a scrape without valid credentials gets 401 and no numbers.

Hardening (:mod:`.metrics_server`): at most ``max_connections`` connections are served at once (one
thread each); a connection that has not sent its request within ``handshake_seconds`` (idle, a
stalled TLS handshake, a trickled request) is cut, and when the cap is reached a new connection
evicts the oldest one still waiting for its request, so idle connections cannot keep a scraper out;
every connection is cut after ``connection_seconds`` in all; a connection that fails is logged in
one line of the ServerApp log, never as a traceback, at most one line a minute (with the count of
the others).
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import ssl
import threading
from pathlib import Path
from typing import Any, Iterable, cast
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, Gauge, Info, make_wsgi_app

from .metrics_server import QuietHandler, ThreadingServer

_NAN = float("nan")


def read_basic_auth_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """``user:password`` lines (blank lines and ``#`` comments skipped) -> {user: password}.

    Raises ValueError naming the file and line for a malformed line or an empty file, and
    PermissionError when the file is readable by group or others (it holds secrets).
    """
    path = Path(path)
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"metrics auth file {path} is readable by others: chmod 600 it")
    users: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"metrics auth file {path} line {n}: expected 'user:password'")
        users[user] = password
    if not users:
        raise ValueError(f"metrics auth file {path} holds no 'user:password' line")
    return users


def _basic_auth(app, users: dict[str, str]):
    """WSGI middleware: 401 unless the request carries one of ``users``' credentials."""
    def check(header: str) -> bool:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        expected = users.get(user, "")
        return hmac.compare_digest(password.encode(), expected.encode()) and bool(expected)

    def wrapped(environ, start_response):
        if not check(environ.get("HTTP_AUTHORIZATION", "")):
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="fl-dp-flower"'),
                                                ("Content-Type", "text/plain")])
            return [b"authentication required\n"]
        return app(environ, start_response)
    return wrapped


class PrivacyMetricsExporter:
    """Serve the accountant's numbers at ``http(s)://<addr>:<port>/metrics``.

    ``port=0`` binds a free port; the bound port is :attr:`port`. ``certfile`` and ``keyfile``
    (PEM) turn on TLS; ``auth_file`` turns on HTTP basic auth; ``max_connections``,
    ``connection_seconds`` and ``handshake_seconds`` (capped at ``connection_seconds``) are the
    hardening's limits (see the module docstring).
    """

    def __init__(self, port: int, addr: str = "127.0.0.1", *, certfile: str = "", keyfile: str = "",
                 auth_file: str = "", max_connections: int = 16, connection_seconds: float = 30.0,
                 handshake_seconds: float = 3.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._rounds = Gauge("fl_dp_rounds_completed", "Rounds accounted so far", registry=r)
        self._last_round = Gauge("fl_dp_last_round", "Global index of the last accounted round",
                                 registry=r)
        self._clients = Gauge("fl_dp_clients_aggregated",
                              "Client replies aggregated in the last round", registry=r)
        self._delta = Gauge("fl_dp_delta", "delta at which epsilon is reported", registry=r)
        self._cert_mu = Gauge("fl_dp_certified_mu", "Certified Gaussian-DP mu", registry=r)
        self._cert_eps = Gauge("fl_dp_certified_epsilon", "Certified epsilon at delta", registry=r)
        self._cert_info = Info("fl_dp_certified", "Bound that certifies the guarantee", registry=r)
        self._paper_mu = Gauge("fl_dp_paper_mu", "The paper's closed-form mu (may be unsound)",
                               registry=r)
        self._paper_eps = Gauge("fl_dp_paper_epsilon",
                                "The paper's closed-form epsilon (may be unsound)", registry=r)
        labels = ["bound", "sound", "assumes"]
        self._bound_mu = Gauge("fl_dp_bound_mu", "mu of each bound (assumes: conditional on it)", labels, registry=r)
        self._bound_eps = Gauge("fl_dp_bound_epsilon", "epsilon of each bound (assumes: conditional on it)", labels,
                                registry=r)
        self._bound_labels: dict[str, tuple[str, str]] = {}  # bound -> (sound, assumes) last published
        self._ar_mu = Gauge("fl_dp_add_remove_mu", "Certified Gaussian-DP mu under add/remove-one", registry=r)
        self._ar_eps = Gauge("fl_dp_add_remove_epsilon", "Certified epsilon at delta under add/remove-one",
                             registry=r)
        self._accuracy = Gauge("fl_dp_accuracy", "Accuracy of the global model", registry=r)
        self._last_time = Gauge("fl_dp_last_round_timestamp_seconds", "Unix time of the last accounted round",
                                registry=r)
        self._min_replies = Gauge("fl_dp_min_replies", "Replies a round needs to be aggregated", registry=r)
        self._increase = Gauge("fl_dp_round_epsilon_increase",
                               "Certified epsilon added by the last round", registry=r)
        self._expected = Gauge("fl_dp_expected_round_epsilon_increase",
                               "Certified epsilon the last round would have added had it run as planned", registry=r)
        self._exhausted = Gauge("fl_dp_stopped_by_budget", "1 once the run stopped on its budget", registry=r)
        self._ledger_head = Info("fl_dp_ledger_head", "SHA-256 of the privacy ledger's last line after the last "
                                 "round line (and after the run's end event): fl-dp-flower verify --expected-head",
                                 registry=r)
        self._budget: Gauge | None = None
        self._budget_remaining: Gauge | None = None
        for g in (self._delta, self._cert_mu, self._cert_eps, self._paper_mu, self._paper_eps,
                  self._ar_mu, self._ar_eps, self._accuracy, self._min_replies, self._increase, self._expected):
            g.set(_NAN)
        self._exhausted.set(0)
        app = make_wsgi_app(self.registry)
        if auth_file:
            app = _basic_auth(app, read_basic_auth_file(auth_file))
        server = cast(ThreadingServer, make_server(addr, port, app, ThreadingServer, handler_class=QuietHandler))
        server.limit(max_connections, connection_seconds, min(handshake_seconds, connection_seconds))
        if certfile or keyfile:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(certfile, keyfile)
            server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        self._server: ThreadingServer | None = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        self.addr = addr
        self.tls = bool(certfile)
        self.authenticated = bool(auth_file)
        self.port: int = server.server_port

    def set_min_replies(self, value: int) -> None:
        self._min_replies.set(value)

    def mark_budget_exhausted(self) -> None:
        self._exhausted.set(1)

    def set_ledger_head(self, head: str | None) -> None:
        """Publish the ledger's head hash (``fl_dp_ledger_head_info{sha256=...}``): a copy kept outside
        the run folder, against which ``verify --expected-head`` detects a ledger cut short."""
        if head:
            self._ledger_head.info({"sha256": head})

    def update(self, report: dict[str, Any], *, clients: int, accuracy: float | None,
               budget_epsilon: float | None, epsilon_increase: float | None = None,
               expected_increase: float | None = None) -> None:
        """Publish one round's report (``PrivacyReport.to_dict()``)."""
        self._last_time.set_to_current_time()
        if epsilon_increase is not None:
            self._increase.set(float(epsilon_increase))
        if expected_increase is not None:
            self._expected.set(float(expected_increase))
        self._rounds.set(report.get("rounds", report["round"]))
        self._last_round.set(report["round"])
        self._clients.set(clients)
        self._delta.set((report.get("screening") or {}).get("delta_total", report["delta"]))  # MATH §17.1
        cert = report["certified"]
        self._cert_mu.set(float(cert["mu"]))
        self._cert_eps.set(float(cert["epsilon"]))
        self._cert_info.info({"bound": str(cert["bound"]), "relation": str(report.get("relation", "replace-one")),
                              "assumes": "; ".join(cert.get("assumes", []))})
        add_remove = report.get("add_remove") or {}
        if add_remove:
            self._ar_mu.set(float(add_remove["mu"]))
            self._ar_eps.set(float(add_remove["epsilon"]))
        for name, bound in report.get("bounds", {}).items():
            labels = ("true" if bound.get("sound") else "false", "; ".join(bound.get("assumes", [])))
            previous = self._bound_labels.get(name)
            for gauge, key in ((self._bound_mu, "mu"), (self._bound_eps, "epsilon")):
                if previous is not None and previous != labels:
                    gauge.remove(name, *previous)  # no stale series when a bound's labels change
                gauge.labels(name, *labels).set(float(bound[key]))
            self._bound_labels[name] = labels
            if name == "paper":
                self._paper_mu.set(float(bound["mu"]))
                self._paper_eps.set(float(bound["epsilon"]))
        if accuracy is not None:
            self._accuracy.set(float(accuracy))
        if budget_epsilon is not None:
            if self._budget is None:
                self._budget = Gauge("fl_dp_budget_epsilon", "Epsilon budget of the run",
                                     registry=self.registry)
                self._budget_remaining = Gauge(
                    "fl_dp_budget_remaining_epsilon",
                    "Budget minus certified epsilon (-Inf when certified epsilon is infinite)",
                    registry=self.registry)
            assert self._budget_remaining is not None
            self._budget.set(float(budget_epsilon))
            self._budget_remaining.set(float(budget_epsilon) - float(cert["epsilon"]))

    def close(self) -> None:
        """Stop the HTTP server and release the port (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> "PrivacyMetricsExporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scrape_config_snippet(job: str, targets: str | Iterable[str], *,
                          scrape_interval: str = "15s") -> str:
    """A ``prometheus.yml`` ``scrape_configs`` block for the exporter(s) at ``targets``
    (``"host:port"`` strings)."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    if not targets:
        raise ValueError("at least one scrape target (host:port) is required")
    target_list = ", ".join(json.dumps(t) for t in targets)
    return (
        "scrape_configs:\n"
        f"  - job_name: {json.dumps(job)}\n"
        f"    scrape_interval: {scrape_interval}\n"
        "    static_configs:\n"
        f"      - targets: [{target_list}]\n"
    )
