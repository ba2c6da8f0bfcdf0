"""bench/gpu/gen_check.py, the generative engine's GPU check, in its dry mode on the CPU: every part runs (parity
against generate, the decode step against the bandwidth bound, kernels and syncs per step, the bf16 run each leg
is compared on), so the script cannot rot before a device runs it; and every row says what ran."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLOW = importlib.util.find_spec("triton") is not None and os.environ.get("ZSERVE_SLOW") == "1"


@pytest.mark.timeout(1800 if SLOW else 300)
def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    """The torch leg; with ZSERVE_SLOW=1 the triton legs too, through triton's interpreter (minutes: in the short
    run tests/unit/test_triton_attention.py checks the kernel, the engine over it and the graph path)."""
    out = tmp_path / "gen_check.json"
    legs = ["torch"]
    env = dict(os.environ)
    if SLOW:
        legs = ["torch", "triton", "triton+graphs"]
        env |= {"TRITON_INTERPRET": "1", "ZSERVE_TRITON_ATTENTION": "interpret"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gen_check", "--dry", "--legs", ",".join(legs), "--out", str(out)],
        capture_output=True, text=True, timeout=1700 if SLOW else 280, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["legs"] == legs and result["failures"] == [] and result["problems"] == []
    models = ("llama-gqa", "qwen2-tied", "qwen3-qknorm")
    assert result["parity"] == {f"{m} ({leg})": "8/8" for leg in legs for m in models}
    assert [(r["leg"], r["batch"]) for r in result["decode"]] == [(leg, n) for leg in legs for n in (1, 2)]
    for row in result["decode"] + result["per_step"]:  # what ran, per row
        assert row["attention_ran"] == ("torch" if row["leg"] == "torch" else "triton"), row
        assert row["graphs"] == (row["leg"] == "triton+graphs"), row
        assert (row["replays"] > 0 and row["graph_check"]) if row["graphs"] else row["replays"] == 0, row
    assert set(result["bf16"]) == set(legs) - {"torch"}
    assert all(c["greedy_equal"] == "4/4" for c in result["bf16"].values()), result["bf16"]
    assert result["bandwidth_gbs"] > 0 and all(s["aten_ops_per_step"] > 0 for s in result["per_step"])


def test_a_leg_that_raises_is_reported_with_its_traceback(tmp_path):
    """On a CPU without the interpreter the triton leg cannot run: it is a failure with its traceback, written to
    the JSON, and the exit status says so (the legs after it would still run: each has its own try)."""
    out = tmp_path / "gen_check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ZSERVE_TRITON_ATTENTION")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gen_check", "--dry", "--legs", "triton+graphs,triton", "--out", str(out)],
        capture_output=True, text=True, timeout=280, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("RuntimeError: triton attention is not usable") == 2
    result = json.loads(out.read_text())
    assert result["legs"] == ["triton", "triton+graphs"]  # the script's order, whatever was asked
    assert [f["leg"] for f in result["failures"]] == ["triton", "triton+graphs"]
    assert result["problems"] and result["parity"] == {} and result["decode"] == []
