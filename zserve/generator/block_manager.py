"""The paged KV cache's bookkeeping: fixed-size blocks from a preallocated pool, a block table per sequence,
and prefix caching (full blocks whose token prefix is identical are computed once and shared by reference
count). Pure: no tensors; the cache tensors are indexed by the block ids this hands out.

A sequence grows block by block. When the pool cannot serve a step, the caller preempts (``free``) the
youngest sequence and recomputes it later; ``blocks_to_take`` says in advance what an admission costs, so
the pool never over-commits and nothing runs out of memory mid-step.

Prefix caching: every full block is known by the hash of all tokens up to its end (a chain, so a block
matches only after an identical prefix). A block's KV exists once ``mark_computed`` says so; ``match``
tells a waiting prompt how many leading blocks it can share now and whether more are being computed by
another sequence (then it should wait for them: sharing a block before its owner's prefill wrote it would
read garbage). Free blocks keep their hash and KV until handed out again, least recently freed first.
Every operation is O(1) per block it touches.

The hash chain is ``zserve.batching.prefix_hash`` (stable across processes and hosts), the one the broker's
router computes over a request's prompt. When ``report_events`` is on, every hash that enters or leaves the
cache's index is noted (its last state wins) until ``take_events`` collects the net change: what the engine
tells the broker it stored and evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from zserve.batching.prefix_hash import ROOT, chain_hash


class BlockPoolExhausted(RuntimeError):
    """A sequence needed a block and none was free (the caller should have asked first)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    prefix_hash: int | None = None  # set once the block is full: hash of every token up to its end
    computed: bool = False  # its KV is in the cache (shareable)


