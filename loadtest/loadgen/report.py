"""Per-request records, the run summary, the printed table, the JSON report, and the per-worker
cache numbers read from the server's /metrics.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

PERCENTILES = (50, 90, 99)


@dataclass
class Record:
    """One request as the client saw it. ``error`` is None on success, else a kind:
    ``http_<status>``, ``timeout``, ``connection``, ``stream_error`` (an error event inside the
    stream), ``incomplete`` (the stream ended without ``[DONE]``), ``protocol`` (unparsable data)."""

    session: str | None
    turn: int
    start: float
    scheduled: float | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    error_detail: str | None = None
    status: int | None = None
    request_id: str | None = None
    retry_after: str | None = None
    text: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("text")
        return d


def percentile(xs: list[float], p: float) -> float | None:
    """The ``p``-th percentile of ``xs`` (0 <= p <= 100), linear between closest ranks; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    rank = p / 100 * (len(s) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def _stats(xs: list[float]) -> dict:
    out = {f"p{p}": percentile(xs, p) for p in PERCENTILES}
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["count"] = len(xs)
    return out


def summarize(records: list[Record]) -> dict:
    """The run's summary. Latency stats and token sums are over successful requests; the duration
    runs from the first send to the last end (of any request)."""
    ok = [r for r in records if r.ok]
    starts = [r.start for r in records]
    ends = [r.start + r.e2e for r in records if r.e2e is not None]
    duration = (max(ends + starts) - min(starts)) if starts else 0.0
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_kind": dict(Counter(r.error for r in records if not r.ok)),
        "duration_s": duration,
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _stats([x for r in ok for x in r.itl]),
        "e2e_s": _stats([r.e2e for r in ok if r.e2e is not None]),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "cached_token_ratio": cached / prompt if prompt else None,
    }


def hit_ratio_by_turn(records: list[Record]) -> dict[int, float]:
    """Cluster-wide cached / prompt tokens of the successful requests of each turn index."""
    sums: dict[int, list[int]] = {}
    for r in records:
        if r.ok and r.prompt_tokens:
            s = sums.setdefault(r.turn, [0, 0])
            s[0] += r.cached_tokens or 0
            s[1] += r.prompt_tokens
    return {t: c / p for t, (c, p) in sorted(sums.items())}


def by_turn(records: list[Record]) -> dict[int, dict]:
    """Per turn index, over the sessions whose previous turn succeeded too: ``n``, TTFT p50 and
    mean (s), and prompt tokens ``computed`` (prompt - cached, the usage's numbers) against
    ``ideal``: what the cluster did not hold, at best. Turn t > 0 ideally computes only its new
    tokens (its prompt minus the previous turn's prompt and reply); turn 0, its whole uncached
    prompt as reported (nothing to compare it with here)."""
    prev = {(r.session, r.turn): r for r in records if r.ok and r.session is not None}
    out: dict[int, dict] = {}
    for (sid, t), r in sorted(prev.items(), key=lambda kv: kv[0][1]):
        p = prev.get((sid, t - 1)) if t > 0 else None
        if r.prompt_tokens is None or (t > 0 and (p is None or p.prompt_tokens is None)):
            continue
        computed = r.prompt_tokens - (r.cached_tokens or 0)
        ideal = computed if p is None else r.prompt_tokens - (p.prompt_tokens or 0) - (p.completion_tokens or 0)
        row = out.setdefault(t, {"n": 0, "computed": 0, "ideal": 0, "ttft": []})
        row["n"] += 1
        row["computed"] += computed
        row["ideal"] += max(ideal, 0)
        if r.ttft is not None:
            row["ttft"].append(r.ttft)
    for row in out.values():
        ttft = row.pop("ttft")
        row["ttft_p50_s"] = percentile(ttft, 50)
        row["ttft_mean_s"] = sum(ttft) / len(ttft) if ttft else None
    return out


