"""Cache-aware routing of generative requests: which engine gets a sequence, by how much of its prompt each
engine's prefix cache already holds, weighed against load. Pure: no sockets, no clock.

The index is exact: engines report the block hashes (``zserve.batching.prefix_hash``) their prefix cache
stores and evicts, as deltas on their step messages and as a full snapshot in their Hello (so a restarted
broker rebuilds it from the Hellos). It is bounded: an engine holds at most ``max(kv_blocks, MIN_ENTRIES)``
entries here (its KV pool cannot cache more; past it, after lost deltas, its oldest entries go), and a lost
engine's entries go at once (``drop``).

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
The cost is a binary search over the prompt's blocks per engine holding its first block (see ``matches``), and
nothing at all for a model with one engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MATCH, SPILL, LEAST_LOADED = "match", "spill", "least_loaded"
REASONS = (MATCH, SPILL, LEAST_LOADED)
MIN_ENTRIES = 1024  # an engine's entries kept at least (its Hello may not say its pool's size)
# Prompt blocks a frontend sends per request: routing beyond the first 4,096 tokens (at 16 a block) changes few
# decisions, and the broker's work per request stays bounded whatever the prompt's length.
MAX_ROUTE_BLOCKS = 256


class PrefixIndex:
    """Which engine's prefix cache holds which block hash. Engines are keyed by their worker id; each gets a slot,
    a bit of the mask kept per hash (an int: no container per hash for the garbage collector to walk, which made
    a broker with 131k entries pay ~40 us a step message in collections).

    The mask is the only lookup structure: a delta or a match touches one dict, which matters because a broker
    with many engines has an index far bigger than the CPU's caches, and every probe costs a miss (a second,
    per-engine dict of the same hashes made a delta cost twice as much). Per engine there is only a log of the
    hashes it stored, in order, appended to and read when it is dropped or over its bound; it is compacted when
    it grows past twice the engine's bound, so its memory stays within that."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # hash -> mask of the slots of the engines holding it
        self._logs: dict[bytes, list[int]] = {}  # engine -> the hashes it stored, oldest first (some gone since)
        self._counts: dict[bytes, int] = {}  # engine -> hashes it holds
        self._limits: dict[bytes, int] = {}
        self._slots: dict[bytes, int] = {}
        self._engines: list[bytes | None] = []  # slot -> engine

    def reset(self, engine: bytes, hashes: Iterable[int], kv_blocks: int = 0) -> None:
        """A (re)registered engine: its snapshot replaces whatever was known of it."""
        self.drop(engine)
        free = [i for i, e in enumerate(self._engines) if e is None]
        slot = free[0] if free else len(self._engines)
        if slot == len(self._engines):
            self._engines.append(engine)
        else:
            self._engines[slot] = engine
        self._slots[engine] = slot
        self._logs[engine] = []
        self._counts[engine] = 0
        self._limits[engine] = max(kv_blocks, MIN_ENTRIES)
        self.update(engine, hashes, ())

    def update(self, engine: bytes, stored: Iterable[int], evicted: Iterable[int]) -> None:
        """Apply an engine's deltas (an unknown engine's are ignored: it must say Hello first). Every step
        message of every engine comes through here: a hash costs two operations on one dict."""
        slot = self._slots.get(engine)
        if slot is None:
            return
        holders = self._holders
        bit = 1 << slot
        n = self._counts[engine]
        for h in evicted:
            mask = holders.get(h, 0)
            if mask & bit:
                n -= 1
                if mask ^ bit:
                    holders[h] = mask ^ bit
                else:
                    del holders[h]
        log = self._logs[engine]
        for h in stored:
            mask = holders.get(h, 0)
            if not mask & bit:
                holders[h] = mask | bit
                log.append(h)
                n += 1
        self._counts[engine] = n
        limit = self._limits[engine]
        if n > limit:  # more than its pool holds: deltas were lost; forget its oldest
            self._trim(engine, bit, n - limit)
        elif len(log) > 2 * limit:
            self._logs[engine] = list(dict.fromkeys(h for h in log if holders.get(h, 0) & bit))

    def _trim(self, engine: bytes, bit: int, over: int) -> None:
        log, holders = self._logs[engine], self._holders
        i = 0
        while over > 0:
            h = log[i]
            i += 1
            mask = holders.get(h, 0)
            if mask & bit:
                over -= 1
                self._counts[engine] -= 1
                if mask ^ bit:
                    holders[h] = mask ^ bit
                else:
                    del holders[h]
        del log[:i]

    def drop(self, engine: bytes) -> None:
        """The engine is gone (lost, restarted, left): its entries go now."""
        log = self._logs.pop(engine, None)
        if log is None:
            return
        slot = self._slots.pop(engine)
        del self._limits[engine], self._counts[engine]
        bit = 1 << slot
        holders = self._holders
        for h in log:
            mask = holders.get(h, 0)
            if mask & bit:
                if mask ^ bit:
                    holders[h] = mask ^ bit
                else:
                    del holders[h]
        self._engines[slot] = None

    def holders(self, h: int) -> list[bytes]:
        """The engines holding block ``h``."""
        mask = self._holders.get(h, 0)
        out = []
        while mask:
            low = mask & -mask
            out.append(self._engines[low.bit_length() - 1])
            mask ^= low
        return out  # type: ignore[return-value]  # a set bit is a live slot

    def matches(self, hashes: Sequence[int], engines: Iterable[bytes]) -> dict[bytes, int]:
        """Per engine of ``engines``, how many leading blocks of ``hashes`` it holds.

        An engine's cache holds a chain's blocks as a prefix: a block is shared only with its whole prefix, and
        the block manager frees a sequence's blocks last first, so its LRU evicts a chain from the end. So the
        count is found by binary search over the chain: O(log n) lookups per engine holding the first block.
        (Where that does not hold, after lost deltas made the index drop an engine's oldest entries, a count
        may be off: a worse route, never a wrong answer.)"""
        matched = dict.fromkeys(engines, 0)
        holders = self._holders
        first = holders.get(hashes[0], 0) if hashes else 0
        if not first:
            return matched
        slots = self._slots
        n = len(hashes)
        last = holders.get(hashes[-1], 0)
        for engine in matched:
            slot = slots.get(engine)
            if slot is None:
                continue
            bit = 1 << slot  # tested with & (one operation on a mask of up to 64 bits: no shifts of it)
            if not first & bit:
                continue
            if last & bit:
                matched[engine] = n
                continue
            lo, hi = 1, n  # hashes[lo - 1] is held, hashes[hi - 1] is not
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if holders.get(hashes[mid - 1], 0) & bit:
                    lo = mid
                else:
                    hi = mid
            matched[engine] = lo
        return matched

    def __len__(self) -> int:
        """Entries (engine, hash) held: the memory bound is the engines' KV blocks (or MIN_ENTRIES each)."""
        return sum(self._counts.values())

    def holds(self, engine: bytes, h: int) -> bool:
        slot = self._slots.get(engine)
        return slot is not None and bool(self._holders.get(h, 0) >> slot & 1)


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

    def matches(self, hashes: Sequence[int], engines: Iterable[bytes]) -> dict[bytes, int]:
        """As ``PrefixIndex.matches``, over the prompts in flight."""
        matched = dict.fromkeys(engines, 0)
        by_engine = self._first.get(hashes[0]) if hashes else None
        if not by_engine:
            return matched
        n = len(hashes)
        for engine in matched:
            prompts = by_engine.get(engine)
            if prompts:
                best = 0
                for prompt in prompts[-self.MAX_COMPARED :]:
                    best = max(best, _common(hashes, prompt))
                    if best == n:
                        break
                matched[engine] = best
        return matched

    def __len__(self) -> int:
        return len(self._routed)


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


