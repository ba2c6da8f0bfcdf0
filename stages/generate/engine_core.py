"""The generative engine core: add requests, call ``step()``; each step runs one packed forward pass over
every scheduled sequence and returns the tokens it produced. No sockets: the engine process shell
(``runner.py``) and ``CausalLM.generate`` (in process) drive it. The model is Hugging Face's, unchanged, with
our paged attention registered. Bookkeeping tensors are built on the CPU and moved to the model's device
once per step; sampling runs on the CPU."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from zserve.stages.generate.attention import PagedKVCache, StepMeta
from zserve.stages.generate.block_manager import BlockManager
from zserve.stages.generate.scheduler import Chunk, StepScheduler
from zserve.stages.generate.sequence import SamplingParams, Sequence

_names = itertools.count()


@dataclass(slots=True)
class TokenOutput:
    seq_id: int
    token_id: int
    finish_reason: str | None  # None while running; "stop" | "length"


class EngineCore:
    def __init__(
        self,
        model,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        max_batched_tokens: int = 256,
        max_running: int = 64,
        chunked_prefill: bool = True,
        batched_decode: bool | None = None,
    ) -> None:
        """``batched_decode``: decodes attend as one padded batch (None: on a GPU, not on a CPU, where one
        call per sequence is faster)."""
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = model.eval()
        self.eos_ids = set(_as_list(getattr(model.generation_config, "eos_token_id", None) or config.eos_token_id))
        # Prefix sharing stays off until the step loop orders sharers after the owner's prefill.
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.cache = PagedKVCache(
            config.num_hidden_layers, num_blocks * block_size, _kv_heads(config), head_dim, model.dtype, model.device
        )
        self.device = model.device
        self.batched_decode = self.device.type != "cpu" if batched_decode is None else batched_decode
        self.scheduler = StepScheduler(
            self.blocks, max_batched_tokens=max_batched_tokens, max_running=max_running, chunked_prefill=chunked_prefill
        )
        name = f"zserve_paged_{next(_names)}"
        AttentionInterface.register(name, self.cache.attention)
        AttentionMaskInterface.register(name, lambda *args, **kwargs: None)
        model.set_attn_implementation(name)
        self.sequences: dict[int, Sequence] = {}
        self._generators: dict[int, torch.Generator] = {}

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` (prompt + new) can ever fit the KV pool."""
        return self.blocks.blocks_needed(num_tokens) <= len(self.blocks.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks.blocks)

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free

    def add(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        if not prompt_ids:
            raise ValueError("empty prompt")
        seq = Sequence(list(prompt_ids), params or SamplingParams())
        if not self.fits(len(seq.tokens) + seq.params.max_new_tokens):
            raise ValueError(
                f"prompt + max_new_tokens needs more KV blocks than the pool has ({len(self.blocks.blocks)})"
            )
        self.sequences[seq.seq_id] = seq
        if seq.params.seed is not None:
            self._generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Stop a sequence now and free its blocks."""
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            self.scheduler.abort(seq)
            seq.finish_reason = "abort"
            self._generators.pop(seq_id, None)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        table = torch.tensor(seq.kv.block_table, dtype=torch.long)
        positions = torch.arange(start, end)
        bs = self.blocks.block_size
        return table[positions // bs] * bs + positions % bs

    def _meta(self, chunks: list[Chunk]) -> tuple[list[int], list[int], StepMeta, list[int]]:
        ids, positions, writes, sample_rows, decodes, prefills, row = [], [], [], [], [], [], 0
        for c in chunks:
            n = c.end - c.start
            ids += c.seq.tokens[c.start : c.end]
            positions += range(c.start, c.end)
            read = self._slots(c.seq, 0, c.end)  # every KV slot the chunk attends to; it writes the last n
            writes.append(read[c.start :])
            if n == 1 and c.start > 0:
                decodes.append((row, c, read))
            else:
                # a later chunk of a prompt sees everything before it, and itself causally
                mask = None
                if c.start > 0:
                    mask = torch.arange(c.end).unsqueeze(0) <= torch.arange(c.start, c.end).unsqueeze(1)
                prefills.append((row, row + n, read, mask))
            row += n
            if c.samples:
                sample_rows.append(row - 1)
        meta = StepMeta(torch.cat(writes), prefills)
        if decodes:
            meta.decode_rows = [r for r, _, _ in decodes]
            meta.decode_lengths = [c.end for _, c, _ in decodes]
            meta.decode_slots = torch.cat([read for _, _, read in decodes])
        return ids, positions, meta, sample_rows

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        p = seq.params
        if len(seq.generated) < p.min_new_tokens:
            banned = [t for t in (*self.eos_ids, *p.stop_token_ids) if t < logits.numel()]
            if banned:
                logits = logits.clone()
                logits[banned] = float("-inf")
        if p.temperature < 1e-5:  # below this, logits / temperature overflows: it is greedy anyway
            return int(logits.argmax())
        logits = logits.float() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, -1) > p.top_p  # keep the first token over top_p
            logits[order[drop]] = float("-inf")
        probs = torch.softmax(logits, -1).nan_to_num_(0.0)
        if not probs.sum() > 0:
            return int(logits.argmax())
        return int(torch.multinomial(probs, 1, generator=self._generators.get(seq.seq_id)))

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        ids, positions, meta, sample_rows = self._meta(chunks)
        device = self.device
        logits = self.model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([positions], device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(sample_rows, dtype=torch.long, device=device),
            zserve_meta=meta.to(device, self.batched_decode),
        ).logits[0]
        if device.type != "cpu":
            logits = logits.float().cpu()  # sampling is per-request Python: one copy back per step
        outputs = []
        sampling = [c for c in chunks if c.samples]
        for c in chunks:
            c.seq.num_computed = c.end
        for c, row_logits in zip(sampling, logits, strict=True):
            seq = c.seq
            token = self._sample(seq, row_logits)
            self.blocks.append(seq.kv, token)
            reason = None
            if (token in self.eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
                reason = "stop"
            elif len(seq.generated) >= seq.params.max_new_tokens:
                reason = "length"
            if reason:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                self.sequences.pop(seq.seq_id, None)
                self._generators.pop(seq.seq_id, None)
            outputs.append(TokenOutput(seq.seq_id, token, reason))
        return outputs


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _kv_heads(config) -> int:
    # GPT-2-style configs have no grouped-query attention field
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
