"""``response_format`` -> a :class:`~tandem.core.types.Constraint` the engine decodes under."""

from __future__ import annotations

import json
from typing import Any

from tandem.core.types import Constraint
from tandem.router.openai_protocol import APIError
from tandem.router.tools.spec import check_schema

TYPES = ("text", "json_object", "json_schema", "regex", "grammar")


def constraint_from_response_format(rf: dict[str, Any] | None) -> Constraint | None:
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError(400, "response_format json_schema needs "
                                "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                           param="response_format.json_schema")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, "response_format.json_schema.strict must be a boolean",
                           param="response_format.json_schema.strict")
        check_schema(js["schema"], "response_format.json_schema.schema")
        return Constraint("json_schema", json.dumps(js["schema"], ensure_ascii=False), strict=bool(strict))
    if kind in ("regex", "grammar"):
        spec = rf.get(kind)
        if not isinstance(spec, str) or not spec:
            raise APIError(400, f"response_format {kind} needs a non-empty string field {kind!r}",
                           param=f"response_format.{kind}")
        return Constraint("regex" if kind == "regex" else "lark", spec)
    raise APIError(400, f"response_format type must be one of {', '.join(TYPES)}, got {str(kind)[:64]!r}",
                   param="response_format.type")
