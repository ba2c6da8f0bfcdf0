"""The HTTP API's bodies as msgspec Structs: the routes decode requests and build responses with them, and
``/openapi.json`` is generated from them (``zserve.frontends.openapi``), so the two cannot drift apart.

The generation request types check the JSON types of the fields and their sampling ranges, which they take from
``zserve.generation`` (``GenerateRequest``'s, declared once); what a range cannot say (``n`` within the engine's
slots, a schema the grammar can enforce) is checked as they are mapped into ``GenerateRequest``s
(``zserve.frontends.openai_params``), a prompt within the context by the engine, with the same field names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from zserve.errors import BadRequest, field_of, validation_parts
from zserve.generation import (
    Int64,
    LogitBias,
    LogprobCount,
    MinTokens,
    Penalty,
    RepetitionPenalty,
    Temperature,
    TokenCount,
    TokenId,
    TopK,
    TopP,
)

T = TypeVar("T")


def decode_body(body: Any, type_: type[T]) -> T:
    """``body`` (parsed JSON) as ``type_``; a wrong type is a ``BadRequest`` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", field="body")
    try:
        return msgspec.convert(body, type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(validation_parts(exc)[0], field=field_of(exc)) from None


# Errors.


class ErrorDetail(msgspec.Struct, omit_defaults=True):
    type: str
    message: str
    field: str | None = None  # the request field at fault, when there is one


class Error(msgspec.Struct):
    """Every error of the native routes, /mii and the health routes."""

    error: ErrorDetail


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str  # invalid_request_error | authentication_error | overloaded_error | server_error
    param: str | None  # the request field at fault
    code: str | None  # our error type (model_not_found, invalid_api_key, ...)


class OpenAIError(msgspec.Struct):
    """Every error of /v1/completions, /v1/chat/completions and /v1/embeddings."""

    error: OpenAIErrorDetail


# Models and health.


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    owned_by: str
    handler: str  # "module:Class"


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class Live(msgspec.Struct):
    status: Literal["ok"]


class Ready(msgspec.Struct):
    status: Literal["ready"]
    engines: dict[str, int]  # ready engines per model
    preprocess_workers: dict[str, int]  # stage processes per model with a preprocess stage


# OpenAI generation.


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


# A request's place in its model's queue (docs/http-api.md#priorities-tenants-and-quotas); bounded so that aging
# (one level per priority_aging_ms) stays meaningful.
Priority = Annotated[int, Meta(ge=-1_000_000, le=1_000_000)]


class _Sampling(msgspec.Struct, kw_only=True):
    """What /v1/completions and /v1/chat/completions share; fields not listed here are ignored, as OpenAI
    does. The ranges are ``GenerateRequest``'s (``zserve.generation``, declared once), top_k's but for -1 (vLLM's
    "off"). Refused unless neutral (400 naming the field): best_of other than n, suffix. ``n`` is at most the
    engine's running slots; ``logprobs`` and ``top_logprobs`` at most 20. ``openai_params.generate_requests``
    turns a body into its ``GenerateRequest``s."""

    model: str
    # UNSET (left out) takes the route's default; null, the model's own (as before the typed body, and vLLM)
    max_tokens: TokenCount | msgspec.UnsetType | None = msgspec.UNSET
    max_completion_tokens: TokenCount | msgspec.UnsetType | None = msgspec.UNSET
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1)] | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    # structured output: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's: a JSON schema the output must match
    logit_bias: LogitBias | None = None  # token id -> added to its logit
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # vLLM's extensions
    ignore_eos: bool | None = None
    min_tokens: MinTokens | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1 or 0 = off
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: RepetitionPenalty | None = None  # HF's, over prompt and output; 1 = off
    priority: Priority | None = None  # vLLM's: lower is more urgent; None = the API key's default (0)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str]
    echo: bool | None = None
    suffix: str | None = None


class ChatContentPart(msgspec.Struct):
    type: Literal["text"]
    text: str = ""


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it (named/required choices: it follows the schema)


class ToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessageIn(msgspec.Struct):
    """A message of the history: ``system``/``user``/``assistant``/``tool`` (any role the chat template
    takes). An assistant's ``tool_calls`` and a ``tool`` message's ``tool_call_id`` (it must answer a call
    of an earlier assistant message) are rendered by the template."""

    role: str
    content: str | list[ChatContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(msgspec.Struct, omit_defaults=True):  # a field not given stays out of the template
    name: str  # 1-64 of a-z, A-Z, 0-9, _ and -
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None  # the arguments follow the schema under a forced choice whatever this says


class ToolDefinition(msgspec.Struct):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling, kw_only=True):
    """Tool calling (docs/openai.md): ``tools`` rendered by the chat template; ``tool_choice`` ``none``
    (plain content), ``auto`` (the default with tools: the model's own tool-call format parsed into
    ``tool_calls`` by the model's ``tool_parser``), ``required`` or a named function (forced by the grammar,
    the arguments follow the schema); ``parallel_tool_calls`` false: at most one call."""

    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions shape: per generated token its text, logprob, the top alternatives by text,
    and where it starts in the choice's text. With ``echo`` the prompt's tokens come first, the first of
    them with null logprob and alternatives (nothing predicts it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None  # "stop" | "length"; null in a stream's text chunks


class Completion(msgspec.Struct, omit_defaults=True):
    """A /v1/completions answer; with ``stream: true`` each Server-Sent Event's data is one of these
    (``usage`` only in the last, with ``stream_options.include_usage``), then ``[DONE]``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None  # null when the answer is tool calls only
    tool_calls: list[ToolCall] = []


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]  # the token's UTF-8 bytes


class TokenLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]  # the `top_logprobs` most likely tokens at this place


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprobOut]


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str  # "stop" | "length" | "tool_calls"


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed part of a tool call: its first has ``id``, ``type`` and ``function.name`` (arguments
    ""), the next ones ``function.arguments`` text to append; ``index`` says which call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None  # those of the chunk's tokens
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    """One Server-Sent Event of /v1/chat/completions with ``stream: true`` (then ``[DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# DeepSpeed-MII.


class MiiRequest(msgspec.Struct, kw_only=True):
    """``POST /mii/{deployment}``: the prompts, MII's options, and the native generate body's sampling
    options (``GenerateRequest``'s, with its ranges; any other field is refused, naming it)."""

    prompts: str | list[str]
    do_sample: bool | None = None  # MII's default: true, with top_p 0.9
    stream: bool | None = None  # ignored: MII's REST answer is never streamed
    return_full_text: bool | None = None  # ignored
    priority: Priority | None = None  # vLLM's: lower is more urgent; None = the API key's default (0)
    max_new_tokens: TokenCount | None = None
    max_length: TokenCount | None = None  # prompt + generated; default 1024
    min_new_tokens: MinTokens | None = None
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None
    json_object: bool | None = None
    json_schema: str | None = None


# OpenAI embeddings.


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    # A text, a list of texts, one input as token ids, or a list of inputs as token ids (OpenAI's four shapes).
    input: str | Annotated[list[str | TokenId | Annotated[list[TokenId], Meta(min_length=1)]], Meta(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # the first N dimensions, normalised again if the model is
    user: str | None = None
    # Extensions, as vLLM and text-embeddings-inference name them: one of the model's prompts by name (default: its
    # default_prompt_name), or a prompt text; truncate=false answers 400 for an input over the model's limit.
    prompt_name: str | None = None
    prompt: str | None = None
    truncate: bool = True
    priority: Priority | None = None  # vLLM's: lower is more urgent; None = the API key's default (0)


class Embedding(msgspec.Struct):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 with encoding_format=base64


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# Rerank and score (the shapes of Cohere's and vLLM's rerank API, and of vLLM's score API).


class RerankDocument(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    model: str
    query: str
    documents: Annotated[list[str | RerankDocument], Meta(min_length=1)]
    top_n: Annotated[int, Meta(ge=1)] | None = None  # None: every document
    return_documents: bool = True
    truncate: bool = True  # false: a pair over the model's limit is a 400 naming `documents`
    priority: Priority | None = None  # vLLM's: lower is more urgent; None = the API key's default (0)


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int  # the document's position in the request
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]  # best first
    usage: RerankUsage


class ScoreRequest(msgspec.Struct, kw_only=True):
    """One text against one or many (text_1 a string), or pairwise (two lists of the same length)."""

    model: str
    text_1: str | Annotated[list[str], Meta(min_length=1)]
    text_2: str | Annotated[list[str], Meta(min_length=1)]
    truncate: bool = True  # false: a pair over the model's limit is a 400 naming `text_2`
    priority: Priority | None = None  # vLLM's: lower is more urgent; None = the API key's default (0)


class ScoreData(msgspec.Struct):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(msgspec.Struct):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


# vLLM's /tokenize and /detokenize.


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A ``prompt`` (tokenised as /v1/completions takes it) or chat ``messages`` (and ``tools``: rendered with the
    chat template, as /v1/chat/completions takes them). ``model`` may be left out where one generative model is
    served. ``add_special_tokens``: the tokenizer's own (BOS, say) around the text; by default for a prompt, not for
    messages (their template writes its own)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)] | None = None
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # vLLM's, refused when set (400 naming them) rather than ignored: the ids would not be what they ask for
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int  # prompt and generated tokens together that the model takes
    tokens: list[int]
    token_strs: list[str] | None = None  # the tokenizer's text of each token, with return_token_strs


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct):
    prompt: str
