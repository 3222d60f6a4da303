"""Prefill worker: runs prompts, holds their KV and WRITEs it into a decode worker's pages."""
