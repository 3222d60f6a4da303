"""Tool-call output formats: how calls are written in the model's output, parsed back, and enforced
(router/README.md, "Tool-call formats", has the table and what the parser promises)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.core.types import Constraint
from tandem.router.tools.spec import Tool, ToolCall, ToolPlan, new_call_id

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": True}


def _call_schema(tools: tuple[Tool, ...], args_key: str) -> dict:
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
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(new_call_id(ids), obj["name"], _args_text(args))


def _json_values(text: str, partial: bool = False) -> list[Any] | None:
    dec, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return out if partial else None
        out.append(value)


@dataclass
class ParseEvent:
    """``text`` for content, or one complete ``call``."""

    text: str = ""
    call: ToolCall | None = None


@dataclass
class StreamingToolParser:
    """Feed output text as it streams; get content text and complete calls, in order."""

    fmt: "ToolFormat"
    id_prefix: str = "call_"
    max_calls: int | None = None  # calls past this many are dropped (None: no limit)
    buf: str = ""
    in_call: bool = False
    decided: bool = False       # whether the reply opens with calls or text is known
    marker: str = ""            # the call marker consumed (given back if the calls do not parse)
    truncated: bool = False     # set by finish(): the output was cut (max_tokens)
    calls: list[ToolCall] = field(default_factory=list)
    _ws: str = ""               # trailing whitespace held back
    _after_call: bool = False   # the last event out was a call

    def feed(self, text: str) -> list[ParseEvent]:
        self.buf += text
        return self._tidy(self.fmt._scan(self, final=False), final=False)

    def finish(self, truncated: bool = False) -> list[ParseEvent]:
        self.truncated = truncated
        return self._tidy(self.fmt._scan(self, final=True), final=True)

    def _call(self, obj) -> ParseEvent | None:
        c = _call_from(obj, self.id_prefix)
        if c is None:
            return None
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return ParseEvent()
        self.calls.append(c)
        return ParseEvent(call=c)

    def _tidy(self, events: list[ParseEvent], final: bool) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        for e in events:
            if e.call is not None:
                self._ws, self._after_call = "", True
                out.append(e)
                continue
            text = e.text.lstrip() if self._after_call else e.text
            body = text.rstrip()
            if body:
                out.append(ParseEvent(self._ws + body))
                self._ws, self._after_call = text[len(body):], False
            else:
                self._ws += text
        if final:
            if self._ws and not self.calls:
                out.append(ParseEvent(self._ws))
            self._ws = ""
        return out


def parse_events(fmt: "ToolFormat", text: str, id_prefix: str = "call_", truncated: bool = False,
                 max_calls: int | None = None) -> list[ParseEvent]:
    """The content and call events of a whole reply, in generation order."""
    p = fmt.parser(id_prefix, max_calls)
    return p.feed(text) + p.finish(truncated)


def parse_all(fmt: "ToolFormat", text: str, id_prefix: str = "call_", truncated: bool = False,
              max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply."""
    events = parse_events(fmt, text, id_prefix, truncated, max_calls)
    return "".join(e.text for e in events), [e.call for e in events if e.call]


def _held(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ToolFormat:
    name = ""

    def parser(self, id_prefix: str = "call_", max_calls: int | None = None) -> StreamingToolParser:
        return StreamingToolParser(self, id_prefix, max_calls)

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
        more = f' ("\\n" call){{0,{plan.max_calls - 1}}}' if plan.max_calls > 1 else ""
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
                keep = _held(p.buf, self.OPEN) if not final or p.truncated else 0
                out.append(ParseEvent(p.buf[:len(p.buf) - keep]))
                p.buf = "" if final else p.buf[len(p.buf) - keep:]   # a cut marker start is dropped
                break
            j = p.buf.find(self.CLOSE)
            if j < 0 and not final:
                break
            body = p.buf[:len(p.buf) - _held(p.buf, self.CLOSE)] if j < 0 else p.buf[:j]
            values = _json_values(body)
            ev = p._call(values[0]) if values and len(values) == 1 else None
            if ev is None and not (j < 0 and p.truncated):   # not a call after all: give the text back
                out.append(ParseEvent(self.OPEN + (p.buf if j < 0 else p.buf[:j + len(self.CLOSE)])))
            elif ev is not None:
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
        more = f' ("; " call){{0,{plan.max_calls - 1}}}' if plan.max_calls > 1 else ""
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
        values = _json_values(body, partial=p.truncated)   # cut: the complete calls before the cut
        events = [p._call(v) for v in values] if values else []
        if (not events and not p.truncated) or any(e is None for e in events):
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
        arr = {"type": "array", "items": call, "minItems": 1, "maxItems": plan.max_calls,
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
                keep = _held(p.buf, self.TAG) if not final or p.truncated else 0
                out.append(ParseEvent(p.buf[:len(p.buf) - keep]))
                p.buf = "" if final else p.buf[len(p.buf) - keep:]
        if p.in_call and final:
            values = _json_values(p.buf.strip())
            arr = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
            events = [p._call(v) for v in arr] if arr else []
            if not events or any(e is None for e in events):
                p.calls.clear()
                if not p.truncated:   # a cut list is dropped, never returned as text
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
