"""ModelRunner: build a ForwardBatch from (row, prefix_len, new ids, new slots) and run the
model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.batch_builder import PlanItem, build_forward_batch
from tandem.engine.forward_batch import ForwardBatch

SeqPlan = tuple[int, int, list[int], torch.Tensor]


@dataclass
class RunnerSeq:
    """A sequence the runner's convenience API manages: its row and how many tokens hold KV."""
    row: int
    length: int = 0
    last_slot: int = -1


class ModelRunner:
    def __init__(self, loaded, kv_pool, req_to_token_pool, allocator, backend):
        self.loaded = loaded
        self.model = loaded.model
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.backend = backend
        self.device = kv_pool.device
        self.decode_graph = None
        self.verify_graph = None

    def build_forward_batch(self, seqs: list[SeqPlan]) -> ForwardBatch:
        """Write each sequence's new slots into its req_to_token row and build the step's tensors
        (engine/batch_builder.py: the one place that does)."""
        if not seqs:
            raise ValueError("build_forward_batch needs at least one sequence")
        items = [PlanItem(row, prefix_len, list(ids), slots) for row, prefix_len, ids, slots in seqs]
        return build_forward_batch(items, self.req_to_token_pool, self.kv_pool, self.device)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] (float32) at each sequence's last new token (``fb.logit_rows``: [R, V] at
        those), or [T, V]."""
        if fb.logit_rows is not None and self.verify_graph is not None:       # a verify step
            shape = self.verify_graph.shape_for(fb, return_all_logits)
            if shape is not None:
                return self.verify_graph.run(fb, shape)
        elif self.decode_graph is not None:
            size = self.decode_graph.size_for(fb, return_all_logits)
            if size is not None:
                return self.decode_graph.run(fb, size)
        self.backend.init_forward(fb)
        return self.model.forward(fb, self.backend, return_all_logits=return_all_logits)

    def new_seq(self) -> RunnerSeq:
        row = self.req_to_token_pool.alloc()
        if row is None:
            raise RuntimeError("no free req_to_token row")
        return RunnerSeq(row)

    def extend(self, seqs: list[RunnerSeq], new_ids: list[list[int]],
               return_all_logits: bool = False) -> torch.Tensor:
        """Append ``new_ids[i]`` to ``seqs[i]`` (allocating slots) in one step; logits [B, V]."""
        plans: list[SeqPlan] = []
        for s, ids in zip(seqs, new_ids, strict=True):
            slots = self.allocator.alloc_extend(s.last_slot, s.length, len(ids))
            if slots is None:
                raise RuntimeError(f"KV pool full: {len(ids)} slots wanted, "
                                   f"{self.allocator.available_size()} free")
            plans.append((s.row, s.length, list(ids), slots))
        fb = self.build_forward_batch(plans)
        for s, (_, _, ids, slots) in zip(seqs, plans):
            s.length += len(ids)
            s.last_slot = int(slots[-1])
        return self.forward(fb, return_all_logits)

    def prefill(self, ids: list[int], chunk: int | None = None) -> tuple[RunnerSeq, torch.Tensor]:
        """A new sequence holding ``ids`` (in chunks of ``chunk`` tokens); logits [V] of the
        last."""
        s = self.new_seq()
        step = chunk or len(ids)
        for i in range(0, len(ids), step):
            logits = self.extend([s], [ids[i:i + step]])
        return s, logits[0]

    def decode(self, seqs: list[RunnerSeq], token_ids: list[int]) -> torch.Tensor:
        """One decode step: append one token to each sequence; logits [B, V]."""
        return self.extend(seqs, [[t] for t in token_ids])

    def release(self, s: RunnerSeq) -> None:
        """Free the sequence's slots and row."""
        if s.length:
            self.allocator.free(self.req_to_token_pool.read(s.row, 0, s.length))
        self.req_to_token_pool.free(s.row)
        s.length, s.last_slot = 0, -1

    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int,
                        stop_ids: set[int] | None = None) -> list[list[int]]:
        """Greedy tokens for each prompt: one batched prefill step, then batched decode steps."""
        seqs = [self.new_seq() for _ in prompts]
        try:
            logits = self.extend(seqs, prompts)
            outs: list[list[int]] = [[] for _ in prompts]
            live = list(range(len(prompts)))
            nxt = logits.argmax(-1).tolist()
            for step in range(max_new_tokens):
                keep = []
                for j, i in enumerate(live):
                    outs[i].append(nxt[j])
                    if not (stop_ids and nxt[j] in stop_ids):
                        keep.append(j)
                if not keep or step == max_new_tokens - 1:
                    break
                live, toks = [live[j] for j in keep], [nxt[j] for j in keep]
                nxt = self.decode([seqs[i] for i in live], toks).argmax(-1).tolist()
            return outs
        finally:
            for s in seqs:
                self.release(s)

    @classmethod
    def create(cls, loaded, max_total_tokens: int = 4096, page_size: int = 1, max_reqs: int = 16,
               max_context: int | None = None, backend=None) -> "ModelRunner":
        """A runner with freshly built pools sized for ``loaded`` (tests, benchmarks)."""
        from tandem.cache.allocator import PagedAllocator
        from tandem.cache.kv_pool import KVPool
        from tandem.cache.req_to_token import ReqToTokenPool
        from tandem.engine.attention import make_attention_backend

        a = loaded.arch
        pool = KVPool(max_total_tokens, page_size, a.num_layers, a.num_kv_heads, a.head_dim,
                      dtype=loaded.model.dtype, device=loaded.model.device)
        r2t = ReqToTokenPool(max_reqs, max_context or a.max_position, device=loaded.model.device)
        alloc = PagedAllocator(max_total_tokens // page_size, page_size)
        return cls(loaded, pool, r2t, alloc, backend or make_attention_backend("auto", loaded.model.device))