@dataclass(slots=True)
class Candidate:
    """An engine that can take the request now: its worker id and its load (running sequences)."""

    engine: bytes
    running: int


@dataclass(slots=True)
class Decision:
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


class PrefixRouter:
    """One generative model's router: the index of its engines' caches, the policy, and its counters."""

    def __init__(self, spill_ratio: float = 1.5, spill_slack: int = 2) -> None:
        self.index = PrefixIndex()
        self.inflight = InFlightPrompts()
        self.spill_ratio = spill_ratio
        self.spill_slack = spill_slack
        self.counters: dict[str, EngineCounters] = {}  # by engine name (stable over its restarts)

    def choose(self, hashes: Sequence[int], candidates: Sequence[Candidate]) -> Decision:
        """Pick an engine for a prompt whose blocks hash to ``hashes`` (``candidates``: at least one, the least
        loaded first, as ``WorkerPool.best`` picks it; the others in any order)."""
        least = candidates[0]
        if len(candidates) == 1 or not hashes:  # no choice to make: say whether it holds the prompt anyway
            matched = self._matches(hashes, [least.engine])[least.engine]
            return Decision(least.engine, MATCH if matched else LEAST_LOADED, matched)
        matched = self._matches(hashes, [c.engine for c in candidates])
        best = least
        for c in candidates:  # the most blocks; among those, the fewest running sequences
            m, b = matched[c.engine], matched[best.engine]
            if m > b or (m == b and c.running < best.running):
                best = c
        if matched[best.engine] == 0:
            return Decision(least.engine, LEAST_LOADED, 0)
        if best.running > self.spill_ratio * least.running + self.spill_slack:
            return Decision(least.engine, SPILL, matched[least.engine])
        return Decision(best.engine, MATCH, matched[best.engine])

    def _matches(self, hashes: Sequence[int], engines: list[bytes]) -> dict[bytes, int]:
        """Leading blocks held (reported) or being computed (in flight), per engine."""
        matched = self.index.matches(hashes, engines)
        for engine, n in self.inflight.matches(hashes, engines).items():
            if n > matched[engine]:
                matched[engine] = n
        return matched

    def count(self, engine_name: str, decision: Decision, requested: int) -> None:
        counters = self.counters.get(engine_name)
        if counters is None:
            counters = self.counters[engine_name] = EngineCounters()
        counters.requested += requested
        counters.found += decision.matched
        counters.decisions[decision.reason] += 1
