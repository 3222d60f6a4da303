"""Speculative decoding from outside: ``tandem serve`` with n-gram drafts on vs off, colocated and
1 prefill + 1 decode (drafting on the decode worker), on the copying agent workload (issue 51);
with ``--llama-server``, llama.cpp's ``llama-server`` on the same GGUF beside it, drafts off and
each of its own n-gram speculation types.

Workload: ``--sessions`` streamed chat requests at once, each one of bench/spec.py's copying
prompts (a JSON document returned with one field changed, a function rewritten with one rename, a
tool result quoted back), greedy, exactly ``--max-tokens`` each (``ignore_eos`` and
``min_tokens``, both servers take them; ``--natural-length`` lets them stop at EOS). A round is
one fresh server (empty prefix cache and n-gram pool: no round sees an earlier round's outputs),
one short request to warm it up, then the workload once; ``--repeats`` rounds of every
configuration, the configurations alternated within each repeat. Reported per configuration:
output tokens/s (completion tokens / wall time of a round, median over rounds), TTFT p50 over
every request, ITL p50 (each request's mean time per token after its first), acceptance
(accepted / drafted tokens: Tandem's /metrics counters, llama-server's per-request ``timings``),
Tandem's on/off ratio, and every row's ratio to llama-server's best n-gram row. Tandem's greedy
texts must be the same on and off (checked); how many of each other row's texts equal
llama-server's without drafts is printed (llama.cpp runs the Q4_1 weights as they are and verifies
drafts in batches of another shape; Tandem runs them dequantized: greedy texts may part).

llama-server: built as bench/serve_vs_llamaserver.py's docstring says, started by its
``LlamaServer`` (``-t/-tb --threads -np 4 --cache-reuse 256``) plus ``--spec-type TYPE``. Its n-gram
types are read from its ``--help`` unless ``--llama-specs`` names them (``;``-separated, each a
type and any flags of its own, e.g. ``ngram-simple --spec-ngram-simple-size-n 4``; ``off``: none;
a later ``-t``/``-tb`` overrides ``--threads``).

    python -m tandem.bench.spec_serve                    # colocated and 1P+1D, 2 threads
    python -m tandem.bench.spec_serve --modes colocated --repeats 3
    python -m tandem.bench.spec_serve --repeats 3 --llama-server /work/llama-build/.../llama-server
"""

from __future__ import annotations

import asyncio
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.agent_cache import Server
from tandem.bench.common import bench_parser, write_report
from tandem.bench.spec import COPYING

