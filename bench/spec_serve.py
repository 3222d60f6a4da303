"""Speculative decoding from outside: ``tandem serve`` with n-gram drafts on vs off, colocated and
1 prefill + 1 decode (drafting on the decode worker), on the copying agent workload (issue 51).

Workload: ``--sessions`` streamed chat requests at once, each one of bench/spec.py's copying
prompts (a JSON document returned with one field changed, a function rewritten with one rename, a
tool result quoted back), greedy, ``--max-tokens`` each. Per (mode, speculation) the server starts
fresh (``--speculative-algorithm ngram|off``, ``--threads``), one short request warms it up, then
the workload runs ``--repeats`` times; on and off alternate within each mode. Reported: output
tokens/s (completion tokens / wall time of a round, median), TTFT p50 over every request, and the
on/off ratios; the greedy texts must be the same on and off (checked).

    python -m tandem.bench.spec_serve                    # colocated and 1P+1D, 2 threads
    python -m tandem.bench.spec_serve --modes colocated --repeats 3
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from tandem.bench.agent_cache import Server
from tandem.bench.common import bench_parser, write_report
from tandem.bench.spec import COPYING

MODES = {"colocated": ["--mode", "colocated"],
         "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]}


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request: its text, completion tokens and time to first token."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    async for c in stream:
        if c.choices and c.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(c.choices[0].delta.content)
        if c.usage is not None:
            usage = c.usage
    return {"text": "".join(parts), "tokens": usage.completion_tokens if usage else 0, "ttft_s": ttft}


async def rounds(url: str, sessions: int, max_tokens: int, repeats: int) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    await one(client, model, "Say hi.", 4)                                   # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client, model, COPYING[i % len(COPYING)], max_tokens)
                                     for i in range(sessions)))
        wall = time.perf_counter() - t0
        out.append({"wall_s": wall, "tok_s": sum(r["tokens"] for r in res) / wall,
                    "ttfts": [r["ttft_s"] for r in res], "texts": [r["text"] for r in res]})
    await client.close()
    return out


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "spec_serve", repeats=2, threads=2)
    ap.add_argument("--modes", default="colocated,disaggregated", help="which, comma-separated")
    ap.add_argument("--sessions", type=int, default=4, help="requests at once")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="spec_serve_"))
    rows = []
    for mode in args.modes.split(","):
        got = {}
        for spec in ("off", "ngram"):
            flags = [*MODES[mode], "--threads", str(args.threads), "--speculative-algorithm", spec]
            with Server(flags, args, logs / f"{mode}-{spec}.log") as srv:
                got[spec] = asyncio.run(rounds(srv.url, args.sessions, args.max_tokens, args.repeats))
            print(f"  {mode} speculation {spec}: " + ", ".join(f"{r['tok_s']:.1f}" for r in got[spec])
                  + " tok/s", flush=True)
        if [r["texts"] for r in got["off"]] != [r["texts"] for r in got["ngram"]]:
            raise AssertionError(f"{mode}: greedy texts differ with speculation")
        off = statistics.median(r["tok_s"] for r in got["off"])
        on = statistics.median(r["tok_s"] for r in got["ngram"])
        ttft = {s: statistics.median(t for r in got[s] for t in r["ttfts"] if t is not None) for s in got}
        rows.append({"mode": mode, "off_tok_s": off, "on_tok_s": on, "ratio": on / off,
                     "ttft_p50_off_s": ttft["off"], "ttft_p50_on_s": ttft["ngram"],
                     "runs": {s: [{k: v for k, v in r.items() if k != "texts"} for r in got[s]] for s in got}})
    print(f"\n{'mode':<14} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'TTFT p50 off/on':>16}")
    for r in rows:
        print(f"{r['mode']:<14} {r['off_tok_s']:>10.1f} {r['on_tok_s']:>9.1f} {r['ratio']:>6.2f}x "
              f"{r['ttft_p50_off_s']:>7.2f}/{r['ttft_p50_on_s']:.2f} s")
    write_report(args.out, {"threads": args.threads, "sessions": args.sessions, "max_tokens": args.max_tokens,
                            "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
