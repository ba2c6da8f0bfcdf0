"""The C decode-attention kernel (``native.py``): the same attention as SDPA over each sequence's gathered KV,
for any head size and grouping, lengths on and off block boundaries, and strided queries/outputs as the
model's attention layers hand them over."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from zserve.generator import c_build, native


@pytest.fixture(autouse=True, params=c_build.runnable())
def isa(request, monkeypatch):
    """Every test on every instruction set this CPU runs (AVX2 built with -march=haswell on an AVX-512 CPU;
    the portable 4-float build everywhere): each has its own vector width, so its own kernel."""
    monkeypatch.setenv("ZSERVE_CPU_ISA", request.param)
    native._library.cache_clear()
    yield request.param
    native._library.cache_clear()


def reference(q, kc, vc, tables, lengths, block_size, scale):
    out = torch.empty_like(q)
    kb, vb = kc.view(-1, block_size, *kc.shape[1:]), vc.view(-1, block_size, *vc.shape[1:])
    for b, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        k = kb.index_select(0, table).flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        v = vb.index_select(0, table).flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        out[b] = F.scaled_dot_product_attention(q[b : b + 1].unsqueeze(2), k, v, scale=scale, enable_gqa=True)[0, :, 0]
    return out


@pytest.fixture
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 80)])
@pytest.mark.parametrize("threads", [1, 3], indirect=True, ids=["1-thread", "rows-split-3-ways"])
@pytest.mark.parametrize("block_size", [8, 16, 48])  # under, at and over the kernel's 4-16 tokens at a time
def test_the_kernel_attends_like_sdpa_over_the_gathered_kv(heads, kv_heads, head_dim, threads, block_size):
    if not c_build.has_compiler():
        pytest.skip("no C compiler here: the engine runs the torch path")
    kernel = native.decode_kernel(torch.zeros(1, kv_heads, head_dim))
    assert kernel is not None, "a compiler is here, yet the kernel did not build (see the warning logged)"
    rng = random.Random(head_dim)
    num_blocks = 2400 // block_size
    torch.manual_seed(heads)
    kc = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    vc = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    lengths = [1, 8, 9, 16, 17, 33, 48, rng.randrange(2, 400), rng.randrange(2, 400)]
    perm = torch.randperm(num_blocks).to(torch.int32)
    tables, used = [], 0
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(perm[used : used + blocks])
        used += blocks
    # queries as the model hands them: [1, heads, T, head_dim], a transposed view of [1, T, heads, head_dim]
    q = torch.randn(1, len(lengths), heads, head_dim).transpose(1, 2)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    kernel(
        q[0].transpose(0, 1), kc, vc, torch.nn.utils.rnn.pad_sequence(tables, batch_first=True),
        torch.tensor(lengths, dtype=torch.int32), block_size, scale, out[0].transpose(0, 1),
    )  # fmt: skip
    want = reference(q[0].transpose(0, 1), kc, vc, tables, lengths, block_size, scale)
    torch.testing.assert_close(out[0].transpose(0, 1), want, rtol=1e-5, atol=1e-5)


def test_the_kernel_does_not_apply_off_fp32_cpu_caches():
    assert native.decode_kernel(torch.zeros(4, 2, 16, dtype=torch.bfloat16)) is None
    assert native.decode_kernel(torch.zeros(4, 2, 32)[:, :, ::2]) is None  # not contiguous
    assert native.decode_kernel(torch.zeros(4, 2, 24)) is None  # its vectors are 16 floats of a head


def test_without_a_compiler_the_kernel_is_none_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    native._library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="zserve.engine"):
            assert native.decode_kernel(torch.zeros(4, 2, 16)) is None
        assert "no C compiler" in caplog.text
    finally:
        native._library.cache_clear()
