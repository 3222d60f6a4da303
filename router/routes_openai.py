"""POST /v1/chat/completions and /v1/completions: request -> GenerateRequest(s) -> JSON or SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tandem.core.messages import GenerateRequest, SampleGroup
from tandem.core.types import InvalidRequest, SamplingParams, check_token_ids
from tandem.router.prompt_cache import retention_pins
from tandem.router import metrics as m
from tandem.router.front_door import FrontDoor, error_response, refusal, request_priority, session_key, start_failed
from tandem.router.logprobs import (TokenTexts, chat_logprobs, completion_logprobs, echo_logprobs, joined,
                                    vllm_prompt_logprobs)
from tandem.router.openai_protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, ErrorBody,
                                           ErrorResponse, parse_json_object, parse_request)
from tandem.router.openai_responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                            ChatCompletionChunk, ChatDelta, Completion, CompletionChoice,
                                            FunctionCall, ToolCallOut, Usage)
from tandem.router.streaming import (ClientGone, Collected, Running, SSEResponse, StartFailed, close_all, collect,
                                     merge, sse, start, unless_disconnected)
from tandem.router.structured import constraint_from_response_format
from tandem.router.tools.formats import StreamingToolParser, parse_all
from tandem.router.tools.render import render_prompt
from tandem.router.tools.spec import ToolCall, ToolPlan, parse_openai_tools

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat defaults to the rest of the context
_SEED_SPAN = 2 ** 64


@dataclass
class Prepared:
    """``greqs``: every choice's request, prompt by prompt (a completion's batch of prompts, each
    fanned out ``n`` times: choice ``k * n + j``, as vLLM numbers them); ``firsts``: the index of
    each prompt's first choice; ``echo``: each choice's prompt text when a completion echoes it
    (None: no echo); ``prompt_top``: vLLM's ``prompt_logprobs`` as asked (None: not asked);
    ``score_only``: echo with max_tokens 0, one token drawn and left out of the answer."""

    greqs: list[GenerateRequest]
    plan: ToolPlan | None
    top_logprobs: int | None
    firsts: list[int]
    echo: list[str] | None = None
    prompt_top: int | None = None
    score_only: bool = False


def fan_out(rid: str, prompt_ids: list[int], params: SamplingParams, session: str | None,
            n: int) -> list[GenerateRequest]:
    """One GenerateRequest, or n of one SampleGroup (rids ``<rid>-<i>``, seeds ``seed + i``)."""
    if n == 1:
        return [GenerateRequest(rid, tuple(prompt_ids), params, session)]
    out = []
    for i in range(n):
        seed = params.seed
        if seed is not None:
            seed = seed + i if seed + i < _SEED_SPAN else seed + i - _SEED_SPAN
        out.append(GenerateRequest(f"{rid}-{i}", tuple(prompt_ids), replace(params, seed=seed), session,
                                   SampleGroup(rid, i, n)))
    return out


def internal_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages in router/tools/render.py's internal shape."""
    out = []
    for i, msg in enumerate(messages):
        try:
            d: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        if msg.tool_calls:
            if msg.role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages.{i}.tool_calls")
            d["tool_calls"] = [(c.id, c.function.name, c.function.arguments if isinstance(c.function.arguments, str)
                                else json.dumps(c.function.arguments, ensure_ascii=False)) for c in msg.tool_calls]
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise APIError(400, f"messages[{i}].tool_call_id is required for a tool message",
                               param=f"messages.{i}.tool_call_id")
            d["tool_call_id"] = msg.tool_call_id
            if msg.name:
                d["name"] = msg.name
        out.append(d)
    return out


@dataclass
class _ChoiceState:
    parser: StreamingToolParser | None
    calls: int = 0
    tokens: int = 0
    offset: int = 0
    last: Any = None
    started: bool = False     # a chunk of this choice was seen (the first one echoes the prompt)


