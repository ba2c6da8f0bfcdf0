"""Linear layers whose weights stay int8 in memory (``native_quant.py``'s kernel): ``quantize(model)`` for
the engine's ``quantization = "int8"`` (every linear layer but the LM head quantised at load, per output
channel, symmetric; the fp32 weight freed), and ``QuantLinear.from_blocks`` for weights that come quantised
(GGUF's Q8_0: 32 int8 and one scale a block), which are packed as they are, never dequantised.

A layer the kernel cannot take (outputs not a whole number of vector panels, inputs not of 32-blocks, or no
C compiler) keeps its int8 weight and runs on torch, dequantised a product at a time: slower, never wrong.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zserve.generator import native_quant

log = logging.getLogger("zserve.engine")

# "auto": a GGUF's quantised tensors kept as they are (Q8_0), everything else as loaded; "none": every weight
# dequantised (fp32/bf16, as before); "int8": a checkpoint's linear layers quantised at load
QUANTIZATIONS = ("auto", "none", "int8")


def check(quantization: str) -> str:
    """``quantization`` if it names one this engine runs, else ValueError naming it."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} must be one of {', '.join(QUANTIZATIONS)}")
    return quantization


class QuantLinear(nn.Module):
    """``nn.Linear``'s forward (inference only) on w = q * s: q int8 [N, K], one fp32 scale per output and
    block of 32 inputs. Holds the kernel's panels where it applies, else q and s as given."""

    def __init__(
        self, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, m: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.isa = native_quant.default_isa()
        self.native = native_quant.applies(self.out_features, self.in_features, self.isa)
        if self.native:
            q, s = native_quant.pack(q, s, self.isa)
            m = None if m is None else native_quant.pack_blocks(m, self.isa)
        # buffers, not parameters: in the module's state and moved with it, never trained
        self.register_buffer("q", q.contiguous(), persistent=False)
        self.register_buffer("s", s.float().contiguous(), persistent=False)
        self.register_buffer("m", None if m is None else m.float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> QuantLinear:
        """``linear`` quantised per output channel, symmetric (``native_quant.quantize_rows``)."""
        q, s = native_quant.quantize_rows(linear.weight)
        return cls(q, s, linear.bias)

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> QuantLinear:
        """Weights already in blocks (q int8 [N, K], s and m [N, K/32]: GGUF's blocks, see ``gguf_quant``)."""
        return cls(q, s, bias, m)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] this layer computes with."""
        if not self.native:
            return native_quant.dequantize(self.q, self.s, self.m)
        panels, k, width = self.q.shape
        q = self.q.transpose(1, 2).reshape(panels * width, k)
        s = self.s.transpose(1, 2).reshape(panels * width, k // native_quant.BLOCK)
        m = None if self.m is None else self.m.transpose(1, 2).reshape(panels * width, k // native_quant.BLOCK)
        return native_quant.dequantize(q, s, m)

    def weight_bytes(self) -> int:
        """What its weights take in memory: int8 values, fp32 scales (and minimums)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.m) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native_quant.linear(x, self.q, self.s, self.bias, self.isa, self.m).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.dequantized().to(x.dtype), bias)

    def extra_repr(self) -> str:
        route = f"native:{self.isa}" if self.native else "torch"
        return f"{self.in_features} -> {self.out_features}, int8, bias={self.bias is not None}, {route}"


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
    """(bytes its ``QuantLinear`` weights take, bytes they would take in fp32)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return sum(m.weight_bytes() for m in layers), sum(4 * m.in_features * m.out_features for m in layers)
