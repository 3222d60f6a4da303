"""engine/grammar.py with the real SmolLM2 tokenizer: random sampling under the bitmask always
yields output the constraint accepts (60 seeded random JSON schemas checked with ``jsonschema``,
json_object, a regex, a Lark tool-call grammar, a structural tag), matchers rebuilt from their
accepted tokens continue identically (the prefill -> decode hand-off), batches mix constrained and
unconstrained rows, and bad constraints are InvalidRequest."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from tandem.core.types import Constraint, InvalidRequest  # noqa: E402
from tandem.engine.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask  # noqa: E402

MAX_STEPS = 400


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer      # Tokenizer.from_gguf, built by the session's load (tests/conftest.py)


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def closers(tok) -> list[int]:
    """Tokens that end strings, numbers, arrays and objects (plus EOS): the random logits source
    boosts them on a random 40% of steps, so outputs stay short; the other steps are uniform."""
    texts = ['"', '}', ']', ',', '0', '1', 'true', 'null', '"}', '"]', '",', '}]', ']}', '}}', '\n']
    return sorted({i for t in texts for i in tok.encode(t)} | set(tok.eos_token_ids))


def sample(compiler, constraint: Constraint, seed: int, boost: list[int] = (), steps: int = MAX_STEPS):
    """Sample under the constraint from random logits until the grammar terminates; the matcher."""
    m = compiler.matcher(constraint)
    g = torch.Generator().manual_seed(seed)
    bitmask = compiler.allocate_bitmask(1)
    for _ in range(steps):
        logits = torch.rand(1, compiler.vocab_size, generator=g)
        if boost and torch.rand(1, generator=g).item() < 0.4:
            logits[0, boost] += 10.0
        m.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        t = int(torch.multinomial(torch.softmax(logits[0] * 4, -1), 1, generator=g))
        assert m.accept(t), f"a token the mask allowed was refused: {t} ({m.error})"
        if m.is_terminated():
            return m
    raise AssertionError(f"no end after {steps} tokens: {m.accepted[:50]}")


def text_of(tok, m) -> str:
    ids = [t for t in m.accepted if t not in tok.eos_token_ids]
    return tok.decode(ids, skip_special_tokens=False)


# ------------------------------------------------------------------------------ random schemas
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, arrays, enums, consts, bounded numbers, patterns, anyOf, required fields."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
    if depth < 3:
        kinds += ["object", "object", "array", "array", "anyOf"]
    k = rng.choice(kinds)
    if k == "string":
        s: dict = {"type": "string"}
        choice = rng.random()
        if choice < 0.3:
            s["maxLength"] = rng.randint(1, 12)
            s["minLength"] = rng.randint(0, s["maxLength"])
        elif choice < 0.45:
            s["pattern"] = rng.choice([r"^[a-z]{1,8}$", r"^[A-Z][a-z]*-\d{2}$", r"^\d{3}$"])
        return s
    if k == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.5:
            lo = rng.randint(-50, 50)
            s |= {"minimum": lo, "maximum": lo + rng.randint(0, 100)}
        return s
    if k == "number":
        return {"type": "number"} | ({"minimum": 0, "maximum": 1.5} if rng.random() < 0.4 else {})
    if k in ("boolean", "null"):
        return {"type": k}
    if k == "enum":
        pool = ["red", "green", "blue", 1, 2.5, True, None, "a b", "ünï"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if k == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    if k == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.5:
            s["minItems"] = rng.randint(0, 2)
            s["maxItems"] = s["minItems"] + rng.randint(0, 3)
        return s
    if k == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}
    names = rng.sample(["id", "name", "tags", "items", "meta", "score", "ok", "kind", "when", "x"],
                       rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [n for n in names if rng.random() < 0.7]}


@pytest.mark.parametrize("seed", range(20))   # 52 more through the engine: test_constrained_engine.py
def test_random_schema_outputs_validate(tok, compiler, closers, seed):
    rng = random.Random(seed)
    schema = random_schema(rng)
    if rng.random() < 0.7:   # most tests want an object at the top, as response_format does
        schema = {"type": "object", "properties": {"root": schema, "n": {"type": "integer"}},
                  "required": ["root"], "additionalProperties": False}
    jsonschema.Draft202012Validator.check_schema(schema)
    m = sample(compiler, Constraint("json_schema", json.dumps(schema)), seed, closers)
    out = json.loads(text_of(tok, m))
    jsonschema.validate(out, schema)


@pytest.mark.parametrize("seed", range(5))
def test_json_object(tok, compiler, closers, seed):
    out = json.loads(text_of(tok, sample(compiler, Constraint("json_object"), seed, closers)))
    assert isinstance(out, dict)


@pytest.mark.parametrize("seed", range(5))
def test_regex_under_uniform_logits(tok, compiler, seed):
    pattern = r"[a-z]{2,6}-[0-9]{2,3}(\.[a-z]{1,4})?"
    text = text_of(tok, sample(compiler, Constraint("regex", pattern), seed))
    assert re.fullmatch(pattern, text), text


def test_lark_tool_call_grammar(tok, compiler, closers):
    args = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}
    body = {"type": "object", "properties": {"name": {"const": "forecast"}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    lark = ('start: call ("\\n" call)*\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(body)}\n")
    for seed in range(3):
        text = text_of(tok, sample(compiler, Constraint("lark", lark), seed, closers))
        calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
        assert calls and text.startswith("<tool_call>")
        for c in calls:
            jsonschema.validate(json.loads(c), body)


def test_structural_tag_constrains_only_after_the_trigger(tok, compiler):
    spec = json.dumps({"triggers": ["<tool_call>"], "structures": [
        {"begin": '<tool_call>\n{"name": "f", "arguments": ', "end": "}\n</tool_call>",
         "schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}]})
    c = Constraint("structural_tag", spec)
    good = tok.encode('Sure thing. <tool_call>\n{"name": "f", "arguments": {"x": 5}}\n</tool_call>')
    m = compiler.matcher(c)
    assert all(m.accept(t) for t in good)
    bad = tok.encode('Sure thing. <tool_call>\n{"name": "g"')
    m = compiler.matcher(c)
    assert [m.accept(t) for t in bad][-1] is False
    assert m.accepted == bad[:len(m.accepted)]   # a refused token leaves the state as it was


def test_matcher_rebuilt_from_accepted_tokens_continues_identically(tok, compiler, closers):
    """The disaggregated hand-off: prefill samples token 1 under the mask, decode replays it."""
    c = Constraint("json_schema", json.dumps(random_schema(random.Random(3))))
    full = sample(compiler, c, 11, closers)
    for cut in (1, len(full.accepted) // 2):
        rebuilt = compiler.matcher_from(c, full.accepted[:cut])
        original = compiler.matcher_from(c, full.accepted[:cut])   # the same path, step by step
        a, b = compiler.allocate_bitmask(1), compiler.allocate_bitmask(1)
        for t in full.accepted[cut:]:
            rebuilt.fill_bitmask(a, 0)
            original.fill_bitmask(b, 0)
            assert torch.equal(a, b)
            assert rebuilt.accept(t) and original.accept(t)
        assert rebuilt.is_terminated() and rebuilt.accepted == full.accepted
    with pytest.raises(InvalidRequest, match="not allowed"):
        compiler.matcher_from(Constraint("json_object"), tok.encode("hello"))


def test_rollback(tok, compiler):
    m = compiler.matcher(Constraint("json_object"))
    ids = tok.encode('{"a": 1')
    assert all(m.accept(t) for t in ids)
    m.rollback(2)
    assert m.accepted == ids[:-2]
    assert all(m.accept(t) for t in ids[-2:]) and m.accept(tok.encode("}")[0]) and m.is_terminated()
    with pytest.raises(ValueError):
        m.rollback(100)


def test_draft_helpers_change_nothing(tok, compiler):
    """The speculation helpers: ``forced`` (a schema's forced tokens: a draft), ``valid_prefix`` cuts a draft at the first refused token,
    ``fill_along`` gives row j the mask after the draft's first j tokens (each equal to the mask a
    matcher that accepted them computes), ``ends_at`` sees the completing token; none moves the
    matcher."""
    m = compiler.matcher(Constraint("json_object"))
    head = tok.encode('{"a": 1')
    assert all(m.accept(t) for t in head)
    draft = tok.encode(', "b": 2}')
    assert m.valid_prefix(draft + tok.encode("x")) == len(draft)        # nothing after the close
    assert m.valid_prefix(tok.encode("]") + draft) == 0
    bits = compiler.allocate_bitmask(len(draft) + 2)
    m.fill_along(draft, bits, list(range(1, len(draft) + 2)))
    want = compiler.allocate_bitmask(1)
    for j in range(len(draft) + 1):
        compiler.matcher_from(Constraint("json_object"), head + draft[:j]).fill_bitmask(want, 0)
        assert torch.equal(bits[1 + j], want[0]), j
    assert not (bits[0] != -1).any()                                     # row 0 untouched
    assert m.accepted == head
    assert not any(m.ends_at(t) for t in draft[:-1])
    assert all(m.accept(t) for t in draft[:-1]) and m.ends_at(draft[-1]) and not m.is_terminated()
    assert m.accepted == head + draft[:-1]
    named = compiler.matcher(Constraint("json_schema", json.dumps({
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
        "additionalProperties": False})))
    forced = named.forced(32)
    assert tok.decode(list(forced)).startswith('{"name"') and named.forced(1) == forced[:1]
    assert named.accepted == [] and all(named.accept(t) for t in forced)


def test_a_draft_stops_before_an_eos_which_llguidance_would_not_roll_back(tok, compiler):
    """The cause of a refused tool call (test_serve_agent with drafts on, 1P+1D): a draft copied
    from the tenant's pool ran past the grammar's end into an EOS. llguidance consumes an EOS after
    the grammar is complete without recording it, so rolling the draft back undid one token too
    many, and the next accepted token was refused. The first half pins llguidance's behaviour (if
    a release changes it, this says so); the second that a draft never holds an EOS: it is cut
    before one, ``fill_along`` refuses one and ``ends_at`` decides an EOS without consuming it."""
    c = Constraint("lark", 'start: "<tool_call>\\n" "x" "\\n</tool_call>"\n')
    ids = tok.encode("<tool_call>\nx\n</tool_call>")
    eos = sorted(compiler.eos_ids)[0]
    raw = compiler.matcher_from(c, ids[:-3])._m
    assert all(raw.consume_token(t) for t in ids[-3:] + [eos]) and raw.is_stopped()
    assert raw.rollback(4) and raw.validate_tokens(ids[-3:]) == 0           # one token too far back
    m = compiler.matcher_from(c, ids[:-3])
    draft = ids[-3:] + [eos]
    assert m.valid_prefix(draft) == 3 and m.valid_prefix([eos]) == 0
    with pytest.raises(ValueError, match="EOS"):
        m.fill_along(draft, compiler.allocate_bitmask(5), list(range(5)))
    assert m.accepted == ids[:-3] and m.valid_prefix(ids[-3:]) == 3
    bits = compiler.allocate_bitmask(4)
    m.fill_along(ids[-3:], bits, list(range(4)))                            # ends on the stopped state
    assert m.valid_prefix(ids[-3:]) == 3
    assert all(m.accept(t) for t in ids[-3:]) and m.is_terminated()
    assert m.ends_at(eos) and m.accepted == ids                              # decided, not consumed
    early = compiler.matcher_from(c, ids[:-1])
    assert not early.ends_at(eos) and early.accepted == ids[:-1]             # not allowed yet
    assert m.forced(8) == ()

def test_batch_mixes_constrained_and_unconstrained_rows(tok, compiler):
    v = compiler.vocab_size
    logits = torch.randn(3, v)
    before = logits.clone()
    bitmask = compiler.allocate_bitmask(3)
    ms = [compiler.matcher(Constraint("regex", "[0-9]+")), compiler.matcher(Constraint("json_object"))]
    compiler.fill_bitmasks([(ms[0], 0), (ms[1], 2)], bitmask)
    apply_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(logits[1], before[1])                       # unconstrained row untouched
    digits = tok.decode([int(logits[0].argmax())])
    assert digits.isdigit()
    assert tok.decode([int(logits[2].argmax())]).lstrip().startswith("{")
    allowed0 = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert all(tok.decode([t]).isdigit() for t in allowed0)


def test_logits_wider_than_the_tokenizer(tok):
    """A model whose embedding is padded past the vocabulary: padding ids are never allowed."""
    wide = GrammarCompiler(tok, vocab_size=tok.vocab_size + 100)
    try:
        m = wide.matcher(Constraint("json_object"))
        bitmask = wide.allocate_bitmask(1)
        m.fill_bitmask(bitmask, 0)
        logits = torch.zeros(1, tok.vocab_size + 100)
        logits[0, tok.vocab_size:] = 100.0
        apply_bitmask(logits, bitmask, [0])
        assert torch.isinf(logits[0, tok.vocab_size:]).all()
        assert int(logits[0].argmax()) < tok.vocab_size
    finally:
        wide.shutdown()
    narrow = allocate_bitmask(1, 40)          # a mask narrower than the logits forbids the rest
    logits = torch.zeros(1, 100)
    apply_bitmask(logits, narrow, [0])
    assert torch.isinf(logits[0, 64:]).all() and torch.isfinite(logits[0, :64]).all()


def test_compile_is_off_thread_and_cached(tok):
    c = GrammarCompiler(tok)
    try:
        seen = []
        schema = Constraint("json_schema", json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}))
        import tandem.engine.grammar as g

        real = g.grammar_text
        g.grammar_text = lambda con: seen.append(threading.current_thread().name) or real(con)
        try:
            f1 = c.compile(schema)
            f2 = c.compile(schema)          # in flight or cached: the same compile either way
            first = f1.result(10)
            assert f2.result(10) is first
            assert c.compile(schema).result(0) is first
        finally:
            g.grammar_text = real
        assert seen and all(name.startswith("grammar") for name in seen) and len(seen) == 1
        assert c.cache_info() == {"entries": 1, "hits": 2, "misses": 1}
        assert first.compile_s > 0
    finally:
        c.shutdown()


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", '{"type": "nonsense"}'), "does not compile"),
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be an object"),
    (Constraint("json_schema", '{"type": "string", "format": "no-such-format"}'), "does not compile"),
    (Constraint("regex", "(("), "does not compile"),
    (Constraint("lark", "start: undefined_rule"), "does not compile"),
    (Constraint("structural_tag", '{"structures": []}'), "structural_tag spec"),
    (Constraint("structural_tag", json.dumps({"triggers": ["<x>"], "structures": [{"begin": "<y>"}]})),
     "none of the triggers"),
])
def test_bad_constraints_are_invalid_requests(compiler, constraint, message):
    with pytest.raises(InvalidRequest, match=message):
        compiler.compile(constraint).result(10)


def test_non_strict_schema_ignores_unsupported_keywords(compiler):
    spec = '{"type": "string", "format": "no-such-format"}'
    assert compiler.compile_now(Constraint("json_schema", spec, strict=False)).constraint.strict is False


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_front_door_call_grammars_yield_parsable_valid_calls(tok, compiler, closers, fmt, choice):
    """The constraint router/tools builds for tool_choice required / a named function compiles, and
    whatever is sampled under it parses back (with the same format's parser) into calls whose
    arguments validate against the tool's parameter schema."""
    from tandem.router.tools.formats import FORMATS, parse_all
    from tandem.router.tools.spec import parse_openai_tools

    tools = [{"type": "function", "function": {"name": f"tool_{k}", "parameters": random_schema(random.Random(k))
                                               if k else {"type": "object", "properties": {
                                                   "q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}
             for k in range(3)]
    for t in tools:   # tool parameters are objects
        p = t["function"]["parameters"]
        if p.get("type") != "object":
            t["function"]["parameters"] = {"type": "object", "properties": {"v": p}, "required": ["v"]}
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "tool_1"}}
    plan = parse_openai_tools(tools, tc, True)
    constraint = FORMATS[fmt].constraint(plan)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for seed in range(3):
        text = text_of(tok, sample(compiler, constraint, seed, closers))
        content, calls = parse_all(FORMATS[fmt], text)
        assert calls and not content.strip(), text
        if choice == "named":
            assert [c.name for c in calls] == ["tool_1"]
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
