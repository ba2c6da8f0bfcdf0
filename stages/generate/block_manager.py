"""The paged KV cache's bookkeeping: fixed-size blocks from a preallocated pool, a block table per sequence,
and prefix sharing (full blocks with identical token prefixes are computed once and shared by reference
count). Pure: no tensors; the cache tensors are indexed by the block ids this hands out.

A sequence grows block by block. When the pool cannot serve a step, the caller preempts (``free``) the
youngest sequence and recomputes it later; ``can_allocate``/``can_append`` say in advance, so the pool never
over-commits and nothing runs out of memory mid-step.

Caveat for the step loop that will use this (generative-engine issue, not built yet): a prompt's full
blocks are hashed when allocated, before their KV is computed; a sequence that shares one must not run
before the owner's prefill of that block has (with chunked prefill, schedule sharers after the owner).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class BlockPoolExhausted(RuntimeError):
    """A sequence needed a block and none was free (the caller should have asked ``can_*`` first)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    prefix_hash: int | None = None  # set once the block is full: hash of every token up to its end


@dataclass(slots=True)
class SeqBlocks:
    """A sequence's view of the cache: its tokens so far and the blocks that hold their KV."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV was found in shared prefix blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.by_hash: dict[int, int] = {}  # prefix hash -> block id (may be free: reusable until overwritten)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hashes(self, token_ids: list[int]) -> list[int]:
        hashes, h = [], 0
        for start in range(0, len(token_ids) - len(token_ids) % self.block_size, self.block_size):
            h = hash((h, tuple(token_ids[start : start + self.block_size])))
            hashes.append(h)
        return hashes

    def _take(self, block_id: int | None = None) -> int:
        if block_id is None:
            if not self.free_ids:
                raise BlockPoolExhausted("no free KV block")
            block_id = self.free_ids.popleft()
        else:
            self.free_ids.remove(block_id)  # a free block found by its prefix hash: reuse its KV
        self.blocks[block_id].ref_count = 1
        return block_id

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free

    def allocate(self, seq: SeqBlocks) -> None:
        """Blocks for the whole prompt, sharing every full block whose prefix is cached."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        hashes = self._prefix_hashes(seq.token_ids) if self.prefix_caching else []
        needed = self.blocks_needed(len(seq.token_ids))
        shared = 0
        for h in hashes:
            block_id = self.by_hash.get(h)
            if block_id is None:
                break
            shared += 1
        if needed - sum(1 for h in hashes[:shared] if self.blocks[self.by_hash[h]].ref_count > 0) > self.num_free:
            raise BlockPoolExhausted(f"sequence {seq.seq_id} needs {needed} blocks, {self.num_free} free")
        for i in range(needed):
            if i < shared:
                block_id = self.by_hash[hashes[i]]
                block = self.blocks[block_id]
                if block.ref_count > 0:
                    block.ref_count += 1
                else:
                    self._take(block_id)
                seq.num_cached_tokens += self.block_size
            else:
                block_id = self._take()
                self._seal(block_id, hashes[i] if i < len(hashes) else None)
            seq.block_table.append(block_id)

    def _seal(self, block_id: int, prefix_hash: int | None) -> None:
        """Record (or clear) the prefix hash of a block just filled (or just handed out)."""
        block = self.blocks[block_id]
        if block.prefix_hash is not None and self.by_hash.get(block.prefix_hash) == block_id:
            del self.by_hash[block.prefix_hash]  # its old content is being overwritten
        block.prefix_hash = prefix_hash
        if prefix_hash is not None and self.prefix_caching:
            self.by_hash[prefix_hash] = block_id

    def can_append(self, seq: SeqBlocks) -> bool:
        """Whether the sequence's next token has a slot (a new block is needed every block_size tokens)."""
        return len(seq.token_ids) < len(seq.block_table) * self.block_size or self.num_free > 0

    def append(self, seq: SeqBlocks, token_id: int) -> None:
        """Add a generated token; take a new block when the last one is full, seal blocks that fill up."""
        if len(seq.token_ids) == len(seq.block_table) * self.block_size:
            block_id = self._take()
            self._seal(block_id, None)
            seq.block_table.append(block_id)
        seq.token_ids.append(token_id)
        if self.prefix_caching and len(seq.token_ids) % self.block_size == 0:
            self._seal(seq.block_table[-1], self._prefix_hashes(seq.token_ids)[-1])

    def free(self, seq: SeqBlocks) -> None:
        """Release the sequence's blocks (finished, aborted or preempted). Full blocks keep their prefix
        hash while free, so a later prompt with the same prefix can take them back without recomputing."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id} by sequence {seq.seq_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
