"""Generation over HTTP through the whole deployment (supervisor, broker, engine, gunicorn): the real
``openai`` client against /v1/completions and /v1/chat/completions, DeepSpeed-MII's REST requests (curl)
against /mii/{deployment}, OpenAI-shaped errors, and a client that goes away mid-stream."""

from __future__ import annotations

import http.client
import json
import time
from typing import Literal
from urllib.parse import urlparse

import openai
import pydantic
import pytest
import torch
from tinylm import build_tiny_lm

import zserve
from bench.generation import mii_rest_client  # bench is a package at the repo root (pytest's pythonpath = ["."])
from zserve.generator import grammar


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tinylm"))


@pytest.fixture(scope="module")
def served(tiny_path):
    options = {"path": str(tiny_path), "block_size": 8, "num_blocks": 256, "max_running": 8, "max_new_tokens": 16}
    client = zserve.serve("zserve.models.causal_lm:CausalLM", name="tiny", options=options, timeout_ms=120_000)
    try:
        yield client
    finally:
        assert client.terminate() == 0


@pytest.fixture(scope="module")
def oai(served):
    # closed before the deployment stops: an idle keep-alive connection left open holds its shutdown ~5 s
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_completions_with_the_openai_client_match_the_python_client(served, oai):
    [direct] = served.generate("DeepSpeed is", max_new_tokens=12, ignore_eos=True)
    out = oai.completions.create(model="tiny", prompt="DeepSpeed is", max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == direct.generated_text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == direct.prompt_length
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    two = oai.completions.create(model="tiny", prompt=["DeepSpeed is", "Seattle is"], max_tokens=5, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == direct.generated_text[
        : len(two.choices[0].text)
    ]


def test_streamed_completion_concatenates_to_the_whole(served, oai):
    whole = oai.completions.create(model="tiny", prompt="Emoji travel as", max_tokens=30, temperature=0.8, seed=4,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    events = list(oai.completions.create(model="tiny", prompt="Emoji travel as", max_tokens=30, temperature=0.8,
                                         seed=4, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))  # fmt: skip
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert len(events) > 3 and text == whole.choices[0].text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].usage.completion_tokens == 30


def test_chat_completions_streamed_and_not(served, oai):
    messages = [{"role": "user", "content": "hello there"}]
    chat = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "min_tokens": 10})  # fmt: skip
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 10
    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


def test_errors_come_in_openai_shape(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="nope", prompt="x")
    assert info.value.body["param"] == "model"
    cases = [
        ({"temperature": -1}, "temperature"),
        ({"n": 9}, "n"),  # past the engine's 8 running slots
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 100_000}, "max_new_tokens"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model="tiny", prompt="x", extra_body=extra)
        assert info.value.body["param"] == param, extra
        assert info.value.body["type"] == "invalid_request_error"
    neutral = {"logprobs": False, "n": None, "top_logprobs": 0, "presence_penalty": 0}  # what wrappers send
    ok = oai.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=neutral)
    assert ok.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="tiny", prompt=["a", "b"], stream=True)
    assert info.value.body["param"] == "prompt"  # one prompt per stream
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=[])
    assert info.value.body["param"] == "messages"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    for extra, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs"),
                         ({"response_format": {"type": "xml"}}, "response_format"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                          "response_format"),
                         ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                         ({"tool_choice": "required"}, "tool_choice")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(**chat, extra_body=extra)
        assert info.value.body["param"] == param, extra


