"""The fault benchmarks: overload at 10x capacity and the soak: ``python -m bench.faults`` (bench/README.md)."""
