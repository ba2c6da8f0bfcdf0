"""The wire protocol: every message that crosses a ZeroMQ socket, defined once.

Frame layout on every socket: ``[identity (ROUTER side only)] [header] [payload frames...]``. The header
is one msgspec-msgpack encoded, tagged Struct; payload frames are raw bytes (see ``zserve.payload``) that
the broker forwards without decoding. Rules for evolving this file: tags are never reused, fields are
only appended, and every appended field has a default, so an older peer still decodes a newer message.
"""

from __future__ import annotations

import enum
import logging

import msgspec

PROTOCOL_VERSION = 1

log = logging.getLogger("zserve.protocol")


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1  # the input was rejected (decode_request, validation, a model-raised BadRequest)
    UNKNOWN_MODEL = 2
    OVERLOADED = 3  # the model's queue is full: retry later
    DEADLINE_EXCEEDED = 4
    ENGINE_LOST = 5  # the worker holding the request died twice, or the broker restarted
    INTERNAL = 6  # the model raised, or returned the wrong number of outputs
    CANCELLED = 7
    SHUTTING_DOWN = 8  # the broker is draining and accepts nothing new
    RATE_LIMITED = 9  # the tenant is past a quota (Reply.field names it): retry after Reply.retry_after_ms


class Msg(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Base of every wire message. Tags are small ints (``tag=N`` on each subclass)."""


# ---- clients (frontends, direct clients) <-> broker: DEALER -> ROUTER -> DEALER ----


class Submit(Msg, tag=1):
    """One request. Followed by ``n_frames`` payload frames (``zserve.payload``)."""

    req_id: int  # chosen by the client, unique per client socket
    model: str
    timeout_ms: int = 0  # relative; 0 = the model's configured timeout_ms
    decoded: bool = False  # True: decode_request already ran (frontends); False: the engine runs the hooks
    stream: bool = False  # generative models: send Chunk messages as text is produced, then the Reply
    cost: int = 0  # what the item costs to compute (``Model.cost``), for models batched by cost; 0 = not given
    # generative models routed cache_aware: the prompt's shareable blocks' hashes (``zserve.batching.prefix_hash``),
    # at most MAX_ROUTE_BLOCKS; [] = route by load alone
    block_hashes: list[int] = []
    priority: int = 0  # lower is more urgent (vLLM's convention); see zserve.batching.fair_share
    tenant: str = ""  # whose quota and share this request counts against ([[tenants]]); "" = nobody's
    # block_hashes packed as little-endian uint64s (``prefix_hash.pack``): what frontends send since, as the
    # broker decodes 8 bytes a block as one object, not an int each; b"" = none (or block_hashes, older frontends)
    block_hashes_packed: bytes = b""


class Cancel(Msg, tag=2):
    req_id: int


class Reply(Msg, tag=3):
    """The one answer to a Submit. On OK, followed by the output's payload frames."""

    req_id: int
    status: Status
    message: str = ""
    field: str = ""  # the offending input field, for BAD_REQUEST when known
    batch_size: int = 0
    queue_ms: float = 0.0  # time from arrival at the broker to dispatch to a worker
    compute_ms: float = 0.0  # time the batch spent in the worker
    retry_after_ms: int = 0  # RATE_LIMITED: when the quota lets the request in


class TopLogprob(msgspec.Struct, gc=False):
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, gc=False):
    """A generated token (its text alone), its log-probability, and the most likely tokens at its place (in
    a streamed Chunk, and in a generative model's response)."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob]


class Chunk(Msg, tag=6):
    """Broker -> client, for a streamed generative request: text produced since the last Chunk. The
    request ends with its one Reply (the whole response), as every request does."""

    req_id: int
    text: str
    num_tokens: int = 0  # tokens generated so far
    # when the request asked for logprobs: those of the tokens generated since the last Chunk whose text
    # went out (a token's text can be held back, by a stop string or an incomplete character)
    logprobs: list[TokenLogprob] = []


# Coalesced messages: every hop sends what it has for a peer in one multipart message (one header, then the
# items' payload frames concatenated; ``frame_counts`` splits them, one count per item). A client sends all
# requests of one event-loop (or IO-thread) turn as one Submits; the broker answers each client with one
# Replies per batch result and one Chunks per engine step. The items are the single-message Structs above.


class Submits(Msg, tag=7):
    """Client -> broker: several requests. An item that does not validate fails alone (BAD_REQUEST, by its
    req_id when it has one); the counts keep every other item's frames aligned."""

    items: list[Submit]
    frame_counts: list[int]


