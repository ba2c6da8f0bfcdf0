"""The dynamic-batching policy, pure (no sockets, no clock of its own): the worker pool (``workers``) and the
scheduler that forms batches for it (``scheduler``). Both the broker (``zserve.broker.core``) and the in-process
``zserve.Streamer`` drive it, so it lives in the base package, below both."""
