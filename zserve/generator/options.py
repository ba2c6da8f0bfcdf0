"""``GeneratorOptions``: the one definition of a ``CausalLM`` model's options (``[models.options]``), their
types, ranges, defaults and meaning. ``CausalLM`` builds it with ``GeneratorOptions.of(options)``; the
``Generator`` reads it; the frontends read ``max_running``'s default from it; docs/generation.md's "Engine
options" table is generated from it (``python -m tools.config_reference --engine-options docs/generation.md``,
checked by tests/docs/test_config_reference.py).

No torch here (``resolve_dtype`` imports it when asked): the frontends and the docs generator import this module.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args, get_type_hints

import msgspec
import msgspec.inspect as mi

from zserve.errors import validation_parts

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)

Positive = Annotated[int, msgspec.Meta(ge=1)]


class GeneratorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine knobs (`[models.options]` of a `CausalLM` model; `max_batch_size`/`max_wait_ms` do not apply:
    batching happens in the engine, every step)."""

    path: str = ""
    """Required: a local folder, a hub name, or `package:NAME` (an installed package's folder) for
    `from_pretrained`."""
    gguf_file: str = ""
    """A GGUF file in `path`. With `quantization = "auto"` on a CPU in one process its quantized blocks are kept
    (config and tokenizer read once from its metadata into the cache); otherwise it is converted once into the
    cache, then loaded as a normal checkpoint."""
    dtype: Dtype = "auto"
    """`auto`: bfloat16 on a CUDA device that supports it, else float32 (`resolve_dtype`). On a CPU with bf16 units
    (AVX512-BF16, AMX), `bfloat16` halves the bytes every step reads and oneDNN computes its products there, while
    fp32's run through zserve's C kernels: a decode step of SmolLM2 at 1 thread (AMD EPYC with AVX512-BF16,
    `python -m bench.studies.step --impls zserve,zserve@bfloat16`) is 0.80x fp32's time at 32 decodes and the same
    as fp32's at 1-8; output is bf16's, not fp32's. Its KV cache stays fp32 on a CPU, so that
    `cpu_attention = "native"` reads it."""
    kv_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The KV pool; `0` = 1 GiB on a CPU, 90% of the free memory on a GPU (after the weights)."""
    num_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The pool in blocks instead (overrides `kv_cache_bytes`)."""
    block_size: Positive = 16
    """Tokens per KV block."""
    max_batched_tokens: Positive = 512
    """Token budget per step (decodes first, then prefill chunks); a step also pays a fixed cost (all the weights
    read once: a step of one decode of SmolLM2 fp32 takes ~27 ms on 1 thread of an AMD EPYC with zserve's C kernels,
    [benchmarks](benchmarks.md#against-vllms-cpu-build)), so larger budgets prefill a burst sooner at the price of
    longer steps for the decodes sharing them."""
    max_running: Positive = 64
    """Sequences per step; also how many the broker admits to one engine."""
    chunked_prefill: bool = True
    """Split long prompts over steps; `false` = a prompt's prefill in one step."""
    prefix_caching: bool = True
    """Share the KV of identical prompt prefixes (full blocks) between requests."""
    max_new_tokens: Positive = 64
    """Default per request."""
    tool_parser: Literal["auto", "hermes", "llama3"] = "auto"
    """How `/v1/chat/completions` reads the model's own tool calls under `tool_choice: "auto"`: `"hermes"` for
    `<tool_call>{...}</tool_call>`, `"llama3"` for Llama 3's JSON calls, `"auto"`: from the chat template
    ([tool calling](openai.md#tool-calling))."""
    tensor_parallel: Positive = 1
    """Processes in each engine's group ([tensor parallel](#tensor-parallel)); must divide the model's attention
    and key/value heads."""
    cpu_linear: Literal["auto", "native", "onednn", "torch"] = "auto"
    """On a CPU, the linear layers' weights are packed once at load. `"auto"`: when the engine starts, each layer
    shape is timed at the row counts the engine runs (1, 2, 8, 32, `max_running`, `max_batched_tokens`; the
    `lm_head` up to `max_running`) on zserve's own C kernel in each of its schedules for this CPU's instruction set
    (`zserve/generator/native_linear.py`: tiles sized to AVX-512's 32 registers, AVX2's 16, or a portable 4-float
    build, compiled on first use with `$CC`/`cc`), on oneDNN with the weight reordered, and on `nn.Linear`, within
    ~2 s (up to 64 rows on 1.5x the last-level cache of the shape's weights, so that they are read from memory as in
    a real step); each row count then runs the fastest, oneDNN unless another beat it by 3%, and oneDNN for whatever
    was left unmeasured when a machine far busier than its cores ran it out of time
    (`zserve/generator/kernel_tune.py`; a shape whose row counts chose kernels with different weight layouts keeps
    one packed copy for each). The choice is cached in the zserve cache by CPU model and flags, kernel source,
    thread count and shapes, and logged in one line with the measured ratio against oneDNN
    ([benchmarks](benchmarks.md#cpu-kernels-per-instruction-set)). `"native"`: fp32 products through the C kernel's
    default schedule and the rest (bf16, a layer whose outputs are not a multiple of the vector width, a machine
    without a C compiler) through oneDNN; `"onednn"`: every layer reordered for oneDNN, what vLLM's CPU build does;
    `"torch"` keeps `nn.Linear` as loaded. Not applied under `tensor_parallel` > 1."""
    model_impl: Literal["auto", "zserve", "transformers"] = "auto"
    """`"zserve"`: zserve's own model code for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3;
    `zserve/generator/llama.py`: q/k/v and gate/up merged at load, fewer ops per layer, greedy output still equal
    to `generate`); `"transformers"`: Hugging Face's modules with the paged attention registered; `"auto"`: ours
    where it applies."""
    cuda_graphs: bool = True
    """On CUDA with zserve's model code and the Triton attention, decode-only steps replay CUDA graphs captured
    when the engine starts, one per batch bucket (1, 2, 4, 8, then multiples of 16 up to `max_running`); prefill
    steps stay eager. The first graphed step is checked against the same step run eagerly; on a mismatch the engine
    stays eager with a warning. Not under `tensor_parallel` > 1. Not yet run on a GPU."""
    quantization: Literal["auto", "none", "int8"] = "auto"
    """On a CPU, linear weights kept quantised in memory ([quantized weights on the
    CPU](#quantized-weights-on-the-cpu)): `"auto"` keeps a GGUF's Q8_0, Q4_0, Q4_1 and Q4_K blocks as the file has
    them (a safetensors model as loaded); `"int8"` quantises a checkpoint's linear layers at load; `"none"`
    dequantises everything (as before). Any other value is an error naming it."""
    cpu_attention: Literal["native", "torch"] = "native"
    """On a CPU (the KV cache in fp32, whatever the `dtype`), every decode of a step attends in one call of a small
    C kernel that reads the paged blocks in place (`zserve/generator/native.py`, compiled on first use with
    `$CC`/`cc` into the zserve cache); `"torch"` = one SDPA call per sequence over its gathered KV. Without a C
    compiler it falls back to `"torch"` with a warning."""
    grammar_compile_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """The longest one schema's grammar may compile (in the engine's compiler process, off the admission path);
    past it the request is a 400 naming `response_format` (`tools` for a forced `tool_choice`)
    ([structured output](openai.md#structured-output))."""
    grammar_memory_mb: Annotated[int, msgspec.Meta(gt=0)] = 1024
    """The memory one compile may add to the compiler process; past it, the same 400."""
    grammar_cache_mb: Annotated[int, msgspec.Meta(gt=0)] = 256
    """Compiled grammars kept (also at most 256 of them), least recently used out first."""

    @classmethod
    def of(cls, options: dict[str, Any]) -> GeneratorOptions:
        """From a ``[models.options]`` table (strictly: ``"2"`` is not 2, ``true`` is not 1); a bad value is a
        ValueError naming the option and the values it takes."""
        try:
            return msgspec.convert(options, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(_explain(exc, options)) from None

    @property
    def grammar(self) -> Any:
        """The grammar compiler's ``CompileBudget`` (imported here lazily: grammar_compile is the engine's)."""
        from zserve.generator.grammar_compile import CompileBudget

        return CompileBudget(time_s=float(self.grammar_compile_s), memory_bytes=self.grammar_memory_mb << 20,
                             cache_bytes=self.grammar_cache_mb << 20)  # fmt: skip


def _explain(exc: msgspec.ValidationError, options: dict[str, Any]) -> str:
    """The option's name, the value given and what it takes, as the handler said it before the Struct."""
    message, path = validation_parts(exc)
    name = path.split("[", 1)[0].split(".", 1)[0]
    if "unknown field `" in message:
        name = message.split("unknown field `", 1)[1].split("`", 1)[0]
        return f"unknown CausalLM option `{name}` (the options: {', '.join(GeneratorOptions.__struct_fields__)})"
    field = next((f for f in _fields() if f.name == name), None)
    if field is None:
        return f"CausalLM options: {message}"
    value = options.get(name)
    t = field.type.type if isinstance(field.type, mi.Metadata) else field.type
    if isinstance(t, mi.LiteralType):
        values = [str(v) for v in get_args(get_type_hints(GeneratorOptions)[name])]  # as declared, not sorted
        return f"{name} {value!r} must be {', '.join(values[:-1])} or {values[-1]}"
    if isinstance(t, mi.BoolType):
        return f"{name} must be true or false, not {value!r}"
    if isinstance(t, mi.IntType) and t.ge is not None:
        return f"{name} must be an integer of {t.ge} or more, not {value!r}"
    if isinstance(t, (mi.IntType, mi.FloatType)) and t.gt == 0:
        return f"{name} must be a positive number, not {value!r}"
    return f"{name}: {message}"


def _fields() -> tuple[mi.Field, ...]:
    info = mi.type_info(GeneratorOptions)
    assert isinstance(info, mi.StructType)
    return info.fields


def default_max_running() -> int:
    """``max_running``'s default (sequences per step, and the broker's limit per engine)."""
    return GeneratorOptions().max_running


def resolve_dtype(device: Any, dtype: str) -> str:
    """The dtype a model runs in, for every model kind (``CausalLM``, the sentence-transformers handlers): a
    named one as it is; ``"auto"``: bfloat16 on a CUDA device that supports it (tensor cores, half the memory;
    embeddings within cosine 0.999 of float32, tested), float32 elsewhere: on a CPU (this project's CPUs compute
    bf16 products slower than fp32 ones at small batches, and zserve's C kernels are fp32) and on a GPU without
    bf16 (float16 overflows in some models' activations; float32 is always right)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype != "auto":
        return dtype
    import torch

    cuda = torch.device(device).type == "cuda"
    return "bfloat16" if cuda and torch.cuda.is_bf16_supported() else "float32"
