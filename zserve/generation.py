"""What a generative model is asked and what it answers: one request type, validated once.

Every route (native ``/v1/models/{name}/predict``, OpenAI, DeepSpeed-MII, the Python clients) turns what it
receives into a ``GenerateRequest``: the native body is one; the OpenAI and MII bodies are typed Structs
(``zserve.frontends.api_types``) whose sampling fields take their ranges from the aliases below, so a range is
declared once, and ``zserve.frontends.openai_params`` maps them (vLLM's ``to_sampling_params``). The request
travels msgpack-encoded as it is; the engine decodes it with ``decode_generate_request`` (``type=GenerateRequest``)
and ``Generator.prepare`` turns it into token ids and ``SamplingParams``. Errors name the offending field, so
HTTP answers 400 with ``field`` set and the Python client raises ``BadRequest``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from zserve.errors import BadRequest, field_of, validation_parts
from zserve.protocol import TokenLogprob, TopLogprob

# The sampling ranges, declared once: GenerateRequest and the HTTP bodies (api_types) take their fields from these.
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs (OpenAI's own limits: 20 for chat, 5 for completions)
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # seeds travel to torch as int64
TokenCount = Annotated[int, Meta(ge=1)]
MinTokens = Annotated[int, Meta(ge=0)]
TokenId = Annotated[int, Meta(ge=0)]
Temperature = Annotated[float, Meta(ge=0.0)]
TopK = Annotated[int, Meta(ge=0)]  # 0 = off
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # OpenAI's presence and frequency penalties
RepetitionPenalty = Annotated[float, Meta(gt=0.0)]  # HF's; 1 = off
LogitBias = dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]]  # token id (as a string) -> added to its logit
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]


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
    max_new_tokens: TokenCount | None = None  # None: the model's default
    # DeepSpeed-MII's cap on prompt + generated tokens; the tighter of the two applies
    max_length: TokenCount | None = None
    min_new_tokens: MinTokens = 0  # eos and stop ids are ignored until this many tokens
    temperature: Temperature = 0.0  # 0 = greedy
    top_k: TopK = 0
    top_p: TopP = 1.0
    seed: Int64 | None = None
    stop: list[str] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    # OpenAI's penalties (on the generated tokens), HF's repetition penalty (prompt and generated tokens)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: LogitBias = {}
    # the sampled tokens' log-probabilities under the model, each with the `logprobs` most likely tokens'
    logprobs: LogprobCount | None = None
    # the prompt tokens' log-probabilities (each given the tokens before it), each with the `prompt_logprobs`
    # most likely tokens' (vLLM's extension; completions' echo with logprobs). Such a prompt is computed whole,
    # never taken from the prefix cache.
    prompt_logprobs: LogprobCount | None = None
    # structured output: any JSON object, or a JSON value matching this JSON schema (JSON text)
    json_object: bool = False
    json_schema: str | None = None
    # The prompt's token ids as the frontend made them for routing (``zserve/frontends/prompt_blocks.py``), so the
    # engine does not tokenise again. Internal to a deployment: a client's body that carries them is refused
    # (``parse_generate_request``), and the engine takes them only when ``prompt_tokenizer`` is its own
    # tokenizer's fingerprint (same vocabulary, rules and chat template), else it tokenises the text itself.
    prompt_token_ids: list[TokenId] | None = None
    prompt_tokenizer: str = ""

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


_INTERNAL_FIELDS = ("prompt_token_ids", "prompt_tokenizer")


def parse_generate_request(body: Any, *, token_ids: bool = False) -> GenerateRequest:
    """A ``GenerateRequest`` from a JSON-like body; a plain string is a prompt. Raises ``BadRequest``
    naming the field. ``token_ids``: the body may carry the frontend's ``prompt_token_ids`` (a body the
    deployment decoded itself); a client's body may not: ids that disagree with the text would make the
    answer disagree with ``echo``, the usage and the router's view, so they are not taken from outside."""
    if isinstance(body, str):
        return GenerateRequest(prompt=body)
    if isinstance(body, GenerateRequest):
        return body
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object {"prompt": "...", ...sampling options}', field="prompt")
    if not token_ids:
        for name in _INTERNAL_FIELDS:
            if name in body:
                raise BadRequest(f"`{name}` is set by the server, not by a client; send `prompt` or `messages`",
                                 field=name)  # fmt: skip
    try:
        return msgspec.convert(body, GenerateRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(validation_parts(exc)[0], field=field_of(exc)) from None


_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)


def decode_generate_request(data: Any) -> GenerateRequest:
    """The engine's one decode of a request a deployment encoded (a frontend's ``GenerateRequest``, msgpack, the
    payload's first frame), ``type=GenerateRequest``: no dict in between. Raises ``BadRequest`` naming the field."""
    try:
        return _request_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise BadRequest(validation_parts(exc)[0], field=field_of(exc)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed generate request: {exc}", field="body") from None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What decides a prompt's token ids, hashed: the fast tokenizer's whole definition (vocabulary, merges,
    normalisation, special tokens, what it adds around a text), the chat template and the transformers
    release that renders it. Equal on a frontend and an engine that tokenise alike, whatever their paths or
    hosts; "" for a tokenizer without that definition (a slow one): its ids never travel. About 90 ms for a
    49k vocabulary, once at load."""
    import hashlib
    import importlib.metadata
    import json

    import transformers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    # The chat template renders {{ bos_token }} and friends from the Python side's special tokens, which the backend's
    # definition need not agree with (a GGUF's misread eos is fixed in the engine's copy only), and jinja2 renders it.
    specials = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    added = json.dumps({str(k): str(v) for k, v in getattr(tokenizer, "added_tokens_decoder", {}).items()})
    versions = [transformers.__version__, *(importlib.metadata.version(d) for d in ("tokenizers", "jinja2"))]
    h = hashlib.blake2b(digest_size=16)
    for part in (backend.to_str(), str(getattr(tokenizer, "chat_template", None)), type(tokenizer).__name__,
                 specials, added, *versions):  # fmt: skip
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
