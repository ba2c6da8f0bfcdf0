"""The generator: one object that loads the model and tokenizer, sizes the KV pool, turns requests into
token ids and sampling parameters, and owns the ``StepCore``. The generative engine process's runner
(``zserve/workers/generate/runner.py``) and in-process generation (``zserve.pipeline``, ``CausalLM.generate``) both
use it, so there is one tokenisation path.

Its ``max_running`` (sequences per step) is also how many sequences the broker admits to it.

The interface of a generative handler (a ``zserve.Model`` with ``generative = True``):
  * ``setup(device)`` sets ``self.generator`` to a ``Generator`` (``Generator.load(...)`` builds
    one from a model folder);
  * ``decode_request(body)`` turns a request body into a ``GenerateRequest`` (raising ``BadRequest`` naming the
    field), and ``encode_response(GenerateResponse)`` the answer into its body;
``zserve.models.causal_lm:CausalLM`` is the one that ships; ``generator_of(model)`` checks the contract.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from zserve.errors import BadRequest
from zserve.generation import (
    GenerateRequest,
    GenerateResponse,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
    tokenizer_fingerprint,
)
from zserve.generator import cpu_linear, grammar
from zserve.generator.attention import cache_dtype
from zserve.generator.detokenize import TextStream
from zserve.generator.grammar_compile import GrammarService
from zserve.generator.llama import own_model
from zserve.generator.options import GeneratorOptions, resolve_dtype
from zserve.generator.sampler import TokenLogprobs
from zserve.generator.schema_check import unenforceable
from zserve.generator.sequence import SamplingParams
from zserve.generator.step_core import StepCore, head_dim, kv_heads

if TYPE_CHECKING:
    from zserve.generator.tensor_parallel import TensorParallelGroup

_CPU_KV_CACHE_BYTES = 1 << 30
_GPU_MEMORY_FRACTION = 0.9


@dataclass(slots=True)
class PreparedPrompt:
    """A request ready for the engine core: token ids, sampling parameters, stop strings. A structured one
    (``structured``) needs its grammar compiled (``schema``; None: any JSON object) into ``params.grammar``
    before it joins the core."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    structured: bool = False
    schema: str | None = None

    def with_grammar(self, compiled: Any) -> PreparedPrompt:
        return dataclasses.replace(self, params=dataclasses.replace(self.params, grammar=compiled))


