"""Cache-aware routing of generative requests: which engine gets a sequence, by how much of its prompt each
engine's prefix cache already holds, weighed against load. Pure: no sockets, no clock.

The index is exact: engines report the block hashes (``zserve.batching.prefix_hash``) their prefix cache
stores and evicts, as deltas on their step messages and as a full snapshot in their Hello (so a restarted
broker rebuilds it from the Hellos). It is bounded: an engine holds at most ``prefix_index.bound(kv_blocks)``
entries here (its KV pool cannot cache more; past it, after lost deltas, its oldest entries go), and a lost
engine's entries go at once (``drop``). It is ``zserve.batching.prefix_table``'s, in C, where the broker's machine
can build it (64 engines at most; a 65th moves the router to the dict index, ``prefix_index.PrefixIndex``,
which also serves where no C compiler is found): the same contents and decisions, under half the CPU.

The broker adds what it routed and is not finished yet (``InFlightPrompts``): an engine reports the blocks it
allocated only after the step that allocated them, so without it the requests that arrive during a prefill
would not find the prefix being computed.

The policy, per request with prompt blocks ``h_1..h_n`` (SGLang's router and vLLM production-stack's load-aware
router do the same in their own units):
  * each engine with a free slot scores the leading blocks of the prompt it holds;
  * the best-matching one (fewest running sequences on a tie) gets it (``match``) unless it is loaded beyond
    ``spill_ratio`` x the least loaded engine's running sequences + ``spill_slack``: then the least loaded one
    gets it (``spill``), and caches the hot prefix too, so a hot prefix spreads instead of piling on one engine;
  * nothing held anywhere (or no blocks given): the least loaded engine (``least_loaded``).
The cost: one probe of the index for a prompt whose first block no engine holds or computes; else one binary
search over the prompt's blocks for all the engines holding its first block at once (``PrefixIndex.longest``);
with the C index, all of it is one call (``route``), the prompts in flight under its first block included.
Nothing at all for a model with one engine. Measured with ``python -m bench.generation routing-cost``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

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

    Kept as the prompts themselves (the request's own hash list, not copied), grouped by first block and engine:
    adding and removing one is O(1), where counting every block of it cost ~7 us a request at 64 blocks; a match
    compares the request with the last ``MAX_COMPARED`` prompts in flight on that engine under the same first
    block (a binary search each, as chains share prefixes)."""

    MAX_COMPARED = 8

    def __init__(self) -> None:
        # a prompt's first hash -> engine -> the hashes of its prompts in flight there, oldest first
        self._first: dict[int, dict[bytes, list[Sequence[int]]]] = {}
        self._routed: dict[int, tuple[bytes, Sequence[int]]] = {}  # item id -> (engine, its hashes)

    def add(self, item_id: int, engine: bytes, hashes: Sequence[int]) -> None:
        if item_id in self._routed:
            self.remove(item_id)  # routed again (re-dispatched after its engine was lost)
        self._routed[item_id] = (engine, hashes)
        by_engine = self._first.get(hashes[0])
        if by_engine is None:
            self._first[hashes[0]] = {engine: [hashes]}
        else:
            prompts = by_engine.get(engine)
            if prompts is None:
                by_engine[engine] = [hashes]
            else:
                prompts.append(hashes)

    def remove(self, item_id: int) -> None:
        routed = self._routed.pop(item_id, None)
        if routed is None:
            return
        engine, hashes = routed
        by_engine = self._first[hashes[0]]
        prompts = by_engine[engine]
        if len(prompts) == 1:
            del by_engine[engine]
            if not by_engine:
                del self._first[hashes[0]]
        else:
            prompts.remove(hashes)  # this very list, or an equal one: the same prompt either way

    def drop(self, engine: bytes) -> None:
        """The engine is gone: so is what it was computing."""
        for item_id in [i for i, (e, _) in self._routed.items() if e == engine]:
            self.remove(item_id)

    def engines_at(self, h: int) -> Iterable[bytes]:
        """The engines computing a prompt whose first block is ``h``."""
        return self._first.get(h, {}).keys()

    def at(self, h: int) -> dict[bytes, list[Sequence[int]]] | None:
        """Per engine, the prompts in flight there whose first block is ``h`` (None: none anywhere)."""
        return self._first.get(h)

    def matches(self, hashes: Sequence[int], engines: Iterable[bytes]) -> dict[bytes, int]:
        """As ``PrefixIndex.matches``, over the prompts in flight."""
        by_engine = self._first.get(hashes[0]) if hashes else None
        if not by_engine:
            return dict.fromkeys(engines, 0)
        return {e: _longest_common(hashes, by_engine.get(e)) for e in engines}

    def __len__(self) -> int:
        return len(self._routed)


