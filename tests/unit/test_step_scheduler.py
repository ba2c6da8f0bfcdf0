"""The engine's step scheduler alone (no model): priorities, preemption order and aging, driven by a fake
clock and a fake step that appends a token to every sequence that samples."""

from __future__ import annotations

import random

import pytest

from zserve.generator.block_manager import BlockManager
from zserve.generator.scheduler import Chunk, StepScheduler
from zserve.generator.sequence import SamplingParams, Sequence


def make(num_blocks: int, *, block_size: int = 4, max_running: int = 64, budget: int = 256, aging_s: float = 1.0):
    blocks = BlockManager(num_blocks, block_size)
    return StepScheduler(blocks, max_batched_tokens=budget, max_running=max_running, chunked_prefill=True,
                         aging_s=aging_s)  # fmt: skip


def seq(seq_id: int, prompt_len: int, priority: int = 0, new: int = 4) -> Sequence:
    return Sequence(seq_id, [seq_id * 1000 + t for t in range(prompt_len)], SamplingParams(max_new_tokens=new),
                    priority=priority)  # fmt: skip


def step(s: StepScheduler) -> tuple[list[Chunk], list[int]]:
    """One engine step without a model: (the chunks, the ids that finished)."""
    chunks = s.schedule()
    done = []
    for c in chunks:
        c.seq.num_computed = c.end
        s.blocks.mark_computed(c.seq.kv, c.end)
        if c.samples:
            s.blocks.append(c.seq.kv, 7)
            if c.seq.num_generated >= c.seq.params.max_new_tokens:
                s.finish(c.seq)
                done.append(c.seq.seq_id)
    return chunks, done


def drain(s: StepScheduler, limit: int = 1000) -> list[int]:
    """Run to the end; the ids in the order they finished."""
    finished: list[int] = []
    for _ in range(limit):
        if not (s.waiting or s.running):
            return finished
        finished += step(s)[1]
    raise AssertionError("did not finish")


def test_admission_by_priority_then_arrival():
    s = make(64, max_running=1)
    for i, (priority, now) in enumerate([(5, 0.0), (0, 0.1), (3, 0.2), (0, 0.3), (5, 0.4)]):
        s.add(seq(i, 3, priority), now)
    assert drain(s) == [1, 3, 2, 0, 4]


def test_all_default_priorities_stay_first_come_first_served():
    s = make(64, max_running=2)
    for i in range(6):
        s.add(seq(i, 5), 0.01 * i)
    assert drain(s) == list(range(6))


def test_a_block_short_step_preempts_the_least_urgent_latest_arrival_never_a_more_urgent_one():
    # three 3-token prompts fill three 4-token blocks; each first token fills its block, so the next step every
    # one needs a new block and none is free
    s = make(3)
    a, b, c = seq(0, 3, priority=2), seq(1, 3, priority=0), seq(2, 3, priority=2)
    for now, x in enumerate([a, b, c]):
        s.add(x, float(now))
    step(s)
    assert s.blocks.num_free == 0 and len(s.running) == 3
    chunks, _ = step(s)
    # b (most urgent, though it came after a) takes c's block (priority 2 like a, but later); a then has
    # nobody less urgent left and preempts itself rather than b
    assert [x.seq_id for x in s.waiting.values()] == [c.seq_id, a.seq_id]
    assert [ch.seq.seq_id for ch in chunks] == [b.seq_id] and list(s.running) == [b.seq_id]
    assert s.preemptions == 2


def test_an_urgent_arrival_takes_blocks_from_less_urgent_running_ones_only_as_many_as_it_needs():
    s = make(6)
    background = [seq(i, 6, priority=3, new=10) for i in range(3)]  # 2 blocks each: the pool is full
    for i, x in enumerate(background):
        s.add(x, 0.01 * i)
    step(s)
    assert s.blocks.num_free == 0
    urgent = seq(9, 3, priority=0)  # one block
    s.add(urgent, 0.1)
    chunks, _ = step(s)
    assert urgent.seq_id in s.running and [x.seq_id for x in s.waiting.values()] == [2]  # the latest only
    assert {ch.seq.seq_id for ch in chunks} == {0, 1, 9}
    assert drain(s)[0] == urgent.seq_id


def test_a_waiting_sequence_never_preempts_more_urgent_running_ones():
    s = make(4)
    for i in range(2):
        s.add(seq(i, 6, priority=0, new=2), float(i))  # 2 blocks each, all they ever need
    step(s)
    assert s.blocks.num_free == 0
    late = seq(5, 3, priority=4)
    s.add(late, 9.0)
    _, done = step(s)
    assert late.seq_id in s.waiting and s.preemptions == 0 and done == [0, 1]
    assert drain(s) == [5]