class Generator:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        options: GeneratorOptions = GeneratorOptions(),
        tensor_parallel: TensorParallelGroup | None = None,
    ) -> None:
        """``tensor_parallel``: ``model`` is rank 0's shard of that group (``load`` builds both)."""
        self.tokenizer = tokenizer
        self.options = options
        self.max_running = options.max_running
        self.max_new_tokens = options.max_new_tokens
        self.tensor_parallel = tensor_parallel
        tp = tensor_parallel.size if tensor_parallel else 1
        num_blocks = options.num_blocks
        if not num_blocks:
            peak = step_peak_bytes(model, options) if tensor_parallel is None else 0
            native = options.cpu_attention == "native"
            num_blocks = pool_blocks(model, options.kv_cache_bytes, options.block_size, tp, peak, native)
        self.core = StepCore(
            model, num_blocks=num_blocks, block_size=options.block_size,
            max_batched_tokens=options.max_batched_tokens, max_running=options.max_running,
            chunked_prefill=options.chunked_prefill, prefix_caching=options.prefix_caching,
            native_decode=options.cpu_attention == "native", tensor_parallel=tensor_parallel,
            cuda_graphs=options.cuda_graphs,
        )  # fmt: skip
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        # what a frontend's prompt_token_ids must have been made with to be taken as they are
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        self._token_texts: dict[int, str] = {}  # logprobs' token strings (the output thread's)
        self._grammars: GrammarService | None = None  # start_grammars(): at engine start, or on first use
        self._grammars_lock = threading.Lock()

    @classmethod
    def load(
        cls, path: str, *, device: str = "cpu", dtype: str = "float32", gguf_file: str = "", options: GeneratorOptions
    ) -> Generator:
        """From a local folder, a hub name or ``package:NAME``; a GGUF file is converted once into a cache
        (transformers' GGUF loader takes ~45 s; the cache loads in about a second), or with ``quantization``
        "auto" on a CPU built with its quantised blocks kept, its config from the cache (``gguf_load.py``). With
        ``options.tensor_parallel`` N > 1 this process becomes rank 0 of a group of N (``tensor_parallel.py``)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from zserve.gguf_cache import converted_path, resolve_model_path

        path = resolve_model_path(path)
        dtype = resolve_dtype(device, dtype)
        if options.quantization == "int8" and (device != "cpu" or options.tensor_parallel != 1):
            raise ValueError(
                f"quantization 'int8' runs on a CPU in one process, not on {device} with tensor_parallel "
                f"{options.tensor_parallel}"
            )
        model = None
        if gguf_file and options.quantization == "auto" and device == "cpu" and options.tensor_parallel == 1:
            from zserve import gguf_load

            # the file's Q8_0/Q4_0/Q4_1/Q4_K blocks straight into our model, never an fp32 copy (None: a model
            # ours does not run, loaded dequantised from ``path``, the converted checkpoint)
            model, folder = gguf_load.load(path, gguf_file, dtype, options.model_impl)
            path = str(folder)
        elif gguf_file:
            path = str(converted_path(path, gguf_file, dtype))
        tokenizer = AutoTokenizer.from_pretrained(path)
        if options.tensor_parallel == 1:
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
                model = own_model(model, options.model_impl)
            if options.quantization == "int8":
                from zserve.generator import quant_linear

                quant_linear.quantize(model)  # before packing: what stays an nn.Linear (the LM head) is packed
            if options.cpu_linear != "torch" and cpu_linear.available(model):
                rows = (1, 2, 8, 32, options.max_running, options.max_batched_tokens)  # the row buckets it runs
                cpu_linear.prepack(model, options.cpu_linear, rows=rows, head_rows=options.max_running)
            return cls(model, tokenizer, options)
        from zserve.generator.tensor_parallel import TensorParallelGroup, check_divisible, load_sharded

        check_divisible(AutoConfig.from_pretrained(path), options.tensor_parallel)
        if device.startswith("cuda") and torch.cuda.device_count() < options.tensor_parallel:
            raise ValueError(
                f"tensor_parallel {options.tensor_parallel} needs as many CUDA devices, this engine sees "
                f'{torch.cuda.device_count()}: give it devices = ["cuda:0,1,..."] (rank r runs on cuda:r)'
            )
        group = TensorParallelGroup.start(
            options.tensor_parallel, path, dtype=dtype, device=device, model_impl=options.model_impl
        )
        try:
            return cls(load_sharded(group.spec), tokenizer, options, group)
        except BaseException:
            group.close()
            raise

    def close(self) -> None:
        """Stop the grammar compiler and the tensor parallel group's other ranks."""
        if self._grammars is not None:
            self._grammars.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def start_grammars(self) -> GrammarService | None:
        """The grammar compiler (None without xgrammar), started now if it is not: an engine calls this at
        start, so the tokenizer's info (~0.9 s on a 49k vocabulary, partly holding the interpreter lock) is
        never built on a request's path."""
        if not grammar.available():
            return None
        with self._grammars_lock:
            if self._grammars is None:
                budget = self.options.grammar
                self._grammars = GrammarService(self.tokenizer, self.core.sampler.vocab_size, budget)
            return self._grammars

    def warmup(self) -> None:
        self.generate([GenerateRequest(prompt="warm up", max_new_tokens=2, ignore_eos=True)])

    def prepare(self, request: GenerateRequest) -> PreparedPrompt:
        """Tokenise (applying the chat template to ``messages``) and check the lengths."""
        ids = self._given_ids(request)
        if ids is None:  # not tokenised by a frontend with this very tokenizer
            ids = self.tokenize(request)
        if not ids:
            raise BadRequest("the prompt is empty after tokenisation", field="prompt")
        room = self.max_context - len(ids)
        if room < 1:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_context}", field="prompt"
            )
        # no max_new_tokens: up to max_length if given (MII), else the model's default
        max_new = request.max_new_tokens or (room if request.max_length else min(self.max_new_tokens, room))
        if request.max_new_tokens and request.max_new_tokens > room:
            raise BadRequest(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({request.max_new_tokens}) is over this model's "
                f"context of {self.max_context} tokens",
                field="max_new_tokens",
            )
        if request.max_length is not None:
            if request.max_length <= len(ids):
                raise BadRequest(f"max_length {request.max_length} leaves no room after {len(ids)} prompt tokens",
                                 field="max_length")  # fmt: skip
            max_new = min(max_new, request.max_length - len(ids))
        if not self.core.fits(len(ids) + max_new):
            raise BadRequest(
                f"prompt + max_new_tokens ({len(ids) + max_new} tokens) is more than the KV cache holds", field="prompt"
            )
        params = SamplingParams(
            max_new_tokens=max_new, temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
            seed=request.seed, stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos,
            min_new_tokens=request.min_new_tokens, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            logit_bias=self._logit_bias(request.logit_bias),
            logprobs=-1 if request.logprobs is None else request.logprobs,
            prompt_logprobs=-1 if request.prompt_logprobs is None else request.prompt_logprobs,
        )  # fmt: skip
        structured = request.json_object or request.json_schema is not None
        if structured:
            self._check_structured(request.json_schema)
        return PreparedPrompt(ids, params, list(request.stop), structured, request.json_schema)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids (the chat template applied to ``messages``)."""
        if request.messages is not None:
            text = self.tokenizer.apply_chat_template(
                [msgspec.to_builtins(m) for m in request.messages],
                tools=request.tools,
                tokenize=False,
                add_generation_prompt=True,
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(request.prompt)["input_ids"]

    def _given_ids(self, request: GenerateRequest) -> list[int] | None:
        """The request's ``prompt_token_ids`` when they were made with this engine's tokenizer (a frontend
        of another release or model revision: None, the text is tokenised here), every one a token of the
        model (the lengths are checked as for a text)."""
        ids = request.prompt_token_ids
        if ids is None or not self.tokenizer_fingerprint or request.prompt_tokenizer != self.tokenizer_fingerprint:
            return None
        vocab = self.core.sampler.vocab_size
        if ids and max(ids) >= vocab:  # msgspec checked >= 0
            raise BadRequest(f"prompt_token_ids holds {max(ids)}, not a token id of this model (0..{vocab - 1})",
                             field="prompt_token_ids")  # fmt: skip
        return ids

    def _check_structured(self, schema: str | None) -> None:
        """What can be refused without compiling: no xgrammar, a schema that is not JSON, or one with what
        the grammar cannot enforce (the frontends check the same; direct clients reach only this)."""
        if not grammar.available():
            raise BadRequest("structured output needs xgrammar on the engine: pip install 'zserve[structured]'",
                             field="response_format")  # fmt: skip
        if schema is None:
            return
        try:
            why = unenforceable(msgspec.json.decode(schema))
        except msgspec.DecodeError:
            raise BadRequest("the JSON schema is not JSON", field="response_format") from None
        if why is not None:
            raise BadRequest(f"the JSON schema cannot be enforced: {why}", field="response_format")

    def _logit_bias(self, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
        vocab = self.core.sampler.vocab_size
        out = []
        for key, value in bias.items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                raise BadRequest(f"logit_bias key {key!r} is not a token id of this model (0..{vocab - 1})",
                                 field="logit_bias")  # fmt: skip
            out.append((int(key), float(value)))
        return tuple(out)

    def token_logprob(self, token_id: int, logprobs: TokenLogprobs) -> TokenLogprob:
        """A sampled token's logprobs with token strings (each id decoded alone, as vLLM does)."""
        text = self._token_text
        return TokenLogprob(text(token_id), logprobs.logprob, [TopLogprob(text(t), lp) for t, lp in logprobs.top])

    def prompt_token_logprobs(self, prompt_ids: list[int], logprobs: list[TokenLogprobs]) -> list[PromptLogprob]:
        """A prompt's logprobs with token strings: its first token has none (nothing predicts it), token p + 1
        has ``logprobs[p]``."""
        text = self._token_text
        out = [PromptLogprob(text(prompt_ids[0]), None, [])]
        for token_id, lp in zip(prompt_ids[1:], logprobs, strict=True):
            out.append(PromptLogprob(text(token_id), lp.logprob, [TopLogprob(text(t), v) for t, v in lp.top]))
        return out

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def text_stream(self, prompt: PreparedPrompt) -> TextStream:
        """The incremental detokeniser of one sequence (stop strings included)."""
        return TextStream(self.tokenizer, prompt.stop, prompt_ids=prompt.prompt_ids)

    def generate(
        self, requests: Sequence[GenerateRequest], on_delta: Callable[[int, str], None] | None = None
    ) -> list[GenerateResponse]:
        """One response per request, generated together in this process (the core must be idle: it is not
        shared with a runner). ``on_delta(index, text)`` streams text as it is produced."""
        prepared = [self.prepare(r) for r in requests]
        for i, p in enumerate(prepared):  # here the caller waits for its own compiles (within their budget)
            if p.structured:
                prepared[i] = p.with_grammar(self.start_grammars().compile(p.schema))
        streams = [self.text_stream(p) for p in prepared]
        lengths = [0] * len(prepared)
        logprobs: list[list[TokenLogprob]] = [[] for _ in prepared]
        prompt_logprobs: list[list[PromptLogprob] | None] = [None] * len(prepared)
        reasons: dict[int, str] = {}
        for i, p in enumerate(prepared):
            self.core.add(i, p.prompt_ids, p.params)
        try:
            while len(reasons) < len(prepared):
                for out in self.core.step():
                    i = out.seq_id
                    if i in reasons:
                        continue
                    lengths[i] += 1
                    if out.logprobs is not None:
                        logprobs[i].append(self.token_logprob(out.token_id, out.logprobs))
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[i] = self.prompt_token_logprobs(prepared[i].prompt_ids, out.prompt_logprobs)
                    delta, reason = streams[i].advance(out.token_id, out.finish_reason)
                    if streams[i].stopped:
                        self.core.abort(i)
                    if reason:
                        reasons[i] = reason
                    if delta and on_delta is not None:
                        on_delta(i, delta)
        finally:
            for i in range(len(prepared)):  # an exception (or a callback's) leaves nothing behind
                self.core.abort(i)
        responses = []
        for i, (s, n, p) in enumerate(zip(streams, lengths, prepared, strict=True)):
            asked = logprobs[i] if p.params.logprobs >= 0 else None
            responses.append(GenerateResponse(s.text, n, len(p.prompt_ids), reasons[i], asked, prompt_logprobs[i]))
        return responses


