"""Sample groups on a decode worker: the prompt's KV moves once per group. Event-loop thread only."""

from __future__ import annotations

import asyncio

from tandem.core.messages import GenerateRequest


class GroupGates:
    def __init__(self):
        self._gates: dict[str, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._gates)

    async def enter(self, greq: GenerateRequest, aborted: asyncio.Event,
                    timeout_s: float) -> asyncio.Event | None:
        """The gate ``greq`` must open (it leads its group here), or None: not in a group, or a
        later member, returned once the leader's gate opened, ``aborted`` was set or
        ``timeout_s`` passed."""
        g = greq.group
        if g is None:
            return None
        gate = self._gates.get(g.id)
        if gate is None:
            gate = self._gates[g.id] = asyncio.Event()
            return gate
        opened, stop = asyncio.ensure_future(gate.wait()), asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait([opened, stop], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
            stop.cancel()
        return None

    def open(self, greq: GenerateRequest, gate: asyncio.Event | None) -> None:
        """The group's later members may reserve now. Idempotent; None is a no-op."""
        if gate is None or gate.is_set():
            return
        gate.set()
        if greq.group is not None and self._gates.get(greq.group.id) is gate:
            del self._gates[greq.group.id]
