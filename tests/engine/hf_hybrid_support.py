"""Helpers for the real hybrid families' tests (test_gemma3.py, test_granite_hybrid.py).

- :func:`save_hf`: a tiny transformers model with seeded random weights, saved as a HF directory
  (config.json + safetensors + the byte-level tokenizer.json of test_model_tiny.py).
- :func:`hf_greedy`: transformers' greedy tokens, recomputing the whole sequence for each one
  (no transformers cache involved: the oracle is the plain forward).
- :class:`StateRunner`: ModelRunner's sequence API plus a state-pool row per sequence, so a
  recurrent model can run chunked prefill and decode without the scheduler.
- :func:`engine_sessions`: multi-turn sessions through the Engine (prefix reuse across turns).
"""

from __future__ import annotations

import torch

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import SamplingParams
from tandem.engine.engine import Engine
from tandem.cache.state_pool import StatePool
from tandem.engine.hybrid import HybridConfig
from tandem.engine.model_runner import ModelRunner, RunnerSeq

from test_model_tiny import write_tokenizer


def randomize(model, *, offset_norms: bool = False, seed: int = 0) -> None:
    """Seeded random weights with realistic Mamba2 parameters: A_log ~ log(1..8) (decays),
    dt_bias around -1 (softplus ~0.3), D ~ 1. ``offset_norms``: norm weights are centred on 0
    (Gemma's ``1 + w``), else on 1."""
    g = torch.Generator().manual_seed(seed)

    def rand(p):
        return torch.randn(p.shape, generator=g)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.linspace(1, 8, p.numel())) + 0.1 * rand(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * rand(p) - 1.0)
            elif name.endswith(".D"):
                p.copy_(1.0 + 0.2 * rand(p))
            elif "norm" in name:
                p.copy_((0.0 if offset_norms else 1.0) + 0.2 * rand(p))
            else:
                p.copy_(0.15 * rand(p))


def save_hf(model, path) -> None:
    model.save_pretrained(path)
    write_tokenizer(path)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` from transformers' full forward."""
    ids, out = list(ids), []
    for _ in range(n):
        tok = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


class StateRunner:
    """``ModelRunner.create`` plus a :class:`StatePool` row per sequence (recurrent layers).
    ``extend(seqs, ids)`` runs one step over several sequences (mixed chunk / decode rows)."""

    def __init__(self, loaded, page_size: int = 1, max_total_tokens: int = 512):
        self.r = ModelRunner.create(loaded, max_total_tokens=max_total_tokens, page_size=page_size,
                                    max_reqs=4, max_context=max(256, max_total_tokens))
        m = loaded.model
        self.pool = StatePool(4, m.recurrent_layers, m.state_shape) \
            if getattr(m, "state_shape", None) else None
        self._rows: dict[int, int] = {}

    def new_seq(self) -> RunnerSeq:
        s = self.r.new_seq()
        self._rows[s.row] = len(self._rows) + 1       # state rows 1.. (0 is padding)
        return s

    def extend(self, seqs: list[RunnerSeq], new_ids: list[list[int]], all_logits: bool = False):
        plans = []
        for s, ids in zip(seqs, new_ids, strict=True):
            slots = self.r.allocator.alloc_extend(s.last_slot, s.length, len(ids))
            plans.append((s.row, s.length, list(ids), slots))
        fb = self.r.build_forward_batch(plans)
        if self.pool is not None:
            fb.state_indices = torch.tensor([self._rows[s.row] for s in seqs])
            fb.state_pool = self.pool
        for s, (_, _, ids, slots) in zip(seqs, plans):
            s.length += len(ids)
            s.last_slot = int(slots[-1])
        return self.r.forward(fb, all_logits)


def make_engine(loaded, *, page_size: int, disable: bool, chunk: int = 16,
                max_total_tokens: int = 512, state_slots: int = 12,
                swa_pool_tokens: int | None = None) -> Engine:
    """An Engine with every invariant check on (cache sanity after each operation, the
    scheduler's exact pool ownership after each step)."""
    cfg = EngineConfig(
        num_threads=1,
        cache=CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens,
                          max_running_requests=4, debug_invariants=True, disable_prefix_cache=disable),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk))
    return Engine(cfg, loaded=loaded,
                  hybrid=HybridConfig(state_slots=state_slots, swa_pool_tokens=swa_pool_tokens))


def engine_sessions(engine: Engine, n_sessions: int = 2, turns: int = 3, max_tokens: int = 6):
    """Interleaved multi-turn sessions (byte prompts of 40-120 tokens: several prefill chunks,
    longer than the sliding windows); each turn's prompt extends the previous prompt + output.
    Returns per session ``[(prompt ids, output ids, cached tokens)]``."""
    history = [list(f"System: tiny hybrid model, session {s}. Answer briefly. ".encode())
               for s in range(n_sessions)]
    out = [[] for _ in range(n_sessions)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for turn in range(turns):
        reqs = []
        for s in range(n_sessions):
            history[s] = history[s] + list(f"<user> q{turn}.{s}? <bot>".encode())
            reqs.append(engine.make_request(history[s], params, session_id=f"s{s}"))
        for s, c in enumerate(engine.generate_many(reqs, timeout=300)):
            assert c.error is None, c.error
            out[s].append((list(history[s]), c.token_ids, c.cached_tokens))
            history[s] = history[s] + c.token_ids
    return out


# -- tiny HF directories of both families (shared by the cluster-half tests) ------------------------
def tiny_gemma3_dir(path, window: int = 8):
    """A tiny random Gemma 3 text model (layers swa, full, swa, full) saved at ``path``;
    returns the transformers model."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=window, sliding_window_pattern=2, query_pre_attn_scalar=24,
        final_logit_softcapping=8.0, bos_token_id=256, eos_token_id=257, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    randomize(hf, offset_norms=True)
    save_hf(hf, path)
    return hf


def tiny_granite_dir(path):
    """A tiny random Granite-4.0-H model (layers mamba, attention, mamba, mamba) at ``path``."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=300, hidden_size=64, intermediate_size=32, shared_intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4, mamba_chunk_size=8,
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.2,
        logits_scaling=1.3, bos_token_id=256, eos_token_id=257, max_position_embeddings=512,
        num_local_experts=0, position_embedding_type="rope")
    hf = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    randomize(hf)
    save_hf(hf, path)
    return hf


def tiny_family(name: str, tmp_path_factory, tag: str = ""):
    """The tiny random ``name`` ("gemma3" or "granite") saved under a fresh temporary directory
    and loaded in float32: (its path, the LoadedModel)."""
    from tandem.engine.loader import load_model

    path = tmp_path_factory.mktemp(f"{tag}{name}")
    (tiny_gemma3_dir if name == "gemma3" else tiny_granite_dir)(path)
    return path, load_model(str(path), device="cpu", dtype="float32")


def hybrid_engine_config(*, page_size: int = 1, max_total_tokens: int = 512, chunk: int = 16,
                         host_pool_tokens: int = 0, disable: bool = False, retract_every: int = 0,
                         max_running_requests: int = 4) -> EngineConfig:
    """The tests' engine config: one thread, every invariant checked after each op and step."""
    return EngineConfig(
        device="cpu", num_threads=1,
        cache=CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens,
                          max_running_requests=max_running_requests, debug_invariants=True,
                          disable_prefix_cache=disable, host_pool_tokens=host_pool_tokens),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, debug_retract_every=retract_every))
