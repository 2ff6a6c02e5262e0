"""Operator-facing reporting: the JSONL privacy ledger, log lines and summary table,
the Prometheus endpoint and the end-of-run plot. No torch, no flwr."""

from .console import fmt_num, format_round_line, render_summary, summary_table
from .ledger import LedgerContents, PrivacyLedger, read_ledger
from .replay import load_round_records
from .plot import plot_privacy_curve
from .prometheus import PrivacyMetricsExporter, scrape_config_snippet

__all__ = [
    "LedgerContents",
    "PrivacyLedger",
    "PrivacyMetricsExporter",
    "fmt_num",
    "format_round_line",
    "load_round_records",
    "plot_privacy_curve",
    "read_ledger",
    "render_summary",
    "scrape_config_snippet",
    "summary_table",
]
