"""The HTTP front door (OpenAI-compatible), routing policies and the session table.

Public entry points: ``tandem.router.http.create_app(backend, config)`` and the
``tandem.router.backend.ServingBackend`` protocol (``LocalEngineBackend`` for colocated mode).
This package imports ``tandem.core`` only; never the engine or torch at import time.
"""
