"""A C kernel for the CPU decode attention: every one-token decode of a step attends to its KV where it lies
in the paged cache (read once, through the block table), in one call per layer.

The torch path gathers each sequence's K and V out of the cache (a copy per sequence, layer and K/V), then
calls SDPA once per sequence: at 32 decodes that is ~2,000 small ops per step, and the gathered copies cost
as much memory traffic as the attention itself. This kernel is what vLLM's CPU build does with its own
C++ paged attention, kept small (``c_build.py``: plain C, compiled on first use for this CPU, called
through ctypes). Without a compiler, or on a cache that is not fp32 on a CPU, ``decode_kernel()`` is None
and the torch path runs instead.

Where its time goes: the keys and values it reads, more than its arithmetic. Blocks of 16 slots lie anywhere
in the pool and the hardware prefetcher stops at each one's end, so reading them in place runs at ~13 GB/s
on this VM's core where a sequential read runs at ~25; the kernel prefetches the next block's row into L2 as
it reads this one's (into L1 measured no faster than no prefetch: the fills queue up), and does each row's
arithmetic in vectors of one register of the ISA it is built for (``c_build.vectors``: 16 floats on AVX-512,
8 on AVX2; every head's dot products summed that many at a time, the softmax vectorised). Against the scalar
kernel before it, SmolLM2's decode attention at 1 thread on an AVX-512 core, 256-token prompts
(``python -m bench.studies.step --impls zserve``): 32 decodes 41.7 -> 27.8 ms per step, 8 decodes 12.2 -> 7.7.
Built with 16-float vectors for AVX2 it ran 7-9x slower than with 8-float ones there (``python -m
bench.studies.attention --threads 1`` with ``ZSERVE_CPU_ISA=avx2``: 32 decodes 10.5 -> 1.2 ms per layer).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from zserve.generator import c_build

_KERNEL = r"""
/* Every cache line of row i of the block at base (nothing when base is NULL), into L2: blocks lie anywhere
   in the pool and the hardware prefetcher stops at the end of each, so the next block's row is fetched while
   this block's is read. Into L1 instead measured no faster than no prefetch at all (the fills queue up). */
static inline void prefetch_row(const float *base, int i, long row) {
    if (!base) return;
    const char *c = (const char *)(base + i * row);
    for (long o = 0; o < row * 4; o += 64) __builtin_prefetch(c + o, 0, 2);
}

/* One decode: query q (H heads, head h at q + h*q_sh) against its L keys and values through its block table;
   k, v: [slots, Hkv, D] contiguous, NC = D / VW; query head h reads key/value head h / G. The scratch:
   scores [H][Lp], qs and acc [H][NC], tile [H][VW]. */
