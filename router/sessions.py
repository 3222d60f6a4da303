"""Naming sessions (:func:`session_key`) and the session table: which prefill and decode worker a
conversation last used.

A request's session key, first found wins: the body's ``prompt_cache_key`` (OpenAI's "route
requests sharing a prefix together": requests with one key land on the same workers whatever
session they belong to, and a key with no session id is routed as a session), a session header
(SESSION_HEADERS, in order), the body's ``session_id``, ``user``, Anthropic's
``metadata.user_id``, else a fingerprint of the chat's opening. So a cache key, the client's own
statement of what shares a prefix, beats a session id, which beats who the user is."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

MAX_SESSION_ID_CHARS = 256
SESSION_HEADERS = ("x-session-id", "x-session-affinity", "x-claude-code-session-id", "session-id")


class SessionIdTooLong(ValueError):
    """An explicit session id over MAX_SESSION_ID_CHARS (the front door answers 400)."""


def session_key(headers: Mapping[str, str], body: Mapping[str, Any], prompt_ids: Sequence[int] = ()) -> str | None:
    """The session a request belongs to (order in the module docstring). None for a plain
    completion prompt with no session named. Raises SessionIdTooLong."""
    meta = body.get("metadata")
    values = [body.get("prompt_cache_key")] + [headers.get(h) for h in SESSION_HEADERS] + [
        body.get("session_id"), body.get("user"), meta.get("user_id") if isinstance(meta, Mapping) else None]
    for value in values:
        if isinstance(value, str) and value:
            if len(value) > MAX_SESSION_ID_CHARS:
                raise SessionIdTooLong(f"session id has {len(value)} characters, at most "
                                       f"{MAX_SESSION_ID_CHARS} allowed")
            return value
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, Mapping) for m in messages):
        system = body.get("system")   # Anthropic keeps the system prompt out of the messages
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        fp = fingerprint(messages)
        if fp is not None:
            return f"fp-{fp:016x}"
    return None


@dataclass(slots=True)
class SessionEntry:
    prefill_worker: int
    decode_worker: int
    last_touched: float     # the view's clock (seconds)
    turns: int = 1


class SessionTable:
    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000):
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError(f"ttl_s={ttl_s} must be > 0 and max_sessions={max_sessions} >= 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[Hashable, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable | None, now: float) -> SessionEntry | None:
        """The live entry for ``key``, or None (no key, unknown, or idle past ``ttl_s``)."""
        if key is None:
            return None
        e = self._entries.get(key)
        if e is None or now - e.last_touched > self.ttl_s:
            return None
        return e

    def bind(self, key: Hashable | None, prefill_worker: int, decode_worker: int, now: float) -> None:
        """Record the workers ``key``'s latest turn went to (touching it)."""
        if key is None:
            return
        e = self._entries.get(key)
        if e is None:
            self._entries[key] = SessionEntry(prefill_worker, decode_worker, now)
            if len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)
            return
        live = now - e.last_touched <= self.ttl_s
        e.prefill_worker, e.decode_worker, e.last_touched = prefill_worker, decode_worker, now
        e.turns = e.turns + 1 if live else 1
        self._entries.move_to_end(key)

    def forget_worker(self, worker: int) -> int:
        """Drop every entry pinned to ``worker`` (it left the cluster). Returns how many."""
        gone = [k for k, e in self._entries.items() if worker in (e.prefill_worker, e.decode_worker)]
        for k in gone:
            del self._entries[k]
        return len(gone)

    def expire(self, now: float) -> int:
        """Drop entries idle past ``ttl_s`` (oldest first). Returns how many."""
        n = 0
        while self._entries:
            k, e = next(iter(self._entries.items()))
            if now - e.last_touched <= self.ttl_s:
                break
            del self._entries[k]
            n += 1
        return n


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def fingerprint(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """A stable 63-bit id of a chat's opening: every system/developer message before the first user
    message, and that user message."""
    head = []
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            head.append([role, _content_text(m.get("content"))])
        elif role == "user":
            head.append(["user", _content_text(m.get("content"))])
            blob = json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode()
            return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1
    return None
