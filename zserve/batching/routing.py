"""Cache-aware routing of generative requests: which engine gets a sequence, by how much of its prompt each
engine's prefix cache already holds, weighed against load. Pure: no sockets, no clock.

The index is exact: engines report the block hashes (``zserve.batching.prefix_hash``) their prefix cache
stores and evicts, as deltas on their step messages and as a full snapshot in their Hello (so a restarted
broker rebuilds it from the Hellos). It is bounded: an engine holds at most ``prefix_index.bound(kv_blocks)``
entries here (its KV pool cannot cache more; past it, after lost deltas, its oldest entries go), and a lost
engine's entries go at once (``drop``). It is ``zserve.batching.prefix_table``'s, in C, where the broker's machine
can build it (64 engines at most; a 65th moves the router to the dict index, ``prefix_index.PrefixIndex``,
which also serves where no C compiler is found): the same contents and decisions, under half the CPU.

The broker adds what it routed and is not finished yet (``InFlightPrompts``; the C index keeps its own,
``NativeInFlight``): an engine reports the blocks it allocated only after the step that allocated them, so
without it the requests that arrive during a prefill would not find the prefix being computed.

The policy, per request with prompt blocks ``h_1..h_n`` (SGLang's router and vLLM production-stack's load-aware
router do the same in their own units):
  * each engine with a free slot scores the leading blocks of the prompt it holds;
  * the best-matching one (fewest running sequences on a tie) gets it (``match``) unless it is loaded beyond
    ``spill_ratio`` x the least loaded engine's running sequences + ``spill_slack``: then the least loaded one
    gets it (``spill``), and caches the hot prefix too, so a hot prefix spreads instead of piling on one engine;
  * nothing held anywhere (or no blocks given): the least loaded engine (``least_loaded``).
The cost: one probe of the index for a prompt whose first block no engine holds or computes; else one binary
search over the prompt's blocks for all the engines holding its first block at once (``PrefixIndex.longest``);
with the C index, all of it is one call (``dispatch``: the choice, and the sequence then in flight there).
Nothing at all for a model with one engine. Measured with ``python -m bench.generation routing-cost``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple

from zserve.batching.prefix_hash import unpack
from zserve.batching.prefix_index import PrefixIndex
from zserve.batching.prefix_table import MAX_ENGINES, native_index
from zserve.batching.workers import Worker

log = logging.getLogger("zserve.broker")

MATCH, SPILL, LEAST_LOADED = "match", "spill", "least_loaded"
REASONS = (MATCH, SPILL, LEAST_LOADED)
# Prompt blocks a frontend sends per request: routing beyond the first 4,096 tokens (at 16 a block) changes few
# decisions, and the broker's work per request stays bounded whatever the prompt's length.
MAX_ROUTE_BLOCKS = 256


class InFlightPrompts:
    """The prompt blocks of the sequences routed to each engine and not finished yet: what an engine is computing
    now, before its step messages report it (an engine reports the blocks it allocated after the step that
    allocated them, and a prefill of hundreds of tokens is seconds on a CPU). Without it, the later turns of a
    group that arrive during its first turn's prefill find nothing and go elsewhere. NVIDIA Dynamo's router keeps
    the same. Bounded by the sequences in flight; gone when they finish or their engine goes.

    Kept as the prompts themselves (the request's own hash list, not copied), grouped by first block and engine,
    in the order they were routed: adding and removing one is O(1), where counting every block of it cost ~7 us a
    request at 64 blocks; a match compares the request with the newest ``MAX_COMPARED`` prompts in flight on that
    engine under the same first block (a binary search each, as chains share prefixes). The C index keeps the
    same in C (``NativeInFlight``); this one serves the dict index."""

    MAX_COMPARED = 8

    def __init__(self) -> None:
        # a prompt's first hash -> engine -> item id -> its hashes, oldest first
        self._first: dict[int, dict[bytes, dict[int, Sequence[int]]]] = {}
        self._routed: dict[int, tuple[bytes, int]] = {}  # item id -> (engine, its first hash)

    def add(self, item_id: int, engine: bytes, hashes: Sequence[int]) -> None:
        if item_id in self._routed:
            self.remove(item_id)  # routed again (re-dispatched after its engine was lost)
        if not hashes:
            return
        self._routed[item_id] = (engine, hashes[0])
        self._first.setdefault(hashes[0], {}).setdefault(engine, {})[item_id] = hashes

    def remove(self, item_id: int) -> None:
        routed = self._routed.pop(item_id, None)
        if routed is None:
            return
        engine, first = routed
        by_engine = self._first[first]
        prompts = by_engine[engine]
        del prompts[item_id]
        if not prompts:
            del by_engine[engine]
            if not by_engine:
                del self._first[first]

    def finish(self, item_ids: Iterable[int]) -> None:
        for item_id in item_ids:
            self.remove(item_id)

    def drop(self, engine: bytes) -> None:
        """The engine is gone: so is what it was computing."""
        for item_id in [i for i, (e, _) in self._routed.items() if e == engine]:
            self.remove(item_id)

    def engines_at(self, h: int) -> Iterable[bytes]:
        """The engines computing a prompt whose first block is ``h``."""
        return self._first.get(h, {}).keys()

    def at(self, h: int) -> dict[bytes, dict[int, Sequence[int]]] | None:
        """Per engine, the prompts in flight there whose first block is ``h``, by item id, oldest first (None:
        none anywhere)."""
        return self._first.get(h)

    def matches(self, hashes: Sequence[int], engines: Iterable[bytes]) -> dict[bytes, int]:
        """As ``PrefixIndex.matches``, over the prompts in flight."""
        by_engine = self._first.get(hashes[0]) if hashes else None
        if not by_engine:
            return dict.fromkeys(engines, 0)
        return {e: _longest_common(hashes, by_engine.get(e)) for e in engines}

    def flights(self) -> list[tuple[int, bytes, Sequence[int]]]:
        """Every prompt in flight: (item id, engine, hashes), each engine's under a first block oldest first."""
        return [(i, e, h) for by_engine in self._first.values() for e, d in by_engine.items() for i, h in d.items()]

    def __len__(self) -> int:
        return len(self._routed)


class NativeInFlight:
    """``InFlightPrompts`` kept by the C index (``prefix_table``), each prompt's hashes copied as uint64s: a route
    compares them without reading a Python int, and a dispatch (``route`` and ``add``) or a batch's ``finish`` is
    one C call. It keeps nothing for an engine the index has no slot for (a worse route, never a wrong answer)."""

    __slots__ = ("_index",)

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def add(self, item_id: int, engine: bytes, hashes: Sequence[int]) -> None:
        self._index.fly(item_id, engine, hashes)  # type: ignore[attr-defined]

    def remove(self, item_id: int) -> None:
        self._index.land((item_id,))  # type: ignore[attr-defined]

    def finish(self, item_ids: Iterable[int]) -> None:
        self._index.land(item_ids)  # type: ignore[attr-defined]

    def drop(self, engine: bytes) -> None:
        """Nothing to do: the index's ``drop`` of an engine lands its prompts in flight."""

    def engines_at(self, h: int) -> Iterable[bytes]:
        return self._index.flying(h)  # type: ignore[attr-defined]

    def at(self, h: int) -> dict[bytes, dict[int, Sequence[int]]] | None:
        """As ``InFlightPrompts.at`` (built from ``flights``: for the tests' and the pure ``choose``'s use)."""
        out: dict[bytes, dict[int, Sequence[int]]] = {}
        for item_id, engine, hashes in self.flights():
            if hashes[0] == h:
                out.setdefault(engine, {})[item_id] = hashes
        return out or None

    def matches(self, hashes: Sequence[int], engines: Iterable[bytes]) -> dict[bytes, int]:
        computing = self._index.computing  # type: ignore[attr-defined]
        return {e: computing(hashes, e, InFlightPrompts.MAX_COMPARED) if hashes else 0 for e in engines}

    def flights(self) -> list[tuple[int, bytes, Sequence[int]]]:
        return self._index.flights()  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return self._index.in_flight()  # type: ignore[attr-defined]


def _longest_common(hashes: Sequence[int], prompts: dict[int, Sequence[int]] | None) -> int:
    """The most leading blocks ``hashes`` has in common with one of the newest ``MAX_COMPARED`` of ``prompts``
    (chains under the same first block, oldest first)."""
    best = 0
    if prompts:
        n = len(hashes)
        for prompt in islice(reversed(prompts.values()), InFlightPrompts.MAX_COMPARED):
            common = _common(hashes, prompt)
            if common > best:
                best = common
                if best == n:
                    break
    return best


def _common(hashes: Sequence[int], other: Sequence[int]) -> int:
    """How many leading blocks two chains that share their first block have in common (binary search: equal
    hashes at a place mean equal chains up to it)."""
    hi = min(len(hashes), len(other))
    if hashes[hi - 1] == other[hi - 1]:
        return hi
    lo = 1  # hashes[lo - 1] == other[lo - 1], hashes[hi - 1] != other[hi - 1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hashes[mid - 1] == other[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


class Candidate(NamedTuple):
    """An engine that can take the request now: its worker id, its load (running sequences), and its bit in the
    index's masks (0: look it up)."""

    engine: bytes
    running: int
    bit: int = 0


class Decision(NamedTuple):
    engine: bytes
    reason: str
    matched: int  # leading prompt blocks the chosen engine holds


@dataclass(slots=True)
class EngineCounters:
    """Since the broker started, per engine name: prompt blocks routed, found in this engine's cache, and the
    decisions that chose it by reason."""

    requested: int = 0
    found: int = 0
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


_NOTHING_COMPUTED: dict[bytes, int] = {}  # never written: what no prompt in flight computes
_COMPARED = InFlightPrompts.MAX_COMPARED


class PrefixRouter:
    """One generative model's router: the index of its engines' caches, the policy, and its counters."""

    def __init__(self, spill_ratio: float = 1.5, spill_slack: int = 2, native: bool = True) -> None:
        """``native``: the index in C where it can be built (``prefix_table``), else the dict index."""
        built = native_index() if native else None
        self.index: PrefixIndex = built() if built is not None else PrefixIndex()
        self._route_c = getattr(self.index, "route", None)  # the C index's whole choice, one call
        self._dispatch_c = getattr(self.index, "dispatch", None)  # and the sequence then in flight, the same call
        self.inflight: InFlightPrompts | NativeInFlight = (
            NativeInFlight(self.index) if built is not None else InFlightPrompts()
        )
        self.spill_ratio = spill_ratio
        self.spill_slack = spill_slack
        # by engine name (stable over its restarts): the dict index's counts, and the C index's of engines gone
        # (the C index counts those it holds itself: ``report`` adds them)
        self.counters: dict[str, EngineCounters] = {}
        self._by_worker: dict[bytes, EngineCounters] = {}  # worker id -> its counters (the dict index's lookup)
        self._names: dict[bytes, str] = {}  # worker id -> the name it is counted by

    def reset(self, engine: bytes, hashes: Iterable[int], kv_blocks: int = 0, name: str = "") -> None:
        """A (re)registered engine's snapshot (``PrefixIndex.reset``); ``name``: its worker name (``name:pid``),
        counted without the pid, so its counters survive its restarts. The C index's masks hold 64 engines: a 65th
        moves this router to the dict index (the same contents, each engine in its slot), for good."""
        if name:
            self._names[engine] = name.rsplit(":", 1)[0]
        try:
            self.index.reset(engine, hashes, kv_blocks)
        except OverflowError:
            if self._route_c is None:
                raise
            log.warning("more than %d engines: the routing index moves to Python (slower)", MAX_ENGINES)
            flights = self.inflight.flights()
            self._harvest()
            self.index = PrefixIndex.restore(self.index.export())  # type: ignore[attr-defined]
            self._route_c = self._dispatch_c = None
            self.inflight = InFlightPrompts()
            for item_id, worker, prompt in flights:
                self.inflight.add(item_id, worker, prompt)
            self.index.reset(engine, hashes, kv_blocks)

    def route(
        self, hashes: Sequence[int] | bytes, least: Worker, workers: dict[bytes, Worker]
    ) -> tuple[bytes, str, int]:
        """The engine of ``workers`` for a prompt whose blocks hash to ``hashes`` (``least``: the pool's least
        loaded engine with credit), as ``choose`` picks it: the candidates are ``least`` and the engines with
        credit that hold or compute the prompt's first block, so a request costs what they do, not what the
        pool's size does. ``hashes``: ints, or ``prefix_hash.pack``'s bytes. Returns (engine, reason, blocks it
        holds): no objects, the broker's hot path."""
        if not hashes:
            return least.worker_id, LEAST_LOADED, 0
        if self._route_c is not None:  # all of it in one C call
            return self._route_c(hashes, least, workers, self.spill_ratio, self.spill_slack, _COMPARED)
        if isinstance(hashes, bytes):
            hashes = unpack(hashes)
            if not hashes:
                return least.worker_id, LEAST_LOADED, 0
        first = hashes[0]
        flying = self.inflight.at(first)
        index = self.index
        if not flying:
            mask = index._holders.get(first, 0)
            if not mask:  # held and computed nowhere: one probe is all a new prompt costs
                return least.worker_id, LEAST_LOADED, 0
            if not mask & (mask - 1):  # most prompts: one engine holds the first block, none computes it
                least_id = least.worker_id
                engine = index._engines[mask.bit_length() - 1]
                matched = index.longest(hashes, mask)[0]
                if engine == least_id:
                    return least_id, MATCH, matched
                w = workers.get(engine)  # type: ignore[arg-type]  # a set bit is a live slot
                if w is None or w.free_credits <= 0:
                    return least_id, LEAST_LOADED, 0
                if len(w.in_flight) > self.spill_ratio * len(least.in_flight) + self.spill_slack:
                    return least_id, SPILL, 0  # the least loaded holds nothing of it
                return engine, MATCH, matched  # type: ignore[return-value]
        else:
            mask = index.mask(first)
        least_id = least.worker_id
        least_bit = index.bit(least_id)
        if flying:
            for engine in flying:  # an engine the index has no slot for is not scored (as in the C index)
                mask |= index.bit(engine)
        candidates = [(least_id, len(least.in_flight), least_bit)]
        scored = least_bit  # the candidates' bits
        # the engines holding the first block or computing it, by slot, as the C index takes them
        for engine in index.engines_in(mask & ~least_bit):
            w = workers.get(engine)
            if w is not None and w.free_credits > 0:
                bit = index.bit(engine)
                candidates.append((engine, len(w.in_flight), bit))
                scored |= bit
        return self._choose(hashes, candidates, scored, flying)

    def dispatch(
        self, item_id: int, hashes: Sequence[int] | bytes, least: Worker, workers: dict[bytes, Worker]
    ) -> tuple[bytes, str, int]:
        """``route``'s decision for queued sequence ``item_id``, which is in flight on that engine from then on
        (``inflight``), until ``finish``: one C call with the C index."""
        if self._dispatch_c is not None:  # counted there too
            return self._dispatch_c(item_id, hashes, least, workers, self.spill_ratio, self.spill_slack, _COMPARED)
        if isinstance(hashes, bytes):
            hashes = unpack(hashes)
        engine, reason, matched = decision = self.route(hashes, least, workers)
        if self.index.bit(engine):  # none kept or counted for an engine without a slot, as in C
            if hashes:
                self.inflight.add(item_id, engine, hashes)
            self.count(engine, reason, matched, len(hashes))
        return decision

    def finish(self, item_ids: Iterable[int]) -> None:
        """These sequences are finished: what they computed is the engine's to report now."""
        self.inflight.finish(item_ids)

    def choose(self, hashes: Sequence[int], candidates: Sequence[Candidate]) -> Decision:
        """Pick an engine for a prompt whose blocks hash to ``hashes`` (``candidates``: at least one, the least
        loaded first, as ``WorkerPool.best`` picks it; the others in any order)."""
        if not hashes:
            return Decision(candidates[0].engine, LEAST_LOADED, 0)
        bit = self.index.bit
        rows = [(c.engine, c.running, c.bit or bit(c.engine)) for c in candidates]
        mask = 0
        for row in rows:
            mask |= row[2]
        return Decision(*self._choose(hashes, rows, mask, self.inflight.at(hashes[0])))

    def _choose(
        self,
        hashes: Sequence[int],
        candidates: list[tuple[bytes, int, int]],
        mask: int,
        flying: dict[bytes, dict[int, Sequence[int]]] | None,
    ) -> tuple[bytes, str, int]:
        """``choose`` over (engine, running, bit) rows, ``mask`` their bits and ``flying`` the prompts in flight
        under the first block. Each candidate scores the leading blocks it holds (reported) or computes (in
        flight), whichever is more; the index is searched once for all of them (``PrefixIndex.longest``)."""
        least = candidates[0]
        held, at = self.index.longest(hashes, mask)  # ``at``: the candidates holding ``held`` blocks
        longest = held
        computing = _NOTHING_COMPUTED
        if flying:
            computing = {}
            for c in candidates:
                prompts = flying.get(c[0])
                if prompts:
                    n = computing[c[0]] = _longest_common(hashes, prompts)
                    if n > longest:
                        longest = n
        if not longest:
            return least[0], LEAST_LOADED, 0
        if held < longest:
            at = 0
        best = None  # the most blocks; among those, the fewest running sequences (the first such)
        for c in candidates:
            if (c[2] & at or (computing and computing.get(c[0]) == longest)) and (best is None or c[1] < best[1]):
                best = c
        assert best is not None  # some candidate scored ``longest``
        if best is not least and best[1] > self.spill_ratio * least[1] + self.spill_slack:
            matched = max(self.index.longest(hashes, least[2])[0], computing.get(least[0], 0))
            return least[0], SPILL, matched
        return best[0], MATCH, longest

    def count(self, engine: bytes, reason: str, matched: int, requested: int) -> None:
        """Count a decision for engine ``engine`` (worker id), by its name (the dict index's; the C index counts
        in ``dispatch``)."""
        counters = self._by_worker.get(engine)
        if counters is None:
            counters = self._by_worker[engine] = self.counters.setdefault(self._name(engine), EngineCounters())
        counters.requested += requested
        counters.found += matched
        counters.decisions[reason] += 1

    def report(self) -> dict[str, EngineCounters]:
        """Since the broker started, per engine name (those that were chosen): prompt blocks routed, found in the
        chosen engine's cache, and the decisions by reason."""
        if self._route_c is None:
            return self.counters
        out = {name: EngineCounters(c.requested, c.found, dict(c.decisions)) for name, c in self.counters.items()}
        for engine, requested, found, *decisions in self.index.counts():  # type: ignore[attr-defined]
            if any(decisions):
                _add(out.setdefault(self._name(engine), EngineCounters()), requested, found, decisions)
        return out

    def _harvest(self, engine: bytes | None = None) -> None:
        """The C index's counts of ``engine`` (None: of every engine) into ``counters``: it forgets them next."""
        for worker, requested, found, *decisions in self.index.counts():  # type: ignore[attr-defined]
            if (engine is None or worker == engine) and any(decisions):
                _add(self.counters.setdefault(self._name(worker), EngineCounters()), requested, found, decisions)

    def _name(self, engine: bytes) -> str:
        return self._names.get(engine) or engine.decode(errors="replace")

    def drop(self, engine: bytes) -> None:
        """The engine is gone: its index entries and the prompts it was computing go now (its counts stay)."""
        if self._route_c is not None:
            self._harvest(engine)
        self.index.drop(engine)
        self.inflight.drop(engine)
        self._by_worker.pop(engine, None)
        self._names.pop(engine, None)


def _add(counters: EngineCounters, requested: int, found: int, decisions: Sequence[int]) -> None:
    counters.requested += requested
    counters.found += found
    for reason, n in zip(REASONS, decisions, strict=True):
        counters.decisions[reason] += n
