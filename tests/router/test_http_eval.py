"""The evaluation API over a real in-process Engine (a tiny random Llama in float32, CPU): echo with
logprobs in OpenAI's legacy shape, vLLM's prompt_logprobs on completions and chat, /tokenize and
/detokenize, and the 400s for what is not served.

Oracle for the prompt's logprobs: a greedy completion's own logprobs. The prompt ``S + G[:-1]``
(G: the greedy continuation of S) scores each token of G exactly where the generation drew it,
so echo's logprobs of those positions must equal the generation's (the same model, float32)."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("torch")

from tandem.core.config import CacheConfig, EngineConfig, ServeConfig  # noqa: E402
from tandem.router.backend import LocalEngineBackend  # noqa: E402

from test_http_engine import CONTEXT, write_tiny_model  # noqa: E402

SEED = "The cat sat on the mat and"
TOL = 2e-4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tandem.engine.engine import Engine

    path = tmp_path_factory.mktemp("tiny-llama-eval")
    write_tiny_model(path)
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", num_threads=1, context_length=CONTEXT,
                       cache=CacheConfig(page_size=4, max_total_tokens=2 * CONTEXT, max_running_requests=4,
                                         debug_invariants=True))
    e = Engine(cfg)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def url(engine, serve):
    return serve(LocalEngineBackend(engine), ServeConfig(mode="colocated")).url


def _post(url, path, body, status=200) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _complete(url, engine, **body) -> dict:
    body = {"model": engine.model_name, "temperature": 0, "ignore_eos": True, **body}
    return _post(url, "/v1/completions", body)


@pytest.fixture(scope="module")
def greedy(url, engine):
    """S's ids, and its greedy continuation G (8 tokens) with each token's logprob and top 3."""
    from tandem.core.types import SamplingParams

    ids = engine.tokenizer.encode(SEED)
    out = _complete(url, engine, prompt=ids, max_tokens=8, logprobs=3)
    g = engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    assert len(g) == 8 == len(out["choices"][0]["logprobs"]["tokens"])
    return ids, g, out["choices"][0]["logprobs"]


def test_echo_logprobs_score_the_prompt_as_generation_did(url, engine, greedy):
    s, g, gen = greedy
    prompt = s + g[:-1]
    text = engine.tokenizer.decode(prompt)
    out = _complete(url, engine, prompt=prompt, max_tokens=1, logprobs=3, echo=True)
    ch = out["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith(text) and len(ch["text"]) > len(text)   # the prompt, then the token generated
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["tokens"][-1] == gen["tokens"][-1]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    # positions of G: what the generation reported for each of its tokens
    echoed = lp["token_logprobs"][len(s):]
    assert max(abs(a - b) for a, b in zip(echoed, gen["token_logprobs"])) < TOL
    for a, b in zip(lp["top_logprobs"][len(s):], gen["top_logprobs"]):
        assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < TOL
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    # the same request again finds its pages in the prefix cache and still scores every token
    again = _complete(url, engine, prompt=prompt, max_tokens=1, logprobs=3, echo=True)["choices"][0]
    assert again["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    # echo without logprobs: only the text
    plain = _complete(url, engine, prompt=prompt, max_tokens=1, echo=True)["choices"][0]
    assert plain["text"] == ch["text"] and plain["logprobs"] is None
    engine.check_invariants()


def test_echo_streamed_equals_non_streamed(url, engine, greedy):
    s, _, _ = greedy
    body = {"model": engine.model_name, "prompt": SEED, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "echo": True}
    whole = _post(url, "/v1/completions", body)["choices"][0]
    text, tokens, lps, offsets = "", [], [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            text += ch["text"]
            if ch["logprobs"]:
                tokens += ch["logprobs"]["tokens"]
                lps += ch["logprobs"]["token_logprobs"]
                offsets += ch["logprobs"]["text_offset"]
    assert text == whole["text"] and text.startswith(SEED)
    assert len(tokens) == len(s) + 4
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert lps[0] is None and max(abs(a - b) for a, b in zip(lps[1:], whole["logprobs"]["token_logprobs"][1:])) < TOL


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_only(url, engine, greedy, stream):
    """OpenAI's legacy scoring call (echo, max_tokens 0, logprobs; what lm-evaluation-harness 0.3
    sends, as vLLM serves it): the answer is the prompt and its logprobs, the very ones the
    max_tokens 1 call gives, and nothing generated (no text, no completion tokens)."""
    s, g, _ = greedy
    prompt = s + g[:-1]
    body = {"model": engine.model_name, "prompt": prompt, "logprobs": 3, "echo": True, "temperature": 0,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    one = _complete(url, engine, prompt=prompt, max_tokens=1, logprobs=3, echo=True)["choices"][0]["logprobs"]
    if not stream:
        out = _post(url, "/v1/completions", {**body, "max_tokens": 0})
        ch, usage = out["choices"][0], out["usage"]
        text, lp, finish = ch["text"], ch["logprobs"], ch["finish_reason"]
    else:
        text, lp, finish, usage = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None, None
        with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                usage = ev.get("usage") or usage
                for ch in ev["choices"]:
                    text += ch["text"]
                    finish = ch["finish_reason"] or finish
                    for k in lp:
                        lp[k] += (ch["logprobs"] or {}).get(k, [])
    assert text == engine.tokenizer.decode(prompt) and finish == "length"
    assert lp["tokens"] == one["tokens"][:-1] and lp["text_offset"] == one["text_offset"][:-1]
    assert lp["token_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], one["token_logprobs"][1:-1])) < TOL
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 0
    assert usage["total_tokens"] == len(prompt)
    chat = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    assert _post(url, "/v1/chat/completions", chat, status=400)["error"]["param"] == "max_tokens"
    engine.check_invariants()


BATCH = [SEED, "A quick brown fox", "Once upon a time there"]


def _stream_choices(url, body) -> dict[int, dict]:
    """A streamed completion's choices, each joined: {index: {text, finish_reason, tokens, token_logprobs}}."""
    out: dict[int, dict] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                o = out.setdefault(ch["index"], {"text": "", "finish_reason": None, "tokens": [], "token_logprobs": []})
                o["text"] += ch["text"]
                o["finish_reason"] = ch["finish_reason"] or o["finish_reason"]
                for k in ("tokens", "token_logprobs"):
                    o[k] += (ch["logprobs"] or {}).get(k, [])
    return out


