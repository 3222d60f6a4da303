"""core/tokenizer.py against Hugging Face transformers' tokenizer built from the same GGUF:
token ids, decoding, the chat template, a tokenizer.json round trip, and incremental detokenizing."""

from __future__ import annotations

import pytest

from tandem.core.detokenizer import IncrementalDetokenizer
from tandem.core.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello world!",
    "  leading spaces\n\n\ttabs   and  runs     ",
    "1234567890 3.14159 1e-9 0x1F 007",
    "héllo ünïcödé 日本語のテキスト 🤖🚀 emoji",
    "def f(x):\n    return x**2  # comment\n\n\nclass A: pass",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>x",
    "I'm you're we'll they've IT'S",
    "\r\n\r\n  \u00a0 nbsp\u3000ideographic",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠",
    "a" * 200,
    "   ",
    "",
    "Mixed123abc456 !!!???...",
    "Привет мир مرحبا بالعالم",
    "    \n  x\n\n\n\n",
]
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "Explain ünïcödé\nin two lines."}]


@pytest.fixture(scope="module")
def tok(smollm2) -> Tokenizer:
    """Tokenizer.from_gguf, as load_model builds it (shares the session's SmolLM2 load)."""
    return smollm2.tokenizer


def test_properties(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    assert tok.chat_template and "im_start" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(tok, hf_smollm2_tokenizer, text):
    hf = hf_smollm2_tokenizer
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_chat_template_matches_hf(tok, hf_smollm2_tokenizer):
    for msgs in (MESSAGES, [{"role": "system", "content": "Be brief."}] + MESSAGES):
        for gen in (True, False):
            want = hf_smollm2_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_hf_dir_round_trip(tok, hf_smollm2_tokenizer, tmp_path):
    """tokenizer.json + tokenizer_config.json / chat_template.jinja as transformers saves them."""
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    t2 = Tokenizer.from_hf_dir(str(tmp_path))
    for text in TEXTS:
        assert t2.encode(text) == tok.encode(text)
    assert t2.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
    assert t2.bos_token_id == 1 and t2.eos_token_ids == {0, 2}


def test_hf_dir_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(str(tmp_path))


def test_chat_template_errors(tok):
    with pytest.raises(TokenizerError, match="messages"):
        tok.apply_chat_template("hi")  # type: ignore[arg-type]
    bad = Tokenizer(tok.backend, name="x", bos_token_id=None, eos_token_ids=set(),
                    chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(TokenizerError, match="no system role"):
        bad.apply_chat_template(MESSAGES)
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tok.backend, name="x", bos_token_id=None, eos_token_ids=set()).apply_chat_template(MESSAGES)


def test_strftime_helper(tok):
    t = Tokenizer(tok.backend, name="x", bos_token_id=None, eos_token_ids=set(),
                  chat_template="{{ strftime_now('%Y') }}|{{ messages | tojson }}")
    out = t.apply_chat_template([{"role": "user", "content": "é<"}])
    year, js = out.split("|", 1)
    assert year.isdigit() and js == '[{"role": "user", "content": "é<"}]'


@pytest.mark.parametrize("text", [TEXTS[3], TEXTS[13], "🤖" * 7 + " ok 日本", TEXTS[4]])
def test_incremental_detokenizer_reassembles(tok, text):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    pieces = [det.add(i) for i in ids]
    assert "".join(pieces) + det.flush() == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_holds_partial_utf8(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # a 4-byte emoji spans several byte-level tokens
    det = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Say: "))
    assert [det.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.add(ids[-1]) == "🤖"


def test_incremental_detokenizer_flushes_incomplete_tail(tok):
    ids = tok.encode("ok 🤖")[:-1]  # cut inside the emoji
    det = IncrementalDetokenizer(tok)
    text = "".join(det.add(i) for i in ids) + det.flush()
    assert text == tok.decode(ids) and text.endswith("\ufffd")
