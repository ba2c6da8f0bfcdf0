"""Triton kernels of the generative engine, jitted on first use (imported only where triton is installed and a
step needs them; see ``triton_attention.py``, which launches them).

``paged_attention``: one program per (tile of query rows, KV head[, KV split]). A tile is ``BLOCK_M`` rows of a
[query rows x GQA group] matrix: row m is query row ``m // GROUP_P`` of the tile and query head
``kv_head * GROUP + m % GROUP_P`` (``GROUP_P``, the group padded to a power of two; padding rows are masked),
so a KV head's keys and values are read once for its whole group and the scores are one ``tl.dot``
[BLOCK_M, D] x [D, BLOCK_N]. Keys are read ``BLOCK_N`` at a time through the block table (slot =
table[key // BLOCK_SIZE] * BLOCK_SIZE + key % BLOCK_SIZE), in place, with an online softmax in fp32; each query
row sees keys 0..its position. A decode tile is one row (``ROW_TILES``: tile i is row i); a prefill tile is up
to ``PREFILL_ROWS`` consecutive rows of one sequence, listed by the host (first row, rows). ``FP32_DOT``: the
products in fp32 (IEEE, not TF32), for fp32 models and under triton's interpreter, whose ``tl.dot`` on bf16
computes garbage (triton 3.9; numpy has no bf16).

Split KV (``SPLITS`` > 1, vLLM's "3D" unified attention): when (tiles x KV heads) is too small a grid to fill
the GPU (batch-1 decode is 1 x kv_heads programs), each tile's keys are cut into ``SPLITS`` ranges that run as
programs of their own; each writes its unnormalised output with its running max and sum, and ``combine_splits``
merges them (the log-sum-exp merge of flash-decoding).
"""

import triton
import triton.language as tl


@triton.jit
def paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, row_seq_ptr, row_pos_ptr, tiles_ptr,
    part_out_ptr, part_ml_ptr,
    q_row, q_head, o_row, o_head, kv_slot, kv_head_stride, table_row, scale,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROW_TILES: tl.constexpr, SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if ROW_TILES:
        first = tile
        rows = 1
    else:
        first = tl.load(tiles_ptr + 2 * tile)
        rows = tl.load(tiles_ptr + 2 * tile + 1)
    seq = tl.load(row_seq_ptr + first)
    pos0 = tl.load(row_pos_ptr + first)  # the tile's rows are consecutive positions of one sequence
    m = tl.arange(0, BLOCK_M)
    r = m // GROUP_P
    g = m % GROUP_P
    m_ok = (r < rows) & (g < GROUP)
    pos = pos0 + r  # each matrix row's query position
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_offsets = (first + r)[:, None] * q_row + head[:, None] * q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    kv_len = pos0 + rows  # keys 0..the last row's position
    lo = 0
    hi = kv_len
    if SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_ok = keys < hi
        block = tl.load(tables_ptr + seq * table_row + keys // BLOCK_SIZE, mask=k_ok, other=0)
        slots = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        offsets = slots[:, None] * kv_slot + kv_head * kv_head_stride + d[None, :]
        both = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=both, other=0.0)
        if FP32_DOT:  # fp32 models: full-precision products (parity with an fp32 reference), not TF32
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = m_ok[:, None] & k_ok[None, :] & (keys[None, :] <= pos[:, None])
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_ptr + offsets, mask=both, other=0.0)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    if SPLITS > 1:
        # row-tiles only: matrix row m is head kv_head * GROUP + m (rows == 1)
        part = (first * NUM_HEADS + head) * SPLITS + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=m_ok[:, None])
        tl.store(part_ml_ptr + 2 * part, m_i, mask=m_ok)
        tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=m_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offsets = (first + r)[:, None] * o_row + head[:, None] * o_head + d[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def combine_splits(
    part_out_ptr, part_ml_ptr, out_ptr, o_row, o_head,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, NUM_HEADS: tl.constexpr,
):  # fmt: skip
    """One program per (row, head): the splits' partial outputs merged by their maxima and sums."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    s_ok = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    part = (row * NUM_HEADS + head) * SPLITS + s
    m = tl.load(part_ml_ptr + 2 * part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + 2 * part + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)  # split 0 always holds key 0: finite
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    acc = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + row * o_row + head * o_head + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
