"""CUDA graphs of decode-only steps (nano-vllm's shape): a step whose rows are all one-token decodes replays a
graph captured for the smallest batch bucket that holds it (1, 2, 4, 8, then multiples of 16 up to
``max_running``), so that its ~30 kernels per layer launch as one graph instead of one by one from Python.
Prefill steps, and steps with prompt logprobs, stay eager.

A graph reads and writes fixed memory, so the step's inputs are copied into static buffers first: token ids,
positions, the slots the new K/V go to, and the block tables [bucket, max_blocks]; attention is the Triton
kernel (``triton_attention.py``), whose shapes do not depend on the KV lengths. Rows past the batch in its
bucket write their K/V to a scratch block that no sequence owns (the cache holds one block more) and attend
to position 0. The first replay is checked against the eager forward of the same step, at the model's dtype
(a tolerance for it, and the same greedy token in every row); on a mismatch the engine turns graphs off with a
warning and stays eager.

On a CPU (tests, with triton interpreted) the same buffers and buckets run, each "replay" the eager forward
over them: everything but the capture itself is checked there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zserve.generator.attention import KernelStep, StepMeta, TorchStep, Uploader

log = logging.getLogger("zserve.generator.cuda_graphs")

# a graphed step's logits against the eager step's, relative to the largest logit, per dtype
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(self, model: Any, max_batch: int, max_blocks: int, block_size: int, scratch_slot: int) -> None:
        """``model``: a LlamaFamily with its cache plugged in; ``scratch_slot``: the first slot of the block no
        sequence owns."""
        self.model, self.max_batch, self.max_blocks, self.block_size = model, max_batch, max_blocks, block_size
        self.scratch_slot = scratch_slot
        self.verified = False
        self.passed: bool | None = None  # the first graphed step's check (None: not yet run)
        self.error = 0.0  # its largest logit difference, relative to the largest logit
        self.same_argmax: bool | None = None
        self.replays = 0  # steps run as a graph
        device = model.device
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.write_slots = torch.full((max_batch,), scratch_slot, dtype=torch.long, device=device)
        self.row_seq = torch.arange(max_batch, dtype=torch.int32, device=device)  # row i is sequence i
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.long, device=device)
        self._pool = None
        self._replays: dict[int, tuple[Any, torch.Tensor]] = {}
        for b in reversed(buckets(max_batch)):  # largest first: the smaller graphs reuse its memory pool
            self._replays[b] = self._capture(b)

    def _forward(self, b: int) -> torch.Tensor:
        kernel = KernelStep(self.tables[:b], self.row_seq[:b], self.positions[:b], b, None)
        step = TorchStep(self.block_size, self.write_slots[:b], [], None, [], kernel=kernel)
        return self.model(self.ids[:b], self.positions[:b], step, self.rows[:b])

    def _capture(self, b: int) -> tuple[Any, torch.Tensor]:
        self._forward(b)  # warm-up: triton's compile, cuBLAS's workspace, outside the graph
        if self.model.device.type != "cuda":
            out = self._forward(b)
            return (lambda: out.copy_(self._forward(b))), out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b)
        self._pool = graph.pool()
        return graph.replay, out

    def takes(self, meta: StepMeta, sample_rows: list[int], has_prompt_rows: bool) -> bool:
        """Whether a step runs as a graph: decodes only, each sampled, within the buckets and the tables."""
        n = len(meta.context_lens)
        return (
            meta.num_decodes == n <= self.max_batch and not has_prompt_rows and len(sample_rows) == n
            and max(len(t) for t in meta.tables) <= self.max_blocks
        )  # fmt: skip

    def step(self, meta: StepMeta, ids: torch.Tensor, positions: torch.Tensor, upload: Uploader) -> torch.Tensor:
        """The logits [B, vocab] of a decode-only step (``ids``/``positions`` [1, B] on the host): its inputs in
        one upload, copied into the buffers, then the bucket's graph replayed."""
        n = len(meta.context_lens)
        b = min(size for size in self._replays if size >= n)
        tables = torch.nn.utils.rnn.pad_sequence(meta.tables, batch_first=True)
        ids_d, positions_d, slots_d, tables_d = upload([ids[0], positions[0], meta.slot_mapping, tables])
        self.ids[:n].copy_(ids_d)
        self.positions[:n].copy_(positions_d)
        self.write_slots[:n].copy_(slots_d)
        self.tables[:n, : tables_d.shape[1]].copy_(tables_d)
        if b > n:  # the padding rows: the scratch block, position 0
            self.write_slots[n:b].fill_(self.scratch_slot)
            self.positions[n:b].zero_()
        replay, out = self._replays[b]
        replay()
        self.replays += 1
        return out[:n]

    def verify(self, graphed: torch.Tensor, eager: torch.Tensor) -> bool:
        """The first graphed step against the same step run eagerly (called once): logits within the model's
        dtype's tolerance (``LOGIT_TOLERANCE``, relative to the largest logit) and the same greedy token in
        every row. A graph over the same kernels computes the same sums, so a difference is a capture that went
        wrong (a buffer read outside the graph's inputs), not rounding; the tolerance leaves room for kernels
        whose reduction order depends on the launch (cuBLAS picks by batch)."""
        self.verified = True
        tolerance = LOGIT_TOLERANCE.get(graphed.dtype, 2e-2)
        a, b = graphed.float(), eager.float()
        self.error = float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) if b.numel() else 0.0
        self.same_argmax = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
        self.passed = self.error <= tolerance and self.same_argmax
        if not self.passed:
            log.warning("a CUDA graph's logits differ from the eager step's (%s: max error %.3g of the largest, "
                        "tolerance %.3g; greedy tokens %s): decode steps stay eager", graphed.dtype, self.error,
                        tolerance, "equal" if self.same_argmax else "differ")  # fmt: skip
        return self.passed
