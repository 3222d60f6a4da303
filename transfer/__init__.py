"""Moves KV bytes between workers: regions and page ids, never requests or trees (transfer/README.md)."""
