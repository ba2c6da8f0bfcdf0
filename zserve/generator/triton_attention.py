"""Paged attention for a whole mixed step in Triton: decodes and prefill chunks alike, each query row attending
causally to its own sequence's KV through the block table, in place (no gather, no padding, no mask). The GPU
backend where triton is installed; the torch backend (padded SDPA) stays the fallback.

Why our own kernel and not a library's: torch's ``varlen_attn`` takes a ``block_table`` from torch 2.13 on and
only on CUDA, FlashInfer and flash-attn are separate CUDA builds that are often absent; triton ships with
torch's CUDA wheels. Its shapes do not change with the KV lengths (tables are [sequences, max blocks]), which
is what a CUDA graph of a decode step needs. The CPU suite checks it through triton's interpreter
(``ZSERVE_TRITON_ATTENTION=interpret`` with ``TRITON_INTERPRET=1``, set before triton is imported).

Two launches per layer at most (``triton_kernels.py`` has the layout): the decode rows, one row per tile, all of
a KV head's query heads in one program; split over the keys when the grid is small (below ``FULL_GRID``
programs, as vLLM's unified Triton attention does), then merged. The prefill rows in tiles of ``PREFILL_ROWS``
consecutive rows of one sequence, x the GQA group, one ``tl.dot`` per block of keys.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("zserve.generator.triton_attention")

# auto | off | interpret (tests, on a CPU); read at every step, so a benchmark can switch backends in process
MODE = os.environ.get("ZSERVE_TRITON_ATTENTION", "auto")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 products run in fp32 there (triton_kernels.py)
FULL_GRID = 128  # programs below which decode tiles split their keys (vLLM's threshold for its 3D kernel)
SPLITS = 16  # key ranges per decode row when split: a constant, so a graph's launch does not depend on lengths
PREFILL_ROWS = 16  # query rows per prefill tile (x the GQA group: the rows of its tl.dot)
BLOCK_N = 64  # keys per iteration

# tolerance of the start-up check per dtype: fp32 sums in another order; bf16/fp16 round their inputs and the
# probabilities before the second product
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@functools.cache
def _kernels():
    """The jitted kernels (``triton_kernels.py``: triton is imported when the first step needs it)."""
    from zserve.generator import triton_kernels

    return triton_kernels


_verdict: dict[str, bool] = {}  # device -> whether every shape checked there passed


def usable(
    device: torch.device, dtype: torch.dtype | None = None, head_dim: int = 32, block_size: int = 4, group: int = 2
) -> bool:
    """Whether a step on ``device`` attends through this kernel: on CUDA with triton installed (unless
    ``ZSERVE_TRITON_ATTENTION=off``) and where it passed its check; on a CPU only under the interpreter.
    With ``dtype`` (an engine starting: its model's dtype, head dim, KV block size and GQA group), the check
    runs at those; without, the device's verdict so far (fp32 at small shapes where none ran yet)."""
    if MODE == "off" or (device.type != "cuda" and MODE != "interpret"):
        return False
    key = str(device)
    if dtype is None and key in _verdict:
        return _verdict[key]
    ok = _checked(key, dtype or torch.float32, head_dim, block_size, group)
    _verdict[key] = _verdict.get(key, True) and ok
    return ok


@functools.cache
def _checked(device: str, dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> bool:
    """Build and check the kernels once per device and shape against attention computed directly in fp32 from
    the same inputs: decodes with their keys split and unsplit, and a prefill chunk of more than one tile after
    cached keys, over shuffled blocks. A kernel that does not build or
    computes otherwise leaves the engine on the torch path, with a warning, instead of failing its steps."""
    try:
        _kernels()
    except ImportError:
        return False
    try:
        err = max(_check_error(device, dtype, head_dim, block_size, group, splits) for splits in (SPLITS, 1))
    except Exception as exc:  # a build failure, an unsupported GPU: the torch path still serves
        log.warning("triton paged attention failed its check on %s at %s, head_dim %d, block %d (%r): using torch's",
                    device, dtype, head_dim, block_size, exc)  # fmt: skip
        return False
    tolerance = TOLERANCE.get(dtype, 2e-2)
    if not err <= tolerance:
        log.warning("triton paged attention differs from the reference on %s at %s, head_dim %d, block %d by %.3g "
                    "(tolerance %.3g): using torch's", device, dtype, head_dim, block_size, err, tolerance)  # fmt: skip
        return False
    log.info("triton paged attention checked on %s at %s, head_dim %d, block %d: max error %.3g",
             device, dtype, head_dim, block_size, err)  # fmt: skip
    return True


def _check_error(device: str, dtype: torch.dtype, d: int, bs: int, group: int, splits: int) -> float:
    """The largest error, relative to the reference's largest magnitude, of one mixed step: three decode rows
    over 2 KV heads (of 1, 150 and 70 keys), their keys in ``splits`` ranges, then a chunk of ``PREFILL_ROWS + 3``
    rows (two tiles) after 37 cached keys."""
    g = torch.Generator().manual_seed(0)
    kv_heads, decodes = 2, 3
    heads = kv_heads * group
    lengths = [1, 150, 70, 37 + PREFILL_ROWS + 3]
    rows = [1] * decodes + [PREFILL_ROWS + 3]
    blocks = [-(-n // bs) for n in lengths]
    perm = torch.randperm(sum(blocks), generator=g)
    tables, at = [], 0
    for n in blocks:
        tables.append(perm[at : at + n].to(torch.int32))
        at += n
    k, v = (torch.randn(sum(blocks) * bs, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    row_seq = [s for s, n in enumerate(rows) for _ in range(n)]
    row_pos = [lengths[s] - rows[s] + i for s, n in enumerate(rows) for i in range(n)]
    q = torch.randn(len(row_seq), heads, d, generator=g).to(dtype)
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    on = functools.partial(torch.as_tensor, device=device)
    out = paged_attention(on(q), on(k), on(v), on(padded), on(torch.tensor(row_seq, dtype=torch.int32)),
                          on(torch.tensor(row_pos)), bs, d**-0.5, decodes,
                          on(prefill_tiles([decodes, len(row_seq)], 0)), splits)  # fmt: skip
    expected = reference(q, k, v, tables, row_seq, row_pos, bs, d**-0.5)
    return float((out.cpu().float() - expected).abs().max() / expected.abs().max())


def reference(q, k, v, tables, row_seq, row_pos, block_size: int, scale: float) -> torch.Tensor:
    """Softmax attention computed directly, in fp32, row by row (the checks' reference)."""
    out = []
    group = q.shape[1] // k.shape[1]
    for r, (s, p) in enumerate(zip(row_seq, row_pos, strict=True)):
        slots = (tables[s].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[: p + 1]
        keys = k[slots].float().transpose(0, 1).repeat_interleave(group, 0)  # [heads, p + 1, d]
        values = v[slots].float().transpose(0, 1).repeat_interleave(group, 0)
        out.append((torch.softmax(q[r].float().unsqueeze(1) @ keys.transpose(1, 2) * scale, -1) @ values)[:, 0])
    return torch.stack(out)


def prefill_tiles(query_start: list[int], first_prefill: int) -> torch.Tensor:
    """[tiles, 2] int32 (first row, rows): the rows of sequences ``first_prefill``.. in tiles of at most
    ``PREFILL_ROWS`` consecutive rows of one sequence (``query_start``: where each sequence's rows start)."""
    tiles = [
        (start, min(PREFILL_ROWS, end - start))
        for i in range(first_prefill, len(query_start) - 1)
        for start, end in [(query_start[i], query_start[i + 1])]
        for start in range(start, end, PREFILL_ROWS)
    ]
    return torch.tensor(tiles, dtype=torch.int32).view(-1, 2)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor,
    row_pos: torch.Tensor, block_size: int, scale: float, decode_rows: int | None = None,
    tiles: torch.Tensor | None = None, splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``q`` [T, heads, D] (head_dim contiguous); ``k_cache``/``v_cache`` one layer's [slots, kv_heads, D];
    ``tables`` [sequences, max blocks], ``row_seq`` [T] each row's sequence, ``row_pos`` [T] its position
    (it attends to keys 0..pos). Rows [0, ``decode_rows``) attend one by one (all of them when None), the rest
    in ``tiles`` [n, 2] (first row, rows; ``prefill_tiles``); the decode rows' keys in ``splits`` ranges (None:
    ``SPLITS`` where the grid is below ``FULL_GRID`` programs, else 1). Returns [T, heads, D], contiguous."""
    T, H, D = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    decode_rows = T if decode_rows is None else decode_rows
    kv_heads = k_cache.shape[1]
    group = H // kv_heads
    group_p = 1 << (group - 1).bit_length()
    block_d = max(16, 1 << (D - 1).bit_length())
    common = dict(GROUP=group, GROUP_P=group_p, D=D, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
                  NUM_HEADS=H, FP32_DOT=q.dtype == torch.float32 or INTERPRETED)  # fmt: skip
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
               tables.stride(0), scale)  # fmt: skip
    kernels = _kernels()
    if decode_rows:
        if splits is None:
            splits = SPLITS if decode_rows * kv_heads < FULL_GRID else 1
        block_m = max(16, group_p)
        part_out = part_ml = out  # unused without splits
        if splits > 1:
            part_out = torch.empty(decode_rows * H * splits * block_d, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(decode_rows * H * splits * 2, dtype=torch.float32, device=q.device)
        kernels.paged_attention[(decode_rows, kv_heads, splits)](
            q, k_cache, v_cache, out, tables, row_seq, row_pos, row_seq, part_out, part_ml, *strides,
            BLOCK_M=block_m, ROW_TILES=True, SPLITS=splits, num_warps=4, **common,
        )  # fmt: skip
        if splits > 1:
            kernels.combine_splits[(decode_rows, H)](
                part_out, part_ml, out, out.stride(0), out.stride(1), D=D, BLOCK_D=block_d, SPLITS=splits,
                SPLITS_P=1 << (splits - 1).bit_length(), NUM_HEADS=H,
            )  # fmt: skip
    if T > decode_rows:
        if tiles is None:
            tiles = prefill_tiles(list(range(decode_rows, T + 1)), 0).to(q.device)
        block_m = max(16, PREFILL_ROWS * group_p)
        kernels.paged_attention[(tiles.shape[0], kv_heads, 1)](
            q, k_cache, v_cache, out, tables, row_seq, row_pos, tiles, out, out, *strides,
            BLOCK_M=block_m, ROW_TILES=False, SPLITS=1, num_warps=4 if block_m <= 64 else 8, **common,
        )  # fmt: skip
    return out
