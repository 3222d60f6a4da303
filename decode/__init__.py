"""Decode worker: preallocates pages, receives KV, streams tokens."""
