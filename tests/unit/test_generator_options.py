"""GeneratorOptions, the one definition of a CausalLM's options: strict conversion with errors that name the
option and its values, the defaults the frontends read, and the one dtype rule of every model kind."""

from __future__ import annotations

import pytest
import torch

from zserve.frontends import openai_params
from zserve.generator.options import GeneratorOptions, default_max_running, resolve_dtype
from zserve.model import Model


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel must be an integer of 1 or more, not 0"),
        ({"max_running": "8"}, "max_running must be an integer of 1 or more, not '8'"),
        ({"num_blocks": -1}, "num_blocks must be an integer of 0 or more, not -1"),
        ({"block_size": True}, "block_size must be an integer of 1 or more, not True"),
        ({"quantization": "int4"}, "quantization 'int4' must be auto, none or int8"),
        ({"dtype": "int8"}, "dtype 'int8' must be auto, float32, bfloat16 or float16"),
        ({"tool_parser": "mistral"}, "tool_parser 'mistral' must be auto, hermes or llama3"),
        ({"prefix_caching": 1}, "prefix_caching must be true or false, not 1"),
        ({"grammar_memory_mb": 0}, "grammar_memory_mb must be a positive number, not 0"),
        ({"colour": "blue"}, "unknown CausalLM option `colour`"),
    ],
)
def test_a_bad_option_is_named_with_what_it_takes(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        GeneratorOptions.of(options)
    assert str(info.value).startswith(message)


def test_options_convert_with_their_defaults_and_the_grammar_budget() -> None:
    options = GeneratorOptions.of({"path": "m", "max_running": 8, "grammar_compile_s": 2, "grammar_cache_mb": 16})
    assert (options.path, options.max_running, options.block_size, options.grammar_compile_s) == ("m", 8, 16, 2.0)
    assert (options.grammar.time_s, options.grammar.memory_bytes, options.grammar.cache_bytes) == (
        2.0,
        1 << 30,
        16 << 20,
    )


def test_the_frontends_read_max_running_from_the_options_or_their_default() -> None:
    assert default_max_running() == GeneratorOptions().max_running == 64
    assert openai_params.max_running(Model()) == default_max_running()
    assert openai_params.max_running(Model(max_running=3)) == 3


def test_one_dtype_rule_for_every_model_kind() -> None:
    assert resolve_dtype("cpu", "auto") == "float32"
    assert resolve_dtype("cpu", "bfloat16") == "bfloat16"
    cuda_auto = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    if torch.cuda.is_available():
        assert resolve_dtype("cuda:0", "auto") == cuda_auto
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, not 'half'"):
        resolve_dtype("cpu", "half")
