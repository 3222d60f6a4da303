"""Command-line flags generated from the config fields (a default lives only in its pydantic field).

A flag not given is None and keeps the base's value; a field with no flag is in :data:`YAML_ONLY`.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tandem.core.config import EngineConfig, ServeConfig

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Flag:
    """``--name`` sets the field at ``path`` (dotted, relative to the model the flags are for).
    ``help`` without "default" gets " (default X)" from the field, unless the default is None."""

    name: str
    path: str
    help: str | None = None


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model", "'smollm2' (the embedded SmolLM2-135M-Instruct GGUF, default), a .gguf file, "
                             "or a Hugging Face directory (config.json, *.safetensors, tokenizer.json)"),
    Flag("--page-size", "cache.page_size", "tokens per KV page"),
    Flag("--max-total-tokens", "cache.max_total_tokens", "device KV slots (tokens) per worker"),
    Flag("--max-running-requests", "cache.max_running_requests", "concurrent requests per worker"),
    Flag("--chunked-prefill-size", "scheduler.chunked_prefill_size", "prompt tokens computed per step"),
    Flag("--context-length", "context_length", "override the model's context length"),
    Flag("--sliding-window", "sliding_window",
         "override: make every attention layer sliding-window with this window"),
    Flag("--disable-prefix-cache", "cache.disable_prefix_cache",
         "every prefix match is a miss (to measure what caching buys)"),
    Flag("--eviction-policy", "cache.eviction_policy", "radix cache eviction policy"),
    Flag("--schedule-policy", "scheduler.schedule_policy",
         "waiting-queue order: arrival (fcfs) or longest cached prefix (lpm)"),
    Flag("--retraction-policy", "scheduler.retraction_policy",
         "which request a full decode pool retracts first: fewest generated tokens "
         "(default) or the least recently active session's (session)"),
    Flag("--host-pool-tokens", "cache.host_pool_tokens",
         "host-memory (L2) KV tokens per worker; 0 disables the host tier (default: decode workers "
         "4x their device pool, capped at a quarter of free host memory; prefill/colocated none)"),
    Flag("--pin-share", "cache.pin_share",
         "prompt caching: the share of a worker's device pool one tenant's pinned prefixes may hold "
         "(cache_control / prompt_cache_retention; past it a request is served unpinned; an API key's "
         "pin_tokens overrides it)"),
    Flag("--pin-max-ttl", "cache.pin_max_ttl_s",
         "prompt caching: the longest a pin lasts, in seconds (a 1h or 24h request is capped to it; "
         "a short value ends pins early, e.g. to see a pinned prefix become evictable)"),
    Flag("--debug-retract-every", "scheduler.debug_retract_every",
         "test lever: retract a decoding request every N decode steps, pressure or not (0 = off)"),
    Flag("--device", "device"),
    Flag("--dtype", "dtype", "compute, weight and KV dtype; auto: bfloat16 on CUDA and on CPUs with native "
                             "bf16 (AVX512-BF16/AMX), else float32 (exact)"),
    Flag("--weights", "weights", "a GGUF's quantized projections: native (keep the file's Q4_0/Q4_1/Q8_0 "
                                 "blocks: Tandem's AVX512 kernels, gcc-built on first use, else torch's "
                                 "int4 kernel; CPU + bfloat16), int4 (torch's int4 kernel), dequant "
                                 "(expand to --dtype); auto: native where it can run"),
    Flag("--attention-backend", "attention_backend",
         "paged attention: cpu_kernel (one C call per layer; AVX512 CPUs), torch, triton (GPU); "
         "auto: triton on CUDA, cpu_kernel where it builds, else torch"),
    Flag("--threads", "num_threads", "torch CPU threads (default: all cores in one process; a worker "
                                     "actor: the CPUs Ray assigned it, cores / workers on a CPU node)"),
    Flag("--debug-cache-invariants", "cache.debug_invariants",
         "run the cache's invariant check() after every operation (slow)"),
    Flag("--disable-cuda-graph", "disable_cuda_graph",
         "decode launches every kernel eagerly instead of replaying CUDA graphs (CUDA only)"),
    Flag("--cuda-graph-max-bs", "cuda_graph_max_bs",
         "largest decode batch captured in a CUDA graph (default: --max-running-requests)"),
    Flag("--overlap-schedule", "overlap_schedule",
         "plan step N+1 while the device runs step N: on, off, or auto (on for CUDA devices)"),
    Flag("--disable-overlap-schedule", "disable_overlap_schedule",
         "turn overlap scheduling off (the host waits for each step's tokens before the next)"),
    Flag("--speculative-algorithm", "speculative_algorithm",
         "speculative decoding: ngram (drafts from the request's text and its tenant's pool, "
         "verified in one step; the same tokens) or off"),
    Flag("--speculative-num-draft-tokens", "speculative_num_draft_tokens",
         "the most draft tokens a request verifies per step (1..32)"),
)

SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("--mode", "mode", "separate prefill and decode workers (disaggregated) or one worker doing "
                           "both (colocated); default disaggregated, but a bare `tandem serve` (no "
                           "--config/--prefill/--decode) on 4 CPU cores or fewer and no GPU: colocated"),
    Flag("--engine", "engine", "the real model (real) or the simulated cost-model engine (sim)"),
    Flag("--prefill", "prefill", "prefill workers"),
    Flag("--decode", "decode", "decode workers"),
    Flag("--prefill-num-gpus", "prefill_num_gpus",
         "GPUs per prefill worker (0.5: two workers share one GPU; default: one each when the "
         "cluster has a GPU per worker, else none)"),
    Flag("--decode-num-gpus", "decode_num_gpus", "GPUs per decode worker (as --prefill-num-gpus)"),
    Flag("--host", "host", "HTTP bind address"),
    Flag("--port", "port", "HTTP port"),
    Flag("--api-key", "api_key", "one admin key: require 'Authorization: Bearer KEY' on /v1/*, /admin/*, /debug/*"),
    Flag("--api-keys", "api_keys", "YAML key file of tenants and roles (key or key_sha256, tenant, "
                                   "role: user|admin, rate_limit); read at start and again on SIGHUP"),
    Flag("--otlp-endpoint", "otlp_endpoint", "trace requests (OpenTelemetry) to this OTLP/HTTP URL, e.g. "
                                             "http://127.0.0.1:4318 (default: OTEL_EXPORTER_OTLP_* or off)"),
    Flag("--ray-address", "ray_address", "join this Ray cluster instead of starting one"),
    Flag("--ray-namespace", "ray_namespace", "Ray namespace of the workers' named actors"),
    Flag("--worker-lifetime", "worker_lifetime",
         "cluster: workers outlive the router and a restarted router adopts them; router: stopped "
         "with it; auto: cluster when joining a Ray cluster with --ray-address"),
    Flag("--tool-parser", "tool_parser", "tool-call format the model writes (default auto: from its chat "
                                         "template; Hermes <tool_call> when the template has no tool support)"),
    Flag("--policy", "policy", "routing policy"),
    Flag("--transfer-timeout", "transfer_timeout_s",
         "seconds before a KV transfer fails and its pages are freed"),
    Flag("--progress-timeout", "progress_timeout_s",
         "seconds without a heartbeat (or 3x that in one engine step) before a worker is suspect: no new requests, "
         "its requests re-dispatched or resumed on a peer, else failed with an error event"),
    Flag("--progress-replace-after", "progress_replace_s",
         "seconds a suspect worker may stay stuck before it is killed and replaced"),
    Flag("--max-failovers", "max_failovers",
         "times a request resumes on another decode worker when its own dies mid-stream, from the tokens "
         "its client has (0: the request ends with an error event, as before)"),
    Flag("--failover-wait-s", "failover_wait_s",
         "seconds such a request waits for a live decode worker (the supervisor's replacement of the "
         "only one) before it ends with an error event that names the wait"),
    Flag("--router-lease", "router_lease_s",
         "seconds without this router's heartbeat before a decode worker aborts the streams it runs for it"),
    Flag("--debug-transfer-delay", "debug_transfer_delay_ms",
         "test lever: prefill workers wait this many milliseconds before posting each KV write"),
    Flag("--debug-transfer-stall", "debug_transfer_stall",
         "test lever: prefill workers never post their KV writes (transfers stall until aborted)"),
    Flag("--local-prefill-threshold", "local_prefill_threshold",
         "decode prefills an uncached suffix shorter than this itself (0: never; unset: the measured cost rule)"),
    Flag("--reply-push", "reply_push",
         "decode workers push a finished request's KV to its prefill worker for the session's next turn"),
    Flag("--debug-push-fault", "debug_push_fault",
         "test lever: fail: decode workers answer every reply push FAILED without writing"),
    Flag("--kv-digest", "kv_digest", "verify every prefill -> decode KV handoff with a digest of its pages"),
    Flag("--debug-corrupt-kv", "debug_corrupt_kv",
         "test lever: decode workers corrupt each received KV page before the digest check"),
    Flag("--kv-store", "kv_store", "shared L3 KV tier: off, mooncake (start a master with the cluster) or "
                                   "mooncake://HOST:PORT[/METAPORT] (join one)"),
    Flag("--l3-store-bytes", "l3_store_bytes",
         "--kv-store mooncake: bytes the storage process beside the master lends to the store"),
    Flag("--l3-worker-segment-bytes", "l3_worker_segment_bytes",
         "bytes each worker lends to the L3 store (0: none, the cluster's storage keeps the pages)"),
    Flag("--debug-corrupt-l3", "debug_corrupt_l3",
         "test lever: workers corrupt each page they write to the L3 store (reads become misses)"),
    Flag("--debug-endpoints", "debug_endpoints",
         "test lever: enable POST /debug/kill?worker=NAME (chaos runs); never in production"),
    Flag("--decode-max-total-tokens", "decode_max_total_tokens",
         "device KV tokens per decode worker (default: --max-total-tokens; "
         "--engine sim: the profile's KV room)"),
    Flag("--sim-profile", "sim_profile", "--engine sim: cost profile, e.g. llama3-8b-h100, llama3-70b-h100x8"),
    Flag("--sim-speedup", "sim_speedup", "--engine sim: simulated seconds per wall second"),
    Flag("--dispatch-queue-size", "dispatch_queue_size",
         "requests that may wait for an admissible worker before 429s (0: refuse at once)"),
    Flag("--dispatch-queue-ttl", "dispatch_queue_ttl_s", "seconds a request may wait in that queue"),
    Flag("--migration", "migration.policy",
         "live migration between decode workers: 'balance' moves running requests off a full or "
         "skewed worker (instead of retracting); 'auto' (default) is balance with >= 2 decode "
         "workers; 'off' only on POST /admin/migrate and /admin/drain"),
    Flag("--debug-migrate-every", "migration.debug_migrate_every",
         "test lever: move every running request to another decode worker each N tokens it streams "
         "(chaos runs; 0: off)"),
    Flag("--planner", "planner.enabled",
         "autoscale prefill and decode workers from TTFT / inter-token latency against their targets"),
    Flag("--ttft-slo", "planner.ttft_slo_s", "the planner's time-to-first-token target (seconds)"),
    Flag("--itl-slo", "planner.itl_slo_s", "the planner's inter-token latency target (seconds)"),
    Flag("--min-prefill", "planner.min_prefill", "the planner's fewest prefill workers"),
    Flag("--max-prefill", "planner.max_prefill", "the planner's most prefill workers"),
    Flag("--min-decode", "planner.min_decode", "the planner's fewest decode workers"),
    Flag("--max-decode", "planner.max_decode", "the planner's most decode workers"),
)

# ServeConfig fields set only through ``--config`` YAML (dotted paths; a section name covers its
# fields that have no Flag).
YAML_ONLY: frozenset[str] = frozenset({
    "isolate_tenants",
    "admission_max_queue", "admission_max_pending_s", "dispatch_prefer_sessions", "kv_events", "max_body_bytes", "l3_timeout_s",
    "engine_config.seed", "engine_config.cache.session_ttl_s", "engine_config.cache.host_write_policy",
    "engine_config.scheduler.max_batch_tokens",
    "engine_config.hybrid", "engine_config.transfer",
    "planner.percentile", "planner.window_s", "planner.period_s", "planner.queue_per_prefill",
    "planner.scale_down_fraction", "planner.scale_down_after_s", "planner.drain_timeout_s",
    "responses", "migration",
})


def field_info(model: type[BaseModel], path: str) -> FieldInfo:
    """The pydantic FieldInfo at dotted ``path`` under ``model``; KeyError names a wrong path."""
    *sections, leaf = path.split(".")
    for part in sections:
        section = _field(model, part, path).annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            raise KeyError(f"{model.__name__}.{part} is not a section (flag path {path!r})")
        model = section
    return _field(model, leaf, path)


def _field(model: type[BaseModel], name: str, path: str) -> FieldInfo:
    info = model.model_fields.get(name)
    if info is None:
        raise KeyError(f"{model.__name__} has no field {name!r} (flag path {path!r})")
    return info


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> int; a Literal stays as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"cannot make a flag for {annotation}")
        return args[0]
    return annotation


def argparse_kwargs(model: type[BaseModel], flag: Flag) -> dict[str, Any]:
    """What ``add_argument(flag.name, **kw)`` needs: type/choices/action and help from the field."""
    info = field_info(model, flag.path)
    kind = _base_type(info.annotation)
    kw: dict[str, Any] = {"default": None, "dest": flag.name.lstrip("-").replace("-", "_")}
    if kind is bool:
        kw["action"] = "store_true"
    elif typing.get_origin(kind) is Literal:
        kw["choices"] = list(typing.get_args(kind))
    elif kind in (int, float, str):
        kw["type"] = kind
    else:
        raise TypeError(f"flag {flag.name}: field {flag.path} is a {kind}, not a flag type")
    help_ = flag.help
    if info.default is not None and kind is not bool and (help_ is None or "default" not in help_):
        shown = f"{info.default:g}" if isinstance(info.default, float) else info.default
        help_ = f"{help_} (default {shown})" if help_ else f"default {shown}"
    if help_ is not None:
        kw["help"] = help_
    return kw


def add_flags(group: argparse._ActionsContainer, flags: tuple[Flag, ...], model: type[BaseModel]) -> None:
    """Add ``flags`` (for fields of ``model``) to an argparse parser or argument group."""
    for f in flags:
        group.add_argument(f.name, **argparse_kwargs(model, f))


def given(args: argparse.Namespace, flags: tuple[Flag, ...]) -> dict[str, Any]:
    """``{path: value}`` of the flags that were given (not None) in ``args``."""
    out: dict[str, Any] = {}
    for f in flags:
        v = getattr(args, f.name.lstrip("-").replace("-", "_"), None)
        if v is not None:
            out[f.path] = v
    return out


def override(base: M, values: dict[str, Any]) -> M:
    """``base`` with each dotted path in ``values`` replaced, validated again as a whole."""
    d = base.model_dump()
    for path, v in values.items():
        *head, last = path.split(".")
        node = d
        for part in head:
            node = node[part]
        node[last] = v
    return type(base).model_validate(d)


def engine_config_from_args(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    """EngineConfig from the engine flags over ``base`` (flags not given leave base's value)."""
    return override(base or EngineConfig(), given(args, ENGINE_FLAGS))


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The serve and engine flags given in ``args``, as ServeConfig paths."""
    values = given(args, SERVE_FLAGS)
    values.update({f"engine_config.{k}": v for k, v in given(args, ENGINE_FLAGS).items()})
    return values


def serve_field_paths() -> set[str]:
    """Every leaf field of ServeConfig as a dotted path (for the flags-vs-fields check)."""
    def walk(model: type[BaseModel], prefix: str) -> set[str]:
        out = set()
        for name, info in model.model_fields.items():
            kind = info.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out |= walk(kind, f"{prefix}{name}.")
            else:
                out.add(prefix + name)
        return out
    return walk(ServeConfig, "")