def test_chat_logprobs_and_completion_logprobs(oai):
    messages = [{"role": "user", "content": "hello there"}]
    chat = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
    plain = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content
    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    carrying = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    streamed = [t for c in carrying for t in c.logprobs.content]
    # to rounding: the second request may read the first's prompt blocks from the prefix cache
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert len(carrying) > 1 and carrying[0].delta.content  # token by token, each with its chunk's text
    assert all(c.delta.content or c.finish_reason for c in carrying)  # a token's logprobs go with its text
    args = {"model": "tiny", "prompt": "DeepSpeed is", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    out = oai.completions.create(**args)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    events = [e.choices[0] for e in oai.completions.create(stream=True, **args) if e.choices and e.choices[0].logprobs]
    assert len(events) > 1
    assert [t for e in events for t in e.logprobs.tokens] == lp.tokens
    assert [o for e in events for o in e.logprobs.text_offset] == lp.text_offset
    assert [x for e in events for x in e.logprobs.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_as_hf_computes_them(oai, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "DeepSpeed is a library for"
    out = oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True,
                                 extra_body={"ignore_eos": True})  # fmt: skip
    plain = oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    choice, lp = out.choices[0], out.choices[0].logprobs
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    ids = tokenizer(prompt)["input_ids"]
    assert choice.text == prompt + plain.choices[0].text
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # equal to rounding, not bit for bit: the plain request reads the echo's first block from the prefix cache
    # and computes the rest as a later chunk, whose attention rounds otherwise than the whole prompt's
    assert lp.token_logprobs[len(ids) :] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[len(ids)] == len(prompt) and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    for p, token in enumerate(ids[1:]):
        assert abs(lp.token_logprobs[p + 1] - float(expected[p, token])) < 1e-4
        top = torch.topk(expected[p], 3).indices.tolist()
        assert set(lp.top_logprobs[p + 1]) == {tokenizer.decode([t]) for t in top}
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4
    events = list(oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                         echo=True, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    [last] = [e.choices[0] for e in events if e.choices and e.choices[0].logprobs]  # the prompt's come first
    assert last.finish_reason == "length" and last.logprobs.tokens == lp.tokens
    assert last.logprobs.text_offset == lp.text_offset and "".join(e.choices[0].text for e in events) == choice.text


def test_n_choices_are_seeded_each_and_usage_counts_every_choice(oai):
    args = {"model": "tiny", "prompt": "Seattle is", "max_tokens": 10, "temperature": 1.0, "seed": 11,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    four = oai.completions.create(n=4, **args)
    again = oai.completions.create(n=4, **args)
    texts = [c.text for c in four.choices]
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1  # each choice its own sequence
    one = oai.completions.create(**{**args, "seed": 13})
    assert one.choices[0].text == texts[2]  # choice j draws with seed + j, whatever the batch
    assert four.usage.completion_tokens == 40 and four.usage.prompt_tokens == one.usage.prompt_tokens
    events = list(oai.completions.create(n=4, stream=True, stream_options={"include_usage": True}, **args))
    streamed = ["".join(e.choices[0].text for e in events if e.choices and e.choices[0].index == i) for i in range(4)]
    assert streamed == texts and events[-1].usage.completion_tokens == 40
    finished = [e.choices[0].index for e in events if e.choices and e.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2, 3]
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, seed=3,
                                       max_tokens=5, extra_body={"ignore_eos": True})  # fmt: skip
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 10


def test_penalties_bias_and_echo(oai):
    args = {"model": "tiny", "prompt": "DeepSpeed is", "max_tokens": 12, "temperature": 0, "logprobs": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = oai.completions.create(**args)
    tokens = plain.choices[0].logprobs.tokens
    assert len(set(tokens)) < len(tokens)  # a tiny random model repeats itself
    fresh = oai.completions.create(**args, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(fresh.choices[0].logprobs.tokens)) > len(set(tokens))
    repeated = oai.completions.create(**{**args, "extra_body": {"ignore_eos": True, "repetition_penalty": 2.0}})
    assert repeated.choices[0].text != plain.choices[0].text
    forced = oai.completions.create(**{**args, "max_tokens": 4}, logit_bias={"7": 100})
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    echoed = oai.completions.create(model="tiny", prompt="DeepSpeed is", max_tokens=12, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert echoed.choices[0].text == "DeepSpeed is" + plain.choices[0].text


class Item(pydantic.BaseModel):
    ok: bool
    n: int = pydantic.Field(ge=0, le=99)
    tag: Literal["red", "green"]


@pytest.mark.skipif(not grammar.available(), reason="xgrammar is not installed (the structured extra)")
def test_structured_output_parses_with_the_openai_client(oai):
    for i in range(20):
        out = oai.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": f"item {i}"}],
                                         response_format=Item, temperature=1.0, seed=i, max_tokens=60)  # fmt: skip
        assert out.choices[0].finish_reason == "stop" and isinstance(out.choices[0].message.parsed, Item)
    out = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json please"}], n=8,
                                      response_format={"type": "json_object"}, temperature=1.0, seed=5,
                                      max_tokens=200)  # fmt: skip
    finished = [c for c in out.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(c.message.content), dict) for c in finished)
    done = oai.completions.create(model="tiny", prompt="x", max_tokens=60, temperature=1.0, seed=1,
                                  extra_body={"guided_json": Item.model_json_schema()})  # fmt: skip
    Item.model_validate_json(done.choices[0].text)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], response_format=bad)
    assert info.value.body["param"] == "response_format"


