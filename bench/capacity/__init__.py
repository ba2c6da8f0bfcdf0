"""The broker's capacity: scaling over engines, the broker alone, through ``Client.submit``:
``python -m bench.capacity`` (bench/README.md)."""
