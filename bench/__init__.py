"""The benchmarks, a package at the repo root so that tests import its helpers (``from bench import ...``) without
editing ``sys.path``; pytest puts the repo root on the path (``pythonpath`` in pyproject.toml)."""
