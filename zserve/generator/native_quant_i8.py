"""The quantised linear layers' second kernel: activations quantised to int8 and integer dot products, as
llama.cpp's ggml-cpu does for its Q8_0 / Q4_0 / Q4_1 products (``quantize_row_q8_0`` and
``ggml_vec_dot_q4_1_q8_1``). ``native_quant.py`` converts every weight to fp32 in registers, scales it and FMAs
it: ~9 vector operations a 32 weights, so a decode step there is bound by that conversion, not by memory. Here
each row of x is quantised once a call, per block of 32 inputs (d = max |x| / 127, xq = round(x / d), nearest
even), and each block's product of integers is one instruction a 4 inputs and VW outputs:

- AVX-512 VNNI (and AVX-VNNI's 256-bit form): ``vpdpbusd`` (unsigned bytes times signed bytes, four a 32-bit
  lane, added in): 4-bit weights (0..15) are the unsigned operand as they are; 8-bit ones are made unsigned
  by flipping their top bit (q + 128) and the block's sum of xq times 128 taken off again, exactly;
- AVX2: ``vpmaddubsw`` + ``vpmaddwd``: 4-bit weights as they are (a block's 16-bit pairs summed before one
  ``vpmaddwd``); 8-bit ones as llama.cpp does, |xq| times the weight with xq's sign (no 16-bit sum can
  overflow: 2 * 127 * 127 < 2^15);
- portable C elsewhere (the same integers, one lane at a time; the tuner keeps the fp32 kernel there).

A block's int32 sum is then converted once and added in fp32 times the weight's scale and the row's d; the
minimums (Q4_0 / Q4_1 / Q4_K) are added once a block, times the exact fp32 sum of x over it (llama.cpp uses
d times the sum of xq: ours loses nothing there). The activations are quantised in two terms by default
(``TERMS``): x ~ d (xq + xr / 128), xr the rounding rest of xq in 1/128 of d, both int8, each block's two sums
meeting as 128 sum1 + sum2 in int32. So the result is the product of the dequantised weights with the
quantised activations, to fp32 rounding (``reference``); against fp32 activations each output moves by at most
sum over blocks of d / 256 (one term: d / 2) times the block's sum of |w|.

The weights are in panels of VW outputs (the ISA's int32 lanes, as the floats of ``native_quant``), laid out
for the instruction: ``i8`` [N/VW][K/32][8][VW][4] (four consecutive inputs of one output in a 32-bit lane),
``u4`` [N/VW][K/32][4][VW][4] with the block's inputs 0-15 in the low nibbles and 16-31 in the high ones.
Scales and minimums as ``native_quant``'s ([N/VW][K/32][VW], fp16 where exact): the same bytes a weight.

The same layout runs fp32 activations too, from ``PackedI8.many`` rows on: the weights converted in registers
(QTILE, a few rows) or a group of panels dequantised once into fp32 tiles (many rows), each weight the
dequantised one, as ``native_quant``'s kernel computes. On AVX2 two terms of ``vpmaddubsw`` + ``vpmaddwd`` cost
more than FMAs from ~3 rows (8-bit weights) or ~16-24 (4-bit), while they win at 1 row by 1.7-2.1x; one layout
kept (not two), the row count of a call picks the path.

Which kernel runs a layer, and from how many rows its calls keep fp32 activations, is measured when the layer is
made (``kernel_tune.quant_choice``), or forced with ``ZSERVE_QUANT_ACTIVATIONS=int8|int8x1|fp32`` (int8x1: one
term; int8 and int8x1 at every row count).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from zserve.generator import c_build, kernel_choice, native_linear, native_quant

BLOCK = native_quant.BLOCK
# The activations in two terms of int8 by default, x ~ d (xq + xr / 128): one term alone moved SmolLM2-135M
# Q4_1's logits too far from the fp32-activation product (cosine per step min 0.933, greedy tokens the same at
# 93.2% of positions, perplexity +1.48%); in two (each output within sum over blocks of d / 256 * sum |w| of the
# fp32-activation product) 0.999995, 99.84%, -0.014%, at twice the integer products: free while a step reads its
# weights from memory (1 row), 1.3-1.5x the fp32-activation kernel's speed at 256 rows on AVX-512
TERMS = 2
NEVER = kernel_choice.NEVER  # PackedI8.many where every row count runs the integer products
FORMATS = ("i8", "i8m", "u4m")  # as native_quant's: 8-bit, 8-bit with minimums, 4-bit two a byte with minimums

# (rows a block of rows takes at most, panels for each of 1..cap rows) for the 8-bit formats and for u4m: an
# int32 and an fp32 accumulator a row and panel, the panels' weight vectors (u4m: two unpacked), and what the
# dot product needs (AVX2: the broadcast activations, their magnitudes, constants) within the ISA's registers.
# One row takes one panel at a time: the weights then stream from memory in one sequence, which the
# prefetchers follow best (1 row of a 33 MB layer, 1 thread: 4-bit 2.5 -> 1.4 ms on AVX-512, 2.5 -> 1.6 on
# AVX2; 8-bit 4.8 -> 2.7 on AVX2)
SCHEDULES = {
    "avx512": ((4, (1, 4, 3, 3)), (4, (1, 4, 3, 2))),
    "avx2": ((4, (1, 2, 1, 1)), (4, (1, 2, 1, 1))),
    "portable": ((4, (1, 2, 1, 1)), (4, (1, 2, 1, 1))),
}

# tiles of up to this many rows x panels sum a block in two chains of dot products (what registers allow)
DUAL_MAX = {"avx512": 6, "avx2": 2, "portable": 2}

# (8-bit formats, u4m): from this many rows on, a call at fp32 activations (PackedI8.many) dequantises a group of
# panels once and runs fp32 tiles; below, it converts the weights in registers (QTILE). AVX2, 1 thread, SmolLM2's
# shapes from memory: 8-bit dequantised 0.69x / 0.84x / 0.96x / 1.04x / 1.12x the fp32 kernel's speed at 4 / 8 /
# 16 / 32 / 64 rows, in registers 0.94x / 0.97x at 4 / 8 rows; u4m as native_quant's own rule (MANY_ROWS)
MANY_ROWS = {isa: (12, native_quant.MANY_ROWS[isa]) for isa in ("avx512", "avx2", "portable")}
# the in-register tiles' schedules (rows a block takes at most, panels for each), as SCHEDULES: up to 4 rows, fewer
# tiles than native_quant's 6-8 (they run 3-11 rows on AVX2 only, where the split is below 12): the library
# builds in about half the time
QSCHEDULES = {
    "avx512": ((4, (4, 4, 3, 3)), (4, (3, 3, 2, 2))),
    "avx2": ((4, (3, 2, 2, 2)), (4, (2, 2, 1, 1))),
    "portable": ((4, (3, 2, 2, 2)), (4, (2, 2, 1, 1))),
}

# A decode step streams the weights from memory: the tiles prefetch the block this many blocks ahead of the one
# they compute (a layer of 1 row on AVX-512 at 33 MB: 2.4 -> 1.8-1.9 ms; hardware prefetch alone follows
# fewer streams than a group's panels)
PREFETCH_BLOCKS = 16

_DOT = r"""
typedef uint8_t vb __attribute__((vector_size(4 * VW)));  /* VW lanes of 4 bytes: one vector register */
typedef uint8_t vbu __attribute__((vector_size(4 * VW), aligned(1)));
static inline vb bload(const uint8_t *p) { return *(const vbu *)p; }
static inline int32_t four(const int8_t *x) { int32_t t; memcpy(&t, x, 4); return t; }
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
/* dot_u: each lane += its 4 unsigned bytes of w times the 4 signed bytes at x;
   dot_s: the same with signed bytes of w (made ready by i8_prep once a load), I8_OFFSET what i8_prep added */
