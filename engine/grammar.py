"""Constrained decoding: a :class:`~tandem.core.types.Constraint` becomes a token bitmask per step,
computed by llguidance (why llguidance and not xgrammar: engine/README.md)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance as llg
import torch

from tandem.core.types import Constraint, InvalidRequest

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for ``c``. Raises InvalidRequest for a spec that is not even well-formed
    (bad JSON); grammar errors proper surface when the grammar is compiled."""
    c.validate()
    if c.kind in ("json_schema", "json_object"):
        if c.kind == "json_object":
            schema: object = {"type": "object"}
        else:
            try:
                schema = json.loads(c.spec)
            except ValueError as e:
                raise InvalidRequest(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        return llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={**JSON_DEFAULTS, "lenient": not c.strict})
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(c.spec)
    return _structural_tag(c.spec)


def _structural_tag(spec: str) -> str:
    try:
        d = json.loads(spec)
        structures, triggers = d["structures"], d["triggers"]
        tags = []
        for s in structures:
            trig = [t for t in triggers if s["begin"].startswith(t)]
            if not trig:
                raise InvalidRequest(f"structural tag {s['begin']!r} starts with none of the triggers {triggers}")
            schema = s.get("schema", {})
            tags.append(llg.StructTag(trigger=max(trig, key=len), begin=s["begin"],
                                      grammar={**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}}
                                      if isinstance(schema, dict) else schema, end=s.get("end", "")))
    except InvalidRequest:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
        raise InvalidRequest(f"a structural_tag spec must be {{\"structures\": [{{\"begin\", \"schema\", "
                             f"\"end\"}}], \"triggers\": [...]}}: {e!r}"[:300]) from None
    if not tags:
        raise InvalidRequest("a structural_tag spec needs at least one structure")
    return llg.StructTag.to_grammar(tags, assume_special=False)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """``[batch, ceil(vocab_size / 32)]`` int32, every token allowed."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _bias_table() -> torch.Tensor:
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).float()


_BIAS = {"cpu": _bias_table()}


def bitmask_bias(words: torch.Tensor) -> torch.Tensor:
    """The additive mask of ``words`` ([R, W] int32 bitmask rows, any device): [R, 32 * W] float32
    on the same device, 0 for an allowed token and -inf for a forbidden one."""
    r = words.shape[0]
    by = words.contiguous().view(torch.uint8)                               # [R, 4W]
    if sys.byteorder != "little":
        by = by.view(r, -1, 4).flip(-1).reshape(r, -1)
    table = _BIAS.get(str(words.device))
    if table is None:
        table = _BIAS[str(words.device)] = _BIAS["cpu"].to(words.device)
    return torch.nn.functional.embedding(by.long(), table).view(r, -1)      # [R, 32W]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t] = -inf`` for every token ``t`` that ``bitmask[r]`` forbids, for each ``r``
    in ``rows`` (in place; other rows are untouched). logits: [B, V] float (any device); bitmask:
    [B, W] int32 on the CPU, rows aligned with logits."""
    if not rows:
        return
    b, v = logits.shape
    if bitmask.dim() != 2 or bitmask.shape[0] != b or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [{b}, W] like logits [{b}, {v}], got "
                         f"{bitmask.dtype} {list(bitmask.shape)}")
    every = len(rows) == b and list(rows) == list(range(b))
    words = bitmask if every else bitmask.index_select(0, torch.tensor(rows, dtype=torch.long))   # [R, W]
    add_bias(logits, bitmask_bias(words), rows)


def add_bias(logits: torch.Tensor, bias: torch.Tensor, rows: list[int]) -> None:
    """``logits[rows[i]] += bias[i]`` in place (bias [R, 32W] from :func:`bitmask_bias`; logits
    columns past ``32 * W`` become -inf)."""
    b, v = logits.shape
    width = min(bias.shape[1], v)
    bias = bias[:, :width].to(device=logits.device, dtype=logits.dtype)
    if len(rows) == b and list(rows) == list(range(b)):
        logits[:, :width].add_(bias)
        if width < v:
            logits[:, width:] = float("-inf")
        return
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx)
    sub[:, :width].add_(bias)
    if width < v:
        sub[:, width:] = float("-inf")
    logits.index_copy_(0, idx, sub)


