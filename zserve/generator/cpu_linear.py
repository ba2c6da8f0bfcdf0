"""Linear layers with weights packed once at load, for the engine's model on a CPU: for our C kernel
(``native_linear.py``) where it applies (fp32), else for oneDNN (bf16, and a layer whose outputs are not a
multiple of 16).

``torch.nn.functional.linear`` on a CPU hands fp32 products to MKL with the weight in its plain row-major
layout, which for the few rows of a decode step (4-64) runs far from the memory bandwidth: measured here on
SmolLM2-135M's 211 products per step (1 thread), 8 rows take 2.1x as long as 1 row although both read the
same 540 MB. oneDNN with the weight reordered once into its blocked layout (what vLLM's CPU build does for
every dense layer) takes 0.65x the time at 8 rows, 0.93x at 32, 0.89x at 256 and 1.06x at 1
(``bench/studies/linear.py``). The reordered weight is an opaque tensor, so each layer keeps it beside its bias
and the plain weight is dropped, except where it is shared (a tied ``lm_head`` keeps the embedding).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from zserve.generator import native_linear

_PACK_ROWS_HINT = 8  # the rows oneDNN picks its layout for; packing for each row count instead measured the same


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a packed copy of its weight (inference only): ``native_linear``'s panels
    where ``native`` and the kernel applies, else oneDNN's reordered layout."""

    def __init__(self, linear: nn.Linear, native: bool = True) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.native = native and native_linear.applies(weight)
        if self.native:
            self.packed = native_linear.pack(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native_linear.linear(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        kernel = "native" if self.native else "onednn"
        return f"{self.in_features} -> {self.out_features}, bias={self.bias is not None}, {kernel}"


def available(model: nn.Module) -> bool:
    """oneDNN is built in and the model's weights are on the CPU in a dtype this CPU can pack."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and packs(weight.dtype)


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders weights of ``dtype`` on this CPU.

    bf16 needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT: on a CPU without them the reorder raises, so a bf16
    model there keeps ``nn.Linear``. Asked of oneDNN itself with a small weight, not from CPU flags, so the
    answer is the one the reorder gives.
    """
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), _PACK_ROWS_HINT)
    except RuntimeError:
        return False
    return True


def prepack(model: nn.Module, native: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` with a ``PackedLinear`` (``native``: through our kernel where
    it applies); the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, native))
                replaced += 1
    return replaced
