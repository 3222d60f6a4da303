"""Cost profiles: how long prefill, a decode step and a KV transfer take."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.policies import PrefillEstimator


@dataclass(frozen=True)
class Profile:
    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    weight_bytes: float
    gemm_flops: float
    attn_flops: float
    hbm_bytes_s: float
    prefill_overhead_s: float
    decode_overhead_s: float
    link_bytes_s: float
    link_efficiency: float
    link_latency_s: float
    kv_dtype_bytes: int
    decode_kv_tokens: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def _pair_flops(self) -> float:
        return 4.0 * self.layers * self.q_heads * self.head_dim

    def prefill_s(self, new: int, cached: int = 0) -> float:
        """Seconds to prefill ``new`` tokens after ``cached`` reused ones (one request)."""
        return self.estimator().seconds(new, cached)

    def estimator(self) -> PrefillEstimator:
        """The same prefill model in the router's terms (the router predicts with it)."""
        return PrefillEstimator(self.prefill_overhead_s, 2.0 * self.params / self.gemm_flops,
                                self._pair_flops / self.attn_flops)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``context_tokens`` KV tokens in all."""
        if batch <= 0:
            return 0.0
        mem = (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / self.hbm_bytes_s
        flops = (2.0 * self.params * batch + self._pair_flops * context_tokens) / self.gemm_flops
        return self.decode_overhead_s + max(mem, flops)

    def transfer_s(self, nbytes: float) -> float:
        return self.link_latency_s + nbytes / (self.link_bytes_s * self.link_efficiency)

    def kv_transfer_s(self, tokens: int) -> float:
        return self.transfer_s(tokens * self.kv_bytes_per_token)


# Llama-3-8B (Meta model card / config.json: 8.03e9 params, 32 layers, 32 query heads, 8 KV heads,
# head_dim 128) in bf16 on one H100 SXM5 80 GB (NVIDIA datasheet: 989 TFLOP/s dense BF16,
# 3.35 TB/s HBM3). [sourced] = from the cited document; [assumed] = our estimate.
# - gemm_flops 600e12 [assumed]: ~60% of the datasheet peak for large bf16 prefill GEMMs.
#   attn_flops 500e12 [assumed]: below FlashAttention-3's reported 740 TFLOP/s forward (75% of
#   peak, Shah et al. 2024) [sourced], for causal masking and chunked prompts. Together:
#   0.53 s for a 15k-token prompt from scratch (~28k prompt tokens/s).
# - hbm 2.6e12 [assumed]: ~78% of the datasheet 3.35 TB/s for memory-bound decode. A lone
#   15k-token request then decodes at ~100 tokens/s (10 ms/step).
# - overheads [assumed]: 10 ms per prefill (scheduling, launches, sampling), 3 ms per decode
#   step (CUDA graphs on).
# - link: one 400 Gb/s ConnectX-7 NIC per GPU, as on a DGX H100 [sourced: DGX H100 datasheet],
#   = 50 GB/s, at 80% efficiency [assumed], 1 ms per transfer [assumed]. KV is 128 KiB/token
#   (2 x 32 layers x 8 heads x 128 x 2 B), so a 15k-token prompt moves 1.97 GB in ~50 ms.
# - decode_kv_tokens: (80 GB x 0.9 - 16.06 GB weights) / 128 KiB = 427k tokens.
LLAMA3_8B_H100 = Profile(
    name="llama3-8b-h100", params=8.03e9, layers=32, q_heads=32, kv_heads=8, head_dim=128,
    weight_bytes=16.06e9, gemm_flops=600e12, attn_flops=500e12, hbm_bytes_s=2.6e12,
    prefill_overhead_s=0.010, decode_overhead_s=0.003, link_bytes_s=50e9, link_efficiency=0.8,
    link_latency_s=0.001, kv_dtype_bytes=2, decode_kv_tokens=427_000)

# Llama-3-70B (config.json: 70.6e9 params, 80 layers, 64 query heads, 8 KV heads, head_dim 128),
# bf16, tensor-parallel over the 8 H100 SXM5 of one node (Mooncake's instances are 8-GPU nodes).
# - gemm 3.5e15, attention 3.0e15 [assumed]: ~45% and ~38% of 8 x 989 TFLOP/s, TP8 losing to
#   the per-layer all-reduces what one GPU keeps.
# - hbm 8 x 2.6e12 [assumed, as above]; 141 GB of weights read per step across the 8 GPUs.
# - link: 8 x 400 Gb/s NICs per node = 400 GB/s [sourced: DGX H100 datasheet]; KV 320 KiB/token.
# - decode_kv_tokens: (8 x 80 GB x 0.9 - 141 GB) / 320 KiB = 1.33M tokens.
LLAMA3_70B_H100X8 = Profile(
    name="llama3-70b-h100x8", params=70.6e9, layers=80, q_heads=64, kv_heads=8, head_dim=128,
    weight_bytes=141.2e9, gemm_flops=3.5e15, attn_flops=3.0e15, hbm_bytes_s=8 * 2.6e12,
    prefill_overhead_s=0.020, decode_overhead_s=0.008, link_bytes_s=400e9, link_efficiency=0.8,
    link_latency_s=0.001, kv_dtype_bytes=2, decode_kv_tokens=1_330_000)

PROFILES = {p.name: p for p in (LLAMA3_8B_H100, LLAMA3_70B_H100X8)}
DEFAULT_PROFILE = LLAMA3_8B_H100.name


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