static inline __attribute__((always_inline)) void decode_one(
    const float *q, long q_sh, const float *k, const float *v, const int32_t *table, int L, int H, int Hkv,
    const int NC, int bs, float scale, float *out, long out_sh, float *scores, vf *qs, vf *tile, vf *acc) {
    const int G = H / Hkv, D = NC * VW, Lp = (L + VW - 1) / VW * VW;
    const long row = (long)Hkv * D, blk = (long)bs * row;
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) qs[h * NC + c] = vload(q + h * q_sh + c * VW) * scale;
    /* scores, up to VW tokens of a block at a time: each row read once, in order, for every head; each head's
       VW partial products summed together */
    for (int t0 = 0; t0 < L; t0 += bs) {
        const float *kb = k + (long)table[t0 / bs] * blk;
        const float *next = t0 + bs < L ? k + (long)table[t0 / bs + 1] * blk : NULL;
        for (int s = 0; s < bs && t0 + s < L; s += VW) {
            int n = bs - s < VW ? bs - s : VW;
            n = L - t0 - s < n ? L - t0 - s : n;
            for (int i = 0; i < VW; i++) {
                if (i >= n) {
                    for (int h = 0; h < H; h++) tile[h * VW + i] = (vf){0};
                    continue;
                }
                prefetch_row(next, s + i, row);
                const float *kr = kb + (s + i) * row;
                for (int g = 0; g < Hkv; g++) {
                    vf kv[NC];
                    for (int c = 0; c < NC; c++) kv[c] = vload(kr + g * D + c * VW);
                    for (int h = g * G; h < (g + 1) * G; h++) {
                        vf a = qs[h * NC] * kv[0];
                        for (int c = 1; c < NC; c++) a += qs[h * NC + c] * kv[c];
                        tile[h * VW + i] = a;
                    }
                }
            }
            for (int h = 0; h < H; h++) {
                const vf r = vsums(tile + h * VW);
                memcpy(scores + (long)h * Lp + t0 + s, &r, sizeof(float) * n);
            }
        }
    }
    /* softmax per head, VW at a time; the row's padding up to Lp is -inf, whose exp (~1e-38 after the
       clamp) adds nothing next to the max's 1 and is never read again */
    for (int h = 0; h < H; h++) {
        float *sc = scores + (long)h * Lp;
        for (int t = L; t < Lp; t++) sc[t] = -INFINITY;
        vf mv = vload(sc);
        for (int t = VW; t < Lp; t += VW) {
            const vf x = vload(sc + t);
            mv = vselect(x > mv, x, mv);
        }
        float m = mv[0];
        for (int i = 1; i < VW; i++) m = mv[i] > m ? mv[i] : m;
        vf sv = {0};
        for (int t = 0; t < Lp; t += VW) {
            const vf e = vexp(vload(sc + t) - m);
            vstore(sc + t, e);
            sv += e;
        }
        const float inv = 1.f / vhsum(sv);
        for (int t = 0; t < Lp; t += VW) vstore(sc + t, vload(sc + t) * inv);
    }
    /* out = p v, rows read once, in order */
    for (int i = 0; i < H * NC; i++) acc[i] = (vf){0};
    for (int t0 = 0; t0 < L; t0 += bs) {
        const float *vb = v + (long)table[t0 / bs] * blk;
        const float *next = t0 + bs < L ? v + (long)table[t0 / bs + 1] * blk : NULL;
        const int n = L - t0 < bs ? L - t0 : bs;
        for (int i = 0; i < n; i++) {
            prefetch_row(next, i, row);
            for (int g = 0; g < Hkv; g++) {
                vf vv[NC];
                for (int c = 0; c < NC; c++) vv[c] = vload(vb + i * row + g * D + c * VW);
                for (int h = g * G; h < (g + 1) * G; h++) {
                    const float p = scores[(long)h * Lp + t0 + i];
                    for (int c = 0; c < NC; c++) acc[h * NC + c] += p * vv[c];
                }
            }
        }
    }
    for (int h = 0; h < H; h++) memcpy(out + h * out_sh, acc + h * NC, sizeof(float) * D);
}

/* Decodes rows [0, B): row b's query at q + b*q_sb, its output at out + b*out_sb (head strides q_sh,
   out_sh; head_dim D contiguous, a multiple of VW); its KV the first lengths[b] slots through
   tables[b * max_blocks ...]. Softmax(q k^T * scale) v per query head. */
