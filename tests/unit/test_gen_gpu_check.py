"""bench/gpu/gen_check.py, the generative engine's GPU check, in its dry mode on the CPU: every part runs (parity
against generate, the decode step against the bandwidth bound, kernels and syncs per step), so the script cannot
rot before a device runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    out = tmp_path / "gen_check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gen_check", "--dry", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["parity"] == {"llama-gqa": "8/8", "qwen2-tied": "8/8", "qwen3-qknorm": "8/8"}
    assert [r["batch"] for r in result["decode"]] == [1, 2] and result["bandwidth_gbs"] > 0
    assert result["per_step"][0]["aten_ops_per_step"] > 0
