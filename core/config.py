"""Configuration models, validated once, loaded in cluster/config.py; every default lives here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


EvictionPolicy = Literal["lru", "lfu", "fifo", "priority", "slru", "session"]
SchedulePolicy = Literal["fcfs", "lpm"]
HostWritePolicy = Literal["write_through", "write_back"]


class CacheConfig(_Strict):
    """KV memory of one engine: device pool, host tier and the radix cache."""

    page_size: int = Field(1, ge=1, le=256, description="tokens per KV page (1 allowed)")
    max_total_tokens: int = Field(32768, ge=16, description="device KV slots (tokens) per worker")
    max_running_requests: int = Field(64, ge=1, description="rows in ReqToTokenPool")
    disable_prefix_cache: bool = Field(False, description="every prefix match is a miss")
    eviction_policy: EvictionPolicy = "lru"
    session_ttl_s: float = Field(300.0, gt=0, description="a session touched within this is active")
    host_pool_tokens: int | None = Field(
        None, ge=0, description="host (L2) KV tokens; 0 disables the host tier; unset: the role's "
                                "default (decode workers 4x the device pool, capped at a quarter of "
                                "free host memory; prefill and colocated engines none)")
    host_write_policy: HostWritePolicy = "write_through"
    debug_invariants: bool = Field(False, description="run the cache invariant check() after every cache "
                                   "operation, every step and every command that ends or hands over KV (the "
                                   "error names the command)")
    pin_share: float = Field(0.25, ge=0, le=1, description="pinned tokens one tenant may hold, as a share "
                                                          "of the device pool (a request past it is served "
                                                          "unpinned); the API key's pin_tokens overrides it")
    pin_max_ttl_s: float = Field(3600.0, gt=0, description="the longest a pin lasts (a 24h retention is "
                                                           "capped to it)")


class SchedulerConfig(_Strict):
    """Continuous batching with chunked prefill."""

    chunked_prefill_size: int = Field(512, ge=16, description="prompt-token budget per step")
    max_batch_tokens: int = Field(8192, ge=16, description="all tokens (prefill + decode) per step")
    schedule_policy: SchedulePolicy = "fcfs"
    retraction_policy: Literal["default", "session"] = Field(
        "default", description="retraction victim: fewest generated tokens (ties: longest prompt), "
                               "or 'session': requests of the least recently active sessions first")
    debug_retract_every: int = Field(
        0, ge=0, description="test lever: retract the chosen victim every N decode steps even "
                             "without memory pressure (0 = off)")


class HybridConfig(_Strict):
    """Pool sizes of a hybrid model's extra pools; None: engine/hybrid.py's defaults."""

    swa_pool_tokens: int | None = Field(None, ge=1, description="rows of the SWA KV pool")
    state_slots: int | None = Field(None, ge=2, description="rows of the recurrent-state pool")
    host_swa_rows: int | None = Field(None, ge=1, description="host-tier SWA rows (with a host tier)")
    host_state_slots: int | None = Field(None, ge=1, description="host-tier state checkpoints")


class TransferConfig(_Strict):
    """The NIXL agent's options, named as ``KVTransferAgent``'s keywords."""

    mode: Literal["dynamic", "prepped"] = Field(
        "dynamic", description="coalesced descriptors per write, or descriptors prepared once per peer")
    parts: int = Field(1, ge=1, description="split one write into up to this many NIXL requests")
    num_threads: int = Field(0, ge=0, description="UCX backend worker threads (0 = NIXL's default)")
    ucx_tls: str | None = Field(None, description="UCX transports; None keeps UCX_TLS, else tcp,sm,cma,self")
    progress_thread: bool = Field(False, description="NIXL progresses in a background thread too")
    progress_delay_us: int = Field(100, ge=0, description="the progress thread's idle wake-up period")


class EngineConfig(_Strict):
    """Everything one engine (model + pools + cache + scheduler) needs."""

    model: str = Field("smollm2", description="'smollm2' (embedded GGUF), a .gguf path or a HF directory")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute, weight and KV dtype; 'auto': bfloat16 on CUDA and on CPUs with "
                            "native bf16 (AVX512-BF16/AMX), else float32 (exact)")
    weights: Literal["auto", "native", "int4", "dequant"] = Field(
        "auto", description="a GGUF's quantized projections: 'native' keeps their Q4_0/Q4_1/Q8_0 "
                            "blocks and computes on them (CPU, bfloat16: Tandem's AVX512 kernels, "
                            "exact 4-bit codes times bf16 activations, where they build, else "
                            "torch's int4 kernel), 'int4' forces torch's int4 kernel, 'dequant' "
                            "expands them to the dtype; 'auto': native on a CPU computing in bfloat16")
    attention_backend: Literal["auto", "cpu_kernel", "torch", "triton"] = Field(
        "auto", description="paged attention: 'cpu_kernel' (one C call per layer, AVX512 CPUs), "
                            "'torch' (plain torch ops), 'triton' (GPU); 'auto': triton on CUDA, "
                            "cpu_kernel where it builds, else torch")
    context_length: int | None = Field(None, ge=16, description="override the model's context length")
    sliding_window: int | None = Field(None, ge=1, description="override: make layers sliding-window")
    num_threads: int | None = Field(None, ge=1,
                                     description="torch CPU threads (default: all cores in one process; "
                                                 "a worker actor: the CPUs Ray assigned it)")
    seed: int = 0
    disable_cuda_graph: bool = Field(
        False, description="decode steps launch every kernel from Python instead of replaying "
                           "captured CUDA graphs (CUDA only; the CPU never captures)")
    cuda_graph_max_bs: int | None = Field(
        None, ge=1, description="largest decode batch captured in a CUDA graph; larger batches run "
                                "eagerly (default: cache.max_running_requests)")
    overlap_schedule: Literal["auto", "on", "off"] = Field(
        "auto", description="plan and build step N+1 while the device runs step N (greedy "
                            "batches; engine/overlap.py); 'auto': on for CUDA devices, off on the CPU")
    disable_overlap_schedule: bool = Field(
        False, description="turn overlap scheduling off whatever overlap_schedule says")
    speculative_algorithm: Literal["ngram", "off"] = Field(
        "ngram", description="speculative decoding: 'ngram' drafts tokens from the request's own text "
                             "and its tenant's finished requests, verified in one step (the same "
                             "tokens as without; engine/sched/spec/), 'off': one token per step")
    speculative_num_draft_tokens: int = Field(
        8, ge=1, le=32, description="the most draft tokens one request verifies in a step (the cost "
                                    "rule drafts fewer where they do not pay)")
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    hybrid: HybridConfig = HybridConfig()
    transfer: TransferConfig = TransferConfig()

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.cache.max_total_tokens < self.cache.page_size * 4:
            raise ValueError(
                f"max_total_tokens={self.cache.max_total_tokens} must hold at least 4 pages of "
                f"page_size={self.cache.page_size}")
        return self


class MigrationConfig(_Strict):
    """Live migration between decode workers (router/rebalance.py decides, cluster/migration.py moves)."""

    policy: Literal["auto", "off", "balance"] = Field(
        "auto", description="'balance': every period, move one request from the fullest decode worker "
        "to the emptiest under pressure or skew (router/rebalance.py); 'auto': balance with >= 2 "
        "decode workers; 'off': only on POST /admin/migrate and /admin/drain")
    period_s: float = Field(0.5, gt=0, description="seconds between two decisions")
    high: float = Field(0.85, gt=0, le=1, description="a decode worker this full (KV tokens of its "
                        "running requests over its pool) sheds a request, if a peer is at most `low`")
    low: float = Field(0.6, ge=0, lt=1, description="how empty a peer must be to take it")
    spread: float = Field(0.5, gt=0, le=1, description="or move when two decode workers' fullness "
                          "differs by more than this")
    precopy: bool = Field(True, description="before the stop, the target takes the request's KV into "
                          "its cache while the source keeps decoding (the stop then copies only the rest)")
    precopy_generated: bool = Field(True, description="the pre-copy takes the tokens generated so far too "
                                    "(whole pages), not only the prompt: the stop copies only the tail "
                                    "generated since (off: the prompt only, and the stop copies every "
                                    "generated token)")
    precopy_again_pages: int = Field(1, ge=0, description="a second pre-copy round when the source "
                                     "generated at least this many more whole pages while the first ran "
                                     "(0: one round only; with precopy_generated)")
    precopy_min_tokens: int = Field(128, ge=0, description="pre-copy only requests whose pre-copied "
                                    "tokens (the prompt, plus the generated ones) are at least this many")
    precopy_timeout_s: float = Field(10.0, gt=0, description="a pre-copy (all its rounds) slower than "
                                     "this is given up (the stop copies what it lacks)")
    debug_migrate_every: int = Field(0, ge=0, description="test lever: the router moves every running "
                                     "request to another decode worker each time it has streamed this "
                                     "many tokens on one (0: off)")

    def active(self, decodes: int) -> bool:
        """Whether the policy moves requests by itself with ``decodes`` decode workers."""
        return self.policy == "balance" or (self.policy == "auto" and decodes >= 2)


class PlannerConfig(_Strict):
    """The router's SLO planner (router/planner.py; cluster/autoscaler.py applies its plans)."""

    enabled: bool = Field(False, description="run the planner (needs a Ray cluster whose worker "
                          "groups offer the 'prefill' / 'decode' resources and autoscale)")
    ttft_slo_s: float = Field(2.0, gt=0, description="target time to first token (seconds)")
    itl_slo_s: float = Field(0.1, gt=0, description="target inter-token latency (seconds)")
    percentile: float = Field(0.9, gt=0, le=1, description="the latency percentile held to the targets")
    window_s: float = Field(20.0, gt=0, description="latency samples older than this are forgotten")
    period_s: float = Field(2.0, gt=0, description="seconds between two plans")
    min_prefill: int = Field(1, ge=0)
    max_prefill: int = Field(4, ge=1)
    min_decode: int = Field(1, ge=1)
    max_decode: int = Field(4, ge=1)
    queue_per_prefill: int = Field(4, ge=1, description="prefill queue depth (waiting requests per "
                                   "worker) that asks for one more prefill worker, whatever the TTFT")
    scale_down_fraction: float = Field(0.3, gt=0, lt=1, description="a role whose latency stays under "
                                       "this fraction of its target (and whose queue is empty) can lose a worker")
    scale_down_after_s: float = Field(30.0, ge=0, description="how long a role must stay that idle "
                                      "before one of its workers is drained")
    drain_timeout_s: float = Field(300.0, gt=0, description="a drained worker is stopped once idle, "
                                   "or after this long whatever it still runs")

    @model_validator(mode="after")
    def _bounds(self) -> "PlannerConfig":
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError(f"planner bounds: prefill {self.min_prefill}..{self.max_prefill}, "
                             f"decode {self.min_decode}..{self.max_decode} (min must be <= max)")
        return self


