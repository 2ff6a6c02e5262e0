"""A Flower ``Array``'s values, deserialised once.

``flwr.app.Array.numpy()`` parses the ``.npy`` bytes (header included) on every call; a round reads
each reply's arrays several times (the finiteness check, the residual-noise check, averaging, the
aggregate's check), which cost more than the arithmetic. :func:`array_values` parses once per ``data``
object and hands out the same read-only array: a changed ``data`` (Flower replaces the bytes object
when an Array is re-serialised) is parsed again, and nothing can write into the shared copy.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array

_CACHE = "_fl_dp_values"  # Array.__dict__ key: (the data bytes it was parsed from, the read-only array)


def array_values(array: Array) -> np.ndarray:
    """``array.numpy()``, parsed once per data bytes object and read-only."""
    cached = array.__dict__.get(_CACHE)
    if cached is not None and cached[0] is array.data:
        return cached[1]
    out = array.numpy()
    out.flags.writeable = False
    array.__dict__[_CACHE] = (array.data, out)
    return out
