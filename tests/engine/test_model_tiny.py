"""Tiny random Llama / Qwen2 / Qwen3 / Mistral models saved as HF directories: Tandem's logits
equal transformers' for a one-shot prefill, and for chunked prefill + decode through the paged
pool (random pages, mixed batches). Covers q/k/v biases, q/k norm, an explicit head_dim, tied
and untied heads, llama3 rope scaling, sharded safetensors and per-layer sliding windows.
The same weights written as GGUF files (llama.cpp names, permuted q/k rows, ``rope_freqs``)
load to the same logits."""

from __future__ import annotations


import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.model_runner import ModelRunner  # noqa: E402
from tandem.engine.models.hybrid import save_byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)
CASES = {
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2_bias_swa": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=6,
                                           max_window_layers=1)),  # layer 0 full, layer 1 window 6
    "qwen3_qknorm": ("Qwen3Config", dict(head_dim=32, num_key_value_heads=1)),
    "mistral_swa": ("MistralConfig", dict(sliding_window=5, head_dim=16)),
}
PROMPT = [(7 * i + 3) % 256 for i in range(21)]


def write_tokenizer(path) -> None:
    """The tiny models' byte-level tokenizer: 256 byte tokens plus <s>, </s> (ids 256, 257), and a chat template."""
    save_byte_tokenizer(path)


def make_hf(kind: str, seed: int = 0):
    cls_name, extra = CASES[kind]
    cfg = getattr(transformers, cls_name)(**{**BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    kind = request.param
    hf = make_hf(kind)
    path = tmp_path_factory.mktemp(kind)
    # One case saves sharded (model.safetensors.index.json + shards).
    hf.save_pretrained(path, max_shard_size="40KB" if kind == "qwen3_qknorm" else "50MB")
    write_tokenizer(path)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]           # [T, V]
    return kind, hf, loaded, ref, path


def runner(loaded, page_size=1):
    r = ModelRunner.create(loaded, max_total_tokens=512, page_size=page_size, max_reqs=4, max_context=64)
    # Leave holes: take every page, give back a random half, so sequences get scattered pages.
    taken = [r.allocator.alloc(page_size) for _ in range(512 // page_size)]
    for i in torch.randperm(len(taken))[: len(taken) // 2].tolist():
        r.allocator.free(taken[i])
    return r


def test_arch_parsed(case):
    kind, hf, loaded, _, path = case
    arch = loaded.arch
    assert arch.num_layers == 2 and arch.vocab_size == VOCAB
    expect = {"llama_tied": ["full", "full"], "llama3_rope": ["full", "full"],
              "qwen2_bias_swa": ["full", "swa"], "qwen3_qknorm": ["full", "full"],
              "mistral_swa": ["swa", "swa"]}[kind]
    assert arch.layer_types == expect
    assert arch.attention_bias == (kind == "qwen2_bias_swa")
    assert arch.qk_norm == (kind == "qwen3_qknorm")
    assert arch.tie_word_embeddings == (kind == "llama_tied")
    assert loaded.tokenizer.eos_token_ids == {257} and loaded.tokenizer.bos_token_id == 256
    tok = loaded.tokenizer
    assert tok.encode("hi") == [tok.token_to_id("h"), tok.token_to_id("i")]
    if kind == "qwen3_qknorm":
        assert (path / "model.safetensors.index.json").exists()


def test_prefill_logits_match_hf(case):
    _, _, loaded, ref, _ = case
    r = runner(loaded)
    s = r.new_seq()
    logits = r.extend([s], [PROMPT], return_all_logits=True)  # [T, V]
    assert ref.abs().max() > 1.0                              # not a degenerate model
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_and_decode_match_hf(case, page_size):
    """Seq A: chunks of 8 and 5 tokens, then decode steps; seq B (a 3-token prefix) runs in the
    same batches, so steps mix extend and decode rows."""
    _, _, loaded, ref, _ = case
    r = runner(loaded, page_size)
    a, b = r.new_seq(), r.new_seq()
    got = [r.extend([a, b], [PROMPT[:8], PROMPT[:3]])]
    got.append(r.extend([a, b], [PROMPT[8:13], PROMPT[3:4]]))
    steps = []
    for t in range(13, len(PROMPT)):
        steps.append(r.decode([a, b], [PROMPT[t], PROMPT[4 + t - 13]]))
    torch.testing.assert_close(got[0][0], ref[7], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[0][1], ref[2], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[1][0], ref[12], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[1][1], ref[3], atol=2e-4, rtol=1e-4)
    for i, lg in enumerate(steps):
        torch.testing.assert_close(lg[0], ref[13 + i], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(lg[1], ref[4 + i], atol=2e-4, rtol=1e-4)


def test_sliding_window_override_matches_mistral(tmp_path):
    """load_model(sliding_window=W) on a Llama equals transformers' Mistral (same weights, window W)."""
    llama = make_hf("llama3_rope", seed=1)
    llama.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", sliding_window=4)
    assert loaded.arch.layer_types == ["swa", "swa"] and loaded.arch.sliding_window == 4
    cfg = transformers.MistralConfig(**{**BASE, "sliding_window": 4, "head_dim": 16,
                                        "rope_parameters": llama.config.rope_parameters})
    mistral = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    mistral.load_state_dict(llama.state_dict())
    with torch.no_grad():
        ref = mistral(torch.tensor([PROMPT])).logits[0]
        assert (ref - llama(torch.tensor([PROMPT])).logits[0]).abs().max() > 0.05  # the window matters
    r = runner(loaded)
    s = r.new_seq()
    torch.testing.assert_close(r.extend([s], [PROMPT], return_all_logits=True), ref, atol=2e-4, rtol=1e-4)


# -- the same models written as GGUF files (F32 tensors, llama.cpp names and q/k layout) --------
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_ARCH = {"llama_tied": "llama", "llama3_rope": "llama", "qwen3_qknorm": "qwen3",
             "mistral_swa": "mistral"}


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (the loader must undo it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, kind: str, path) -> None:
    import gguf
    from tokenizers import pre_tokenizers

    cfg, arch = hf.config, GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    if kind == "mistral_swa":
        w.add_sliding_window(cfg.sliding_window)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(VOCAB - 258)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3] + [1] * (VOCAB - 258))
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if kind == "llama3_rope":  # llama.cpp stores llama3 scaling as per-dimension frequency factors
        from tandem.engine.layers import rope_inv_freq

        plain = rope_inv_freq(cfg.head_dim, cfg.rope_parameters["rope_theta"])
        scaled = rope_inv_freq(cfg.head_dim, cfg.rope_parameters["rope_theta"], {**cfg.rope_parameters})
        w.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    for i in range(cfg.num_hidden_layers):
        for hf_name, g_name in _GGUF_NAMES.items():
            t = sd.get(f"model.layers.{i}.{hf_name}")
            if t is None:
                continue
            if arch in ("llama", "mistral") and hf_name.startswith("self_attn.q_proj"):
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif arch in ("llama", "mistral") and hf_name.startswith("self_attn.k_proj"):
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g_name}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", sorted(GGUF_ARCH))
def test_gguf_file_matches_hf(kind, tmp_path):
    hf = make_hf(kind, seed=2)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(hf, kind, path)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.arch.arch == GGUF_ARCH[kind] and loaded.name == kind
    assert loaded.arch.layer_types == (["swa", "swa"] if kind == "mistral_swa" else ["full", "full"])
    assert loaded.tokenizer.eos_token_ids == {257}
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    r = runner(loaded)
    s = r.new_seq()
    got = r.extend([s], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
