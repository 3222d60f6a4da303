"""cluster/launch.py pieces that need no Ray: decode's engine config, the driver's tokenizer."""

from __future__ import annotations

import json
import os

from tandem.cluster.launch import decode_engine_config, load_tokenizer
from tandem.core.config import CacheConfig, EngineConfig, ServeConfig


def test_decode_workers_get_their_own_kv_pool_size():
    ec = EngineConfig(cache=CacheConfig(page_size=16, max_total_tokens=4096))
    assert decode_engine_config(ServeConfig(engine_config=ec)) == ec
    d = decode_engine_config(ServeConfig(engine_config=ec, decode_max_total_tokens=8192))
    assert d.cache.max_total_tokens == 8192 and d.cache.page_size == 16
    assert d.model_dump(exclude={"cache"}) == ec.model_dump(exclude={"cache"})


def test_driver_tokenizer_matches_the_workers_without_loading_weights(smollm2):
    tok = load_tokenizer("smollm2")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs)
    assert text == smollm2.tokenizer.apply_chat_template(msgs)
    assert tok.encode(text) == smollm2.tokenizer.encode(text)
    assert tok.eos_token_ids == smollm2.tokenizer.eos_token_ids
    assert load_tokenizer("smollm2") is tok                  # built once per process


def test_a_changed_model_directory_gets_a_new_tokenizer(hf_smollm2_tokenizer, tmp_path):
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    first = load_tokenizer(str(tmp_path))
    assert load_tokenizer(str(tmp_path)) is first and first.eos_token_ids == {2}
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [2, 0]}))
    again = load_tokenizer(str(tmp_path))
    assert again is not first and again.eos_token_ids == {0, 2}
    st = os.stat(gen)
    os.utime(gen, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))   # rewritten, same bytes
    assert load_tokenizer(str(tmp_path)) is not again
