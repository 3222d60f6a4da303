"""RoleHandle: a role's engine handle."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.connector import KVConnector
from tandem.engine.handle import EngineHandle

if TYPE_CHECKING:
    from tandem.engine.engine import Engine


class RoleHandle(EngineHandle):
    """An EngineHandle whose engine runs the role's ``CONNECTOR`` (ValueError otherwise)."""

    ROLE = "worker"
    CONNECTOR: type[KVConnector] = KVConnector

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        if not isinstance(engine.connector, self.CONNECTOR):
            raise ValueError(f"a {self.ROLE} worker's engine needs connector={self.CONNECTOR.__name__}, "
                             f"not {type(engine.connector).__name__}")
        self.connector = engine.connector
