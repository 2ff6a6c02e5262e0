"""Durable file helpers shared by the ledger and the server's outputs."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a newly created or renamed entry in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
