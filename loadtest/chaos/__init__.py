"""Chaos harness: seeded random multi-turn sessions with client aborts against a live server, an
oracle for every completed request, and a leak check of every worker once idle (see cli.py)."""
