"""The paged KV cache's block manager: random workloads never leak or double-free a block."""

from __future__ import annotations

import random

import pytest

from zserve.generator.block_manager import BlockManager, BlockPoolExhausted, SeqBlocks


def check(bm: BlockManager, live: dict[int, SeqBlocks]) -> None:
    refs = [0] * len(bm.blocks)
    for seq in live.values():
        assert len(seq.block_table) == bm.blocks_needed(len(seq.token_ids))
        for block_id in seq.block_table:
            refs[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    free = set(bm.free_ids)
    assert len(free) == len(bm.free_ids)  # no block listed free twice
    assert free == {i for i, r in enumerate(refs) if r == 0}  # free exactly when unreferenced


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_thousand_random_operations_leak_nothing(prefix_caching):
    rng = random.Random(7)
    bm = BlockManager(num_blocks=64, block_size=4, prefix_caching=prefix_caching)
    live: dict[int, SeqBlocks] = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    for seq_id in range(1000):
        op = rng.random()
        if op < 0.35 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
            seq = SeqBlocks(seq_id, list(prompt))
            if bm.can_allocate(len(prompt)):
                bm.allocate(seq)
                live[seq_id] = seq
            elif bm.num_free == 0:
                with pytest.raises(BlockPoolExhausted):
                    bm.allocate(seq)
        elif op < 0.8:
            seq = live[rng.choice(list(live))]
            for _ in range(rng.randrange(1, 6)):
                if not bm.can_append(seq):
                    victim = max(live)  # preempt the youngest
                    bm.free(live.pop(victim))
                    if victim == seq.seq_id:
                        break
                bm.append(seq, rng.randrange(50))
        else:
            bm.free(live.pop(rng.choice(list(live))))  # finish or abort
        check(bm, live)
    for seq in list(live.values()):
        bm.free(seq)
    assert bm.num_free == 64
    with pytest.raises(RuntimeError, match="double free"):
        seq = SeqBlocks(0, [1, 2, 3])
        bm.allocate(seq)
        table = list(seq.block_table)
        bm.free(seq)
        seq.block_table = table
        bm.free(seq)


def test_identical_prefixes_share_full_blocks_and_survive_a_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = SeqBlocks(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    b = SeqBlocks(2, [1, 2, 3, 4, 5, 6, 7, 8, 42])
    assert bm.match(b) == (0, True)  # announced by a, not computed yet: wait for it
    bm.mark_computed(a, 9)
    assert bm.match(b) == (2, False)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8 and bm.num_free == 8 - 4
    bm.free(a)
    bm.free(b)
    c = SeqBlocks(3, [1, 2, 3, 4, 0])
    bm.allocate(c)
    assert c.num_cached_tokens == 4  # the freed block kept its prefix: no recompute
