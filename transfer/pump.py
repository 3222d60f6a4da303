"""Pump: a worker's one NIXL progress loop (UCX tcp writes into a worker move only when it
progresses its agent). Event-loop thread only; the agent is not thread-safe."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from tandem.transfer.agent import KVTransferAgent

PUMP_S = 0.0005
log = logging.getLogger(__name__)


class Pump:
    """The worker's one NIXL progress loop: while ``live()``, progress the agent every ``PUMP_S``
    (UCX tcp writes into this worker move only when it progresses)."""

    def __init__(self, agent: KVTransferAgent, name: str, live: Callable[[], bool]):
        self.agent, self.name, self.live = agent, name, live
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self.live():
            try:
                self.agent.progress()
            except Exception:   # keep pumping: the writer's own bound ends its call
                log.exception("NIXL progress failed on %s", self.name)
            await asyncio.sleep(PUMP_S)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
