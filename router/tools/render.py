"""A conversation with tools -> the prompt text, through the model's chat template."""

from __future__ import annotations

import json
from functools import lru_cache

from tandem.router.tools.formats import ToolFormat
from tandem.router.tools.spec import ToolPlan


@lru_cache(maxsize=16)
def _reads_tools(source: str) -> bool:
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return False


def template_supports_tools(tokenizer) -> bool:
    source = getattr(tokenizer, "chat_template", None)
    return isinstance(source, str) and _reads_tools(source)


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def render_prompt(tokenizer, messages: list[dict], plan: ToolPlan | None, fmt: ToolFormat) -> str:
    """The prompt for ``messages`` (internal shape above), ending with the assistant's turn."""
    offered = plan.tools if plan is not None and plan.active else ()
    if template_supports_tools(tokenizer):
        out = []
        for m in messages:
            d = {"role": m["role"], "content": m.get("content") or ""}
            if m.get("tool_calls"):
                d["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": _arguments(a)}}
                                   for i, n, a in m["tool_calls"]]
            if m["role"] == "tool":
                d["tool_call_id"] = m.get("tool_call_id") or ""
                if m.get("name"):
                    d["name"] = m["name"]
            out.append(d)
        return tokenizer.apply_chat_template(out, add_generation_prompt=True,
                                             tools=[t.openai() for t in offered] or None)
    return tokenizer.apply_chat_template(fallback_messages(messages, offered, fmt), add_generation_prompt=True)


def fallback_messages(messages: list[dict], tools, fmt: ToolFormat) -> list[dict]:
    """Only system / user / assistant roles with plain string content."""
    out: list[dict] = []
    results: list[str] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": fmt.render_results(results)})
            results.clear()

    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            results.append(content)
            continue
        flush()
        if role == "assistant" and m.get("tool_calls"):
            calls = fmt.render_calls([(n, a) for _, n, a in m["tool_calls"]])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    flush()
    if tools:
        text = fmt.instructions(tuple(tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