def test_mii_rest_benchmark_requests_run_unchanged(served):
    """The REST part of DeepSpeed-MII's multi-process REST benchmark: one curl per prompt, at once."""
    url = f"{served.url}/mii/tiny"
    results = mii_rest_client.call_mii_rest_curl(url, mii_rest_client.QUERIES, max_length=40)
    assert len(results) == len(mii_rest_client.QUERIES)
    for [r] in results:
        assert r["generated_length"] == 40 - r["prompt_length"]  # max_length caps prompt + generated
        assert r["finish_reason"] == "length" and isinstance(r["generated_text"], str)
    [greedy] = mii_rest_client.parse_response(_post(url, {"prompts": ["DeepSpeed is"], "do_sample": False,
                                                          "max_new_tokens": 8, "ignore_eos": True}))  # fmt: skip
    [direct] = served.generate("DeepSpeed is", max_new_tokens=8, ignore_eos=True)
    assert greedy["generated_text"] == direct.generated_text
    status, body = _post_status(f"{served.url}/mii/tiny", {"prompt": "typo"})
    assert status == 400 and json.loads(body)["error"]["field"] == "prompts"
    status, body = _post_status(f"{served.url}/mii/nope", {"prompts": "x"})
    assert status == 404 and json.loads(body)["error"]["type"] == "model_not_found"


def test_client_gone_mid_stream_aborts_the_sequence(served):
    u = urlparse(served.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": "tiny", "prompt": "DeepSpeed is", "max_tokens": 400, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: ")  # the first event is out
    seen_running = next(m for m in served.health().models if m.name == "tiny").running_sequences
    conn.sock.close()  # gone, mid-generation
    conn.close()
    deadline = time.monotonic() + 20
    while True:
        m = next(m for m in served.health().models if m.name == "tiny")
        if m.running_sequences == 0 and m.free_kv_blocks == 256:
            break
        assert time.monotonic() < deadline, "the abandoned sequence kept running"
        time.sleep(0.05)
    assert seen_running == 1


def _post_status(url: str, body: dict) -> tuple[int, bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def _post(url: str, body: dict) -> bytes:
    status, data = _post_status(url, body)
    assert status == 200, data
    return data


def post_json(url: str, body: dict) -> tuple[int, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_tokenize_gives_the_ids_the_engine_takes(served, oai, tiny_path):
    """vLLM's /tokenize and /detokenize: a prompt's and chat messages' ids are the engine's (usage counts them)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    prompt = "Seattle is a city in the state of Washington."
    status, out = post_json(served.url + "/tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == tokenizer(prompt)["input_ids"] and out["count"] == len(out["tokens"]) > 5
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] == AutoConfig.from_pretrained(tiny_path).max_position_embeddings
    used = oai.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert used == out["count"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    status, chat = post_json(served.url + "/tokenize", {"messages": messages})  # model: the one served
    assert status == 200, chat
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat["token_strs"] is None
    used = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage.prompt_tokens
    assert used == chat["count"]
    status, plain = post_json(served.url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and plain["count"] < chat["count"] and chat["tokens"][: plain["count"]] == plain["tokens"]
    status, back = post_json(served.url + "/detokenize", {"model": "tiny", "tokens": chat["tokens"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(chat["tokens"]) and "hello there" in back["prompt"]


def test_tokenize_errors_name_the_field(served):
    url = served.url
    bad_tool = {"type": "function", "function": {"name": "bad name!"}}  # chat completions refuse it too
    for path, body, status, param in [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": "tiny"}, 400, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": 3}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [bad_tool]}, 400, "tools"),
        ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, 400, "chat_template"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/detokenize", {"model": "tiny", "tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ]:
        got, out = post_json(url + path, body)
        assert (got, out["error"]["param"]) == (status, param), (path, body, out)
        assert out["error"]["type"] == "invalid_request_error"
    # a history call's arguments nested past the interpreter's limit: rendered as the text they are, not a 500
    deep = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [deep]}]
    got, out = post_json(url + "/tokenize", {"messages": history})
    assert got == 200 and out["count"] > 0, out
    got, out = post_json(url + "/v1/chat/completions", {"model": "tiny", "messages": history, "max_tokens": 1})
    assert got == 200, out
