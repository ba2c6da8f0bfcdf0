"""A package, so that conftest.py's package-scoped deployment stops when this folder's tests end."""
