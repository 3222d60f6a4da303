"""The chaos run's schedule, a pure function of its seed: who says what, when, and who hangs up."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("river stone light paper garden window silver morning quiet engine market harbor cloud "
         "letter forest bridge number orange winter circle planet doctor music story table "
         "island pocket candle signal rocket tunnel valley yellow wheel shadow summer").split()

SYSTEMS = (
    "You are a helpful assistant. Answer briefly and precisely.",
    "You are a travel agent. Suggest places, prices and times in short sentences.",
    "You are a tutor for children. Explain things simply, one idea at a time.",
)


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int
    abort: str = "none"
    abort_after: int = 0
    early_delay_s: float = 0.0


@dataclass(frozen=True)
class SessionPlan:
    sid: str
    system: str
    turns: tuple[Turn, ...]
    start_s: float


def make_plan(seed: int, sessions: int, turns: int, *, max_tokens: int = 24, p_mid: float = 0.15,
              p_early: float = 0.1, stagger_s: float = 2.0) -> list[SessionPlan]:
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        system = rng.choice(SYSTEMS)
        ts = []
        for _ in range(turns):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
            n = rng.randint(max(1, max_tokens // 3), max_tokens)
            x = rng.random()
            if x < p_early:
                ts.append(Turn(f"Tell me about {user}.", n, "early", 0, rng.uniform(0.0, 0.05)))
            elif x < p_early + p_mid:
                ts.append(Turn(f"Tell me about {user}.", n, "mid", rng.randint(1, max(1, n // 2))))
            else:
                ts.append(Turn(f"Tell me about {user}.", n))
        out.append(SessionPlan(f"chaos-{seed}-{s}", system, tuple(ts), rng.uniform(0.0, stagger_s)))
    return out
