"""The run config's error text: allowed ranges, unknown-key suggestions, pydantic errors as lines
that name each dash key (the messages of :class:`fl_dp_flower.app.config.ConfigError`)."""

from __future__ import annotations

import difflib
import re
from typing import Iterable, Literal, Mapping, get_args, get_origin

import annotated_types as at
from pydantic import ValidationError
from pydantic.fields import FieldInfo

#: The ``sigma`` value that asks the package to calibrate sigma for ``target-epsilon``.
AUTO_SIGMA = "auto"


def dash(name: str) -> str:
    """A field's run-config key: ``local_steps`` -> ``local-steps``."""
    return name.replace("_", "-")


def dash_names(message: str, names: Iterable[str]) -> str:
    """A library message with each of ``names`` (field names) as its quoted run-config key: "server_lr x
    server_weight_decay" -> "'server-lr' x 'server-weight-decay'"."""
    names = sorted(names, key=len, reverse=True)
    if not names:
        return message
    pattern = "|".join(re.escape(name) for name in names)  # a name already quoted stays as it is
    return re.sub(rf"(?<!')\b({pattern})\b(?!')", lambda m: f"'{dash(m.group(1))}'", message)


#: the library's words for settings the run config names otherwise: the population is num-partitions x
#: clients-per-node, a coalition's size is colluding-clients, a Poisson rate is its sampling key
LIBRARY_TERMS = (
    ("batch_rate (Poisson batch sampling)", "'batch-sampling' = 'poisson'"),
    ("sampling_rate (Poisson client sampling)", "'client-sampling' = 'poisson'"),
    ("population must", "'num-partitions' x 'clients-per-node' (the population) must"),
    ("clients =", "'clients-per-round' ="),
    ("colluders", "'colluding-clients'"),
)


def run_config_words(message: str, names: Iterable[str]) -> str:
    """A library rule's message in the run config's words: each of :data:`LIBRARY_TERMS` (a whole term, not part
    of a word or a quoted key), then each of ``names`` (field names) as its quoted dash key (:func:`dash_names`)."""
    for term, words in LIBRARY_TERMS:
        message = re.sub(rf"(?<![\w'-]){re.escape(term)}(?![\w'-])", words, message)
    return dash_names(message, names)


def describe_range(fields: Mapping[str, FieldInfo], field_name: str) -> str:
    """Human-readable allowed values of one field (underscore name)."""
    info = fields[field_name]
    ann = info.annotation
    if get_origin(ann) is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(ann))
    if ann is bool:
        return "true or false"
    if ann is str:
        text = "a string"
        for meta in info.metadata:
            if isinstance(meta, at.MinLen) and meta.min_length >= 1:
                text = "a non-empty string"
        if field_name == "run_name":
            text += " of letters, digits, '.', '_' or '-' (no path separators)"
        return text
    if field_name == "sigma":
        return f"a finite number > 0, or {AUTO_SIGMA!r} (calibrated for 'target-epsilon' > 0)"
    kind = "an integer" if ann is int else "a finite number"
    bounds = []
    for meta in info.metadata:
        for cls, op, attr in ((at.Gt, ">", "gt"), (at.Ge, ">=", "ge"), (at.Lt, "<", "lt"), (at.Le, "<=", "le")):
            if isinstance(meta, cls):
                bounds.append(f"{op} {getattr(meta, attr)!r}")
    return f"{kind} {' and '.join(bounds)}".strip()


def unknown_key_message(fields: Mapping[str, FieldInfo], key: str) -> str:
    """"unknown run-config key 'lr2'; did you mean 'lr'?" (or the list of known keys)."""
    known = sorted(dash(n) for n in fields)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if close:
        return f"unknown run-config key '{key}'; did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    return f"unknown run-config key '{key}' (known keys: {', '.join(known)})"


def format_errors(fields: Mapping[str, FieldInfo], exc: ValidationError) -> str:
    """A pydantic ValidationError as lines that name each run-config key and its allowed range."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = err.get("loc") or ()
        if not loc:  # cross-field check: the message already names the keys
            msg = str(err.get("msg", ""))
            msg = msg.removeprefix("Value error, ")
            lines.extend(msg.split("; "))
            continue
        key = dash(str(loc[0]))
        field = key.replace("-", "_")
        if err.get("type") == "extra_forbidden":
            lines.append(unknown_key_message(fields, key))
        elif field in fields:
            got = err.get("input")
            lines.append(f"'{key}' = {got!r}: must be {describe_range(fields, field)} ({err.get('msg')})")
        else:
            lines.append(f"'{key}': {err.get('msg')}")
    return "invalid run config:\n" + "\n".join(f"  - {line}" for line in lines)
