"""Synthetic workloads: what ``tandem bench`` sends, planned up front from a seed."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from tandem.workloads import VLLM_MULTI_TURN

# One token each (checked against SmolLM2's tokenizer: 1,000 sampled words -> 1,000 tokens).
WORDS: tuple[str, ...] = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but have an
they you were her she there been one all we their has would when if so no will can more who them some
its out about into than then up time other what only new could these two may first any like now my
such make over our even most made after also did many before must through back years where much your
way well down should because each just those people how too little state good very world still own see
men work long get here between both life being under never day same another know while last might
great old year off come since against go came right used take three small large plan file data tool
step check list table value query index result error cache block page model server client request
token batch queue worker node route stream write read parse build test run""".split())

# Tool schemas every agent session shares, declared in the request's ``tools`` (as an agent does;
# the server renders them into the prompt, so they are part of the shared prefix).
TOOL_SCHEMAS: tuple[dict, ...] = (
    {"name": "search_files", "description": "Search the repository for a pattern.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                     "path": {"type": "string"}},
                    "required": ["pattern"]}},
    {"name": "read_file", "description": "Read a file, optionally a line range.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                     "start": {"type": "integer"},
                                                     "end": {"type": "integer"}},
                    "required": ["path"]}},
    {"name": "run_tests", "description": "Run the test suite and report failures.",
     "parameters": {"type": "object", "properties": {"selector": {"type": "string"}}}},
)


TOOLS: tuple[dict, ...] = tuple({"type": "function", "function": t} for t in TOOL_SCHEMAS)


def tool_arguments(rng: random.Random, name: str) -> dict:
    """Plausible arguments for one of TOOL_SCHEMAS' tools (each required field filled)."""
    w = rng.choice(WORDS)
    if name == "search_files":
        return {"pattern": w, "path": "src"}
    if name == "read_file":
        start = rng.randint(1, 400)
        return {"path": f"src/{w}.py", "start": start, "end": start + rng.randint(10, 80)}
    return {"selector": f"tests/test_{w}.py"}


def words(rng: random.Random, n: int) -> str:
    """``n`` words from :data:`WORDS` (about ``n`` tokens), space-separated."""
    return " ".join(rng.choice(WORDS) for _ in range(max(0, n)))


# ------------------------------------------------------------------------------ distributions
@dataclass(frozen=True)
class Dist:
    """A distribution given on the command line. Spec forms:

    ``64`` constant; ``uniform:A,B`` (integers when both are); ``lognormal:MEAN[,MAX]`` with the
    given mean and median = 0.85 * mean (vLLM's multi-turn default), capped at MAX;
    ``exp:MEAN`` exponential (think times).
    """

    kind: str
    a: float
    b: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "a", float(self.a))
        if self.b is not None:
            object.__setattr__(self, "b", float(self.b))

    @classmethod
    def parse(cls, spec: str | float | int) -> "Dist":
        kind, _, rest = str(spec).strip().partition(":")
        if not rest:
            kind, rest = "const", kind
        try:
            args = [float(x) for x in rest.split(",")]
        except ValueError:
            raise ValueError(f"bad distribution spec {spec!r}: numbers expected "
                             f"(forms: 64, uniform:A,B, lognormal:MEAN[,MAX], exp:MEAN)") from None
        arity = {"const": (1, 1), "uniform": (2, 2), "lognormal": (1, 2), "exp": (1, 1)}.get(kind)
        if arity is None or not arity[0] <= len(args) <= arity[1]:
            raise ValueError(f"bad distribution spec {spec!r} (forms: 64, uniform:A,B, "
                             f"lognormal:MEAN[,MAX], exp:MEAN)")
        if any(x < 0 for x in args) or (kind == "uniform" and args[0] > args[1]):
            raise ValueError(f"bad distribution spec {spec!r}: values must be >= 0 and A <= B")
        return cls(kind, args[0], args[1] if len(args) > 1 else None)

    @property
    def mean(self) -> float:
        return (self.a + self._hi) / 2 if self.kind == "uniform" else self.a

    @property
    def _hi(self) -> float:
        """``b``: uniform's upper bound (parse() always gives it one); ``a`` when unset."""
        return self.a if self.b is None else self.b

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "uniform":
            if self.a.is_integer() and self._hi.is_integer():
                return float(rng.randint(int(self.a), int(self._hi)))
            return rng.uniform(self.a, self._hi)
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        # lognormal: median = 0.85 * mean -> sigma^2 = 2 ln(mean / median), mu = ln(median)
        if self.a <= 0:
            return 0.0
        median = 0.85 * self.a
        x = rng.lognormvariate(math.log(median), math.sqrt(2 * math.log(1 / 0.85)))
        return min(x, self.b) if self.b is not None else x

    def tokens(self, rng: random.Random, scale: float = 1.0, lo: int = 1) -> int:
        """One draw as a token count: scaled, rounded, at least ``lo``."""
        return max(lo, round(self.sample(rng) * scale))