class OpenAIRoutes:
    def __init__(self, door: FrontDoor):
        self.door = door
        self.texts = TokenTexts(door.backend.tokenizer)

    def prepare(self, req: ChatCompletionRequest | CompletionRequest, body: dict, headers, rid: str) -> Prepared:
        chat = isinstance(req, ChatCompletionRequest)
        plan = (parse_openai_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
                if isinstance(req, ChatCompletionRequest) else None)
        constraint = constraint_from_response_format(req.response_format)
        if plan is not None and plan.forced:
            if constraint is not None:
                raise APIError(400, f"response_format cannot be combined with tool_choice "
                                    f"{plan.choice!r} (the call grammar already constrains the output)",
                               param="response_format")
            constraint = self.door.tool_format.constraint(plan)
        if isinstance(req, ChatCompletionRequest):
            msgs = internal_messages(req.messages)
            prompts = [self.door.render(lambda tok: render_prompt(tok, msgs, plan, self.door.tool_format))]
        else:
            prompts = self._completion_ids(req)
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        score_only = isinstance(req, CompletionRequest) and req.scores_only()
        top = req.top_logprobs_asked()
        prio = request_priority(headers, body)
        base = SamplingParams(
            max_tokens=1, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0), seed=req.seed,
            stop=req.stop_strings(), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            logprobs=top is not None, top_logprobs=top or 0, constraint=constraint,
            prompt_logprobs=req.prompt_logprobs_needed(), speculative=req.speculative)
        greqs: list[GenerateRequest] = []
        firsts: list[int] = []
        for k, ids in enumerate(prompts):      # each prompt its own room for output
            params = replace(base, max_tokens=self.door.output_budget(
                len(ids), 1 if score_only else req.requested_max_tokens(),
                None if chat else DEFAULT_COMPLETION_MAX_TOKENS, chat, param))
            try:
                params.validate()
            except InvalidRequest as e:
                raise APIError(400, str(e)) from None
            firsts.append(len(greqs))
            pins = retention_pins(req.prompt_cache_retention, len(ids))
            greqs += [replace(g, priority=prio, pins=pins) if prio or pins else g
                      for g in fan_out(rid if len(prompts) == 1 else f"{rid}-p{k}", ids, params,
                                       session_key(headers, body, ids), req.n)]
        echo = None
        if isinstance(req, CompletionRequest) and req.echo:        # echo is refused with n > 1: a choice per prompt
            echo = [p if isinstance(p, str) else self.door.backend.tokenizer.decode(ids)
                    for p, ids in zip(req.prompts(), prompts)]
        return Prepared(greqs, plan, top, firsts, echo, req.prompt_logprobs, score_only)

    def _completion_ids(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt's ids (a string tokenized, ids checked against the vocabulary)."""
        try:
            prompts = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        vocab = getattr(self.door.backend.tokenizer, "vocab_size", None)
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                out.append(list(self.door.backend.tokenizer.encode(prompt, add_special_tokens=True)))
                continue
            try:
                check_token_ids(prompt, vocab)
            except InvalidRequest as e:
                raise APIError(400, str(e), param="prompt") from None
            out.append(list(prompt))
        return out

    async def serve(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            who = self.door.check_auth(request)
            body = parse_json_object(await self.door.read_body(request))
            req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
            self.door.check_model(req.model)
            refused = req.unsupported()
            if refused is not None:
                raise APIError(400, refused[1], param=refused[0], code="unsupported")
            prep = await asyncio.to_thread(self.prepare, req, body, request.headers, rid)
            prep.greqs = self.door.admit(who, prep.greqs, body)
        except APIError as e:
            m.REJECTED.labels(e.reason).inc()
            m.REQUESTS.labels("rejected").inc()
            return refusal(e)
        except Exception as e:   # a bug on our side (or the tokenizer's): 500, and keep serving
            log.exception("preparing %s failed", rid)
            m.REQUESTS.labels("error").inc()
            return error_response(500, f"internal error: {type(e).__name__}", type="server_error")

        try:   # the first chunks decide the status code: a refusal is still a 400
            runs = await start(self.door.backend, prep.greqs, arrival, request.receive)
        except StartFailed as e:
            return start_failed(e, rid)
        headers = {"X-Request-Id": rid}
        if req.stream:
            return SSEResponse(self._events(req, prep, rid, runs), headers)
        try:
            done = await unless_disconnected(collect(runs), request.receive)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            log.exception("backend failed on %s", rid)
            return error_response(500, f"backend error: {e!r}"[:500], type="server_error")
        finally:
            await close_all([r.chunks for r in runs])   # records the outcome now, not at garbage collection
        failed = next((c.last for c in done if c.last.error), None)
        if failed is not None:
            return error_response(500, f"generation failed: {failed.error}", type="server_error", headers=headers)
        missing = next((why for i, c in enumerate(done) if (why := _prompt_lps_missing(prep, i, c.prompt_logprobs))),
                       None)
        if missing is not None:
            return error_response(500, missing, type="server_error", headers=headers)
        if done[0].last.worker:
            headers["X-Tandem-Worker"] = done[0].last.worker
        return Response(self._body(req, prep, rid, done).model_dump_json(), media_type="application/json",
                        headers=headers)

    def _body(self, req, prep: Prepared, rid: str, done: list[Collected]):
        usage = _usage(done, prep)
        model, top = self.door.backend.model_name, prep.top_logprobs
        if isinstance(req, CompletionRequest):
            return Completion(id=rid, model=model, usage=usage, choices=[
                self._completion_choice(i, c.text, c.last.finish_reason, prep, c.logprobs, c.prompt_logprobs)[0]
                for i, c in enumerate(done)])
        choices = []
        for i, c in enumerate(done):
            content, finish = c.text, c.last.finish_reason
            calls: list[ToolCall] = []
            if prep.plan is not None and prep.plan.active:
                content, calls = parse_all(self.door.tool_format, c.text, truncated=finish == "length",
                                           max_calls=prep.plan.max_calls)
                if calls and finish == "stop":
                    finish = "tool_calls"
            msg = AssistantMessage(content=content if content or not calls else None, tool_calls=[
                ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls] or None)
            choices.append(ChatChoice(index=i, message=msg, finish_reason=finish,
                                      logprobs=chat_logprobs(self.texts, c.logprobs, top) if top is not None else None))
        plps = None if prep.prompt_top is None else vllm_prompt_logprobs(self.texts, done[0].prompt_logprobs,
                                                                           prep.prompt_top)
        return ChatCompletion(id=rid, model=model, usage=usage, choices=choices, prompt_logprobs=plps)

    def _completion_choice(self, i: int, text: str, finish: str | None, prep: Prepared, lps, plps,
                           offset: int = 0, first: bool = True) -> tuple[CompletionChoice, int]:
        top, logprobs = prep.top_logprobs, None
        echo = prep.echo[i] if first and prep.echo is not None else None
        if prep.score_only:      # the token drawn to end a scoring request is not part of the answer
            text, lps = "", ()
            finish = "length" if finish in ("stop", "length") else finish
        if echo is not None:
            text = echo + text
        if top is not None:
            if echo is not None:
                head = echo_logprobs(self.texts, prep.greqs[i].prompt_ids, plps, top)[0]
                tail, offset = completion_logprobs(self.texts, lps, top, len(echo))
                logprobs = joined(head, tail)
            else:
                logprobs, offset = completion_logprobs(self.texts, lps, top, offset)
        elif echo is not None:
            offset = len(echo)
        vllm = None
        if first and prep.prompt_top is not None:
            vllm = vllm_prompt_logprobs(self.texts, plps, prep.prompt_top)
        return CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs,
                                prompt_logprobs=vllm), offset

    async def _events(self, req, prep: Prepared, rid: str, runs: list[Running]) -> AsyncGenerator[bytes, None]:
        chat = isinstance(req, ChatCompletionRequest)
        created, model, top = int(time.time()), self.door.backend.model_name, prep.top_logprobs
        active = prep.plan is not None and prep.plan.active
        states = [_ChoiceState(self.door.tool_format.parser(max_calls=prep.plan.max_calls)
                               if prep.plan is not None and prep.plan.active else None)
                  for _ in runs]

        def chat_event(i: int, delta: ChatDelta, finish: str | None = None, lps=None) -> bytes:
            choice = ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=lps)
            return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]).model_dump_json())

        try:
            if chat:
                for i in range(len(runs)):
                    yield chat_event(i, ChatDelta(role="assistant", content=""))
            async for i, c in merge(runs):
                st = states[i]
                st.tokens += len(c.token_ids)
                if c.error:
                    yield sse(_error_json(f"generation failed: {c.error}"))
                    break
                if not st.started and (missing := _prompt_lps_missing(prep, i, c.prompt_logprobs)):
                    yield sse(_error_json(missing))
                    break
                if c.finish_reason is not None:
                    st.last = c
                if not chat:
                    first, st.started = not st.started, True
                    choice, st.offset = self._completion_choice(i, c.text, c.finish_reason, prep, c.logprobs,
                                                                c.prompt_logprobs, st.offset, first)
                    if choice.text or c.finish_reason is not None or (c.logprobs and not prep.score_only):
                        yield sse(Completion(id=rid, created=created, model=model, choices=[choice]).model_dump_json())
                    continue
                text, deltas = c.text, []
                if st.parser is not None:
                    events = st.parser.feed(c.text) + (st.parser.finish(c.finish_reason == "length")
                                                       if c.finish_reason is not None else [])
                    text = "".join(e.text for e in events)
                    for e in events:
                        if e.call is not None:
                            deltas.append({"index": st.calls, "id": e.call.id, "type": "function",
                                           "function": {"name": e.call.name, "arguments": e.call.arguments}})
                            st.calls += 1
                finish = c.finish_reason
                if finish == "stop" and st.calls:
                    finish = "tool_calls"
                lps = chat_logprobs(self.texts, c.logprobs, top) if top is not None and c.logprobs else None
                if text or deltas or finish is not None or lps is not None:
                    yield chat_event(i, ChatDelta(content=text or None, tool_calls=deltas or None), finish, lps)
            else:
                if req.include_usage():
                    done = [Collected("", s.last, s.tokens, []) for s in states]
                    usage = _usage(done, prep)
                    out = (ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage) if chat
                           else Completion(id=rid, created=created, model=model, choices=[], usage=usage))
                    yield sse(out.model_dump_json())
        except Exception as e:
            log.exception("stream %s failed", rid)
            yield sse(_error_json(f"backend error: {e!r}"[:500]))
        finally:
            await close_all([r.chunks for r in runs])
        yield sse("[DONE]")


def _prompt_lps_missing(prep: Prepared, i: int, plps) -> str | None:
    g = prep.greqs[i]
    n = len(g.prompt_ids)
    if g.params.prompt_logprobs is None or len(plps) == n - 1:
        return None
    return (f"the backend returned {len(plps)} prompt logprobs for a {n}-token prompt "
            f"(echo with logprobs and prompt_logprobs need {n - 1})")


def _usage(done: list[Collected], prep: Prepared) -> Usage:
    """Each prompt once (its first choice's figures), every choice's completion tokens; none when
    ``prep.score_only`` (the one drawn is not in the answer)."""
    prompt = sum(done[k].last.prompt_tokens or len(prep.greqs[k].prompt_ids) for k in prep.firsts)
    cached = sum(done[k].last.cached_tokens or 0 for k in prep.firsts)
    return Usage.of(prompt, cached,
                    0 if prep.score_only else sum(c.last.completion_tokens or c.n_tokens for c in done))


def _error_json(message: str) -> str:
    return ErrorResponse(error=ErrorBody(message=message, type="server_error")).model_dump_json()
