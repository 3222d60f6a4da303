"""Shared vocabulary of Tandem: imports nothing of ours and no torch."""
