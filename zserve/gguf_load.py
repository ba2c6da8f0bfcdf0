"""A GGUF file straight into zserve's Llama-family model with its quantised blocks kept (``quantization`` "auto" on
a CPU), never an fp32 copy of it: the model is built from the config on the meta device (no memory), every linear
layer whose tensors are of a type the kernels take becomes a ``QuantLinear`` of the file's blocks, and only the
rest is read as real tensors: norms, biases, F32/F16 tensors and any tensor of another type (dequantised, with a
log line naming it and its type). The rotary frequencies are computed on the CPU, as transformers does.

The weights are what transformers' GGUF loader makes of the file, with the blocks put in after (the former path:
``gguf_cache._convert``, then ``keep_quantized``, kept as tests/support/gguf_reference.py), bit for bit: the same
dequantisation (the ``gguf`` package's), the same q/k row order (``unpermute_rows``, "llama" files only), the
same products stacked; so the engine's output is the same too.

Tensors are read with plain reads, a tensor (or a slice of the embedding's rows) at a time, not through the
reader's memory map, whose pages count in the process's RSS for as long as it is mapped.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from zserve.gguf_quant import BLOCK, PRODUCTS, SUPPORTED, Blocks, blocks, stacked, unpermute_rows

log = logging.getLogger("zserve.gguf")

# the embedding's rows decoded this many at a time (its int8 values, SmolLM2's 49152 x 576 or a 128k x 2048
# one, are held once; the decode's own temporaries only for a slice)
ROWS_A_SLICE = 8192


@dataclass(frozen=True)
class _Entry:
    type_name: str
    offset: int  # from the file's start
    nbytes: int
    shape: tuple[int, ...]  # torch's order: [rows, columns] for a weight


class GGUFTensors:
    """A GGUF file's tensors by name (``blk.0.attn_q.weight``), read on demand."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        self.architecture = "" if field is None else bytes(field.parts[field.data[0]]).decode()
        self.path = path
        self.entries = {
            t.name: _Entry(t.tensor_type.name, int(t.data_offset), int(t.n_bytes), tuple(int(d) for d in t.shape[::-1]))
            for t in reader.tensors
        }
        del reader  # its memory map of the whole file goes with it

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def type_name(self, name: str) -> str:
        return self.entries[name].type_name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def _read(self, entry: _Entry, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        nbytes = entry.nbytes - start if nbytes is None else nbytes
        out = np.empty(nbytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(entry.offset + start)
            if f.readinto(memoryview(out)) != nbytes:
                raise ValueError(f"{self.path}: a tensor's bytes run past the end of the file")
        return out

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor as the ``gguf`` package dequantises it (transformers' loader too), in ``dtype``."""
        from gguf import GGMLQuantizationType, quants

        entry = self.entries[name]
        raw = self._read(entry)
        if len(entry.shape) > 1:
            raw = raw.reshape(entry.shape[0], -1)
        values = quants.dequantize(raw, GGMLQuantizationType[entry.type_name])
        return torch.from_numpy(np.ascontiguousarray(values).reshape(entry.shape)).to(dtype)

    def blocks(self, name: str) -> Blocks:
        """A weight of a ``SUPPORTED`` type as ``gguf_quant.Blocks``, decoded ``ROWS_A_SLICE`` rows at a time."""
        entry = self.entries[name]
        rows, cols = entry.shape
        row_bytes = entry.nbytes // rows
        parts = []
        for first in range(0, rows, ROWS_A_SLICE):
            n = min(ROWS_A_SLICE, rows - first)
            parts.append(blocks(self._read(entry, first * row_bytes, n * row_bytes), entry.type_name, n, cols))
        if len(parts) == 1:
            return parts[0]
        q, s = torch.cat([b.q for b in parts]), torch.cat([b.s for b in parts])
        m = None if parts[0].m is None else torch.cat([b.m for b in parts])
        return Blocks(q, s, m, parts[0].bits)


def load(folder: str, gguf_file: str, dtype: str, model_impl: str) -> tuple[nn.Module | None, Path]:
    """(our model of ``folder/gguf_file`` with its blocks kept, the folder of its config and tokenizer); or (None,
    the converted checkpoint's folder) where our model code does not run the file (``model_impl``
    "transformers", or a model type we have no code for): that one is loaded dequantised, as before."""
    from transformers import AutoConfig, GenerationConfig

    from zserve.generator.llama import unsupported
    from zserve.gguf_cache import config_path, converted_path, resolve_model_path

    meta = config_path(folder, gguf_file)
    config = AutoConfig.from_pretrained(meta)
    reason = "model_impl is transformers" if model_impl == "transformers" else unsupported(config)
    if reason:
        log.warning("quantised GGUF weights are kept for zserve's Llama-family model only (%s): %s is dequantised",
                    reason, gguf_file)  # fmt: skip
        return None, converted_path(folder, gguf_file, dtype)
    source = Path(resolve_model_path(folder)) / gguf_file
    model = load_model(source, config, GenerationConfig.from_pretrained(meta), getattr(torch, dtype))
    return model, meta


def load_model(gguf_path: Path, config: Any, generation_config: Any, dtype: torch.dtype) -> nn.Module:
    """zserve's Llama-family model of ``config`` (read from the file's metadata, ``gguf_cache.config_path``) with
    the weights of ``gguf_path``: the file's blocks where the kernels take them. ValueError where a tensor the
    model needs is missing or of another shape."""
    from transformers import AutoModelForCausalLM

    from zserve.generator.llama import LlamaFamily

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.generation_config = generation_config
    # on the CPU: the only tensor the config alone gives (a buffer, not in the file)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    model = LlamaFamily.from_hf(hf)
    del hf
    tensors = GGUFTensors(gguf_path)
    kept: Counter[str] = Counter()
    replaced = _fill_embedding(model, tensors, dtype, kept)
    _give_back_freed()
    for i, layer in enumerate(model.layers):
        replaced += _fill_layer(model.config, i, layer, tensors, dtype, kept)
        _give_back_freed()  # a layer's at a time, so the peak is what is held and one layer's temporaries
    model.norm = nn.Parameter(tensors.dense("output_norm.weight", dtype), requires_grad=False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{gguf_path.name}: no tensor in the file for {', '.join(left)}")
    log.info("kept %d layers of %s quantised (%s), built without an fp32 copy", replaced, gguf_path.name,
             ", ".join(f"{n} {t}" for t, n in sorted(kept.items())))  # fmt: skip
    return model.eval()


def _give_back_freed() -> None:
    """Hand the decoding's freed temporaries back to the system: glibc keeps what freed blocks of its heap held
    (a ~1B model's load left ~100 MiB of RSS so: 1568 -> 1471 MiB after load); a no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _fill_layer(config: Any, i: int, layer: nn.Module, tensors: GGUFTensors, dtype: torch.dtype, kept: Counter) -> int:
    """Layer ``i``'s products, norms and biases from the file; the number of products kept quantised."""
    from zserve.generator.llama import _linear
    from zserve.generator.quant_linear import QuantLinear

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    # llama.cpp's converter permutes q/k rows for "llama" files only (Mistral's included), as transformers'
    # loader undoes for that architecture only (biases too): a Qwen2/Qwen3 file's rows are in the checkpoint's order
    permuted = tensors.architecture == "llama"

    def rows_of(name: str, x: torch.Tensor) -> torch.Tensor:
        if permuted and name in ("attn_q", "attn_k"):
            return unpermute_rows(x, heads if name == "attn_q" else kv_heads)
        return x

    replaced = 0
    for product, names in PRODUCTS.items():
        old = getattr(layer, product)
        bias = None
        if old.bias is not None:
            bias = torch.cat([rows_of(n, tensors.dense(f"blk.{i}.{n}.bias", dtype)) for n in names])
        weights = [f"blk.{i}.{n}.weight" for n in names]
        unkept = [w for w in weights if tensors.type_name(w) not in SUPPORTED or tensors.shape(w)[1] % BLOCK]
        for w in unkept:
            log.info("%s is %s: dequantised (the int8 kernel takes %s)", w, tensors.type_name(w), ", ".join(SUPPORTED))
        if unkept:
            dense = [rows_of(n, tensors.dense(w, dtype)) for n, w in zip(names, weights, strict=True)]
            new = _linear(torch.cat(dense), bias)
        else:
            parts = []
            for n, w in zip(names, weights, strict=True):
                b = tensors.blocks(w)
                parts.append(Blocks(*(None if t is None else rows_of(n, t) for t in (b.q, b.s, b.m)), b.bits))
                kept[tensors.type_name(w)] += 1
            b = stacked(parts)
            new = QuantLinear.from_blocks(b.q, b.s, b.m, bias, b.bits)
            replaced += 1
        if (new.out_features, new.in_features) != (old.out_features, old.in_features):
            raise ValueError(f"GGUF layer {i} {product}: {(new.out_features, new.in_features)} where the model has "
                             f"{(old.out_features, old.in_features)}")  # fmt: skip
        setattr(layer, product, new)
    layer.input_norm = nn.Parameter(tensors.dense(f"blk.{i}.attn_norm.weight", dtype), requires_grad=False)
    layer.post_norm = nn.Parameter(tensors.dense(f"blk.{i}.ffn_norm.weight", dtype), requires_grad=False)
    if layer.qk_norm is not None:  # Qwen3: one weight per head of q, then of k (as from_hf merges them)
        q, k = (tensors.dense(f"blk.{i}.{n}.weight", dtype) for n in ("attn_q_norm", "attn_k_norm"))
        w = torch.cat([q.expand(layer.heads, -1), k.expand(layer.kv_heads, -1)]).contiguous()
        layer.qk_norm = nn.Parameter(w, requires_grad=False)
    return replaced


def _fill_embedding(model: nn.Module, tensors: GGUFTensors, dtype: torch.dtype, kept: Counter) -> int:
    """The embedding (``token_embd``) and the LM head (``output``, or the embedding where the file ties them):
    the file's blocks where their type is ``SUPPORTED`` and the kernel takes the head's shape (one
    ``QuantLinear`` for both where tied), else dequantised; the number kept quantised (0-2)."""
    from zserve.generator import native_quant
    from zserve.generator.quant_linear import QuantEmbedding, QuantLinear

    vocab, hidden = model.lm_head.out_features, model.lm_head.in_features
    quantised: dict[str, QuantLinear] = {}
    for name in ("token_embd", "output"):
        weight = f"{name}.weight"
        if weight not in tensors:
            continue
        type_name, shape = tensors.type_name(weight), tensors.shape(weight)
        if type_name not in SUPPORTED or shape != (vocab, hidden) or not native_quant.applies(vocab, hidden):
            log.info("%s is %s %s: dequantised", weight, type_name, list(shape))
            continue
        b = tensors.blocks(weight)
        quantised[name] = QuantLinear.from_blocks(b.q, b.s, b.m, None, b.bits)
        del b
        kept[type_name] += 1
    replaced = 0
    if "token_embd" in quantised:
        model.embed = QuantEmbedding(quantised["token_embd"])
        replaced += 1
    else:
        model.embed = nn.Embedding(vocab, hidden, device="meta")
        model.embed.weight = nn.Parameter(tensors.dense("token_embd.weight", dtype), requires_grad=False)
    tied = "output.weight" not in tensors
    head = quantised.get("token_embd" if tied else "output")
    if head is not None:
        model.lm_head = head
        replaced += 1
    elif tied:
        model.lm_head.weight = model.embed.weight  # one Parameter for both, as from_pretrained ties them
    else:
        model.lm_head.weight = nn.Parameter(tensors.dense("output.weight", dtype), requires_grad=False)
    return replaced
