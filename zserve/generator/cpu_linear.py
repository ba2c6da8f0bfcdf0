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

from zserve.generator import c_build, kernel_choice, native_linear

_PACK_ROWS_HINT = 8  # the rows oneDNN picks its layout for; packing for each row count instead measured the same


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a packed copy of its weight (inference only). Without a ``route``:
    ``native_linear``'s panels where ``native`` and the kernel applies, else oneDNN's reordered layout. With
    one (``kernel_choice.Route``, what ``kernel_tune`` measured fastest for this shape): each row count runs
    the candidate chosen for it, and only the forms of the weight those need are kept."""

    def __init__(
        self, linear: nn.Linear, native: bool = True, route: kernel_choice.Route | None = None,
        forms: dict[str, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """``forms``: the packed weights of another ``PackedLinear`` of the same layer to share (the kernel's
        variants on one ISA share one packing)."""
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if route is None:
            use_native = native and native_linear.applies(weight)
            kind = kernel_choice.native(c_build.isa().name, native_linear.default().name) if use_native else None
            route = kernel_choice.Route((1,), (kind or kernel_choice.ONEDNN,))
        self.route = route
        self._routes = [(limit, _runner(kind)) for limit, kind in zip(route.limits, route.kinds, strict=False)]
        self._last = _runner(route.kinds[-1])
        self.native = any(k.startswith(kernel_choice.NATIVE) for k in route.kinds)
        forms = forms or {}
        self.forms = {f: forms[f] if f in forms else _pack(weight, f) for f in {_form(k) for k in route.kinds}}
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        for limit, run in self._routes:
            if rows <= limit:
                return run(self, x)
        return self._last(self, x)

    def extra_repr(self) -> str:
        kinds = ", ".join(
            f"{r}:{k.removeprefix(kernel_choice.NATIVE)}"
            for r, k in zip(self.route.rows, self.route.kinds, strict=True)
        )
        return f"{self.in_features} -> {self.out_features}, bias={self.bias is not None}, {kinds}"


def _form(kind: str) -> str:
    """The weight layout a candidate runs on: ``"native:<isa>"`` (panels as wide as that ISA's vectors),
    ``"onednn"`` or ``"torch"`` (the plain weight)."""
    return kind.split("/")[0] if kind.startswith(kernel_choice.NATIVE) else kind


def _pack(weight: torch.Tensor, form: str) -> torch.Tensor:
    if form == kernel_choice.ONEDNN:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
    if form == kernel_choice.TORCH:
        return weight
    return native_linear.pack(weight, native_linear.default(form.removeprefix(kernel_choice.NATIVE)))


def _variant(kind: str) -> native_linear.Variant:
    isa, name = kind.removeprefix(kernel_choice.NATIVE).split("/")
    return next(v for v in native_linear.variants(isa) if v.name == name)


def _runner(kind: str):
    """``kind``'s forward, as a function of the layer and its input."""
    if kind == kernel_choice.ONEDNN:
        return lambda m, x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), m.forms[kind], m.bias, "none", [], "")
    if kind == kernel_choice.TORCH:
        return lambda m, x: torch.nn.functional.linear(x, m.forms[kind], m.bias)
    variant, form = _variant(kind), _form(kind)
    return lambda m, x: native_linear.linear(x, m.forms[form], m.bias, variant)


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


def prepack(model: nn.Module, native: bool | str = True, rows: tuple[int, ...] = (), head_rows: int = 0) -> int:
    """Replace every ``nn.Linear`` of ``model`` with a ``PackedLinear``; the number replaced. ``native``:
    True or "native" (through our kernel where it applies, else oneDNN), False or "onednn", or "auto" (each
    shape and row bucket on what ``kernel_tune`` measures fastest among our kernel's schedules, oneDNN and
    torch, for ``rows``; the output layer for rows up to ``head_rows``, the most it computes logits for)."""
    if native == "auto":
        from zserve.generator import kernel_tune

        return kernel_tune.prepack(model, rows, head_rows)
    native = native in (True, "native")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, native))
                replaced += 1
    return replaced
