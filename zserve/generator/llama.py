"""Our own model code for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3), nano-vllm style: the
engine runs it instead of Hugging Face's modules where it applies (``model_impl``, see ``own_model``).

One file for the four: they differ in data, not in code. Qwen2 has a bias on q/k/v, Llama may have biases
(``attention_bias``, ``mlp_bias``), Qwen3 normalises each head of q and k (``q_norm``/``k_norm``); the
weights say which, so the layers are built from a loaded Hugging Face model (safetensors or a converted
GGUF, whatever ``from_pretrained`` read) and its modules are dropped layer by layer as ours take their
weights. What changes against Hugging Face's modules:
  * q/k/v are one product (``qkv``), gate/up are one (``gate_up``): merged at load, as vLLM's
    ``QKVParallelLinear``/``MergedColumnParallelLinear`` (measured 0.92x the time of the separate products);
  * the packed step is a [T, hidden] matrix, not a padded batch; no mask, no cache object, no kwargs
    plumbing: a decode step's layer dispatches 40 top-level aten ops against HF's 71 (fp32, counted with the
    profiler on a tiny Llama; most of what is left are views and slices);
  * rotary applies to q and k in one call over [T, heads + kv_heads, head_dim] (cos/sin once per step),
    Qwen3's q/k norms too; the residual add is folded into the next norm (``add_rms_norm``);
  * attention is the engine's paged backend (``PagedKVCache.attend``) with the step's metadata.
The leaf functions (norms, rotary, SiLU) are C kernels on a CPU in fp32 (``native_pointwise.py``: one
pass each instead of 3-8 torch ops), plain torch otherwise (RMSNorm through torch's fused kernel), and
``torch.compile``-d on CUDA, where each saves kernel launches (``Compiled``: eager for good, with a warning,
if compiling fails; not yet run on a GPU).

Greedy output equals Hugging Face ``generate`` token for token (tests/unit/test_own_model.py): every op
computes what HF's does, in the same order (rotary's halves are HF's ``rotate_half`` written out); the C
kernels (products, attention, the leaf functions) sum in their own order, so logits differ from HF's by
rounding.

Tensor parallel: our layers are sharded as vLLM's (q/k/v and gate/up by output rows, whole heads per rank;
o_proj and down_proj by input columns, then an all-reduce; their biases on rank 0 only). The embedding and
the lm_head stay whole on every rank.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zserve.generator import native_pointwise
from zserve.generator.attention import PagedKVCache, TorchStep

log = logging.getLogger("zserve.generator.llama")

MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})  # cos/sin depend on the position alone


def unsupported(config: Any) -> str | None:
    """Why our code cannot run this model (None: it can)."""
    kind = getattr(config, "model_type", "")
    if kind not in MODEL_TYPES:
        return f"model type {kind!r} is not one we have code for ({', '.join(sorted(MODEL_TYPES))})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (ours is silu)"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if rope_type not in _STATIC_ROPE:
        return f"rope type {rope_type!r} (ours: {', '.join(sorted(_STATIC_ROPE))})"
    window = getattr(config, "sliding_window", None)
    uses_window = kind == "mistral" or getattr(config, "use_sliding_window", False)
    if uses_window and window and window < getattr(config, "max_position_embeddings", 0):
        return f"a sliding window of {window} tokens"
    return None


# ---- leaf functions (compiled on CUDA, see _leaf) ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm over the last dim; ``weight`` [D], or [heads, D] for Qwen3's merged q/k norms."""
    if x.dtype == torch.float32:
        # torch's fused kernel: one op instead of eight, bit for bit HF's formula in fp32 (checked over 108
        # shapes and scales, tests/unit/test_own_model.py)
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x, weight.shape[-1:], None, eps) * weight
    # below fp32, HF's op for op: the variance in fp32, the weight applied after the cast back
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add before a norm, and the norm: (norm(x + residual), x + residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] rotated by cos/sin [T, 1, D/2]: HF's ``x*cos + rotate_half(x)*sin`` with its equal
    halves of cos/sin written out (the same products and sums, bit for bit)."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


@functools.cache
def _leaf(fn, device_type: str):
    """``fn`` as the device runs it best: compiled on CUDA (one kernel instead of 4-8), on a CPU our C kernel
    (``native_pointwise.py``) where it applies, else eager."""
    if device_type == "cuda":
        return Compiled(fn)
    if device_type == "cpu":
        halves = fn in (rotary, silu_mul)  # their halves are vectors of 16 too
        return functools.partial(_native_or_torch, getattr(native_pointwise, fn.__name__), fn, 2 if halves else 1)
    return fn


