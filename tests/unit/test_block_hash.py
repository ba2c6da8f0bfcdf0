"""The prefix-block hash chain: the engine's block manager and the broker's router agree on it, and it is the
same in every process (a remote engine may run another Python build)."""

from __future__ import annotations

import os
import subprocess
import sys

from zserve.batching.prefix_hash import block_hashes, chain_hash, pack, shareable_hashes, unpack
from zserve.batching.prefix_table import buildable, native_index
from zserve.generator.block_manager import BlockManager, SeqBlocks

# BLAKE2b-64 of (parent as 8 little-endian bytes, each id as 4): fixed values, so a change of the function (which
# would split every mixed-version deployment's cache from its router) fails here and not in production
GOLDEN = [
    (0, list(range(16)), 10251598853290956434),
    (2**64 - 1, [2**32 - 1] * 16, 14114715859839730171),
]


def test_the_chain_is_the_documented_function():
    for parent, tokens, expected in GOLDEN:
        assert chain_hash(parent, tokens) == expected
    ids = list(range(40))
    first = chain_hash(0, ids[:16])
    assert block_hashes(ids, 16) == [first, chain_hash(first, ids[16:32])]
    assert block_hashes(ids, 16, max_blocks=1) == [first]
    # a block matches only after an identical prefix
    assert block_hashes([9, *ids[1:32]], 16)[1] != block_hashes(ids, 16)[1]


def test_the_same_in_another_process_with_another_hash_seed():
    code = "from zserve.batching.prefix_hash import block_hashes; print(block_hashes(list(range(100)), 16))"
    seen = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen.add(out.stdout.strip())
    assert seen == {str(block_hashes(list(range(100)), 16))}


def test_the_block_manager_and_the_router_agree():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.report_events()
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 0, 11]  # 3 full blocks; the third holds the last token
    seq = SeqBlocks(1, list(prompt))
    bm.allocate(seq)
    assert seq.hashes[:2] == shareable_hashes(prompt, 4)
    assert seq.hashes == block_hashes(prompt, 4)
    assert set(bm.by_hash) == set(block_hashes(prompt, 4))
    stored, evicted = bm.take_events()
    assert sorted(stored) == sorted(block_hashes(prompt, 4)) and evicted == []
    assert bm.take_events() == ([], [])


def test_events_are_the_net_change_and_eviction_is_reported():
    bm = BlockManager(num_blocks=2, block_size=2)
    assert bm.report_events() == []
    a = SeqBlocks(1, [1, 2, 3, 4])
    bm.allocate(a)
    bm.mark_computed(a, 4)
    bm.free(a)  # computed: the blocks keep their hashes while free
    first = bm.take_events()
    assert sorted(first[0]) == sorted(block_hashes([1, 2, 3, 4], 2)) and first[1] == []
    b = SeqBlocks(2, [5, 6, 7, 8])  # takes both free blocks: a's hashes leave the cache
    bm.allocate(b)
    stored, evicted = bm.take_events()
    assert sorted(evicted) == sorted(block_hashes([1, 2, 3, 4], 2))
    assert sorted(stored) == sorted(block_hashes([5, 6, 7, 8], 2))
    bm.free(b)  # never computed: its hashes leave the cache (nobody may wait for them)
    stored, evicted = bm.take_events()
    assert stored == [] and sorted(evicted) == sorted(block_hashes([5, 6, 7, 8], 2))
    c = SeqBlocks(3, [9, 9, 9, 9])
    bm.allocate(c)
    bm.free(c)  # stored and evicted between two reports: only its last state goes out (an idempotent evict)
    stored, evicted = bm.take_events()
    assert stored == [] and sorted(evicted) == sorted(block_hashes([9, 9, 9, 9], 2))


def test_packed_hashes_are_little_endian_uint64s_that_both_indexes_read_as_the_ints():
    hashes = [0, 1, 2**63, 2**64 - 1, GOLDEN[0][2]]
    packed = pack(hashes)
    assert packed[8:16] == (1).to_bytes(8, "little") and unpack(packed) == hashes
    assert unpack(packed + b"\x01\x02") == hashes  # a partial last hash is dropped
    index = native_index()
    if index is None:
        assert not buildable()
        return
    c = index(seed=1)
    c.reset(b"e", hashes[:3], 0)
    assert c.longest(packed, c.bit(b"e")) == c.longest(hashes, c.bit(b"e")) == (3, c.bit(b"e"))
    assert c.longest(packed + b"\x01", 1) == c.longest(hashes, 1) and c.longest(b"\x01" * 7, 1) == (0, 0)
