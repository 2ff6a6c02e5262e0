"""fl-dp-flower: differentially private federated learning (Noisy-FedAvg / Noisy-FedProx) on Flower.

Layers (data flows one way: config -> strategy -> clients -> aggregate -> accountant -> reports):

- ``fl_dp_flower.privacy``    pure math + accounting (numpy/scipy only, no torch, no flwr)
- ``fl_dp_flower.training``   models, data, local update, noise (torch)
- ``fl_dp_flower.strategies`` Flower strategies and the validated app config (flwr)
- ``fl_dp_flower.reporting``  ledger, logs, Prometheus metrics, plots
"""

__version__ = "0.1.0"
