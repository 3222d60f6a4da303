"""OpenAI ``n`` on one worker: the members of a SampleGroup compute their shared prompt once."""

from __future__ import annotations

from tandem.engine.sched.sched_types import SchedReq


class SampleGroups:
    def __init__(self) -> None:
        self._members: dict[str, list[SchedReq]] = {}

    def add(self, sr: SchedReq, holders: dict[str, SchedReq]) -> None:
        """Register ``sr``; first forget finished members that hold no KV any more."""
        if sr.group is None:
            return
        for gid in list(self._members):
            left = [m for m in self._members[gid] if not m.req.finished or holders.get(m.rid) is m]
            if left:
                self._members[gid] = left
            else:
                del self._members[gid]
        self._members.setdefault(sr.group.id, []).append(sr)

    def remove(self, sr: SchedReq) -> None:
        """Forget ``sr`` (finished, or a reservation that got no room); a no-op when unknown."""
        if sr.group is None:
            return
        members = self._members.get(sr.group.id)
        if members is not None and sr in members:
            members.remove(sr)
            if not members:
                del self._members[sr.group.id]

    def prefilling_sibling(self, sr: SchedReq, running: dict[str, SchedReq]) -> SchedReq | None:
        """Another member of ``sr``'s group that is in ``running`` and has not computed the prompt
        yet (so ``sr`` should wait for its KV), or None."""
        if sr.group is None:
            return None
        for m in self._members.get(sr.group.id, ()):
            if m is not sr and running.get(m.rid) is m and m.req.computed_len < len(m.req.prompt_ids):
                return m
        return None

    def computed_sibling(self, sr: SchedReq, holders: dict[str, SchedReq]) -> SchedReq | None:
        """Another member of ``sr``'s group holding KV here (``holders``: running, reserved or held
        for sending) whose whole prompt is computed: the source of a fork (RequestKV.fork) when the
        prefix cache keeps nothing. None when there is none."""
        if sr.group is None:
            return None
        n = len(sr.req.prompt_ids)
        for m in self._members.get(sr.group.id, ()):
            if (m is not sr and holders.get(m.rid) is m and m.req.computed_len >= n
                    and m.req.prompt_ids == sr.req.prompt_ids):
                return m
        return None

    def __len__(self) -> int:
        return len(self._members)
