"""A tiny Qwen2 model whose chat template renders tools and tool calls as Qwen2.5's does (Hermes-style
``<tool_call>`` JSON, ``<tool_response>`` for tool messages), with a locally trained byte-level BPE tokenizer
(``<|im_start|>``/``<|im_end|>`` special, ``<tool_call>``/``</tool_call>`` added tokens as in Qwen's), saved
like a hub model. Nothing is downloaded. Its weights are random: ``tool_choice`` auto gets plain text from it
unless a test teaches it a call (``teach``)."""

from __future__ import annotations

from pathlib import Path

from tinylm import byte_level_bpe

# Qwen2.5-Instruct's template, its tool parts as they are (the system prompt's wording shortened).
TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""  # noqa: E501

CORPUS = [
    "You are a helpful assistant.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "For each function call, return a json object with function name and arguments within XML tags:",
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}',
    '{"name": "get_weather", "arguments": {"city": "Paris"}} {"unit": "celsius", "days": 3, "ok": true}',
    "What is the weather in Paris? It is sunny and 21 degrees. The quick brown fox jumps over the lazy dog.",
] * 20


def build_tiny_tool_lm(out: Path) -> Path:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = byte_level_bpe(CORPUS, 600, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     additional_special_tokens=["<|im_start|>"])  # fmt: skip
    hf_tok.add_tokens(["<tool_call>", "</tool_call>"])  # not special: they stay in the decoded text, as in Qwen's
    hf_tok.chat_template = TEMPLATE
    config = Qwen2Config(
        vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out


def teach(path: Path, prompt: str, answer: str, steps: int = 150) -> None:
    """Overfit the model at ``path`` (in place) so that greedy decoding after ``prompt`` writes ``answer``
    and ends: a model that really writes a tool call in its own format, for ``tool_choice`` auto."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt_ids + answer_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    model.save_pretrained(path)
