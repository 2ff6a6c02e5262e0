"""Flower glue: ``client`` (ClientApp: train/evaluate handlers) and ``server`` (ServerApp main)."""
