"""Preprocess stages without processes: hook wiring, start-up validation, the runners, the routing."""

from __future__ import annotations

import numpy as np
import pytest
from testmodels import MisplacedTokenizer, Picky, Staged

from zserve import Model, payload
from zserve.batching.scheduler import BatchPolicy, Scheduler
from zserve.batching.workers import WorkerPool
from zserve.hooks import HookError, check_preprocess_hooks, uses_preprocess
from zserve.protocol import Batch, Status
from zserve.workers.engine import BatchSteps
from zserve.workers.preprocess import PreprocessRunner


class TokenizerInSetupPreprocess(Model):
    vocab = {"a": 1}  # a class attribute is everywhere

    def setup_preprocess(self):
        self.tokenizer = str.split

    def setup(self, device):
        self.weights = 1

    def preprocess(self, items):
        return [(self.tokenizer(i), self.vocab) for i in items]

    def predict(self, batch):
        return [self.weights for _ in batch]


def test_only_models_that_override_preprocess_get_a_stage():
    assert uses_preprocess(Staged) and uses_preprocess(TokenizerInSetupPreprocess)
    assert not uses_preprocess(Picky)


def test_a_resource_created_only_in_setup_is_caught_at_start_up():
    with pytest.raises(HookError) as info:
        check_preprocess_hooks(MisplacedTokenizer)
    message = str(info.value)
    assert "self.tokenizer" in message and "setup_preprocess" in message
    check_preprocess_hooks(TokenizerInSetupPreprocess)  # fine
    check_preprocess_hooks(Picky)  # no stage, nothing to check


def frames_of(items):
    frames, counts = [], []
    for item in items:
        f = payload.encode(item)
        frames += f
        counts.append(len(f))
    return frames, counts


def test_stage_then_engine_carry_a_batch_and_arrays_as_raw_frames():
    model = Staged()
    model.setup_preprocess()
    frames, counts = frames_of(["a", "b", "c"])
    result, out = PreprocessRunner(model, "stage").run(Batch(1, "m", [1, 2, 3], counts, [True] * 3), frames)
    assert result.statuses == [Status.OK] * 3 and result.prepared_frames == len(out) == 1
    batch = Batch(2, "m", [1, 2, 3], [len(out)], [True] * 3, prepared=True)
    engine_result, engine_out = BatchSteps(model, "engine").run(batch, out)
    assert engine_result.statuses == [Status.OK] * 3
    assert [payload.decode([f])["echo"] for f in engine_out] == ["a", "b", "c"]

    arrays = {"input_ids": np.arange(6).reshape(2, 3)}
    encoded = payload.encode(arrays)
    assert len(encoded) == 2  # the array is its own frame


def test_a_preprocess_exception_fails_its_batch_with_a_400_naming_the_stage():
    model = Staged()
    model.setup_preprocess()
    frames, counts = frames_of(["a", "poison"])
    result, out = PreprocessRunner(model, "stage-m-0:7").run(Batch(1, "m", [1, 2], counts, [True, True]), frames)
    assert result.statuses == [Status.BAD_REQUEST] * 2
    assert "preprocess stage stage-m-0:7" in result.messages[0] and "ValueError" in result.messages[0]
    assert result.prepared_frames == 0 and out == []


def test_decode_failures_stay_with_their_item_in_the_stage():
    model = Staged()
    model.setup_preprocess()
    frames, counts = frames_of(["a", "b"])
    frames[0] = b"\xc1"
    result, out = PreprocessRunner(model, "s").run(Batch(1, "m", [1, 2], counts, [False, False]), frames)
    assert result.statuses == [Status.BAD_REQUEST, Status.OK]
    assert payload.decode(out[-result.prepared_frames :])["items"] == ["b"]


def test_staged_models_go_to_a_stage_first_and_prepared_batches_to_engines():
    pool = WorkerPool(liveness_s=1.0)
    pool.register(b"s", name="s", pid=1, role="preprocess", models=["m"], credits=1, now=0.0)
    pool.register(b"e", name="e", pid=2, role="engine", models=["m"], credits=1, now=0.0)
    s = Scheduler({"m": BatchPolicy(2, 5.0, 100)}, pool, frozenset({"m"}))
    for i in range(6):
        s.submit("m", i, 0.0)
    [d] = s.pop_batches(0.0)
    assert d.worker.name == "s" and d.item_ids == [0, 1] and d.prepared is None
    pool.finish(d.batch_id)
    s.add_prepared("m", [0, 1], [b"payload"])
    batches = s.pop_batches(0.0)
    assert [(b.worker.name, b.item_ids, b.prepared is not None) for b in batches] == [
        ("e", [0, 1], True),
        ("s", [2, 3], False),
    ]
    # the engine is busy and one prepared batch waits: the stage is not fed further (bounded memory)
    pool.finish(batches[1].batch_id)
    s.add_prepared("m", [2, 3], [b"p2"])
    assert s.pop_batches(1.0) == []
    assert s.prepared_depth("m") == 1 and s.depth("m") == 2
    assert s.next_wakeup_s(1.0) is None  # no timer can help (a busy loop would spin on 0)