class Replies(Msg, tag=8):
    """Broker -> client: answers, each followed (in order) by its ``frame_counts[i]`` payload frames."""

    items: list[Reply]
    frame_counts: list[int]


class Chunks(Msg, tag=9):
    """Broker -> client: new text of streamed requests, from one engine step. Always sent before the
    Replies that end any of them."""

    items: list[Chunk]


class HealthQuery(Msg, tag=4):
    query_id: int


class EngineRouting(msgspec.Struct, array_like=True, gc=False):
    """A generative engine's routing counters since the broker started (models routed cache_aware)."""

    engine: str  # its worker name
    prompt_blocks: int = 0  # prompt blocks of the requests routed to it
    cached_blocks: int = 0  # of those, held by its prefix cache when routed (hit rate = cached / prompt)
    match: int = 0  # decisions: routed here for the prefix it holds
    spill: int = 0  # routed here because the best-matching engine was too loaded
    least_loaded: int = 0  # routed here by load alone (nothing held anywhere, no blocks given, one engine)


class ModelHealth(msgspec.Struct, array_like=True, gc=False):
    name: str
    ready_workers: int  # engines
    queue_depth: int
    in_flight: int
    busy_workers: int = 0
    preprocess_workers: int = 0
    prepared_depth: int = 0  # preprocessed batches waiting for an engine
    engine_busy_s: float = 0.0  # compute time reported by workers, summed since the broker started
    preprocess_busy_s: float = 0.0
    generative: bool = False
    running_sequences: int = 0  # generative: sequences held by engines (running or waiting for KV blocks)
    free_kv_blocks: int = 0  # generative: free KV blocks over all engines, from their last report
    # generative, over all engines (the counters: since each engine started, the sum of their last reports)
    kv_blocks: int = 0  # the KV pools' size, in blocks (from Hello): usage = 1 - free_kv_blocks / kv_blocks
    engine_steps: int = 0  # engine steps run (mean step time = engine_busy_s / engine_steps)
    batch_tokens: int = 0  # tokens forwarded in those steps (mean batch = batch_tokens / engine_steps)
    preemptions: int = 0  # sequences preempted for KV blocks (recomputed later)
    prompt_tokens: int = 0  # prompt tokens admitted to engines (a recomputed sequence counts again)
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache (hit rate = cached / prompt)
    # For `zserve status` and /metrics:
    credits: int = 0  # engine credits over the ready engines (batches; sequences for a generative engine)
    free_credits: int = 0  # of those, not held by a batch or sequence
    batches: int = 0  # engine batches (generative: sequences) completed since the broker started
    mean_batch_size: float = 0.0  # items per engine batch, over recent batches
    latency_p50_ms: float = 0.0  # arrival at the broker to the answer, over recent answered requests
    latency_p90_ms: float = 0.0
    latency_p99_ms: float = 0.0
    workers_hung: int = 0  # workers found hung (no progress past batch_timeout_s) and killed, since start
    # models batched by cost, since start: the items' cost in dispatched batches, and what the batches
    # computed (size x largest cost); padding efficiency = batched_cost / padded_cost
    batched_cost: int = 0
    padded_cost: int = 0
    routing: list[EngineRouting] = []  # generative models routed cache_aware: per engine
    versions: list[str] = []  # its ready engines' library versions (Hello.versions), each distinct line once


