"""POST /tokenize and /detokenize, in vLLM's request and response shapes."""

from __future__ import annotations

import asyncio
import json

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import Response

from tandem.core.types import InvalidRequest, check_token_ids
from tandem.router.front_door import FrontDoor, refusal
from tandem.router.openai_protocol import APIError, ChatMessage, _Request, parse_json_object, parse_request
from tandem.router.routes_openai import internal_messages
from tandem.router.tools.render import render_prompt


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None      # a prompt's (default true); messages: the template's own
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class TokenizeRoutes:
    def __init__(self, door: FrontDoor):
        self.door = door

    async def _parse(self, request: Request, model: type[_Request]):
        self.door.check_auth(request)
        req = parse_request(model, parse_json_object(await self.door.read_body(request)))
        if req.model is not None:
            self.door.check_model(req.model)
        return req

    async def tokenize(self, request: Request) -> Response:
        try:
            req = await self._parse(request, TokenizeRequest)
            ids = await asyncio.to_thread(self._ids, req)
        except APIError as e:
            return refusal(e)
        tok = self.door.backend.tokenizer
        out = {"count": len(ids), "max_model_len": self.door.backend.max_context, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return Response(json.dumps(out), media_type="application/json")

    def _ids(self, req: TokenizeRequest) -> list[int]:
        tok = self.door.backend.tokenizer
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            return list(tok.encode(req.prompt, add_special_tokens=special))
        msgs = internal_messages(req.messages or [])   # the validator: messages when no prompt
        return self.door.render(lambda t: render_prompt(t, msgs, None, self.door.tool_format))

    async def detokenize(self, request: Request) -> Response:
        try:
            req = await self._parse(request, DetokenizeRequest)
            try:
                check_token_ids(req.tokens, self.door.backend.tokenizer.vocab_size)
            except InvalidRequest as e:
                raise APIError(400, str(e), param="tokens") from None
            text = await asyncio.to_thread(self.door.backend.tokenizer.decode, req.tokens,
                                           skip_special_tokens=False)
        except APIError as e:
            return refusal(e)
        return Response(json.dumps({"prompt": text}), media_type="application/json")
