import sys
from pathlib import Path

# tests/support holds the test models; engine subprocesses get it through PYTHONPATH (see fixtures).
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))
sys.path.insert(0, str(SUPPORT.parent))  # tests/cluster.py