def _native_or_torch(native, fn, parts: int, x: torch.Tensor, *args):
    return native(x, *args) if native_pointwise.applies(x, x.shape[-1] // parts) else fn(x, *args)


# Each leaf is compiled once per input rank and dtype (rms_norm sees [T, hidden] and Qwen3's [T, heads, D], fp32
# and bf16 models share a process in the GPU check; dynamic=True keeps T symbolic, except T = 1): a dozen
# entries, past dynamo's default limit of 8, after which it would run the function eagerly without a word.
RECOMPILE_LIMIT = 64
COMPILE_S: dict[str, float] = {}  # leaf -> seconds of its first call (the compile), for the GPU check to print


class Compiled:
    """``torch.compile(fn)``, guarded: a compile or a compiled call that raises (no C compiler for inductor, a
    triton too old for the GPU, a dynamo bug) turns this leaf to eager for good, with a warning, instead of
    failing the step."""

    def __init__(self, fn) -> None:
        self.fn, self.name = fn, fn.__name__
        self.call = None  # the compiled function, once made; fn itself after a failure
        self.failed = False

    def __call__(self, *args):
        if self.call is None:
            return self._first(*args)
        try:
            return self.call(*args)
        except Exception as exc:
            if self.failed:
                raise
            return self._fall_back(exc, *args)

    def _first(self, *args):
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        started = time.perf_counter()
        try:
            self.call = torch.compile(self.fn, dynamic=True)
            out = self.call(*args)
        except Exception as exc:
            return self._fall_back(exc, *args)
        COMPILE_S[self.name] = time.perf_counter() - started
        log.info("torch.compile of %s: %.1f s (its first call)", self.name, COMPILE_S[self.name])
        return out

    def _fall_back(self, exc: Exception, *args):
        log.warning("torch.compile of %s failed (%r): it runs eagerly", self.name, exc)
        self.call, self.failed = self.fn, True
        return self.fn(*args)


# ---- the model ----


class LlamaLayer(nn.Module):
    def __init__(self, index: int, heads: int, kv_heads: int, head_dim: int, eps: float, group: Any) -> None:
        super().__init__()
        self.index, self.heads, self.kv_heads, self.head_dim, self.eps = index, heads, kv_heads, head_dim, eps
        self.scale = head_dim**-0.5
        self.group = group  # the tensor parallel process group (None: alone)
        self.qkv: nn.Linear
        self.o_proj: nn.Linear
        self.gate_up: nn.Linear
        self.down_proj: nn.Linear
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.qk_norm: torch.Tensor | None = None  # Qwen3: [heads + kv_heads, D], q's weight per q head, k's

    def forward(self, h, residual, cos, sin, step: TorchStep, cache: PagedKVCache, device_type: str):
        if residual is None:
            residual, x = h, _leaf(rms_norm, device_type)(h, self.input_norm, self.eps)
        else:
            x, residual = _leaf(add_rms_norm, device_type)(h, residual, self.input_norm, self.eps)
        T, D, H, Hkv = x.shape[0], self.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(x)
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        if self.qk_norm is not None:
            qk = _leaf(rms_norm, device_type)(qk, self.qk_norm, self.eps)
        qk = _leaf(rotary, device_type)(qk, cos, sin)
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        o = cache.attend(self.index, qk[:, :H], qk[:, H:], v, step, self.scale)
        h = self._reduce(self.o_proj(o.view(T, H * D)))
        x, residual = _leaf(add_rms_norm, device_type)(h, residual, self.post_norm, self.eps)
        return self._reduce(self.down_proj(_leaf(silu_mul, device_type)(self.gate_up(x)))), residual

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(x, group=self.group)
        return x


class LlamaFamily(nn.Module):
    """A Llama-family causal LM on the engine's paged KV cache. ``forward`` takes one packed step."""

    def __init__(
        self, config: Any, generation_config: Any, embed: nn.Embedding, layers: list[LlamaLayer], norm: torch.Tensor,
        lm_head: nn.Linear, inv_freq: torch.Tensor, rope_scale: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = rope_scale  # yarn's attention factor (1 for the rest)
        self.eps = layers[0].eps
        self.cache: PagedKVCache | None = None  # set by the engine (step_core.paged_cache_for)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: TorchStep, sample_rows: torch.Tensor):
        """``ids``/``positions`` [T] of the packed step; the logits [len(sample_rows), vocab] of those rows."""
        assert self.cache is not None, "the engine plugs its KV cache in before the first step"
        device_type = self.device.type
        h = self.embed(ids)
        freqs = positions[:, None].float() * self.inv_freq  # as HF's rotary embedding, once per step
        cos = (freqs.cos() * self.rope_scale).to(h.dtype).unsqueeze(1)
        sin = (freqs.sin() * self.rope_scale).to(h.dtype).unsqueeze(1)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, step, self.cache, device_type)
        h, _ = _leaf(add_rms_norm, device_type)(h, residual, self.norm, self.eps)
        return self.lm_head(h.index_select(0, sample_rows))

    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf: Any, rank: int = 0, world: int = 1, group: Any = None) -> LlamaFamily:
        """Ours, from a loaded Hugging Face model of the family (whose layers are emptied on the way, so the
        weights are never held twice over). With ``world`` > 1, rank ``rank``'s shard."""
        config = hf.config
        reason = unsupported(config)
        if reason:
            raise ValueError(f"zserve's model code does not run this model: {reason}")
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        kv_heads = kv_heads or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if heads % world or kv_heads % world:
            raise ValueError(f"tensor_parallel {world} must divide {heads} heads and {kv_heads} key/value heads")
        H, Hkv = heads // world, kv_heads // world
        inter = config.intermediate_size // world
        body = hf.model
        layers = []
        for i in range(len(body.layers)):
            src = body.layers[i]
            a, m = src.self_attn, src.mlp
            layer = LlamaLayer(i, H, Hkv, head_dim, src.input_layernorm.variance_epsilon, group if world > 1 else None)
            parts = [_rows(a.q_proj, rank, H * head_dim), _rows(a.k_proj, rank, Hkv * head_dim)]
            layer.qkv = _merged([*parts, _rows(a.v_proj, rank, Hkv * head_dim)])
            layer.o_proj = _linear(_cols(a.o_proj.weight, rank, H * head_dim), _bias_on_rank0(a.o_proj, rank))
            layer.gate_up = _merged([_rows(m.gate_proj, rank, inter), _rows(m.up_proj, rank, inter)])
            layer.down_proj = _linear(_cols(m.down_proj.weight, rank, inter), _bias_on_rank0(m.down_proj, rank))
            layer.input_norm = nn.Parameter(src.input_layernorm.weight.detach(), requires_grad=False)
            layer.post_norm = nn.Parameter(src.post_attention_layernorm.weight.detach(), requires_grad=False)
            if hasattr(a, "q_norm"):
                w = torch.cat([a.q_norm.weight.detach().expand(H, -1), a.k_norm.weight.detach().expand(Hkv, -1)])
                layer.qk_norm = nn.Parameter(w.contiguous(), requires_grad=False)
            layers.append(layer)
            body.layers[i] = nn.Identity()  # HF's copy of this layer's weights goes now
        embed = body.embed_tokens
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        lm_head.weight = hf.lm_head.weight  # the embedding's own Parameter when they are tied
        rotary_emb = body.rotary_emb
        return cls(
            config, hf.generation_config, embed, layers, body.norm.weight.detach(), lm_head,
            rotary_emb.inv_freq, float(rotary_emb.attention_scaling),
        ).eval()  # fmt: skip