@dataclass(slots=True)
class SeqBlocks:
    """A sequence's view of the cache: its tokens so far and the blocks that hold their KV."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV was found in shared prefix blocks
    hashes: list[int] = field(default_factory=list)  # prefix hash of each full block of token_ids, so far
    num_computed_blocks: int = 0  # leading blocks marked computed by this sequence
    num_synced: int = 0  # leading blocks the engine has copied into its slot tables (reset by free)
    reuse_prefix: bool = True  # False: computed whole, never from cached blocks (its own still become shareable)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # least recently freed first
        self.by_hash: dict[int, int] = {}  # prefix hash -> block id (may be free: reusable until overwritten)
        # hash -> True (entered by_hash) / False (left it) since the last take_events; None: not reported
        self._events: dict[int, bool] | None = None

    def report_events(self) -> list[int]:
        """Start noting what enters and leaves the cache; returns the hashes it holds now (the snapshot the
        notes are relative to)."""
        self._events = {}
        return list(self.by_hash)

    def take_events(self) -> tuple[list[int], list[int]]:
        """(hashes stored, hashes evicted) since the last call, each at most once: the net change."""
        events = self._events
        if not events:
            return [], []
        self._events = {}
        return [h for h, stored in events.items() if stored], [h for h, stored in events.items() if not stored]

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq: SeqBlocks) -> list[int]:
        """The prefix hashes of the sequence's full blocks, extended for the blocks filled since last time."""
        bs, tokens, hashes = self.block_size, seq.token_ids, seq.hashes
        h = hashes[-1] if hashes else ROOT
        for start in range(len(hashes) * bs, len(tokens) - bs + 1, bs):
            h = chain_hash(h, tokens[start : start + bs])
            hashes.append(h)
        return hashes

    def _shareable(self, seq: SeqBlocks) -> list[int]:
        # never the block holding the prompt's last token: that token is computed to sample the first output
        return self._hashes(seq)[: (len(seq.token_ids) - 1) // self.block_size] if self.prefix_caching else []

    def match(self, seq: SeqBlocks) -> tuple[int, bool]:
        """(leading blocks of ``seq`` whose KV is cached now, whether the next one is being computed by a
        running sequence: wait for it rather than compute it twice)."""
        ready = 0
        shareable = self._shareable(seq)  # also the hashes allocate seals this sequence's blocks with
        if not seq.reuse_prefix:
            return 0, False
        for h in shareable:
            block_id = self.by_hash.get(h)
            if block_id is None:
                return ready, False
            block = self.blocks[block_id]
            if not block.computed:
                return ready, block.ref_count > 0
            ready += 1
        return ready, False

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free

    def blocks_to_take(self, seq: SeqBlocks, num_tokens: int) -> int:
        """Free blocks that allocating ``num_tokens`` of ``seq`` would use (shared live blocks cost none)."""
        ready, _ = self.match(seq)
        hashes = seq.hashes
        live = sum(1 for h in hashes[:ready] if self.blocks[self.by_hash[h]].ref_count > 0)
        return self.blocks_needed(num_tokens) - live

    def _take(self, block_id: int | None = None) -> int:
        if block_id is None:
            if not self.free_ids:
                raise BlockPoolExhausted("no free KV block")
            block_id, _ = self.free_ids.popitem(last=False)
            self._seal(block_id, None)  # fresh: its old content is about to be overwritten
            self.blocks[block_id].computed = False
        else:
            del self.free_ids[block_id]  # a free block found by its prefix hash: reuse its KV
        self.blocks[block_id].ref_count = 1
        return block_id

    def allocate(self, seq: SeqBlocks) -> int:
        """Blocks for every token of ``seq``, sharing the leading full blocks whose KV is cached. Returns the
        number of tokens found cached (``seq.num_cached_tokens``): their KV need not be computed."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        needed = self.blocks_needed(len(seq.token_ids))
        if self.blocks_to_take(seq, len(seq.token_ids)) > self.num_free:
            raise BlockPoolExhausted(f"sequence {seq.seq_id} needs {needed} blocks, {self.num_free} free")
        ready, _ = self.match(seq)
        for i in range(needed):
            if i < ready:
                block_id = self.by_hash[seq.hashes[i]]
                block = self.blocks[block_id]
                if block.ref_count > 0:
                    block.ref_count += 1
                else:
                    self._take(block_id)
            else:
                block_id = self._take()
                if i < len(seq.hashes):
                    self._seal(block_id, seq.hashes[i])
            seq.block_table.append(block_id)
        seq.num_cached_tokens = ready * self.block_size
        seq.num_computed_blocks = ready
        return seq.num_cached_tokens

    def _seal(self, block_id: int, prefix_hash: int | None) -> None:
        """Record (or clear) the prefix hash of a block just filled (or just handed out)."""
        block = self.blocks[block_id]
        events = self._events
        if block.prefix_hash is not None and self.by_hash.get(block.prefix_hash) == block_id:
            del self.by_hash[block.prefix_hash]
            if events is not None:
                events[block.prefix_hash] = False
        block.prefix_hash = prefix_hash
        # the first block known by a hash keeps it: a duplicate (computed by a sharer that could not wait)
        # must not hide a block whose KV already exists
        if prefix_hash is not None and self.prefix_caching and prefix_hash not in self.by_hash:
            self.by_hash[prefix_hash] = block_id
            if events is not None:
                events[prefix_hash] = True

    def can_append(self, seq: SeqBlocks) -> bool:
        """Whether the sequence's next token has a slot (a new block is needed every block_size tokens)."""
        return len(seq.token_ids) < len(seq.block_table) * self.block_size or self.num_free > 0

    def append(self, seq: SeqBlocks, token_id: int) -> None:
        """Add a generated token; take a new block when the last one is full, seal blocks that fill up."""
        if len(seq.token_ids) == len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take())
        seq.token_ids.append(token_id)
        if self.prefix_caching and len(seq.token_ids) % self.block_size == 0:
            self._seal(seq.block_table[-1], self._hashes(seq)[-1])

    def mark_computed(self, seq: SeqBlocks, num_tokens: int) -> None:
        """The KV of the first ``num_tokens`` of ``seq`` is in the cache: its full blocks become shareable."""
        full = min(num_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_computed_blocks, full):
            self.blocks[seq.block_table[i]].computed = True
        seq.num_computed_blocks = max(seq.num_computed_blocks, full)

    def free(self, seq: SeqBlocks) -> None:
        """Release the sequence's blocks (finished, aborted or preempted). Computed full blocks keep their
        prefix hash while free, so a later prompt with the same prefix takes them back without computing."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id} by sequence {seq.seq_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if not block.computed:
                    self._seal(block_id, None)  # announced but never written: nobody may wait for it
                self.free_ids[block_id] = None
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        seq.num_computed_blocks = 0
        seq.num_synced = 0
