"""``tandem bench``: a load generator for a running Tandem (or any OpenAI-compatible) server.

workloads.py (agent sessions, vLLM multi-turn shape) and traces.py (Mooncake, Azure) plan what
to send; client.py sends it, streamed, and times each request; report.py summarises and writes
JSON; plots.py draws the figures; cli.py is the command line. Usage: docs/BENCH.md.
"""