class ResponsesConfig(_Strict):
    """The Responses API's store, bounded by count, bytes and age (least recently used goes first)."""

    max_stored: int = Field(10_000, ge=1, description="responses kept at most")
    max_bytes: int = Field(256 << 20, ge=1 << 16, description="bytes of stored responses kept at most "
                           "(each holds its whole conversation, so a chain's last turn needs no other)")
    ttl_s: float = Field(24 * 3600.0, gt=0, description="a response not used for this long is dropped")


class WorkerOptions(_Strict):
    """What a prefill or decode worker runs with besides its engine, built once from a
    ServeConfig (:meth:`ServeConfig.worker_options`) and handed whole to the actor and the
    worker; each role reads the fields it uses. In-process workers take the same fields as
    keywords (tests)."""

    transfer_timeout_s: float = Field(30.0, gt=0)
    kv_events: bool = False
    kv_events_host: str = "127.0.0.1"
    l3: dict[str, Any] | None = None             # cache/tiers/l3/connect.py ``l3_options``
    kv_digest: bool = False                      # decode verifies received pages (ServeConfig's)
    debug_corrupt_kv: bool = False
    local_prefill_threshold: int | None = Field(0, ge=0)   # decode/local_prefill.py; ServeConfig's default is None
    reply_push: bool = True
    debug_push_fault: Literal["", "fail"] = ""
    debug_transfer_delay_ms: float = Field(0.0, ge=0)   # prefill's sends
    debug_transfer_stall: bool = False
    prefix_warmup: bool = False                  # prefill takes a peer's held prefix into its cache (prefill/warmup.py)


