"""A deterministic stand-in model for scheduler tests: no weights, no attention, milliseconds a step.

``KVEchoModel`` is a test double for the *model* (the scheduler, the KV manager, the cache, the
pools and the sampler are all real). Each step it writes every new token's ``(token id,
position)`` into that token's KV slot (layer 0's K), then, for each sequence, reads every slot of
its row back through ``req_to_token`` and picks the next token as a hash of the tokens it read.
So:

- a slot holding another position (misplaced, stale, or reused after a free) raises at once;
- a wrong token anywhere in the KV changes the next token, so outputs differ from the oracle;
- :func:`oracle` computes the exact greedy continuation of any prompt in pure Python, the
  reference for every schedule (chunked prefill, prefix reuse, retraction, restore, P/D).

Logits are peaked at the hashed token (a second-best one below it) so temperature sampling is
well defined too. Next tokens are ids 0..93 of the byte tokenizer, the printable ASCII characters
``!`` .. ``~`` (its alphabet is sorted), never EOS.
"""

from __future__ import annotations

import torch

from tandem.engine.loader import LoadedModel
from tandem.engine.model_config import ModelArchConfig
from tandem.engine.models.hybrid import byte_tokenizer

VOCAB = 258                 # the byte tokenizer: 0..255 bytes, 256 <s>, 257 </s>
_LO, _N = 0, 94             # next tokens: ids 0..93 = "!".."~" in the byte tokenizer
_P, _M = 1_000_003, 2**61 - 1


def next_token(tokens: list[int]) -> int:
    """The model's greedy choice after ``tokens`` (a polynomial hash of all of them)."""
    h = 0
    for t in tokens:
        h = (h * _P + t + 1) % _M
    return _LO + (h >> 7) % _N


def oracle(prompt: list[int], n: int) -> list[int]:
    """The greedy continuation of ``prompt`` by ``n`` tokens."""
    seq, out = list(prompt), []
    for _ in range(n):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


class KVEchoModel:
    def __init__(self):
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.forwards = 0

    def forward(self, fb, backend, return_all_logits: bool = False) -> torch.Tensor:
        self.forwards += 1
        k = fb.kv_pool.layer(0).k                                  # [rows, 1, 2]
        new = torch.stack([fb.input_ids, fb.positions], dim=-1).to(k.dtype)  # [T, 2]
        k[fb.out_cache_loc, 0] = new
        starts = [0]
        for n in fb.extend_lens_cpu:
            starts.append(starts[-1] + n)
        rows = range(starts[-1]) if return_all_logits else fb.logit_indices.tolist()
        logits = torch.full((len(rows), VOCAB), -10.0)
        for i, t in enumerate(rows):
            b = next(b for b in range(fb.batch_size) if t < starts[b + 1])
            n = fb.prefix_lens_cpu[b] + t - starts[b] + 1          # the tokens up to position t
            slots = fb.req_to_token[int(fb.req_pool_indices[b]), :n].to(torch.int64)
            kv = k[slots, 0].to(torch.int64)                       # [n, 2]: (token, position)
            bad = torch.nonzero(kv[:, 1] != torch.arange(n)).flatten()
            if len(bad):
                p = int(bad[0])
                raise AssertionError(f"row {int(fb.req_pool_indices[b])}: position {p} reads slot "
                                     f"{int(slots[p])}, which holds position {int(kv[p, 1])}")
            nt = next_token(kv[:, 0].tolist())
            logits[i, nt] = 5.0
            logits[i, _LO + (nt - _LO + 1) % _N] = 4.0
        return logits


def fake_loaded(max_position: int = 4096) -> LoadedModel:
    arch = ModelArchConfig(arch="llama", vocab_size=VOCAB, hidden_size=2, num_layers=1,
                           num_q_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=2,
                           max_position=max_position, layer_types=["full"],
                           bos_token_id=256, eos_token_ids=(257,))
    return LoadedModel(KVEchoModel(), arch, byte_tokenizer(), "kv-echo")
