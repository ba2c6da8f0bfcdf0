"""The dynamic-batching scheduler. Pure: no sockets and no clock of its own (``now`` is passed in, in
seconds), so tests drive it with a fake clock and ``zserve.Streamer`` can reuse it in-process.

Policy, per model: a bounded FIFO queue. A batch goes to a worker that has credit when
  * the queue holds ``max_batch_size`` items (full by count), or
  * the oldest item has waited ``max_wait_ms``, or
  * the worker is idle (nothing in flight): an idle worker never leaves a request waiting, so at low load
    the added latency is the hops, not the batching window; under load the queue fills while workers
    are busy and batches grow by themselves.

A model with a preprocess stage ("staged") sends its batches to preprocess workers first; what they return
waits in the model's prepared queue and goes, as formed, to the next engine with credit. Stages are fed
only while fewer batches are on their way (in stages or prepared) than the engines' total credit, so
preprocessed batches never pile up faster than engines take them; and a partial batch goes to a stage
only when an idle engine would wait for it (otherwise it keeps filling while the engines compute, and goes
when it is full).

Cost-aware batching (a model with ``max_batch_cost``): each item has a cost (tokens, pixels), and a batch
costs its size times its largest item's cost, which is what a batch padded to its longest item computes.
The queue counts as full once it holds a budget's worth of cost. A batch always starts with the oldest
item; it is filled with the queued items whose cost is closest to that one's, as long as the batch stays
within the budget and at least half of what it computes is real (padding efficiency >= 1/2), so that long
items share batches with long ones and short with short. Fairness bound: only items that arrived within
``max_wait_ms`` of the oldest one may join it, so no item is ever passed over by one that arrived more than
``max_wait_ms`` after it, and every batch takes the oldest item: nothing starves.

Priorities and tenants (``zserve.batching.fair_share``): a model whose items all have priority 0 and no tenant keeps
the FIFO above, at no cost. The first item with a priority or a tenant (or tenants configured from the start) gives
the model a ``FairQueue``, and from then on its batches take items in the fair queue's order (priority with aging,
then weighted fair share on cost); when to send a batch is decided as above. A cost-aware model's batches then fill
in that order up to the budget, without grouping items by cost.

A full queue and tenants: ``max_queue`` is one bound for the model, but a tenant that floods it does not take the
others' room. When the queue is full and the arrival's tenant holds less than its weighted share of it,
``make_room`` takes the newest queued item of the tenant holding the most past its share out of the queue (its
caller answers it, as it would a refused arrival); the rule is ``FairQueue.push_out``'s. Requests without a
tenant count as one tenant (``""``, weight 1); a model with one tenant (or none) refuses the arrival, as before.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zserve.batching.fair_share import DEFAULT_AGING_S, FairQueue
from zserve.batching.workers import ENGINE, PREPROCESS, Worker, WorkerPool


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    max_batch_size: int
    max_wait_ms: float
    max_queue: int
    max_batch_cost: int = 0  # 0: by count only


MIN_PADDING_EFFICIENCY = 0.5  # a cost-aware batch computes at most twice the cost of its items
_COST_CANDIDATES = 8  # x max_batch_size: how far down the queue a cost-aware batch looks for its items


class Admission(enum.Enum):
    ACCEPTED = "accepted"
    OVERLOADED = "overloaded"
    UNKNOWN_MODEL = "unknown_model"


@dataclass(slots=True)
class Prepared:
    """A batch a preprocess stage returned: one payload for ``item_ids`` together."""

    item_ids: list[int]
    frames: list[Any]


@dataclass(slots=True)
class Dispatch:
    """A batch the scheduler formed: send ``item_ids`` of ``model`` to ``worker`` as ``batch_id``.
    ``prepared`` is set when the batch is a preprocessed payload for an engine."""

    batch_id: int
    model: str
    worker: Worker
    item_ids: list[int]
    prepared: Prepared | None = None
    preprocess: bool = False  # a staged model's batch for an idle engine, which preprocesses it itself


class Scheduler:
    def __init__(
        self,
        policies: dict[str, BatchPolicy],
        pool: WorkerPool,
        staged: frozenset[str] = frozenset(),
        first_batch_id: int = 1,
        weights: dict[str, float] | None = None,
        fair_models: frozenset[str] = frozenset(),
        aging_s: float = DEFAULT_AGING_S,
    ):
        self.policies = policies
        self.pool = pool
        self.staged = staged
        # item id -> time it entered the queue; insertion order is FIFO order.
        self._queues: dict[str, OrderedDict[int, float]] = {m: OrderedDict() for m in policies}
        self._prepared: dict[str, deque[Prepared]] = {m: deque() for m in policies}
        # Cost-aware models only: item id -> cost of each queued item, and their sum.
        self._costs: dict[str, dict[int, int]] = {m: {} for m, p in policies.items() if p.max_batch_cost}
        self._queued_cost: dict[str, int] = dict.fromkeys(self._costs, 0)
        self.padding: dict[str, list[int]] = {m: [0, 0] for m in self._costs}  # [real, computed] cost dispatched
        # Queued items that must go in a batch of their own: they were in a batch that hung its worker, and
        # the one item that hangs must not take its batch-mates down with it again.
        self._alone: dict[str, set[int]] = {m: set() for m in policies}
        self._next_batch_id = first_batch_id
        # models whose sequences an engine router places: (model, item id, the least-loaded engine) -> engine
        self.routes: dict[str, Callable[[str, int, Worker], Worker]] = {}
        # models ordered by priority and fair share (the module docstring); the others stay FIFO
        self.weights = weights or {}
        self.aging_s = aging_s
        self.fair: dict[str, FairQueue] = {m: FairQueue(self.weights, aging_s) for m in fair_models if m in policies}

    def submit(
        self, model: str, item_id: int, now: float, cost: int = 1, priority: int = 0, tenant: str = ""
    ) -> Admission:
        queue = self._queues.get(model)
        if queue is None:
            return Admission.UNKNOWN_MODEL
        if len(queue) >= self.policies[model].max_queue:
            return Admission.OVERLOADED
        queue[item_id] = now
        if priority or tenant or self.fair:  # the FIFO hot path pays this one test
            fair = self.fair.get(model)
            if fair is None and (priority or tenant):
                fair = self._make_fair(model, item_id)
            if fair is not None:
                fair.add(item_id, now, cost, priority, tenant)
        costs = self._costs.get(model)
        if costs is not None:
            costs[item_id] = cost = max(1, cost)
            self._queued_cost[model] += cost
        return Admission.ACCEPTED

    def make_room(self, model: str, item_id: int, tenant: str = "") -> int | None:
        """``submit`` found ``model``'s queue full: take out the queued item that ``tenant``'s arrival (``item_id``)
        may replace, and return its id for the caller to answer; None (nothing taken) if the arrival is the one to
        refuse. Only at exactly ``max_queue``: past it (items requeued after a lost batch) one out makes no room."""
        queue = self._queues.get(model)
        if queue is None or len(queue) != self.policies[model].max_queue:
            return None
        fair = self.fair.get(model)
        if fair is None:
            if not tenant:  # one tenant, the FIFO's: nobody holds more than their share
                return None
            fair = self._make_fair(model, item_id)
        victim = fair.push_out(tenant, len(queue))
        if victim is not None:
            self.remove(model, victim)  # the rest of its bookkeeping (the fair queue has let it go)
        return victim

    def _make_fair(self, model: str, item_id: int) -> FairQueue:
        """A FIFO model's first item with a priority or tenant: what is queued joins the fair queue as it stands."""
        fair = self.fair[model] = FairQueue(self.weights, self.aging_s)
        costs = self._costs.get(model)
        for queued_id, arrived_s in self._queues[model].items():
            if queued_id != item_id:
                fair.add(queued_id, arrived_s, costs[queued_id] if costs is not None else 1)
        return fair

    def requeue(
        self, model: str, item_id: int, queued_s: float, cost: int = 1, alone: bool = False, tenant: str = ""
    ) -> None:
        """Put an item back at the head of its queue (its batch was lost). Ignores ``max_queue``: the
        item was admitted once and must get an answer. ``alone``: its next batch holds only it."""
        queue = self._queues[model]
        queue[item_id] = queued_s
        queue.move_to_end(item_id, last=False)
        fair = self.fair.get(model)
        if fair is not None:
            fair.add_front(item_id, cost, tenant)
        if alone:
            self._alone[model].add(item_id)
        costs = self._costs.get(model)
        if costs is not None and item_id not in costs:
            costs[item_id] = cost = max(1, cost)
            self._queued_cost[model] += cost

    def remove(self, model: str, item_id: int) -> bool:
        """Drop a queued item (cancelled or expired); False if it is not queued."""
        queue = self._queues.get(model)
        if queue is None or queue.pop(item_id, None) is None:
            return False
        self._alone[model].discard(item_id)
        fair = self.fair.get(model)
        if fair is not None:
            fair.remove(item_id)
        costs = self._costs.get(model)
        if costs is not None:
            self._queued_cost[model] -= costs.pop(item_id)
        return True

    def depth(self, model: str) -> int:
        return len(self._queues[model])

    def prepared_depth(self, model: str) -> int:
        return len(self._prepared[model])

    def add_prepared(self, model: str, item_ids: list[int], frames: list[Any]) -> None:
        self._prepared[model].append(Prepared(item_ids, frames))

    def _role(self, model: str) -> str:
        """Who takes a model's queued batches: its preprocess stages if it has them, else its engines."""
        return PREPROCESS if model in self.staged else ENGINE

    def _new_batch_id(self) -> int:
        self._next_batch_id += 1
        return self._next_batch_id - 1

    def _ahead(self, model: str) -> int:
        """Batches on their way to the engines: prepared, or in a stage."""
        return len(self._prepared[model]) + self.pool.in_flight_batches(model, PREPROCESS)

    def _feeds_stage(self, model: str) -> bool:
        """Whether the queue's next batch may go to a stage: not while enough are on their way to engines."""
        return self._ahead(model) < max(1, self.pool.credit_total(model, ENGINE))

    def _engine_would_wait(self, model: str) -> bool:
        """An idle engine would wait for a batch, and none on its way is for it: a partial batch is worth sending
        now. A busy engine's spare credit does not count: it is for the next batch to be ready when the current
        one ends, and a partial batch sent into it early stops growing while the engine computes (measured: a
        closed loop of 64 on an engine with 2 credits ran batches of 5 where 32 fit)."""
        return self.pool.idle_count(model, ENGINE) > self._ahead(model)

    def pop_batches(self, now: float) -> list[Dispatch]:
        """Every batch that should leave now, with the worker each goes to (credit already taken)."""
        out: list[Dispatch] = []
        for model, queue in self._queues.items():
            prepared = self._prepared[model]
            while prepared:
                worker = self.pool.best(model, ENGINE)
                if worker is None:
                    break
                batch = prepared.popleft()
                batch_id = self._new_batch_id()
                self.pool.start(worker, batch_id, model, batch.item_ids, now)
                out.append(Dispatch(batch_id, model, worker, batch.item_ids, batch))
            policy = self.policies[model]
            role = self._role(model)
            alone = self._alone[model]
            fair = self.fair.get(model)
            while queue:
                # An idle engine with nothing on its way takes a staged model's batch itself if its preprocess is
                # cheap (Model.preprocess_in_idle_engine): through a stage, the hops are all the engine waits for.
                would_wait = role == PREPROCESS and self._engine_would_wait(model)
                engine = self.pool.best(model, ENGINE) if would_wait else None
                direct = engine is not None and engine.preprocesses and not engine.in_flight
                if role == PREPROCESS and not direct and not self._feeds_stage(model):
                    break
                worker = engine if direct else self.pool.best(model, role)
                if worker is None:
                    break
                route = self.routes.get(model)
                oldest_s = next(iter(queue.values()))
                # With a stage, a partial batch leaves only if an engine would otherwise wait for it;
                # while engines are busy the batch keeps filling (as a busy engine without credit would).
                partial_ok = role == ENGINE or would_wait
                full = len(queue) >= policy.max_batch_size or (
                    policy.max_batch_cost and self._queued_cost[model] >= policy.max_batch_cost
                )
                ready = full or (
                    partial_ok and ((now - oldest_s) * 1000.0 >= policy.max_wait_ms or not worker.in_flight)
                )
                if alone and next(iter(queue)) in alone:  # requeued at the head: one batch each
                    item_id = queue.popitem(last=False)[0]
                    alone.discard(item_id)
                    if policy.max_batch_cost:
                        self._queued_cost[model] -= self._costs[model].pop(item_id)
                    if fair is not None:
                        fair.remove(item_id)
                    ids = [item_id]
                elif not ready:
                    break
                elif fair is not None:
                    ids = self._take_fair(model, policy, fair, now)
                elif policy.max_batch_cost:
                    ids = self._take_by_cost(model, policy)
                else:
                    n = min(policy.max_batch_size, len(queue))
                    if not alone:
                        ids = [queue.popitem(last=False)[0] for _ in range(n)]
                    else:  # the batch ends before an item that must go alone
                        ids = []
                        while queue and len(ids) < n and next(iter(queue)) not in alone:
                            ids.append(queue.popitem(last=False)[0])
                if route is not None and len(ids) == 1:  # a generative sequence, routed by its prompt's blocks
                    worker = route(model, ids[0], worker)
                batch_id = self._new_batch_id()
                self.pool.start(worker, batch_id, model, ids, now)
                out.append(Dispatch(batch_id, model, worker, ids, preprocess=direct))
        return out

    def _take_fair(self, model: str, policy: BatchPolicy, fair: FairQueue, now: float) -> list[int]:
        """A batch in the fair queue's order: up to ``max_batch_size`` items, and for a cost-aware model while the
        batch (its size times its largest item's cost) stays within the budget; always at least one item."""
        queue, alone, costs = self._queues[model], self._alone[model], self._costs.get(model)
        ids: list[int] = []
        largest = 0
        while len(ids) < policy.max_batch_size:
            item_id = fair.peek(now)
            if item_id is None or (ids and item_id in alone):
                break
            if costs is not None:
                top = max(largest, costs[item_id])
                if ids and (len(ids) + 1) * top > policy.max_batch_cost:
                    break
                largest = top
            fair.pop(now)
            del queue[item_id]
            ids.append(item_id)
            if item_id in alone:  # only at the head: a batch of its own
                alone.discard(item_id)
                break
        if costs is not None:
            total = sum(costs.pop(i) for i in ids)
            self._queued_cost[model] -= total
            padding = self.padding[model]
            padding[0] += total
            padding[1] += len(ids) * largest
        return ids

    def _take_by_cost(self, model: str, policy: BatchPolicy) -> list[int]:
        """Take a cost-aware batch off the queue (the rule is in the module docstring)."""
        queue, costs = self._queues[model], self._costs[model]
        budget, limit = policy.max_batch_cost, policy.max_batch_size
        items = iter(queue.items())
        head_id, head_s = next(items)
        head_cost = costs[head_id]
        window_end_s = head_s + policy.max_wait_ms / 1000.0
        candidates: list[tuple[int, int, int]] = []  # (distance from the head's cost, position, id)
        for position, (item_id, arrived_s) in enumerate(items):
            if arrived_s > window_end_s or position >= _COST_CANDIDATES * limit:
                break
            if item_id not in self._alone[model]:
                candidates.append((abs(costs[item_id] - head_cost), position, item_id))
        candidates.sort()
        ids, total, largest = [head_id], head_cost, head_cost
        for _, _, item_id in candidates:
            if len(ids) >= limit:
                break
            cost = costs[item_id]
            top = max(largest, cost)
            computed = (len(ids) + 1) * top
            if computed > budget or total + cost < MIN_PADDING_EFFICIENCY * computed:
                continue
            ids.append(item_id)
            total, largest = total + cost, top
        # Past the window, items join in arrival order while every item before them has joined: nobody is
        # passed over, and a queue that grew while the engines computed still fills a batch (a closed loop of
        # 64 otherwise ran batches of what arrived within max_wait_ms of the oldest).
        taken = set(ids)
        for item_id in queue:  # in arrival order; the first item that cannot join ends the batch
            if len(ids) >= limit:
                break
            if item_id in taken:
                continue
            cost = costs[item_id]
            top = max(largest, cost)
            computed = (len(ids) + 1) * top
            if item_id in self._alone[model] or computed > budget or total + cost < MIN_PADDING_EFFICIENCY * computed:
                break
            ids.append(item_id)
            total, largest = total + cost, top
        for item_id in ids:
            del queue[item_id]
            del costs[item_id]
        self._queued_cost[model] -= total
        padding = self.padding[model]
        padding[0] += total
        padding[1] += len(ids) * largest
        return ids

    def next_wakeup_s(self, now: float) -> float | None:
        """Seconds until a batching window closes for a model that has a worker with credit; None if no
        such deadline is pending (only new arrivals or results can make a batch ready)."""
        best: float | None = None
        for model, queue in self._queues.items():
            role = self._role(model)
            if not queue or self.pool.best(model, role) is None:
                continue
            if role == PREPROCESS and not (self._feeds_stage(model) and self._engine_would_wait(model)):
                continue  # only a full queue or an engine's progress can start a batch: no timer
            oldest_s = next(iter(queue.values()))
            wait = max(0.0, oldest_s + self.policies[model].max_wait_ms / 1000.0 - now)
            best = wait if best is None else min(best, wait)
        return best
