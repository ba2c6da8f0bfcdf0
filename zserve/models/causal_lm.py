"""``zserve.models.causal_lm:CausalLM``: autoregressive LLMs on the generative engine
(``zserve.generator.generator``): continuous batching over a paged KV cache, chunked prefill, prefix
caching, per-request sampling, stop ids and strings, incremental detokenisation.

This handler keeps the options and the request hooks; ``setup`` builds the ``Generator`` (model,
tokenizer, KV pool, core), which the engine process's runner drives when served and ``generate`` drives in
process (``zserve.pipeline``).

Options: ``path`` (a local folder, a hub name, or ``package:NAME`` for an installed package's folder),
``gguf_file`` (converted once into a cache, see ``zserve.gguf_cache``), ``dtype`` ("auto": bfloat16 on CUDA,
float32 on a CPU; "float32", "bfloat16", "float16"), ``model_impl`` ("auto": zserve's own model code for the
Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3: merged projections, see zserve/generator/llama.py) and
Hugging Face's modules for every other architecture; "zserve": ours or an error; "transformers": HF's), and
the engine knobs: ``kv_cache_bytes`` (the KV pool; 0 = 1 GiB on a CPU, 90% of the free
memory on a GPU), or ``num_blocks`` to size it in blocks, ``block_size``, ``max_batched_tokens`` (token
budget per step), ``max_running`` (sequences per step; also the broker's limit per engine),
``chunked_prefill``, ``prefix_caching``, ``max_new_tokens`` (the default per request), ``cpu_linear``
("auto": on a CPU each product runs on what measured fastest for its shape and row count when the engine
started, among a C kernel compiled on first use, oneDNN and torch, the weights packed once; "native": the C
kernel; "onednn": prepacked for oneDNN; "torch": as loaded),
``cpu_attention`` ("native": on a CPU decodes attend through a C kernel compiled on first use; "torch"),
``quantization`` (on a CPU: "int8" quantises the linear layers but the LM head at load, per output channel,
kept int8 in memory and run through a C kernel; "auto": a GGUF's Q8_0 tensors kept as they are; "none":
every weight dequantised; see docs/generation.md),
``cuda_graphs`` (on CUDA, decode-only steps replay graphs captured at start; see docs/generation.md),
and ``tool_parser`` (how /v1/chat/completions reads the model's own tool calls under ``tool_choice: auto``:
"hermes" for ``<tool_call>{...}</tool_call>``, "llama3" for Llama 3's JSON calls, "auto": from the chat
template; see docs/openai.md), and the budget of one schema's grammar (``grammar_compile_s``, default 10,
``grammar_memory_mb``, default 1024: past either the request is a 400 naming ``response_format`` or ``tools``)
and of the compiled grammars' cache (``grammar_cache_mb``, default 256).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from zserve.generation import GenerateResponse, parse_generate_request
from zserve.model import Model


class CausalLM(Model):
    generative = True  # served by the generative engine: sequences, not batches (see zserve/generator/generator.py)

    def __init__(
        self,
        path: str = "",
        gguf_file: str = "",
        dtype: str = "auto",
        kv_cache_bytes: int = 0,
        num_blocks: int = 0,
        block_size: int = 16,
        max_batched_tokens: int = 512,
        max_running: int = 64,
        chunked_prefill: bool = True,
        prefix_caching: bool = True,
        max_new_tokens: int = 64,
        tensor_parallel: int = 1,
        cpu_linear: str = "auto",
        cpu_attention: str = "native",
        quantization: str = "auto",
        model_impl: str = "auto",
        tool_parser: str = "auto",
        cuda_graphs: bool = True,
        grammar_compile_s: float = 10.0,
        grammar_memory_mb: int = 1024,
        grammar_cache_mb: int = 256,
    ) -> None:
        super().__init__(
            path=path, gguf_file=gguf_file, dtype=dtype, kv_cache_bytes=kv_cache_bytes, num_blocks=num_blocks,
            block_size=block_size, max_batched_tokens=max_batched_tokens, max_running=max_running,
            chunked_prefill=chunked_prefill, prefix_caching=prefix_caching, max_new_tokens=max_new_tokens,
            tensor_parallel=tensor_parallel, cpu_linear=cpu_linear, cpu_attention=cpu_attention,
            quantization=quantization, model_impl=model_impl, tool_parser=tool_parser, cuda_graphs=cuda_graphs,
            grammar_compile_s=grammar_compile_s, grammar_memory_mb=grammar_memory_mb, grammar_cache_mb=grammar_cache_mb,
        )  # fmt: skip
        if not path:
            raise ValueError("CausalLM needs the `path` option (a local folder, a hub name or package:NAME)")
        if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be an integer of 1 or more, not {tensor_parallel!r}")
        if cpu_linear not in ("auto", "native", "onednn", "torch"):
            raise ValueError(f"cpu_linear {cpu_linear!r} must be auto, native, onednn or torch")
        if cpu_attention not in ("native", "torch"):
            raise ValueError(f"cpu_attention {cpu_attention!r} must be native or torch")
        if quantization not in ("auto", "none", "int8"):
            raise ValueError(f"quantization {quantization!r} must be auto, none or int8")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {dtype!r} must be one of auto, float32, bfloat16, float16")
        if model_impl not in ("auto", "zserve", "transformers"):
            raise ValueError(f"model_impl {model_impl!r} must be auto, zserve or transformers")
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, not {cuda_graphs!r}")
        for name, value in (("grammar_compile_s", grammar_compile_s), ("grammar_memory_mb", grammar_memory_mb),
                            ("grammar_cache_mb", grammar_cache_mb)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number, not {value!r}")
        if tool_parser not in ("auto", "hermes", "llama3"):
            raise ValueError(f"tool_parser {tool_parser!r} must be auto, hermes or llama3")
        self.path = path
        self.gguf_file = gguf_file
        self.dtype = dtype
        self.generator: Any = None  # a Generator after setup (torch is imported lazily)

    # ---- engine side ----

    def setup(self, device: str) -> None:
        from zserve.generator.generator import Generator, GeneratorOptions
        from zserve.generator.grammar_compile import CompileBudget

        o = self.options
        options = GeneratorOptions(
            kv_cache_bytes=int(o["kv_cache_bytes"]), num_blocks=int(o["num_blocks"]), block_size=int(o["block_size"]),
            max_batched_tokens=int(o["max_batched_tokens"]), max_running=int(o["max_running"]),
            chunked_prefill=bool(o["chunked_prefill"]), prefix_caching=bool(o["prefix_caching"]),
            max_new_tokens=int(o["max_new_tokens"]), tensor_parallel=int(o["tensor_parallel"]),
            cpu_linear=str(o["cpu_linear"]), cpu_attention=str(o["cpu_attention"]), model_impl=str(o["model_impl"]),
            quantization=str(o["quantization"]),
            cuda_graphs=bool(o["cuda_graphs"]),
            grammar=CompileBudget(time_s=float(o["grammar_compile_s"]), memory_bytes=int(o["grammar_memory_mb"]) << 20,
                                  cache_bytes=int(o["grammar_cache_mb"]) << 20),
        )  # fmt: skip
        self.generator = Generator.load(
            self.path, device=device, dtype=self.dtype, gguf_file=self.gguf_file, options=options
        )

    def warmup(self) -> None:
        self.generator.warmup()

    # ---- request hooks (frontends, and the engine for direct clients) ----

    def decode_request(self, body: Any) -> dict[str, Any]:
        return msgspec.to_builtins(parse_generate_request(body))

    def encode_response(self, output: GenerateResponse | dict[str, Any]) -> dict[str, Any]:
        return output if isinstance(output, dict) else msgspec.to_builtins(output)

    def chat_template(self) -> str | None:
        """The chat template's text as the model's files hold it (tokenizer_config.json, chat_template.jinja),
        read without loading the tokenizer and without the network (a hub model only from the local cache);
        None when not found. The frontend picks the tool-call parser by it."""
        import json
        from pathlib import Path

        from zserve.gguf_cache import resolve_model_path

        try:
            path = resolve_model_path(self.path)
        except (OSError, ValueError):
            return None
        texts = []
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            file: Any = Path(path) / name
            if not file.is_file():
                try:
                    from huggingface_hub import try_to_load_from_cache

                    file = try_to_load_from_cache(path, name)
                except Exception:  # not a hub name
                    file = None
                if not isinstance(file, str):
                    continue
            text = Path(file).read_text(errors="replace")
            if name.endswith(".json"):
                template = json.loads(text).get("chat_template")
                text = template if isinstance(template, str) else json.dumps(template) if template else ""
            texts.append(text or "")
        return "\n".join(texts) or None

    # ---- in process (zserve.pipeline) ----

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        on_delta: Callable[[int, str], None] | None = None,
        **sampling: Any,
    ) -> list[GenerateResponse]:
        """One response per prompt, generated together in this process. ``sampling``: the fields of
        ``GenerateRequest`` (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
        ``stop_token_ids``, ``ignore_eos``, ``min_new_tokens``, ``max_length``); ``on_delta(index, text)``
        streams text as it is produced."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        requests = [parse_generate_request({"prompt": p, **sampling}) for p in prompts]
        return self.generator.generate(requests, on_delta)
