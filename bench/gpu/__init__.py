"""The GPU checks: ``python -m bench.gpu.gen_check``, ``python -m bench.gpu.embed_dtype`` (bench/gpu/README.md)."""
