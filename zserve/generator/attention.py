"""Attention over the paged KV cache, plugged into unchanged Hugging Face model code through transformers'
attention interface. Each step is one packed forward pass (all sequences' new tokens in one row).

``StepMeta`` describes a step the way paged-attention kernels take it (vLLM's / FlashInfer's layout): the
cache slot of every new token (``slot_mapping``), row offsets per sequence (``query_start``, i.e.
cu_seqlens_q), KV lengths (``context_lens``), and a block table per sequence (``block_tables``), decodes
first. The cache tensors are ``[num_blocks * block_size, kv_heads, head_dim]`` per layer, the contiguous
view of flash-attn's paged ``[num_blocks, block_size, kv_heads, head_dim]``.

The torch backend (CPU, and the fallback on GPUs without a paged kernel) writes the new K/V at their slots,
then attends each sequence to its own KV only: on a CPU all decodes in one call of the C kernel that reads
the blocks in place (``native.py``; without it, one SDPA call each over its gathered KV), on a GPU as one
padded batch; prefill chunks one by one, causal with their offset. Cost is linear in the total KV, not
quadratic in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zserve.generator import triton_attention
from zserve.generator.native import decode_kernel


@dataclass(slots=True)
class StepMeta:
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64, cache slot of every token of the packed row
    query_start: list[int]  # [N + 1] where each sequence's tokens start in the row
    context_lens: list[int]  # [N] each sequence's KV length after this step
    num_decodes: int  # sequences [0, num_decodes) are one-token decodes
    tables: list[torch.Tensor]  # [N] each sequence's block table (int32, its blocks so far)
    slot_rows: list[torch.Tensor]  # [N] each sequence's KV slots (int64, context_lens[i] long)

    def for_torch(
        self, device: torch.device, batched_decode: bool, upload: Uploader, ids: torch.Tensor,
        positions: torch.Tensor, sample_rows: list[int], kernel: bool = False,
    ) -> tuple[TorchStep, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The torch backend's inputs on ``device`` (built once per step, used by every layer), and the step's
        ``ids``, ``positions`` [T] and sampled rows there: every host tensor goes up in one ``upload``; the
        masks are built on the device from the lengths (no copy). ``kernel``: every row attends through
        ``triton_attention`` in one call per layer (its tables, each row's sequence; positions are shared)."""
        d, n_seqs = self.num_decodes, len(self.context_lens)
        host = [ids, positions, torch.tensor(sample_rows, dtype=torch.long), self.slot_mapping]
        if kernel:
            counts = torch.tensor(self.query_start[1:]) - torch.tensor(self.query_start[:-1])
            host += [torch.repeat_interleave(torch.arange(n_seqs, dtype=torch.int32), counts),
                     torch.nn.utils.rnn.pad_sequence(self.tables, batch_first=True),
                     triton_attention.prefill_tiles(self.query_start, d)]  # fmt: skip
            ids, positions, rows, write_slots, row_seq, tables, tiles = upload(host)
            kernel = KernelStep(tables, row_seq, positions, d, tiles)
            step = TorchStep(self.block_size, write_slots, [], None, [], kernel=kernel)
            return step, ids, positions, rows
        padded = d and batched_decode
        if padded:
            host += [torch.tensor(self.query_start[:d]), torch.nn.utils.rnn.pad_sequence(self.slot_rows[:d], True),
                     torch.tensor(self.context_lens[:d])]  # fmt: skip
        elif d:
            host += self.tables[:d]
        host += self.tables[d:]
        moved = upload(host)
        ids, positions, rows, write_slots = moved[:4]
        moved = moved[4:]
        decode_padded = None
        if padded:
            decode_rows, slots, lengths = moved[:3]
            moved = moved[3:]
            mask = torch.arange(slots.shape[1], device=device).unsqueeze(0) < lengths.unsqueeze(1)
            decode_padded = (decode_rows, slots, mask.view(d, 1, 1, -1))
        decodes, tables, lengths = [], None, None
        if d and not padded:
            decodes = [(self.query_start[i], moved[i], self.context_lens[i]) for i in range(d)]
            moved = moved[d:]
            if device.type == "cpu":  # the native kernel's inputs (native.py)
                tables = torch.nn.utils.rnn.pad_sequence(self.tables[:d], batch_first=True)
                lengths = torch.tensor(self.context_lens[:d], dtype=torch.int32)
        prefills = []
        for i, table in zip(range(d, n_seqs), moved, strict=True):
            start, end, length = self.query_start[i], self.query_start[i + 1], self.context_lens[i]
            mask = None
            if end - start < length:  # a later chunk of a prompt sees everything before it, and itself causally
                keys = torch.arange(length, device=device)
                mask = keys.unsqueeze(0) <= keys[length - (end - start) :].unsqueeze(1)
            prefills.append((start, end, table, length, mask))
        step = TorchStep(self.block_size, write_slots, decodes, decode_padded, prefills, tables, lengths)
        return step, ids, positions, rows


