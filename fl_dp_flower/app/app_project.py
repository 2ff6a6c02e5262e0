"""Where the reference app's Flower project lives, for ``fl-dp-flower run`` (``flwr run <dir>``).

In a checkout it is the repository root (its ``pyproject.toml`` has the ``[tool.flwr.app]`` tables).
An installed wheel has no such file, so the project is written once per version into a user cache
folder: a ``pyproject.toml`` whose components are the installed package's apps
(``fl_dp_flower.app.serverapp:app``, ``fl_dp_flower.app.clientapp:app``) and whose run config is
:class:`~fl_dp_flower.app.config.AppConfig`'s defaults (the same values as the checkout's pyproject;
tests/app/test_config.py checks that they agree).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[2]
CACHE_ENV = "FL_DP_FLOWER_APP_DIR"  # where to write the installed package's app project (optional)


def is_app_project(path: Path) -> bool:
    """Whether ``path`` holds a Flower app project (``pyproject.toml`` with ``[tool.flwr.app]``)."""
    try:
        data = tomllib.loads((path / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return "app" in data.get("tool", {}).get("flwr", {})


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is a JSON string for these characters
    if isinstance(value, (int, float)):
        return repr(value)
    raise ValueError(f"run-config default '{key}' = {value!r} is not a TOML scalar")


def packaged_project_text() -> str:
    """The ``pyproject.toml`` of the installed package's app project."""
    from fl_dp_flower import __version__
    from fl_dp_flower.app.config import AppConfig

    config = "\n".join(f'"{k}" = {_toml_value(k, v)}' for k, v in AppConfig().to_run_config().items())
    return (
        "# written by fl-dp-flower (fl_dp_flower/app/app_project.py): the reference app of the installed package\n"
        f'[project]\nname = "fl-dp-flower-app"\nversion = "{__version__}"\n'
        'description = "fl-dp-flower reference app"\nlicense = "Apache-2.0"\ndependencies = []\n\n'
        '[tool.flwr.app]\npublisher = "fl-dp-flower"\nfab-include = ["pyproject.toml"]\n\n'
        '[tool.flwr.app.components]\nserverapp = "fl_dp_flower.app.serverapp:app"\n'
        'clientapp = "fl_dp_flower.app.clientapp:app"\n\n'
        f"[tool.flwr.app.config]\n{config}\n"
    )


def app_project() -> Path:
    """The folder ``flwr run`` submits: the checkout root, or the installed package's written project."""
    if is_app_project(CHECKOUT) and (CHECKOUT / "server_app.py").exists():
        return CHECKOUT
    from fl_dp_flower import __version__

    base = Path(os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "fl-dp-flower" / f"app-{__version__}")
    text = packaged_project_text()
    target = base / "pyproject.toml"
    if not target.exists() or target.read_text() != text:
        base.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".toml.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
    return base
