"""Decode worker: preallocates pages, receives KV, streams tokens (see README.md)."""