class Uploader:
    """A step's host tensors to the device in one copy: packed into one int64 staging buffer (pinned on CUDA,
    kept and grown as needed), copied without blocking, split into views of their shapes and dtypes there.
    On a CPU there is nothing to copy (``pack`` False: the tensors come back as they are); ``pack`` True on a
    CPU runs the packing anyway, so that the CPU suite tests what a GPU runs."""

    def __init__(self, device: torch.device, pack: bool | None = None) -> None:
        self.device = device
        self.pack = device.type != "cpu" if pack is None else pack
        self.uploads = 0  # copies made (one per step)
        self._staging = torch.empty(0, dtype=torch.long)
        self._copied = None  # CUDA: the event after the last copy, waited for before the buffer is rewritten

    def __call__(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.pack:
            return parts
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        if self._staging.numel() < total:
            pinned = self.device.type == "cuda"
            self._staging = torch.empty(max(total, 2 * self._staging.numel()), dtype=torch.long, pin_memory=pinned)
        elif self._copied is not None:  # a step that sampled nothing did not wait for its copy
            self._copied.synchronize()
        flat = self._staging[:total]
        torch.cat([p.reshape(-1) for p in parts], out=flat)  # int32 tables widen to int64 here
        moved = flat.to(self.device, non_blocking=True) if self.device.type != "cpu" else flat.clone()
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.uploads += 1
        return [v.view(p.shape).to(p.dtype) for v, p in zip(moved.split(sizes), parts, strict=True)]


@dataclass(slots=True)
class TorchStep:
    block_size: int
    write_slots: torch.Tensor  # [T]
    decodes: list[tuple[int, torch.Tensor, int]]  # (row, block table, KV length), one SDPA call each
    decode_padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows [B], slots [B, L], mask
    prefills: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]  # (row start, end, table, length, mask)
    decode_tables: torch.Tensor | None = None  # [num_decodes, max blocks] int32, on a CPU
    decode_lengths: torch.Tensor | None = None  # [num_decodes] int32
    kernel: KernelStep | None = None  # every row through triton_attention


@dataclass(slots=True)
class KernelStep:
    """A step's inputs to ``triton_attention.paged_attention``, on the device."""

    tables: torch.Tensor  # [N, max blocks] int32
    row_seq: torch.Tensor  # [T] each row's sequence
    row_pos: torch.Tensor  # [T] each row's position
    decode_rows: int  # rows [0, decode_rows) are one-token decodes
    tiles: torch.Tensor | None  # [n, 2] the prefill rows' tiles (first row, rows); None: one row each


