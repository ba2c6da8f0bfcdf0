"""The index of the engines' prefix caches, in Python: which engine holds which block hash. The broker runs
``zserve.batching.prefix_table``'s (the same contents and answers, in C) where this machine can build it; this one
where it cannot, above 64 engines, and in the tests that check the two agree. Pure: no sockets, no clock.

Bounded: an engine holds at most ``bound(kv_blocks)`` entries here (its KV pool cannot cache more;
past it, after lost deltas, its oldest entries go), and a lost engine's entries go at once (``drop``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MIN_ENTRIES = 1024  # an engine's entries kept at least (its Hello may not say its pool's size)
# and at most, whatever its Hello says (no KV pool is near it): the C index's log sizes (twice it) fit an int64
MAX_ENTRIES = 2**48


def bound(kv_blocks: int) -> int:
    """The entries an engine reporting a pool of ``kv_blocks`` blocks may hold here (both indexes')."""
    return min(max(kv_blocks, MIN_ENTRIES), MAX_ENTRIES)


class _Held:
    """One engine's part of the index: its bit in the masks, the log of the hashes it stored, how many it holds
    and may hold. One object, so a delta finds all of it with one lookup."""

    __slots__ = ("bit", "count", "limit", "log", "slot")

    def __init__(self, slot: int, limit: int) -> None:
        self.slot = slot
        self.bit = 1 << slot  # this very object is the value of every hash only this engine holds (see update)
        self.log: list[int] = []  # the hashes it stored, oldest first (some gone since)
        self.count = 0
        self.limit = limit


class PrefixIndex:
    """Which engine's prefix cache holds which block hash. Engines are keyed by their worker id; each gets a slot,
    a bit of the mask kept per hash (an int: no container per hash for the garbage collector to walk, which made
    a broker with 131k entries pay ~40 us a step message in collections).

    The mask is the only lookup structure: a delta or a match touches one dict, which matters because a broker
    with many engines has an index far bigger than the CPU's caches, and every probe costs a miss (a second,
    per-engine dict of the same hashes made a delta cost twice as much). A hash only one engine holds (most of
    them) has that engine's own bit object as its value, one object per engine, hot, so reading a mask costs no
    miss of its own and an entry no int of its own. Per engine there is only a log of the hashes it stored, in
    order, appended to and read when it is dropped or over its bound; it is compacted when it grows past twice
    the engine's bound, so its memory stays within that."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # hash -> mask of the slots of the engines holding it
        self._held: dict[bytes, _Held] = {}
        self._engines: list[bytes | None] = []  # slot -> engine

    def reset(self, engine: bytes, hashes: Iterable[int], kv_blocks: int = 0) -> None:
        """A registered engine: its snapshot replaces whatever was known of it. A new one takes the lowest free
        slot; one registered again keeps its slot (the router's prompts in flight there are still its own)."""
        held = self._held.get(engine)
        if held is not None:
            slot = held.slot
            self.drop(engine)
        else:
            free = [i for i, e in enumerate(self._engines) if e is None]
            slot = free[0] if free else len(self._engines)
        if slot == len(self._engines):
            self._engines.append(engine)
        else:
            self._engines[slot] = engine
        self._held[engine] = _Held(slot, bound(kv_blocks))
        self.update(engine, hashes, ())

    def update(self, engine: bytes, stored: Iterable[int], evicted: Iterable[int]) -> None:
        """Apply an engine's deltas (an unknown engine's are ignored: it must say Hello first). Every step
        message of every engine comes through here: an evicted hash costs one operation on one dict (most are
        held by one engine), a stored one two (a miss, then an insert into the slot just found)."""
        held = self._held.get(engine)
        if held is None:
            return
        holders = self._holders
        bit = held.bit
        n = held.count
        for h in evicted:
            mask = holders.pop(h, 0)
            if mask & bit:
                n -= 1
                if mask != bit:
                    holders[h] = mask ^ bit
            elif mask:  # held by others only (an eviction this engine reported twice): put back
                holders[h] = mask
        log = held.log
        for h in stored:
            mask = holders.get(h, 0)
            if not mask & bit:
                holders[h] = mask | bit if mask else bit
                log.append(h)
                n += 1
        held.count = n
        if n > held.limit:  # more than its pool holds: deltas were lost; forget its oldest
            self._trim(held, n - held.limit)
        elif len(log) > 2 * held.limit:
            held.log = list(dict.fromkeys(h for h in log if holders.get(h, 0) & bit))

    def _trim(self, held: _Held, over: int) -> None:
        log, holders, bit = held.log, self._holders, held.bit
        i = 0
        while over > 0:
            h = log[i]
            i += 1
            mask = holders.get(h, 0)
            if mask & bit:
                over -= 1
                held.count -= 1
                if mask != bit:
                    holders[h] = mask ^ bit
                else:
                    del holders[h]
        del log[:i]

    def drop(self, engine: bytes) -> None:
        """The engine is gone (lost, restarted, left): its entries go now."""
        held = self._held.pop(engine, None)
        if held is None:
            return
        bit = held.bit
        holders = self._holders
        for h in held.log:
            mask = holders.get(h, 0)
            if mask & bit:
                if mask != bit:
                    holders[h] = mask ^ bit
                else:
                    del holders[h]
        self._engines[held.slot] = None

    def bit(self, engine: bytes) -> int:
        """The engine's bit in the masks (0 if it is not indexed)."""
        held = self._held.get(engine)
        return held.bit if held is not None else 0

    def mask(self, h: int) -> int:
        """The mask of the engines holding block ``h``."""
        return self._holders.get(h, 0)

    def engines_in(self, mask: int) -> list[bytes]:
        """The engines whose bits are set in ``mask``, by slot."""
        out = []
        while mask:
            low = mask & -mask
            out.append(self._engines[low.bit_length() - 1])
            mask ^= low
        return out  # type: ignore[return-value]  # a set bit is a live slot

    def holders(self, h: int) -> list[bytes]:
        """The engines holding block ``h``."""
        return self.engines_in(self._holders.get(h, 0))

    def longest(self, hashes: Sequence[int], mask: int) -> tuple[int, int]:
        """The most leading blocks of ``hashes`` that one engine of ``mask`` holds, and the mask of the engines
        of ``mask`` holding that many: one binary search for all of them.

        An engine's cache holds a chain's blocks as a prefix: a block is shared only with its whole prefix, and
        the block manager frees a sequence's blocks last first, so its LRU evicts a chain from the end. So the
        engines holding block k are among those holding block k - 1, and the search narrows the mask as it goes
        up: O(log n) lookups whatever the number of engines. (Where that does not hold, after lost deltas made
        the index drop an engine's oldest entries, a count may be off: a worse route, never a wrong answer.)"""
        if not hashes:
            return 0, 0
        get = self._holders.get
        at = get(hashes[0], 0) & mask
        if not at:
            return 0, 0
        held, free = 0, len(hashes)  # some engine of ``at`` holds hashes[held]; none holds hashes[free] (or beyond)
        while free - held > 1:
            mid = (held + free) >> 1
            found = get(hashes[mid], 0) & at
            if found:
                held = mid
                at = found
            else:
                free = mid
        return held + 1, at

    def matches(self, hashes: Sequence[int], engines: Iterable[bytes]) -> dict[bytes, int]:
        """Per engine of ``engines``, how many leading blocks of ``hashes`` it holds (``longest`` for each)."""
        return {e: self.longest(hashes, self.bit(e))[0] for e in engines}

    def __len__(self) -> int:
        """Entries (engine, hash) held: the memory bound is the engines' KV blocks (or MIN_ENTRIES each)."""
        return sum(held.count for held in self._held.values())

    def holds(self, engine: bytes, h: int) -> bool:
        return bool(self._holders.get(h, 0) & self.bit(engine))

    def log_size(self, engine: bytes) -> int:
        """The length of the engine's log (at most twice its bound, past which it is compacted)."""
        held = self._held.get(engine)
        return len(held.log) if held is not None else 0

    @classmethod
    def restore(cls, slots: Sequence[tuple[bytes, int, Sequence[int]] | None]) -> PrefixIndex:
        """An index holding what ``slots`` says (per slot: None, or an engine, its bound and the hashes it holds,
        oldest first: ``prefix_table``'s ``export``), each engine in the same slot."""
        index = cls()
        index._engines = [s[0] if s is not None else None for s in slots]
        for slot, s in enumerate(slots):
            if s is not None:
                engine, limit, hashes = s
                index._held[engine] = _Held(slot, limit)
                index.update(engine, hashes, ())
        return index

    def export(self) -> list[tuple[bytes, int, list[int]] | None]:
        """Per slot: None, or the engine there, its bound and the hashes it holds, oldest first (``restore``)."""
        out: list[tuple[bytes, int, list[int]] | None] = [None] * len(self._engines)
        for engine, held in self._held.items():
            holders, bit = self._holders, held.bit
            out[held.slot] = (engine, held.limit, [h for h in dict.fromkeys(held.log) if holders.get(h, 0) & bit])
        return out
