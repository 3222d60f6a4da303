"""Gemma 3 (text) from a HF directory: interleaved sliding-window / global attention.

Tiny random ``Gemma3ForCausalLM`` models (1:1 local/global pattern, local and global rotary bases,
linear rope scaling on the global layers, ``query_pre_attn_scalar`` != head_dim, final logit
softcapping, norm weights centred on 0 so ``1 + w`` matters) saved with ``save_pretrained``:

- logits equal transformers' (measured max |diff| 0 for a one-shot prefill, <= 4e-6 chunked;
  asserted within 1e-4) for prompts longer than the window, one-shot and in chunks whose
  boundaries fall inside and across the window, batched with decode rows, page sizes 1 and 4;
- the Engine (chunked_prefill_size 16, page sizes 1 and 4, prefix cache on and off, every
  invariant checked) gives transformers' greedy tokens over multi-turn sessions, for a window
  smaller than a chunk (7) and larger than one (20), also with pools small enough that the cache
  evicts FULL nodes and tombstones SWA rows.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.model_config import ModelLoadError  # noqa: E402
from tandem.engine.models.gemma3 import gemma3_arch  # noqa: E402

from hf_hybrid_support import (engine_sessions, hf_greedy, make_engine, randomize,  # noqa: E402
                               save_hf, StateRunner)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(7 * i + 3) % 256 for i in range(37)]
ATOL = 1e-4


def gemma_config(window: int, **kw):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                sliding_window=window, sliding_window_pattern=2, query_pre_attn_scalar=24,
                final_logit_softcapping=8.0, bos_token_id=256, eos_token_id=257, pad_token_id=0,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return transformers.Gemma3TextConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=[7, 20], ids=["window7", "window20"])
def gemma(request, tmp_path_factory):
    """(transformers model, Tandem LoadedModel, reference logits [T, V] of PROMPT)."""
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(gemma_config(request.param)).eval()
    randomize(hf, offset_norms=True)
    path = tmp_path_factory.mktemp(f"gemma3_w{request.param}")
    save_hf(hf, path)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    return hf, loaded, ref


def test_config_parsed(gemma):
    hf, loaded, _ = gemma
    a, ex = loaded.arch, loaded.model.extras
    assert a.arch == "gemma3" and a.layer_types == ["swa", "full", "swa", "full"]
    assert a.sliding_window == hf.config.sliding_window and a.tie_word_embeddings
    assert a.rope_theta == 1e6 and a.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert ex.rope_kinds == ("local", "global", "local", "global") and ex.local_theta == 1e4
    assert ex.query_pre_attn_scalar == 24 and ex.final_logit_softcapping == 8.0
    assert loaded.tokenizer.eos_token_ids == {257}


def test_legacy_config_layout():
    """transformers 4.5x configs: rope_theta / rope_local_base_freq / rope_scaling at the top
    level, sliding_window_pattern instead of layer_types."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 512, "sliding_window_pattern": 3,
           "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 16,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "eos_token_id": [1, 106]}
    arch, ex = gemma3_arch(cfg)
    assert arch.layer_types == ["swa", "swa", "full"] * 2 and arch.sliding_window == 512
    assert (arch.rope_theta, ex.local_theta) == (1e6, 1e4) and ex.local_scaling is None
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0} and arch.eos_token_ids == (1, 106)
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        gemma3_arch({**cfg, "attn_logit_softcapping": 50.0})
    with pytest.raises(ModelLoadError, match="hidden_activation 'relu'"):
        gemma3_arch({**cfg, "hidden_activation": "relu"})


def test_prefill_logits_match_hf(gemma):
    hf, loaded, ref = gemma
    r = StateRunner(loaded)
    got = r.extend([r.new_seq()], [PROMPT], all_logits=True)              # [T, V]
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    wide = transformers.Gemma3ForCausalLM(gemma_config(len(PROMPT))).eval()  # same weights, no window
    wide.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert (wide(torch.tensor([PROMPT])).logits[0] - ref).abs().max() > 0.05   # the window matters


