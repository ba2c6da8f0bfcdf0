"""``parse_generate_request``'s refusals: msgspec's message without its path, and the field it is about (read by
``zserve.errors``, as the OpenAI routes' are), for each kind of bad body."""

from __future__ import annotations

import pytest

from zserve.errors import BadRequest
from zserve.generation import GenerateRequest, parse_generate_request


@pytest.mark.parametrize(
    ("body", "message", "field"),
    [
        ({"prompt": "a", "bogus": 1}, "Object contains unknown field `bogus`", "bogus"),
        ({"prompt": "a", "top_p": 2}, "Expected `float` <= 1.0", "top_p"),
        ({"prompt": "x", "stop": [1]}, "Expected `str`, got `int`", "stop"),
        ({"prompt": "x", "logit_bias": {"1": 500}}, "Expected `float` <= 100.0", "logit_bias"),
        ({"prompt": "x", "max_new_tokens": 0}, "Expected `int` >= 1", "max_new_tokens"),
        ({"messages": [{"role": 1, "content": "x"}]}, "Expected `str`, got `int`", "messages"),
        ({}, "give exactly one of `prompt` and `messages`", "prompt"),
        ({"prompt": "a", "messages": []}, "give exactly one of `prompt` and `messages`", "prompt"),
        ({"messages": []}, "`messages` must not be empty", "messages"),
        # a missing key is named itself, as on the OpenAI routes (``messages`` before the one reader in errors.py)
        ({"messages": [{"content": "hi"}]}, "Object missing required field `role`", "role"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "`prompt_token_ids` is set by the server", "prompt_token_ids"),
        (7, "body must be a JSON object", "prompt"),
    ],
)
def test_a_bad_body_is_refused_naming_the_field(body, message, field):
    with pytest.raises(BadRequest) as info:
        parse_generate_request(body)
    assert str(info.value).startswith(message) and " - at `" not in str(info.value)
    assert info.value.field == field


def test_a_good_body_and_a_bare_prompt_parse():
    assert parse_generate_request("hi") == GenerateRequest(prompt="hi")
    assert parse_generate_request({"prompt": "hi", "top_k": 5}).top_k == 5
    internal = parse_generate_request({"prompt": "hi", "prompt_token_ids": [1, 2]}, token_ids=True)
    assert internal.prompt_token_ids == [1, 2]
