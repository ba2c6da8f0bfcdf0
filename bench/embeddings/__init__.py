"""zserve's embedding path against infinity-emb and mosec: ``python -m bench.embeddings``
(bench/embeddings/README.md)."""