def step_peak_bytes(model: Any, options: GeneratorOptions) -> int:
    """On CUDA, the memory a step takes beyond the weights, measured (as vLLM and nano-vllm do) on one whole
    prompt of ``max_batched_tokens`` through a throwaway core: what the KV pool must leave free. Elsewhere 0
    (a CPU's pool has its own budget)."""
    if model.device.type != "cuda":
        return 0
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    warm_step(model, options)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # what the warm-up cached goes back, so mem_get_info sees it free
    return peak


def warm_step(model: Any, options: GeneratorOptions) -> None:
    """One step over a whole prompt of ``max_batched_tokens`` (capped at the model's context) on a throwaway
    core and KV pool just big enough for it; the real core plugs its own cache in afterwards."""
    n = min(options.max_batched_tokens, int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30) - 1)
    core = StepCore(
        model, num_blocks=-(-n // options.block_size) + 1, block_size=options.block_size, max_batched_tokens=n,
        chunked_prefill=False, prefix_caching=False, native_decode=options.cpu_attention == "native",
    )  # fmt: skip
    core.add(0, [0] * n, SamplingParams(max_new_tokens=1, ignore_eos=True))
    while core.has_work():
        core.step()


def pool_blocks(
    model: Any, kv_cache_bytes: int, block_size: int, tensor_parallel: int = 1, step_peak_bytes: int = 0,
    native_decode: bool = True,
) -> int:  # fmt: skip
    """KV blocks in ``kv_cache_bytes`` per rank (0: 1 GiB on a CPU; on a GPU 90% of the free device memory less
    ``step_peak_bytes``, what a step needs beside the pool); under tensor parallelism a rank holds 1/N of each
    block's heads."""
    c = model.config
    itemsize = cache_dtype(model.dtype, model.device, native_decode).itemsize
    per_block = 2 * c.num_hidden_layers * (kv_heads(c) // tensor_parallel) * head_dim(c) * itemsize
    per_block *= block_size
    budget = int(kv_cache_bytes)
    if not budget:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = int(free * _GPU_MEMORY_FRACTION) - step_peak_bytes
            if budget < per_block:
                raise RuntimeError(
                    f"no GPU memory left for the KV cache: {free >> 20} MiB free after the weights, a step of "
                    f"max_batched_tokens takes {step_peak_bytes >> 20} MiB (lower max_batched_tokens or the dtype)"
                )
        else:
            budget = _CPU_KV_CACHE_BYTES
    return max(1, budget // per_block)


def generator_of(model: Any) -> Generator:
    """The generator of a generative handler after ``setup``; a clear error when it breaks the contract."""
    generator = getattr(model, "generator", None)
    if generator is None and isinstance(getattr(model, "engine", None), Generator):
        # handlers written before 2026-12-06 set ``self.engine``: still accepted, with a warning
        warnings.warn(
            f"{type(model).__name__}.setup() set self.engine; the attribute is self.generator now "
            "(self.engine is read until a later release)",
            FutureWarning,
            stacklevel=2,
        )
        generator = model.engine
    if not isinstance(generator, Generator):
        raise TypeError(
            f"{type(model).__name__} says generative = True, but its setup() did not set self.generator to a "
            "zserve.generator.generator.Generator"
        )
    return generator
