"""A C kernel for linear layers whose weights stay quantised in memory: y = x w^T + b with w = q * s (+ m),
one scale s (and, for some formats, a minimum m) per output and block of 32 inputs. That form holds GGUF's
Q8_0, Q4_0, Q4_1 and Q4_K exactly (``zserve/gguf_quant.py``) and per-output-channel symmetric int8 (the row's
one scale repeated over its blocks).

Why: a decode step on a CPU reads every weight once and is bound by memory bandwidth; int8 reads 1 byte a
weight where fp32 reads 4, and 4-bit values packed two a byte read half a byte.

The layout is ``native_linear``'s panels (W the floats in one vector register of the ISA: 16 AVX-512, 8
AVX2, 4 portable), in one of three formats (``Packed``):

- ``i8``: q int8 [N/W][K][W]; Q8_0 and per-channel int8;
- ``i8m``: the same with a minimum per block (a product stacking 8-bit and 4-bit parts);
- ``u4m``: 4-bit values 0..15 two a byte, [N/W][K/2][W] (input 2j in the low nibble, 2j+1 in the high),
  with a minimum per block: Q4_1 and Q4_K as they are, Q4_0 as w = d v - 8 d.

Scales and minimums are [N/W][K/32][W], fp16 where that holds them exactly (GGUF's Q8_0, Q4_0 and Q4_1
store fp16 scales: 2 bytes a block, so Q4_1 takes 0.625 bytes a weight), else fp32 (Q4_K's d * sc, the
per-channel int8 scale). The tile converts each weight vector to fp32 in registers, multiplies it by its
block's scale (exactly the dequantised fp32 weight: q * s is one rounding of the same product) and FMAs it
into one accumulator per row and panel, over the inputs in order; the minimums are added once a block, times
the block's sum of x. Activations stay fp32 (no int8 dot products): what this costs in arithmetic is the
conversion, shared by every row of a tile.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from zserve.generator import c_build, native_linear

BLOCK = 32  # inputs per scale: GGUF's Q8_0 block
FORMATS = ("i8", "i8m", "u4m")  # see the module's docstring

# (rows a block takes at most, panels for each block size) for the 8-bit formats and for u4m: what fits the
# ISA's registers with the accumulators, the converted weight vectors and their scales (AVX-512: 32
# registers, AVX2/portable: 16); u4m holds two converted weight vectors a panel (and the nibble mask)
_SCHEDULES = {
    "avx512": ((8, (8, 6, 4, 4, 4, 3, 3, 3)), (8, (6, 6, 4, 4, 4, 3, 3, 2))),
    "avx2": ((6, (4, 3, 3, 2, 2, 2)), (6, (3, 2, 2, 2, 1, 1))),
    "portable": ((6, (4, 3, 3, 2, 2, 2)), (6, (3, 2, 2, 2, 1, 1))),
}

# from this many rows on, a u4m product dequantises a group of panels once to fp32 and runs fp32 tiles
# (at 8 rows of a 3072 x 576 product 0.39 -> 0.35 ms on AVX-512, 0.44 -> 0.38 on AVX2; at 4 rows slower)
MANY_ROWS = {"avx512": 8, "avx2": 6, "portable": 6}

_CONVERT = r"""
/* VW int8 at p -> VW floats; VW bytes of two 4-bit values each -> the low and the high nibbles' VW floats;
   VW fp16 -> VW floats. GCC lowers __builtin_convertvector from int8 lanes to one scalar conversion a lane
   (16 movsbl + vpinsrd a vector, 3x slower than fp32's product), so x86's extensions by hand */