def format_turns(turns: dict[int, dict]) -> str:
    """``by_turn`` as a text table."""
    lines = [f"{'turn':>5}{'n':>5}{'computed':>10}{'ideal':>8}{'TTFT p50 ms':>13}{'mean ms':>10}"]
    for t, row in sorted(turns.items()):
        lines.append(f"{t:>5}{row['n']:>5}{row['computed']:>10}{row['ideal']:>8}"
                     f"{_ms(row['ttft_p50_s']):>13}{_ms(row['ttft_mean_s']):>10}")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def format_table(summary: dict, title: str) -> str:
    """A short text table of the summary."""
    s = summary
    lines = [f"{title}: {s['requests']} requests ({s['ok']} ok, {s['errors']} errors) in {s['duration_s']:.2f} s",
             f"{'':10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}"]
    for label, key in (("TTFT ms", "ttft_s"), ("ITL ms", "itl_s"), ("E2E ms", "e2e_s")):
        st = s[key]
        lines.append(f"{label:10}" + "".join(f"{_ms(st[k]):>10}" for k in ("p50", "p90", "p99", "mean")))
    tps, rps, ratio = s["output_tokens_per_s"], s["requests_per_s"], s["cached_token_ratio"]
    lines.append(f"throughput: {tps or 0:.1f} output tok/s, {rps or 0:.2f} req/s; "
                 f"cached tokens: {s['cached_tokens']}/{s['prompt_tokens']} prompt tokens "
                 f"({'-' if ratio is None else f'{ratio:.1%}'})")
    if s["errors_by_kind"]:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["errors_by_kind"].items())))
    return "\n".join(lines)


def write_json(path: str | Path, *, config: dict, summary: dict, records: list[Record],
               server: dict | None = None) -> None:
    doc = {"config": config, "summary": summary, "server": server or {},
           "records": [r.to_json() for r in records]}
    Path(path).write_text(json.dumps(doc, indent=1))


# ------------------------------------------------------------------------------ /metrics
Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse_metrics(text: str) -> dict[Sample, float]:
    """Prometheus text -> {(sample name, sorted labels): value} (``_created`` samples dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Sample, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def worker_hit_ratios(before: dict[Sample, float], after: dict[Sample, float]) -> dict[str, dict]:
    """Per-worker prefix-cache hit ratio over the run, from samples labelled ``worker`` whose name
    starts with ``tandem_`` (counters as after - before). The first of these that a worker has wins:

    1. a ``tandem_*cache*`` sample named ``*hit_ratio*`` or ``*hit_rate*`` (its final value);
    2. ``tandem_*cache*hit*_total`` / (that + ``tandem_*cache*miss*_total``);
    3. ``tandem_cached_prompt_tokens_total`` / ``tandem_prompt_tokens_total``.

    Empty when the server exports no per-worker cache metrics.
    """
    per: dict[str, dict[str, float]] = {}
    for (name, labels), value in after.items():
        lab = dict(labels)
        w = lab.get("worker")
        if w is None or not name.startswith("tandem_"):
            continue
        delta = value - before.get((name, labels), 0.0)
        d = per.setdefault(w, {})
        if "cache" in name and ("hit_ratio" in name or "hit_rate" in name):
            d["ratio"] = value
        elif "cache" in name and "hit" in name and name.endswith("_total"):
            d["hits"] = d.get("hits", 0.0) + delta
        elif "cache" in name and "miss" in name and name.endswith("_total"):
            d["misses"] = d.get("misses", 0.0) + delta
        elif name == "tandem_cached_prompt_tokens_total":
            d["cached"] = d.get("cached", 0.0) + delta
        elif name == "tandem_prompt_tokens_total":
            d["prompt"] = d.get("prompt", 0.0) + delta
    out: dict[str, dict] = {}
    for w, d in sorted(per.items()):
        if "ratio" in d:
            out[w] = {"hit_ratio": d["ratio"], "source": "ratio"}
        elif "hits" in d and (d["hits"] + d.get("misses", 0.0)) > 0:
            out[w] = {"hit_ratio": d["hits"] / (d["hits"] + d.get("misses", 0.0)), "source": "hits/misses",
                      "hits": d["hits"], "misses": d.get("misses", 0.0)}
        elif "cached" in d and d.get("prompt", 0.0) > 0:
            out[w] = {"hit_ratio": d["cached"] / d["prompt"], "source": "cached/prompt tokens",
                      "cached": d["cached"], "prompt": d["prompt"]}
    return out
