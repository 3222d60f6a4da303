"""A multi-turn agent run through the Responses API with ``previous_response_id`` vs the same run
resending its history through chat completions: request bytes, TTFT and cached tokens per turn.

One ``tandem serve --mode disaggregated --prefill 1 --decode 1`` (SmolLM2 on the CPU) is started
on 127.0.0.1 by this script (bench/agent_cache.py's Server) and serves both modes. An agent run
is ``--turns`` requests: each but the last forces one call of the ``lookup`` tool
(``tool_choice`` required, ``parallel_tool_calls`` false, streamed, temperature 0), the client
answers it with a synthetic tool result of about ``--result-words`` words, and the last turn
lets the model answer in text. The two modes send the same conversation:

- ``chat``: ``POST /v1/chat/completions`` with the whole history each turn (system, user, every
  assistant ``tool_calls`` message and ``tool`` message so far) and the tools;
- ``responses``: ``POST /v1/responses`` with only the new item (the first turn: the user message;
  then the ``function_call_output``), ``previous_response_id``, ``instructions`` and the tools
  (neither is carried over by OpenAI's semantics, so a client sends them every turn).

``--sessions`` runs of each mode alternate, each with its own system prompt (no run shares a
cached prefix with another beyond the chat template's first tokens). TTFT is the time from
sending the request to its first SSE event: Tandem sends the first event only once the first
token exists (the front door awaits it, so a refusal can still be a 4xx), in both APIs.
Reported per turn: median request bytes, TTFT, prompt tokens and cached tokens of each mode, and
their ratios; JSON to ``--out`` (default bench/out/responses_vs_chat.json).

    .venv/bin/python -m tandem.bench.responses_vs_chat [--sessions 3] [--turns 6]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.bench.agent_cache import Server
from tandem.bench.common import bench_parser, write_report

M = "smollm2"
PARAMS = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24}}, "required": ["query"],
          "additionalProperties": False}
FN = {"name": "lookup", "description": "Look a fact up in the knowledge base.", "parameters": PARAMS}
WORDS = ("river delta harbour granite meadow lantern orbit copper willow ember signal canyon "
         "glacier compass falcon quarry tundra beacon cedar marble").split()


def _result(session: int, turn: int, words: int) -> str:
    """The synthetic tool result of one turn (deterministic)."""
    return f"Result {session}.{turn}: " + " ".join(WORDS[(session * 7 + turn * 3 + i) % len(WORDS)]
                                                    for i in range(words))


def _sse(resp: httpx.Response, t0: float):
    """(time of the first event, parsed data payloads) of an SSE response."""
    first, events = None, []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            first = first if first is not None else time.perf_counter() - t0
            data = line[6:]
            if data != "[DONE]":
                events.append(json.loads(data))
    return first, events


def _chat_turn(http: httpx.Client, url: str, messages: list, last: bool, max_tokens: int) -> dict:
    body = {"model": M, "messages": messages, "tools": [{"type": "function", "function": FN}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            **({} if last else {"tool_choice": "required", "parallel_tool_calls": False})}
    raw = json.dumps(body).encode()
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/chat/completions", content=raw,
                     headers={"Content-Type": "application/json"}) as r:
        r.raise_for_status()
        ttft, events = _sse(r, t0)
    calls = [d for e in events for c in e.get("choices", []) for d in (c.get("delta", {}).get("tool_calls") or [])]
    usage = next(e["usage"] for e in events if e.get("usage"))
    return {"bytes": len(raw), "ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "calls": calls}


def _responses_turn(http: httpx.Client, url: str, instructions: str, items: list, prev: str | None, last: bool,
                    max_tokens: int) -> dict:
    body = {"model": M, "input": items, "instructions": instructions, "tools": [{"type": "function", **FN}],
            "temperature": 0, "max_output_tokens": max_tokens, "stream": True,
            **({"previous_response_id": prev} if prev else {}),
            **({} if last else {"tool_choice": "required", "parallel_tool_calls": False})}
    raw = json.dumps(body).encode()
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/responses", content=raw, headers={"Content-Type": "application/json"}) as r:
        r.raise_for_status()
        ttft, events = _sse(r, t0)
    final = events[-1]["response"]
    u = final["usage"]
    return {"bytes": len(raw), "ttft_s": ttft, "prompt_tokens": u["input_tokens"],
            "cached_tokens": u["input_tokens_details"]["cached_tokens"], "id": final["id"],
            "calls": [o for o in final["output"] if o["type"] == "function_call"]}


def run_chat(http, url: str, session: int, args) -> list[dict]:
    system, user = _opening("chat", session)
    messages: list = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    rows = []
    for turn in range(args.turns):
        last = turn == args.turns - 1
        row = _chat_turn(http, url, messages, last, args.max_tokens)
        rows.append({k: v for k, v in row.items() if k != "calls"})
        if last:
            break
        [c] = row["calls"]
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": c["id"], "type": "function", "function": c["function"]}]},
                     {"role": "tool", "tool_call_id": c["id"], "content": _result(session, turn, args.result_words)}]
    return rows


def run_responses(http, url: str, session: int, args) -> list[dict]:
    system, user = _opening("responses", session)
    items: list = [{"role": "user", "content": user}]
    prev, rows = None, []
    for turn in range(args.turns):
        last = turn == args.turns - 1
        row = _responses_turn(http, url, system, items, prev, last, args.max_tokens)
        rows.append({k: v for k, v in row.items() if k not in ("calls", "id")})
        if last:
            break
        [c] = row["calls"]
        prev = row["id"]
        items = [{"type": "function_call_output", "call_id": c["call_id"],
                  "output": _result(session, turn, args.result_words)}]
    return rows


def _opening(mode: str, session: int) -> tuple[str, str]:
    system = (f"You are research agent {mode}-{session}. Use the lookup tool to gather facts, one call at a "
              f"time, then answer briefly.")
    return system, f"Find three facts about the city number {session} and summarize them."


def _per_turn(runs: list[list[dict]]) -> list[dict]:
    out = []
    for t in range(min(len(r) for r in runs)):
        rows = [r[t] for r in runs]
        out.append({k: statistics.median(x[k] for x in rows) for k in rows[0]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "responses_vs_chat")
    p.add_argument("--sessions", type=int, default=3, help="agent runs of each mode")
    p.add_argument("--turns", type=int, default=6, help="requests per agent run")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--result-words", type=int, default=60, help="words of each synthetic tool result")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    flags = ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]
    try:
        load = tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        load = None
    runs: dict[str, list] = {"chat": [], "responses": []}
    logdir = Path(tempfile.mkdtemp(prefix="responses_vs_chat-"))
    with Server(flags, args, logdir / "serve.log") as srv, httpx.Client(timeout=600) as http:
        print(f"healthy after {srv.startup_s:.1f} s on {srv.url}; load average {load}", file=sys.stderr)
        http.post(srv.url + "/v1/chat/completions", json={"model": M, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Say hello."}]}).raise_for_status()      # warm-up, dropped
        for s in range(args.sessions):
            for mode, fn in (("chat", run_chat), ("responses", run_responses)):
                runs[mode].append(fn(http, srv.url, s, args))
                print(f"[{mode} {s}] {[round(r['ttft_s'] * 1000) for r in runs[mode][-1]]} ms TTFT per turn",
                      file=sys.stderr)
    turns = {mode: _per_turn(r) for mode, r in runs.items()}
    table = []
    for t, (c, r) in enumerate(zip(turns["chat"], turns["responses"])):
        table.append({"turn": t + 1, "chat_bytes": c["bytes"], "responses_bytes": r["bytes"],
                      "bytes_ratio": r["bytes"] / c["bytes"], "chat_ttft_s": c["ttft_s"],
                      "responses_ttft_s": r["ttft_s"], "ttft_ratio": r["ttft_s"] / c["ttft_s"],
                      "chat_prompt": c["prompt_tokens"], "responses_prompt": r["prompt_tokens"],
                      "chat_cached": c["cached_tokens"], "responses_cached": r["cached_tokens"]})
    print("turn | bytes chat -> responses (ratio) | TTFT ms chat -> responses (ratio) | prompt | cached chat / responses")
    for row in table:
        print(f"{row['turn']:>4} | {row['chat_bytes']:>6} -> {row['responses_bytes']:>5} ({row['bytes_ratio']:.2f}) | "
              f"{row['chat_ttft_s'] * 1000:>5.0f} -> {row['responses_ttft_s'] * 1000:>5.0f} ({row['ttft_ratio']:.2f}) | "
              f"{row['chat_prompt']:>5.0f} | {row['chat_cached']:>5.0f} / {row['responses_cached']:.0f}")
    total = {m: sum(r["bytes"] for r in turns[m]) for m in turns}
    print(f"request bytes over the run: chat {total['chat']}, responses {total['responses']} "
          f"({total['responses'] / total['chat']:.2f}x)")
    write_report(args.out, {"args": vars(args), "load_average": load, "per_turn": table, "total_bytes": total,
                            "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
