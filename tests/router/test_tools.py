"""router/tools/: validation messages, prompt rendering (template with tools and the fallback), the
three output parsers streamed at every split point and whole, and the call grammars' shape."""

from __future__ import annotations

import json

import pytest

from tandem.router.openai_protocol import APIError
from tandem.router.tools.formats import FORMATS, choose_format, parse_all
from tandem.router.tools.render import fallback_messages, render_prompt, template_supports_tools
from tandem.router.tools.spec import Tool, parse_openai_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


# ------------------------------------------------------------------------------ spec
def test_plan_defaults_and_choices():
    plan = parse_openai_tools([WEATHER, TIME], None, None)
    assert (plan.choice, plan.function, plan.parallel, plan.active, plan.forced) == ("auto", None, True, True, False)
    assert [t.name for t in plan.tools] == ["get_weather", "get_time"]
    assert parse_openai_tools([WEATHER], "none", None).active is False
    req = parse_openai_tools([WEATHER, TIME], "required", False)
    assert req.forced and not req.parallel
    named = parse_openai_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert (named.choice, named.function) == ("function", "get_time")
    assert [t.name for t in named.callable_tools()] == ["get_time"]
    assert parse_openai_tools(None, None, None) is None


@pytest.mark.parametrize("tools, choice, message, param", [
    ([{"type": "function", "function": {"description": "x"}}], None, "tools[0].function.name is required",
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": ""}}], None, "needs a name", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "must be 1-128 characters", None),
    ([{"type": "function"}], None, "tools[0].function is required", "tools[0].function"),
    ([{"type": "retrieval"}], None, "must be", "tools[0]"),
    ([WEATHER, WEATHER], None, "more than once", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], None,
     "tools[0].function.parameters is not a valid JSON Schema", "tools[0].function.parameters"),
    ([WEATHER], {"type": "function", "function": {"name": "launch_rockets"}},
     "names function 'launch_rockets', which is not among the declared tools ('get_weather')",
     "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice must be", "tool_choice"),
    (None, "required", "needs tools", "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice must be", "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, message, param):
    with pytest.raises(APIError) as e:
        parse_openai_tools(tools, choice, None)
    assert e.value.status == 400 and message in e.value.message
    if param:
        assert e.value.param == param


# ------------------------------------------------------------------------------ parsers
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = {
    "hermes": [
        (CALL, "", [("get_weather", {"city": "Paris"})]),
        ("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), "Let me check.",   # no whitespace beside calls
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
        ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
        ('<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),   # unclosed at the end
        ("a <tool_c", "a <tool_c", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}', "",
         [("get_time", {}), ("get_time", {})]),
        ("The weather is nice.", "The weather is nice.", []),
        ('{"broken": ', '{"broken": ', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
         [("get_weather", {"city": "Paris"})]),
        ('Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
         "Sure.", [("get_time", {}), ("get_time", {})]),
        ('[{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),   # the special token was stripped
        ("[1] is a citation.", "[1] is a citation.", []),
        ("Plain answer.", "Plain answer.", []),
    ],
}


@pytest.mark.parametrize("fmt, case", [(f, i) for f, cases in CASES.items() for i in range(len(cases))])
def test_parsers_whole_and_streamed_at_every_split(fmt, case):
    text, content, calls = CASES[fmt][case]
    f = FORMATS[fmt]
    got_content, got_calls = parse_all(f, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    for cut in range(len(text) + 1):       # the same result however the text arrives
        p = f.parser()
        events = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
        assert "".join(e.text for e in events) == content, cut
        assert [(e.call.name, json.loads(e.call.arguments)) for e in events if e.call] == calls, cut
    p = f.parser()                          # one character at a time
    events = [e for ch in text for e in p.feed(ch)] + p.finish()
    assert "".join(e.text for e in events) == content


def test_streamed_text_is_not_held_longer_than_needed():
    p = FORMATS["hermes"].parser()
    assert [e.text for e in p.feed("Hello <tool")] == ["Hello"]          # trailing whitespace waits for
    assert [e.text for e in p.feed("bar> there")] == [" <toolbar> there"]   # what follows it


def test_choose_format():
    assert choose_format("auto", None).name == "hermes"
    assert choose_format("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert choose_format("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert choose_format("auto", "{{ '<tool_call>' }}").name == "hermes"
    assert choose_format("mistral", "{{ '<tool_call>' }}").name == "mistral"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_call_grammars(fmt):
    plan = parse_openai_tools([WEATHER, TIME], "required", True)
    c = FORMATS[fmt].constraint(plan)
    assert c.kind == "lark" and "get_weather" in c.spec and "get_time" in c.spec
    one = FORMATS[fmt].constraint(parse_openai_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True))
    assert "get_time" in one.spec and "get_weather" not in one.spec


# ------------------------------------------------------------------------------ rendering
class Tok:
    """Renders messages as ``<role>content`` lines; ``chat_template`` decides tool support."""

    def __init__(self, template):
        self.chat_template = template
        self.kwargs = None

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.kwargs = kwargs
        self.messages = messages
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages)


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [("call_1", "get_weather", '{"city": "Paris"}'),
                                                        ("call_2", "get_weather", '{"city": "Oslo"}')]},
    {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "9C", "tool_call_id": "call_2"},
]


def test_fallback_prompt_hermes():
    plan = parse_openai_tools([WEATHER], None, None)
    tok = Tok("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools(tok)
    text = render_prompt(tok, HISTORY, plan, FORMATS["hermes"])
    roles = [m["role"] for m in tok.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert tok.messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in tok.messages[0]["content"] and "<tools>" in text
    assert tok.messages[2]["content"].count("<tool_call>") == 2
    assert tok.messages[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n9C\n</tool_response>"
    assert tok.kwargs == {}
    # tool_choice none: no tool descriptions, the history still rendered
    fallback = fallback_messages(HISTORY, (), FORMATS["hermes"])
    assert "# Tools" not in fallback[0]["content"] and "<tool_call>" in fallback[2]["content"]
    no_system = fallback_messages(HISTORY[1:2], (Tool("get_weather"),), FORMATS["hermes"])
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith("# Tools")


def test_template_with_tool_support_gets_hf_convention():
    tok = Tok("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_supports_tools(tok)
    render_prompt(tok, HISTORY, parse_openai_tools([WEATHER], None, None), FORMATS["hermes"])
    assert tok.kwargs["tools"] == [{"type": "function", "function": WEATHER["function"]}]
    assert tok.messages[2]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert tok.messages[3] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    render_prompt(tok, HISTORY, parse_openai_tools([WEATHER], "none", None), FORMATS["hermes"])
    assert tok.kwargs["tools"] is None


def test_smollm2_fallback_renders_through_its_own_template(smollm2):
    tok = smollm2.tokenizer       # Tokenizer.from_gguf, built by the session's load (tests/conftest.py)
    assert not template_supports_tools(tok)
    text = render_prompt(tok, HISTORY, parse_openai_tools([WEATHER], None, None), FORMATS["hermes"])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>tool" not in text
