"""The frontend's prompt blocks (zserve/frontends/prompt_blocks.py) are the engine's: the same token ids as
``Generator.prepare`` for a text prompt and for chat messages with the chat template, and the block hashes the
engine's prefix cache stores for them (the tiny Llama of tests/support/tinylm.py, nothing downloaded)."""

from __future__ import annotations

import pytest
from tinylm import build_tiny_lm

from zserve import payload
from zserve.batching.prefix_hash import shareable_hashes
from zserve.errors import BadRequest
from zserve.frontends.prompt_blocks import PromptBlocks
from zserve.generation import GenerateRequest, decode_generate_request, parse_generate_request
from zserve.generator.generator import Generator, GeneratorOptions


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tinylm"))


def test_the_frontend_tokenises_and_hashes_as_the_engine_does(tiny_path):
    engine = Generator.load(str(tiny_path), options=GeneratorOptions(num_blocks=64, block_size=4))
    blocks = PromptBlocks({"path": str(tiny_path), "block_size": 4})
    assert blocks(GenerateRequest(prompt="x" * 100)) == []  # no tokenizer yet: routed by load
    blocks.tokenizer.prompt_ids(GenerateRequest(prompt="x"))  # loads it here (start() loads it on a thread)
    text = {"prompt": "Seattle is a city in the state of Washington. " * 3, "max_new_tokens": 2}
    chat = {"messages": [{"role": "system", "content": "DeepSpeed is a deep learning optimization library."},
                         {"role": "user", "content": "The quick brown fox"}], "max_new_tokens": 2}  # fmt: skip
    for body in (text, chat):
        ids = engine.prepare(parse_generate_request(body)).prompt_ids
        item = parse_generate_request(body)  # what the frontend's decode_request makes
        assert blocks.tokenizer.prompt_ids(item) == ids
        hashes = blocks(item)
        assert hashes == shareable_hashes(ids, 4) and len(hashes) >= 3
        # the ids travel in the request, with the fingerprint of the tokenizer that made them: the engine's own
        assert item.prompt_token_ids == ids and item.prompt_tokenizer == engine.tokenizer_fingerprint != ""
        # as the runner gets it: the client's frames, decoded with type=GenerateRequest
        received = decode_generate_request(payload.encode(item)[0])
        assert received == item
        engine.generate([received])  # the engine caches the prompt's blocks
        assert all(h in engine.core.blocks.by_hash for h in hashes)
    assert PromptBlocks({"path": str(tiny_path), "prefix_caching": False})(parse_generate_request(text)) == []
    missing = PromptBlocks({"path": "/nonexistent"})
    missing._load()
    assert not missing.enabled and "/nonexistent" in missing.tokenizer.failed
    assert missing(parse_generate_request(text)) == []
    assert not PromptBlocks({"path": ""}).enabled  # nothing to load


def test_prompt_blocks_take_the_engines_defaults():
    blocks, defaults = PromptBlocks({"path": "x"}), GeneratorOptions()
    assert (blocks.block_size, blocks.enabled) == (defaults.block_size, defaults.prefix_caching)


def test_the_engine_takes_the_frontends_ids_only_from_its_own_tokenizer(tiny_path):
    engine = Generator.load(str(tiny_path), options=GeneratorOptions(num_blocks=64, block_size=4))
    own = engine.tokenizer_fingerprint
    text = {"prompt": "The quick brown fox", "max_new_tokens": 2}
    tokenised = engine.prepare(parse_generate_request(text)).prompt_ids
    other = [5, 6, 7, 8, 9]  # not the text's ids: so a prompt that comes out as these was not tokenised again
    assert other != tokenised

    def prepared(**fields):
        return engine.prepare(parse_generate_request({**text, **fields}, token_ids=True)).prompt_ids

    assert prepared(prompt_token_ids=other, prompt_tokenizer=own) == other
    # made by another tokenizer (another release, another revision), or by nobody said which: tokenised here
    assert prepared(prompt_token_ids=other, prompt_tokenizer="0" * 32) == tokenised
    assert prepared(prompt_token_ids=other) == tokenised
    vocab = engine.core.sampler.vocab_size
    with pytest.raises(BadRequest) as info:
        prepared(prompt_token_ids=[1, vocab], prompt_tokenizer=own)
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(BadRequest) as info:
        prepared(prompt_token_ids=[1, -1], prompt_tokenizer=own)
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(BadRequest) as info:  # the lengths are checked as for a text
        prepared(prompt_token_ids=[1] * (engine.max_context + 1), prompt_tokenizer=own)
    assert info.value.field == "prompt"
    with pytest.raises(BadRequest) as info:
        prepared(prompt_token_ids=[], prompt_tokenizer=own)
    assert info.value.field == "prompt"


def test_a_client_cannot_send_token_ids():
    for name, value in (("prompt_token_ids", [1, 2]), ("prompt_tokenizer", "x")):
        with pytest.raises(BadRequest) as info:
            parse_generate_request({"prompt": "hi", name: value})
        assert info.value.field == name


def test_the_fingerprint_sees_the_special_tokens_a_chat_template_renders(tiny_path):
    """Two copies of one tokenizer whose eos differs (what transformers 5.17 read from SmolLM2's GGUF, fixed in the
    engine's converted copy only) render a template's ``{{ eos_token }}`` differently: their fingerprints differ."""
    from transformers import AutoTokenizer

    from zserve.generation import tokenizer_fingerprint

    one, two = AutoTokenizer.from_pretrained(tiny_path), AutoTokenizer.from_pretrained(tiny_path)
    assert tokenizer_fingerprint(one) == tokenizer_fingerprint(two) != ""
    specials = [t for t in two.all_special_tokens if t != two.eos_token]
    assert specials, two.special_tokens_map
    two.eos_token = specials[0]
    assert tokenizer_fingerprint(one) != tokenizer_fingerprint(two)
