"""Grammar compiles off the admission path, within a budget (grammar_compile.GrammarService): a schema past
its time or memory budget is a BadRequest naming the request's field, and the compiler process is replaced;
a cancelled compile is killed, not left running; other schemas compile meanwhile and after; the cache is
bounded; no compile starves another thread of the interpreter lock (the heartbeat's). And what the grammar
cannot enforce is refused before any compile (schema_check)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from tinylm import build_tiny_lm

from zserve.errors import BadRequest
from zserve.generator import grammar
from zserve.generator.schema_check import unenforceable

needs_xgrammar = pytest.mark.skipif(not grammar.available(), reason="xgrammar is not installed (the structured extra)")

SMALL = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def optional_properties(n: int) -> str:
    """A schema whose compile grows much faster than its size: 1,000 optional properties take ~30 s on the
    tiny tokenizer (100 take 0.03 s)."""
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_lm(tmp_path_factory.mktemp("tinylm")))


@pytest.fixture(scope="module")
def service(tokenizer):
    from zserve.generator.grammar_compile import CompileBudget, GrammarService

    svc = GrammarService(tokenizer, len(tokenizer), CompileBudget(time_s=1.5, cache_entries=3))
    svc.compile(None)  # the child has started
    yield svc
    svc.close()


@needs_xgrammar
def test_a_compile_past_its_time_budget_is_a_bad_request_naming_the_field(service):
    kills = service.kills
    started = time.monotonic()
    with pytest.raises(BadRequest) as info:
        service.compile(optional_properties(1000), field="tools")
    took = time.monotonic() - started
    assert info.value.field == "tools" and "1.5 s budget" in info.value.message
    assert took < 6, took  # the budget, not the ~30 s the compile would take
    assert service.kills == kills + 1
    assert service.compile(SMALL) is not None  # a new compiler process took over


@needs_xgrammar
def test_a_compile_past_its_memory_budget_is_refused(tokenizer):
    from zserve.generator.grammar_compile import CompileBudget, GrammarService

    svc = GrammarService(tokenizer, len(tokenizer), CompileBudget(time_s=60, memory_bytes=1 << 20))
    try:
        with pytest.raises(BadRequest) as info:  # its grammar alone is ~1 MiB, its compile more
            svc.compile(optional_properties(300))
        assert info.value.field == "response_format" and "memory budget" in info.value.message
        assert svc.compile(SMALL) is not None
    finally:
        svc.close()


@needs_xgrammar
def test_a_cancelled_compile_is_killed_and_others_go_on(service):
    answers: list[object] = []
    kills = service.kills
    ticket = service.submit(optional_properties(1001), "response_format", lambda *a: answers.append(a))
    time.sleep(0.3)  # the compile is running in the child
    ticket.cancel()
    deadline = time.monotonic() + 5
    while service.kills == kills and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.kills == kills + 1, "the cancelled compile was not stopped"
    assert service.compile(SMALL) is not None
    assert answers == []  # a cancelled request hears nothing


@needs_xgrammar
def test_past_max_waiting_schemas_a_new_one_is_overloaded_at_once(tokenizer):
    from zserve.errors import Overloaded
    from zserve.generator.grammar_compile import CompileBudget, GrammarService

    svc = GrammarService(tokenizer, len(tokenizer), CompileBudget(time_s=60, max_waiting=1))
    try:
        assert svc.wait_ready(120)
        answers: list[object] = []
        ticket = svc.submit(optional_properties(1003), "tools", lambda *a: answers.append(a))
        assert ticket is not None and answers == []
        refused: list[object] = []
        assert svc.submit(SMALL, "response_format", lambda *a: refused.append(a)) is None
        [(compiled, error)] = refused
        assert compiled is None and isinstance(error, Overloaded) and error.field == "response_format"
        ticket.cancel()  # the costly one is killed; the queue has room again
        assert svc.compile(SMALL) is not None
    finally:
        svc.close()


@needs_xgrammar
def test_the_cache_is_bounded_and_shared_by_equal_schemas(service):
    schemas = [json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}) for i in range(5)]
    compiled = [service.compile(s) for s in schemas]
    count, size = service.cache_size
    assert count == 3 and 0 < size
    compiles = service.compiles
    assert service.compile(schemas[-1]) is compiled[-1] and service.compiles == compiles  # from the cache
    service.compile(schemas[0])  # evicted: compiled again
    assert service.compiles == compiles + 1


@needs_xgrammar
def test_no_compile_holds_the_interpreter_lock(service):
    """What starved the heartbeat thread: a 10 ms ticker sees no long gap while a costly schema compiles
    (to its budget) and a mid-sized one compiles, crosses the process boundary and is deserialised."""
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        with pytest.raises(BadRequest):
            service.compile(optional_properties(1002))
        service.compile(optional_properties(80))
    finally:
        stop.set()
        ticker.join()
    assert max(gaps) < 0.5, max(gaps)  # the broker's liveness is 1 s; shared CI cores jitter by tens of ms


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"$ref": "https://example.com/schema.json"}, "$.$ref"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "$.properties.a.not"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "$.allOf"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "$.uniqueItems"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "$.dependentRequired"),
        ({"anyOf": [{"type": "object", "propertyNames": {"pattern": "^a"}}]}, "$.anyOf[0].propertyNames"),
    ],
)
def test_what_the_grammar_cannot_enforce_is_named(schema, where):
    why = unenforceable(schema)
    assert why is not None and why.startswith(where), why


def test_enforceable_schemas_pass_including_keywords_used_as_names():
    ok = [
        {"type": "object", "properties": {"not": {"type": "string"}, "contains": {"$ref": "#/$defs/x"}},
         "$defs": {"x": {"type": "integer"}}},
        {"allOf": [{"$ref": "#/$defs/x"}], "$defs": {"x": {"type": "string"}}},
        {"type": "array", "items": {"enum": ["not", "allOf"]}, "uniqueItems": False},
        {"const": {"not": 1, "$ref": "http://x"}},
        True,
    ]  # fmt: skip
    for schema in ok:
        assert unenforceable(schema) is None, schema


@needs_xgrammar
def test_a_request_that_joins_a_compile_dropped_for_cancellation_is_still_answered(service):
    # The interleaving, made by hand: the service's thread found every ticket for a schema cancelled and is
    # about to drop it, when a request for the same schema joins the waiting list (queuing no job of its own).
    from zserve.generator.grammar_compile import Ticket

    schema = json.dumps({"type": "object", "properties": {"late": {"type": "boolean"}}})
    done = threading.Event()
    answer: list = []
    with service._lock:
        service._waiting[schema] = [Ticket(schema, "response_format", lambda c, e: (answer.extend([c, e]), done.set()))]
    service._finish(schema, None, None)
    assert done.wait(30), "the request that joined was never answered"
    assert answer[0] is not None and answer[1] is None