#if VW == 16 && defined(__AVX512VNNI__)
#define INT_PATH "avx512-vnni"
static inline vfi dot_u(vfi acc, vb w, const int8_t *x) {
    return (vfi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(four(x)));
}
#define I8_OFFSET 128
static inline vb i8_prep(vb w) { return w ^ (uint8_t)0x80; }
static inline vfi dot_s(vfi acc, vb w, const int8_t *x, const uint8_t *xa) { (void)xa; return dot_u(acc, w, x); }
#elif VW == 8 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define INT_PATH "avx-vnni"
static inline vfi dot_u(vfi acc, vb w, const int8_t *x) {
#ifdef __AVXVNNI__
    return (vfi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(four(x)));
#else
    return (vfi)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(four(x)));
#endif
}
#define I8_OFFSET 128
static inline vb i8_prep(vb w) { return w ^ (uint8_t)0x80; }
static inline vfi dot_s(vfi acc, vb w, const int8_t *x, const uint8_t *xa) { (void)xa; return dot_u(acc, w, x); }
#elif VW == 8 && defined(__AVX2__)
#define INT_PATH "avx2"
/* each sum kept in a register as it is made: GCC otherwise reassociates a tile's integer sums, makes every
   product first and spills them all to the stack (4 rows: 64 products stored and loaded again a block) */
#define KEEP(v) __asm__("" : "+x"(v))
#define HAVE_DOT16
static inline vfi dot_u(vfi acc, vb w, const int8_t *x) {
    const __m256i p = _mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(four(x)));
    acc += (vfi)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
    KEEP(acc);
    return acc;
}
/* 4-bit weights: a block's vpmaddubsw pairs summed in 16 bits (8 of them at most 8 * 2 * 15 * 127 < 2^15), one
   vpmaddwd a block rather than one a pair */
static inline vfi dot16(vfi h, vb w, const int8_t *x) {
    h = (vfi)_mm256_add_epi16((__m256i)h, _mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(four(x))));
    KEEP(h);
    return h;
}
static inline vfi widen16(vfi h) { return (vfi)_mm256_madd_epi16((__m256i)h, _mm256_set1_epi16(1)); }
#define I8_OFFSET 0
static inline vb i8_prep(vb w) { return w; }
/* |x| times w with x's sign (llama.cpp's mul_sum_i8_pairs): maddubs wants its first operand unsigned */
static inline vfi dot_s(vfi acc, vb w, const int8_t *x, const uint8_t *xa) {
    const __m256i sw = _mm256_sign_epi8((__m256i)w, _mm256_set1_epi32(four(x)));
    const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(four((const int8_t *)xa)), sw);
    acc += (vfi)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
    KEEP(acc);
    return acc;
}
#else
#define INT_PATH "portable"
static inline vfi dot_u(vfi acc, vb w, const int8_t *x) {
    for (int l = 0; l < VW; l++)
        acc[l] += w[4 * l] * x[0] + w[4 * l + 1] * x[1] + w[4 * l + 2] * x[2] + w[4 * l + 3] * x[3];
    return acc;
}
#define I8_OFFSET 0
static inline vb i8_prep(vb w) { return w; }
static inline vfi dot_s(vfi acc, vb w, const int8_t *x, const uint8_t *xa) {
    (void)xa;
    for (int l = 0; l < VW; l++)
        acc[l] += (int8_t)w[4 * l] * x[0] + (int8_t)w[4 * l + 1] * x[1] + (int8_t)w[4 * l + 2] * x[2] +
                  (int8_t)w[4 * l + 3] * x[3];
    return acc;
}
#endif
#ifndef HAVE_DOT16
static inline vfi dot16(vfi h, vb w, const int8_t *x) { return dot_u(h, w, x); }
static inline vfi widen16(vfi h) { return h; }
#endif
const char *zserve_qlinear_i8_path(void) { return INT_PATH; }

/* a tile of at most DUAL_MAX rows x panels sums each block in two chains of dependent dot products (the low and
   the high nibbles, or even and odd groups of 4 inputs), halving the latency a block waits on */
#define DUAL(MB, NP) ((MB) * (NP) <= DUAL_MAX)
/* y[MB rows][NP * VW] (+)= the rows' int8 activations times NP panels of weights in format FMT (0 i8, 1 i8m,
   2 u4m), scales (and minimums) fp16 where HALF. Each row of xq (and of xa, their magnitudes) holds RES + 1
   terms of K values: x ~ d (xq + xr / 128) where RES; each row of sq their blocks' sums, [RES + 1][K/32]; dx and
   xs the blocks' d and exact fp32 sums of x, [K/32] a row. With RES each block's sum of the second term runs in
   the second chain, and the two meet as 128 sum1 + sum2 (exact in int32: |sum1| <= 32 * 127 * 127) */
