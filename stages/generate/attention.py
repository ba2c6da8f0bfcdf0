"""Attention over the paged KV cache, plugged into unchanged Hugging Face model code through transformers'
attention interface. Each step is one packed forward pass (all sequences' new tokens in one row); this
function writes the new K/V into the cache at their slots, then attends each sequence to its own KV only:
decodes as one batched, padded gather; prefill chunks one by one, causal with their offset. Cost is linear
in the total KV, not quadratic in the batch. This is the torch (CPU and fallback) backend; a GPU backend
(flash-attn / FlashInfer with block tables) would take the same StepMeta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepMeta:
    write_slots: torch.Tensor  # [T] cache slot of every token in the packed row
    decode_rows: torch.Tensor | None  # [B] rows of single-token decodes
    decode_slots: torch.Tensor | None  # [B, Lmax] each decode's KV slots, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] True where real
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (row start, row end, KV slots, mask)


class PagedKVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.k = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]

    def attention(self, module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """The transformers attention-interface signature; q/k/v are [1, heads, T, head_dim]."""
        meta: StepMeta = kwargs["zserve_meta"]
        kc, vc = self.k[module.layer_idx], self.v[module.layer_idx]
        kc[meta.write_slots] = k[0].transpose(0, 1)
        vc[meta.write_slots] = v[0].transpose(0, 1)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            keys = kc[meta.decode_slots].permute(0, 2, 1, 3)  # [B, Hkv, Lmax, D]
            values = vc[meta.decode_slots].permute(0, 2, 1, 3)
            queries = q[0, :, meta.decode_rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True
            )
            out[0, :, meta.decode_rows] = o.squeeze(2).transpose(0, 1)
        for start, end, slots, mask in meta.prefills:
            keys = kc[slots].transpose(0, 1).unsqueeze(0)
            values = vc[slots].transpose(0, 1).unsqueeze(0)
            out[:, :, start:end] = F.scaled_dot_product_attention(
                q[:, :, start:end], keys, values, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
            )
        return out.transpose(1, 2), None
