"""Iteration-level scheduling: every step, running sequences continue (one decode token, or the next chunk
of their prompt) and waiting ones join, under a token budget per step (``max_batched_tokens``) and a cap on
running sequences (``max_running``). A long prompt is split into chunks that share a step with other
sequences' decode tokens (chunked prefill, MII's Dynamic SplitFuse).

Order: every sequence has a rank, ``arrival + priority * aging_s`` (then arrival order), fixed when it is
added; a lower rank is more urgent. Waiting sequences are admitted by rank, running ones are scheduled by
rank, and when the KV pool cannot hold the next tokens the running sequence of the highest rank (the least
urgent priority, the latest arrival among equals) is preempted: its blocks are freed and it is recomputed
later. A sequence that needs a block therefore only ever preempts less urgent ones, or itself when it is the
least urgent. A waiting sequence more urgent than running ones that does not fit the free blocks takes them
from those running ones, least urgent first, when together they free enough and it is then admitted in the
same step (a running slot free and token budget left; else nobody is preempted for nothing). With every
priority 0 this is first come, first served, as before priorities.

No starvation: ``aging_s`` of waiting counts as one priority level, and a rank never changes, so a sequence
waits at most about ``(p - p_urgent) * aging_s`` behind a stream of more urgent ones; once the clock has
passed its rank, no sequence added later can go before it or preempt it (the broker's queue ages the same
way, ``zserve.batching.fair_share``). The scheduler has no clock: ``add`` takes ``now``.

With prefix caching, an admitted prompt starts after its cached leading blocks; one whose next prefix block
is still being computed by a running sequence waits for that prefill (it holds the queue), so a prefix
shared by many requests is computed once.

The waiting queue is a heap of ranks beside a dict by id (a removed entry is skipped when it surfaces):
add, finish, abort and preempt are O(log n) at most; a step sorts the running sequences (at most
``max_running``) once.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from zserve.batching.fair_share import DEFAULT_AGING_S
from zserve.generator.block_manager import BlockManager
from zserve.generator.sequence import Sequence


@dataclass(slots=True)
class StepSpan:
    """Compute positions [start, end) of ``seq`` this step; it samples a token if end reaches its length."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == len(self.seq.tokens)


def _rank(seq: Sequence) -> tuple[float, int]:
    return seq.rank


class StepScheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_batched_tokens: int,
        max_running: int,
        chunked_prefill: bool,
        aging_s: float = DEFAULT_AGING_S,
    ) -> None:
        if aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self.chunked_prefill = chunked_prefill
        self.aging_s = aging_s
        self.waiting: dict[int, Sequence] = {}
        self._queue: list[tuple[tuple[float, int], int]] = []  # (rank, seq id): the waiting ones' order
        self.running: dict[int, Sequence] = {}
        self._arrivals = itertools.count()
        self.preemptions = 0
        self.prompt_tokens = 0  # tokens of every admitted prompt (a recomputed one counts again)
        self.cached_tokens = 0  # of those, found in the prefix cache

    def add(self, seq: Sequence, now: float) -> None:
        """Queue ``seq`` (its ``priority`` set), arrived at ``now`` (seconds, any monotonic clock)."""
        seq.rank = (now + seq.priority * self.aging_s, next(self._arrivals))
        self._wait(seq)

    def _wait(self, seq: Sequence) -> None:
        self.waiting[seq.seq_id] = seq
        heapq.heappush(self._queue, (seq.rank, seq.seq_id))

    def _head(self) -> Sequence | None:
        """The most urgent waiting sequence."""
        queue, waiting = self._queue, self.waiting
        while queue:
            rank, seq_id = queue[0]
            seq = waiting.get(seq_id)
            if seq is not None and seq.rank == rank:
                return seq
            heapq.heappop(queue)  # aborted (or aborted and its id added again): skip
        return None

    def abort(self, seq: Sequence) -> None:
        if self.running.pop(seq.seq_id, None) is not None:
            self.blocks.free(seq.kv)
        else:
            self.waiting.pop(seq.seq_id, None)

    def finish(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.blocks.free(seq.kv)

    def _preempt(self, victim: Sequence) -> None:
        del self.running[victim.seq_id]
        self.blocks.free(victim.kv)
        victim.num_computed = 0
        self._wait(victim)
        self.preemptions += 1

    def schedule(self) -> list[StepSpan]:
        spans: list[StepSpan] = []
        budget = self.max_batched_tokens
        bs = self.blocks.block_size
        new_blocks = 0  # blocks that this step's sampled tokens will need
        # most urgent first: a victim (always taken from the end) is never one already scheduled this step
        order = sorted(self.running.values(), key=_rank)
        head = self._head()
        if head is not None and order and order[-1].rank > head.rank:
            self._make_room(head, order)
        i = 0
        while i < len(order) and budget > 0:
            seq = order[i]
            i += 1
            end = min(len(seq.tokens), seq.num_computed + budget)
            if end == len(seq.tokens) and len(seq.tokens) % bs == 0:
                # its next token opens a block: make sure one will be free, preempting the least urgent if not
                # (down to this sequence itself, the last one left in ``order``)
                while self.blocks.num_free - new_blocks < 1 and len(order) >= i:
                    self._preempt(order.pop())
                if len(order) < i:
                    break  # it preempted itself: every less urgent one is gone already
                new_blocks += 1
            spans.append(StepSpan(seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        while budget > 0 and len(self.running) < self.max_running:
            seq = self._head()
            if seq is None:
                break
            ready, pending = self.blocks.match(seq.kv)
            if pending:
                break  # its prefix is being computed: share it once that prefill is done
            todo = len(seq.tokens) - ready * bs
            if not self.chunked_prefill and todo > budget and spans:
                break  # the whole prompt in one step, or wait for a step of its own
            # the prompt's blocks, plus one if its first token opens a new block
            extra = 1 if len(seq.tokens) % bs == 0 else 0
            if self.blocks.blocks_to_take(seq.kv, len(seq.tokens)) + extra + new_blocks > self.blocks.num_free:
                break
            heapq.heappop(self._queue)
            del self.waiting[seq.seq_id]
            cached = self.blocks.allocate(seq.kv)
            seq.num_computed = cached
            self.prompt_tokens += len(seq.tokens)
            self.cached_tokens += cached
            self.running[seq.seq_id] = seq
            end = len(seq.tokens) if not self.chunked_prefill else min(len(seq.tokens), cached + budget)
            if end == len(seq.tokens):
                new_blocks += extra
            spans.append(StepSpan(seq, cached, end))
            budget -= end - cached
        return spans

    def _make_room(self, head: Sequence, order: list[Sequence]) -> None:
        """``head``, the most urgent waiting sequence, is more urgent than the last of ``order`` (the running
        ones by rank). If it does not fit the free blocks, preempt running sequences less urgent than it, least
        urgent first, until it does, counting one block for each running sequence that stays and may open
        a block this step; but only if those sequences together free enough and ``head`` is then admitted in
        this step (a running slot, and token budget left after the chunks of those that stay: all of its
        prompt without chunked prefill), so nobody is preempted for nothing. Runs before any running sequence
        is scheduled, so no victim has a chunk in this step."""
        ready, pending = self.blocks.match(head.kv)
        if pending:
            return  # it waits for a prefix being computed, not for blocks
        bs, blocks = self.blocks.block_size, self.blocks.blocks
        opens = [len(s.tokens) % bs == 0 for s in order]  # whose next token may take a block this step
        extra = 1 if len(head.tokens) % bs == 0 else 0
        short = self.blocks.blocks_to_take(head.kv, len(head.tokens)) + extra + sum(opens) - self.blocks.num_free
        if short <= 0:
            return
        # its own cached prefix blocks that a victim holds: freeing them makes them free and costly alike
        prefix = {self.blocks.by_hash[h] for h in head.kv.hashes[:ready]}
        drops: dict[int, int] = {}
        victims = 0
        for k in range(len(order) - 1, -1, -1):
            victim = order[k]
            if victim.rank <= head.rank:
                return  # the rest are at least as urgent as head: it waits
            for block_id in victim.kv.block_table:
                drops[block_id] = drops.get(block_id, 0) + 1
                if drops[block_id] == blocks[block_id].ref_count and block_id not in prefix:
                    short -= 1
            short -= opens[k]
            victims += 1
            if short <= 0:
                break
        else:
            return
        staying = order[: len(order) - victims]
        if len(staying) >= self.max_running:
            return
        left = self._budget_left(staying)
        if left <= 0 or (not self.chunked_prefill and staying and len(head.tokens) - ready * bs > left):
            return  # admission would stop before it: it waits, and they keep their blocks
        for _ in range(victims):
            self._preempt(order.pop())

    def _budget_left(self, staying: list[Sequence]) -> int:
        """The token budget that the running sequences ``staying`` (by rank) leave, spent as ``schedule``
        spends it on them."""
        budget = self.max_batched_tokens
        for seq in staying:
            if budget <= 0:
                break
            budget -= min(len(seq.tokens) - seq.num_computed, budget)
        return budget