class TenantHealth(msgspec.Struct, gc=False):
    """One tenant's requests since the broker started (``[[tenants]]``, or named by a direct client)."""

    name: str
    admitted: int = 0
    rate_limited: int = 0  # answered RATE_LIMITED (past one of its quotas)
    served_cost: dict[str, int] = {}  # model -> cost taken from its queue (the fair share's measure)
    overloaded: int = 0  # answered OVERLOADED after its quotas (a full queue, or its deadline out of reach)
    pending: int = 0  # its requests in the broker now, queued or computing


class HealthReport(Msg, tag=5):
    query_id: int
    epoch: int  # random per broker start: a change tells a client the broker restarted
    draining: bool
    models: list[ModelHealth] = []
    tenants: list[TenantHealth] = []


# ---- workers <-> broker ----
# Batches go broker ROUTER -> worker DEALER (addressed, credit-based). Results and heartbeats come back on
# the PUSH -> PULL fan-in, each naming the worker it comes from.


class Hello(Msg, tag=20):
    """A worker registers (after setup and warm-up); sent on its DEALER, whose identity is ``worker``."""

    worker: str
    pid: int
    role: str  # "engine"; "preprocess" comes with the stage issue
    models: list[str]
    credits: int  # batches it may hold; for a generative engine: sequences (its max_running)
    protocol: int = PROTOCOL_VERSION
    kv_blocks: int = 0  # generative engines: the KV pool's size, in blocks
    preprocesses: bool = False  # an engine that runs its staged model's preprocess itself when idle (Batch.preprocess)
    block_hashes: list[int] = []  # generative engines: every block hash its prefix cache holds (the router's snapshot)
    versions: str = ""  # the libraries it runs on (zserve.versions.library_versions), for `zserve status`


class Batch(Msg, tag=21):
    """Followed by every item's payload frames, concatenated; ``frame_counts`` splits them."""

    batch_id: int
    model: str
    item_ids: list[int]
    frame_counts: list[int]
    decoded: list[bool]
    # True: the frames are one payload, what a preprocess stage made of all the items together
    # (frame_counts then has a single entry); the engine passes it to predict as is.
    prepared: bool = False
    stream: list[bool] = []  # generative: per item, whether its client wants Chunks
    # True: a staged model's batch sent straight to an idle engine, which runs the model's preprocess itself (a
    # stage would only add its hops while the engine waits)
    preprocess: bool = False
    # generative: per item, its priority (lower is more urgent); empty = every one 0 (also from older brokers)
    priorities: list[int] = []


class BatchResult(Msg, tag=22):
    """Followed by each OK item's output frames, concatenated; ``frame_counts`` splits them."""

    batch_id: int
    worker: str
    statuses: list[Status]
    messages: list[str]
    fields: list[str]
    frame_counts: list[int]
    compute_ms: float = 0.0
    # From a preprocess stage: the last ``prepared_frames`` frames are one payload, the batch made of the
    # OK items (in order) for an engine. Failed items carry their status as usual.
    prepared_frames: int = 0


class Heartbeat(Msg, tag=23):
    sender: str
    busy: bool = False
    free_kv_blocks: int = -1  # generative engines; -1 = not reported


class Reset(Msg, tag=24):
    """Broker -> worker: "I do not know you" (the broker restarted, or expired you): send Hello again."""

    reason: str = ""


class Shutdown(Msg, tag=25):
    """Broker -> worker: finish the current batch and exit."""

    reason: str = ""


class Abort(Msg, tag=26):
    """Broker -> generative engine: stop these sequences now and free their blocks (cancelled, expired)."""

    batch_ids: list[int]


class Replace(Msg, tag=28):
    """Broker -> worker: you were found hung (work held, no progress past batch_timeout_s). Exit now, so that
    your supervisor (on whatever host) starts a fresh process; the broker has re-dispatched your batches."""

    reason: str = ""


