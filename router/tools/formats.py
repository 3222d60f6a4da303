"""Tool-call output formats: how calls are written in the model's output, parsed back, and enforced.

| format | the model writes | chosen for |
|---|---|---|
| ``hermes`` | ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one block per call) | Hermes, Qwen 2/2.5/3, and every template without tool support (SmolLM2) |
| ``llama3_json`` | ``{"name": ..., "parameters": {...}}`` as the whole reply (``; `` between calls) | Llama 3.1+ (``<|python_tag|>`` in the template) |
| ``mistral`` | ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` | Mistral (``[TOOL_CALLS]`` in the template) |

Each :class:`ToolFormat` gives: ``instructions(tools)`` (the fallback system prompt that describes
the tools and the format, for templates without tool support), ``render_calls(calls)`` (an
assistant turn's earlier calls, as the model would have written them), ``render_results(texts)``
(tool results, sent as a user turn), ``parser()`` (a :class:`StreamingToolParser`: text in,
content and complete calls out; the non-streamed path feeds everything at once, so both agree),
and ``constraint(plan)`` (the grammar for ``tool_choice`` required / a named function, decoded by
the engine so the call is always valid JSON matching the parameter schema).

Calls are emitted whole, when their closing marker (or the end of the output) is seen: a streamed
reply carries each call in one ``tool_calls`` delta with its id, name and complete arguments.
Markers that are special tokens (``<|python_tag|>``, ``[TOOL_CALLS]``) are dropped by the
detokenizer, so the parsers also accept the bare JSON that follows them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tandem.core.types import Constraint
from tandem.router.tools.spec import Tool, ToolCall, ToolPlan, new_call_id

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": True}


def _call_schema(tools: tuple[Tool, ...], args_key: str) -> dict:
    """One call object: {"name": <one of tools>, args_key: <that tool's parameters>}."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, args_key: t.schema},
                "required": ["name", args_key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _args_text(args) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def _call_from(obj, ids: str, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(new_call_id(ids), obj["name"], _args_text(args))


def _json_values(text: str) -> list | None:
    """Every JSON value in ``text`` (separated by whitespace, ';' or ','), or None if any part is not JSON."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


@dataclass
class ParseEvent:
    """``text`` for content, or one complete ``call``."""

    text: str = ""
    call: ToolCall | None = None


@dataclass
class StreamingToolParser:
    """Feed output text as it streams; get content text and complete calls, in order.

    Text that may still turn into a call marker is held back until it cannot. ``finish()`` flushes:
    an unclosed call whose JSON is complete becomes a call, anything else is returned as text.
    """

    fmt: "ToolFormat"
    id_prefix: str = "call_"
    buf: str = ""
    in_call: bool = False
    decided: bool = False       # whether the reply opens with calls or text is known
    marker: str = ""            # the call marker consumed (given back if the calls do not parse)
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[ParseEvent]:
        self.buf += text
        return self.fmt._scan(self, final=False)

    def finish(self) -> list[ParseEvent]:
        return self.fmt._scan(self, final=True)

    def _call(self, obj) -> ParseEvent | None:
        c = _call_from(obj, self.id_prefix)
        if c is None:
            return None
        self.calls.append(c)
        return ParseEvent(call=c)


def parse_all(fmt: "ToolFormat", text: str, id_prefix: str = "call_") -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply."""
    p = fmt.parser(id_prefix)
    events = p.feed(text) + p.finish()
    return "".join(e.text for e in events), [e.call for e in events if e.call]


def _held(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ToolFormat:
    name = ""

    def parser(self, id_prefix: str = "call_") -> StreamingToolParser:
        return StreamingToolParser(self, id_prefix)

    def tool_lines(self, tools: tuple[Tool, ...]) -> str:
        return "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)

    def render_results(self, texts: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)

    # per format
    def instructions(self, tools: tuple[Tool, ...]) -> str: raise NotImplementedError
    def render_calls(self, calls: list[tuple[str, str]]) -> str: raise NotImplementedError
    def constraint(self, plan: ToolPlan) -> Constraint: raise NotImplementedError
    def _scan(self, p: StreamingToolParser, final: bool) -> list[ParseEvent]: raise NotImplementedError


class HermesFormat(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def instructions(self, tools):
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{self.tool_lines(tools)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls):
        return "\n".join(f'{self.OPEN}\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n{self.CLOSE}'
                         for n, a in calls)

    def constraint(self, plan):
        body = {**_call_schema(plan.callable_tools(), "arguments"), "x-guidance": JSON_LAYOUT}
        more = ' ("\\n" call)*' if plan.parallel and plan.choice == "required" else ""
        lark = (f"start: call{more}\n"
                f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: %json {json.dumps(body, ensure_ascii=False)}\n")
        return Constraint("lark", lark)

    def _scan(self, p, final):
        out: list[ParseEvent] = []
        while True:
            if not p.in_call:
                i = p.buf.find(self.OPEN)
                if i >= 0:
                    out.append(ParseEvent(p.buf[:i]))
                    p.buf, p.in_call = p.buf[i + len(self.OPEN):], True
                    continue
                keep = 0 if final else _held(p.buf, self.OPEN)
                out.append(ParseEvent(p.buf[:len(p.buf) - keep]))
                p.buf = p.buf[len(p.buf) - keep:]
                break
            j = p.buf.find(self.CLOSE)
            if j < 0 and not final:
                break
            body = p.buf if j < 0 else p.buf[:j]
            values = _json_values(body)
            ev = p._call(values[0]) if values and len(values) == 1 else None
            if ev is None:    # not a call after all: give the text back
                out.append(ParseEvent(self.OPEN + (body if j < 0 else p.buf[:j + len(self.CLOSE)])))
            else:
                out.append(ev)
            p.buf, p.in_call = ("" if j < 0 else p.buf[j + len(self.CLOSE):]), False
            if j < 0:
                break
        return [e for e in out if e.call or e.text]


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def instructions(self, tools):
        return ("You have access to the following functions:\n\n" + self.tool_lines(tools)
                + "\n\nTo call a function, respond with only a JSON object of the form "
                  '{"name": <function-name>, "parameters": <args-json-object>} and nothing else '
                  "(several calls: separate the objects with '; ').")

    def render_calls(self, calls):
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)

    def render_results(self, texts):
        return "\n".join(texts)

    def constraint(self, plan):
        body = {**_call_schema(plan.callable_tools(), "parameters"), "x-guidance": JSON_LAYOUT}
        more = ' ("; " call)*' if plan.parallel and plan.choice == "required" else ""
        return Constraint("lark", f"start: call{more}\ncall: %json {json.dumps(body, ensure_ascii=False)}\n")

    def _scan(self, p, final):
        if not p.decided:
            head = p.buf.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
            if head[:1] == "{":
                p.decided, p.in_call = True, True
            elif head and not self.TAG.startswith(head):
                p.decided = True
            elif not final:
                return []
        if not p.in_call:
            text, p.buf = p.buf, ""
            return [ParseEvent(text)] if text else []
        if not final:
            return []
        body = p.buf.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        values = _json_values(body)
        events = [p._call(v) for v in values] if values else []
        if not events or any(e is None for e in events):
            p.calls.clear()
            text, p.buf = p.buf, ""
            return [ParseEvent(text)]
        p.buf = ""
        return events


class MistralFormat(ToolFormat):
    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def instructions(self, tools):
        return ("[AVAILABLE_TOOLS]" + json.dumps([t.openai() for t in tools], ensure_ascii=False)
                + "[/AVAILABLE_TOOLS]\nTo call functions, respond with [TOOL_CALLS] followed by a JSON "
                  'list: [TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]')

    def render_calls(self, calls):
        return self.TAG + "[" + ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a}}}'
                                          for n, a in calls) + "]"

    def render_results(self, texts):
        return "\n".join(f"[TOOL_RESULTS]{t}[/TOOL_RESULTS]" for t in texts)

    def constraint(self, plan):
        call = _call_schema(plan.callable_tools(), "arguments")
        one = not (plan.parallel and plan.choice == "required")
        arr = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if one else {}),
               "x-guidance": JSON_LAYOUT}
        return Constraint("lark", f"start: %json {json.dumps(arr, ensure_ascii=False)}\n")

    def _scan(self, p, final):
        out: list[ParseEvent] = []
        if not p.in_call and not p.decided:   # a reply may open with the bare list
            head = p.buf.lstrip()
            if head.startswith("[{"):
                p.buf, p.in_call = head, True
            elif head in ("", "[") and not final:
                return []
            p.decided = True
        if not p.in_call:
            i = p.buf.find(self.TAG)
            if i >= 0:
                out.append(ParseEvent(p.buf[:i]))
                p.buf, p.in_call, p.marker = p.buf[i + len(self.TAG):], True, self.TAG
            else:
                keep = 0 if final else _held(p.buf, self.TAG)
                out.append(ParseEvent(p.buf[:len(p.buf) - keep]))
                p.buf = p.buf[len(p.buf) - keep:]
        if p.in_call and final:
            values = _json_values(p.buf.strip())
            arr = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
            events = [p._call(v) for v in arr] if arr else []
            if not events or any(e is None for e in events):
                p.calls.clear()
                out.append(ParseEvent(p.marker + p.buf))
            else:
                out += events
            p.buf, p.in_call = "", False
        return [e for e in out if e.call or e.text]


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}


def choose_format(flag: str, chat_template: str | None) -> ToolFormat:
    """``flag`` (ServeConfig.tool_parser) unless "auto"; then by the markers in the chat template,
    Hermes when there are none (the format of the fallback prompt)."""
    if flag != "auto":
        return FORMATS[flag]
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<|python_tag|>" in t or "ipython" in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