def test_pickled_model_gives_the_same_logits(gemma):
    """The cluster ships a loaded model to its workers with ray.put (pickle)."""
    import pickle

    _, loaded, ref = gemma
    r = StateRunner(pickle.loads(pickle.dumps(loaded)))
    got = r.extend([r.new_seq()], [PROMPT], all_logits=True)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_and_decode_match_hf(gemma, page_size):
    """Seq A: chunks [0, 6) [6, 19) [19, 30), then decode to 37 (chunk boundaries inside and
    across both windows); seq B runs beside it one token at a time, so steps mix rows."""
    _, loaded, ref = gemma
    r = StateRunner(loaded, page_size)
    a, b = r.new_seq(), r.new_seq()
    got_a, got_b = [], []
    for (lo, hi), t in zip([(0, 6), (6, 19), (19, 30)], range(3)):
        lg = r.extend([a, b], [PROMPT[lo:hi], PROMPT[t:t + 1]], all_logits=True)
        got_a.append(lg[: hi - lo])
        got_b.append(lg[hi - lo:])
    for t in range(30, len(PROMPT)):
        lg = r.extend([a, b], [[PROMPT[t]], [PROMPT[t - 27]]])
        got_a.append(lg[:1])
        got_b.append(lg[1:])
    torch.testing.assert_close(torch.cat(got_a), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), ref[:10], atol=ATOL, rtol=0)


@pytest.mark.parametrize("disable", [False, True], ids=["cache", "nocache"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_greedy_matches_hf(gemma, page_size, disable):
    hf, loaded, _ = gemma
    e = make_engine(loaded, page_size=page_size, disable=disable)
    try:
        sessions = engine_sessions(e)
        e.check_invariants()   # also checked after every step
        stats, hstats = dict(e.scheduler.stats), dict(e.hybrid.stats)
    finally:
        e.shutdown()
    assert e.hybrid.window == hf.config.sliding_window
    for sess in sessions:
        for prompt, out, cached in sess:
            assert out == hf_greedy(hf, prompt, len(out))
            assert cached == 0 or not disable
    later = [c for sess in sessions for _, _, c in sess[1:]]
    assert (sum(later) > 0) != disable, later        # later turns reuse the cached prefix
    if disable:   # the request alone owns its SWA rows and frees them as the window moves on
        assert hstats["swa_released"] > 0 and stats["steps"] > 0


def test_engine_under_pool_pressure_matches_hf(gemma):
    """Small full and SWA pools (256 / 64 rows), three sessions: the cache evicts FULL nodes and
    tombstones SWA rows (its SWA vote then limits reuse), outputs stay transformers'."""
    hf, loaded, _ = gemma
    e = make_engine(loaded, page_size=4, disable=False, max_total_tokens=256, swa_pool_tokens=64)
    try:
        sessions = engine_sessions(e, n_sessions=3)
        e.check_invariants()
        stats, hstats = dict(e.scheduler.stats), dict(e.hybrid.stats)
    finally:
        e.shutdown()
    for sess in sessions:
        for prompt, out, _ in sess:
            assert out == hf_greedy(hf, prompt, len(out))
    assert hstats["swa_evicted"] > 0 and stats["evicted_tokens"] > 0
    assert sum(c for sess in sessions for _, _, c in sess) > 0


def test_conditional_generation_checkpoint_text_part(tmp_path):
    """A Gemma3ForConditionalGeneration directory (text + a vision tower): its text model, read
    from ``model.language_model.*``, gives transformers' text-only logits."""
    from tandem.engine.model_runner import ModelRunner
    from hf_hybrid_support import save_hf

    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
        sliding_window_pattern=2, query_pre_attn_scalar=24, bos_token_id=256, eos_token_id=257, pad_token_id=0)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    randomize(hf, offset_norms=True)
    save_hf(hf, tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.arch.arch == "gemma3" and loaded.arch.num_layers == 4
    ids = list(range(3, 40))
    r = ModelRunner.create(loaded, max_total_tokens=256, page_size=1, max_reqs=2, max_context=128)
    s = r.new_seq()
    got = r.extend([s], [ids], return_all_logits=True)
    r.release(s)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref.float(), atol=2e-4, rtol=1e-4)