def test_a_batch_of_prompts_answers_each_as_its_own_request_would(url, engine):
    """A batch (what lm-evaluation-harness sends with batch_size > 1): choice k is prompt k's,
    equal to that prompt sent alone (greedy, float32), streamed or not; usage adds the prompts up."""
    alone = [_complete(url, engine, prompt=p, max_tokens=4, logprobs=2)["choices"][0] for p in BATCH]
    out = _complete(url, engine, prompt=BATCH, max_tokens=4, logprobs=2)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for got, want in zip(out["choices"], alone):
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"])) < TOL
    ids = [engine.tokenizer.encode(p) for p in BATCH]
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids)) and out["usage"]["completion_tokens"] == 12
    streamed = _stream_choices(url, {"model": engine.model_name, "prompt": BATCH, "max_tokens": 4, "temperature": 0,
                                     "ignore_eos": True})
    assert [streamed[k]["text"] for k in range(3)] == [c["text"] for c in alone]
    # token ids, n = 2: choice k * n + j is prompt k's j-th sample (both greedy here)
    two = _complete(url, engine, prompt=ids[:2], max_tokens=4, n=2)["choices"]
    assert [c["index"] for c in two] == [0, 1, 2, 3]
    assert [c["text"] for c in two] == [alone[0]["text"]] * 2 + [alone[1]["text"]] * 2
    engine.check_invariants()


def test_a_batch_of_scoring_calls_scores_each_prompt(url, engine):
    """lm-evaluation-harness 0.3's loglikelihood batch: echo, max_tokens 0, logprobs, several prompts."""
    out = _complete(url, engine, prompt=BATCH, max_tokens=0, echo=True, logprobs=1)
    for k, (p, ch) in enumerate(zip(BATCH, out["choices"])):
        one = _complete(url, engine, prompt=p, max_tokens=0, echo=True, logprobs=1)["choices"][0]
        assert ch["index"] == k and ch["text"] == p == one["text"]
        assert ch["logprobs"]["tokens"] == one["logprobs"]["tokens"] and ch["logprobs"]["token_logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(ch["logprobs"]["token_logprobs"][1:],
                                              one["logprobs"]["token_logprobs"][1:])) < TOL
    assert out["usage"]["completion_tokens"] == 0
    streamed = _stream_choices(url, {"model": engine.model_name, "prompt": BATCH, "max_tokens": 0, "echo": True,
                                     "logprobs": 1})
    assert [streamed[k]["text"] for k in range(3)] == BATCH
    assert [streamed[k]["tokens"] for k in range(3)] == [c["logprobs"]["tokens"] for c in out["choices"]]