def test_nobody_is_preempted_for_a_sequence_that_would_not_fit_anyway():
    s = make(6)
    s.add(seq(0, 6, priority=0, new=2), 0.0)  # 2 blocks, more urgent than the newcomer
    s.add(seq(1, 6, priority=5, new=2), 0.1)  # 2 blocks
    s.add(seq(2, 6, priority=5, new=2), 0.2)  # 2 blocks
    step(s)
    big = seq(7, 19, priority=1)  # 5 blocks: the two less urgent ones free only 4
    s.add(big, 0.3)
    step(s)
    assert s.preemptions == 0 and big.seq_id in s.waiting


def test_aging_bounds_the_wait_of_a_less_urgent_sequence():
    """One level per second: a priority-5 sequence added at t=0 goes before every priority-0 one added after
    t=5, however steady the stream; without aging (a huge aging_s) it starves."""

    def run(aging_s: float) -> tuple[list[int], float | None]:
        s = make(64, max_running=1, aging_s=aging_s)
        s.add(seq(0, 3, priority=5, new=1), 0.0)
        now, started, admitted = 0.0, [], None
        for k in range(1, 60):
            now = 0.25 * k
            s.add(seq(k, 3, priority=0, new=1), now)
            chunks, _ = step(s)
            started += [c.seq.seq_id for c in chunks if c.start == 0]
            if 0 in started and admitted is None:
                admitted = now
        return started, admitted

    started, admitted = run(1.0)
    # the urgent ones added before t=5 (ranks 0.25 .. 4.75) go first, then it
    assert started.index(0) == 19 and started[:19] == list(range(1, 20))
    assert admitted is not None and admitted <= 5.0 + 0.25 * 20
    starved, never = run(1e9)
    assert 0 not in starved and never is None


@pytest.mark.parametrize(("arrival", "preempted"), [(2.5, True), (3.5, False)])
def test_an_aged_running_sequence_is_not_preempted_by_a_newcomer(arrival, preempted):
    s = make(4)
    old = seq(0, 5, priority=3, new=3)  # rank 3.0; 2 blocks, all it ever needs
    s.add(old, 0.0)
    step(s)
    s.add(seq(1, 6, priority=0, new=2), 1.0)  # rank 1.0: the other 2 blocks
    step(s)
    assert s.blocks.num_free == 0
    s.add(seq(2, 3, priority=0), arrival)  # rank 2.5: more urgent than old; 3.5: old has waited past it
    step(s)
    assert s.preemptions == int(preempted) and (0 in s.waiting) == preempted and (2 in s.running) == preempted


def test_an_aborted_waiting_sequence_and_a_reused_id_keep_the_order():
    s = make(64, max_running=1)
    s.add(seq(0, 3, priority=0), 0.0)
    first = seq(1, 3, priority=1)
    s.add(first, 0.1)
    s.abort(first)
    s.add(seq(1, 3, priority=9), 0.2)  # the same id again, now the least urgent
    s.add(seq(2, 3, priority=2), 0.3)
    assert drain(s) == [0, 2, 1]


@pytest.mark.parametrize("seed", range(20))
def test_random_priorities_keep_every_invariant(seed):
    """A small pool, random priorities and arrivals: every chunk is of a running sequence (once: vLLM 23347
    scheduled a request it then preempted in the same step), the step never runs out of blocks, a victim is
    never more urgent than a sequence that stays or joins, and everything finishes with every block back."""
    rng = random.Random(seed)
    s = make(12, budget=rng.choice([8, 32, 256]), max_running=rng.choice([3, 64]), aging_s=rng.choice([0.5, 100.0]))
    pending = [seq(i, rng.randrange(1, 14), rng.randrange(-2, 4), rng.randrange(1, 12)) for i in range(30)]
    now, finished = 0.0, []
    for _ in range(5000):
        if not (pending or s.waiting or s.running):
            break
        now += 0.1
        while pending and rng.random() < 0.4:
            s.add(pending.pop(0), now)
        before = dict(s.running)
        chunks, done = step(s)  # BlockPoolExhausted here would be a broken reservation
        ids = [c.seq.seq_id for c in chunks]
        assert len(ids) == len(set(ids)) and all(i in s.running or i in done for i in ids)
        victims = [x for i, x in before.items() if i in s.waiting]
        if victims:
            worst = min(v.rank for v in victims)
            stayed = [x for i, x in before.items() if i not in s.waiting]
            joined = [c.seq for c in chunks if c.seq.seq_id not in before]
            assert all(x.rank < worst for x in stayed + joined)
        finished += done
    assert sorted(finished) == list(range(30)) and s.blocks.num_free == 12
