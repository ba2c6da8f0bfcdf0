"""Paged attention for a whole mixed step in one kernel per layer, in Triton: decodes and prefill chunks alike,
each query row attending causally to its own sequence's KV through the block table, in place (no gather, no
padding, no mask). The GPU backend where triton is installed; the torch backend (padded SDPA) stays the
fallback.

Why our own kernel and not a library's: torch's ``varlen_attn`` takes a ``block_table`` from torch 2.13 on and
only on CUDA, FlashInfer and flash-attn are separate CUDA builds that are often absent; triton ships with
torch's CUDA wheels. Its shapes do not change with the KV lengths (tables are [sequences, max blocks]), which
is what a CUDA graph of a decode step needs. The CPU suite checks it through triton's interpreter
(``ZSERVE_TRITON_ATTENTION=interpret`` with ``TRITON_INTERPRET=1``, set before triton is imported).

One program per (query row, head): the row's queries are [D], its keys those of positions 0..pos of its
sequence, read BLOCK_N at a time (slot = table[key // block_size] * block_size + key % block_size), with an
online softmax in fp32. Grouped-query heads share their KV head's loads through the cache.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("zserve.generator.triton_attention")

# auto | off | interpret (tests, on a CPU); read at every step, so a benchmark can switch backends in process
MODE = os.environ.get("ZSERVE_TRITON_ATTENTION", "auto")


@functools.cache
def _kernel():
    """The jitted kernel (``triton_kernels.py``: triton is imported when the first step needs it)."""
    from zserve.generator.triton_kernels import paged_attention

    return paged_attention


def usable(device: torch.device) -> bool:
    """Whether a step on ``device`` attends through this kernel: on CUDA with triton installed (unless
    ``ZSERVE_TRITON_ATTENTION=off``) and where it passed its check; on a CPU only under the interpreter."""
    if MODE == "off" or (device.type != "cuda" and MODE != "interpret"):
        return False
    return _checked(str(device))


@functools.cache
def _checked(device: str) -> bool:
    """Build and check the kernel once per device against attention computed directly (two sequences over
    shuffled blocks, GQA): a kernel that does not build or computes otherwise on this device leaves the engine
    on the torch path, with a warning, instead of failing its steps."""
    try:
        _kernel()
    except ImportError:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        bs, kv_heads, heads, d = 4, 2, 4, 32
        k, v, q = (torch.randn(shape, generator=g).to(device) for shape in ((32, kv_heads, d),) * 2 + ((5, heads, d),))
        tables = [[3, 1, 6], [7, 0]]
        row_seq, row_pos = [0, 0, 0, 1, 1], [9, 10, 11, 2, 6]  # a chunk of 3 after 9 cached, two decodes
        padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32, device=device)
        out = paged_attention(q, k, v, padded, torch.tensor(row_seq, device=device),
                              torch.tensor(row_pos, device=device), bs, d**-0.5)  # fmt: skip
        for r, (s, p) in enumerate(zip(row_seq, row_pos, strict=True)):
            slots = torch.tensor([tables[s][i // bs] * bs + i % bs for i in range(p + 1)], device=device)
            keys = k[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            values = v[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            expected = (torch.softmax(q[r].unsqueeze(1) @ keys.transpose(1, 2) * d**-0.5, -1) @ values)[:, 0]
            if not torch.allclose(out[r], expected, atol=1e-3, rtol=1e-3):
                log.warning("triton paged attention differs from the reference on %s: using torch's", device)
                return False
    except Exception as exc:  # a build failure, an unsupported GPU: the torch path still serves
        log.warning("triton paged attention failed its check on %s (%r): using torch's", device, exc)
        return False
    return True


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor,
    row_pos: torch.Tensor, block_size: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """``q`` [T, heads, D] (head_dim contiguous); ``k_cache``/``v_cache`` one layer's [slots, kv_heads, D];
    ``tables`` [sequences, max blocks], ``row_seq`` [T] each row's sequence, ``row_pos`` [T] its position
    (it attends to keys 0..pos). Returns [T, heads, D], contiguous."""
    T, H, D = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    group = H // k_cache.shape[1]
    _kernel()[(T, H)](
        q, k_cache, v_cache, out, tables, row_seq, row_pos,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        tables.stride(0), scale,
        GROUP=group, D=D, BLOCK_D=max(16, 1 << (D - 1).bit_length()), BLOCK_SIZE=block_size, BLOCK_N=64,
    )  # fmt: skip
    return out
