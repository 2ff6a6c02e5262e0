"""Empirical privacy audit (docs/audit.md): the worst-case canary through the package's own client
update, noise and aggregation (``canary``), the likelihood-ratio attack and its confidence bounds
(``attack``, numpy/scipy only), verdicts for every bound (``run``), and the plot (``plot``).
"""