# ------------------------------------------------------------------------------ workload types
@dataclass(frozen=True)
class Turn:
    """One request of a session: what is appended after the previous reply, then sent.

    With ``tool_name`` (agent turns after the first) the previous reply is replayed as an assistant
    message that called ``tool_name(tool_args)``, followed by the ``tool`` message with
    ``tool_result``; then ``user`` (when not empty) as a user message.
    """

    user: str
    max_tokens: int
    exact_output: bool = False
    think_s: float = 0.0
    tool_name: str = ""
    tool_args: str = ""
    tool_result: str = ""


@dataclass(frozen=True)
class Session:
    sid: str
    system: str | None
    turns: tuple[Turn, ...]
    tools: tuple[dict, ...] = ()

    def messages(self, turn: int, replies: list[str]) -> list[dict]:
        """Chat messages of request ``turn``: the system prompt, turn 0's user text, then for each
        later turn up to ``turn`` the previous reply (``replies[i]`` is the server's answer to
        turn i; with the turn's tool call when it has one), the tool result, the user text."""
        if len(replies) < turn:
            raise ValueError(f"turn {turn} of {self.sid} needs {turn} earlier replies, got {len(replies)}")
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        out.append({"role": "user", "content": self.turns[0].user})
        for i in range(1, turn + 1):
            t = self.turns[i]
            reply: dict = {"role": "assistant", "content": replies[i - 1]}
            if t.tool_name:
                call_id = f"call_{self.sid}_{i}"
                reply["tool_calls"] = [{"id": call_id, "type": "function",
                                        "function": {"name": t.tool_name, "arguments": t.tool_args}}]
                out += [reply, {"role": "tool", "tool_call_id": call_id, "content": t.tool_result}]
            else:
                out.append(reply)
            if t.user:
                out.append({"role": "user", "content": t.user})
        return out


@dataclass(frozen=True)
class TimedRequest:
    """An open-loop request (trace replay): sent at ``arrival_s`` after the start to /v1/completions."""

    index: int
    arrival_s: float
    prompt: str | tuple[int, ...]
    max_tokens: int
    exact_output: bool = True


@dataclass
class Workload:
    name: str
    sessions: list[Session] = field(default_factory=list)
    requests: list[TimedRequest] = field(default_factory=list)
    notes: str = ""

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions) + len(self.requests)


def cap_tokens(n: int, max_tokens: int | None) -> int:
    """An output length: ``n`` capped at ``max_tokens`` (if given), at least 1."""
    return max(1, min(n, max_tokens)) if max_tokens is not None else max(1, n)


# ------------------------------------------------------------------------------ agent
@dataclass(frozen=True)
class AgentConfig:
    """An agent loop. Defaults fit a 2-core CPU running SmolLM2; GPU runs raise them with flags."""

    num_sessions: int = 4
    turns: int = 3
    system_prompt_tokens: int = 200
    task_tokens: int = 40
    instruction_tokens: int = 12
    tool_result_tokens: Dist = Dist("uniform", 32, 96)
    think_time_s: Dist = Dist("const", 0.2)
    max_tokens: int = 32
    seed: int = 0


def agent_workload(cfg: AgentConfig) -> Workload:
    """``cfg.num_sessions`` sessions of ``cfg.turns`` turns. All sessions share the system prompt
    and declare the same tools (TOOLS); each has its own task. Turn 0 sends the task; turn t > 0
    replays the previous reply as an assistant tool call (a tool and arguments drawn from the
    seed), the tool's result (length drawn from ``tool_result_tokens``) and a short instruction,
    after a think time: what an agent loop sends."""
    if cfg.num_sessions < 1 or cfg.turns < 1:
        raise ValueError(f"agent workload needs at least 1 session and 1 turn, got "
                         f"{cfg.num_sessions} sessions x {cfg.turns} turns")
    shared = random.Random(f"agent/{cfg.seed}/system")
    system = ("You are a coding agent. Think step by step and call one tool per turn. "
              + words(shared, cfg.system_prompt_tokens))
    sessions = []
    for i in range(cfg.num_sessions):
        rng = random.Random(f"agent/{cfg.seed}/session/{i}")
        turns = [Turn(f"Task {i}: " + words(rng, cfg.task_tokens), cfg.max_tokens)]
        for t in range(1, cfg.turns):
            tool = TOOL_SCHEMAS[rng.randrange(len(TOOL_SCHEMAS))]["name"]
            args = json.dumps(tool_arguments(rng, tool))
            result = words(rng, cfg.tool_result_tokens.tokens(rng))
            instruction = words(rng, cfg.instruction_tokens)
            turns.append(Turn(f"Next: {instruction}" if instruction else "", cfg.max_tokens,
                              think_s=cfg.think_time_s.sample(rng), tool_name=tool, tool_args=args,
                              tool_result=result))
        sessions.append(Session(f"agent-{cfg.seed}-{i:04d}", system, tuple(turns), TOOLS))
    return Workload("agent", sessions=sessions,
                    notes=f"{cfg.num_sessions} sessions x {cfg.turns} turns, shared system prompt "
                          f"~{cfg.system_prompt_tokens} tokens + {len(TOOLS)} declared tools, tool calls "
                          f"and results replayed")


