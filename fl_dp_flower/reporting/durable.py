"""Durable file helpers shared by the ledger and the server's outputs."""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a newly created or renamed entry in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_INT_DIGITS = 30  # a ledger's integers (rounds, counts, member ids node id x clients-per-node + slot) are far shorter


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise json.JSONDecodeError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are plausible)", text, 0)
    return int(text)


def load_json_line(raw: bytes) -> Any:
    """Parse one JSON line (UTF-8); integers longer than ``MAX_INT_DIGITS`` digits are rejected
    (json.JSONDecodeError), so no count, round or id of absurd size is ever accepted."""
    return json.loads(raw.decode("utf-8"), parse_int=_bounded_int)


def json_safe(obj: Any) -> Any:
    """Map non-finite floats to strings and containers to JSON types (recursively)."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy scalars and arrays, without importing numpy
        return json_safe(obj.tolist())
    raise TypeError(f"cannot write {type(obj).__name__} value {obj!r} as strict JSON")


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` whole or not at all: ``write`` fills an owner-only (0600) temp file in the
    same folder, which is fsynced, renamed over ``path`` and the folder fsynced."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_whole(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data``, whole or not at all, never over a non-empty file: ``data`` goes to
    an owner-only temp file in the same folder, fsynced, then hard-linked to ``path`` (which fails if
    ``path`` exists) and the folder fsynced. A full disk leaves no ``path`` (and no temp file). An
    existing *empty* ``path`` (a creation an older writer left half done) is replaced: returns True then.
    Raises FileExistsError for any other existing ``path``. On a file system without hard links, the
    temp file is renamed to ``path`` after checking that it does not exist."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    replaced = False
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            if path.stat().st_size != 0:
                raise
            os.replace(tmp, path)
            replaced = True
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            if path.exists() and path.stat().st_size != 0:
                raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
            replaced = path.exists()
            os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(path.parent)
    return replaced


def _write_bytes(f: BinaryIO, data: bytes) -> None:
    f.write(data)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Strict JSON (non-finite floats as strings, see :func:`json_safe`), written atomically."""
    text = json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda f: _write_bytes(f, text.encode()))