class ServeConfig(_Strict):
    """``tandem serve``'s config: the YAML of ``--config`` has exactly these keys."""

    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: Literal["real", "sim"] = "real"
    prefill: int = Field(1, ge=0, description="prefill workers")
    decode: int = Field(1, ge=1, description="decode workers")
    prefill_num_gpus: float | None = Field(
        None, ge=0, description="GPUs each prefill worker's Ray actor asks for (a fraction shares one "
                                "GPU between workers); None: one each when the cluster has a GPU per "
                                "worker, else none")
    decode_num_gpus: float | None = Field(None, ge=0, description="likewise, each decode worker")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: str | None = Field(None, description="one admin key of the default tenant")
    api_keys: str | None = Field(None, description="YAML key file: a list of {key | key_sha256, tenant, "
                                 "role: user|admin, rate_limit} (router/auth.py); read at start and on SIGHUP")
    isolate_tenants: bool = Field(True, description="each tenant's requests reuse only that tenant's "
                                  "cached prefixes (its name salts the page-hash chain, core/page_hash.py)")
    otlp_endpoint: str | None = Field(None, description="trace every request with OpenTelemetry, exported "
                                      "over OTLP/HTTP to this URL (OTEL_EXPORTER_OTLP_* work too)")
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting one")
    ray_namespace: str = Field("tandem", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                               description="the Ray namespace of the workers' named actors (every "
                               "router of one worker set uses the same)")
    worker_lifetime: Literal["auto", "router", "cluster"] = Field(
        "auto", description="'cluster': workers are detached named actors that outlive the router; "
                            "a router that starts adopts the running ones. 'router': this router's "
                            "own private workers, stopped when it stops. 'auto': 'cluster' when "
                            "joining a Ray cluster (ray_address), else 'router'")
    policy: Literal["round_robin", "random", "least_load", "cache_aware", "kv_events", "session"] = "session"
    transfer_timeout_s: float = Field(30.0, gt=0)
    progress_timeout_s: float = Field(5.0, gt=0, description="a worker whose heartbeat goes unanswered "
                                      "this long (or whose engine stays in one step 3x as long) is "
                                      "suspect: no new "
                                      "requests; its requests are re-dispatched (nothing streamed yet) "
                                      "or resumed on a peer (text streamed), else fail with an error "
                                      "event; it rejoins once it answers again")
    progress_replace_s: float = Field(60.0, gt=0, description="a worker suspect for this long is "
                                      "killed and replaced, as a dead one is")
    max_failovers: int = Field(2, ge=0, description="times one request may resume on another decode "
                               "worker after the one streaming it died (its client's tokens so far kept, "
                               "the KV recomputed there); past it, or with 0, the request ends with an "
                               "error event")
    failover_wait_s: float = Field(30.0, ge=0, description="a request whose decode worker died waits "
                                   "this long for a live one (the supervisor's replacement when it was "
                                   "the only one) before it ends with an error event")
    router_lease_s: float = Field(15.0, gt=0, description="a decode worker that has not heard this "
                                  "router's heartbeat for this long aborts the streams it runs for it "
                                  "(the router went away); sent with each heartbeat")
    debug_transfer_delay_ms: float = Field(0.0, ge=0, description="test lever: prefill workers wait "
                                           "this long before posting each KV write")
    debug_transfer_stall: bool = Field(False, description="test lever: prefill workers never post "
                                       "their KV writes (each transfer stalls until aborted)")
    local_prefill_threshold: int | None = Field(None, ge=0, description="None: a decode worker prefills "
                                                "a prompt itself when it holds tokens the prefill worker lacks "
                                                "and the measured cost rule says so (decode/README.md); 0: never; "
                                                "N: an uncached suffix shorter than N tokens")
    reply_push: Literal["on", "off"] = Field("on", description="on: a decode worker pushes a finished "
                                             "request's sequence (prompt and reply) to the prefill worker that "
                                             "served it, so a session's next turn computes only its new tokens "
                                             "there (decode/README.md, reply push); off: never")
    debug_push_fault: Literal["off", "fail"] = Field("off", description="test lever: fail: decode workers "
                                                     "answer every reply push FAILED without writing")
    decode_max_total_tokens: int | None = Field(None, ge=16, description="device KV tokens per decode worker")
    admission_max_queue: int = Field(64, ge=0, description="a prefill worker with this many requests "
                                     "waiting takes no new ones; all of them past it -> 429")
    admission_max_pending_s: float = Field(30.0, gt=0, description="likewise, predicted queueing seconds")
    dispatch_queue_size: int = Field(256, ge=0, description="requests that wait in the router for a "
                                     "worker under its admission limits before any 429 (0: refuse at once)")
    dispatch_queue_ttl_s: float = Field(5.0, gt=0, description="a queued request still not admitted "
                                        "after this long is refused (429 with Retry-After)")
    dispatch_prefer_sessions: bool = Field(True, description="in that queue, a later turn of a session "
                                           "the router is serving waits ahead of new sessions (same priority)")
    kv_events: bool | None = Field(None, description="workers (prefill and decode) publish KV events "
                                   "in vLLM's format to the router's exact index (default: with the "
                                   "kv_events and session policies on Ray workers)")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    kv_digest: bool = Field(False, description="prefill sends a digest of the KV pages it wrote; "
                            "decode verifies it before decoding (a mismatch fails the request)")
    debug_corrupt_kv: bool = Field(False, description="test lever: decode workers corrupt every received "
                                   "KV page before the digest check (with kv_digest: every request fails)")
    kv_store: str = Field("off", pattern=r"^(off|mooncake|mooncake://[^\s/:]+:\d+(/\d+)?)$",
                          description="the shared L3 KV tier (issue 26): off; mooncake (start a Mooncake "
                                      "master with the cluster); mooncake://HOST:PORT[/METAPORT] (join one). "
                                      "Off by default until a bench shows it helps on the deployment")
    l3_timeout_s: float = Field(0.5, gt=0, description="L3 store calls slower than this are a miss")
    l3_store_bytes: int = Field(1 << 30, ge=0, description="memory the storage process that "
                                "kv_store 'mooncake' starts beside the master lends to the store (where "
                                "L3 pages live, so they outlive the workers; at least 16 MiB; 0: start "
                                "no storage, the workers must lend)")
    l3_worker_segment_bytes: int = Field(0, ge=0, description="memory each worker lends to the L3 "
                                         "store (0: none, the cluster's storage keeps the pages; a page "
                                         "in a worker's segment goes with that worker)")
    debug_corrupt_l3: bool = Field(False, description="test lever: workers corrupt each page they write to "
                                   "the L3 store (every L3 read is then a digest miss, recomputed)")
    debug_endpoints: bool = Field(False, description="test lever: enable POST /debug/kill (stop a worker "
                                  "by name) for chaos runs; never on in production")
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="tool-call output format (router/tools/formats.py): 'auto' picks it from "
                            "the model's chat template, Hermes when the template has no tool support")
    sim_profile: str = Field("llama3-8b-h100", description="engine 'sim': the cost profile "
                             "(sim/cost_model.py) the simulated workers run at")
    sim_speedup: float = Field(1.0, gt=0, description="engine 'sim': simulated seconds per wall second")
    engine_config: EngineConfig = EngineConfig()
    planner: PlannerConfig = PlannerConfig()
    migration: MigrationConfig = MigrationConfig()
    responses: ResponsesConfig = ResponsesConfig()

    def worker_options(self, *, l3: dict[str, Any] | None = None,
                       kv_events: bool = False) -> WorkerOptions:
        """The options every worker of this cluster runs with (``l3``, ``kv_events``: resolved
        by cluster/launch.py)."""
        return WorkerOptions(
            transfer_timeout_s=self.transfer_timeout_s, kv_events=kv_events, l3=l3,
            kv_digest=self.kv_digest, debug_corrupt_kv=self.debug_corrupt_kv,
            local_prefill_threshold=self.local_prefill_threshold, reply_push=self.reply_push == "on",
            debug_push_fault="" if self.debug_push_fault == "off" else self.debug_push_fault,
            debug_transfer_delay_ms=self.debug_transfer_delay_ms,
            debug_transfer_stall=self.debug_transfer_stall)

    @property
    def detached_workers(self) -> bool:
        """Whether the workers outlive this router (``worker_lifetime``, 'auto' resolved)."""
        if self.worker_lifetime == "auto":
            return self.ray_address is not None
        return self.worker_lifetime == "cluster"