MODES = {"colocated": ["--mode", "colocated"],
         "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]}


async def one(client, model: str, prompt: str, max_tokens: int, exact: bool) -> dict:
    """One streamed greedy chat request: its text, completion tokens, time to first token, mean time
    per token after the first (``itl_s``), and the draft tokens llama-server says it verified and
    accepted (its final chunk's ``timings``)."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    timings: dict[str, Any] = {}
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": max_tokens} if exact else None)
    async for c in stream:
        if c.choices and c.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(c.choices[0].delta.content)
        if c.usage is not None:
            usage = c.usage
        timings = (c.model_extra or {}).get("timings") or timings
    tokens = usage.completion_tokens if usage else 0
    itl = (time.perf_counter() - t0 - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"text": "".join(parts), "tokens": tokens, "ttft_s": ttft, "itl_s": itl,
            "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}


async def one_round(url: str, sessions: int, max_tokens: int, exact: bool) -> dict:
    """Warm the server up with one short request, then run the workload once."""
    import openai

    # no keep-alive: twice a measured request to llama-server failed to connect right after the
    # warm-up on a kept connection; with a new connection per request it did not happen again
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600,
                                default_headers={"Connection": "close"})
    model = (await client.models.list()).data[0].id
    await one(client, model, "Say hi.", 4, False)
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(client, model, COPYING[i % len(COPYING)], max_tokens, exact)
                                 for i in range(sessions)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"wall_s": wall, "tokens": [r["tokens"] for r in res], "tok_s": sum(r["tokens"] for r in res) / wall,
            "ttfts": [r["ttft_s"] for r in res], "itls": [r["itl_s"] for r in res],
            "texts": [r["text"] for r in res],
            "drafted": sum(r["drafted"] for r in res), "accepted": sum(r["accepted"] for r in res)}


def tandem_counters(url: str) -> dict:
    """Drafted and accepted tokens and model steps, summed over the workers, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for key, series in (("drafted", "tandem_spec_drafted_tokens_total"),
                        ("accepted", "tandem_spec_accepted_tokens_total"), ("steps", "tandem_worker_steps_total")):
        out[key] = sum(float(m) for m in re.findall(rf"^{series}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


def ngram_types(binary: str) -> list[str]:
    """The n-gram types llama-server's ``--spec-type`` takes, as its ``--help`` lists them."""
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"--spec-type\s+(\S+)", help_text)
    return [t for t in m.group(1).strip("[]").replace("|", ",").split(",") if t.startswith("ngram")] if m else []


def configs(args) -> dict:
    """Configuration name -> a function of the log path that gives its (not yet started) server."""
    out = {}
    for mode in filter(None, args.modes.split(",")):
        for spec in ("off", "ngram"):
            flags = [*MODES[mode], "--threads", str(args.threads), "--speculative-algorithm", spec]
            out[f"tandem {mode} {spec}"] = lambda log, flags=flags: Server(flags, args, log)
    if args.llama_server:
        from tandem.bench.serve_vs_llamaserver import LlamaServer
        from tandem.engine.loader import smollm2_path

        specs = args.llama_specs.split(";") if args.llama_specs else ["off", *ngram_types(args.llama_server)]
        for spec in specs:
            def make(log, spec=spec.split()):
                srv = LlamaServer(args.llama_server, smollm2_path(), args, log)
                srv.cmd += spec[1:] if spec[0] == "off" else ["--spec-type", *spec]
                return srv
            out[f"llama-server {' '.join(spec.split())}"] = make
    return out


def summarize(name: str, rounds: list[dict]) -> dict:
    drafted, accepted = sum(r["drafted"] for r in rounds), sum(r["accepted"] for r in rounds)
    row = {"config": name, "tok_s": statistics.median(r["tok_s"] for r in rounds),
           "ttft_p50_s": statistics.median(t for r in rounds for t in r["ttfts"] if t is not None),
           "itl_p50_s": statistics.median(t for r in rounds for t in r["itls"] if t is not None),
           "acceptance": accepted / drafted if drafted else None,
           "runs": [{k: v for k, v in r.items() if k != "texts"} for r in rounds]}
    if "steps" in rounds[0]:
        row["tokens_per_step"] = statistics.median(sum(r["tokens"]) / r["steps"] for r in rounds if r["steps"])
    return row


def same_texts(a: list[dict], b: list[dict]) -> str:
    """How many requests' texts two configurations share, over their rounds: 'equal/all'."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra["texts"], rb["texts"])]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def compare(got: dict[str, list[dict]], modes: list[str]) -> list[dict]:
    """Each configuration's row from its rounds, with Tandem's on/off ratio (its texts checked the
    same on and off), each row's ratio to llama-server's best n-gram row, and how many texts equal
    llama-server's without drafts."""
    rows = [summarize(name, rounds) for name, rounds in got.items()]
    by = {r["config"]: r for r in rows}
    for mode in modes:
        off, on = got[f"tandem {mode} off"], got[f"tandem {mode} ngram"]
        if [r["texts"] for r in off] != [r["texts"] for r in on]:
            raise AssertionError(f"{mode}: greedy texts differ with speculation")
        by[f"tandem {mode} ngram"]["on_off"] = by[f"tandem {mode} ngram"]["tok_s"] / by[f"tandem {mode} off"]["tok_s"]
    ngram = [r for r in rows if r["config"].startswith("llama-server") and r["config"] != "llama-server off"]
    best = max(ngram, key=lambda r: r["tok_s"], default=None)
    for r in rows:
        if best is not None:
            r["vs_best_llama_ngram"] = {"tok_s": r["tok_s"] / best["tok_s"],
                                        "ttft_p50": r["ttft_p50_s"] / best["ttft_p50_s"]}
        if "llama-server off" in got and r["config"] != "llama-server off":
            r["texts_equal_to_llama_off"] = same_texts(got[r["config"]], got["llama-server off"])
    if best is not None:
        best["best_llama_ngram"] = True
    return rows


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "spec_serve", repeats=2, threads=2)
    ap.add_argument("--modes", default="colocated,disaggregated", help="Tandem's, comma-separated ('': none)")
    ap.add_argument("--sessions", type=int, default=4, help="requests at once")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--natural-length", action="store_true",
                    help="let requests stop at EOS (default: exactly --max-tokens each)")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--llama-server", default="", help="the llama-server binary (none: its rows are skipped)")
    ap.add_argument("--llama-specs", default="",
                    help="llama-server's rows, ';'-separated: 'off' or a --spec-type value and its flags "
                         "(default: off and every ngram-* type its --help lists)")
    ap.add_argument("--ctx-per-slot", type=int, default=4096, help="llama-server's context per slot")
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="spec_serve_"))
    makers = configs(args)
    got: dict[str, list[dict]] = {name: [] for name in makers}
    for rep in range(args.repeats):
        for name, make in makers.items():
            with make(logs / f"{name.replace(' ', '_')}-{rep}.log") as srv:
                r = asyncio.run(one_round(srv.url, args.sessions, args.max_tokens, not args.natural_length))
                if name.startswith("tandem"):
                    r |= tandem_counters(srv.url)
            got[name].append(r)
            print(f"  round {rep}: {name}: {r['tok_s']:.1f} tok/s, tokens {r['tokens']}, "
                  f"TTFT {statistics.median(t for t in r['ttfts'] if t is not None):.2f} s, "
                  f"accepted {r['accepted']:.0f}/{r['drafted']:.0f}", flush=True)

    rows = compare(got, list(filter(None, args.modes.split(","))))
    best = next((r["config"] for r in rows if r.get("best_llama_ngram")), None)
    vs = f"vs {best}" if best else ""
    w = max(len(r["config"]) for r in rows)
    print(f"\n{'config':<{w}} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} {'accept':>7} {'on/off':>7} {vs}")
    for r in rows:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        ratio = f"{r['on_off']:.2f}x" if "on_off" in r else ""
        cmp = (f"{r['vs_best_llama_ngram']['tok_s']:.2f}x tok/s, TTFT {r['vs_best_llama_ngram']['ttft_p50']:.2f}x"
               if best else "")
        print(f"{r['config']:<{w}} {r['tok_s']:>7.1f} {r['ttft_p50_s']:>8.2f}s {1e3 * r['itl_p50_s']:>6.1f}ms "
              f"{acc:>7} {ratio:>7} {cmp}")
    if "llama-server off" in got:
        print("texts equal to llama-server off's: " + ", ".join(
            f"{r['config']} {r['texts_equal_to_llama_off']}" for r in rows if "texts_equal_to_llama_off" in r))
    write_report(args.out, {"threads": args.threads, "sessions": args.sessions, "max_tokens": args.max_tokens,
                            "exact_length": not args.natural_length, "llama_server": args.llama_server,
                            "logs": str(logs), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
