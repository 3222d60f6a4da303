"""The HTTP front door (OpenAI-compatible), routing policies and the session table."""
