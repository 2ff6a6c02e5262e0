"""fl-dp-flower: differentially private federated learning (Noisy-FedAvg / Noisy-FedProx) on Flower.

Layers (docs/ARCHITECTURE.md has the data flow):

- ``fl_dp_flower.vocabulary``  every user-facing name, defined once (standard library only)
- ``fl_dp_flower.privacy``     the math and the accountant (numpy/scipy only; docs/MATH.md)
- ``fl_dp_flower.training``    models, data, local update, noise (torch)
- ``fl_dp_flower.config``      the validated run config (pydantic)
- ``fl_dp_flower.reporting``   ledger, log lines, Prometheus, plot, round reporters (no torch, no flwr)
- ``fl_dp_flower.strategies``  the Flower strategies (flwr)
- ``fl_dp_flower.apps``        the ClientApp and the ServerApp
- ``fl_dp_flower.launcher``    ``fl-dp-flower run``: the main job in Flower's simulation engine
"""

__version__ = "0.1.0"
