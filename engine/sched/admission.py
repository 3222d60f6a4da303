"""Admission: which waiting request may take a row, in what order, and with what it starts."""

from __future__ import annotations

import time
from typing import Callable

from tandem.core.messages import Resume, SampleGroup
from tandem.core.types import InvalidRequest, Req
from tandem.engine.connector import KVConnector
from tandem.engine.sched.output import OutputTracker
from tandem.engine.sched.queue_policy import order
from tandem.engine.request_kv import RequestKV
from tandem.engine.sched.sample_groups import SampleGroups
from tandem.engine.sched.sched_types import SchedReq


class Admission:
    def __init__(self, kv: RequestKV, tokenizer, max_context: int, policy: str,
                 grammar: Callable[[], object] | None, connector: KVConnector,
                 groups: SampleGroups, stats: dict):
        self.kv, self.tok, self.max_context, self.policy = kv, tokenizer, max_context, policy
        self.grammar, self.connector, self.groups, self.stats = grammar, connector, groups, stats
        self.session_seen: dict[str, float] = {}

    def validate(self, req: Req) -> None:
        req.params.validate()
        n, pool = req.seq_len, self.kv.alloc.size
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        if n >= self.max_context:
            raise InvalidRequest(
                f"the prompt has {n} tokens but the context holds {self.max_context} "
                f"(prompt + at least 1 generated token must fit)")
        if n + 1 > pool:
            raise InvalidRequest(f"the prompt has {n} tokens but the KV pool holds {pool} tokens")

    def track(self, req: Req, group: SampleGroup | None = None, resume: Resume | None = None) -> SchedReq:
        """``resume``: ``req.output_ids`` were generated elsewhere; its stream has sent
        ``streamed_chars`` of their text and its prompt's usage is counted (not again here)."""
        self.validate(req)
        c = req.params.constraint
        if c is not None and self.grammar is None:
            raise InvalidRequest("this engine has no grammar engine: constrained decoding is off")
        if req.session_id is not None:
            self.session_seen[req.session_id] = time.monotonic()
        sr = SchedReq(req, OutputTracker(req, self.tok, self.max_context), group=group)
        sr.receive = self.connector.receives(sr)
        if resume is not None:
            sr.tracker.sent, req.cached_len, req.admissions = resume.streamed_chars, resume.cached_tokens, 1
        if c is not None:
            sr.grammar = self.grammar().compile(c)
        self.groups.add(sr, self.kv.holders)
        self.kv.prefetch(sr)
        return sr

    def order(self, waiting) -> list[SchedReq]:
        if self.policy != "lpm" or len(waiting) < 2:
            return list(waiting)
        return order(waiting, lambda sr: self.kv.cache.peek(sr.req.cache_ids), "lpm",
                     token_ids_fn=lambda sr: sr.req.cache_ids, page_size=self.kv.page_size)

    @staticmethod
    def grammar_ready(sr: SchedReq) -> bool:
        if sr.grammar is None or sr.matcher is not None:
            return True
        if not sr.grammar.done():
            return False
        m = sr.grammar.result().matcher()
        for i, t in enumerate(sr.req.output_ids):
            if not m.accept(t):
                raise InvalidRequest(f"token {t} at output position {i} is not allowed by the "
                                     f"{m.constraint.kind} constraint: {m.error or 'rejected'}")
        sr.matcher = m
        return True

    def fork_prompt(self, sr: SchedReq) -> None:
        """All but the last prompt token, copied from a computed sibling; counted as cached."""
        src = self.groups.computed_sibling(sr, self.kv.holders)
        n = len(sr.req.prompt_ids) - 1
        if src is not None and self.kv.fork(sr, src, n):
            sr.req.cached_len += n
            self.stats["cached_tokens"] += n
