"""The former load of a GGUF with its blocks kept (before ``zserve/gguf_load.py``): transformers' fp32 conversion
(``gguf_cache.converted_path``), our model on it (``own_model``), then its linear layers, embedding and LM head
replaced by the file's blocks. Kept here as the reference ``gguf_load`` must equal, bit for bit."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from zserve.gguf_quant import BLOCK, PRODUCTS, SUPPORTED, Blocks, blocks, stacked, unpermute_rows

log = logging.getLogger("zserve.gguf")


def former_model(folder: str, gguf_file: str) -> torch.nn.Module:
    """Our model of ``folder/gguf_file`` as the engine loaded it with ``quantization`` "auto" before."""
    from transformers import AutoModelForCausalLM

    from zserve.generator.llama import own_model
    from zserve.gguf_cache import converted_path, resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(converted_path(folder, gguf_file), dtype=torch.float32)
    model = own_model(hf, "zserve")
    keep_quantized(model, Path(resolve_model_path(folder)) / gguf_file)
    return model


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
