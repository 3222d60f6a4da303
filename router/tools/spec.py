"""Declared tools and the tool choice, validated: :func:`parse_openai_tools` -> :class:`ToolPlan`.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tandem.router.openai_protocol import APIError

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8   # the most calls one reply may make (the call grammar's and the parser's bound)
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}

Choice = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: Any = None      # a JSON Schema (dict); None = no arguments
    strict: bool = False

    @property
    def schema(self) -> Any:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS

    def openai(self) -> dict:
        """The OpenAI ``tools[]`` entry (what chat templates with tool support expect)."""
        fn: dict = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """What the request allows: ``choice`` "auto" (the model decides), "none" (no calls: tools are
    left out of the prompt and the output is not parsed), "required" (at least one call), or
    "function" (exactly one call, to ``function``)."""

    tools: tuple[Tool, ...]
    choice: Choice = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are offered and the output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """A call must be made (the engine decodes under the call grammar)."""
        return self.active and self.choice in ("required", "function")

    @property
    def max_calls(self) -> int:
        """The most calls one reply may make: 1 for a named function or without ``parallel``,
        else :data:`MAX_PARALLEL_CALLS` (the grammar admits no more, the parser keeps no more)."""
        return MAX_PARALLEL_CALLS if self.parallel and self.choice != "function" else 1

    def callable_tools(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name == self.function) if self.choice == "function" else self.tools


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``arguments`` is JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def check_schema(schema: Any, where: str) -> None:
    """400 unless ``schema`` is a valid JSON Schema (draft 2020-12 meta-schema)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{where} must be a JSON Schema object, got {type(schema).__name__}", param=where)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise APIError(400, f"{where} is not a valid JSON Schema: {e.message}"
                            f"{' (at ' + path + ')' if path else ''}"[:500], param=where) from None


def tool_from(name: Any, description: Any, parameters: Any, strict: Any, where: str,
              name_field: str = "name", params_field: str = "parameters") -> Tool:
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}.{name_field} is required: every tool needs a name", param=f"{where}.{name_field}")
    if not NAME_RE.match(name):
        raise APIError(400, f"{where}.{name_field} {name[:80]!r} must be 1-128 characters of "
                            f"letters, digits, '_', '.' or '-'", param=f"{where}.{name_field}")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", param=f"{where}.description")
    if parameters is not None:
        check_schema(parameters, f"{where}.{params_field}")
    return Tool(name, description or "", parameters, bool(strict))


def parse_openai_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """The plan of an OpenAI chat request (None when it declares no tools and names no choice)."""
    if tools is None and tool_choice is None:
        return None
    parsed: list[Tool] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise APIError(400, "tools must be a list", param="tools")
        if len(tools) > MAX_TOOLS:
            raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
        for i, t in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type", "function") != "function":
                raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise APIError(400, f"{where}.function is required", param=f"{where}.function")
            parsed.append(tool_from(fn.get("name"), fn.get("description"), fn.get("parameters"),
                                    fn.get("strict"), f"{where}.function"))
    names = [t.name for t in parsed]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise APIError(400, f"tools declares {dupes[0]!r} more than once", param="tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice, function = _choice(tool_choice, names)
    return ToolPlan(tuple(parsed), choice, function, parallel_tool_calls is not False)


def _choice(tool_choice: Any, names: list[str]) -> tuple[Choice, str | None]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise APIError(400, f"tool_choice must be 'auto', 'none', 'required' or "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}"[:300],
                           param="tool_choice")
        if tool_choice != "none" and not names:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return tool_choice, None  # type: ignore[return-value]
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    return named_choice(name, names, "tool_choice.function.name")


def named_choice(name: str, names: list[str], where: str) -> tuple[Choice, str]:
    if name not in names:
        declared = ", ".join(repr(n) for n in names) or "none"
        raise APIError(400, f"{where} names function {name[:128]!r}, which is not among the declared "
                            f"tools ({declared})"[:500], param=where)
    return "function", name
