"""The bench modules import each other as top-level modules (``python bench/run.py`` puts bench/ first on
sys.path); do the same for their tests: ``.venv/bin/python -m pytest bench/tests``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
