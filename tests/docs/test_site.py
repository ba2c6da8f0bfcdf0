"""The documentation site builds with mkdocs in strict mode: a broken link or anchor, or a page left out of the
nav, fails here (mkdocs.yml's `validation` turns each into a warning, and --strict makes warnings errors)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about its successor
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-6000:]}"
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "configuration" / "index.html").exists()
