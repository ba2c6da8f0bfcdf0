"""The benchmark suites, a package at the repo root: each suite runs as ``python -m bench.SUITE`` and tests import
its helpers as a package (``from bench.generation import mii_rest_client``) without editing ``sys.path``; pytest
puts the repo root on the path (``pythonpath`` in pyproject.toml), ``python -m`` from the root does the same."""
