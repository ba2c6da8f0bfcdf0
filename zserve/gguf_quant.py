"""A GGUF file's quantised tensors as the quantised kernel's blocks (``zserve/generator/native_quant.py``),
never dequantised: every type here is, per block of 32 weights along a row, integer values q, a scale s and
(for some) a minimum m, w = q * s + m:

- Q8_0: 32 int8 and an fp16 scale: q, s as they are.
- Q4_0: 32 4-bit values v and an fp16 scale d, w = d (v - 8): q = v, s = d, m = -8 d.
- Q4_1: 4-bit values, fp16 scale d and minimum m, w = d v + m.
- Q4_K: super-blocks of 256 (8 blocks of 32): fp16 d and dmin, 6-bit scale sc and minimum mn per block,
  w = (d sc) v - (dmin mn): s = d sc, m = -dmin mn, as ggml computes them.

The 4-bit types stay 4-bit (``Blocks.bits``): the kernel keeps them two a byte, with fp16 scales and
minimums where those are exact (Q4_0, Q4_1: 0.625 bytes a weight, as the file) and fp32 ones for Q4_K
(0.75; its d * sc is an fp32 product). The embedding and, where the file has one, the output layer are kept
as the file stores them too (SmolLM2's token_embd, its tied LM head, is Q8_0).

The raw blocks are read by ``gguf_load.py`` (which builds the model around them); the scale layouts follow the
``gguf`` package's ``quants.py`` (what its dequantisation, and transformers', compute).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32


@dataclass(frozen=True)
class Blocks:
    """One [N, K] weight: q int8 [N, K] (0..15 where ``bits`` is 4), s fp32 [N, K/32], m fp32 [N, K/32] or
    None."""

    q: torch.Tensor
    s: torch.Tensor
    m: torch.Tensor | None
    bits: int = 8


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values 0-15: low nibbles are the first 16, high the last 16."""
    return np.concatenate([raw & 0x0F, raw >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return b[:, 2:].view(np.int8), _f16(b[:, :2])[:, 0], None


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, :2])[:, 0]
    return _nibbles(b[:, 2:]).astype(np.int8), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:]).astype(np.int8), _f16(b[:, :2])[:, 0], _f16(b[:, 2:4])[:, 0]


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())
    # 4 chunks of 32 bytes: a chunk's low nibbles are its first block of 32, high nibbles the second
    qs = b[:, 16:].reshape(n, 4, 32)
    v = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, BLOCK).astype(np.int8)
    s = (d * sc.astype(np.float32)).reshape(-1)
    m = -(dmin * mn.astype(np.float32)).reshape(-1)
    return v, s, m


# type name -> (bytes a block, weights a block, the block's (q, s, m), bits a value)
_TYPES = {
    "Q8_0": (34, 32, _q8_0, 8),
    "Q4_0": (18, 32, _q4_0, 4),
    "Q4_1": (20, 32, _q4_1, 4),
    "Q4_K": (144, 256, _q4_k, 4),
}
SUPPORTED = tuple(_TYPES)


def blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Blocks:
    """A tensor's raw bytes (``ReaderTensor.data``, [rows, bytes a row]) of ``type_name`` -> ``Blocks``."""
    size, per, decode, bits = _TYPES[type_name]
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)
    q, s, m = decode(flat)
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols))
    s = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32).reshape(rows, cols // BLOCK))
    m = None if m is None else torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32).reshape(rows, cols // BLOCK))
    assert per % BLOCK == 0
    return Blocks(q, s, m, bits)


def unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter's permutation of a Llama q/k projection's rows (for its rotary layout), as
    transformers' GGUF loader does to the weight; rows move whole, so blocks along K move with them."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


# our Llama-family layer's products (zserve/generator/llama.py) and the GGUF tensors stacked into each
PRODUCTS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


def stacked(parts: list[Blocks]) -> Blocks:
    """Parts' rows stacked; where some have minimums and others not, zeros for those; 4-bit where all are
    (a 4-bit part among 8-bit ones is held a value a byte, as its values fit)."""
    with_min = any(p.m is not None for p in parts)
    mins = [p.m if p.m is not None else torch.zeros_like(p.s) for p in parts] if with_min else None
    mins = None if mins is None else torch.cat(mins)
    return Blocks(torch.cat([p.q for p in parts]), torch.cat([p.s for p in parts]), mins, max(p.bits for p in parts))
