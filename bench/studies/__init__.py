"""One-off studies that informed a decision (kernels, stages, cost-aware batching, the Streamer), each runnable as
``python -m bench.studies.NAME`` (bench/README.md)."""
