"""The call grammars router/tools builds, compiled by engine/grammar.py with SmolLM2's tokenizer,
admit exactly as many calls as the plan allows: one without ``parallel_tool_calls`` (or for a
named function), :data:`MAX_PARALLEL_CALLS` otherwise; past that only EOS may follow."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from tandem.engine.grammar import GrammarCompiler  # noqa: E402
from tandem.router.tools.formats import FORMATS  # noqa: E402
from tandem.router.tools.spec import MAX_PARALLEL_CALLS, parse_openai_tools  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer      # Tokenizer.from_gguf, built by the session's load (tests/conftest.py)


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok)
    yield c
    c.shutdown()


def _accepts(compiler, tok, constraint, text: str) -> bool:
    m = compiler.matcher(constraint)
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("choice, parallel, most", [
    ("required", True, MAX_PARALLEL_CALLS), ("required", False, 1),
    ({"type": "function", "function": {"name": "get_weather"}}, True, 1)])
def test_hermes_grammar_admits_at_most_the_plans_calls(tok, compiler, choice, parallel, most):
    c = FORMATS["hermes"].constraint(parse_openai_tools([WEATHER], choice, parallel))
    assert _accepts(compiler, tok, c, "\n".join([CALL] * most))
    assert not _accepts(compiler, tok, c, "\n".join([CALL] * (most + 1)))
