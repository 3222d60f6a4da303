"""Helpers for the k8s/ and docker/ tests: rendering, schema validation, dashboard metric names.

``k8s_dashboard_metric_names`` is also meant for the live test that compares the dashboard with a
running server's /metrics (``from k8s_support import k8s_dashboard_metric_names`` from tests/k8s/).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import yaml

from kustomize_lite import render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu-dev", "gpu")
DASHBOARD = K8S / "base" / "dashboards" / "tandem.json"
SERVE_CONFIGMAP = "tandem-serve-config"
SERVE_KEY = "serve.yaml"

# What a live `tandem serve` exports on /metrics: the only families the dashboard may use.
TANDEM_COUNTERS = frozenset({
    "tandem_requests_total",
    "tandem_prompt_tokens_total",
    "tandem_cached_prompt_tokens_total",
    "tandem_kv_transfer_bytes_total",
    "tandem_rejected_requests_total",
})
TANDEM_HISTOGRAMS = frozenset({
    "tandem_time_to_first_token_seconds",
    "tandem_inter_token_latency_seconds",
    "tandem_kv_transfer_seconds",
})


def tandem_series_names() -> set[str]:
    """Every series name the families above put in the Prometheus exposition."""
    return set(TANDEM_COUNTERS) | {h + s for h in TANDEM_HISTOGRAMS for s in ("_bucket", "_sum", "_count")}


# --- dashboard ---------------------------------------------------------------------------------

_METRIC = re.compile(r"(?<![A-Za-z0-9_:])tandem_[A-Za-z0-9_:]*")
_QUERY_KEYS = ("expr", "query", "definition")  # panel targets and template-variable queries


def _query_strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _QUERY_KEYS and isinstance(v, str):
                yield v
            else:
                yield from _query_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _query_strings(v)


def k8s_dashboard_metric_names(path: str | Path = DASHBOARD) -> set[str]:
    """The tandem_* series names (as written, e.g. ``..._seconds_bucket``) in a Grafana dashboard's
    PromQL: panel targets' ``expr`` and template variables' ``query`` / ``definition``."""
    dash = json.loads(Path(path).read_text())
    return {m for s in _query_strings(dash) for m in _METRIC.findall(s)}


# --- rendering ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(K8S / "overlays" / overlay))


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's resources (deep copies: tests may not mutate the cache)."""
    return copy.deepcopy(list(_rendered(overlay)))


def one(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def serve_yaml(resources: list[dict[str, Any]]) -> str:
    return one(resources, "ConfigMap", SERVE_CONFIGMAP)["data"][SERVE_KEY]


def worker_group(raycluster: dict[str, Any], name: str) -> dict[str, Any]:
    hits = [g for g in raycluster["spec"].get("workerGroupSpecs", []) if g["groupName"] == name]
    assert len(hits) == 1, f"expected one worker group {name!r}"
    return hits[0]


def pod_templates(resource: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, PodTemplateSpec) for the kinds we ship."""
    kind = resource["kind"]
    if kind == "RayCluster":
        yield "headGroupSpec", resource["spec"]["headGroupSpec"]["template"]
        for g in resource["spec"].get("workerGroupSpecs", []):
            yield f"workerGroupSpecs[{g['groupName']}]", g["template"]
    elif kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield "template", resource["spec"]["template"]


def containers(resource: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, pod spec, container) for every application container."""
    for where, tpl in pod_templates(resource):
        for c in tpl["spec"]["containers"]:
            yield f"{resource['kind']}/{resource['metadata']['name']} {where} {c['name']}", tpl["spec"], c


# --- quantities --------------------------------------------------------------------------------

_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(q: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "8Gi", 2) as a number (cores or bytes)."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m and m.group(2) in _SUFFIX, f"unsupported quantity {q!r}"
    return float(m.group(1)) * _SUFFIX[m.group(2)]


# --- schemas -----------------------------------------------------------------------------------

def closed(schema: Any) -> Any:
    """Emulate the API server's strict field validation on a CRD schema: an object that lists
    ``properties`` and neither ``additionalProperties`` nor preserve-unknown-fields rejects others."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def load_crd_schema(filename: str) -> dict[str, Any]:
    return closed(yaml.safe_load((K8S / "schemas" / filename).read_text()))


def crd_validator(filename: str):
    import jsonschema

    checker = jsonschema.FormatChecker()

    @checker.checks("int32")
    def _int32(v: Any) -> bool:
        return not isinstance(v, int) or -(2**31) <= v < 2**31

    @checker.checks("int64")
    def _int64(v: Any) -> bool:
        return not isinstance(v, int) or -(2**63) <= v < 2**63

    schema = load_crd_schema(filename)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema, format_checker=checker)


# --- commands ----------------------------------------------------------------------------------

def ray_start_argv(params: dict[str, str]) -> list[str]:
    """The `ray start` flags KubeRay builds from rayStartParams (it writes --key=value into a bash
    command line, so values are shell words: the quoted JSON of `resources` loses one level)."""
    argv: list[str] = []
    for k, v in params.items():
        argv.extend(shlex.split(f"--{k}={v}"))
    return argv


def shell_lines(script: str) -> list[str]:
    return [ln.strip() for ln in script.splitlines() if ln.strip() and not ln.strip().startswith("#")]