def test_vllm_prompt_logprobs_on_completions_and_chat(url, engine, greedy):
    s, g, gen = greedy
    prompt = s + g[:-1]
    out = _complete(url, engine, prompt=prompt, max_tokens=1, prompt_logprobs=2)["choices"][0]
    plp = out["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None and out["logprobs"] is None
    for pos, entry in enumerate(plp[1:], start=1):
        tok = entry[str(prompt[pos])]
        assert tok["rank"] >= 1 and tok["logprob"] <= 0
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(prompt[pos]))
        assert ranks == [r for r in (1, 2) if r != tok["rank"]]   # the top 2, the prompt token's once
    for pos, want in zip(range(len(s), len(prompt)), gen["token_logprobs"]):
        tok = plp[pos][str(prompt[pos])]
        assert tok["rank"] == 1 and abs(tok["logprob"] - want) < TOL   # G's tokens were greedy picks
    # chat: at the top of the response, one entry per prompt token
    msgs = [{"role": "user", "content": "hello there"}]
    chat = _post(url, "/v1/chat/completions", {"model": engine.model_name, "messages": msgs, "max_tokens": 2,
                                               "temperature": 0, "prompt_logprobs": 0})
    n = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == n and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])      # the prompt token alone
    plain = _post(url, "/v1/chat/completions", {"model": engine.model_name, "messages": msgs, "max_tokens": 2,
                                                "temperature": 0})
    assert "prompt_logprobs" not in plain and plain["choices"][0]["message"] == chat["choices"][0]["message"]


@pytest.mark.parametrize("body,param", [
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "n": 2}, "echo"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "n": 2}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),                       # 0 only scores a prompt: it needs echo
    ({"max_tokens": 0, "echo": True, "n": 2}, "echo"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
])
def test_refusals(url, engine, body, param):
    out = _post(url, "/v1/completions", {"model": engine.model_name, "prompt": "hi", **body}, status=400)
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"


def test_tokenize_and_detokenize(url, engine):
    tok = engine.tokenizer
    out = _post(url, "/tokenize", {"model": engine.model_name, "prompt": SEED, "return_token_strs": True})
    assert out["tokens"] == tok.encode(SEED, add_special_tokens=True)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == CONTEXT
    assert "".join(out["token_strs"]) == SEED
    assert _post(url, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": SEED}
    msgs = [{"role": "user", "content": "hello"}]
    counted = _post(url, "/tokenize", {"messages": msgs})
    chat = _post(url, "/v1/chat/completions", {"model": engine.model_name, "messages": msgs, "max_tokens": 1})
    assert counted["count"] == chat["usage"]["prompt_tokens"]
    assert _post(url, "/detokenize", {"tokens": counted["tokens"]})["prompt"].endswith("<|im_start|>assistant\n")
    assert _post(url, "/tokenize", {"prompt": "a", "messages": msgs}, status=400)["error"]["message"]
    assert _post(url, "/detokenize", {"tokens": [tok.vocab_size]}, status=400)["error"]["param"] == "tokens"
    assert _post(url, "/tokenize", {"model": "other", "prompt": "a"}, status=404)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_without_prompt_logprobs_is_an_error_not_a_short_list(live, stream):
    """The scripted backend (a test double) computes no prompt logprobs: echo with logprobs must
    fail loudly rather than answer lists that stop after the first prompt token."""
    body = {"model": "scripted-model", "prompt": "hello", "max_tokens": 2, "logprobs": 1, "echo": True,
            "stream": stream}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
    if not stream:
        assert r.status_code == 500 and "0 prompt logprobs for a 5-token prompt" in r.json()["error"]["message"]
        return
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "0 prompt logprobs for a 5-token prompt" in events[0]["error"]["message"]
    assert all("choices" not in e for e in events)
