"""A real-size geometry without a download: Llama-3.1-8B's shapes with seeded random bf16 weights
made on the GPU (32 layers, hidden 4,096, 32 query / 8 KV heads, head dim 128, intermediate
14,336, vocab 128,256; 16 GB), built straight into ``LlamaForCausalLM`` (no file).

Measured through ModelRunner with CUDA graphs (the runner: batch building + forward + argmax):
decode tok/s at batches 1, 16 and 64 over 512-token contexts against the HBM roofline of the same
run ((weights + KV read and written) / copy bandwidth), an 8,192-token prefill against the FLOP
roofline at the measured GEMM rate, and the kernel launches of a decode step. The CPU smoke run
uses a tiny geometry of the same shape family.
"""

from __future__ import annotations

from typing import Any

import torch

LLAMA31_8B = dict(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_q_heads=32,
                  num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position=131072,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
SMOKE = dict(LLAMA31_8B, vocab_size=300, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
             head_dim=16, intermediate_size=128, max_position=4096)


@torch.no_grad()
def random_llama(geometry: dict, device, dtype, seed: int = 0):
    """A LoadedModel of ``geometry`` with random weights made on ``device`` (a byte tokenizer:
    the runner never detokenizes)."""
    from tandem.engine.loader import LoadedModel
    from tandem.engine.model_config import ModelArchConfig
    from tandem.engine.models.hybrid import byte_tokenizer
    from tandem.engine.models.llama import LlamaForCausalLM

    g = dict(geometry)
    arch = ModelArchConfig(layer_types=["full"] * g["num_layers"], bos_token_id=256, eos_token_ids=(257,), **g)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    shapes = {"q_proj": (arch.num_q_heads * d, h), "k_proj": (arch.num_kv_heads * d, h),
              "v_proj": (arch.num_kv_heads * d, h), "o_proj": (h, arch.num_q_heads * d),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def get(name: str) -> torch.Tensor:
        if "norm" in name:
            return 1.0 + 0.1 * torch.randn(h, generator=gen, device=device, dtype=dtype)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0.02 * torch.randn(arch.vocab_size, h, generator=gen, device=device, dtype=dtype)
        shape = shapes[name.split(".")[-2]]
        return torch.randn(shape, generator=gen, device=device, dtype=dtype) * shape[1] ** -0.5

    model = LlamaForCausalLM(arch, get, torch.device(device), dtype)
    return LoadedModel(model, arch, byte_tokenizer(), "random weights, Llama-3.1-8B geometry")


def measure(device, dtype, ceilings: dict, smoke: bool = False) -> dict:
    from tandem.bench.gpu.models import ModelPair
    from tandem.bench.gpu.profile import decode_launches
    from tandem.bench.gpu import throughput as tp

    loaded = random_llama(SMOKE if smoke else LLAMA31_8B, device, dtype)
    pair = ModelPair(loaded.name, False, loaded, None, [])
    arch = loaded.arch
    wbytes = tp.weight_bytes(loaded.model)
    kv_bpt = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * torch.tensor([], dtype=dtype).element_size()
    graph = "cuda" if torch.device(device).type == "cuda" else "standin"
    prompt, steps = (12, 4) if smoke else (512, 32)
    rows = []
    for B in ((1, 2) if smoke else (1, 16, 64)):
        row: dict[str, Any] = {"batch": B, "graphs": tp.runner_decode(pair, B, prompt, steps, graph)}
        if "copy_GBps" in ceilings:
            floor = tp.decode_floor_s(wbytes, kv_bpt, B, prompt + steps // 2, ceilings["copy_GBps"])
            row["roofline_tok_s"] = round(B / floor, 1)
            row["of_roofline"] = round(row["graphs"]["tok_s"] / row["roofline_tok_s"], 3)
        rows.append(row)
        print(f"[gpu_check]   8B geometry decode B={B}: {row}", flush=True)
    T = 48 if smoke else 8192
    pre = tp.runner_prefill(pair, T)
    if "bf16_gemm_TFLOPs" in ceilings:
        pre["roofline_tok_s"] = round(T / (tp.prefill_flops(arch, T) / (ceilings["bf16_gemm_TFLOPs"] * 1e12)), 1)
        pre["of_roofline"] = round(pre["tok_s"] / pre["roofline_tok_s"], 3)
    launches = decode_launches(pair, 1, prompt)
    del pair, loaded
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"weights_GB": round(wbytes / 1e9, 2), "decode": rows, "prefill": dict(pre, tokens=T),
            "launches": launches, "ok": True}
