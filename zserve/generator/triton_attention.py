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
import os

import torch

# auto | off | interpret (tests, on a CPU); read at every step, so a benchmark can switch backends in process
MODE = os.environ.get("ZSERVE_TRITON_ATTENTION", "auto")


@functools.cache
def _kernel():
    """The jitted kernel (``triton_kernels.py``: triton is imported when the first step needs it)."""
    from zserve.generator.triton_kernels import paged_attention

    return paged_attention


def usable(device: torch.device) -> bool:
    """Whether a step on ``device`` attends through this kernel: on CUDA with triton installed (unless
    ``ZSERVE_TRITON_ATTENTION=off``); on a CPU only under the interpreter, for tests."""
    if MODE == "off" or (device.type != "cuda" and MODE != "interpret"):
        return False
    try:
        _kernel()
    except ImportError:
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
