"""What a response says: its output items, built from the tool parser's events, its stream, and the
Response object around them (:func:`response_object`, :func:`usage_of`)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from tandem.router.tools.formats import ParseEvent
from tandem.router.tools.spec import ToolPlan


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Parser events -> output items and the SSE payloads (dicts) that stream them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.seq = 0
        self._msg: dict[str, Any] | None = None       # the open message item

    def _ev(self, kind: str, **data) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return out

    def lifecycle(self, kind: str, response: dict) -> dict:
        return self._ev(kind, response=response)

    def feed(self, events: list[ParseEvent]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.call is not None:
                out += self._close_message("completed")
                item = {"type": "function_call", "id": new_id("fc"), "call_id": e.call.id, "name": e.call.name,
                        "arguments": "", "status": "in_progress"}
                i = len(self.items)
                self.items.append(item)
                out.append(self._ev("response.output_item.added", output_index=i, item=dict(item)))
                out.append(self._ev("response.function_call_arguments.delta", output_index=i, item_id=item["id"],
                                    delta=e.call.arguments))
                item.update(arguments=e.call.arguments, status="completed")
                out.append(self._ev("response.function_call_arguments.done", output_index=i, item_id=item["id"],
                                    name=e.call.name, arguments=e.call.arguments))
                out.append(self._ev("response.output_item.done", output_index=i, item=dict(item)))
            elif e.text:
                if self._msg is None:
                    out += self._open_message()
                msg = self._msg
                assert msg is not None, "_open_message() opened it"
                part = msg["content"][0]
                part["text"] += e.text
                out.append(self._ev("response.output_text.delta", output_index=len(self.items) - 1,
                                    item_id=msg["id"], content_index=0, delta=e.text, logprobs=[]))
        return out

    def close(self, incomplete: bool) -> list[dict]:
        """End the output: the open message closes; a reply with no item at all gets an empty message."""
        out = [] if self.items else self._open_message()
        return out + self._close_message("incomplete" if incomplete else "completed")

    def _open_message(self) -> list[dict]:
        self._msg = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                     "content": []}
        i = len(self.items)
        self.items.append(self._msg)
        added = self._ev("response.output_item.added", output_index=i, item=json.loads(json.dumps(self._msg)))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._msg["content"].append(part)
        return [added, self._ev("response.content_part.added", output_index=i, item_id=self._msg["id"],
                                content_index=0, part=dict(part))]

    def _close_message(self, status: str) -> list[dict]:
        msg, self._msg = self._msg, None
        if msg is None:
            return []
        i = self.items.index(msg)
        part = msg["content"][0]
        msg["status"] = status
        return [self._ev("response.output_text.done", output_index=i, item_id=msg["id"], content_index=0,
                         text=part["text"], logprobs=[]),
                self._ev("response.content_part.done", output_index=i, item_id=msg["id"], content_index=0,
                         part=dict(part)),
                self._ev("response.output_item.done", output_index=i, item=json.loads(json.dumps(msg)))]


def history_items(output: list[dict]) -> list[dict]:
    """A response's output items as the next turn's input items."""
    out = []
    for it in output:
        if it["type"] == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "".join(p["text"] for p in it["content"])}]})
        elif it["type"] == "function_call":
            out.append({"type": "function_call", "call_id": it["call_id"], "name": it["name"],
                        "arguments": it["arguments"]})
    return out


def usage_of(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """The Responses API's usage object (input tokens include the cached ones, as OpenAI counts)."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(req, rid: str, created_at: int, model: str, plan: ToolPlan | None, status: str,
                    output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
    """OpenAI's Response object for ``req`` (a ResponsesRequest) in ``status``: the request's
    settings echoed (defaults filled in), ``output`` and ``usage`` as given."""
    tools = [{"type": "function", "name": t.name, "description": t.description or None,
              "parameters": t.parameters, "strict": t.strict} for t in (plan.tools if plan else ())]
    choice = "auto" if plan is None else ({"type": "function", "name": plan.function}
                                          if plan.choice == "function" else plan.choice)
    return {"id": rid, "object": "response", "created_at": created_at, "status": status,
            "background": req.background, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": choice, "tools": tools, "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled", "usage": usage, "user": req.user,
            "completed_at": int(time.time()) if status == "completed" else None}
