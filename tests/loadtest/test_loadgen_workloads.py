"""Workload generators: determinism, shape (turns, shared prefixes, context growth), distributions."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tandem.loadtest.loadgen.workloads import (TOOLS, VLLM_MULTITURN_FILE, WORDS, AgentConfig,
                                               Dist, agent_workload, load_vllm_config, vllm_multiturn_workload,
                                               words)

SMALL = AgentConfig(num_sessions=3, turns=4, system_prompt_tokens=50, task_tokens=10,
                    tool_result_tokens=Dist.parse("uniform:5,9"), think_time_s=Dist.parse("0.25"),
                    max_tokens=8, seed=7)


def _replies(n):
    return [f"reply {i}" for i in range(n)]


def test_word_list_is_plain_distinct_words():
    assert len(WORDS) == len(set(WORDS)) > 150
    assert all(w.isalpha() and w.islower() for w in WORDS)
    text = words(random.Random(0), 37)
    assert len(text.split()) == 37 and set(text.split()) <= set(WORDS)


def test_agent_workload_is_deterministic_and_seeded():
    assert agent_workload(SMALL) == agent_workload(SMALL)
    other = agent_workload(replace(SMALL, seed=8))
    assert other.sessions[0].turns != agent_workload(SMALL).sessions[0].turns


def test_agent_workload_shape():
    w = agent_workload(SMALL)
    assert w.num_requests == 12 and len(w.sessions) == 3
    assert all(len(s.turns) == 4 for s in w.sessions)
    assert len({s.system for s in w.sessions}) == 1                      # shared system prompt
    assert all(s.tools == TOOLS for s in w.sessions)                     # the same declared tools
    assert {t["function"]["name"] for t in TOOLS} == {"search_files", "read_file", "run_tests"}
    assert len({s.turns[0].user for s in w.sessions}) == 3               # a task per session
    assert len({s.sid for s in w.sessions}) == 3
    for s in w.sessions:
        assert s.turns[0].think_s == 0 and all(t.think_s == 0.25 for t in s.turns[1:])
        assert all(t.max_tokens == 8 and not t.exact_output for t in s.turns)
        for t in s.turns[1:]:
            assert 5 <= len(t.tool_result.split()) <= 9                   # tool result from the distribution
            assert t.user.startswith("Next: ")
            schema = next(x["function"]["parameters"] for x in TOOLS if x["function"]["name"] == t.tool_name)
            args = json.loads(t.tool_args)
            assert set(schema.get("required", ())) <= set(args) <= set(schema["properties"])


def test_agent_context_grows_by_extending_the_previous_turn():
    s = agent_workload(SMALL).sessions[1]
    replies = _replies(len(s.turns))
    prev = s.messages(0, [])
    assert [m["role"] for m in prev] == ["system", "user"]
    for t in range(1, len(s.turns)):
        cur = s.messages(t, replies)
        # the previous request, its reply calling a tool, the tool's result, then the instruction:
        # a strict prefix extension
        assert cur[:len(prev)] == prev
        call = cur[len(prev)]
        assert (call["role"], call["content"]) == ("assistant", replies[t - 1])
        [tc] = call["tool_calls"]
        assert tc["function"] == {"name": s.turns[t].tool_name, "arguments": s.turns[t].tool_args}
        assert cur[len(prev) + 1] == {"role": "tool", "tool_call_id": tc["id"], "content": s.turns[t].tool_result}
        assert cur[-1] == {"role": "user", "content": s.turns[t].user}
        assert len(cur) == len(prev) + 3
        assert sum(len(m["content"]) for m in cur) > sum(len(m["content"]) for m in prev)
        prev = cur
    with pytest.raises(ValueError, match="needs 2 earlier replies"):
        s.messages(2, replies[:1])


def test_dist_specs():
    rng = random.Random(0)
    assert Dist.parse("64").sample(rng) == 64 and Dist.parse(3).sample(rng) == 3
    u = Dist.parse("uniform:10,12")
    assert {u.sample(rng) for _ in range(200)} == {10, 11, 12}
    e = Dist.parse("exp:2")
    assert 1.6 < sum(e.sample(rng) for _ in range(4000)) / 4000 < 2.4
    ln = Dist.parse("lognormal:100,150")
    xs = [ln.sample(rng) for _ in range(4000)]
    assert max(xs) <= 150 and 80 < sum(xs) / len(xs) < 100               # mean 100 before the cap
    assert Dist.parse("uniform:0.5,1.5").sample(rng) % 1 != 0
    for bad in ("uniform:5", "normal:1,2", "uniform:9,3", "lognormal:x", "-3"):
        with pytest.raises(ValueError, match="bad distribution spec"):
            Dist.parse(bad)


VLLM_MULTITURN_DEFAULT = load_vllm_config()


def test_the_default_vllm_config_is_the_vendored_file(tmp_path):
    assert VLLM_MULTITURN_FILE.is_file()
    assert VLLM_MULTITURN_DEFAULT == json.loads(VLLM_MULTITURN_FILE.read_text())
    assert VLLM_MULTITURN_DEFAULT["num_conversations"] == 24
    bad = tmp_path / "other.json"
    bad.write_text('{"filetype": "something_else"}')
    with pytest.raises(ValueError, match="expected 'generate_conversations'"):
        load_vllm_config(bad)


def test_vllm_multiturn_shape():
    w = vllm_multiturn_workload(VLLM_MULTITURN_DEFAULT, seed=3)
    assert w == vllm_multiturn_workload(VLLM_MULTITURN_DEFAULT, seed=3)
    assert len(w.sessions) == 24
    # num_turns counts messages (12..18, rounded up to even) -> 6..9 requests per conversation
    assert all(6 <= len(s.turns) <= 9 for s in w.sessions)
    firsts = [s.turns[0].user.split() for s in w.sessions]
    common = firsts[0][:500]
    assert all(f[:500] == common for f in firsts)                         # 500-token common prefix
    assert len({" ".join(f[500:520]) for f in firsts}) == 24              # then per-conversation text
    own = [len(f) - 500 - 13 for f in firsts]   # minus "{i} is a nice number." and the instruction text
    assert max(own) <= 5000 + 160 and 800 < sum(own) / len(own) < 1300  # lognormal, average ~1000
    for s in w.sessions:
        assert s.system is None
        assert all(120 <= len(t.user.split()) <= 160 for t in s.turns[1:])
        assert all(80 <= t.max_tokens <= 120 and t.exact_output for t in s.turns)


def test_vllm_multiturn_scale_and_overrides():
    w = vllm_multiturn_workload(VLLM_MULTITURN_DEFAULT, scale=0.1, num_sessions=3, turns=2, max_tokens=5)
    assert len(w.sessions) == 3 and all(len(s.turns) == 2 for s in w.sessions)
    assert [len(s.turns[0].user.split()[:50]) for s in w.sessions] == [50] * 3
    assert w.sessions[0].turns[0].user.split()[:50] == w.sessions[2].turns[0].user.split()[:50]
    assert all(12 <= len(s.turns[1].user.split()) <= 16 for s in w.sessions)
    assert all(t.max_tokens == 5 for s in w.sessions for t in s.turns)
