"""bench/gpu/embed_dtype.py, the embedding batch path's GPU check, runs dry on the CPU (a small model), so that it
cannot rot before a device is lent. In CI tests/unit/test_gpu_image_standin.py runs this very command (its
embed_dtype part) over the same packages and checks the same: this test runs where that one cannot (no make),
and with ZSERVE_SLOW=1, where that one runs it over the image's versions instead of these."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    os.environ.get("ZSERVE_SLOW") != "1" and shutil.which("make") is not None,
    reason="run by test_gpu_image_standin.py over the same packages; ZSERVE_SLOW=1 runs it here too",
)
def test_the_embedding_gpu_check_runs_dry_on_the_cpu(tmp_path):
    out = tmp_path / "embed.json"
    command = [sys.executable, "-m", "bench.gpu.embed_dtype", "--device", "cpu", "--small",
               "--batch", "2", "--seq", "8", "--iters", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"] and all(r["path"] == "zserve" for r in rows)
    assert rows[1]["min_cosine_to_fp32"] > 0.99 and all(r["engine_items_s"] > 0 for r in rows)
