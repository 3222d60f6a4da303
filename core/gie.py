"""The Gateway API Inference Extension's model-server gauges under vLLM's names, each labelled
``model_name``, ``worker`` and ``role``; read from a callable at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
         "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")


@dataclass(frozen=True)
class GIESample:
    waiting: int
    running: int
    kv_used_tokens: int
    kv_total_tokens: int
    block_size: int
    host_blocks: int = 0
    prefix_caching: bool = True

    @property
    def usage(self) -> float:
        return min(self.kv_used_tokens / self.kv_total_tokens, 1.0) if self.kv_total_tokens else 0.0


class GIECollector(Collector):
    """The five families above for one worker; ``read()`` is called at every scrape."""

    def __init__(self, read: Callable[[], GIESample], model: str, worker: str, role: str) -> None:
        self.read, self.labels = read, {"model_name": model, "worker": worker, "role": role}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.read()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, v: float, extra: dict[str, str] | None = None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names + list(extra or {}))
            g.add_metric(values + list((extra or {}).values()), float(v))
            return g

        yield gauge(NAMES[0], "Number of requests waiting to be processed.", s.waiting)
        yield gauge(NAMES[1], "Number of requests currently running.", s.running)
        yield gauge(NAMES[2], "KV-cache usage. 1 means 100 percent usage.", s.usage)
        yield gauge(NAMES[3], "KV-cache usage (older name). 1 means 100 percent usage.", s.usage)
        yield gauge(NAMES[4], "Information of the KV cache configuration.", 1, {
            "block_size": str(s.block_size), "num_gpu_blocks": str(s.kv_total_tokens // max(s.block_size, 1)),
            "num_cpu_blocks": str(s.host_blocks), "enable_prefix_caching": str(s.prefix_caching)})
