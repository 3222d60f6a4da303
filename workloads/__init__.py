"""Public workload files, vendored unchanged; ``FILES``: each one's upstream md5 (README.md)."""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).resolve().parent

MOONCAKE_SYNTHETIC = DIR / "mooncake_synthetic_trace.jsonl"
AZURE_CONV_2023 = DIR / "azure_llm_2023_conv.csv"
VLLM_MULTI_TURN = DIR / "vllm_generate_multi_turn.json"

FILES = {
    MOONCAKE_SYNTHETIC.name: "cf1d3a0f649d43500616e04eb8126260",
    AZURE_CONV_2023.name: "2ec51bd013f310fa72cac08de1331368",
    VLLM_MULTI_TURN.name: "47bb6c01cdd7aa77d42d1236ef06732f",
}
