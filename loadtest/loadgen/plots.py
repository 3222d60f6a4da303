"""The report's figures (PNG, matplotlib's Agg backend; nothing needs a display)."""

from __future__ import annotations

import random
from pathlib import Path

from tandem.loadtest.loadgen.report import Record, hit_ratio_by_turn, percentile

FIGSIZE, DPI = (7.0, 4.2), 110


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def ttft_by_turn(records: list[Record], path: Path, title: str) -> Path:
    plt = _plt()
    by_turn: dict[int, list[float]] = {}
    for r in records:
        if r.ok and r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft * 1000)
    fig, ax = plt.subplots(figsize=FIGSIZE)
    turns = sorted(by_turn)
    if turns:
        ax.boxplot([by_turn[t] for t in turns], positions=turns, widths=0.5, showfliers=False)
        jitter = random.Random(0)
        for t in turns:
            ax.scatter([t + jitter.uniform(-0.15, 0.15) for _ in by_turn[t]], by_turn[t], s=12,
                       alpha=0.6, color="tab:blue")
        ax.plot(turns, [percentile(by_turn[t], 50) for t in turns], color="tab:orange", marker="o",
                label="median")
        ax.legend(loc="best")
    ax.set_xlabel("turn index (0 = first request of a session)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"TTFT by turn: {title}")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def ttft_cdf(records: list[Record], path: Path, title: str) -> Path:
    plt = _plt()
    xs = sorted(r.ttft * 1000 for r in records if r.ok and r.ttft is not None)
    fig, ax = plt.subplots(figsize=FIGSIZE)
    if xs:
        n = len(xs)
        ax.step([xs[0]] + xs, [0.0] + [(i + 1) / n for i in range(n)], where="post", label=f"{n} requests")
        for p, style in ((50, ":"), (90, "--"), (99, "-.")):
            v = percentile(xs, p)
            ax.axvline(v, color="gray", linestyle=style, label=f"p{p} = {v:.0f} ms")
        ax.legend(loc="lower right")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def throughput(records: list[Record], path: Path, title: str) -> Path:
    """Output tokens are placed at the arrival of their chunks (start + TTFT + cumulative ITLs); a
    request's completion_tokens are spread evenly over its chunks."""
    plt = _plt()
    ok = [r for r in records if r.ok and r.ttft is not None]
    end = max((r.start + (r.e2e or 0) for r in records), default=0.0)
    bin_s = max(0.5, end / 40) if end > 0 else 1.0
    nbins = int(end / bin_s) + 1
    tokens, done = [0.0] * nbins, [0] * nbins
    for r in ok:
        times = [r.start + (r.ttft or 0.0)]    # ok: every one has its ttft
        for gap in r.itl:
            times.append(times[-1] + gap)
        per_chunk = (r.completion_tokens or len(times)) / len(times)
        for t in times:
            tokens[min(int(t / bin_s), nbins - 1)] += per_chunk
        done[min(int((r.start + (r.e2e or 0)) / bin_s), nbins - 1)] += 1
    xs = [(i + 0.5) * bin_s for i in range(nbins)]
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(xs, [t / bin_s for t in tokens], color="tab:blue", marker=".", label="output tokens/s")
    ax.set_xlabel(f"time since start (s), {bin_s:.1f} s bins")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [d / bin_s for d in done], color="tab:green", marker=".", linestyle="--",
             label="completed requests/s")
    ax2.set_ylabel("completed requests/s", color="tab:green")
    ax.set_title(f"Throughput over time: {title}")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def hit_ratio(records: list[Record], workers: dict[str, dict], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    if workers:
        names = list(workers)
        bars = ax.bar(range(len(names)), [workers[w]["hit_ratio"] for w in names], color="tab:purple")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_xlabel("worker")
        ax.set_title(f"Prefix-cache hit ratio per worker (/metrics): {title}")
    else:
        per_turn = hit_ratio_by_turn(records)
        turns = list(per_turn)
        bars = ax.bar(turns, [per_turn[t] for t in turns], color="tab:purple")
        ax.set_xticks(turns)
        ax.set_xlabel("turn index")
        ax.set_title(f"No per-worker cache metrics in /metrics: cluster-wide hit ratio per turn\n"
                     f"(cached / prompt tokens from usage): {title}", fontsize=10)
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def write_all(records: list[Record], workers: dict[str, dict], out: Path, title: str) -> list[Path]:
    """All four figures into ``out``; returns their paths."""
    return [ttft_by_turn(records, out / "ttft_by_turn.png", title),
            ttft_cdf(records, out / "ttft_cdf.png", title),
            throughput(records, out / "throughput.png", title),
            hit_ratio(records, workers, out / "hit_ratio.png", title)]