def cache_dtype(dtype: torch.dtype, device: torch.device | str, native_decode: bool) -> torch.dtype:
    """The KV cache's dtype for a model computing in ``dtype``: its own, except on a CPU with the C decode
    kernel, which reads fp32. A bf16 model's keys and values are kept in fp32 there: twice the bytes, which
    a CPU has, against decode attention through SDPA over gathers, 2.5x the kernel's time at 32 decodes
    (bench/studies/attention.py)."""
    if native_decode and torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        native_decode: bool = True,
    ):
        """``dtype``: the model's (the cache's is ``cache_dtype``'s); ``native_decode``: CPU decodes attend
        through the C kernel (``native.py``) where it applies."""
        shape = (num_slots, num_kv_heads, head_dim)
        self.dtype = cache_dtype(dtype, device, native_decode)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.native = decode_kernel(self.k[0]) if native_decode else None

    def attention(self, module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """The transformers attention-interface signature; q/k/v are [1, heads, T, head_dim]."""
        out = self.attend(
            module.layer_idx, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
            kwargs["zserve_meta"], scaling if scaling is not None else q.shape[-1] ** -0.5,
        )  # fmt: skip
        return out.unsqueeze(0), None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: TorchStep, scale: float
    ) -> torch.Tensor:
        """One layer's attention for the whole packed step: writes the new ``k``/``v`` [T, kv_heads, head_dim]
        at their slots, then attends ``q`` [T, heads, head_dim] (head_dim contiguous, any row and head
        strides); returns [T, heads, head_dim], contiguous."""
        if q.dtype == self.dtype:
            return self._attend(layer, q, k, v, step, scale)
        # a bf16 model over an fp32 cache (``cache_dtype``): attend in fp32
        c = self.dtype
        return self._attend(layer, q.to(c), k.to(c), v.to(c), step, scale).to(q.dtype)

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: TorchStep, scale: float
    ) -> torch.Tensor:
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(0, step.write_slots, k)
        vc.index_copy_(0, step.write_slots, v)
        if (kernel := step.kernel) is not None:
            return triton_attention.paged_attention(
                q, kc, vc, kernel.tables, kernel.row_seq, kernel.row_pos, step.block_size, scale, kernel.decode_rows,
                kernel.tiles,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if step.decode_padded is not None:
            rows, slots, mask = step.decode_padded
            keys = kc[slots].permute(0, 2, 1, 3)  # [B, Hkv, Lmax, D]
            values = vc[slots].permute(0, 2, 1, 3)
            queries = q[rows].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            out[rows] = o.squeeze(2)
        bs = step.block_size
        decodes = step.decodes
        if decodes and self.native is not None and step.decode_tables is not None:
            d = len(decodes)  # decodes are rows [0, d) of the packed row
            self.native(q[:d], kc, vc, step.decode_tables, step.decode_lengths, bs, scale, out[:d])
            decodes = []
        # Without the kernel, one unmasked SDPA call per sequence over its own KV beats one padded, masked
        # batch on a CPU (bench/studies/attention.py): the mask forces SDPA's slow path and the padding costs too.
        kb, vb = kc.view(-1, bs, *kc.shape[1:]), vc.view(-1, bs, *vc.shape[1:])
        for row, table, length in decodes:
            out[row] = F.scaled_dot_product_attention(
                q[row].unsqueeze(1).unsqueeze(0), _gather(kb, table, length), _gather(vb, table, length),
                scale=scale, enable_gqa=True,
            )[0, :, 0]  # fmt: skip
        for start, end, table, length, mask in step.prefills:
            keys, values = _gather(kb, table, length), _gather(vb, table, length)
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, is_causal=mask is None,
                scale=scale, enable_gqa=True,
            )[0].transpose(0, 1)  # fmt: skip
        return out


def _gather(blocks: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first ``length`` KV rows as [1, kv_heads, length, head_dim], from its block table:
    ``index_select`` of whole blocks copies 5x faster than indexing every slot (measured: 9 against 46 us for
    300 slots of 3 x 64 fp32), and SDPA reads the strided view as is."""
    return blocks.index_select(0, table).flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
