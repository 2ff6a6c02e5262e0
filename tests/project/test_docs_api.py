"""docs/api.md is generated from the public API (fl_dp_flower.__all__) with inspect and must be current (issue 30)."""

from __future__ import annotations

from pathlib import Path

import fl_dp_flower
from fl_dp_flower.api_docs import api_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_api_page_is_current_and_names_every_public_name():
    page = api_markdown()
    assert all(f"## `{name}`" in page for name in fl_dp_flower.__all__)
    assert "def open_ledger(path" in page and "unfinished_round" in page  # real signatures, not names only
    assert PAGE.read_text() == page, "docs/api.md is stale: python -m fl_dp_flower.api_docs > docs/api.md"