class Matcher:
    """One request's grammar state."""

    def __init__(self, ll: "llg.LLMatcher", eos_ids: frozenset[int], constraint: Constraint):
        self._m = ll
        self._eos = eos_ids
        self.constraint = constraint
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU, contiguous rows)."""
        v = bitmask[row]
        if not v.is_contiguous() or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
            raise ValueError("bitmask must be a contiguous int32 CPU tensor")
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) when the grammar does not allow it."""
        t = int(token_id)
        if self._m.is_error() or self._m.validate_tokens([t]) != 1:
            return False
        if not self._m.consume_token(t):   # pragma: no cover - validate_tokens said yes
            return False
        self.accepted.append(t)
        return True

    def valid_prefix(self, tokens) -> int:
        """How many of ``tokens``, in order, the grammar would accept from here, stopping before
        the first EOS (changes nothing): a draft is cut there (engine/sched/spec/). An EOS is never
        drafted under a grammar: llguidance consumes an EOS once the grammar is complete without
        recording it, so rolling the draft back would undo one token too many (and an EOS ends the
        request anyway: the target's own token at that row finds it)."""
        if not tokens or self._m.is_error():
            return 0
        ids = [int(t) for t in tokens]
        n = self._m.validate_tokens(ids)
        return next((i for i, t in enumerate(ids[:n]) if t in self._eos), n)

    def forced(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens the grammar forces from here (llguidance's fast-forward tokens: a
        JSON schema's keys and punctuation); changes nothing. A draft where no text matches."""
        if limit <= 0 or self._m.is_error() or self._m.is_stopped():
            return ()
        ff = [int(t) for t in self._m.compute_ff_tokens()[:limit]]
        return tuple(ff[:next((i for i, t in enumerate(ff) if t in self._eos), len(ff))])

    def ends_at(self, token_id: int) -> bool:
        """Whether accepting ``token_id`` now would complete the grammar (changes nothing). An EOS
        the grammar allows ends it, and is not consumed to find out (llguidance would not record
        it, and the rollback would undo the token before it)."""
        if int(token_id) in self._eos:
            return self.is_terminated() or (not self._m.is_error() and self._m.validate_tokens([int(token_id)]) == 1)
        if not self.accept(token_id):
            return False
        done = self.is_terminated()
        self.rollback(1)
        return done

    def fill_along(self, tokens, bitmask: torch.Tensor, rows: list[int]) -> None:
        """``bitmask[rows[j]]``: the tokens allowed after ``tokens[:j]`` (j = 0 .. len(tokens);
        ``tokens`` a prefix the grammar accepts, :meth:`valid_prefix`): a verify step's draft
        positions; no EOS among them (:meth:`valid_prefix` cuts before one). The state is the same
        after."""
        if any(int(t) in self._eos for t in tokens):
            raise ValueError(f"a draft under a grammar never holds an EOS ({sorted(self._eos)}): {list(tokens)}")
        self.fill_bitmask(bitmask, rows[0])
        for j, t in enumerate(tokens):
            if not self._m.consume_token(int(t)):
                raise RuntimeError(f"draft token {int(t)} refused by the grammar: {self._m.get_error()}")
            self.fill_bitmask(bitmask, rows[j + 1])
        if tokens and not self._m.rollback(len(tokens)):
            raise RuntimeError(f"grammar rollback of {len(tokens)} tokens failed: {self._m.get_error()}")

    def is_terminated(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or EOS was accepted): finish."""
        return self._m.is_stopped() and not self._m.is_error()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self._m.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding, retries)."""
        if not 0 <= num_tokens <= len(self.accepted):
            raise ValueError(f"cannot roll back {num_tokens} tokens, {len(self.accepted)} accepted")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")
        del self.accepted[len(self.accepted) - num_tokens:]

    @property
    def error(self) -> str:
        return self._m.get_error()


@dataclass
class CompiledGrammar:
    """A compiled grammar, shared by every request with the same constraint."""

    constraint: Constraint
    _pristine: "llg.LLMatcher"
    _eos: frozenset[int]
    compile_s: float

    def matcher(self) -> Matcher:
        return Matcher(self._pristine.deep_copy(), self._eos, self.constraint)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and logits width; caches them per constraint."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *, threads: int = 1,
                 cache_size: int = 512):
        self.vocab_size = max(int(tokenizer.vocab_size), int(vocab_size or 0))
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self._tok = tokenizer
        self._lltok: "llg.LLTokenizer | None" = None
        self._tok_lock = threading.Lock()
        self.tokenizer_setup_s = 0.0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._executor = llg.LLExecutor(num_threads=threads)
        self._threads = threads
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._cache_size = cache_size
        self.hits = self.misses = 0

    def compile(self, constraint: Constraint) -> "Future[CompiledGrammar]":
        """A future of the compiled grammar: already done on a cache hit, else compiled on the pool.
        Poll ``done()`` from the step loop; ``result()`` raises InvalidRequest for a constraint that
        does not compile."""
        key = constraint.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                f: Future = Future()
                f.set_result(hit)
                return f
            f = self._inflight.get(key)
            if f is not None:
                self.hits += 1
                return f
            self.misses += 1
            f = self._inflight[key] = self._pool.submit(self._compile, constraint)
        return f

    def compile_now(self, constraint: Constraint) -> CompiledGrammar:
        """Compile on the calling thread (cached like :meth:`compile`)."""
        return self.compile(constraint).result()

    def _lltokenizer(self) -> "llg.LLTokenizer":
        with self._tok_lock:
            if self._lltok is None:
                t0 = time.perf_counter()
                self._lltok = llg.LLTokenizer(self._tok.backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=sorted(self.eos_ids) or None)
                self.tokenizer_setup_s = time.perf_counter() - t0
            return self._lltok

    def _compile(self, c: Constraint) -> CompiledGrammar:
        key = c.key()
        try:
            lltok = self._lltokenizer()
            t0 = time.perf_counter()
            grammar = grammar_text(c)
            ll = llg.LLMatcher(lltok, grammar, log_level=0)
            if ll.is_error():
                raise InvalidRequest(f"the {c.kind} constraint does not compile: {ll.get_error()}"[:1000])
            out = CompiledGrammar(c, ll, self.eos_ids, time.perf_counter() - t0)
            with self._lock:
                self._cache[key] = out
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return out
        except ValueError as e:
            if isinstance(e, InvalidRequest):
                raise
            raise InvalidRequest(f"the {c.kind} constraint is invalid: {e}"[:1000]) from None
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher (compiling synchronously on a miss)."""
        return self.compile_now(constraint).matcher()

    def matcher_from(self, constraint: Constraint, accepted_token_ids) -> Matcher:
        """The matcher after ``accepted_token_ids`` (e.g. the first token the prefill worker
        sampled). Raises InvalidRequest when the ids are not a prefix the grammar allows."""
        m = self.matcher(constraint)
        for i, t in enumerate(accepted_token_ids):
            if not m.accept(t):
                raise InvalidRequest(f"token {int(t)} at output position {i} is not allowed by the "
                                     f"{constraint.kind} constraint: {m.error or 'rejected'}")
        return m

    def fill_bitmasks(self, matchers: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """``fill_bitmask`` for many (matcher, row) pairs in one call: with ``threads > 1``
        llguidance computes the rows on its own threads with the GIL released; with one thread (or
        one row) on the calling thread, waking no worker."""
        if not matchers:
            return
        if not bitmask.is_contiguous() or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
            raise ValueError("bitmask must be a contiguous int32 CPU tensor")
        b, w = bitmask.shape
        if self._threads == 1 or len(matchers) == 1:
            for m, row in matchers:
                v = bitmask[row]
                m._m.unsafe_compute_mask_ptr(v.data_ptr(), w * 4)
            return
        self._executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in matchers],
                                               bitmask.data_ptr(), w * 4, b)

    def allocate_bitmask(self, batch: int) -> torch.Tensor:
        return allocate_bitmask(batch, self.vocab_size)

    def cache_info(self) -> dict:
        with self._lock:
            return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
