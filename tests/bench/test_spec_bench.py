"""bench/spec.py's measurement on a tiny size: drafts on and off give the same greedy tokens, the
copying prompt's drafts are accepted, and the counters the report reads are there."""

from __future__ import annotations

from tandem.bench import spec


def test_run_once_on_equals_off_and_counts(smollm2, one_torch_thread):
    prompt = [spec.COPYING[2]]                       # the tool result quoted back
    off = spec.run_once(smollm2, "off", prompt, 40, "torch")
    on = spec.run_once(smollm2, "ngram", prompt, 40, "torch")
    assert on["ids"] == off["ids"] and on["tokens"] == off["tokens"] > 0
    assert off["drafted"] == off["verify_steps"] == off["declined_steps"] == 0
    assert on["accepted"] > 0 and on["steps"] < off["steps"]
