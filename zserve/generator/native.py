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
arithmetic in 16-float vectors (every head's dot products summed 16 at a time, the softmax vectorised).
Against the scalar kernel before it, SmolLM2's decode attention at 1 thread, 256-token prompts
(``python -m bench.studies.step --impls zserve``): 32 decodes 41.7 -> 27.8 ms per step, 8 decodes 12.2 -> 7.7.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from zserve.generator import c_build

_SOURCE = (
    c_build.VECTORS
    + r"""
#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

/* r[i] = the sum of p[i]'s lanes, for 16 vectors at once: a tree of shuffles and adds, ~3 operations per sum
   where summing each vector alone costs ~10 */
static inline v16 sum16(const v16 *p) {
    v16 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; i++)
        s1[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                SHUF(p[2 * i], p[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (int i = 0; i < 4; i++)
        s2[i] = SHUF(s1[2 * i], s1[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                SHUF(s1[2 * i], s1[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int i = 0; i < 2; i++)
        s3[i] = SHUF(s2[2 * i], s2[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
                SHUF(s2[2 * i], s2[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return SHUF(s3[0], s3[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(s3[0], s3[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* Every cache line of row i of the block at base (nothing when base is NULL), into L2: blocks lie anywhere
   in the pool and the hardware prefetcher stops at the end of each, so the next block's row is fetched while
   this block's is read. Into L1 instead measured no faster than no prefetch at all (the fills queue up). */
static inline void prefetch_row(const float *base, int i, long row) {
    if (!base) return;
    const char *c = (const char *)(base + i * row);
    for (long o = 0; o < row * 4; o += 64) __builtin_prefetch(c + o, 0, 2);
}

/* One decode: query q (H heads, head h at q + h*q_sh) against its L keys and values through its block table;
   k, v: [slots, Hkv, D] contiguous, NC = D / 16; query head h reads key/value head h / G. The scratch:
   scores [H][Lp], qs and acc [H][NC], tile [H][16]. */
static inline __attribute__((always_inline)) void decode_one(
    const float *q, long q_sh, const float *k, const float *v, const int32_t *table, int L, int H, int Hkv,
    const int NC, int bs, float scale, float *out, long out_sh, float *scores, v16 *qs, v16 *tile, v16 *acc) {
    const int G = H / Hkv, D = NC * 16, Lp = (L + 15) & ~15;
    const long row = (long)Hkv * D, blk = (long)bs * row;
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) qs[h * NC + c] = load(q + h * q_sh + c * 16) * scale;
    /* scores, up to 16 tokens of a block at a time: each row read once, in order, for every head; each head's
       16 partial products summed together */
    for (int t0 = 0; t0 < L; t0 += bs) {
        const float *kb = k + (long)table[t0 / bs] * blk;
        const float *next = t0 + bs < L ? k + (long)table[t0 / bs + 1] * blk : NULL;
        for (int s = 0; s < bs && t0 + s < L; s += 16) {
            int n = bs - s < 16 ? bs - s : 16;
            n = L - t0 - s < n ? L - t0 - s : n;
            for (int i = 0; i < 16; i++) {
                if (i >= n) {
                    for (int h = 0; h < H; h++) tile[h * 16 + i] = (v16){0};
                    continue;
                }
                prefetch_row(next, s + i, row);
                const float *kr = kb + (s + i) * row;
                for (int g = 0; g < Hkv; g++) {
                    v16 kv[NC];
                    for (int c = 0; c < NC; c++) kv[c] = load(kr + g * D + c * 16);
                    for (int h = g * G; h < (g + 1) * G; h++) {
                        v16 a = qs[h * NC] * kv[0];
                        for (int c = 1; c < NC; c++) a += qs[h * NC + c] * kv[c];
                        tile[h * 16 + i] = a;
                    }
                }
            }
            for (int h = 0; h < H; h++) {
                const v16 r = sum16(tile + h * 16);
                memcpy(scores + (long)h * Lp + t0 + s, &r, sizeof(float) * n);
            }
        }
    }
    /* softmax per head, 16 at a time; the row's padding up to Lp is -inf, whose exp (~1e-38 after the
       clamp) adds nothing next to the max's 1 and is never read again */
    for (int h = 0; h < H; h++) {
        float *sc = scores + (long)h * Lp;
        for (int t = L; t < Lp; t++) sc[t] = -INFINITY;
        v16 mv = load(sc);
        for (int t = 16; t < Lp; t += 16) {
            const v16 x = load(sc + t);
            mv = vselect(x > mv, x, mv);
        }
        float m = mv[0], sum = 0.f;
        for (int i = 1; i < 16; i++) m = mv[i] > m ? mv[i] : m;
        v16 sv = {0};
        for (int t = 0; t < Lp; t += 16) {
            const v16 e = vexp(load(sc + t) - m);
            store(sc + t, e);
            sv += e;
        }
        for (int i = 0; i < 16; i++) sum += sv[i];
        const float inv = 1.f / sum;
        for (int t = 0; t < Lp; t += 16) store(sc + t, load(sc + t) * inv);
    }
    /* out = p v, rows read once, in order */
    for (int i = 0; i < H * NC; i++) acc[i] = (v16){0};
    for (int t0 = 0; t0 < L; t0 += bs) {
        const float *vb = v + (long)table[t0 / bs] * blk;
        const float *next = t0 + bs < L ? v + (long)table[t0 / bs + 1] * blk : NULL;
        const int n = L - t0 < bs ? L - t0 : bs;
        for (int i = 0; i < n; i++) {
            prefetch_row(next, i, row);
            for (int g = 0; g < Hkv; g++) {
                v16 vv[NC];
                for (int c = 0; c < NC; c++) vv[c] = load(vb + i * row + g * D + c * 16);
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
   out_sh; head_dim D contiguous, a multiple of 16); its KV the first lengths[b] slots through
   tables[b * max_blocks ...]. Softmax(q k^T * scale) v per query head. */
int zserve_paged_decode(const float *q, long q_sb, long q_sh, const float *k, const float *v,
                        const int32_t *tables, long max_blocks, const int32_t *lengths, int B, int H, int Hkv,
                        int D, int block_size, float scale, float *out, long out_sb, long out_sh, int threads) {
    if (D % 16) return -2;
    int max_len = 1, failed = 0;
    for (int b = 0; b < B; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
    const int NC = D / 16;
    /* the decodes over `threads` threads (torch's own OpenMP pool), one sequence at a time as each frees */
#pragma omp parallel num_threads(threads) if (threads > 1 && B > 1)
    {
        void *scores = NULL, *work = NULL;
        if (posix_memalign(&scores, 64, sizeof(float) * (size_t)H * (size_t)(max_len + 16)) ||
            posix_memalign(&work, 64, sizeof(v16) * (size_t)H * (size_t)(2 * NC + 16))) {
#pragma omp atomic write
            failed = 1;
        } else {
            v16 *qs = work, *acc = qs + H * NC, *tile = acc + H * NC;
#pragma omp for schedule(dynamic, 1)
            for (int b = 0; b < B; b++) {
                const float *qb = q + b * q_sb;
                const int32_t *table = tables + (long)b * max_blocks;
                float *ob = out + b * out_sb;
                /* the common head sizes as constants: their loops unroll fully */
                if (NC == 4)
                    decode_one(qb, q_sh, k, v, table, lengths[b], H, Hkv, 4, block_size, scale, ob, out_sh, scores,
                               qs, tile, acc);
                else if (NC == 8)
                    decode_one(qb, q_sh, k, v, table, lengths[b], H, Hkv, 8, block_size, scale, ob, out_sh, scores,
                               qs, tile, acc);
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
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = c_build.build("paged_decode", _SOURCE, [*c_build.FLAGS, "-fopenmp"], "CPU decode attention")
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
    if cache.shape[-1] % 16:  # its vectors are 16 floats of a head
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