def _rows(linear: nn.Linear, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s ``n`` output rows of ``linear``: (weight, bias)."""
    w = linear.weight.detach()[rank * n : (rank + 1) * n]
    b = None if linear.bias is None else linear.bias.detach()[rank * n : (rank + 1) * n]
    return w, b


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> nn.Linear:
    """One product for several with the same input: their rows stacked (q, k, v; gate, up)."""
    biases = [b for _, b in parts]
    return _linear(torch.cat([w for w, _ in parts]), None if biases[0] is None else torch.cat(biases))


def _cols(weight: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    return weight.detach()[:, rank * n : (rank + 1) * n]


def _bias_on_rank0(linear: nn.Linear, rank: int) -> torch.Tensor | None:
    """A row-parallel product's bias is added once, after the all-reduce sums the ranks' parts: on rank 0."""
    return None if linear.bias is None or rank else linear.bias.detach()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return out


def own_model(hf: Any, model_impl: str, rank: int = 0, world: int = 1, group: Any = None) -> Any:
    """The model the engine runs: ours for ``model_impl`` "zserve" (an error where we have no code for it) and
    "auto" where we have it; Hugging Face's ``hf`` itself otherwise."""
    if model_impl == "transformers" or (model_impl == "auto" and unsupported(hf.config)):
        return hf
    return LlamaFamily.from_hf(hf, rank, world, group)
