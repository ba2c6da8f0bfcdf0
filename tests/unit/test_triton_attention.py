"""The Triton paged attention kernel (zserve/generator/triton_attention.py), the GPU backend, checked on a CPU
through triton's interpreter: against softmax attention computed directly, and inside the engine core, where
greedy output equals Hugging Face ``generate`` with chunked prefill, prefix caching and preemption, also with
decode steps run the CUDA-graph way (zserve/generator/cuda_graphs.py: static buffers, batch buckets, padding
rows on the scratch block; on a CPU each replay is the eager forward over those buffers).

The interpreter must be chosen before triton is imported, so the checks run in a child interpreter (this
file run as a script) with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import copy
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.timeout(900)  # interpreted, every program runs in Python: ~30 s on 2 shared cores, ~40 s in full
def test_the_kernel_and_the_engine_through_it_under_triton_s_interpreter():
    env = os.environ | {"TRITON_INTERPRET": "1", "ZSERVE_TRITON_ATTENTION": "interpret"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "kernel ok" in done.stdout and "engine ok" in done.stdout and "fallbacks ok" in done.stdout


def test_a_kernel_that_fails_its_check_leaves_the_engine_on_the_torch_path(monkeypatch, caplog):
    from zserve.generator import triton_attention

    monkeypatch.setattr(triton_attention, "MODE", "interpret")  # the check runs on a CPU device here
    wrong = [lambda q, *args: torch.zeros_like(q), lambda *args: (_ for _ in ()).throw(RuntimeError("no PTX"))]
    for kernel, says in zip(wrong, ["differs from the reference", "failed its check"], strict=True):
        triton_attention._checked.cache_clear()
        triton_attention._verdict.clear()
        monkeypatch.setattr(triton_attention, "paged_attention", kernel)
        with caplog.at_level(logging.WARNING, logger="zserve.generator.triton_attention"):
            assert not triton_attention.usable(torch.device("cpu"))
        assert says in caplog.text
    triton_attention._checked.cache_clear()
    triton_attention._verdict.clear()


def _check_kernel() -> None:
    """Every launch the engine makes: decode rows split over the keys (``SPLITS``, as a small grid has them, and 3,
    which leaves the short rows' last ranges empty) and not, prefill rows one by one and in tiles (a chunk of
    more than one tile), in fp32 and bf16."""
    from zserve.generator import triton_attention

    torch.manual_seed(0)
    bs, kv_heads, heads, d, n_blocks = 4, 2, 6, 24, 60  # GQA of 3, a head_dim that is not a power of two
    k, v = torch.randn(n_blocks * bs, kv_heads, d), torch.randn(n_blocks * bs, kv_heads, d)
    # three decodes (one of 70 keys: two splits' worth), a later chunk of 5, a whole prompt of 6, a chunk of 21
    lengths, rows = [7, 70, 1, 9, 6, 25], [1, 1, 1, 5, 6, 21]
    perm, at, tables = torch.randperm(n_blocks), 0, []
    for n in lengths:
        tables.append(perm[at : at + -(-n // bs)].to(torch.int32))
        at += len(tables[-1])
    row_seq = [s for s, n in enumerate(rows) for _ in range(n)]
    row_pos = [lengths[s] - rows[s] + i for s, n in enumerate(rows) for i in range(n)]
    q = torch.randn(len(row_seq), heads * 2, d)[:, ::2]  # strided heads, as a view of a qkv product is
    query_start = [sum(rows[:i]) for i in range(len(rows) + 1)]
    tiles = triton_attention.prefill_tiles(query_start, 3)
    assert tiles.tolist() == [[3, 5], [8, 6], [14, 16], [30, 5]]
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    expected = triton_attention.reference(q, k, v, tables, row_seq, row_pos, bs, d**-0.5)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for splits, decode_rows, tiled in ((None, None, None), (None, 3, tiles), (1, 3, tiles), (3, 3, tiles)):
            out = triton_attention.paged_attention(
                q.to(dtype), k.to(dtype), v.to(dtype), padded, torch.tensor(row_seq, dtype=torch.int32),
                torch.tensor(row_pos), bs, d**-0.5, decode_rows, tiled, splits,
            )  # fmt: skip
            err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            assert err < tolerance, (dtype, splits, decode_rows, err)
    print("kernel ok")


def _check_engine() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_own_model import run, tiny
    from test_step_core import expected

    from zserve.generator.llama import own_model
    from zserve.generator.step_core import StepCore

    # the kernel sees only q, k and v, whatever the family: Qwen3 (its q/k norms before the kernel) in full runs only
    cases = [("llama-gqa-untied", False), ("llama-gqa-untied", True)]
    if os.environ.get("ZSERVE_SLOW") == "1":
        cases.insert(1, ("qwen3-gqa", False))
    for family, graphs in cases:
        reference = tiny(family)
        model = own_model(copy.deepcopy(reference), "zserve")
        # graphs: 7 sequences at once, so that decode steps of 7 replay bucket 8 with a padding row
        num_blocks, k, every = (40, 7, 0) if graphs else (12, 4, 2)
        engine = StepCore(model, num_blocks=num_blocks, block_size=4, max_batched_tokens=24, max_running=8,
                          cuda_graphs=graphs)  # fmt: skip
        rng = random.Random(3)
        shared = [rng.randrange(1, 256) for _ in range(9)]
        batch = [shared + [rng.randrange(1, 256) for _ in range(rng.randrange(2, 14))] for _ in range(k)]
        produced = run(engine, batch, 6, every)
        for i, prompt in enumerate(batch):
            assert produced[i] == expected(reference, prompt, 6), (family, graphs, i)
        assert engine.stats.cached_tokens > 0, (family, engine.stats)
        if graphs:
            assert engine.graphs is not None and engine.graphs.verified and engine.graphs.replays >= 4
            assert engine.cache.k[0].shape[0] == (num_blocks + 1) * 4  # the scratch block
        else:
            assert engine.scheduler.preemptions > 0, (family, engine.stats)
    print("engine ok")


def _check_graph_fallbacks() -> None:
    """A replay that computes otherwise is caught by the first graphed step's check, a capture that raises
    leaves the engine eager: either way the output is still generate's."""
    from test_own_model import run, tiny
    from test_step_core import expected

    from zserve.generator import step_core
    from zserve.generator.llama import own_model
    from zserve.generator.step_core import StepCore

    def failing_capture(*args, **kwargs):
        raise RuntimeError("capture failed")

    reference = tiny("llama-gqa-untied")
    rng = random.Random(4)
    batch = [[rng.randrange(1, 256) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    for broken in ("replay", "capture"):
        original = step_core.DecodeGraphs
        if broken == "capture":
            step_core.DecodeGraphs = failing_capture
        try:
            engine = StepCore(own_model(copy.deepcopy(reference), "zserve"), num_blocks=40, block_size=4,
                              max_batched_tokens=24, max_running=4, cuda_graphs=True)  # fmt: skip
        finally:
            step_core.DecodeGraphs = original
        graphs = engine.graphs
        if broken == "replay":
            graphs._replays = {b: ((lambda out=out: out.zero_()), out) for b, (_, out) in graphs._replays.items()}
        produced = run(engine, batch, 4, 0)
        assert engine.graphs is None and (broken == "capture" or graphs.verified), broken
        assert all(produced[i] == expected(reference, p, 4) for i, p in enumerate(batch)), broken
    print("fallbacks ok")


if __name__ == "__main__":
    from zserve.generator import triton_attention

    # the interpreter runs every program in Python: the engine's steps split their decodes in 4, not 16
    triton_attention.SPLITS = 4

    assert triton_attention.usable(torch.device("cpu")), "the interpreter mode is not on"
    _check_kernel()  # splits of 1, 3 and SPLITS (4)
    if os.environ.get("ZSERVE_SLOW") != "1":
        # CI's short run: the engine's decodes split in 2 (still split and combined), half the programs to
        # interpret (each costs the interpreter's set-up whatever its range): about half this check's time
        triton_attention.SPLITS = 2
    _check_engine()
    _check_graph_fallbacks()
