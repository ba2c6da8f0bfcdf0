"""Iteration-level scheduling: every step, running sequences continue (one decode token, or the next chunk
of their prompt) and waiting ones join, under a token budget per step (``max_batched_tokens``) and a cap on
running sequences (``max_running``). A long prompt is split into chunks that share a step with other
sequences' decode tokens (chunked prefill, MII's Dynamic SplitFuse). When the KV pool cannot hold the next
tokens, the youngest running sequence is preempted: its blocks are freed and it is recomputed later.

With prefix caching, an admitted prompt starts after its cached leading blocks; one whose next prefix block
is still being computed by a running sequence waits for that prefill (FIFO: it holds the queue), so a
prefix shared by many requests is computed once.

Both queues are insertion-ordered dicts keyed by sequence id: add, finish, abort and preempt are O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from zserve.generator.block_manager import BlockManager
from zserve.generator.sequence import Sequence


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
        self.waiting: OrderedDict[int, Sequence] = OrderedDict()  # FIFO; a preempted one goes back to the front
        self.running: dict[int, Sequence] = {}  # oldest first
        self.preemptions = 0
        self.prompt_tokens = 0  # tokens of every admitted prompt (a recomputed one counts again)
        self.cached_tokens = 0  # of those, found in the prefix cache

    def add(self, seq: Sequence) -> None:
        self.waiting[seq.seq_id] = seq

    def abort(self, seq: Sequence) -> None:
        if self.running.pop(seq.seq_id, None) is not None:
            self.blocks.free(seq.kv)
        else:
            self.waiting.pop(seq.seq_id, None)

    def finish(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.blocks.free(seq.kv)

    def _preempt_youngest(self) -> None:
        _, victim = self.running.popitem()
        self.blocks.free(victim.kv)
        victim.num_computed = 0
        self.waiting[victim.seq_id] = victim
        self.waiting.move_to_end(victim.seq_id, last=False)
        self.preemptions += 1

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget = self.max_batched_tokens
        bs = self.blocks.block_size
        new_blocks = 0  # blocks that this step's sampled tokens will need
        for seq in list(self.running.values()):
            if budget == 0:
                break
            if seq.seq_id not in self.running:
                continue  # preempted earlier in this pass
            end = min(len(seq.tokens), seq.num_computed + budget)
            if end == len(seq.tokens) and len(seq.tokens) % bs == 0:
                # its next token opens a block: make sure one will be free, preempting the youngest if not
                while self.blocks.num_free - new_blocks < 1 and seq.seq_id in self.running:
                    self._preempt_youngest()
                if seq.seq_id not in self.running:
                    continue
                new_blocks += 1
            chunks.append(Chunk(seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = next(iter(self.waiting.values()))
            ready, pending = self.blocks.match(seq.kv)
            if pending:
                break  # its prefix is being computed: share it once that prefill is done
            todo = len(seq.tokens) - ready * bs
            if not self.chunked_prefill and todo > budget and chunks:
                break  # the whole prompt in one step, or wait for a step of its own
            # the prompt's blocks, plus one if its first token opens a new block
            extra = 1 if len(seq.tokens) % bs == 0 else 0
            if self.blocks.blocks_to_take(seq.kv, len(seq.tokens)) + extra + new_blocks > self.blocks.num_free:
                break
            del self.waiting[seq.seq_id]
            cached = self.blocks.allocate(seq.kv)
            seq.num_computed = cached
            self.prompt_tokens += len(seq.tokens)
            self.cached_tokens += cached
            self.running[seq.seq_id] = seq
            end = len(seq.tokens) if not self.chunked_prefill else min(len(seq.tokens), cached + budget)
            if end == len(seq.tokens):
                new_blocks += extra
            chunks.append(Chunk(seq, cached, end))
            budget -= end - cached
        return chunks
