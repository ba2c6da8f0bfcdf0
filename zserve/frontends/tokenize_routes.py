"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes and shapes) for the generative models: the token
ids the engine makes of a prompt or of chat messages (``model_tokenizer.py``), and the text of token ids.

Answered by the frontend worker itself, with the model's tokenizer loaded there on first use; nothing reaches the
broker. Token-level routers in front of several deployments ask for these before they route (vLLM's router,
``vllm-router``, posts each prompt to ``/tokenize``), and clients use them to count a prompt's tokens. Errors come in
OpenAI's shape, as vLLM's do.
"""

from __future__ import annotations

import asyncio
from typing import Any

import falcon
import falcon.asgi
import msgspec
from jinja2 import TemplateError

from zserve.errors import BadRequest
from zserve.frontends import openai_params, tool_calls
from zserve.frontends.api_types import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    decode_body,
)
from zserve.frontends.limits import Limits
from zserve.frontends.model_tokenizer import ModelTokenizer
from zserve.frontends.resources import RequestError, answer_error, openai_error, read_json
from zserve.generation import ChatMessage

_json = msgspec.json.Encoder()


class _TokenizerRoute:
    """What both routes share: the model's tokenizer by name, the body read and the answer written; ``answer``
    (each route's own) makes the answer of a body."""

    def __init__(self, tokenizers: dict[str, ModelTokenizer], max_body_bytes: int, limits: Limits) -> None:
        """``tokenizers``: each generative model's, by name (shared with routing's prompt blocks)."""
        self.tokenizers = tokenizers
        self.max_body_bytes = max_body_bytes
        self.limits = limits

    def model(self, name: str | None) -> ModelTokenizer:
        """The model's tokenizer, maybe not loaded yet; ``name`` None: the one model's."""
        if name is None:
            if len(self.tokenizers) != 1:
                raise BadRequest("`model` is required: this deployment serves several generative models",
                                 field="model")  # fmt: skip
            [tokenizer] = self.tokenizers.values()
        else:
            tokenizer = self.tokenizers.get(name)
            if tokenizer is None:
                raise RequestError(404, "model_not_found", f"no generative model named {name!r}; see GET /v1/models",
                                   "model")  # fmt: skip
        return tokenizer

    @staticmethod
    async def loaded(tokenizer: ModelTokenizer) -> ModelTokenizer:
        """``tokenizer``, loaded (off the event loop the first time)."""
        if tokenizer.tokenizer is None and await asyncio.to_thread(tokenizer.load) is None:
            raise RequestError(500, "tokenizer_unavailable", f"the model's tokenizer does not load: {tokenizer.failed}")
        return tokenizer

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        try:
            answer = await self.answer(await read_json(req, self.max_body_bytes))
        except Exception as exc:
            answer_error(resp, exc, openai_error)
            return
        resp.content_type = falcon.MEDIA_JSON
        resp.data = _json.encode(answer)

    async def answer(self, body: Any) -> Any:
        raise NotImplementedError


class TokenizeResource(_TokenizerRoute):
    async def answer(self, body: Any) -> TokenizeResponse:
        request = decode_body(body, TokenizeRequest)
        tokenizer = self.model(request.model)
        for name in ("continue_final_message", "chat_template", "chat_template_kwargs"):  # vLLM's, not ours
            if getattr(request, name):
                raise BadRequest(f"`{name}` is not supported by this server", field=name)
        if (request.prompt is None) == (request.messages is None):
            raise BadRequest("give exactly one of `prompt` and `messages`", field="prompt")
        if request.messages is None and request.tools is not None:
            raise BadRequest("`tools` go with `messages`", field="tools")
        # as /v1/chat/completions reads them: the same checks, the same template input
        tools = None if request.tools is None else msgspec.to_builtins(request.tools)
        self.limits.check_tools(tools)
        if tools is not None:
            tool_calls.check_tools(tools)
        messages = None if request.messages is None else openai_params.chat_messages(request.messages)
        tokenizer = await self.loaded(tokenizer)
        # off the event loop: a body of max_body_bytes takes the tokenizer a while, and the worker's other
        # connections must not wait for it
        return await asyncio.to_thread(self._tokenize, tokenizer, request, messages, tools)

    @staticmethod
    def _tokenize(tokenizer: ModelTokenizer, request: TokenizeRequest, messages: list[ChatMessage] | None,
                  tools: list[dict[str, Any]] | None) -> TokenizeResponse:  # fmt: skip
        if messages is None:
            ids = tokenizer.text_ids(request.prompt or "", add_special_tokens=request.add_special_tokens is not False)
        else:
            try:
                ids = tokenizer.chat_ids(messages, tools, request.add_generation_prompt,
                                         add_special_tokens=request.add_special_tokens is True)  # fmt: skip
            # the template's refusal (a role it does not take), or arguments nested past the interpreter's limit
            except (TemplateError, ValueError, TypeError, RecursionError) as exc:
                raise BadRequest(f"the chat template cannot render these messages: {exc}", field="messages") from exc
        strs = tokenizer.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(len(ids), tokenizer.max_context, ids, strs)


class DetokenizeResource(_TokenizerRoute):
    async def answer(self, body: Any) -> DetokenizeResponse:
        request = decode_body(body, DetokenizeRequest)
        tokenizer = await self.loaded(self.model(request.model))
        vocab = len(tokenizer.tokenizer)
        if any(t >= vocab for t in request.tokens):
            raise BadRequest(f"a token id past the vocabulary ({vocab} tokens)", field="tokens")
        return DetokenizeResponse(await asyncio.to_thread(tokenizer.tokenizer.decode, request.tokens))