# ------------------------------------------------------------------------------ vLLM multi-turn
# vLLM's benchmarks/multi_turn/generate_multi_turn.json, vendored unchanged (workloads/README.md).
VLLM_MULTITURN_FILE = VLLM_MULTI_TURN


def _vllm_dist(conf: dict) -> Dist:
    """One of vLLM's distribution objects as a :class:`Dist` (constant, uniform, lognormal by average)."""
    kind = conf.get("distribution")
    if kind == "constant":
        return Dist("const", float(conf["value"]))
    if kind == "uniform":
        return Dist("uniform", float(conf["min"]), float(conf["max"]))
    if kind == "lognormal" and "average" in conf:
        if conf.get("median_ratio", 0.85) != 0.85:
            raise ValueError("only the default lognormal median_ratio 0.85 is supported")
        return Dist("lognormal", float(conf["average"]), conf.get("max"))
    raise ValueError(f"unsupported vLLM distribution {conf!r} (constant, uniform, lognormal with average)")


def load_vllm_config(path: str | Path | None = None) -> dict:
    """The generator config at ``path``, by default the vendored copy of vLLM's."""
    p = Path(path) if path else VLLM_MULTITURN_FILE
    conf = json.loads(p.read_text())
    if conf.get("filetype") != "generate_conversations":
        raise ValueError(f"{p}: filetype {conf.get('filetype')!r}, expected 'generate_conversations'")
    return conf


def vllm_multiturn_workload(conf: dict, *, scale: float = 1.0, seed: int = 0,
                            num_sessions: int | None = None, turns: int | None = None,
                            max_tokens: int | None = None, think_time_s: Dist = Dist("const", 0.0)) -> Workload:
    """vLLM's synthetic multi-turn conversations, token counts multiplied by ``scale``.

    As in vLLM's generator, ``num_turns`` counts messages (user and assistant), rounded up to an
    even number: 12-18 "turns" are 6-9 requests. The first user message holds a prefix common to
    all conversations, then the conversation's own prefix (lognormal, rescaled so the sample mean
    is the configured average, then capped), then the question; every later user message has
    ``num_tokens`` input tokens, and every reply is asked for exactly its sampled output length.
    ``turns`` (if given) overrides the number of requests per conversation.
    """
    pin, pout = conf["prompt_input"], conf["prompt_output"]
    n = num_sessions or int(conf["num_conversations"])
    rng = random.Random(f"vllm-multiturn/{seed}")
    d_turns, d_in, d_out = _vllm_dist(pin["num_turns"]), _vllm_dist(pin["num_tokens"]), _vllm_dist(pout["num_tokens"])
    d_prefix = _vllm_dist(pin["prefix_num_tokens"])
    common_n = round(_vllm_dist(pin.get("common_prefix_num_tokens", {"distribution": "constant", "value": 0}))
                     .sample(rng) * scale)
    common = words(rng, common_n)
    if d_prefix.kind == "lognormal":
        raw = [Dist("lognormal", d_prefix.a).sample(rng) for _ in range(n)]
        k = d_prefix.a * n / sum(raw)
        raw = [min(x * k, d_prefix.b if d_prefix.b is not None else math.inf) for x in raw]
    else:
        raw = [d_prefix.sample(rng) for _ in range(n)]
    sessions = []
    for i in range(n):
        crng = random.Random(f"vllm-multiturn/{seed}/conv/{i}")
        msgs = int(d_turns.sample(crng))
        msgs = max(2, msgs + msgs % 2)
        n_req = turns or msgs // 2
        own = words(crng, round(raw[i] * scale))
        out = []
        for t in range(n_req):
            body = words(crng, max(1, round(d_in.sample(crng) * scale)))
            user = (f"{common} {i} is a nice number. {own} Please rewrite the following text and add "
                    f"more content: {body}" if t == 0 else body)
            out_n = cap_tokens(round(d_out.sample(crng) * scale), max_tokens)
            out.append(Turn(user.strip(), out_n, exact_output=True,
                            think_s=think_time_s.sample(crng) if t else 0.0))
        sessions.append(Session(f"vllm-{seed}-{i:04d}", None, tuple(out)))
    return Workload("vllm-multiturn", sessions=sessions,
                    notes=f"{n} conversations, common prefix ~{common_n} tokens, scale {scale}")
