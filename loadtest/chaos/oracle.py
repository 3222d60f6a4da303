"""The oracle: every completed chaos request again, alone, on a fresh engine."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from tandem.loadtest.chaos.client import Outcome


@dataclass
class Mismatch:
    sid: str
    turn: int
    at: int
    got: str
    want: str


def first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Oracle:
    def __init__(self, model: str = "smollm2", dtype: str = "float32", threads: int | None = None,
                 loaded=None):
        """``loaded``: an already loaded model of ``model`` (tests share one)."""
        from tandem.core.config import CacheConfig, EngineConfig, ServeConfig
        from tandem.engine.engine import Engine
        from tandem.router.backend import LocalEngineBackend
        from tandem.router.http import create_app

        self.engine = Engine(EngineConfig(model=model, dtype=dtype, device="cpu", num_threads=threads,
                                          cache=CacheConfig(disable_prefix_cache=True)), loaded=loaded)
        self.backend = LocalEngineBackend(self.engine)
        self.app = create_app(self.backend, ServeConfig())
        self._memo: dict[str, str] = {}

    async def text(self, o: Outcome) -> str:
        import json

        body = o.body(stream=False) | {"model": self.engine.model_name}
        key = json.dumps(body, sort_keys=True)
        if key not in self._memo:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                         base_url="http://oracle") as http:
                r = await http.post("/v1/chat/completions", json=body, timeout=600)
            r.raise_for_status()
            self._memo[key] = r.json()["choices"][0]["message"]["content"] or ""
        return self._memo[key]

    async def check(self, outcomes: list[Outcome], progress=None) -> list[Mismatch]:
        bad = []
        done = [o for o in outcomes if o.kind == "completed"]
        for i, o in enumerate(done):
            want = await self.text(o)
            if o.text != want:
                k = first_diff(o.text, want)
                bad.append(Mismatch(o.sid, o.turn, k, o.text[max(0, k - 20):k + 40],
                                    want[max(0, k - 20):k + 40]))
            if progress is not None:
                progress(i + 1, len(done))
        return bad

    def close(self) -> None:
        self.engine.shutdown()
