"""The simulated engine: cost profiles, simulated prefill/decode workers and the serving backend
``tandem serve --engine sim`` runs (see README.md)."""
