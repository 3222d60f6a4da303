"""Composition root: config loading, Ray launch and placement, health, the `tandem` CLI."""
