"""Per-request output tracking: finish conditions and streamed text."""

from __future__ import annotations

from tandem.core.types import Req


class OutputTracker:
    def __init__(self, req: Req, tokenizer, max_context: int):
        self.req = req
        self.tok = tokenizer
        self.max_context = max_context
        self.sent = 0
        self.text = ""
        self.stop_str: str | None = None
        p = req.params
        self._stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            self._stop_ids |= set(tokenizer.eos_token_ids)
        self._stops = p.stop
        self._max_hold = max((len(s) for s in self._stops), default=0)

    def _decoded(self) -> str:
        ids = self.req.output_ids
        if ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        return self.tok.decode(ids)

    def may_finish(self, tok: int) -> bool:
        """Whether :meth:`on_token` could finish the request once ``tok`` is appended (False: it
        surely does not; True may be a stop string that ``min_tokens`` still holds back). Changes
        nothing. A grammar's end is not looked at (the scheduler asks the matcher, Matcher.ends_at)."""
        req = self.req
        if (tok in self._stop_ids or len(req.output_ids) + 1 >= req.params.max_tokens
                or req.seq_len + 1 >= self.max_context):
            return True
        if not self._stops:
            return False
        text = self.tok.decode(req.output_ids + [tok])
        start = max(0, self.sent - self._max_hold)
        return any(text.find(s, start) >= 0 for s in self._stops)

    def on_token(self, tok: int, grammar_done: bool = False) -> tuple[str, str | None]:
        req = self.req
        finish: str | None = None
        if tok in self._stop_ids and len(req.output_ids) >= req.params.min_tokens:
            finish = "stop"
        text = self._decoded()
        if self._stops:
            start = max(0, self.sent - self._max_hold)
            found = [(i, s) for s in self._stops if (i := text.find(s, start)) >= 0]
            if found and len(req.output_ids) >= req.params.min_tokens:
                cut, self.stop_str = min(found, key=lambda f: f[0])
                text, finish = text[:cut], "stop"
        if finish is None and grammar_done:
            finish = "stop"
        if finish is None and (len(req.output_ids) >= req.params.max_tokens
                               or req.seq_len >= self.max_context):
            finish = "length"
        if finish is None:
            safe = len(text)
            while safe > self.sent and text[safe - 1] == "\ufffd":
                safe -= 1
            for s in self._stops:
                for k in range(min(len(s) - 1, safe - self.sent), 0, -1):
                    if text[safe - k:safe] == s[:k]:
                        safe -= k
                        break
            new, self.sent = text[self.sent:safe], max(self.sent, safe)
            return new, None
        new = text[self.sent:]
        self.sent = len(text)
        self.text = text
        return new, finish

    def full_text(self) -> str:
        """The text so far: all of it once finished, else what was already streamed."""
        return self.text if self.text else self._decoded()[: self.sent]
