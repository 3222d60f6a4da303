"""Turns the scheduler's CPU-side plan into a ForwardBatch, in exactly one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class PlanItem:
    row: int
    prefix_len: int
    new_ids: list[int]
    new_slots: torch.Tensor  # [n] int64


def build_forward_batch(items: list[PlanItem], req_to_token_pool, kv_pool,
                        device: torch.device | str = "cpu", state_indices=None,
                        state_pool=None) -> ForwardBatch:
    """The step's ForwardBatch."""
    if not items:
        raise ValueError("empty plan")
    rows, prefix, ext, ids, pos, locs = [], [], [], [], [], []
    for it in items:
        n = len(it.new_ids)
        if n == 0 or len(it.new_slots) != n:
            raise ValueError(f"plan item for row {it.row}: {n} ids but {len(it.new_slots)} slots")
        rows.append(it.row)
        prefix.append(it.prefix_len)
        ext.append(n)
        ids.extend(it.new_ids)
        pos.extend(range(it.prefix_len, it.prefix_len + n))
        locs.append(it.new_slots.to("cpu", torch.int64))
    req_to_token_pool.write_many(rows, prefix, [it.new_slots for it in items])
    seq = [p + e for p, e in zip(prefix, ext)]
    starts = [0]
    for e in ext[:-1]:
        starts.append(starts[-1] + e)
    T, B = len(ids), len(items)
    packed = torch.cat([torch.tensor(ids + pos, dtype=torch.int64), *locs,
                        torch.tensor(rows + seq + prefix + ext + starts, dtype=torch.int64)]).to(device, non_blocking=True)
    tok = packed[:3 * T].view(3, T)
    per = packed[3 * T:].view(5, B)
    return ForwardBatch(
        input_ids=tok[0], positions=tok[1], out_cache_loc=tok[2],
        req_pool_indices=per[0], seq_lens=per[1], prefix_lens=per[2], extend_lens=per[3],
        extend_starts=per[4],
        req_to_token=req_to_token_pool.req_to_token,
        kv_pool=kv_pool,
        seq_lens_cpu=seq,
        prefix_lens_cpu=prefix,
        extend_lens_cpu=ext,
        state_indices=state_indices,
        state_pool=state_pool,
    )
