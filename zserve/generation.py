"""What a generative model is asked and what it answers: one request body, validated once.

Every route (native ``/v1/models/{name}/predict``, OpenAI, DeepSpeed-MII, the Python clients) turns what it
receives into a ``GenerateRequest``; the engine turns that into token ids and sampling parameters. Errors
name the offending field, so HTTP answers 400 with ``field`` set and the Python client raises ``BadRequest``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from zserve.errors import BadRequest
from zserve.protocol import TokenLogprob, TopLogprob


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    # tool calling (OpenAI's shapes, passed to the chat template as they are): an assistant's calls, and the
    # call a `tool` message answers
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One prompt (text, or chat messages rendered with the tokenizer's chat template) and how to sample."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool definitions, rendered by the chat template
    max_new_tokens: Annotated[int, Meta(ge=1)] | None = None  # None: the model's default
    # DeepSpeed-MII's cap on prompt + generated tokens; the tighter of the two applies
    max_length: Annotated[int, Meta(ge=1)] | None = None
    min_new_tokens: Annotated[int, Meta(ge=0)] = 0  # eos and stop ids are ignored until this many tokens
    temperature: Annotated[float, Meta(ge=0.0)] = 0.0  # 0 = greedy
    top_k: Annotated[int, Meta(ge=0)] = 0  # 0 = off
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] = []
    ignore_eos: bool = False
    # OpenAI's penalties (on the generated tokens), HF's repetition penalty (prompt and generated tokens)
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0  # 1 = off
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] = {}  # token id (as a string) -> bias
    # the sampled tokens' log-probabilities under the model, each with the `logprobs` most likely tokens'
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # the prompt tokens' log-probabilities (each given the tokens before it), each with the `prompt_logprobs`
    # most likely tokens' (vLLM's extension; completions' echo with logprobs). Such a prompt is computed whole,
    # never taken from the prefix cache.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # structured output: any JSON object, or a JSON value matching this JSON schema (JSON text)
    json_object: bool = False
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages` - at `$.prompt`")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must not be empty - at `$.messages`")


class PromptLogprob(msgspec.Struct):
    """A prompt token (its text alone), its log-probability given the tokens before it (None for the first
    token: nothing predicts it), and the most likely tokens at its place."""

    token: str
    logprob: float | None
    top_logprobs: list[TopLogprob]


class GenerateResponse(msgspec.Struct, omit_defaults=True):
    """A generative model's answer to one prompt (the fields DeepSpeed-MII's responses have, and
    ``logprobs`` when the request asked)."""

    generated_text: str
    generated_length: int
    prompt_length: int
    finish_reason: str  # "stop" (eos, a stop id or string) | "length" (max_new_tokens / max_length)
    logprobs: list[TokenLogprob] | None = None  # one per generated token
    prompt_logprobs: list[PromptLogprob] | None = None  # one per prompt token, when asked


def _field_of(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if "unknown field `" in text:
        return text.split("unknown field `", 1)[1].split("`", 1)[0]
    at = text.rfind("at `$.")
    if at < 0:
        return "body"
    path = text[at + len("at `$.") :].rstrip("`")
    return path.split("[", 1)[0].split(".", 1)[0] or "body"


def parse_generate_request(body: Any) -> GenerateRequest:
    """A ``GenerateRequest`` from a JSON-like body; a plain string is a prompt. Raises ``BadRequest``
    naming the field."""
    if isinstance(body, str):
        return GenerateRequest(prompt=body)
    if isinstance(body, GenerateRequest):
        return body
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object {"prompt": "...", ...sampling options}', field="prompt")
    try:
        return msgspec.convert(body, GenerateRequest)
    except msgspec.ValidationError as exc:
        message = str(exc).split(" - at `", 1)[0]
        raise BadRequest(f"{message}", field=_field_of(exc)) from None
