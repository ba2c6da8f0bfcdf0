"""The step core: add requests (under the caller's ids), call ``step()``; each step runs one packed
forward pass over every scheduled sequence and returns the tokens it produced. No sockets and no
text: ``generator.Generator`` owns it (tokenising, in-process generate) and the engine process shell
(``zserve/workers/generate/runner.py``) drives it. The model is ours for the Llama family (``llama.py``), else
Hugging Face's, unchanged, with our paged attention registered.

Per step the Python work is O(1) per sequence: each sequence keeps its KV slot table and block table as
tensors that grow a block at a time (``_sync``), so building the step's metadata slices views instead of
rebuilding slot lists; sampling is one batched call on the model's device (``sampler.py``)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from zserve.batching.fair_share import DEFAULT_AGING_S
from zserve.generator import grammar, triton_attention
from zserve.generator.attention import PagedKVCache, StepMeta, Uploader
from zserve.generator.block_manager import BlockManager
from zserve.generator.cuda_graphs import DecodeGraphs
from zserve.generator.llama import LlamaFamily
from zserve.generator.options import GeneratorOptions
from zserve.generator.sampler import Sampler, TokenLogprobs, prompt_logprobs
from zserve.generator.sequence import SamplingParams, Sequence
from zserve.generator.step_scheduler import StepScheduler, StepSpan

if TYPE_CHECKING:
    from zserve.generator.tensor_parallel import TensorParallelGroup

log = logging.getLogger("zserve.generator.step_core")

_names = itertools.count()


@dataclass(slots=True)
class TokenOutput:
    seq_id: int
    token_id: int
    finish_reason: str | None  # None while running; "stop" | "length"
    logprobs: TokenLogprobs | None = None  # when the sequence's params ask for them
    # with a sequence's first token, when its params ask: one per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class StepStats:
    """Counters since the engine started (the runner reports them with every step's output)."""

    steps: int = 0
    batch_tokens: int = 0  # tokens in the last step's forward pass
    computed_tokens: int = 0  # tokens forwarded, all steps (prompt chunks and decodes)
    preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens admitted (a recomputed sequence counts again)
    cached_tokens: int = 0  # of those, found in the prefix cache (not computed)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# The engine options' defaults (GeneratorOptions, their one definition) are a bare core's too.
_OPTIONS = GeneratorOptions()


class StepCore:
    def __init__(
        self,
        model,
        *,
        num_blocks: int = 256,
        block_size: int = _OPTIONS.block_size,
        max_batched_tokens: int = _OPTIONS.max_batched_tokens,
        max_running: int = _OPTIONS.max_running,
        chunked_prefill: bool = _OPTIONS.chunked_prefill,
        prefix_caching: bool = _OPTIONS.prefix_caching,
        batched_decode: bool | None = None,
        native_decode: bool = _OPTIONS.cpu_attention == "native",
        tensor_parallel: TensorParallelGroup | None = None,
        cuda_graphs: bool = False,
        priority_aging_s: float = DEFAULT_AGING_S,
    ) -> None:
        """The options as ``GeneratorOptions`` names them (its defaults are these); ``num_blocks``: the KV pool
        (``Generator`` sizes it from ``kv_cache_bytes``). ``batched_decode``: decodes attend as one padded batch
        (None: on a GPU, not on a CPU, where one call per sequence is faster). ``native_decode``: CPU decodes
        attend through the C kernel (``native.py``) where it applies (``cpu_attention = "native"``).
        ``tensor_parallel``: ``model`` is rank 0's shard of a group; every step is broadcast to the other ranks
        before it runs. ``cuda_graphs``: decode-only steps replay CUDA graphs (``cuda_graphs.py``) where they
        apply: our model code, alone, attending through the Triton kernel; off unless asked (the engine passes
        ``GeneratorOptions.cuda_graphs``; a throwaway core, such as the memory probe's warm-up step, stays eager).
        ``priority_aging_s``: how long a sequence waits to count as one priority level more urgent
        (``step_scheduler.py``)."""
        config = model.config
        self.model = model.eval()
        eos = _as_list(getattr(model.generation_config, "eos_token_id", None) or config.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.device = model.device
        self.batched_decode = self.device.type != "cpu" if batched_decode is None else batched_decode
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None:
            tensor_parallel.init_cache(num_blocks, block_size, self.batched_decode, native_decode)
        tp = tensor_parallel.size if tensor_parallel else 1
        graphed = cuda_graphs and tensor_parallel is None and isinstance(model, LlamaFamily)
        # the kernel's check at this model's dtype and shapes (its verdict holds for the steps on this device)
        kernel = triton_attention.usable(self.device, model.dtype, head_dim(config), block_size,
                                         config.num_attention_heads // kv_heads(config))  # fmt: skip
        graphed = graphed and kernel
        # a graphed step's padding rows write their K/V to one more block, which no sequence owns
        cache_blocks = num_blocks + 1 if graphed else num_blocks
        self.cache = paged_cache_for(model, cache_blocks, block_size, tp, native_decode=native_decode)
        self.scheduler = StepScheduler(
            self.blocks, max_batched_tokens=max_batched_tokens, max_running=max_running,
            chunked_prefill=chunked_prefill, aging_s=priority_aging_s,
        )  # fmt: skip
        self.sampler = Sampler(self.eos_ids, config.vocab_size)
        self.sequences: dict[int, Sequence] = {}
        self._stats = StepStats()
        self._block_slots = torch.arange(block_size)  # slot offsets inside a block
        self.upload = Uploader(self.device)  # a step's inputs to the device, one copy
        self.graphs: DecodeGraphs | None = None
        if graphed:
            max_context = getattr(config, "max_position_embeddings", 0) or num_blocks * block_size
            max_blocks = min(num_blocks, -(-max_context // block_size))
            try:
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(model, max_running, max_blocks, block_size, num_blocks * block_size)
            except Exception as exc:  # a capture that fails on a device it was never tried on: stay eager
                log.warning("CUDA graphs could not be captured (%r): decode steps run eagerly", exc)

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` (prompt + new) can ever fit the KV pool."""
        return self.blocks.blocks_needed(num_tokens) <= len(self.blocks.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks.blocks)

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def stats(self) -> StepStats:
        s = self._stats
        s.preemptions = self.scheduler.preemptions
        s.prompt_tokens, s.cached_tokens = self.scheduler.prompt_tokens, self.scheduler.cached_tokens
        return s

    def add(
        self, seq_id: int, prompt_ids: list[int], params: SamplingParams | None = None, *, priority: int = 0,
        now: float | None = None,
    ) -> None:  # fmt: skip
        """Queue a sequence under the caller's ``seq_id`` (unique among the sequences in the engine), of
        ``priority`` (lower is more urgent), arrived at ``now`` (``time.monotonic()`` if None)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if seq_id in self.sequences:
            raise ValueError(f"sequence id {seq_id} is already in the engine")
        seq = Sequence(seq_id, list(prompt_ids), params or SamplingParams(), priority=priority)
        capacity = self.blocks.blocks_needed(len(seq.tokens) + seq.params.max_new_tokens)
        if capacity > len(self.blocks.blocks):
            raise ValueError(
                f"prompt + max_new_tokens needs more KV blocks than the pool has ({len(self.blocks.blocks)})"
            )
        seq.slots = torch.empty(capacity * self.blocks.block_size, dtype=torch.long)
        seq.table = torch.empty(capacity, dtype=torch.int32)
        if seq.params.grammar is not None:
            seq.matcher = grammar.matcher(seq.params.grammar)
        self.sequences[seq_id] = seq
        self.scheduler.add(seq, time.monotonic() if now is None else now)

    def abort(self, seq_id: int) -> None:
        """Stop a sequence now and free its blocks."""
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            self.scheduler.abort(seq)
            seq.finish_reason = "abort"

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def _sync(self, seq: Sequence) -> None:
        """Copy the blocks added to the sequence's block table since the last step into its slot tables."""
        table, bs = seq.kv.block_table, self.blocks.block_size
        for j in range(seq.kv.num_synced, len(table)):
            seq.table[j] = table[j]
            seq.slots[j * bs : (j + 1) * bs] = self._block_slots + table[j] * bs
        seq.kv.num_synced = len(table)

    def _meta(self, spans: list[StepSpan]) -> tuple[torch.Tensor, torch.Tensor, StepMeta, list[int], _PromptRows]:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        writes, tables, slot_rows, lengths, starts, sample_rows = [], [], [], [], [0], []
        prompt_rows = _PromptRows()
        for c in spans:
            seq = c.seq
            self._sync(seq)
            ids += seq.tokens[c.start : c.end]
            positions.append(torch.arange(c.start, c.end))
            writes.append(seq.slots[c.start : c.end])
            slot_rows.append(seq.slots[: c.end])
            tables.append(seq.table[: len(seq.kv.block_table)])
            lengths.append(c.end)
            starts.append(starts[-1] + c.end - c.start)
            if c.samples:
                sample_rows.append(starts[-1] - 1)
            if seq.prompt_logprobs_todo:
                prompt_rows.add(seq, c.start, c.end, starts[-2])
        num_decodes = sum(1 for c in spans if c.end - c.start == 1 and c.start > 0)
        meta = StepMeta(self.blocks.block_size, torch.cat(writes), starts, lengths, num_decodes, tables, slot_rows)
        return torch.tensor([ids]), torch.cat(positions).unsqueeze(0), meta, sample_rows, prompt_rows

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        spans = self.scheduler.schedule()
        if not spans:
            return []
        # decodes first (the layout paged kernels take); order within each group is kept
        spans.sort(key=lambda c: not (c.end - c.start == 1 and c.start > 0))
        ids, positions, meta, sample_rows, prompt_rows = self._meta(spans)
        rows = sample_rows + prompt_rows.rows
        graphs = self.graphs
        if self.tensor_parallel is not None:
            logits = self.tensor_parallel.forward(
                self.model, ids, positions, meta, rows, self.batched_decode, self.upload
            )
        elif graphs is not None and graphs.takes(meta, rows, bool(prompt_rows.rows)):
            logits = graphs.step(meta, ids, positions, self.upload)
            if not graphs.verified:  # once: the same step eagerly (it writes the same K/V again)
                eager = forward(self.model, ids, positions, meta, rows, batched_decode=self.batched_decode,
                                upload=self.upload)  # fmt: skip
                if not graphs.verify(logits, eager):
                    self.graphs, logits = None, eager
        else:
            logits = forward(
                self.model, ids, positions, meta, rows, batched_decode=self.batched_decode, upload=self.upload
            )
        if prompt_rows.rows:
            prompt_rows.collect(prompt_logprobs(logits[len(sample_rows) :], prompt_rows.targets, prompt_rows.top))
            logits = logits[: len(sample_rows)]
        stats = self._stats
        stats.steps += 1
        stats.batch_tokens = ids.shape[1]
        stats.computed_tokens += ids.shape[1]
        for c in spans:
            c.seq.num_computed = c.end
            self.blocks.mark_computed(c.seq.kv, c.end)
        sampling = [c.seq for c in spans if c.samples]
        sampled = self.sampler.run(logits, sampling) if sampling else None
        tokens = sampled.tokens if sampled else []
        logprobs = sampled.logprobs if sampled and sampled.logprobs else [None] * len(tokens)
        outputs = []
        for seq, token, token_logprobs in zip(sampling, tokens, logprobs, strict=True):
            self.blocks.append(seq.kv, token)
            reason = None
            if seq.matcher is not None and (not seq.matcher.accept_token(token) or seq.matcher.is_terminated()):
                reason = "stop"  # the grammar is complete (the token is its stop token, or ends it)
            elif (token in self.eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
                reason = "stop"
            elif seq.num_generated >= seq.params.max_new_tokens:
                reason = "length"
            if reason:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                del self.sequences[seq.seq_id]
            first = seq.params.prompt_logprobs >= 0 and seq.num_generated == 1
            outputs.append(
                TokenOutput(seq.seq_id, token, reason, token_logprobs, seq.prompt_logprobs if first else None)
            )
        return outputs


class _PromptRows:
    """The step's rows whose logits give prompt logprobs: row r predicts prompt token ``targets[r]``."""

    def __init__(self) -> None:
        self.rows: list[int] = []  # in the packed step
        self.targets: list[int] = []
        self.top: list[int] = []  # each row's k
        self.owners: list[tuple[Sequence, int]] = []  # (sequence, how many of the rows, in order)

    def add(self, seq: Sequence, start: int, end: int, first_row: int) -> None:
        """Positions [start, end) of ``seq`` are computed this step: the ones not yet done predict a prompt
        token (position p, token p + 1; a recomputed chunk after a preemption adds nothing twice)."""
        lo, hi = max(start, len(seq.prompt_logprobs)), min(end, seq.prompt_len - 1)
        if lo >= hi:
            return
        self.rows += range(first_row + lo - start, first_row + hi - start)
        self.targets += seq.tokens[lo + 1 : hi + 1]
        self.top += [seq.params.prompt_logprobs] * (hi - lo)
        self.owners.append((seq, hi - lo))

    def collect(self, logprobs: list[TokenLogprobs]) -> None:
        at = 0
        for seq, n in self.owners:
            seq.prompt_logprobs += logprobs[at : at + n]
            at += n


def paged_cache_for(
    model, num_blocks: int, block_size: int, tensor_parallel: int = 1, *, native_decode: bool = True
) -> PagedKVCache:
    """A paged KV cache for ``model`` (its share of the key/value heads, under tensor parallelism), plugged
    into the model's attention layers."""
    config = model.config
    cache = PagedKVCache(
        config.num_hidden_layers, num_blocks * block_size, kv_heads(config) // tensor_parallel, head_dim(config),
        model.dtype, model.device, native_decode,
    )  # fmt: skip
    if isinstance(model, LlamaFamily):  # ours calls the cache itself
        model.cache = cache
        return cache
    name = f"zserve_paged_{next(_names)}"
    AttentionInterface.register(name, cache.attention)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)
    model.set_attn_implementation(name)
    return cache


def forward(
    model, ids, positions, meta: StepMeta, sample_rows: list[int], *, batched_decode: bool, upload: Uploader
) -> torch.Tensor:
    """One step's forward pass over the packed row: the logits of the ``sample_rows``. ``ids`` and
    ``positions`` are [1, T] on the host; they and the step's metadata reach the device in one ``upload``."""
    kernel = triton_attention.usable(model.device)
    step, ids, positions, rows = meta.for_torch(
        model.device, batched_decode, upload, ids[0], positions[0], sample_rows, kernel
    )
    if isinstance(model, LlamaFamily):
        return model(ids, positions, step, rows)
    return model(
        input_ids=ids.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        use_cache=False,
        logits_to_keep=rows,
        zserve_meta=step,
    ).logits[0]


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def kv_heads(config) -> int:
    """The model's key/value heads (GPT-2-style configs have no grouped-query attention field)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
