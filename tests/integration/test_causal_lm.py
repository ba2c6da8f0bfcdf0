"""CausalLM on the engine core, with a tiny model saved and reloaded through from_pretrained(path)."""

from __future__ import annotations

import pytest
import torch
from tinylm import build_tiny_lm

import zserve
from zserve.generation import GenerateRequest
from zserve.generator.detokenize import TextStream


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tinylm"))


@pytest.fixture(scope="module")
def pipe(tiny_path):
    return zserve.pipeline("zserve.models.causal_lm:CausalLM", path=str(tiny_path), block_size=8, num_blocks=256)


def test_pipeline_generates_like_hf_generate(pipe, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zserve.generator.llama import LlamaFamily

    assert isinstance(pipe.model.generator.core.model, LlamaFamily)  # model_impl auto: ours, for a Llama
    prompts = ["DeepSpeed is", "Seattle is", "zserve batches many small"]
    out = pipe(prompts, max_new_tokens=16, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    for prompt, response in zip(prompts, out, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1] :]
        assert response.generated_text == tokenizer.decode(ref, skip_special_tokens=True)
        assert response.generated_length == 16 and response.prompt_length == ids.shape[1]
        assert response.finish_reason == "length"


def test_streaming_deltas_concatenate_to_the_text_and_stop_strings_cut_it(pipe):
    deltas: dict[int, list[str]] = {}
    out = pipe.model.generate(
        ["Emoji travel as", "你好"], max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=3,
        on_delta=lambda i, d: deltas.setdefault(i, []).append(d),
    )  # fmt: skip
    for i, response in enumerate(out):
        assert "".join(deltas.get(i, [])) == response.generated_text
    options = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    [whole] = pipe.model.generate(["Emoji travel as"], **options)
    full = whole.generated_text
    assert len(full) > 4
    stop = full[2:4]
    [cut] = pipe.model.generate(["Emoji travel as"], **options, stop=[stop])
    assert cut.finish_reason == "stop" and cut.generated_text == full[: full.find(stop)]


def test_text_stream_is_correct_across_multibyte_characters(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    text = "bytes: 🚀 🌍 🎉 你好 世界。日本語"
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    held = TextStream(tokenizer, stop=["世界"])
    emitted = "".join(held.push(i) for i in ids)
    assert held.stopped and emitted == text[: text.find("世界")]


def test_the_mii_style_flow_serve_generate_terminate(tiny_path):
    client = zserve.serve("zserve.models.causal_lm:CausalLM", name="tiny", options={"path": str(tiny_path)})
    try:
        responses = client.generate(["DeepSpeed is", "Seattle is"], max_new_tokens=8, ignore_eos=True)
        assert [r.generated_length for r in responses] == [8, 8]
        assert all(r.finish_reason == "length" and r.generated_text for r in responses)
    finally:
        assert client.terminate() == 0


def test_bad_requests_and_options_are_clear_errors(pipe):
    with pytest.raises(zserve.BadRequest) as info:
        pipe.model.decode_request({"text": "no prompt"})
    assert info.value.field == "text"  # the unknown field is named
    assert pipe.model.decode_request("plain text") == GenerateRequest(prompt="plain text")  # travels as it is
    with pytest.raises(ValueError, match="needs the `path` option"):
        zserve.pipeline("zserve.models.causal_lm:CausalLM")
    with pytest.raises(ValueError, match="cpu_linear 'mkl' must be auto, native, onednn or torch"):
        zserve.pipeline("zserve.models.causal_lm:CausalLM", path="x", cpu_linear="mkl")
    with pytest.raises(ValueError, match="cpu_attention 'flash' must be native or torch"):
        zserve.pipeline("zserve.models.causal_lm:CausalLM", path="x", cpu_attention="flash")
    with pytest.raises(ValueError, match="cuda_graphs must be true or false, not 'yes'"):
        zserve.pipeline("zserve.models.causal_lm:CausalLM", path="x", cuda_graphs="yes")
    with pytest.raises(ValueError, match="model_impl 'vllm' must be auto, zserve or transformers"):
        zserve.pipeline("zserve.models.causal_lm:CausalLM", path="x", model_impl="vllm")
    with pytest.raises(zserve.BadRequest) as info:  # an unknown option is named
        pipe.model.decode_request({"prompt": "x", "colour": "blue"})
    assert info.value.field == "colour"
    with pytest.raises(zserve.BadRequest) as info:
        pipe(["x"], temperature=-1)
    assert info.value.field == "temperature"
    with pytest.raises(zserve.BadRequest) as info:  # vLLM's limit of 20 alternatives, for prompt logprobs too
        pipe.model.decode_request({"prompt": "x", "prompt_logprobs": 21})
    assert info.value.field == "prompt_logprobs"


def test_serve_refuses_a_model_defined_in_main():
    from zserve.config import ConfigError

    class Local(zserve.Model):
        def predict(self, batch):
            return batch

    Local.__module__ = "__main__"
    with pytest.raises(ConfigError, match="define it in a module"):
        zserve.serve(Local)
