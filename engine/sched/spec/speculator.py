"""One engine's speculation: which decodes draft how many tokens this step (the cost rule), the
verify step's logit rows, and what each verification accepted (engine/sched/spec/README.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.sched.spec.ngram import NgramPool, RequestIndex

MAX_DRAFT_TOKENS = 32
DECAY = 0.7               # weight of the past in a request's acceptance EWMA, per verification
PROBE_EVERY = 16          # a request not worth drafting still drafts one token every this many
                          # steps times the batch's decodes
PRIOR_RATIO = 1 / 16      # step cost of one more token / the cost of a step, before measuring
TRUST_SHORT = 0.5         # a suffix match shorter than 3 tokens drafts only for requests accepting
                          # this often


@dataclass
class DraftState:
    """A request's drafting state (on its SchedReq, so it survives retraction): its n-gram index and
    the EWMA of accepted draft tokens (``hits``) over accepted plus first rejected (``tries``)."""

    index: RequestIndex = field(default_factory=RequestIndex)
    hits: float = 0.8
    tries: float = 2.0
    idle: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def alpha(self) -> float:
        """Estimated probability that one more draft token is accepted."""
        return self.hits / self.tries


class StepCost:
    """Measured step seconds. Steps without drafts fit ``a + b * tokens`` (an exponentially
    weighted least-squares fit; ``ratio`` = b / a, what one more token costs, in steps). A verify
    step may cost more than its tokens: another attention path (the torch backend attends each
    drafting request on its own) and a decode step after it that rebuilds what the verify
    disturbed (the decode KV mirror). ``extra`` is that overhead, in seconds: an EWMA over verify
    steps of their seconds beyond the fit's prediction (signed, so a noisy machine's scatter
    averages out), plus the next step's beyond it when that one is a plain step."""

    def __init__(self, decay: float = 0.95, fixed: float | None = None):
        """``fixed``: the ratio, never measured, and no verify overhead (tests whose drafts must
        not depend on timing)."""
        self.decay, self.fixed = decay, fixed
        self.w = self.t = self.tt = self.y = self.ty = 0.0
        self.extra = 0.0               # optimistic until verify steps are measured
        self._pending: float | None = None

    def observe(self, tokens: int, seconds: float, verify: bool = False) -> None:
        if self.fixed is not None:
            return
        over = seconds - self.predict(tokens) if self.w >= 4 else None
        if self._pending is not None:                  # the step after a verify step
            if not verify and over is not None:
                self._extra(self._pending + over)
                self._pending = None
                return
            self._extra(self._pending)
            self._pending = None
        if verify:
            self._pending = over                       # signed: noise averages out, not up
            return
        d = self.decay
        self.w, self.t, self.tt = d * self.w + 1, d * self.t + tokens, d * self.tt + tokens * tokens
        self.y, self.ty = d * self.y + seconds, d * self.ty + tokens * seconds

    def _extra(self, seconds: float) -> None:
        self.extra = 0.7 * self.extra + 0.3 * seconds

    def predict(self, tokens: int) -> float:
        """Seconds of a step of ``tokens`` without drafts (0 before any step was measured)."""
        if self.w == 0:
            return 0.0
        mt, my = self.t / self.w, self.y / self.w
        r = self.ratio
        a = my / (1 + r * mt)
        return a * (1 + r * tokens)

    @property
    def ratio(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if self.w < 4:
            return PRIOR_RATIO
        mt, my = self.t / self.w, self.y / self.w
        var = self.tt / self.w - mt * mt
        if var < 0.25:
            return PRIOR_RATIO          # every step had about as many tokens: no slope to read
        b = (self.ty / self.w - mt * my) / var
        a = my - b * mt
        if b <= 0:
            return 1 / 1024             # more tokens cost nothing measurable
        return 1024.0 if a <= 0 else min(max(b / a, 1 / 1024), 1024.0)

    def pays(self, batch: int, drafted: int, expected: float) -> bool:
        """Whether ``drafted`` draft tokens expected to add ``expected`` accepted ones pay for
        making a step of ``batch`` decodes a verify step: ``(B + E) / (t(B + K) + extra) > B /
        t(B)``."""
        step = self.predict(batch)
        if step <= 0:
            return True
        return expected * step > batch * (self.predict(batch + drafted) - step + max(self.extra, 0.0))


class Speculator:
    """Drafts for the decodes of a step, and the bookkeeping of their verification.

    Cost rule, in two halves. Per token: with step time ``a + b T`` for ``T`` tokens and ``B``
    decodes, a step makes about ``B / (a + b B)`` tokens per second; a request's ``i``-th draft
    token adds ``alpha ** i`` expected tokens for ``b`` more seconds, so it is drafted while
    ``alpha ** i > r B / (1 + r B)`` (``r = b / a``, measured). Per step: the drafts together must
    also pay for the verify step's own overhead (``StepCost.extra``, measured): else the step
    decodes without them, but for the probes. The draft is cut at ``max_tokens`` and the context
    length."""

    def __init__(self, max_draft: int, max_context: int):
        if not 1 <= max_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {max_draft}")
        self.max_draft, self.max_context = max_draft, max_context
        self.pool = NgramPool(span=max_draft)
        self.cost = StepCost()
        self.stats: dict = {}         # the scheduler's counters (engine/sched/sched_types.py new_stats)

    def length(self, st: DraftState, batch: int) -> int:
        """How many tokens ``st``'s request drafts in a step of ``batch`` decodes (the per-token
        half of the cost rule; 0: none, unless it is due a probe: :meth:`probe_due`)."""
        rb = self.cost.ratio * batch
        bar = rb / (1 + rb)
        k, p = 0, st.alpha
        while k < self.max_draft and p > bar:
            k, p = k + 1, p * st.alpha
        if k == 0 and self.probe_due(st, batch):
            k = 1
        return k

    @staticmethod
    def probe_due(st: DraftState, batch: int) -> bool:
        """A request not worth drafting drafts one token every PROBE_EVERY x ``batch`` steps, so
        its acceptance can recover (a probe makes its whole step a verify step)."""
        return st.idle >= PROBE_EVERY * batch

    @staticmethod
    def expected(st: DraftState, n: int) -> float:
        """Expected accepted tokens of a draft of ``n``: alpha + alpha^2 + ... + alpha^n."""
        a = st.alpha
        return sum(a ** i for i in range(1, n + 1))

    def draft(self, sr, batch: int) -> tuple[int, ...]:
        """The draft of ``sr`` for this step (() for none)."""
        r = sr.req
        if ((sr.grammar is not None and sr.matcher is None) or sr.ahead or sr.inflight
                or not r.params.speculative):
            return ()
        if sr.spec is None:
            sr.spec = DraftState()
        st = sr.spec
        k = min(self.length(st, batch), r.params.max_tokens - len(r.output_ids) - 1,
                self.max_context - r.seq_len - 1)
        if k <= 0:
            return ()
        ids = r.all_ids
        min_n = 1 if st.alpha >= TRUST_SHORT else st.index.max_n   # a short match is weak evidence
        d = st.index.propose(ids, k, min_n) or self.pool.propose((r.cache_salt, r.tenant), ids, k)
        if sr.matcher is not None:
            d = d[:sr.matcher.valid_prefix(d)] or sr.matcher.forced(k)   # a refused token ends it
        return d

    def plan(self, plan, decodes: list, kv) -> list:
        """Give each request of ``decodes`` worth a draft its ``1 + k`` slots in ``plan`` (never
        evicting for a draft: only while free slots stay for every other decode); returns the
        others, to decode as usual."""
        batch = len(decodes)
        probes = [sr.spec is not None and self.probe_due(sr.spec, batch) for sr in decodes]
        drafts = [self.draft(sr, batch) for sr in decodes]
        keep = [bool(d) for d in drafts]
        if any(d for d, p in zip(drafts, probes) if not p):           # the step-level half
            gain = sum(self.expected(sr.spec, len(d)) for sr, d, p in zip(decodes, drafts, probes) if d and not p)
            if not self.cost.pays(batch, sum(len(d) for d in drafts), gain):
                keep = [bool(d) and p for d, p in zip(drafts, probes)]
                self.stats["spec_steps_declined"] += 1
        rest = []
        for sr, d, k in zip(decodes, drafts, keep):
            if sr.spec is not None:
                sr.spec.idle = 0 if k else sr.spec.idle + 1
            spare = kv.alloc.available_size() - (batch + 1) * kv.page_size
            slots = kv.extend(sr, 1 + len(d)) if k and spare >= 1 + len(d) else None
            if slots is None:
                rest.append(sr)
                continue
            plan.add(sr, 1 + len(d), slots, draft=d)
        return rest

    def verified(self, sr, draft: tuple[int, ...], run: tuple[int, ...]) -> None:
        """``run`` (``draft[:m]`` then the target's own token) is what verifying ``draft`` gave."""
        st, m = sr.spec, len(run) - 1
        st.hits = DECAY * st.hits + m
        st.tries = DECAY * st.tries + m + (m < len(draft))
        st.drafted += len(draft)
        st.accepted += m
        self.stats["spec_drafted_tokens"] += len(draft)
        self.stats["spec_accepted_tokens"] += m
        self.stats["spec_verify_steps"] += 1

    def finished(self, sr) -> None:
        """``sr`` finished: its text joins its tenant's pool."""
        r = sr.req
        if r.output_ids and r.params.speculative:
            self.pool.add((r.cache_salt, r.tenant), r.all_ids)


def logit_layout(plan) -> tuple[list[int], list, list[int]]:
    """The rows a step samples: ``(token index into the forward's T, SchedReq, output offset)``
    per row, in ``plan.sampling`` order; an entry with a draft of k tokens has k + 1 rows (its
    pending token's position and each draft token's), one without a draft its last position."""
    idx, srs, offsets, t = [], [], [], 0
    for e in plan.entries:
        t += e.n
        if e.samples:
            k = len(e.draft)
            idx.extend(range(t - 1 - k, t))
            srs.extend([e.sr] * (k + 1))
            offsets.extend(range(k + 1))
    return idx, srs, offsets


def accepted_runs(plan, tokens: list, logprobs: list | None) -> tuple[list, list | None]:
    """Per sampling entry of ``plan``: its token (no draft), or the tuple of tokens the verification
    accepted: the draft's longest prefix the target picked too, then the target's token at the
    first difference (or after the whole draft); ``tokens`` / ``logprobs`` are per row of
    :func:`logit_layout`."""
    out, lps, i = [], [] if logprobs is not None else None, 0
    for e in plan.sampling:
        k = len(e.draft)
        picks = tokens[i:i + k + 1]
        if not k:
            out.append(picks[0])
            if lps is not None:
                lps.append(logprobs[i])
        else:
            m = 0
            while m < k and picks[m] == e.draft[m]:
                m += 1
            out.append(tuple(picks[:m + 1]))
            if lps is not None:
                lps.append(tuple(logprobs[i:i + m + 1]))
        i += k + 1
    return out, lps


def make_speculator(cfg, arch, max_context: int) -> tuple[Speculator | None, str]:
    """The engine's Speculator (None when off) and the startup line's clause saying so, and why."""
    if cfg.speculative_algorithm == "off":
        return None, "off"
    if "mamba" in arch.layer_types:
        return None, ("off: recurrent (mamba) layers cannot roll back the state of rejected "
                      "draft tokens")
    k = cfg.speculative_num_draft_tokens
    return Speculator(k, max_context), f"ngram (up to {k} draft tokens)"
