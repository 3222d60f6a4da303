"""``/v1/responses``: create (JSON, SSE or background), GET, DELETE, cancel."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, SamplingParams, StreamChunk
from tandem.router.prompt_cache import retention_pins
from tandem.router import metrics as m
from tandem.router.auth import Principal
from tandem.router.front_door import (FrontDoor, error_response, refusal, request_priority, session_key,
                                      start_failed)
from tandem.router.openai_protocol import APIError, parse_json_object, parse_request
from tandem.router.responses.output import OutputBuilder, history_items, new_id, response_object, usage_of
from tandem.router.responses.protocol import (ResponsesRequest, input_items, internal_messages, text_constraint,
                                              tool_plan)
from tandem.router.responses.store import IN_PROGRESS, ResponseStore, StoredResponse
from tandem.router.streaming import (ClientGone, Running, SSEResponse, StartFailed, close_all, collect, merge, sse,
                                     start, unless_disconnected)
from tandem.router.tools.formats import ParseEvent, StreamingToolParser
from tandem.router.tools.render import render_prompt
from tandem.router.tools.spec import ToolPlan

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5


@dataclass
class Prepared:
    greq: GenerateRequest
    plan: ToolPlan | None
    history: list[dict]          # the conversation's items before this turn's output
    created_at: int = field(default_factory=lambda: int(time.time()))


async def _never(_=None) -> dict:
    await asyncio.Event().wait()
    return {}


class ResponsesRoutes:
    def __init__(self, door: FrontDoor, store: ResponseStore):
        self.door, self.store = door, store
        self._background: dict[str, asyncio.Task] = {}

    def prepare(self, req: ResponsesRequest, body: dict, headers, rid: str, prev: StoredResponse | None) -> Prepared:
        plan = tool_plan(req)
        constraint = text_constraint(req)
        if plan is not None and plan.forced:
            if constraint is not None:
                raise APIError(400, f"text.format cannot be combined with tool_choice {plan.choice!r} (the "
                                    f"call grammar already constrains the output)", param="text.format")
            constraint = self.door.tool_format.constraint(plan)
        history = (prev.history if prev is not None else []) + input_items(req)
        msgs = internal_messages(req.instructions, history)
        ids = self.door.render(lambda tok: render_prompt(tok, msgs, plan, self.door.tool_format))
        max_tokens = self.door.output_budget(len(ids), req.max_output_tokens, None, True, "max_output_tokens")
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, constraint=constraint,
                                speculative=req.speculative)
        try:
            params.validate()
        except InvalidRequest as e:
            raise APIError(400, str(e)) from None
        session = (session_key(headers, {"session_id": req.session_id, "prompt_cache_key": req.prompt_cache_key,
                                             "user": req.user})
                   or (prev.session if prev is not None else None) or session_key({}, {"messages": msgs}))
        greq = GenerateRequest(rid, tuple(ids), params, session, priority=request_priority(headers, body),
                               pins=retention_pins(req.prompt_cache_retention, len(ids)))
        return Prepared(greq, plan, history)

    async def _previous(self, req: ResponsesRequest, who: Principal) -> StoredResponse | None:
        if req.previous_response_id is None:
            return None
        prev = await self.store.get(req.previous_response_id)
        if prev is None or prev.tenant != who.tenant:     # another tenant's: as if it did not exist
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        if prev.status in IN_PROGRESS:
            raise APIError(400, f"Previous response '{prev.id}' is still {prev.status}; wait for it to finish.",
                           param="previous_response_id")
        return prev

    async def create(self, request: Request) -> Response:
        arrival = time.perf_counter()
        rid = new_id("resp")
        try:
            who = self.door.check_auth(request)
            body = parse_json_object(await self.door.read_body(request))
            req = parse_request(ResponsesRequest, body)
            self.door.check_model(req.model)
            refused = req.unsupported()
            if refused is not None:
                raise APIError(400, refused[1], param=refused[0], code="unsupported")
            prev = await self._previous(req, who)
            prep = await asyncio.to_thread(self.prepare, req, body, request.headers, rid, prev)
            [prep.greq] = self.door.admit(who, [prep.greq], body)
        except APIError as e:
            m.REJECTED.labels(e.reason).inc()
            m.REQUESTS.labels("rejected").inc()
            return refusal(e)
        except Exception as e:   # a bug on our side, or the store is unreachable: 500, keep serving
            log.exception("preparing %s failed", rid)
            m.REQUESTS.labels("error").inc()
            return error_response(500, f"internal error: {type(e).__name__}", type="server_error")
        if req.background:
            return await self._start_background(req, prep, arrival)
        try:
            runs = await start(self.door.backend, [prep.greq], arrival, request.receive)
        except StartFailed as e:
            return start_failed(e, rid)
        headers = {"X-Request-Id": rid}
        if req.stream:
            return SSEResponse(self._events(req, prep, runs), headers)
        try:
            [done] = await unless_disconnected(collect(runs), request.receive)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            log.exception("backend failed on %s", rid)
            return error_response(500, f"backend error: {e!r}"[:500], type="server_error")
        finally:
            await close_all([r.chunks for r in runs])
        if done.last.error:
            return error_response(500, f"generation failed: {done.last.error}", type="server_error", headers=headers)
        if done.last.worker:
            headers["X-Tandem-Worker"] = done.last.worker
        b = OutputBuilder()
        b.feed(self._parse(prep, done.text, done.last))
        b.close(done.last.finish_reason == "length")
        out = await self._finish(req, prep, b, done.last, done.n_tokens)
        return Response(json.dumps(out, ensure_ascii=False), media_type="application/json", headers=headers)

    def _parser(self, prep: Prepared) -> StreamingToolParser | None:
        plan = prep.plan
        return self.door.tool_format.parser(max_calls=plan.max_calls) if plan is not None and plan.active else None

    def _parse(self, prep: Prepared, text: str, last: StreamChunk | None, parser=None) -> list[ParseEvent]:
        parser = parser or self._parser(prep)
        if parser is None:
            return [ParseEvent(text)]
        return parser.feed(text) + (parser.finish(last.finish_reason == "length") if last is not None else [])

    def _response(self, req: ResponsesRequest, prep: Prepared, status: str, output: list[dict],
                  usage: dict | None = None, error: dict | None = None) -> dict:
        return response_object(req, prep.greq.rid, prep.created_at, self.door.backend.model_name, prep.plan,
                               status, output, usage, error)

    async def _finish(self, req: ResponsesRequest, prep: Prepared, b: OutputBuilder, last: StreamChunk,
                      n_tokens: int, unless_cancelled: bool = False) -> dict:
        usage = usage_of(last.prompt_tokens or len(prep.greq.prompt_ids), last.cached_tokens,
                         last.completion_tokens or n_tokens)
        if last.error:
            status, error = "failed", {"code": "server_error", "message": f"generation failed: {last.error}"[:500]}
        else:
            status, error = ("incomplete" if last.finish_reason == "length" else "completed"), None
        out = self._response(req, prep, status, b.items, usage, error)
        if req.store:
            rec = StoredResponse(out["id"], out, prep.history + history_items(b.items), prep.greq.session_id,
                                 prep.greq.tenant)
            try:
                out = (await self.store.put(rec, unless_cancelled)).response
            except Exception:   # the reply still goes out; a later previous_response_id will not find it
                log.exception("storing %s failed", out["id"])
        return out

    async def _events(self, req: ResponsesRequest, prep: Prepared, runs: list[Running]):
        b, parser, n_tokens, last = OutputBuilder(), self._parser(prep), 0, None

        def ev(payload: dict) -> bytes:
            return sse(json.dumps(payload, ensure_ascii=False), payload["type"])

        try:
            snapshot = self._response(req, prep, "in_progress", [])
            yield ev(b.lifecycle("response.created", snapshot))
            yield ev(b.lifecycle("response.in_progress", snapshot))
            async for _, c in merge(runs):
                n_tokens += len(c.token_ids)
                if c.finish_reason is not None:
                    last = c
                if c.error:
                    break
                for payload in b.feed(self._parse(prep, c.text, last, parser) if parser else [ParseEvent(c.text)]):
                    yield ev(payload)
            if last is None:
                last = StreamChunk(prep.greq.rid, (), "", "abort", error="the stream ended without a final chunk")
            if not last.error:
                for payload in b.close(last.finish_reason == "length"):
                    yield ev(payload)
            out = await self._finish(req, prep, b, last, n_tokens)
            kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(out["status"],
                                                                                         "response.completed")
            yield ev(b.lifecycle(kind, out))
        except Exception as e:
            log.exception("stream %s failed", prep.greq.rid)
            failed = self._response(req, prep, "failed", b.items, None,
                                    {"code": "server_error", "message": f"backend error: {e!r}"[:500]})
            yield ev(b.lifecycle("response.failed", failed))
        finally:
            await close_all([r.chunks for r in runs])

    async def _start_background(self, req: ResponsesRequest, prep: Prepared, arrival: float) -> Response:
        queued = self._response(req, prep, "queued", [])
        try:
            await self.store.put(StoredResponse(queued["id"], queued, prep.history, prep.greq.session_id,
                                                 prep.greq.tenant))
        except Exception as e:
            log.exception("storing %s failed", queued["id"])
            return error_response(500, f"the response store is unavailable: {type(e).__name__}", type="server_error")
        task = asyncio.ensure_future(self._run_background(req, prep, arrival))
        self._background[queued["id"]] = task
        task.add_done_callback(lambda _: self._background.pop(queued["id"], None))
        return JSONResponse(queued, headers={"X-Request-Id": queued["id"]})

    async def _run_background(self, req: ResponsesRequest, prep: Prepared, arrival: float) -> None:
        rid = prep.greq.rid
        try:
            runs = await start(self.door.backend, [prep.greq], arrival, _never)
        except StartFailed as e:
            failed = self._response(req, prep, "failed", [], None, {"code": e.kind, "message": e.message[:500]})
            await self.store.put(StoredResponse(rid, failed, prep.history, prep.greq.session_id, prep.greq.tenant), True)
            return
        try:
            running = self._response(req, prep, "in_progress", [])
            if (await self.store.put(StoredResponse(rid, running, prep.history, prep.greq.session_id, prep.greq.tenant),
                                     True)).status == "cancelled":
                return
            done = await unless_disconnected(collect(runs), self._cancelled(rid))
        except ClientGone:   # cancelled: closing the stream aborts the generation
            return
        except Exception:
            log.exception("background response %s failed", rid)
            return
        finally:
            await close_all([r.chunks for r in runs])
        [d] = done
        b = OutputBuilder()
        if not d.last.error:
            b.feed(self._parse(prep, d.text, d.last))
            b.close(d.last.finish_reason == "length")
        await self._finish(req, prep, b, d.last, d.n_tokens, unless_cancelled=True)

    def _cancelled(self, rid: str):
        async def receive() -> dict:
            while True:
                await asyncio.sleep(CANCEL_POLL_S)
                try:
                    rec = await self.store.get(rid)
                except Exception:   # the store is unreachable: keep generating
                    continue
                if rec is None or rec.status == "cancelled":
                    return {"type": "http.disconnect"}
        return receive

    async def _record(self, request: Request, rid: str) -> StoredResponse:
        who = self.door.check_auth(request)
        rec = await self.store.get(rid)
        if rec is None or rec.tenant != who.tenant:
            raise APIError(404, f"Response with id '{rid[:256]}' not found.", param="response_id", code="not_found")
        return rec

    async def get(self, request: Request, rid: str) -> Response:
        try:
            if request.query_params.get("stream") in ("true", "1"):
                raise APIError(400, "streaming a stored response again is not supported", param="stream")
            rec = await self._record(request, rid)
        except APIError as e:
            return refusal(e)
        return JSONResponse(rec.response)

    async def delete(self, request: Request, rid: str) -> Response:
        try:
            await self._record(request, rid)
            await self.store.delete(rid)
        except APIError as e:
            return refusal(e)
        task = self._background.get(rid)
        if task is not None:
            task.cancel()
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: Request, rid: str) -> Response:
        try:
            rec = await self._record(request, rid)
            if not rec.response.get("background"):
                raise APIError(400, "Only responses created with background: true can be cancelled.",
                               param="response_id")
            rec = await self.store.cancel(rid) or rec
            if rec.status != "cancelled":
                raise APIError(400, f"Cannot cancel a response whose status is {rec.status!r}.", param="response_id")
        except APIError as e:
            return refusal(e)
        task = self._background.get(rid)
        if task is not None:
            task.cancel()
        return JSONResponse(rec.response)
