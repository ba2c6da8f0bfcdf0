"""The engine's step scheduler alone (no model): priorities, preemption order and aging, driven by a fake
clock and a fake step that appends a token to every sequence that samples."""

from __future__ import annotations

import random

import pytest

from zserve.generator.block_manager import BlockManager
from zserve.generator.sequence import SamplingParams, Sequence
from zserve.generator.step_scheduler import StepScheduler, StepSpan


def make(
    num_blocks: int,
    *,
    block_size: int = 4,
    max_running: int = 64,
    budget: int = 256,
    aging_s: float = 1.0,
    chunked: bool = True,
) -> StepScheduler:
    blocks = BlockManager(num_blocks, block_size)
    return StepScheduler(blocks, max_batched_tokens=budget, max_running=max_running, chunked_prefill=chunked,
                         aging_s=aging_s)  # fmt: skip


def watch_make_room(s: StepScheduler) -> list[Sequence]:
    """Record every waiting sequence for which ``_make_room`` preempted (the real method runs): preemptions
    made for an admission, as opposed to those of a running sequence short of a block."""
    requesters: list[Sequence] = []
    real = s._make_room

    def make_room(head: Sequence, order: list[Sequence]) -> None:
        before = s.preemptions
        real(head, order)
        if s.preemptions > before:
            requesters.append(head)

    s._make_room = make_room  # type: ignore[method-assign]
    return requesters


def seq(seq_id: int, prompt_len: int, priority: int = 0, new: int = 4) -> Sequence:
    return Sequence(seq_id, [seq_id * 1000 + t for t in range(prompt_len)], SamplingParams(max_new_tokens=new),
                    priority=priority)  # fmt: skip


def step(s: StepScheduler) -> tuple[list[StepSpan], list[int]]:
    """One engine step without a model: (the spans, the ids that finished)."""
    spans = s.schedule()
    done = []
    for c in spans:
        c.seq.num_computed = c.end
        s.blocks.mark_computed(c.seq.kv, c.end)
        if c.samples:
            s.blocks.append(c.seq.kv, 7)
            if c.seq.num_generated >= c.seq.params.max_new_tokens:
                s.finish(c.seq)
                done.append(c.seq.seq_id)
    return spans, done


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
    spans, _ = step(s)
    # b (most urgent, though it came after a) takes c's block (priority 2 like a, but later); a then has
    # nobody less urgent left and preempts itself rather than b
    assert [x.seq_id for x in s.waiting.values()] == [c.seq_id, a.seq_id]
    assert [ch.seq.seq_id for ch in spans] == [b.seq_id] and list(s.running) == [b.seq_id]
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
    spans, _ = step(s)
    assert urgent.seq_id in s.running and [x.seq_id for x in s.waiting.values()] == [2]  # the latest only
    assert {ch.seq.seq_id for ch in spans} == {0, 1, 9}
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


def test_nobody_is_preempted_for_a_sequence_the_token_budget_cannot_admit_this_step():
    """Without chunked prefill an 8-token prompt needs 8 tokens of one step; with the more urgent A decoding, 7
    are left. Preempting B for its blocks would leave B and the newcomer both waiting while A runs alone."""
    s = make(5, budget=8, chunked=False)
    b = seq(1, 8, priority=5, new=30)  # 3 blocks once it samples
    s.add(b, 0.0)
    step(s)
    a = seq(0, 3, priority=0, new=30)
    s.add(a, 0.0)
    step(s)
    assert s.blocks.num_free == 1 and list(s.running) == [b.seq_id, a.seq_id]
    urgent = seq(9, 8, priority=1, new=2)  # more urgent than b, less than a; 3 blocks: only b's free enough
    s.add(urgent, 0.5)
    requesters = watch_make_room(s)
    for _ in range(2):  # then b's 12th token fills its last block and b, the least urgent, preempts itself
        spans, _ = step(s)
        assert s.preemptions == 0 and not requesters
        assert {c.seq.seq_id for c in spans} == {a.seq_id, b.seq_id} and urgent.seq_id in s.waiting


