"""Structured output in the engine (xgrammar): a random tiny model sampling at temperature 1 writes valid
JSON under ``json_object`` and output matching a schema under ``json_schema``, whatever else is in the
batch; a schema that cannot compile is a BadRequest naming ``response_format``; rows without a grammar are
untouched (greedy still equals the unconstrained run)."""

from __future__ import annotations

import json

import pytest
from tinylm import build_tiny_lm

from zserve.errors import BadRequest
from zserve.generation import GenerateRequest
from zserve.generator import grammar

needs_xgrammar = pytest.mark.skipif(not grammar.available(), reason="xgrammar is not installed (the structured extra)")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["red", "green"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from zserve.generator.generator import Generator, GeneratorOptions

    path = build_tiny_lm(tmp_path_factory.mktemp("tinylm"))
    return Generator.load(str(path), options=GeneratorOptions(num_blocks=512, block_size=8, max_new_tokens=64))


@needs_xgrammar
def test_json_schema_output_matches_the_schema_under_sampling(engine):
    schema = json.dumps(SCHEMA)
    requests = [GenerateRequest(prompt=f"item {i}:", temperature=1.0, seed=i, max_new_tokens=40, json_schema=schema)
                for i in range(12)]  # fmt: skip
    plain = GenerateRequest(prompt="item 0:", max_new_tokens=10, ignore_eos=True)
    out = engine.generate([*requests, plain])
    for r in out[:-1]:
        assert r.finish_reason == "stop", r
        value = json.loads(r.generated_text)
        assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
        assert value["tag"] in ("red", "green")
    assert out[-1].generated_text == engine.generate([plain])[0].generated_text


@needs_xgrammar
def test_json_object_is_valid_json_whenever_it_finishes(engine):
    requests = [GenerateRequest(prompt="{", temperature=1.0, seed=100 + i, max_new_tokens=64, json_object=True)
                for i in range(16)]  # fmt: skip
    out = engine.generate(requests)
    finished = [r for r in out if r.finish_reason == "stop"]
    assert finished, "no sequence closed its object within 64 tokens"
    for r in finished:
        assert isinstance(json.loads(r.generated_text), dict)
    for r in out:  # cut by the length: still a prefix of an object
        assert r.generated_text.lstrip().startswith("{")


@needs_xgrammar
def test_a_bad_schema_is_a_bad_request_naming_response_format(engine):
    with pytest.raises(BadRequest) as info:  # the compiler's refusal
        engine.generate([GenerateRequest(prompt="x", json_schema='{"type": "nonsense"}')])
    assert info.value.field == "response_format"
    for schema in ("{not json", '{"type": "object", "properties": {"a": {"not": {"type": "string"}}}}'):
        with pytest.raises(BadRequest) as info:  # refused before any compile
            engine.prepare(GenerateRequest(prompt="x", json_schema=schema))
        assert info.value.field == "response_format"


def test_without_xgrammar_a_structured_request_is_a_bad_request_and_a_plain_one_is_not(engine, monkeypatch):

    monkeypatch.setattr(grammar, "available", lambda: False)
    monkeypatch.setattr(engine, "_grammars", None)
    with pytest.raises(BadRequest) as info:
        engine.prepare(GenerateRequest(prompt="x", json_object=True))
    assert info.value.field == "response_format" and "xgrammar" in info.value.message
    assert engine.prepare(GenerateRequest(prompt="x")).params.grammar is None
