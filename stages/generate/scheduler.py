"""Iteration-level scheduling: every step, running sequences continue (one decode token, or the next chunk
of their prompt) and waiting ones join, under a token budget per step (``max_batched_tokens``) and a cap on
running sequences (``max_running``). A long prompt is split into chunks that share a step with other
sequences' decode tokens (chunked prefill, MII's Dynamic SplitFuse). When the KV pool cannot hold the next
tokens, the youngest running sequence is preempted: its blocks are freed and it is recomputed later."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from zserve.stages.generate.block_manager import BlockManager
from zserve.stages.generate.sequence import Sequence


@dataclass(slots=True)
class Chunk:
    """Compute positions [start, end) of ``seq`` this step; it samples a token if end reaches its length."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == len(self.seq.tokens)


class StepScheduler:
    def __init__(
        self, blocks: BlockManager, *, max_batched_tokens: int, max_running: int, chunked_prefill: bool
    ) -> None:
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.kv)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.kv)

    def _preempt_youngest(self) -> Sequence:
        victim = self.running.pop()
        self.blocks.free(victim.kv)
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget = self.max_batched_tokens
        new_blocks = 0  # blocks that this step's sampled tokens will need
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted earlier in this pass
            end = min(len(seq.tokens), seq.num_computed + budget)
            if end == len(seq.tokens) and len(seq.tokens) % self.blocks.block_size == 0:
                # its next token opens a block: make sure one will be free, preempting the youngest if not
                while self.blocks.num_free - new_blocks < 1 and seq in self.running:
                    self._preempt_youngest()
                if seq not in self.running:
                    continue
                new_blocks += 1
            chunks.append(Chunk(seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not self.chunked_prefill and len(seq.tokens) > budget and chunks:
                break  # the whole prompt in one step, or wait for a step of its own
            # the prompt's blocks, plus one if its first token opens a new block
            extra = 1 if len(seq.tokens) % self.blocks.block_size == 0 else 0
            if self.blocks.blocks_needed(len(seq.tokens)) + extra + new_blocks > self.blocks.num_free:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.kv)
            self.running.append(seq)
            end = len(seq.tokens) if not self.chunked_prefill else min(len(seq.tokens), budget)
            if end == len(seq.tokens):
                new_blocks += extra
            chunks.append(Chunk(seq, 0, end))
            budget -= end
        return chunks
