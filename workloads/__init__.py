"""Public workload files, vendored unchanged (provenance and licenses: README.md beside this file).

Every default and test that replays a public trace reads it from here, so a clone of the
repository needs nothing beside it. ``FILES`` maps each file to the md5 of the upstream copy;
``tests/workloads/test_vendored_workloads.py`` checks them.
"""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).resolve().parent

MOONCAKE_SYNTHETIC = DIR / "mooncake_synthetic_trace.jsonl"   # Mooncake FAST'25 synthetic trace
AZURE_CONV_2023 = DIR / "azure_llm_2023_conv.csv"              # Azure LLM inference 2023, conversation
VLLM_MULTI_TURN = DIR / "vllm_generate_multi_turn.json"       # vLLM's multi-turn generator config

FILES = {
    MOONCAKE_SYNTHETIC.name: "cf1d3a0f649d43500616e04eb8126260",
    AZURE_CONV_2023.name: "2ec51bd013f310fa72cac08de1331368",
    VLLM_MULTI_TURN.name: "47bb6c01cdd7aa77d42d1236ef06732f",
}
