"""Triton kernels of the generative engine, jitted on first use (imported only where triton is installed and a
step needs them; see ``triton_attention.py``)."""

import triton
import triton.language as tl


@triton.jit
def paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, row_seq_ptr, row_pos_ptr,
    q_row, q_head, o_row, o_head, kv_slot, kv_head_stride, table_row, scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(row_seq_ptr + row)
    pos = tl.load(row_pos_ptr + row)
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + row * q_row + head * q_head + d, mask=d_ok, other=0.0).to(tl.float32)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_ok = keys <= pos
        block = tl.load(tables_ptr + seq * table_row + keys // BLOCK_SIZE, mask=k_ok, other=0)
        slots = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        offsets = slots[:, None] * kv_slot + kv_head * kv_head_stride + d[None, :]
        both = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=both, other=0.0).to(tl.float32)
        scores = tl.where(k_ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offsets, mask=both, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + row * o_row + head * o_head + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
