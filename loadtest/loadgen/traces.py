"""Trace replay: public traces turned into open-loop :class:`TimedRequest` lists."""

from __future__ import annotations

import csv
import json
import math
import random
from datetime import datetime
from pathlib import Path

from tandem.loadtest.loadgen.workloads import TimedRequest, Workload, cap_tokens, words

MOONCAKE_BLOCK_TOKENS = 512
# Token ids are drawn from [TOKEN_ID_LO, TOKEN_ID_HI): above every special token of SmolLM2 / Llama /
# Qwen (ids < 1000 hold the specials and single bytes) and inside every vocabulary of >= 32k ids.
TOKEN_ID_LO, TOKEN_ID_HI = 1000, 32000


def hash_block(hash_id: int, block_size: int) -> tuple[int, ...]:
    """The ``block_size`` token ids standing for Mooncake block ``hash_id`` (a function of the id only)."""
    rng = random.Random(f"mooncake-block/{int(hash_id)}")
    return tuple(rng.randrange(TOKEN_ID_LO, TOKEN_ID_HI) for _ in range(block_size))


def mooncake_prompt(hash_ids: list[int], input_length: int, block_size: int) -> tuple[int, ...]:
    """Token ids of one Mooncake request: its blocks concatenated, cut to the scaled input length."""
    n = math.ceil(input_length * block_size / MOONCAKE_BLOCK_TOKENS)
    ids: list[int] = []
    for h in hash_ids:
        if len(ids) >= n:
            break
        ids += hash_block(h, block_size)
    return tuple(ids[:max(1, n)])


def load_mooncake(path: str | Path, *, block_size: int = 16, speedup: float = 1.0,
                  max_tokens: int | None = None, max_requests: int | None = None) -> Workload:
    if block_size < 1 or speedup <= 0:
        raise ValueError(f"block size must be >= 1 and speedup > 0, got {block_size} and {speedup}")
    reqs: list[TimedRequest] = []
    t0 = None
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if max_requests is not None and len(reqs) >= max_requests:
                break
            try:
                r = json.loads(line)
                ts, n_in, n_out, hashes = (float(r["timestamp"]), int(r["input_length"]),
                                           int(r["output_length"]), list(r["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
            t0 = ts if t0 is None else t0
            reqs.append(TimedRequest(len(reqs), (ts - t0) / 1000.0 / speedup,
                                     mooncake_prompt(hashes, n_in, block_size), cap_tokens(n_out, max_tokens)))
    return Workload("trace:mooncake", requests=reqs,
                    notes=f"{len(reqs)} requests, block size {block_size}, speedup {speedup}")


def _azure_time(s: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (fractions of any length)."""
    base, _, frac = s.strip().partition(".")
    return datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)


def load_azure(path: str | Path, *, scale: float = 1.0, speedup: float = 1.0, seed: int = 0,
               max_tokens: int | None = None, max_requests: int | None = None) -> Workload:
    if scale <= 0 or speedup <= 0:
        raise ValueError(f"scale and speedup must be > 0, got {scale} and {speedup}")
    reqs: list[TimedRequest] = []
    t0 = None
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(rows.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure trace (missing columns {sorted(missing)})")
        for row in rows:
            if max_requests is not None and len(reqs) >= max_requests:
                break
            try:
                ts, n_in, n_out = _azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except ValueError as e:
                raise ValueError(f"{path}:{rows.line_num}: bad row ({e})") from None
            t0 = ts if t0 is None else t0
            rng = random.Random(f"azure/{seed}/{len(reqs)}")
            reqs.append(TimedRequest(len(reqs), (ts - t0) / speedup, words(rng, max(1, round(n_in * scale))),
                                     cap_tokens(round(n_out * scale), max_tokens)))
    return Workload("trace:azure", requests=reqs,
                    notes=f"{len(reqs)} requests, scale {scale}, speedup {speedup}")


def load_trace(path: str, **kw) -> Workload:
    """A trace by file type: ``.jsonl`` Mooncake, ``.csv`` Azure."""
    if path.endswith(".jsonl"):
        kw.pop("scale", None), kw.pop("seed", None)
        return load_mooncake(path, **kw)
    if path.endswith(".csv"):
        kw.pop("block_size", None)
        return load_azure(path, **kw)
    raise ValueError(f"unknown trace format {path!r}: expected a Mooncake .jsonl or an Azure .csv")
