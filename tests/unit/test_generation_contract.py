"""The generation contract (issue 39): an HTTP body is decoded once into its typed Struct, mapped into one
``GenerateRequest`` (``openai_params``, the MII route), which travels msgpack-encoded as it is and is decoded by
the engine with ``type=GenerateRequest``. The ranges are declared once (``zserve.generation``), and the frames are
the ones an engine of the day before reads."""

from __future__ import annotations

import msgspec
import msgspec.inspect as mi
import pytest

from zserve import payload
from zserve.errors import BadRequest
from zserve.frontends import openai_params
from zserve.frontends.api_types import ChatCompletionRequest, CompletionRequest, MiiRequest, decode_body
from zserve.frontends.generate_routes import _mii_requests
from zserve.generation import GenerateRequest, decode_generate_request, parse_generate_request


def completions(**fields) -> list[GenerateRequest]:
    body = decode_body({"model": "m", "prompt": "hi", **fields}, CompletionRequest)
    return openai_params.completion_requests(body, max_n=8)


def test_max_tokens_is_read_once_from_the_typed_body():
    assert completions()[0].max_new_tokens == openai_params.COMPLETIONS_MAX_TOKENS  # OpenAI's default, 16
    assert completions(max_tokens=5)[0].max_new_tokens == 5
    assert completions(max_tokens=5, max_completion_tokens=7)[0].max_new_tokens == 7  # the newer name wins
    chat = decode_body({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest)
    assert openai_params.chat_request(chat, max_n=8).max_new_tokens is None  # chat: the model's default


def test_a_null_token_limit_is_the_models_own_as_before_the_typed_body():
    """Left out: the route's default (16 for completions); null: no limit of the client's, the model's own
    (``GenerateRequest``'s default), as the raw-dict code read it and vLLM does; the first name given wins."""
    assert completions(max_tokens=None)[0].max_new_tokens is None
    assert completions(max_completion_tokens=None, max_tokens=50)[0].max_new_tokens is None
    assert completions(max_completion_tokens=7, max_tokens=None)[0].max_new_tokens == 7


def test_openai_fields_map_to_the_generate_request():
    [r] = completions(top_k=-1, stop="x", seed=3, min_tokens=2, logit_bias={"5": 1.5}, logprobs=2, echo=True)
    assert (r.prompt, r.temperature, r.top_k, r.stop, r.seed, r.min_new_tokens) == ("hi", 1.0, 0, ["x"], 3, 2)
    assert r.logit_bias == {"5": 1.5} and r.logprobs == r.prompt_logprobs == 2
    two = completions(prompt=["a", "b"], n=2, seed=10)
    assert [(c.prompt, c.seed) for c in openai_params.choices(two, 2)] == [("a", 10), ("a", 11), ("b", 10), ("b", 11)]
    chat = decode_body({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                        {"type": "text", "text": "b"}]}], "logprobs": True, "top_logprobs": 3,
                        "response_format": {"type": "json_object"}}, ChatCompletionRequest)  # fmt: skip
    r = openai_params.chat_request(chat, max_n=8)
    assert r.messages[0].content == "ab" and r.logprobs == 3 and r.json_object


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"n": 9}, "n"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"), ({"prompt": []}, "prompt"),
     ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs")],
)  # fmt: skip
def test_what_a_range_cannot_say_is_refused_naming_the_field(fields, field):
    with pytest.raises(BadRequest) as info:
        completions(**fields)
    assert info.value.field == field


def _field_types(struct: type) -> dict[str, object]:
    """Each field's type, ``X | None`` as ``X`` (the bodies' optional fields)."""
    out = {}
    for f in mi.type_info(struct).fields:
        t = f.type
        if isinstance(t, mi.UnionType):
            t = next(x for x in t.types if not isinstance(x, mi.NoneType))
        out[f.name] = t
    return out


def test_the_ranges_are_generate_requests_own():
    ours = _field_types(GenerateRequest)
    openai = _field_types(CompletionRequest)
    pairs = [("max_new_tokens", "max_tokens"), ("max_new_tokens", "max_completion_tokens"),
             ("temperature", "temperature"), *openai_params._SAME]  # fmt: skip
    for mine, theirs in pairs:
        assert openai[theirs] == ours[mine], theirs
    mii = _field_types(MiiRequest)
    for name in ("max_new_tokens", "max_length", "min_new_tokens", "temperature", "top_k", "top_p", "seed",
                 "stop_token_ids", "presence_penalty", "repetition_penalty", "logit_bias", "logprobs"):  # fmt: skip
        assert mii[name] == ours[name], name
    assert ours["seed"] == mi.IntType(ge=-(2**63), le=2**63 - 1)  # int64, as torch takes it


def test_mii_defaults_and_its_unknown_fields():
    [r] = _mii_requests(MiiRequest(prompts="x"))
    assert (r.temperature, r.top_p, r.max_length, r.max_new_tokens) == (1.0, 0.9, 1024, None)
    [r] = _mii_requests(MiiRequest(prompts=["x"], do_sample=False, max_new_tokens=8, stop="s", presence_penalty=1.0))
    assert (r.temperature, r.top_p, r.max_length, r.max_new_tokens, r.stop) == (0.0, 1.0, None, 8, ["s"])
    assert r.presence_penalty == 1.0


def test_the_request_travels_typed_and_as_yesterdays_frames():
    request = parse_generate_request({"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 7,
                                      "stop": ["\n"], "seed": -(2**63), "logit_bias": {"3": -100.0}})  # fmt: skip
    request.prompt_token_ids, request.prompt_tokenizer = [1, 2, 3], "f" * 32  # as PromptBlocks adds them
    frames = payload.encode(request)
    assert len(frames) == 1
    assert decode_generate_request(frames[0]) == request  # the engine's one decode
    # what a frontend sent before (the dict of to_builtins) and what an engine read before: the same values
    assert payload.decode(frames) == msgspec.to_builtins(request)
    assert parse_generate_request(payload.decode(frames), token_ids=True) == request


@pytest.mark.parametrize(
    ("value", "field"),
    [({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"), ({"prompt": "x", "seed": 2**63}, "seed"),
     ({"prompt": "x", "bogus": 1}, "bogus"), ({}, "prompt")],
)  # fmt: skip
def test_the_engine_refuses_a_bad_request_naming_the_field(value, field):
    with pytest.raises(BadRequest) as info:
        decode_generate_request(msgspec.msgpack.encode(value))
    assert info.value.field == field
    with pytest.raises(BadRequest) as info:
        decode_generate_request(b"\xc1")
    assert info.value.field == "body"
