"""Noisy-FedAvg on scikit-learn's bundled digits with fl-dp-flower (an example app to copy)."""