class Leave(Msg, tag=29):
    """Worker -> broker: "I am stopping (SIGTERM: a scale-down, a rollout)". The broker sends it no more work,
    puts ``batch_ids`` (batches it received and will not start) back at the head of their queues without
    counting an attempt, and answers Shutdown once the worker holds nothing; what it is computing, it
    finishes. A worker sends Leave again for a Batch that crossed its first one."""

    worker: str
    batch_ids: list[int] = []


class StepOutput(Msg, tag=27):
    """Generative engine -> broker: one message per engine step, for every sequence with news. A sequence
    is a batch of one (``batch_ids``); an entry with ``finished`` is its last, and carries the whole
    response as payload frames (``frame_counts``, concatenated after the header) when its status is OK.
    """

    worker: str
    batch_ids: list[int]
    texts: list[str]  # new text since the last entry (streamed requests only; "" otherwise)
    num_tokens: list[int]  # tokens generated so far
    finished: list[bool]
    statuses: list[Status]
    messages: list[str]
    frame_counts: list[int]
    free_kv_blocks: int = -1
    step_ms: float = 0.0  # compute time of the step(s) this message reports
    fields: list[str] = []  # per entry: the offending input field of a BAD_REQUEST
    steps: int = 0  # engine steps this message reports (several when the output thread fell behind)
    batch_tokens: int = 0  # tokens forwarded in those steps
    # the engine's counters since it started (cumulative: the broker keeps each engine's last values)
    preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens admitted (a recomputed sequence counts again)
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache (not computed)
    logprobs: list[list[TokenLogprob]] = []  # per entry, when any asked: as Chunk.logprobs (streamed only)
    # block hashes the prefix cache stored and evicted since the engine's last StepOutput (or its Hello's snapshot)
    stored_blocks: list[int] = []
    evicted_blocks: list[int] = []


Message = (
    Submit
    | Submits
    | Cancel
    | Reply
    | Replies
    | Chunk
    | Chunks
    | HealthQuery
    | HealthReport
    | Hello
    | Batch
    | BatchResult
    | Heartbeat
    | Reset
    | Shutdown
    | Abort
    | StepOutput
    | Replace
    | Leave
)


class InvalidItem(msgspec.Struct, gc=False):
    """Not a wire type: an item of a Submits that did not validate, as ``Codec.decode`` hands it on so that
    only this item fails. ``req_id`` is None when even that could not be read (nobody can be answered)."""

    req_id: int | None
    message: str


class Codec:
    """Header encoder/decoder. Not thread-safe: one per thread that owns a socket."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Msg) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview, sender: str = "?") -> Msg | None:
        """Decode a header; a malformed one is logged with its sender and dropped (None), never raised. A
        Submits whose envelope is sound but some items are not comes back with those items as InvalidItem."""
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            salvaged = _salvage_submits(data) if isinstance(exc, msgspec.ValidationError) else None
            if salvaged is not None:
                bad = sum(isinstance(item, InvalidItem) for item in salvaged.items)
                log.warning("%d malformed items in a Submits from %s: %s", bad, sender, exc)
                return salvaged
            log.warning("dropped malformed frame from %s: %s", sender, exc)
            return None


_SUBMITS_TAG = Submits.__struct_config__.tag


def _salvage_submits(data: bytes | memoryview) -> Submits | None:
    """The slow path for a Submits that failed validation: validate item by item."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:  # valid enough for a tag, not as msgpack (trailing bytes): drop it
        return None
    if not (isinstance(raw, list) and len(raw) >= 3 and raw[0] == _SUBMITS_TAG and isinstance(raw[1], list)):
        return None
    try:
        counts = msgspec.convert(raw[2], list[int])
    except msgspec.ValidationError:
        return None
    items: list[Submit | InvalidItem] = []
    for entry in raw[1]:
        try:
            items.append(msgspec.convert(entry, Submit))
        except msgspec.ValidationError as exc:
            req_id = entry[1] if isinstance(entry, list) and len(entry) > 1 and type(entry[1]) is int else None
            items.append(InvalidItem(req_id, f"malformed request: {exc}"))
    return Submits(items, counts)  # type: ignore[arg-type]  # InvalidItem rows are for the broker only
