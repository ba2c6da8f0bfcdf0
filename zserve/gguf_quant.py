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

The raw blocks come from the ``gguf`` package's reader (a memory map of the file); the scale layouts follow
its ``quants.py`` (what its dequantisation, and transformers', compute).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("zserve.gguf")

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


def read(path: Path) -> tuple[str, dict[str, tuple[str, np.ndarray, int, int]]]:
    """The file's ``general.architecture`` and every 2-D tensor of it: name -> (type name, raw bytes, rows,
    columns). GGUF lists a tensor's dimensions innermost first: [K, N] for an [N, K] weight."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    architecture = "" if field is None else bytes(field.parts[field.data[0]]).decode()
    out = {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            cols, rows = (int(d) for d in t.shape)
            out[t.name] = (t.tensor_type.name, t.data, rows, cols)
    return architecture, out


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


def keep_quantized(model: torch.nn.Module, gguf_path: Path) -> int:
    """Replace the linear layers of ``model`` (zserve's Llama-family model, loaded from ``gguf_path``
    dequantised) with ``QuantLinear``s of the file's own blocks, where all of a layer's tensors are of a
    ``SUPPORTED`` type; the number replaced. A layer with another type stays as loaded, with a log line
    naming the tensor and its type. The embedding and the LM head are kept too, where the kernel takes
    them (``_keep_embedding``)."""
    from zserve.generator.llama import LlamaFamily
    from zserve.generator.quant_linear import QuantLinear

    if not isinstance(model, LlamaFamily):
        log.warning("quantised GGUF weights are kept for zserve's Llama-family model only: %s is dequantised",
                    type(model).__name__)  # fmt: skip
        return 0
    architecture, tensors = read(gguf_path)
    # llama.cpp's converter permutes q/k rows for "llama" files only (Mistral's included), as transformers'
    # loader undoes for that architecture only: a Qwen2/Qwen3 file's rows are in the checkpoint's own order.
    permuted = architecture == "llama"
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    replaced, kept = 0, {}
    for i, layer in enumerate(model.layers):
        for product, names in PRODUCTS.items():
            parts = []
            for name in names:
                type_name, raw, rows, cols = tensors[f"blk.{i}.{name}.weight"]
                if type_name not in SUPPORTED or cols % BLOCK:
                    log.info("blk.%d.%s.weight is %s: dequantised (the int8 kernel takes %s)", i, name, type_name,
                             ", ".join(SUPPORTED))  # fmt: skip
                    break
                b = blocks(raw, type_name, rows, cols)
                if permuted and name in ("attn_q", "attn_k"):
                    h = heads if name == "attn_q" else kv_heads
                    b = Blocks(*(None if t is None else unpermute_rows(t, h) for t in (b.q, b.s, b.m)), b.bits)
                parts.append(b)
                kept[type_name] = kept.get(type_name, 0) + 1
            else:
                old = getattr(layer, product)
                b = stacked(parts)
                if tuple(b.q.shape) != (old.out_features, old.in_features):
                    raise ValueError(f"GGUF layer {i} {product}: {tuple(b.q.shape)} where the model has "
                                     f"{(old.out_features, old.in_features)}")  # fmt: skip
                setattr(layer, product, QuantLinear.from_blocks(b.q, b.s, b.m, old.bias, b.bits))
                replaced += 1
    replaced += _keep_embedding(model, tensors, kept)
    log.info("kept %d layers of %s quantised (%s)", replaced, gguf_path.name,
             ", ".join(f"{n} {t}" for t, n in sorted(kept.items())))  # fmt: skip
    return replaced


def _keep_embedding(model: torch.nn.Module, tensors: dict, kept: dict[str, int]) -> int:
    """The embedding (``token_embd``) and the LM head (``output``, or the embedding where the file ties
    them: one weight for both, as the file stores it) replaced by the file's blocks where their type is
    ``SUPPORTED`` and the kernel takes the head's shape; the number replaced (0-2). The embedding's lookup
    dequantises the rows it reads."""
    from zserve.generator import native_quant
    from zserve.generator.quant_linear import QuantEmbedding, QuantLinear

    vocab, hidden = model.lm_head.out_features, model.lm_head.in_features
    layers = {}
    for name in ("token_embd", "output"):
        if f"{name}.weight" not in tensors:
            continue
        type_name, raw, rows, cols = tensors[f"{name}.weight"]
        if type_name not in SUPPORTED or (rows, cols) != (vocab, hidden) or not native_quant.applies(rows, cols):
            log.info("%s.weight is %s [%d, %d]: dequantised", name, type_name, rows, cols)
            continue
        b = blocks(raw, type_name, rows, cols)
        layers[name] = QuantLinear.from_blocks(b.q, b.s, b.m, None, b.bits)
        kept[type_name] = kept.get(type_name, 0) + 1
    replaced = 0
    if "token_embd" in layers:
        model.embed = QuantEmbedding(layers["token_embd"])
        replaced += 1
    head = layers.get("output", layers.get("token_embd") if "output.weight" not in tensors else None)
    if head is not None and model.lm_head.bias is None:
        model.lm_head = head
        replaced += 1
    return replaced