int zserve_paged_decode(const float *q, long q_sb, long q_sh, const float *k, const float *v,
                        const int32_t *tables, long max_blocks, const int32_t *lengths, int B, int H, int Hkv,
                        int D, int block_size, float scale, float *out, long out_sb, long out_sh, int threads) {
    if (D % VW) return -2;
    int max_len = 1, failed = 0;
    for (int b = 0; b < B; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
    const int NC = D / VW;
    /* the decodes over `threads` threads (torch's own OpenMP pool), one sequence at a time as each frees */
#pragma omp parallel num_threads(threads) if (threads > 1 && B > 1)
    {
        void *scores = NULL, *work = NULL;
        if (posix_memalign(&scores, 64, sizeof(float) * (size_t)H * (size_t)(max_len + VW)) ||
            posix_memalign(&work, 64, sizeof(vf) * (size_t)H * (size_t)(2 * NC + VW))) {
#pragma omp atomic write
            failed = 1;
        } else {
            vf *qs = work, *acc = qs + H * NC, *tile = acc + H * NC;
#pragma omp for schedule(dynamic, 1)
            for (int b = 0; b < B; b++) {
                const float *qb = q + b * q_sb;
                const int32_t *table = tables + (long)b * max_blocks;
                float *ob = out + b * out_sb;
                /* the common head sizes (64, 128) as constants: their loops unroll fully */
                if (NC == 64 / VW)
                    decode_one(qb, q_sh, k, v, table, lengths[b], H, Hkv, 64 / VW, block_size, scale, ob, out_sh,
                               scores, qs, tile, acc);
                else if (NC == 128 / VW)
                    decode_one(qb, q_sh, k, v, table, lengths[b], H, Hkv, 128 / VW, block_size, scale, ob, out_sh,
                               scores, qs, tile, acc);
                else
                    decode_one(qb, q_sh, k, v, table, lengths[b], H, Hkv, NC, block_size, scale, ob, out_sh,
                               scores, qs, tile, acc);
            }
        }
        free(scores);
        free(work);
    }
    return failed ? -1 : 0;
}
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    isa = c_build.isa()
    source = c_build.vectors(isa.width) + _KERNEL
    lib = c_build.build(f"paged_decode-{isa.name}", source, [*isa.flags, "-fopenmp"], "CPU decode attention")
    if lib is None:
        return None
    fn = lib.zserve_paged_decode
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, c_long, c_long, ptr, ptr, ptr, c_long, ptr, c_int, c_int, c_int, c_int, c_int,
                   ctypes.c_float, ptr, c_long, c_long, c_int]  # fmt: skip
    fn.restype = c_int
    return lib


def decode_kernel(cache: torch.Tensor) -> PagedDecode | None:
    """The kernel for a cache layer like ``cache``, or None where it does not apply (or cannot be built)."""
    if cache.device.type != "cpu" or cache.dtype != torch.float32 or not cache.is_contiguous():
        return None
    if cache.shape[-1] % 16:  # its vectors are up to 16 floats of a head
        return None
    lib = _library()
    return None if lib is None else PagedDecode(lib.zserve_paged_decode)


class PagedDecode:
    """The kernel over a step's decodes; with torch's thread count above 1 the sequences are shared out over
    torch's own OpenMP threads (the library links the libgomp torch loaded, as ``native_linear`` does)."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
        block_size: int, scale: float, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """``q``/``out``: [B, H, D] views (any row and head strides, head_dim contiguous) of the decodes' rows;
        ``k``/``v``: one layer's cache [slots, Hkv, D]; ``tables`` [B, max_blocks] and ``lengths`` [B] int32.
        The caller guarantees every table entry is a block of the cache and lengths[b] <= blocks * block_size
        (the block manager's tables are), which is what keeps the kernel's reads in bounds."""
        if q.stride(2) != 1 or out.stride(2) != 1 or q.dtype != torch.float32 or out.dtype != torch.float32:
            raise ValueError("paged decode: q and out must be float32 with a contiguous head_dim")
        if tables.dtype != torch.int32 or lengths.dtype != torch.int32 or not tables.is_contiguous():
            raise ValueError("paged decode: tables and lengths must be contiguous int32")
        B, H, D = q.shape
        rc = self._fn(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), tables.data_ptr(),
            tables.shape[1], lengths.data_ptr(), B, H, k.shape[1], D, block_size, scale, out.data_ptr(),
            out.stride(0), out.stride(1), torch.get_num_threads(),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("paged decode: out of memory for the scores")
        if rc != 0:
            raise ValueError(f"paged decode: head_dim {D} is not a multiple of 16")
