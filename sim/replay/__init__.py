"""Trace replay over a simulated prefill/decode cluster, for routing experiments on one CPU."""
