"""The generation suite: zserve against static batching and one request at a time, against vLLM, prefix
caching, the decode step against the bandwidth bound: ``python -m bench.generation`` (bench/README.md)."""