#if VW == 16 && defined(__AVX512F__)
#include <immintrin.h>
static inline vf vq2f(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void vq4f(const uint8_t *p, vf *lo, vf *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
static inline vf vh2f(const uint16_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif VW == 8 && defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
static inline vf vq2f(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void vq4f(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *hi = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
static inline vf vh2f(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vf vq2f(const int8_t *p) {
    vfi v;
    for (int i = 0; i < VW; i++) v[i] = p[i];
    return __builtin_convertvector(v, vf);
}
static inline void vq4f(const uint8_t *p, vf *lo, vf *hi) {
    vfi l, h;
    for (int i = 0; i < VW; i++) l[i] = p[i] & 15, h[i] = p[i] >> 4;
    *lo = __builtin_convertvector(l, vf), *hi = __builtin_convertvector(h, vf);
}
/* fp16 bits -> float: the exponent and mantissa moved into a float's place read 2^-112 times the value
   (subnormals included), so one product by 2^112 restores it exactly; infinities and NaNs apart */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = h & 0x7fff;
    union { uint32_t u; float f; } v;
    if (em >= 0x7c00) {
        v.u = sign | 0x7f800000 | (em & 0x3ff) << 13;
        return v.f;
    }
    v.u = em << 13;
    v.f *= 0x1p112f;
    v.u |= sign;
    return v.f;
}
static inline vf vh2f(const uint16_t *p) {
    vf v;
    for (int i = 0; i < VW; i++) v[i] = h2f(p[i]);
    return v;
}
#endif
/* a block's VW scales (or minimums): fp16 or fp32 */
#define SLOAD(HALF, base, i) ((HALF) ? vh2f((const uint16_t *)(base) + (i)) : vload((const float *)(base) + (i)))
"""

_TILE = r"""
/* y[MB rows][NP * VW] = x[MB][K] (q * s + m)^T (+ bias): FMT 0 (i8) q NP panels [K][VW] int8; 1 (i8m) the
   same with minimums; 2 (u4m) NP panels [K/2][VW] of two 4-bit values a byte, with minimums. s and m NP
   panels [K/32][VW], fp16 where HALF. The minimums are not added to each weight but once a block, times the
   block's sum of x (xs [MB][K/32]): one FMA a block where adding them cost one operation a weight vector.
   (Multiplying one row's block sums by the scale once a block, not each weight vector, measured 5-25%
   slower on both ISAs.) */
#define TILE(MB, NP, FMT, HALF)                                                                              \
    static void tile_##MB##_##NP##_##FMT##_##HALF(const float *x, long ldx, const void *q, const void *s,    \
                                                 const void *mn, const float *xs, int K, const float *bias,  \
                                                 float *y, long ldy) {                                       \
        vf acc[MB][NP];                                                                                      \
        for (int p = 0; p < NP; p++) {                                                                       \
            const vf b = bias ? vload(bias + p * VW) : (vf){0};                                              \
            for (int m = 0; m < MB; m++) acc[m][p] = b;                                                      \
        }                                                                                                    \
        const int KB = K / 32;                                                                               \
        for (int kb = 0; kb < KB; kb++) {                                                                    \
            vf sc[NP];                                                                                       \
            for (int p = 0; p < NP; p++) sc[p] = SLOAD(HALF, s, ((long)p * KB + kb) * VW);                   \
            if (FMT == 2) {                                                                                  \
                for (int k = kb * 32; k < kb * 32 + 32; k += 2) {                                            \
                    vf w0[NP], w1[NP];                                                                       \
                    for (int p = 0; p < NP; p++) {                                                           \
                        vq4f((const uint8_t *)q + ((long)p * K + k) / 2 * VW, &w0[p], &w1[p]);               \
                        w0[p] *= sc[p], w1[p] *= sc[p];                                                      \
                    }                                                                                        \
                    for (int m = 0; m < MB; m++) {                                                           \
                        const float x0 = x[m * ldx + k], x1 = x[m * ldx + k + 1];                            \
                        for (int p = 0; p < NP; p++) acc[m][p] += x0 * w0[p] + x1 * w1[p];                   \
                    }                                                                                        \
                }                                                                                            \
            } else {                                                                                         \
                for (int k = kb * 32; k < kb * 32 + 32; k++) {                                               \
                    vf wv[NP];                                                                               \
                    for (int p = 0; p < NP; p++)                                                             \
                        wv[p] = vq2f((const int8_t *)q + ((long)p * K + k) * VW) * sc[p];                    \
                    for (int m = 0; m < MB; m++) {                                                           \
                        const float xv = x[m * ldx + k];                                                     \
                        for (int p = 0; p < NP; p++) acc[m][p] += xv * wv[p];                                \
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
/* Many rows of u4m: converting every weight vector again for each block of rows costs more than the
   products (at 32 rows 1.35x i8's time). A group of panels is then dequantised once into fp32 panels,
   q * s + m, and those run through fp32 tiles (native_linear's, spliced in as FTILE) for every block of rows:
   1.68 -> 1.26 ms at 32 rows of a 3072 x 576 product, 3.3 -> 2.3 at 64, on AVX-512 and AVX2 alike (the fp32
   kernel: 1.50, 2.52).
   The 8-bit formats gain nothing from it below 64 rows and lose at 16-32 (0.64 -> 0.80 ms at 16) */
/* one panel [K][VW] of format fmt -> fp32 [K][VW] at w: q * s (+ m), each weight the dequantised one */
static void dequant_panel(const void *q, const void *s, const void *mn, int fmt, int half, int K, float *w) {
    const int KB = K / 32;
    for (int kb = 0; kb < KB; kb++) {
        const vf sc = half ? vh2f((const uint16_t *)s + (long)kb * VW) : vload((const float *)s + (long)kb * VW);
        vf mv = {0};
        if (fmt) mv = half ? vh2f((const uint16_t *)mn + (long)kb * VW) : vload((const float *)mn + (long)kb * VW);
        for (int k = kb * 32; k < kb * 32 + 32; k += 2) {
            vf w0, w1;
            if (fmt == 2)
                vq4f((const uint8_t *)q + (long)k / 2 * VW, &w0, &w1);
            else
                w0 = vq2f((const int8_t *)q + (long)k * VW), w1 = vq2f((const int8_t *)q + (long)(k + 1) * VW);
            vstore(w + (long)k * VW, w0 * sc + mv);
            vstore(w + (long)(k + 1) * VW, w1 * sc + mv);
        }
    }
}
"""

_ENTRY = r"""
/* M >= MANY rows: each group of panels dequantised once (a scratch of its own, per group), then fp32 tiles
   over every block of rows, in the 8-bit formats' schedule */
static int many_rows(const float *x, long ldx, int M, const void *q, const void *s, const void *mn, int fmt,
                     int half, int N, int K, const float *bias, float *y, long ldy, int threads, size_t qbytes,
                     size_t sbytes) {
    const int blocks = (M + CAP[0] - 1) / CAP[0], rows = (M + blocks - 1) / blocks;
    const int np = PANELS[0][rows], panels = N / VW, groups = (panels + np - 1) / np;
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

/* y [M][N] (row stride ldy) = x [M][K] (row stride ldx) (q * s + mn)^T (+ bias [N]) in format fmt (0 i8,
   1 i8m, 2 u4m), scales and minimums fp16 where half; N a multiple of VW, K of 32.
   Rows in blocks of even size up to CAP, a block of r rows against groups of PANELS[r] panels (each the
   format's: 8-bit or u4m), the groups split over `threads` threads (torch's OpenMP pool). */
int zserve_qlinear(const float *x, long ldx, int M, const void *q, const void *s, const void *mn, int fmt,
                   int half, int N, int K, const float *bias, float *y, long ldy, int threads) {
    if (K % 32 || fmt < 0 || fmt > 2 || (fmt && !mn)) return -1;
    const int KB = K / 32;
    const size_t qbytes = fmt == 2 ? (size_t)K * VW / 2 : (size_t)K * VW, sbytes = (half ? 2 : 4) * (size_t)KB * VW;
    if (fmt == 2 && M >= MANY)
        return many_rows(x, ldx, M, q, s, mn, fmt, half, N, K, bias, y, ldy, threads, qbytes, sbytes);
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
    const tile_fn(*table)[MAXP + 1] = TILES[fmt * 2 + (half != 0)];
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
                table[mb][width](x + (long)m0 * ldx, ldx, qp, sp, mp, xs ? xs + (long)m0 * KB : 0, K, b,
                                 y + (long)m0 * ldy + p * VW, ldy);
            }
        }
    }
    free(xs);
    return 0;
}
"""


def source(isa: str) -> str:
    """The C source for ``isa``: the tiles its schedules run, in every format, and the entry point."""
    schedules = _SCHEDULES[isa]
    cap = max(c for c, _ in schedules)
    max_panels = max(max(p) for _, p in schedules)
    combos = [(fmt, half) for fmt in range(len(FORMATS)) for half in (0, 1)]

    def tiles(fmt: int) -> list[tuple[int, int]]:
        cap, panels = schedules[fmt == 2]
        return sorted({(mb, np) for r in range(1, cap + 1) for mb in range(1, r + 1) for np in (panels[r - 1], 1)})

    def table(fmt: int, half: int) -> str:
        have = set(tiles(fmt))
        rows = (
            "        {"
            + ", ".join(f"tile_{mb}_{np}_{fmt}_{half}" if (mb, np) in have else "0" for np in range(max_panels + 1))
            + "},"
            for mb in range(cap + 1)
        )
        return "    {\n" + "\n".join(rows) + "\n    },"

    def ftable() -> str:
        have = set(tiles(0))
        return "\n".join(
            "    {" + ", ".join(f"ftile_{mb}_{np}" if (mb, np) in have else "0" for np in range(max_panels + 1)) + "},"
            for mb in range(cap + 1)
        )

    def row(values: tuple[int, ...]) -> str:
        return "{" + ", ".join(map(str, (0, *values, *[values[-1]] * (cap - len(values))))) + "}"

    return (
        c_build.vectors(c_build.ISAS[isa].width)
        + f"static const int CAP[2] = {{{schedules[0][0]}, {schedules[1][0]}}};\n#define MAXP {max_panels}\n"
        + f"#define MANY {MANY_ROWS[isa]}\n"
        + f"static const int PANELS[2][{cap + 1}] = {{{row(schedules[0][1])}, {row(schedules[1][1])}}};\n"
        + "typedef void (*tile_fn)(const float *, long, const void *, const void *, const void *, const float *,"
        + " int, const float *, float *, long);\n"
        + "typedef void (*ftile_fn)(const float *, long, const float *, int, const float *, float *, long);\n"
        + _CONVERT
        + _TILE
        + native_linear.fp32_tile_source("FTILE", "ftile")
        + "\n".join(f"TILE({mb}, {np}, {fmt}, {half})" for fmt, half in combos for mb, np in tiles(fmt))
        + "\n"
        + "\n".join(f"FTILE({mb}, {np})" for mb, np in tiles(0))
        + f"\nstatic const ftile_fn FTILES[{cap + 1}][{max_panels + 1}] = {{\n{ftable()}\n}};"
        + f"\nstatic const tile_fn TILES[{len(combos)}][{cap + 1}][{max_panels + 1}] = {{\n"
        + "\n".join(table(fmt, half) for fmt, half in combos)
        + "\n};\n"
        + _ENTRY
    )


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    chosen = c_build.for_name(isa)
    lib = c_build.build(f"qlinear-{isa}", source(isa), [*chosen.flags, "-fopenmp"], "the quantised linear layers")
    if lib is None:
        return None
    ptr, c_long, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.zserve_qlinear.argtypes = [ptr, c_long, c_int, ptr, ptr, ptr, c_int, c_int, c_int, c_int, ptr, ptr, c_long,
                                   c_int]  # fmt: skip
    lib.zserve_qlinear.restype = c_int
    return lib


def default_isa() -> str:
    return c_build.isa().name


def applies(out_features: int, in_features: int, isa: str | None = None) -> bool:
    """The kernel takes this shape (whole panels of outputs, whole blocks of inputs) and builds here."""
    isa = isa or default_isa()
    return out_features % c_build.ISAS[isa].width == 0 and in_features % BLOCK == 0 and _library(isa) is not None


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8, s [N, K/32] fp32): per output channel, symmetric (q = round(w / s),
    s = max |w| / 127, one scale for the row, repeated over its ceil(K/32) blocks)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, q = 0
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.expand(-1, -(-w.shape[1] // BLOCK)).contiguous()


def dequantize(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """(q [N, K] integer values, s [N, ceil(K/32)], and a minimum per block m like s, or None) -> the fp32
    weight [N, K] they stand for: q * s (+ m)."""
    w = q.float() * s.float().repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]
    return w if m is None else w + m.float().repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]


def _exact_half(t: torch.Tensor) -> bool:
    h = t.half()
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t.float())


@dataclass(frozen=True)
class Packed:
    """A weight in the kernel's panels for ``isa``: ``q`` (int8 [N/W, K, W], or uint8 [N/W, K/2, W] for
    ``u4m``), ``s`` and ``m`` [N/W, K/32, W] fp16 or fp32 (``m`` None for ``i8``)."""

    fmt: str
    q: torch.Tensor
    s: torch.Tensor
    m: torch.Tensor | None
    isa: str

    @property
    def width(self) -> int:
        return self.q.shape[2]

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the weight."""
        panels, k, width = self.q.shape
        return panels * width, k * 2 if self.fmt == "u4m" else k

    @functools.cached_property
    def call_args(self) -> tuple:
        """The kernel's arguments that stay the same from call to call (a decode step makes ~120 calls)."""
        n, k = self.shape
        m = None if self.m is None else self.m.data_ptr()
        fmt, half = FORMATS.index(self.fmt), int(self.s.dtype == torch.float16)
        return self.q.data_ptr(), self.s.data_ptr(), m, fmt, half, n, k

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.m) if t is not None)

    def values(self) -> torch.Tensor:
        """q [N, K] as the integers it holds (int16: 0..15 for ``u4m``, -128..127 else)."""
        panels, k, width = self.q.shape
        q = self.q
        if self.fmt == "u4m":
            q = torch.stack([q & 15, q >> 4], dim=2).reshape(panels, 2 * k, width)
        return q.to(torch.int16).transpose(1, 2).reshape(panels * width, -1)

    def blocks(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Scales or minimums back as [N, K/32] fp32."""
        if t is None:
            return None
        panels, blocks, width = t.shape
        return t.float().transpose(1, 2).reshape(panels * width, blocks)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] this stands for."""
        return dequantize(self.values(), self.blocks(self.s), self.blocks(self.m))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantised weight, [len(ids), K] fp32 (an embedding's lookup)."""
        width = self.width
        panel, lane = ids // width, ids % width
        q = self.q[panel, :, lane]  # [T, K] (or K/2 bytes)
        if self.fmt == "u4m":
            q = torch.stack([q & 15, q >> 4], dim=2).reshape(len(ids), -1)
        w = q.float() * self.s[panel, :, lane].float().repeat_interleave(BLOCK, dim=1)
        return w if self.m is None else w + self.m[panel, :, lane].float().repeat_interleave(BLOCK, dim=1)


def pack(
    q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None = None, isa: str | None = None, bits: int = 8
) -> Packed:
    """(q [N, K] integers, s and m [N, K/32] or m None) -> the kernel's panels for ``isa``: ``u4m`` where
    ``bits`` is 4 (q 0..15; m zeros where None), else ``i8`` / ``i8m``. Scales and minimums kept fp16 where
    that holds them exactly."""
    isa = isa or default_isa()
    width = c_build.ISAS[isa].width
    n, k = q.shape
    qp = q.reshape(n // width, width, k).transpose(1, 2)
    if bits == 4:
        if m is None:
            m = torch.zeros_like(s, dtype=torch.float32)
        qp = qp.to(torch.uint8)
        qp, fmt = (qp[:, 0::2] | (qp[:, 1::2] << 4)).contiguous(), "u4m"
    else:
        qp, fmt = qp.to(torch.int8).contiguous(), "i8" if m is None else "i8m"
    half = _exact_half(s) and (m is None or _exact_half(m))
    return Packed(fmt, qp, pack_blocks(s, isa, half), None if m is None else pack_blocks(m, isa, half), isa)


def pack_blocks(s: torch.Tensor, isa: str | None = None, half: bool = False) -> torch.Tensor:
    """Scales or minimums [N, K/32] -> the kernel's panels [N/W, K/32, W], fp16 where ``half``, else fp32."""
    width = c_build.ISAS[isa or default_isa()].width
    n, blocks = s.shape
    out = s.float().reshape(n // width, width, blocks).transpose(1, 2)
    return (out.half() if half else out).contiguous()


def input_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` [..., K] as both quantised kernels read it: [M, K] fp32, unit stride along K. Refused unless its width
    is K: the kernels read K floats a row, so a narrower row would be read past its end."""
    if x.shape[-1] != k:
        raise ValueError(f"quantised linear: input of {x.shape[-1]} features for a weight of {k}")
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.dtype != torch.float32:
        rows = rows.float()
    return rows if rows.stride(1) == 1 else rows.contiguous()


def linear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., K] fp32 through the ``pack``-ed weight ``w`` (and a contiguous fp32 ``bias`` [N], or None)."""
    args = w.call_args
    n, k = args[5], args[6]
    rows = input_rows(x, k)
    count = rows.shape[0]
    y = torch.empty((count, n), dtype=torch.float32)
    if count:
        rc = _library(w.isa).zserve_qlinear(
            rows.data_ptr(), rows.stride(0), count, *args, None if bias is None else bias.data_ptr(), y.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"quantised linear: K = {k} is not a multiple of {BLOCK}, or out of memory ({rc})")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
