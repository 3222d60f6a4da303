"""Cluster-wide /metrics: the workers' expositions (each sample labelled ``worker``) and the
driver's, merged into one valid exposition (one HELP/TYPE per family; a family whose type
differs keeps the first source's).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


class _Families:
    """A collector that yields already-built metric families."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_expositions(workers: Mapping[str, bytes], driver: bytes = b"") -> bytes:
    """One exposition: ``driver``'s samples as they are, each worker's with ``worker=<name>``."""
    merged: dict[str, Metric] = {}
    seen: set[tuple[Any, ...]] = set()

    def add(text: bytes, worker: str | None) -> None:
        for fam in text_string_to_metric_families(text.decode("utf-8", errors="replace")):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif out.type != fam.type:
                log.warning("metric %s is a %s from one source and a %s from %s; dropped there",
                            fam.name, out.type, fam.type, worker or "the driver")
                continue
            for s in fam.samples:
                labels = dict(s.labels)
                if worker is not None:
                    labels["worker"] = worker
                key = (s.name, tuple(sorted(labels.items())))
                if key in seen:
                    continue
                seen.add(key)
                out.samples.append(s._replace(labels=labels))

    add(driver, None)
    for name, text in workers.items():
        add(text, name)
    reg = CollectorRegistry()
    reg.register(_Families(list(merged.values())))
    return generate_latest(reg)
