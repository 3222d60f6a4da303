"""RoleHandle: a role's engine handle (written once for prefill's and decode's)."""

from __future__ import annotations

from tandem.engine.connector import KVConnector
from tandem.engine.handle import EngineHandle


class RoleHandle(EngineHandle):
    """An :class:`EngineHandle` over an engine whose scheduler runs the role's connector
    (``CONNECTOR``; ValueError otherwise), kept as ``self.connector``."""

    ROLE = "worker"
    CONNECTOR: type[KVConnector] = KVConnector

    def __init__(self, engine):
        super().__init__(engine)
        if not isinstance(engine.connector, self.CONNECTOR):
            raise ValueError(f"a {self.ROLE} worker's engine needs connector={self.CONNECTOR.__name__}, "
                             f"not {type(engine.connector).__name__}")
        self.connector = engine.connector