#define ITILE(MB, NP, FMT, HALF, RES)                                                                        \
    static void itile_##MB##_##NP##_##FMT##_##HALF##_##RES(                                                  \
        const int8_t *xq, const uint8_t *xa, const float *dx, const float *xs, const int32_t *sq, int K,     \
        const void *q, const void *s, const void *mn, const float *bias, float *y, long ldy) {               \
        const int KB = K / 32;                                                                               \
        const long ldq = (long)(RES + 1) * K, lds = (long)(RES + 1) * KB;                                     \
        const long qstep = FMT == 2 ? (long)K * VW / 2 : (long)K * VW; /* bytes a panel */                   \
        const int two = RES || DUAL(MB, NP);                                                                 \
        vf acc[MB][NP];                                                                                      \
        for (int p = 0; p < NP; p++) {                                                                       \
            const vf b = bias ? vload(bias + p * VW) : (vf){0};                                              \
            for (int m = 0; m < MB; m++) acc[m][p] = b;                                                      \
        }                                                                                                    \
        for (int kb = 0; kb < KB; kb++) {                                                                    \
            const long bb = FMT == 2 ? 16 * VW : 32 * VW; /* bytes a block of a panel */                     \
            for (int p = 0; p < NP; p++)                                                                     \
                for (int l = 0; l < bb; l += 64)                                                             \
                    __builtin_prefetch((const uint8_t *)q + p * qstep + (kb + PREFETCH) * bb + l);           \
            vfi ia[MB][NP], ib[MB][NP]; /* ib: the second chain of sums */                                   \
            for (int m = 0; m < MB; m++) {                                                                   \
                const int32_t ia0 = FMT == 2 ? 0 : -I8_OFFSET * sq[m * lds + kb];                            \
                const int32_t ib0 = FMT == 2 || !RES ? 0 : -I8_OFFSET * sq[m * lds + KB + kb];               \
                for (int p = 0; p < NP; p++) ia[m][p] = (vfi){0} + ia0, ib[m][p] = (vfi){0} + ib0;           \
            }                                                                                                \
            if (FMT == 2) {                                                                                  \
                for (int j = 0; j < 4; j++) {                                                                \
                    vb lo[NP], hi[NP];                                                                       \
                    for (int p = 0; p < NP; p++) {                                                           \
                        const vb v = bload((const uint8_t *)q + p * qstep + ((long)kb * 4 + j) * 4 * VW);    \
                        lo[p] = v & (uint8_t)15, hi[p] = v >> 4;                                             \
                    }                                                                                        \
                    for (int m = 0; m < MB; m++) {                                                           \
                        const int8_t *x = xq + m * ldq + kb * 32 + 4 * j;                                    \
                        for (int p = 0; p < NP; p++) {                                                       \
                            if (RES) {                                                                       \
                                ia[m][p] = dot16(dot16(ia[m][p], lo[p], x), hi[p], x + 16);                  \
                                ib[m][p] = dot16(dot16(ib[m][p], lo[p], x + K), hi[p], x + K + 16);          \
                            } else if (two) {                                                                \
                                ia[m][p] = dot16(ia[m][p], lo[p], x);                                        \
                                ib[m][p] = dot16(ib[m][p], hi[p], x + 16);                                   \
                            } else                                                                           \
                                ia[m][p] = dot16(dot16(ia[m][p], lo[p], x), hi[p], x + 16);                  \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
                for (int m = 0; m < MB; m++)                                                                 \
                    for (int p = 0; p < NP; p++) ia[m][p] = widen16(ia[m][p]), ib[m][p] = widen16(ib[m][p]); \
            } else {                                                                                         \
                for (int j = 0; j < 8; j++) {                                                                \
                    vb w[NP];                                                                                \
                    for (int p = 0; p < NP; p++)                                                             \
                        w[p] = i8_prep(bload((const uint8_t *)q + p * qstep + ((long)kb * 8 + j) * 4 * VW));  \
                    for (int m = 0; m < MB; m++) {                                                           \
                        const long at = m * ldq + kb * 32 + 4 * j;                                           \
                        for (int p = 0; p < NP; p++) {                                                       \
                            if (RES) {                                                                       \
                                ia[m][p] = dot_s(ia[m][p], w[p], xq + at, xa + at);                          \
                                ib[m][p] = dot_s(ib[m][p], w[p], xq + at + K, xa + at + K);                  \
                            } else if (two && (j & 1))                                                       \
                                ib[m][p] = dot_s(ib[m][p], w[p], xq + at, xa + at);                          \
                            else                                                                             \
                                ia[m][p] = dot_s(ia[m][p], w[p], xq + at, xa + at);                          \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            for (int p = 0; p < NP; p++) {                                                                   \
                const vf sc = SLOAD(HALF, s, ((long)p * KB + kb) * VW);                                      \
                for (int m = 0; m < MB; m++) {                                                               \
                    const vfi t = RES ? ia[m][p] * 128 + ib[m][p] : two ? ia[m][p] + ib[m][p] : ia[m][p];    \
                    acc[m][p] += __builtin_convertvector(t, vf) * (sc * (dx[m * KB + kb] * (RES ? 0x1p-7f : 1.f))); \
                }                                                                                            \
            }                                                                                                \
            if (FMT != 0)                                                                                    \
                for (int p = 0; p < NP; p++) {                                                               \
                    const vf mv = SLOAD(HALF, mn, ((long)p * KB + kb) * VW);                                 \
                    for (int m = 0; m < MB; m++) acc[m][p] += xs[m * KB + kb] * mv;                          \
                }                                                                                            \
        }                                                                                                    \
        for (int m = 0; m < MB; m++)                                                                         \
            for (int p = 0; p < NP; p++) vstore(y + m * ldy + p * VW, acc[m][p]);                            \
    }
"""

_QTILE = r"""
/* fp32 activations on this layout, the weights converted in registers (native_quant's tile, its conversion by
   shifts out of the 32-bit lanes): y[MB rows][NP * VW] (+)= x[MB][K] (q * s + m)^T, the minimums once a block
   times the block's sum of x (xs [MB][K/32]). What a few rows run where the integer products cost more than
   FMAs (AVX2's 8-bit weights from ~3 rows); many rows dequantise a group of panels once instead (many_rows) */
#define QTILE(MB, NP, FMT, HALF)                                                                             \
    static void qtile_##MB##_##NP##_##FMT##_##HALF(const float *x, long ldx, const void *q, const void *s,   \
                                                  const void *mn, const float *xs, int K, const float *bias, \
                                                  float *y, long ldy) {                                      \
        const int KB = K / 32;                                                                               \
        const long qstep = FMT == 2 ? (long)K * VW / 2 : (long)K * VW;                                       \
        vf acc[MB][NP];                                                                                      \
        for (int p = 0; p < NP; p++) {                                                                       \
            const vf b = bias ? vload(bias + p * VW) : (vf){0};                                              \
            for (int m = 0; m < MB; m++) acc[m][p] = b;                                                      \
        }                                                                                                    \
        for (int kb = 0; kb < KB; kb++) {                                                                    \
            vf sc[NP];                                                                                       \
            for (int p = 0; p < NP; p++) sc[p] = SLOAD(HALF, s, ((long)p * KB + kb) * VW);                   \
            for (int j = 0; j < (FMT == 2 ? 4 : 8); j++) {                                                   \
                vfi v[NP];                                                                                   \
                for (int p = 0; p < NP; p++)                                                                 \
                    memcpy(&v[p], (const uint8_t *)q + p * qstep + ((long)kb * (FMT == 2 ? 4 : 8) + j) * 4 * VW, \
                           sizeof(vfi));                                                                     \
                for (int t = 0; t < 4; t++) {                                                                \
                    vf w0[NP], w1[NP];                                                                       \
                    for (int p = 0; p < NP; p++) {                                                           \
                        if (FMT == 2) {                                                                      \
                            w0[p] = __builtin_convertvector((v[p] >> (8 * t)) & 15, vf) * sc[p];             \
                            w1[p] = __builtin_convertvector((v[p] >> (8 * t + 4)) & 15, vf) * sc[p];         \
                        } else                                                                               \
                            w0[p] = __builtin_convertvector((v[p] << (24 - 8 * t)) >> 24, vf) * sc[p];       \
                    }                                                                                        \
                    for (int m = 0; m < MB; m++) {                                                           \
                        const float x0 = x[m * ldx + kb * 32 + 4 * j + t];                                   \
                        const float x1 = FMT == 2 ? x[m * ldx + kb * 32 + 16 + 4 * j + t] : 0.f;             \
                        for (int p = 0; p < NP; p++)                                                         \
                            acc[m][p] = FMT == 2 ? acc[m][p] + x0 * w0[p] + x1 * w1[p] : acc[m][p] + x0 * w0[p]; \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            if (FMT != 0)                                                                                    \
                for (int p = 0; p < NP; p++) {                                                               \
                    const vf mv = SLOAD(HALF, mn, ((long)p * KB + kb) * VW);                                 \
                    for (int m = 0; m < MB; m++) acc[m][p] += xs[(long)m * KB + kb] * mv;                    \
                }                                                                                            \
        }                                                                                                    \
        for (int m = 0; m < MB; m++)                                                                         \
            for (int p = 0; p < NP; p++) vstore(y + m * ldy + p * VW, acc[m][p]);                            \
    }
"""

_ENTRY = r"""
/* rows m0..m1 of x quantised per block of 32 (llama.cpp's quantize_row_q8_0, with d in fp32): d = max |x| / 127,
   xq = x / d rounded to nearest even (rintf, the default rounding mode); where terms is 2, the rest as a second
   term, xr = (x - d xq) / (d / 128) rounded (|xr| <= 64: x ~ d (xq + xr / 128) to 1/256 of d); xa = |xq|, |xr|;
   the blocks' sums of each term and of x. Rows of xq and xa hold terms * K values, of sq terms * K/32 */
static void quantize_rows(const float *x, long ldx, int m0, int m1, int K, int terms, int8_t *xq, uint8_t *xa,
                          float *dx, float *xs, int32_t *sq) {
    const int KB = K / 32;
    for (int m = m0; m < m1; m++)
        for (int kb = 0; kb < KB; kb++) {
            const float *p = x + (long)m * ldx + kb * 32;
            float amax = 0.f, sum = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(p[i])), sum += p[i];
            /* a NaN or inf in the block (fmaxf skips NaN; the sum does not): d = NaN, so the block's product is
               NaN as the fp32 kernel's would be, and no NaN reaches the float->int conversions (undefined in C).
               A block below 1e-28 quantises to zeros (1 / d could overflow), its error below 1e-28 a weight */
            const int finite = isfinite(sum) && isfinite(amax);
            const float d = finite ? amax / 127.f : NAN, id = finite && d > 1e-30f ? 1.f / d : 0.f, id128 = id * 128.f;
            int32_t total = 0, rest = 0;
            int8_t *q = xq + (long)m * terms * K + kb * 32;
            uint8_t *a = xa + (long)m * terms * K + kb * 32;
            for (int i = 0; i < 32; i++) {
                const int v = id != 0.f ? (int)rintf(p[i] * id) : 0;
                q[i] = (int8_t)v, a[i] = (uint8_t)abs(v), total += v;
                if (terms == 2) {
                    int r = id != 0.f ? (int)rintf(fmaf(-(float)v, d, p[i]) * id128) : 0;
                    r = r > 127 ? 127 : r < -127 ? -127 : r;
                    q[K + i] = (int8_t)r, a[K + i] = (uint8_t)abs(r), rest += r;
                }
            }
            dx[(long)m * KB + kb] = d, xs[(long)m * KB + kb] = sum;
            sq[(long)m * terms * KB + kb] = total;
            if (terms == 2) sq[(long)m * terms * KB + KB + kb] = rest;
        }
}

/* x [M][K] quantised as the product does it (xq [M][terms * K], d [M][K/32]), for tests to compare with */
void zserve_quantize_rows(const float *x, long ldx, int M, int K, int terms, int8_t *xq, float *dx) {
    const int KB = K / 32;
    uint8_t *xa = malloc((size_t)M * K * terms);
    float *xs = malloc(sizeof(float) * (size_t)M * KB);
    int32_t *sq = malloc(sizeof(int32_t) * (size_t)M * KB * terms);
    if (xa && xs && sq) quantize_rows(x, ldx, 0, M, K, terms, xq, xa, dx, xs, sq);
    free(xa), free(xs), free(sq);
}

/* One panel of this kernel's layout (format fmt) -> fp32 [K][VW] at w: q * s (+ m), each weight the
   dequantised one. A 32-bit lane holds 4 consecutive inputs of one output (u4m: their low nibbles inputs 4j..4j+3
   of the block, the high ones 16 + 4j..): shifts take each out of all VW lanes at once */
static void dequant_panel(const void *q, const void *s, const void *mn, int fmt, int half, int K, float *w) {
    const int KB = K / 32;
    for (int kb = 0; kb < KB; kb++) {
        const vf sc = SLOAD(half, s, (long)kb * VW);
        const vf mv = fmt ? SLOAD(half, mn, (long)kb * VW) : (vf){0};
        float *out = w + (long)kb * 32 * VW;
        if (fmt == 2)
            for (int j = 0; j < 4; j++) {
                vfi v;
                memcpy(&v, (const uint8_t *)q + ((long)kb * 4 + j) * 4 * VW, sizeof v);
                for (int t = 0; t < 4; t++) {
                    const vfi lo = (v >> (8 * t)) & 15, hi = (v >> (8 * t + 4)) & 15;
                    vstore(out + (4 * j + t) * VW, __builtin_convertvector(lo, vf) * sc + mv);
                    vstore(out + (16 + 4 * j + t) * VW, __builtin_convertvector(hi, vf) * sc + mv);
                }
            }
        else
            for (int j = 0; j < 8; j++) {
                vfi v;
                memcpy(&v, (const int8_t *)q + ((long)kb * 8 + j) * 4 * VW, sizeof v);
                for (int t = 0; t < 4; t++) /* the byte to the top, then arithmetic shift: its sign extended */
                    vstore(out + (4 * j + t) * VW, __builtin_convertvector((v << (24 - 8 * t)) >> 24, vf) * sc + mv);
            }
    }
}

/* M >= many rows: activations stay fp32. Each group of panels is dequantised once (a scratch of its own) and
   runs through native_linear's fp32 tiles for every block of rows, as native_quant's many-row path: at 32 rows
   and more on AVX2 the integer products (two terms of vpmaddubsw + vpmaddwd) cost more than the FMAs */
static int many_rows(const float *x, long ldx, int M, const void *q, const void *s, const void *mn, int fmt,
                     int half, int N, int K, const float *bias, float *y, long ldy, int threads, size_t qbytes,
                     size_t sbytes) {
    const int blocks = (M + FCAP - 1) / FCAP, rows = (M + blocks - 1) / blocks;
    const int np = FPANELS[rows], panels = N / VW, groups = (panels + np - 1) / np;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int g = 0; g < groups; g++) {
        float *w = malloc(sizeof(float) * (size_t)np * K * VW);
        if (!w) {
            failed = 1;
            continue;
        }
        const int p0 = g * np, count = panels - p0 < np ? panels - p0 : np, width = count < np ? 1 : np;
        for (int i = 0; i < count; i++) {
            const int p = p0 + i;
            dequant_panel((const char *)q + p * qbytes, (const char *)s + p * sbytes,
                          mn ? (const char *)mn + p * sbytes : 0, fmt, half, K, w + (long)i * K * VW);
        }
        for (int i = 0; i < count; i += width) {
            const float *b = bias ? bias + (p0 + i) * VW : 0;
            for (int m0 = 0; m0 < M; m0 += rows) {
                const int mb = M - m0 < rows ? M - m0 : rows;
                float *out = y + (long)m0 * ldy + (p0 + i) * VW;
                FTILES[mb][width](x + (long)m0 * ldx, ldx, w + (long)i * K * VW, K, b, out, ldy);
            }
        }
        free(w);
    }
    return failed ? -2 : 0;
}

/* fewer rows than QMANY at fp32 activations: QTILES in native_quant's schedules, as its kernel runs */
static int few_rows(const float *x, long ldx, int M, const void *q, const void *s, const void *mn, int fmt, int half,
                    int N, int K, const float *bias, float *y, long ldy, int threads) {
    const int KB = K / 32;
    float *xs = 0; /* each row's sum over each block: what the blocks' minimums multiply */
    if (fmt) {
        xs = malloc(sizeof(float) * (size_t)M * KB);
        if (!xs) return -2;
        for (int m = 0; m < M; m++)
            for (int kb = 0; kb < KB; kb++) {
                float t = 0.f;
                for (int k = kb * 32; k < kb * 32 + 32; k++) t += x[(long)m * ldx + k];
                xs[(long)m * KB + kb] = t;
            }
    }
    const size_t qbytes = fmt == 2 ? (size_t)K * VW / 2 : (size_t)K * VW, sbytes = (half ? 2 : 4) * (size_t)KB * VW;
    const qtile_fn(*table)[QMAXP + 1] = QTILES[fmt * 2 + (half != 0)];
    const int cap = QCAP[fmt == 2], blocks = (M + cap - 1) / cap, rows = (M + blocks - 1) / blocks;
    const int np = QPANELS[fmt == 2][rows], panels = N / VW, groups = (panels + np - 1) / np;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * np, width = panels - p0 < np ? 1 : np;
        for (int p = p0; p < p0 + np && p < panels; p += width) {
            const char *qp = (const char *)q + p * qbytes, *sp = (const char *)s + p * sbytes;
            const char *mp = mn ? (const char *)mn + p * sbytes : 0;
            const float *b = bias ? bias + p * VW : 0;
            for (int m0 = 0; m0 < M; m0 += rows) {
                const int mb = M - m0 < rows ? M - m0 : rows;
                table[mb][width](x + (long)m0 * ldx, ldx, qp, sp, mp, xs ? xs + (long)m0 * KB : 0, K, b,
                                 y + (long)m0 * ldy + p * VW, ldy);
            }
        }
    }
    free(xs);
    return 0;
}

/* y [M][N] (row stride ldy) = x [M][K] quantised (in terms 1 or 2 of int8) (q * s + mn)^T (+ bias [N]) in format
   fmt (0 i8, 1 i8m, 2 u4m), scales and minimums fp16 where half; N a multiple of VW, K of 32. x is quantised
   first (its rows split over the threads), then rows in blocks of even size up to CAP against groups of
   PANELS[r] panels, the groups split over `threads` threads (torch's OpenMP pool), as native_quant's kernel.
   From `many` rows on, x stays fp32 (many_rows). */
int zserve_qlinear_i8(const float *x, long ldx, int M, const void *q, const void *s, const void *mn, int fmt,
                      int half, int N, int K, const float *bias, float *y, long ldy, int threads, int terms,
                      int many) {
    if (K % 32 || fmt < 0 || fmt > 2 || (fmt && !mn) || terms < 1 || terms > 2) return -1;
    const int KB = K / 32;
    if (M >= many && M >= QMANY[fmt == 2])
        return many_rows(x, ldx, M, q, s, mn, fmt, half, N, K, bias, y, ldy, threads,
                         fmt == 2 ? (size_t)K * VW / 2 : (size_t)K * VW, (half ? 2 : 4) * (size_t)KB * VW);
    if (M >= many)
        return few_rows(x, ldx, M, q, s, mn, fmt, half, N, K, bias, y, ldy, threads);
    int8_t *xq = malloc((size_t)M * K * terms);
    uint8_t *xa = malloc((size_t)M * K * terms);
    float *dx = malloc(sizeof(float) * (size_t)M * KB * 2);
    int32_t *sq = malloc(sizeof(int32_t) * (size_t)M * KB * terms);
    if (!xq || !xa || !dx || !sq) {
        free(xq), free(xa), free(dx), free(sq);
        return -2;
    }
    float *xs = dx + (size_t)M * KB;
    const int qthreads = M >= 4 * threads ? threads : 1, chunk = (M + qthreads - 1) / qthreads;
#pragma omp parallel for num_threads(qthreads) schedule(static) if (qthreads > 1)
    for (int t = 0; t < qthreads; t++)
        quantize_rows(x, ldx, t * chunk, (t + 1) * chunk < M ? (t + 1) * chunk : M, K, terms, xq, xa, dx, xs, sq);
    const size_t qbytes = fmt == 2 ? (size_t)K * VW / 2 : (size_t)K * VW, sbytes = (half ? 2 : 4) * (size_t)KB * VW;
    const itile_fn(*table)[MAXP + 1] = ITILES[terms - 1][fmt * 2 + (half != 0)];
    const int cap = CAP[fmt == 2], blocks = (M + cap - 1) / cap, rows = (M + blocks - 1) / blocks;
    const int np = PANELS[fmt == 2][rows], panels = N / VW, groups = (panels + np - 1) / np;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * np, width = panels - p0 < np ? 1 : np; /* a last, partial group one panel at a time */
        for (int p = p0; p < p0 + np && p < panels; p += width) {
            const char *qp = (const char *)q + p * qbytes, *sp = (const char *)s + p * sbytes;
            const char *mp = mn ? (const char *)mn + p * sbytes : 0;
            const float *b = bias ? bias + p * VW : 0;
            for (int m0 = 0; m0 < M; m0 += rows) {
                const int mb = M - m0 < rows ? M - m0 : rows;
                table[mb][width](xq + (long)m0 * K * terms, xa + (long)m0 * K * terms, dx + (long)m0 * KB,
                                 xs + (long)m0 * KB, sq + (long)m0 * KB * terms, K, qp, sp, mp, b,
                                 y + (long)m0 * ldy + p * VW, ldy);
            }
        }
    }
    free(xq), free(xa), free(dx), free(sq);
    return 0;
}
"""


def source(isa: str, schedules: tuple | None = None, dual: int | None = None, prefetch: int | None = None) -> str:
    """The C source for ``isa`` (with ``schedules`` in ``SCHEDULES``' form, or the ISA's own): the tiles in
    every format, the activations' quantisation and the entry point."""
    schedules = schedules or SCHEDULES[isa]
    cap = max(c for c, _ in schedules)
    max_panels = max(max(p) for _, p in schedules)
    combos = [(fmt, half) for fmt in range(len(FORMATS)) for half in (0, 1)]

    def tiles(fmt: int) -> list[tuple[int, int]]:
        cap, panels = schedules[fmt == 2]
        return sorted({(mb, np) for r in range(1, cap + 1) for mb in range(1, r + 1) for np in (panels[r - 1], 1)})

    def table(fmt: int, half: int, res: int) -> str:
        have = set(tiles(fmt))
        rows = (
            "        {"
            + ", ".join(
                f"itile_{mb}_{np}_{fmt}_{half}_{res}" if (mb, np) in have else "0" for np in range(max_panels + 1)
            )
            + "},"
            for mb in range(cap + 1)
        )
        return "    {\n" + "\n".join(rows) + "\n    },"

    def row(values: tuple[int, ...], cap: int = cap) -> str:
        return "{" + ", ".join(map(str, (0, *values, *[values[-1]] * (cap - len(values))))) + "}"

    # the many-row path's fp32 tiles: native_quant's schedule for them
    fcap, fpanels = native_quant._SCHEDULES[isa][0]
    ftiles = sorted({(mb, np) for r in range(1, fcap + 1) for mb in range(1, r + 1) for np in (fpanels[r - 1], 1)})
    fmaxp = max(fpanels)
    ftable = "\n".join(
        "    {" + ", ".join(f"ftile_{mb}_{np}" if (mb, np) in ftiles else "0" for np in range(fmaxp + 1)) + "},"
        for mb in range(fcap + 1)
    )
    # the few-row fp32-activation tiles (8-bit formats, u4m)
    qsched = QSCHEDULES[isa]
    qcap = max(c for c, _ in qsched)
    qmaxp = max(max(p) for _, p in qsched)

    def qtiles(fmt: int) -> list[tuple[int, int]]:
        cap, panels = qsched[fmt == 2]
        return sorted({(mb, np) for r in range(1, cap + 1) for mb in range(1, r + 1) for np in (panels[r - 1], 1)})

    def qtable(fmt: int, half: int) -> str:
        have = set(qtiles(fmt))
        rows = (
            "        {"
            + ", ".join(f"qtile_{mb}_{np}_{fmt}_{half}" if (mb, np) in have else "0" for np in range(qmaxp + 1))
            + "},"
            for mb in range(qcap + 1)
        )
        return "    {\n" + "\n".join(rows) + "\n    },"

    return (
        c_build.vectors(c_build.ISAS[isa].width)
        + f"static const int CAP[2] = {{{schedules[0][0]}, {schedules[1][0]}}};\n#define MAXP {max_panels}\n"
        + f"#define DUAL_MAX {DUAL_MAX[isa] if dual is None else dual}\n"
        + f"#define PREFETCH {PREFETCH_BLOCKS if prefetch is None else prefetch}\n"
        + f"static const int PANELS[2][{cap + 1}] = {{{row(schedules[0][1])}, {row(schedules[1][1])}}};\n"
        + "typedef void (*itile_fn)(const int8_t *, const uint8_t *, const float *, const float *, const int32_t *,"
        + " int, const void *, const void *, const void *, const float *, float *, long);\n"
        + native_quant._CONVERT
        + f"#define FCAP {fcap}\nstatic const int FPANELS[{fcap + 1}] = {row(fpanels, fcap)};\n"
        + "typedef void (*ftile_fn)(const float *, long, const float *, int, const float *, float *, long);\n"
        + native_linear.fp32_tile_source("FTILE", "ftile")
        + "\n".join(f"FTILE({mb}, {np})" for mb, np in ftiles)
        + f"\nstatic const ftile_fn FTILES[{fcap + 1}][{fmaxp + 1}] = {{\n{ftable}\n}};\n"
        + f"static const int QCAP[2] = {{{qsched[0][0]}, {qsched[1][0]}}};\n#define QMAXP {qmaxp}\n"
        + f"static const int QPANELS[2][{qcap + 1}] = {{{row(qsched[0][1], qcap)}, {row(qsched[1][1], qcap)}}};\n"
        + f"static const int QMANY[2] = {{{MANY_ROWS[isa][0]}, {MANY_ROWS[isa][1]}}};\n"
        + "typedef void (*qtile_fn)(const float *, long, const void *, const void *, const void *, const float *,"
        + " int, const float *, float *, long);\n"
        + _QTILE
        + "\n".join(f"QTILE({mb}, {np}, {fmt}, {half})" for fmt, half in combos for mb, np in qtiles(fmt))
        + f"\nstatic const qtile_fn QTILES[{len(combos)}][{qcap + 1}][{qmaxp + 1}] = {{\n"
        + "\n".join(qtable(fmt, half) for fmt, half in combos)
        + "\n};\n"
        + _DOT
        + "\n".join(
            f"ITILE({mb}, {np}, {fmt}, {half}, {res})"
            for res in (0, 1)
            for fmt, half in combos
            for mb, np in tiles(fmt)
        )
        + f"\nstatic const itile_fn ITILES[2][{len(combos)}][{cap + 1}][{max_panels + 1}] = {{\n"
        + "\n".join("{" + "\n".join(table(fmt, half, res) for fmt, half in combos) + "}," for res in (0, 1))
        + "\n};\n"
        + _ENTRY
    )


@functools.cache
def _library(isa: str, schedules: tuple | None = None) -> ctypes.CDLL | None:
    chosen = c_build.for_name(isa)
    name = f"qlinear-i8-{isa}"
    lib = c_build.build(name, source(isa, schedules), [*chosen.flags, "-fopenmp"], "the int8-activation products")
    if lib is None:
        return None
    ptr, c_long, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.zserve_qlinear_i8.argtypes = [ptr, c_long, c_int, ptr, ptr, ptr, c_int, c_int, c_int, c_int, ptr, ptr, c_long,
                                      c_int, c_int, c_int]  # fmt: skip
    lib.zserve_qlinear_i8.restype = c_int
    lib.zserve_quantize_rows.argtypes = [ptr, c_long, c_int, c_int, c_int, ptr, ptr]
    lib.zserve_quantize_rows.restype = None
    lib.zserve_qlinear_i8_path.restype = ctypes.c_char_p
    return lib


def instructions(isa: str) -> str | None:
    """Which integer dot product the kernel built for ``isa`` runs (avx512-vnni, avx-vnni, avx2, portable), or
    None where it does not build."""
    lib = _library(isa)
    return None if lib is None else lib.zserve_qlinear_i8_path().decode()


def applies(q: torch.Tensor, out_features: int, in_features: int, isa: str) -> bool:
    """The kernel takes this weight: whole panels and blocks, it builds here, and no 8-bit value is -128 (AVX2's
    sign trick negates the weight: -128 has no int8 negation; GGUF's Q8_0 and our int8 hold -127..127)."""
    return (
        native_quant.applies(out_features, in_features, isa)
        and _library(isa) is not None
        and (q.dtype != torch.int8 or q.numel() == 0 or int(q.min()) > -128)
    )


@dataclass(frozen=True)
class PackedI8(native_quant.Packed):
    """A weight in this kernel's layout for ``isa``: ``q`` [N/W, K/32, 8, W, 4] int8 (``i8``, ``i8m``) or
    [N/W, K/32, 4, W, 4] uint8 (``u4m``: inputs 0-15 of a block low nibbles, 16-31 high); ``s``, ``m`` as
    ``native_quant.Packed``'s; ``terms``: the activations in 1 or 2 terms of int8 (``TERMS``)."""

    terms: int = 2
    # from this many rows on a call keeps its activations fp32 (the weights dequantised a group of panels at a
    # time, fp32 tiles): where the integer products cost more than FMAs (AVX2's two terms from ~8-16 rows)
    many: int = NEVER

    @property
    def width(self) -> int:
        return self.q.shape[3]

    @property
    def shape(self) -> tuple[int, int]:
        panels, blocks, _, width, _ = self.q.shape
        return panels * width, blocks * BLOCK

    def values(self) -> torch.Tensor:
        panels, blocks, _, width, _ = self.q.shape
        q = self.q
        if self.fmt == "u4m":
            q = torch.stack([q & 15, q >> 4], dim=2)  # [P, KB, 2, 4, W, 4]
            q = q.permute(0, 4, 1, 2, 3, 5)
        else:
            q = q.permute(0, 3, 1, 2, 4)
        return q.to(torch.int16).reshape(panels * width, blocks * BLOCK)

    @functools.cached_property
    def entry(self) -> tuple:
        """The C function and its arguments that stay the same from call to call."""
        return _library(self.isa).zserve_qlinear_i8, self.call_args

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        width = self.width
        panel, lane = ids // width, ids % width
        q = self.q[panel, :, :, lane, :]  # [T, KB, G, 4]
        if self.fmt == "u4m":
            q = torch.stack([q & 15, q >> 4], dim=2)
        q = q.reshape(len(ids), -1)
        w = q.float() * self.s[panel, :, lane].float().repeat_interleave(BLOCK, dim=1)
        return w if self.m is None else w + self.m[panel, :, lane].float().repeat_interleave(BLOCK, dim=1)


def pack(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None, isa: str | None = None,
         bits: int = 8, terms: int = TERMS, many: int = NEVER) -> PackedI8:  # fmt: skip
    """(q [N, K] integers, s and m [N, K/32] or m None) -> this kernel's layout for ``isa``, in the format
    ``native_quant.pack`` would choose (``u4m`` where ``bits`` is 4, else ``i8`` / ``i8m``), its activations
    to be quantised in ``terms`` terms, fp32 from ``many`` rows on (clamped to 1..``NEVER``: C takes an int)."""
    isa = isa or native_quant.default_isa()
    many = max(1, min(int(many), NEVER))  # 2**31 would wrap to a negative int: every call at fp32 activations
    width = c_build.ISAS[isa].width
    n, k = q.shape
    panels, blocks = n // width, k // BLOCK
    if bits == 4:
        if m is None:
            m = torch.zeros_like(s, dtype=torch.float32)
        # [P, W, KB, half, j, t] -> [P, KB, half, j, W, t]: input kb*32 + 16 half + 4 j + t
        v = q.to(torch.uint8).reshape(panels, width, blocks, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
        qp, fmt = (v[:, :, 0] | (v[:, :, 1] << 4)).contiguous(), "u4m"
    else:
        v = q.to(torch.int8).reshape(panels, width, blocks, 8, 4).permute(0, 2, 3, 1, 4)
        qp, fmt = v.contiguous(), "i8" if m is None else "i8m"
    half = native_quant._exact_half(s) and (m is None or native_quant._exact_half(m))
    sp = native_quant.pack_blocks(s, isa, half)
    return PackedI8(fmt, qp, sp, None if m is None else native_quant.pack_blocks(m, isa, half), isa, terms, many)


def quantize_activations(x: torch.Tensor, terms: int = TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, terms * K] int8, d [M, K/32] fp32) as the kernel quantises it: per block of 32,
    d = max |x| / 127 and xq = x * (1 / d) rounded to nearest even (the same fp32 operations: the same bits);
    where ``terms`` is 2, each row's second K values the rest, (x - d xq) * (128 / d) rounded (x - d xq as one
    fused multiply-add: exact in float64, then rounded once), so that x ~ d (xq + xr / 128)."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    finite = blocks.sum(dim=2).isfinite() & blocks.abs().amax(dim=2).isfinite()  # a NaN or inf: d = NaN, xq = 0
    d = torch.where(
        finite, blocks.abs().nan_to_num(0.0).amax(dim=2) / 127.0, torch.full_like(blocks[..., 0], torch.nan)
    )
    live = finite & (d > 1e-30)  # as the kernel: a block below 1e-28 quantises to zeros
    inv = torch.where(live, 1.0 / torch.where(live, d, torch.ones_like(d)), torch.zeros_like(d))
    blocks = torch.where(live.unsqueeze(2), blocks, torch.zeros_like(blocks))
    xq = torch.round(blocks * inv.unsqueeze(2))
    if terms == 1:
        return xq.to(torch.int8).reshape(rows, k), d
    rest = (blocks.double() - xq.double() * d.double().unsqueeze(2)).float()
    xr = torch.round(rest * (inv * 128.0).unsqueeze(2)).clamp_(-127, 127)
    return torch.cat([xq.reshape(rows, k), xr.reshape(rows, k)], dim=1).to(torch.int8), d


def dequantize_activations(xq: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """What ``quantize_activations``' (xq, d) stand for, [M, K] float64: d (xq + xr / 128), or d xq."""
    k = d.shape[1] * BLOCK
    scale = d.double().repeat_interleave(BLOCK, dim=1)
    x = xq[:, :k].double() * scale
    return x if xq.shape[1] == k else x + xq[:, k:].double() * scale / 128


def reference(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, terms: int = TERMS,
) -> torch.Tensor:  # fmt: skip
    """What the kernel computes, in float64: x [M, K] quantised (``quantize_activations``) times the weights
    q * s [N, K], plus each block's minimum times the block's exact sum of x (and ``bias``)."""
    y = dequantize_activations(*quantize_activations(x, terms)) @ native_quant.dequantize(q, s).double().T
    if m is not None:
        sums = x.double().reshape(x.shape[0], -1, BLOCK).sum(dim=2)
        y += sums @ m.double().T
    return y if bias is None else y + bias.double()


def quantize_in_c(x: torch.Tensor, isa: str | None = None, terms: int = TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_activations`` as the C kernel does it (what the tests compare against torch's)."""
    lib = _library(isa or native_quant.default_isa())
    x = x.float().contiguous()
    xq = torch.empty(x.shape[0], terms * x.shape[1], dtype=torch.int8)
    d = torch.empty(x.shape[0], x.shape[1] // BLOCK)
    lib.zserve_quantize_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], terms, xq.data_ptr(), d.data_ptr())
    return xq, d


def linear(x: torch.Tensor, w: PackedI8, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., K] fp32 through the ``pack``-ed weight ``w`` (and a contiguous fp32 ``bias`` [N], or None),
    its rows quantised to int8 on the way."""
    # a decode step makes ~120 of these calls: each step below a few hundred ns (the call was 11 us, 3 of them C)
    kernel, args = w.entry
    n, k = args[5], args[6]
    rows = native_quant.input_rows(x, k)
    count = rows.shape[0]
    y = torch.empty((count, n), dtype=torch.float32)
    if count:
        rc = kernel(rows.data_ptr(), rows.stride(0), count, *args, None if bias is None else bias.data_ptr(),
                    y.data_ptr(), n, torch.get_num_threads(), w.terms, w.many)  # fmt: skip
        if rc:
            raise RuntimeError(f"int8 quantised linear: K = {k} is not a multiple of {BLOCK}, or out of memory ({rc})")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
