"""The order in which one model's queued items are taken when priorities or tenants are in use. Pure: no clock of
its own (``now`` is passed in, in seconds).

Priority (an integer, lower is more urgent, default 0: vLLM's convention) comes first, tenants' fair share second:

* **Fair share.** Tenants are served by start-time fair queuing on cost (Goyal et al., 1996): each backlogged tenant
  has a virtual start tag, the tenant with the smallest tag is served next, and serving an item of cost ``c`` moves
  its tenant's tag on by ``c / weight``. Two tenants that are both backlogged therefore get served cost in the ratio
  of their weights, whatever rate each sends; a tenant that was idle starts at the current virtual time, so it
  cannot bank credit while it sends nothing.
* **Priority.** Among tenants, the one whose next item is the most urgent goes first; within a tenant, its items go
  most urgent first, oldest first within a priority.
* **A full queue.** When the model's queue holds ``max_queue`` items and an item arrives from a tenant holding fewer
  than its weighted share of them (``max_queue * weight / the weights of the tenants holding items, itself
  included``), ``push_out`` takes out the item to refuse instead: the one served last in its own tenant's order
  (its newest, at equal priorities) of the tenant holding the most per unit of weight, if that tenant holds more than
  its share. Otherwise the arrival is refused. So a tenant that floods fills only its share of the queue, and the
  others' arrivals still find room (the "longest queue drop" of fair queuing's buffer management, as Linux's fq_codel
  drops from its fattest flow). Requeued items (their batch was lost) are never chosen: they were admitted and
  dispatched once.
* **Aging, so nothing starves.** Each ``aging_s`` an item waits counts as one level more urgent (never more urgent
  than the most urgent item it is compared with, so equally urgent tenants still share fairly). An item of priority
  ``p`` therefore waits at most about ``(p - p_best) * aging_s`` behind a steady stream of more urgent ones, and is
  then served among them by fair share; within a tenant the order key ``arrived_s + priority * aging_s`` says the
  same without depending on the clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

DEFAULT_AGING_S = 1.0


@dataclass(slots=True)
class _Tenant:
    weight: float
    # (arrived_s + priority * aging_s, sequence, item id, priority, arrived_s): the tenant's own order
    heap: list[tuple[float, int, int, int, float]] = field(default_factory=list)
    start: float = 0.0  # virtual start tag of its next item, while backlogged
    queued: int = 0  # live items in the heap (removed ones stay in it until they reach its top)
    # (-order key, -sequence, item id): the same items the other way round, its top the item served last, which a
    # full queue pushes out (``push_out``). Built by the first push-out and kept while the tenant has items queued,
    # so a queue that never fills pays nothing for it; entries of items gone are dropped when met, or past a bound.
    last: list[tuple[float, int, int]] | None = None


class FairQueue:
    """One model's queue order under priorities and tenants. Holds ids and their costs; the scheduler keeps the
    rest (arrival times for the batching window, the cost totals)."""

    def __init__(self, weights: dict[str, float] | None = None, aging_s: float = DEFAULT_AGING_S) -> None:
        self.weights = weights or {}
        self.aging_s = aging_s
        self._tenants: dict[str, _Tenant] = {}
        self._live: dict[int, tuple[str, int]] = {}  # item id -> (tenant, cost)
        self._front: deque[int] = deque()  # requeued items (their batch was lost): first, in this order
        self._seq = itertools.count()
        self.virtual = 0.0  # the start tag of the item served last
        self.served: dict[str, int] = {}  # tenant -> cost served (the fair-share figure)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item_id: int) -> bool:
        return item_id in self._live

    def add(self, item_id: int, arrived_s: float, cost: int = 1, priority: int = 0, tenant: str = "") -> None:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(self._weight(tenant))
        if not t.queued:  # becomes backlogged: no credit for the time it sent nothing
            t.start = max(t.start, self.virtual)
        t.queued += 1
        key = arrived_s + priority * self.aging_s
        seq = next(self._seq)
        heapq.heappush(t.heap, (key, seq, item_id, priority, arrived_s))
        self._live[item_id] = (tenant, max(1, cost))
        last = t.last
        if last is not None:  # the queue was full and this tenant was past its share: keep its order backwards too
            if len(last) > 2 * t.queued + 64:  # mostly items gone since: keep the live ones (amortised O(1))
                live = self._live
                last[:] = [e for e in last if e[2] in live]
                heapq.heapify(last)
            heapq.heappush(last, (-key, -seq, item_id))

    def add_front(self, item_id: int, cost: int = 1, tenant: str = "") -> None:
        """An item whose batch was lost: it goes before everything else (it was admitted and chosen once)."""
        self._live[item_id] = (tenant, max(1, cost))
        self._front.appendleft(item_id)

    def remove(self, item_id: int) -> bool:
        entry = self._live.pop(item_id, None)
        if entry is None:
            return False
        t = self._tenants.get(entry[0])
        if t is not None and item_id not in self._front:
            t.queued -= 1
            if not t.queued:
                t.last = None
        return True

    def _weight(self, tenant: str) -> float:
        t = self._tenants.get(tenant)
        return t.weight if t is not None else max(1e-9, float(self.weights.get(tenant, 1.0)))

    def push_out(self, tenant: str, capacity: int) -> int | None:
        """The queue holds ``capacity`` items and one of ``tenant`` arrives: take out and return the queued item to
        refuse in its place, or None (nothing taken) to refuse the arrival; the rule is in the module docstring.
        Requeued items count in their tenant's holding (they take room) but are never taken."""
        live, tenants = self._live, self._tenants
        holding = {name: t.queued for name, t in tenants.items() if t.queued}
        front: set[int] = set()
        if self._front:  # rare: items of a lost batch
            front = {item_id for item_id in self._front if item_id in live}
            for item_id in front:
                name = live[item_id][0]
                holding[name] = holding.get(name, 0) + 1
        weights = {name: self._weight(name) for name in holding}
        mine = self._weight(tenant)
        per_weight = capacity / (sum(weights.values()) + (0.0 if tenant in holding else mine))
        if holding.get(tenant, 0) >= per_weight * mine:
            return None  # at or past its share: the arrival is the one refused
        for name in sorted(holding, key=lambda n: holding[n] / weights[n], reverse=True):
            if name == tenant:
                continue
            if holding[name] <= per_weight * weights[name]:
                return None  # nobody else holds more than their share (requeued items, rounding)
            t = tenants.get(name)
            if t is None:  # known only by requeued items: nothing it holds may go
                continue
            last = t.last
            if last is None:
                last = t.last = [(-e[0], -e[1], e[2]) for e in t.heap if e[2] in live]
                heapq.heapify(last)
            while last:
                item_id = heapq.heappop(last)[2]
                if item_id in live and item_id not in front:
                    self.remove(item_id)
                    return item_id
                # an item served or removed since (or a requeued item's old entry): dropped, look again
        return None

    def cost(self, item_id: int) -> int:
        return self._live[item_id][1]

    def _head(self, t: _Tenant) -> tuple[float, int, int, int, float] | None:
        heap, live = t.heap, self._live
        while heap and heap[0][2] not in live:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def peek(self, now: float) -> int | None:
        """The id that ``pop`` would take now, or None if empty."""
        front = self._front
        while front and front[0] not in self._live:
            front.popleft()
        if front:
            return front[0]
        choice = self._choose(now)
        return None if choice is None else choice[1][2]

    def _choose(self, now: float) -> tuple[str, tuple[float, int, int, int, float]] | None:
        heads = []
        for name, t in self._tenants.items():
            if t.queued:
                head = self._head(t)
                if head is not None:
                    heads.append((name, t, head))
        if not heads:
            return None
        best_priority = min(h[3] for _, _, h in heads)
        best: tuple[int, float, int] | None = None
        chosen = None
        for name, t, head in heads:
            aged = head[3] - math.floor((now - head[4]) / self.aging_s) if self.aging_s > 0 else head[3]
            rank = (max(aged, best_priority), t.start, head[1])
            if best is None or rank < best:
                best, chosen = rank, (name, head)
        return chosen

    def pop(self, now: float) -> int | None:
        """Take the next item (see the module docstring); None if empty."""
        front = self._front
        while front:
            item_id = front.popleft()
            if item_id in self._live:
                tenant, cost = self._live.pop(item_id)
                self.served[tenant] = self.served.get(tenant, 0) + cost
                return item_id
        choice = self._choose(now)
        if choice is None:
            return None
        name, head = choice
        t = self._tenants[name]
        heapq.heappop(t.heap)
        item_id = head[2]
        _, cost = self._live.pop(item_id)
        t.queued -= 1
        if not t.queued:
            t.last = None
        self.virtual = t.start
        t.start += cost / t.weight
        self.served[name] = self.served.get(name, 0) + cost
        return item_id
