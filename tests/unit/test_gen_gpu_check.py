"""bench/gpu/gen_check.py, the generative engine's GPU check, in its dry mode on the CPU: every part runs (parity
against generate, the decode step against the bandwidth bound, kernels and syncs per step), so the script cannot
rot before a device runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    """Every leg; the triton ones through triton's interpreter, with ZSERVE_SLOW=1 (minutes: in the short run
    tests/unit/test_triton_attention.py checks the kernel, the engine over it and the graph path)."""
    out = tmp_path / "gen_check.json"
    backends = ["torch"]
    env = dict(os.environ)
    if importlib.util.find_spec("triton") is not None and os.environ.get("ZSERVE_SLOW") == "1":
        backends = ["triton+graphs", "triton", "torch"]
        env |= {"TRITON_INTERPRET": "1", "ZSERVE_TRITON_ATTENTION": "interpret"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gen_check", "--dry", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["attention_backends"] == backends
    models = ("llama-gqa", "qwen2-tied", "qwen3-qknorm")
    assert result["parity"] == {f"{m} ({b})": "8/8" for b in backends for m in models}
    assert [(r["attention"], r["batch"]) for r in result["decode"]] == [(b, n) for b in backends for n in (1, 2)]
    assert result["bandwidth_gbs"] > 0 and all(s["aten_ops_per_step"] > 0 for s in result["per_step"])
