"""Readable ServerApp logs: Flower's strategy dumps go to a file, not to the operator's stream.

``Strategy.start`` logs, per round, the whole aggregated ``MetricRecord`` (hundreds of
characters) and at the end every metric of every round again ("Final results"), beside the one
round line this package logs. :class:`FlowerDumps`, installed on Flower's ``flwr`` logger, keeps
those records (INFO and WARNING from ``flwr/serverapp/strategy/``) out of the console and out of
``flwr log``, and writes them to a file in the run folder when one is attached.

It also removes the traceback from Flower's "ServerApp raised an exception" record when the
exception is one of this package's own clean errors (a config error, a refused resume, a run
that trained nothing): their message was already logged at ERROR, and the traceback only
buries it. Any other exception keeps its traceback.

Pure ``logging``: no flwr import.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

_STRATEGY_DIR = os.sep.join(("flwr", "serverapp", "strategy")) + os.sep


class FlowerDumps(logging.Filter):
    """Logger filter for ``logging.getLogger("flwr")`` (see the module docstring)."""

    def __init__(self, clean_errors: tuple[type[BaseException], ...] = ()) -> None:
        super().__init__()
        self.clean_errors = clean_errors
        self._clean_names = tuple(f"{e.__module__}.{e.__qualname__}" for e in clean_errors)
        self._sink: logging.Handler | None = None

    def attach_file(self, path: Path) -> None:
        """Write the dropped records to ``path`` (owner-only) from now on."""
        self.detach_file()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self._sink = handler

    def detach_file(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.WARNING and _STRATEGY_DIR in record.pathname:
            if self._sink is not None:
                self._sink.emit(record)
            return False
        if record.exc_info and isinstance(record.exc_info[1], self.clean_errors):
            record.exc_info, record.exc_text = None, None
            return True
        if self._clean_names and record.levelno >= logging.ERROR:
            text = record.getMessage()
            if text.startswith("Traceback") and any(name in text for name in self._clean_names):
                return False  # the simulation engine's formatted traceback of a clean error
        return True

    def install(self, logger: logging.Logger) -> "FlowerDumps":
        if self not in logger.filters:
            logger.addFilter(self)
        return self

    def uninstall(self, logger: logging.Logger) -> None:
        logger.removeFilter(self)
        self.detach_file()
