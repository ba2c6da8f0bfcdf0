"""Linear layers whose weights stay quantised in memory (``native_quant.py``'s kernel): ``quantize(model)``
for the engine's ``quantization = "int8"`` (every linear layer but the LM head quantised at load, per output
channel, symmetric; the fp32 weight freed), and ``QuantLinear.from_blocks`` for weights that come quantised
(GGUF's blocks: 8-bit values, or 4-bit ones kept two a byte), which are packed as they are, never
dequantised; ``QuantEmbedding`` reads an embedding's rows out of such a weight.

A layer the kernel cannot take (outputs not a whole number of vector panels, inputs not of 32-blocks, or no
C compiler) keeps its values one a byte and runs on torch, dequantised a product at a time: slower, never
wrong.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zserve.generator import kernel_choice, kernel_tune, native_quant, native_quant_i8

log = logging.getLogger("zserve.engine")

# "auto": a GGUF's quantised tensors kept as they are (Q8_0, Q4_0, Q4_1, Q4_K), everything else as loaded;
# "none": every weight dequantised (fp32/bf16, as before); "int8": a checkpoint's linear layers quantised at load
QUANTIZATIONS = ("auto", "none", "int8")


def check(quantization: str) -> str:
    """``quantization`` if it names one this engine runs, else ValueError naming it."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} must be one of {', '.join(QUANTIZATIONS)}")
    return quantization


class QuantLinear(nn.Module):
    """``nn.Linear``'s forward (inference only) on w = q * s (+ m): q integers [N, K] (int8, or 0..15 where
    ``bits`` is 4), one scale (and minimum) per output and block of 32 inputs. Holds the kernel's panels
    (``native_quant.Packed``) where it applies, else q, s and m as given."""

    def __init__(
        self, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, m: torch.Tensor | None = None,
        bits: int = 8,
    ) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits = bits
        self.isa = native_quant.default_isa()
        self.native = native_quant.applies(self.out_features, self.in_features, self.isa)
        # the kernel's view of the buffers below (CPU only: a QuantLinear is never moved), or None on torch
        self.packed: native_quant.Packed | None = None
        self.fmt = ""  # the kernel's format (native_quant.FORMATS) where it runs
        # its activations where the kernel runs: fp32 (native_quant) or int8 (native_quant_i8: two terms, or one
        # where forced to int8x1), measured per shape; on int8's layout, calls of ``many_rows`` rows or more run
        # fp32 activations (measured: AVX2's integer products lose to FMAs at many rows)
        self.activations = ""
        self.many_rows = kernel_choice.NEVER
        if self.native:
            self.activations = kernel_choice.FP32
            if native_quant_i8.applies(q, self.out_features, self.in_features, self.isa):
                minimums = m is not None or bits == 4
                half = native_quant._exact_half(s) and (m is None or native_quant._exact_half(m))
                self.activations, self.many_rows = kernel_tune.quant_choice(
                    self.out_features, self.in_features, bits, minimums, half, self.isa
                )
            if self.activations == kernel_choice.FP32:
                self.packed = native_quant.pack(q, s, m, self.isa, bits)
            else:
                terms = 1 if self.activations == kernel_choice.INT8_ONE else 2
                self.packed = native_quant_i8.pack(q, s, m, self.isa, bits, terms, self.many_rows)
            self.fmt, q, s, m = self.packed.fmt, self.packed.q, self.packed.s, self.packed.m
        else:
            s, m = s.float(), None if m is None else m.float()
        # buffers, not parameters: in the module's state and moved with it, never trained
        self.register_buffer("q", q.contiguous(), persistent=False)
        self.register_buffer("s", s.contiguous(), persistent=False)
        self.register_buffer("m", None if m is None else m.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> QuantLinear:
        """``linear`` quantised per output channel, symmetric (``native_quant.quantize_rows``)."""
        q, s = native_quant.quantize_rows(linear.weight)
        return cls(q, s, linear.bias)

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None, bias: torch.Tensor | None = None,
        bits: int = 8,
    ) -> QuantLinear:  # fmt: skip
        """Weights already in blocks (q [N, K], s and m [N, K/32]: GGUF's blocks, see ``gguf_quant``)."""
        return cls(q, s, bias, m, bits)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] this layer computes with."""
        if self.packed is not None:
            return self.packed.dequantized()
        return native_quant.dequantize(self.q, self.s, self.m)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantised weight [len(ids), K] fp32: an embedding that shares this weight."""
        if self.packed is not None:
            return self.packed.rows(ids)
        return native_quant.dequantize(self.q[ids], self.s[ids], None if self.m is None else self.m[ids])

    def weight_bytes(self) -> int:
        """What its weights take in memory: the values, the scales (and minimums)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.m) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            kernel = native_quant if self.activations == kernel_choice.FP32 else native_quant_i8
            y = kernel.linear(x, self.packed, self.bias)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.dequantized().to(x.dtype), bias)

    def extra_repr(self) -> str:
        split = f" (fp32 from {self.many_rows} rows)" if self.many_rows != kernel_choice.NEVER else ""
        route = f"native:{self.isa}, {self.activations} activations{split}" if self.native else "torch"
        form = self.fmt or f"int{self.bits}"
        return f"{self.in_features} -> {self.out_features}, {form}, bias={self.bias is not None}, {route}"


class QuantEmbedding(nn.Module):
    """An embedding whose table is a ``QuantLinear``'s weight (GGUF's token_embd as the file stores it; the
    same object as the LM head where the two are tied): a lookup dequantises the rows it reads."""

    def __init__(self, table: QuantLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        # what the model reads its device and dtype from (an nn.Embedding's weight); holds nothing
        self.register_buffer("weight", torch.empty(0, dtype=torch.float32, device=table.q.device), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)


def quantize(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` of ``model`` but those named in ``skip`` (the LM head, which may share the
    embedding's weight) with a ``QuantLinear``; the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in skip:
                setattr(parent, name, QuantLinear.from_linear(child))
                replaced += 1
    log.info("quantised %d linear layers to int8 (per output channel)", replaced)
    return replaced


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes its ``QuantLinear`` weights take, bytes they would take in fp32); a weight shared by the LM head
    and the embedding counted once."""
    layers = list({id(m): m for m in model.modules() if isinstance(m, QuantLinear)}.values())
    return sum(m.weight_bytes() for m in layers), sum(4 * m.in_features * m.out_features for m in layers)