def test_nobody_is_preempted_for_a_sequence_that_finds_no_token_budget_left():
    """The urgent one would take v's blocks, but the more urgent a's prefill chunks take the whole budget: v
    keeps its blocks until a step leaves budget for the newcomer, and is preempted in that step."""
    s = make(8, budget=4)
    v = seq(2, 3, priority=5, new=30)
    s.add(v, 0.0)
    step(s)
    a = seq(0, 20, priority=0, new=2)  # 5 blocks, then 4 prompt tokens a step
    s.add(a, 0.1)
    step(s)
    assert s.blocks.num_free == 1 and list(s.running) == [v.seq_id, a.seq_id]
    urgent = seq(9, 3, priority=1, new=2)  # 1 block and a's next one: v's 2 blocks are needed
    s.add(urgent, 0.2)
    requesters = watch_make_room(s)
    for _ in range(20):
        spans, _ = step(s)
        if urgent.seq_id not in s.waiting:
            break
        assert s.preemptions == 0 and v.seq_id in s.running and [c.seq for c in spans] == [a]
    assert requesters == [urgent] and s.preemptions == 1 and v.seq_id in s.waiting
    assert [c.seq.seq_id for c in spans] == [a.seq_id, urgent.seq_id]


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
            spans, _ = step(s)
            started += [c.seq.seq_id for c in spans if c.start == 0]
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
    """A small pool, random priorities and arrivals: every span is of a running sequence (once: vLLM 23347
    scheduled a request it then preempted in the same step), the step never runs out of blocks, a victim is
    never more urgent than a sequence that stays or joins, a sequence that preempts others to join does join in
    that step, and everything finishes with every block back."""
    rng = random.Random(seed)
    s = make(12, budget=rng.choice([8, 32, 256]), max_running=rng.choice([3, 64]), aging_s=rng.choice([0.5, 100.0]),
             chunked=rng.random() < 0.7)  # fmt: skip
    requesters = watch_make_room(s)
    pending = [seq(i, rng.randrange(1, 14), rng.randrange(-2, 4), rng.randrange(1, 12)) for i in range(30)]
    now, finished = 0.0, []
    for _ in range(5000):
        if not (pending or s.waiting or s.running):
            break
        now += 0.1
        while pending and rng.random() < 0.4:
            s.add(pending.pop(0), now)
        before = dict(s.running)
        requesters.clear()
        spans, done = step(s)  # BlockPoolExhausted here would be a broken reservation
        ids = [c.seq.seq_id for c in spans]
        assert len(ids) == len(set(ids)) and all(i in s.running or i in done for i in ids)
        # a preemption for a waiting sequence admits it in the same step
        assert all(x.seq_id in ids and x.seq_id not in before for x in requesters)
        victims = [x for i, x in before.items() if i in s.waiting]
        if victims:
            worst = min(v.rank for v in victims)
            stayed = [x for i, x in before.items() if i not in s.waiting]
            joined = [c.seq for c in spans if c.seq.seq_id not in before]
            assert all(x.rank < worst for x in stayed + joined)
        finished += done
    assert sorted(finished) == list(range(30)) and s.blocks.num_free == 12


def _check_blocks(s: StepScheduler) -> None:
    """Every block's reference count is the number of running sequences that hold it; waiting ones hold none."""
    refs: dict[int, int] = {}
    for x in s.running.values():
        for block_id in x.kv.block_table:
            refs[block_id] = refs.get(block_id, 0) + 1
    assert all(not x.kv.block_table for x in s.waiting.values())
    for block in s.blocks.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in s.blocks.free_ids)


def _fuzz(seed: int) -> None:
    rng = random.Random(seed)
    bs, nb = rng.choice([2, 4]), rng.choice([8, 12, 20])
    s = make(nb, block_size=bs, budget=rng.choice([4, 8, 32, 256]), max_running=rng.choice([2, 3, 64]),
             aging_s=rng.choice([0.5, 100.0]), chunked=rng.random() < 0.7)  # fmt: skip
    requesters = watch_make_room(s)
    prefixes = [[900 + k for k in range(rng.randrange(0, 12))] for _ in range(3)]  # shared prompt prefixes
    pending = []
    for i in range(40):
        tokens = rng.choice(prefixes) + [i * 1000 + t for t in range(rng.randrange(1, 6))]
        new = rng.randrange(1, 10)
        if -(-(len(tokens) + new) // bs) > nb:
            tokens, new = tokens[:bs], 1
        logprobs = 0 if rng.random() < 0.15 else -1  # such a prompt shares no prefix
        params = SamplingParams(max_new_tokens=new, prompt_logprobs=logprobs)
        pending.append(Sequence(i, tokens, params, priority=rng.randrange(-2, 4)))
    now, done, aborted, added = 0.0, set(), set(), set()
    for _ in range(20000):
        if not (pending or s.waiting or s.running):
            break
        now += 0.1
        while pending and rng.random() < 0.4:
            x = pending.pop(0)
            s.add(x, now)
            added.add(x.seq_id)
        if rng.random() < 0.05 and (s.waiting or s.running):
            x = rng.choice(list(s.waiting.values()) + list(s.running.values()))
            s.abort(x)
            aborted.add(x.seq_id)
        before = dict(s.running)
        requesters.clear()
        spans, finished = step(s)
        ids = [c.seq.seq_id for c in spans]
        assert len(ids) == len(set(ids)) and all(i in s.running or i in finished for i in ids)
        victims = [x for i, x in before.items() if i in s.waiting]
        if victims:
            worst = min(v.rank for v in victims)
            stayed = [x for i, x in before.items() if i not in s.waiting]
            joined = [c.seq for c in spans if c.seq.seq_id not in before]
            assert all(x.rank < worst for x in stayed + joined)
        assert all(x.seq_id in ids and x.seq_id not in before for x in requesters)
        done.update(finished)
        _check_blocks(s)
        assert all((i in s.waiting) != (i in s.running) for i in added - done - aborted)
    else:
        raise AssertionError(f"no progress: waiting {list(s.waiting)}, running {list(s.running)}")
    assert done | aborted == set(range(40)) and s.blocks.num_free == nb


@pytest.mark.parametrize("first", range(0, 400, 100))
def test_shared_prefixes_aborts_and_no_chunked_prefill_keep_every_invariant(first):
    """The invariants above (100 seeds a case, about 0.3 s) with shared prompt prefixes, prompts that keep
    their logprobs, aborts, a budget as small as 4 tokens, chunked prefill on and off; and every block's
    reference count is that of the running sequences that hold it."""
    for seed in range(first, first + 100):
        _fuzz(seed)
