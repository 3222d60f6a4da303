"""Overlap scheduling: the host plans and builds step N+1 while the device runs step N."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tandem.engine.logprobs import wants_prompt_logprobs
from tandem.engine.sched.sched_types import StepPlan


LANE_SWITCH_S = 0.0005


def resolve_overlap(setting: str, disabled: bool, device: torch.device, hybrid: bool) -> bool:
    """``EngineConfig.overlap_schedule`` ("auto": on for CUDA devices only) unless ``disabled``
    (``--disable-overlap-schedule``); never for hybrid models."""
    if disabled or hybrid or setting == "off":
        return False
    return setting == "on" or device.type == "cuda"


def device_sampleable(plan: StepPlan, device: torch.device) -> bool:
    """Every sampling row of ``plan`` is one the device can pick alone (module docstring), and no
    entry wants its prompt's logprobs (those need every position's logits on the host), and none
    verifies a draft (engine/sched/spec/: it samples every draft position; such a step runs plainly)."""
    if plan.drafts or wants_prompt_logprobs(plan.entries):
        return False
    for e in plan.sampling:
        sr, p = e.sr, e.sr.req.params
        if sr.matcher is not None or p.logprobs:
            return False
        if not p.greedy and (device.type != "cuda" or p.seed is not None):
            return False
        if len(sr.req.output_ids) + sr.ahead - 1 < p.min_tokens:
            return False
    return True


def fill_indices(plan: StepPlan, prev: "Launched | None") -> tuple[list[int], list[int]]:
    """``(dst, src)``: token ``dst[i]`` of ``plan``'s batch is ``prev``'s sampled token ``src[i]``
    (entries whose input token is still in flight)."""
    if prev is None:
        return [], []
    where = {id(e.sr): i for i, e in enumerate(prev.plan.sampling)}
    dst, src, t = [], [], 0
    for e in plan.entries:
        if e.start >= e.sr.req.seq_len:
            dst.append(t + e.n - 1)
            src.append(where[id(e.sr)])
        t += e.n
    return dst, src


def fill_inputs(fb, dst: list[int], src: list[int], tokens: torch.Tensor) -> None:
    """``fb.input_ids[dst[i]] = tokens[src[i]]`` on the batch's device (no host round trip)."""
    device = fb.input_ids.device
    d = torch.tensor(dst, dtype=torch.int64).to(device, non_blocking=True)
    s = torch.tensor(src, dtype=torch.int64).to(device, non_blocking=True)
    fb.input_ids[d] = tokens.to(device)[s]


@dataclass
class Launched:
    """A step on the device lane: ``tokens`` ([S] int64 on the device, ``plan.sampling`` order; on
    the CPU a Future of it), and the host copy being read back."""

    plan: StepPlan
    tokens: torch.Tensor | Future
    _host: torch.Tensor | None = None
    _event: object = None
    _ids: list[int] | None = field(default=None, repr=False)

    def device_tokens(self) -> torch.Tensor:
        """The sampled ids on the device (the CPU lane: waits for the step, on the lane itself)."""
        return self.tokens.result() if isinstance(self.tokens, Future) else self.tokens

    def host_tokens(self) -> list[int]:
        """The sampled ids on the host: waits for the step (the read-back was started at launch)."""
        if self._ids is None:
            if isinstance(self.tokens, Future):
                self._ids = self.tokens.result().tolist()
            else:
                self._event.synchronize()
                self._ids = self._host.tolist()
        return self._ids


class DeviceLane:
    """Runs launched steps (forward + greedy pick) in launch order, off the host's path."""

    def __init__(self, runner, device: torch.device, seed: int = 0):
        self.runner = runner
        self.device = device
        self._gen = torch.Generator().manual_seed(seed)
        self._pool: ThreadPoolExecutor | None = None

    def launch(self, plan: StepPlan, fb, prev: Launched | None) -> Launched:
        """Start ``plan``'s forward (batch ``fb``) and greedy pick; returns at once."""
        dst, src = fill_indices(plan, prev)
        rows = plan.sample_rows
        all_rows = len(rows) == len(plan.entries)
        draw = self._draw_params(plan)
        if self.device.type != "cuda":
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-device")
                _cpu_lane_started()
            return Launched(plan, self._pool.submit(self._run, fb, dst, src, prev, rows, all_rows, draw))
        tokens = self._run(fb, dst, src, prev, rows, all_rows, draw)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Launched(plan, tokens, host, event)

    def _draw_params(self, plan: StepPlan) -> tuple[torch.Tensor, ...] | None:
        """(temperature, top_p, top_k, seed) per sampling row, or None when all are greedy."""
        ps = [e.sr.req.params for e in plan.sampling]
        if all(p.greedy for p in ps):
            return None
        seeds = torch.randint(0, 2 ** 62, (len(ps),), generator=self._gen)
        return (torch.tensor([p.temperature for p in ps], dtype=torch.float32),
                torch.tensor([p.top_p for p in ps], dtype=torch.float32),
                torch.tensor([p.top_k for p in ps], dtype=torch.int32), seeds)

    @torch.inference_mode()
    def _run(self, fb, dst: list[int], src: list[int], prev: Launched | None, rows: list[int],
             all_rows: bool, draw: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        if dst:
            fill_inputs(fb, dst, src, prev.device_tokens())
        logits = self.runner.forward(fb)                              # [B, V]
        if not rows:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        picked = logits if all_rows else logits[rows]
        if draw is not None:
            from tandem.engine.attention.triton_kernels.layer_ops import sample

            return sample(picked.contiguous(), *(t.to(picked.device, non_blocking=True) for t in draw))
        return argmax_rows(picked)

    def close(self) -> None:
        """Stop the CPU lane's thread (a later launch starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            _cpu_lane_stopped()


_lanes = {"running": 0, "switch": 0.0}
_lanes_lock = threading.Lock()


def _cpu_lane_started() -> None:
    with _lanes_lock:
        if _lanes["running"] == 0:
            _lanes["switch"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_lanes["switch"], LANE_SWITCH_S))
        _lanes["running"] += 1


def _cpu_lane_stopped() -> None:
    with _lanes_lock:
        _lanes["running"] -= 1
        if _lanes["running"] == 0:
            sys.setswitchinterval(_lanes["switch"])


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64 argmax (the sampler's ``greedy`` rule), on the logits' device."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype("int64"))
    return logits.argmax(dim=-1)