def test_a_partial_batch_waits_for_a_stage_until_an_engine_would_otherwise_idle():
    pool = WorkerPool(liveness_s=1.0)
    pool.register(b"s", name="s", pid=1, role="preprocess", models=["m"], credits=1, now=0.0)
    pool.register(b"e", name="e", pid=2, role="engine", models=["m"], credits=1, now=0.0)
    s = Scheduler({"m": BatchPolicy(8, 5.0, 100)}, pool, frozenset({"m"}))
    s.submit("m", 0, 0.0)
    [first] = s.pop_batches(0.0)  # everything idle: a lone request goes at once
    assert first.item_ids == [0]
    pool.finish(first.batch_id)
    s.add_prepared("m", [0], [b"p"])
    [to_engine] = s.pop_batches(0.0)
    assert to_engine.worker.name == "e"
    for i in range(1, 4):
        s.submit("m", i, 0.001)
    assert s.pop_batches(1.0) == []  # the engine is busy: the batch keeps filling past max_wait_ms
    assert s.next_wakeup_s(1.0) is None
    pool.finish(to_engine.batch_id)  # the engine is free and nothing is on its way: send what there is
    [partial] = s.pop_batches(1.0)
    assert partial.worker.name == "s" and partial.item_ids == [1, 2, 3]


def test_a_busy_engines_spare_credit_takes_only_full_batches_from_the_stage():
    pool = WorkerPool(liveness_s=1.0)
    pool.register(b"s", name="s", pid=1, role="preprocess", models=["m"], credits=1, now=0.0)
    pool.register(b"e", name="e", pid=2, role="engine", models=["m"], credits=2, now=0.0)
    s = Scheduler({"m": BatchPolicy(4, 5.0, 100)}, pool, frozenset({"m"}))
    s.submit("m", 0, 0.0)
    [first] = s.pop_batches(0.0)
    pool.finish(first.batch_id)
    s.add_prepared("m", [0], [b"p"])
    [busy] = s.pop_batches(0.0)
    assert busy.worker.name == "e" and pool.free_credit_total("m") == 1
    for i in range(1, 4):
        s.submit("m", i, 0.001)
    assert s.pop_batches(1.0) == []  # one credit spare, but the engine computes: the batch keeps filling
    s.submit("m", 4, 1.0)
    [full] = s.pop_batches(1.0)  # full: prepared now, ready when the engine's current batch ends
    assert full.worker.name == "s" and full.item_ids == [1, 2, 3, 4]


def test_an_idle_engine_that_preprocesses_takes_a_staged_batch_itself_and_a_busy_one_does_not():
    pool = WorkerPool(liveness_s=1.0)
    pool.register(b"s", name="s", pid=1, role="preprocess", models=["m"], credits=1, now=0.0)
    pool.register(b"e", name="e", pid=2, role="engine", models=["m"], credits=2, now=0.0, preprocesses=True)
    s = Scheduler({"m": BatchPolicy(4, 5.0, 100)}, pool, frozenset({"m"}))
    s.submit("m", 0, 0.0)
    [direct] = s.pop_batches(0.0)
    assert direct.worker.name == "e" and direct.preprocess and direct.prepared is None
    for i in range(1, 5):
        s.submit("m", i, 0.001)
    [staged] = s.pop_batches(0.001)  # the engine computes: a full batch goes through the stage
    assert staged.worker.name == "s" and not staged.preprocess and staged.item_ids == [1, 2, 3, 4]


def test_an_engine_runs_preprocess_on_a_batch_sent_to_it_unpreprocessed():
    model = Staged()
    model.setup_preprocess()
    frames, counts = frames_of(["a", "b"])
    result, out = BatchSteps(model, "e").run(Batch(1, "m", [1, 2], counts, [True] * 2, preprocess=True), frames)
    assert result.statuses == [Status.OK] * 2
    assert [payload.decode([f])["echo"] for f in out] == ["a", "b"]
    frames, counts = frames_of(["a", "poison"])
    result, _ = BatchSteps(model, "e").run(Batch(2, "m", [1, 2], counts, [True] * 2, preprocess=True), frames)
    assert result.statuses == [Status.BAD_REQUEST] * 2 and "cannot preprocess poison" in result.messages[0]
