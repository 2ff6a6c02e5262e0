"""The metrics endpoint's HTTP(S) server, hardened against clients that hold connections (used by
:class:`~.prometheus.PrivacyMetricsExporter`).

- At most ``max_connections`` connections are served at once (one thread each).
- A connection that has not delivered its request (request line and headers) within ``handshake_seconds``
  of being accepted (a TCP connection that sends nothing, a TLS handshake that stalls, a request trickled
  byte by byte) is cut; so is every connection after ``connection_seconds`` in all.
- When all slots are taken, a new connection evicts the *oldest* connection still waiting for its
  request (pre-TLS or pre-request) instead of being refused: idle connections from anywhere that
  reaches the port cannot keep a scraper out (issue 28.11: 16 idle TCP connections let 1 of 45
  scrapes through). Only when every slot holds a connection past its request line is a new one closed.
- A failed connection (a refused or cut handshake, a scraper that hangs up) is logged in one line,
  never as a traceback, and at most once per ``FAILURE_LOG_SECONDS``: the next line says how many
  failures were not logged in between, and closing the server logs the count still pending.
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

log = logging.getLogger("flwr").getChild("fl_dp_flower.reporting.prometheus")  # Flower's handlers: the ServerApp log

FAILURE_LOG_SECONDS = 60.0  # at most one failed-connection line per minute
EVICTION_WAIT_SECONDS = 1.0  # how long a new connection waits for the slot an evicted one frees


def _one_line(err: BaseException | None) -> str:
    return f"{type(err).__name__}: {err}" if err is not None else "unknown error"


def _peer(client_address: Any) -> str:
    try:
        return f"{client_address[0]}:{client_address[1]}"
    except (TypeError, IndexError):
        return str(client_address)


def _cut(sock: socket.socket) -> None:
    """Unblock every read or write on ``sock`` (the connection's thread then ends)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class FailureLog:
    """One line per failed connection, at most one per ``interval`` seconds; the others are counted."""

    def __init__(self, interval: float = FAILURE_LOG_SECONDS) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self.suppressed = 0
        self.total = 0

    def failed(self, message: str, *args: Any) -> None:
        with self._lock:
            self.total += 1
            now = time.monotonic()
            if now - self._last < self.interval:
                self.suppressed += 1
                return
            self._last, suppressed, self.suppressed = now, self.suppressed, 0
        more = f" ({suppressed} more failed connection(s) not logged since the last line)" if suppressed else ""
        log.info("metrics endpoint: " + message + "%s", *args, more)

    def flush(self) -> None:
        with self._lock:
            suppressed, self.suppressed = self.suppressed, 0
        if suppressed:
            log.info("metrics endpoint: %d more failed connection(s) not logged (%d in all)", suppressed, self.total)


class ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per connection, at most ``max_connections`` at a time (the module docstring has the rules)."""

    daemon_threads = True

    def limit(self, max_connections: int, connection_seconds: float, handshake_seconds: float) -> None:
        """Set the caps (before :meth:`serve_forever`)."""
        if max_connections < 1 or not connection_seconds > 0 or not 0 < handshake_seconds <= connection_seconds:
            raise ValueError(f"metrics endpoint: max_connections must be >= 1, connection_seconds > 0 and "
                             f"0 < handshake_seconds <= connection_seconds, got {max_connections}, "
                             f"{connection_seconds} and {handshake_seconds}")
        self.max_connections, self.connection_seconds = max_connections, connection_seconds
        self.handshake_seconds = handshake_seconds
        self._slots = threading.BoundedSemaphore(max_connections)
        self._waiting: dict[Any, float] = {}  # connections before their request -> time accepted
        self._lock = threading.Lock()
        self.refused_connections = 0
        self.evicted_connections = 0
        self.failures = FailureLog()

    def started(self, request: Any) -> None:
        """The connection delivered its request: it is no longer evictable, nor cut at the handshake deadline."""
        with self._lock:
            self._waiting.pop(request, None)

    def _evict_oldest_waiting(self) -> bool:
        with self._lock:
            if not self._waiting:
                return False
            oldest = min(self._waiting, key=self._waiting.__getitem__)
            del self._waiting[oldest]
        self.evicted_connections += 1
        _cut(oldest)
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            if not (self._evict_oldest_waiting() and self._slots.acquire(timeout=EVICTION_WAIT_SECONDS)):
                self.refused_connections += 1
                if self.refused_connections == 1 or self.refused_connections % 100 == 0:
                    log.warning("metrics endpoint: %d concurrent connections past their request (the cap): closed "
                                "the connection from %s (%d refused so far)", self.max_connections,
                                _peer(client_address), self.refused_connections)
                self.shutdown_request(request)
                return
        with self._lock:
            self._waiting[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.started(request)
            self._slots.release()
            raise

    def _cut_if_waiting(self, request: Any) -> None:
        with self._lock:
            waiting = self._waiting.pop(request, None) is not None
        if waiting:
            _cut(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(self.handshake_seconds, self._cut_if_waiting, (request,))
        watchdog = threading.Timer(self.connection_seconds, _cut, (request,))
        for timer in (deadline, watchdog):
            timer.daemon = True
            timer.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            watchdog.cancel()
            self.started(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One (rate-limited) log line for a failed connection, never a traceback."""
        self.failures.failed("connection from %s failed: %s", _peer(client_address), _one_line(sys.exc_info()[1]))

    def server_close(self) -> None:
        super().server_close()
        self.failures.flush()


class _OneLineServerHandler(ServerHandler):
    def log_exception(self, exc_info: Any) -> None:
        handler = getattr(self, "request_handler", None)
        peer = _peer(handler.client_address) if handler is not None else "?"
        server = cast(ThreadingServer, handler.server) if handler is not None else None
        if server is not None:
            server.failures.failed("connection from %s ended early: %s", peer, _one_line(exc_info[1]))


class QuietHandler(WSGIRequestHandler):
    timeout = 10  # seconds a single read or write may stall

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):  # handshake in this connection's thread, not in
            self.request.settimeout(self.timeout)    # the accept loop: a stalled client blocks no one
            self.request.do_handshake()
        super().setup()

    def handle(self) -> None:
        """:meth:`WSGIRequestHandler.handle` with a WSGI handler that logs a failed response in one
        line instead of printing its traceback to stderr (the ServerApp's log)."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline, self.request_version, self.command = "", "", ""
            self.send_error(414)
            return
        if not self.parse_request():  # reads the headers too
            return
        cast(ThreadingServer, self.server).started(self.request)
        handler: Any = _OneLineServerHandler(self.rfile, cast(Any, self.wfile), self.get_stderr(),
                                             self.get_environ(), multithread=False)
        handler.request_handler = self
        handler.run(cast(Any, self.server).get_app())

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        pass