def _longest_common(hashes: Sequence[int], prompts: list[Sequence[int]] | None) -> int:
    """The most leading blocks ``hashes`` has in common with one of the last ``MAX_COMPARED`` of ``prompts``
    (chains under the same first block)."""
    best = 0
    if prompts:
        n = len(hashes)
        for prompt in prompts[-InFlightPrompts.MAX_COMPARED :]:
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


class PrefixRouter:
    """One generative model's router: the index of its engines' caches, the policy, and its counters."""

    def __init__(self, spill_ratio: float = 1.5, spill_slack: int = 2, native: bool = True) -> None:
        """``native``: the index in C where it can be built (``prefix_table``), else the dict index."""
        built = native_index() if native else None
        self.index: PrefixIndex = built() if built is not None else PrefixIndex()
        self._route_c = getattr(self.index, "route", None)  # the C index's whole choice, one call
        self.inflight = InFlightPrompts()
        self.spill_ratio = spill_ratio
        self.spill_slack = spill_slack
        self.counters: dict[str, EngineCounters] = {}  # by engine name (stable over its restarts)
        self._by_worker: dict[bytes, EngineCounters] = {}  # worker id -> its counters (the hot path's lookup)

    def reset(self, engine: bytes, hashes: Iterable[int], kv_blocks: int = 0) -> None:
        """A (re)registered engine's snapshot (``PrefixIndex.reset``). The C index's masks hold 64 engines: a 65th
        moves this router to the dict index (the same contents, each engine in its slot), for good."""
        try:
            self.index.reset(engine, hashes, kv_blocks)
        except OverflowError:
            if self._route_c is None:
                raise
            log.warning("more than %d engines: the routing index moves to Python (slower)", MAX_ENGINES)
            self.index = PrefixIndex.restore(self.index.export())  # type: ignore[attr-defined]
            self._route_c = None
            self.index.reset(engine, hashes, kv_blocks)

    def route(self, hashes: Sequence[int], least: Worker, workers: dict[bytes, Worker]) -> tuple[bytes, str, int]:
        """The engine of ``workers`` for a prompt whose blocks hash to ``hashes`` (``least``: the pool's least
        loaded engine with credit), as ``choose`` picks it: the candidates are ``least`` and the engines with
        credit that hold or compute the prompt's first block, so a request costs what they do, not what the
        pool's size does. Returns (engine, reason, blocks it holds): no objects, the broker's hot path."""
        if not hashes:
            return least.worker_id, LEAST_LOADED, 0
        first = hashes[0]
        flying = self.inflight._first.get(first)
        if self._route_c is not None:  # all of it in one C call (None: more engines computing it than it takes)
            decision = self._route_c(
                hashes, least, workers, self.spill_ratio, self.spill_slack, flying, InFlightPrompts.MAX_COMPARED
            )
            if decision is not None:
                return decision
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
        candidates = [(least_id, len(least.in_flight), least_bit)]
        scored = least_bit  # the candidates' bits
        for engine in index.engines_in(mask & ~least_bit):  # the engines holding the first block, by slot
            w = workers.get(engine)
            if w is not None and w.free_credits > 0:
                bit = index.bit(engine)
                candidates.append((engine, len(w.in_flight), bit))
                scored |= bit
        if flying:  # and those computing it without holding it (whose bits cannot score in the index)
            for engine in flying:
                if engine != least_id and not index.bit(engine) & mask:
                    w = workers.get(engine)
                    if w is not None and w.free_credits > 0:
                        candidates.append((engine, len(w.in_flight), 0))
        return self._choose(hashes, candidates, scored, flying)

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
        flying: dict[bytes, list[Sequence[int]]] | None,
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

    def count(self, engine: bytes, name: str, reason: str, matched: int, requested: int) -> None:
        """Count a decision for engine ``engine`` (worker id), named ``name`` (``name:pid``): counted by its name
        without the pid, so its counters survive its restarts."""
        counters = self._by_worker.get(engine)
        if counters is None:
            key = name.rsplit(":", 1)[0]
            counters = self._by_worker[engine] = self.counters.setdefault(key, EngineCounters())
        counters.requested += requested
        counters.found += matched
        counters.decisions[reason] += 1

    def drop(self, engine: bytes) -> None:
        """The engine is gone: its index entries and the prompts it was computing go now."""
        self.index.drop(engine)
        self.inflight.drop(engine)
        self._by_worker.pop(engine, None)
