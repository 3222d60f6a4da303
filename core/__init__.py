"""Shared vocabulary of Tandem. Imports nothing of ours and no torch (see README.md)."""
