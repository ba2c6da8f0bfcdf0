"""Direct Python clients: straight to the broker over ZeroMQ, no HTTP.

* ``Client``: thread-safe; ``predict`` blocks, ``submit`` returns a ``concurrent.futures.Future`` (many in
  flight from one thread). One I/O thread owns the socket.
* ``AsyncClient``: ``await predict(...)`` from asyncio; the frontends use it too.

Both coalesce: what callers submit in one turn (of the IO thread, of the event loop) reaches the broker as
one message, and the broker answers each client once per batch. Both keep their requests in one
socket-free ``PendingTable`` (``pending.py``).

Generative models: ``generate(prompts, model=..., **sampling)`` returns one ``GenerateResponse`` per prompt
(all prompts in flight at once, so the engine batches them); ``generate_stream(prompt, model=...)`` yields
text deltas as the engine produces them, and holds the whole response in ``.response`` at the end. Closing
a stream early (``break``, ``close()``) cancels the request: the engine frees its KV blocks at once.

Payloads sent here are raw request bodies: the engine runs the model's ``decode_request`` and
``encode_response`` hooks, so ``client.predict("embed", {"text": "hi"})`` answers exactly what
``POST /v1/models/embed/predict`` would. Errors arrive as the typed exceptions of ``zserve.errors``.

While requests are pending, a client pings the broker; if the broker stops answering, or restarts (its
epoch changes), every pending request fails with ``BrokerUnavailable``/``EngineLost`` instead of hanging.
"""

from zserve.client.aio import AsyncClient
from zserve.client.pending import Answer
from zserve.client.streams import AsyncGenerationStream, GenerationStream
from zserve.client.sync import Client, endpoint_from_config

__all__ = ["Answer", "AsyncClient", "AsyncGenerationStream", "Client", "GenerationStream", "endpoint_from_config"]
