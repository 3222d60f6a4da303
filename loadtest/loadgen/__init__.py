"""``tandem bench``: a load generator for a running Tandem (or any OpenAI-compatible) server."""
