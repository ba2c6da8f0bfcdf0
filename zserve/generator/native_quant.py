"""A C kernel for linear layers whose weights stay int8 in memory: y = x w^T + b with w = q * s (+ m), q int8,
one fp32 scale s (and, optionally, minimum m) per output and block of 32 inputs. That form holds GGUF's Q8_0,
Q4_0, Q4_1 and Q4_K exactly (``zserve/gguf_quant.py``) and per-output-channel symmetric int8 (the row's one
scale repeated over its blocks).

Why: a decode step on a CPU reads every weight once and is bound by memory bandwidth; int8 reads 1 byte a
weight (plus 4 bytes of scale per 32) where fp32 reads 4, so 0.28x the bytes.

The layout is ``native_linear``'s panels, in int8: q packed [N/W][K][W] (W the floats in one vector register
of the ISA: 16 AVX-512, 8 AVX2, 4 portable), the scales [N/W][K/32][W]. The tile converts each weight vector
to fp32 in registers, multiplies it by its block's scale (giving exactly the dequantised fp32 weight: q * s
is one rounding of the same product) and FMAs it into one accumulator per row and panel, over the inputs in
order: the sums are those of ``native_linear`` on the dequantised weights, to rounding of the FMA contraction.
Activations stay fp32 (no int8 dot products): what this costs in arithmetic is the conversion, shared by
every row of a tile.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from zserve.generator import c_build

BLOCK = 32  # inputs per scale: GGUF's Q8_0 block

# (rows a block takes at most, panels for each block size): what fits the ISA's registers with the
# accumulators, the converted weight vectors and their scales (AVX-512: 32 registers, AVX2/portable: 16)
_SCHEDULES = {
    "avx512": (8, (8, 6, 4, 4, 4, 3, 3, 3)),
    "avx2": (6, (4, 3, 3, 2, 2, 2)),
    "portable": (6, (4, 3, 3, 2, 2, 2)),
}

_TILE = r"""
/* VW int8 at p -> VW floats: GCC lowers __builtin_convertvector from int8 lanes to one scalar conversion a lane
   (16 movsbl + vpinsrd a vector, 3x slower than fp32's product), so x86's sign extensions by hand */
#if VW == 16 && defined(__AVX512F__)
#include <immintrin.h>
static inline vf vq2f(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif VW == 8 && defined(__AVX2__)
#include <immintrin.h>
static inline vf vq2f(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline vf vq2f(const int8_t *p) {
    vfi v;
    for (int i = 0; i < VW; i++) v[i] = p[i];
    return __builtin_convertvector(v, vf);
}
#endif
/* y[MB rows][NP * VW] = x[MB][K] (q * s + m)^T (+ bias): q is NP panels [K][VW] int8, s and m NP panels
   [K/32][VW] (m only where WITHMIN: GGUF's Q4_1 and Q4_K have a minimum per block, Q8_0 and Q4_0 none). The
   minimums are not added to each weight but once a block, times the block's sum of x (xs [MB][K/32]): one
   FMA a block where adding them cost one operation a weight vector (Q4_1's step then ran 1.2x int8's) */
#define TILE(MB, NP, SUFFIX, WITHMIN)                                                                        \
    static void tile_##MB##_##NP##SUFFIX(const float *x, long ldx, const int8_t *q, const float *s,          \
                                         const float *mn, const float *xs, int K, const float *bias,         \
                                         float *y, long ldy) {                                               \
        vf acc[MB][NP];                                                                                      \
        for (int p = 0; p < NP; p++) {                                                                       \
            const vf b = bias ? vload(bias + p * VW) : (vf){0};                                              \
            for (int m = 0; m < MB; m++) acc[m][p] = b;                                                      \
        }                                                                                                    \
        const int KB = K / 32;                                                                               \
        for (int kb = 0; kb < KB; kb++) {                                                                    \
            vf sc[NP];                                                                                       \
            for (int p = 0; p < NP; p++) sc[p] = vload(s + ((long)p * KB + kb) * VW);                        \
            for (int k = kb * 32; k < kb * 32 + 32; k++) {                                                   \
                vf wv[NP];                                                                                   \
                for (int p = 0; p < NP; p++) wv[p] = vq2f(q + ((long)p * K + k) * VW) * sc[p];               \
                for (int m = 0; m < MB; m++) {                                                               \
                    const float xv = x[m * ldx + k];                                                         \
                    for (int p = 0; p < NP; p++) acc[m][p] += xv * wv[p];                                    \
                }                                                                                            \
            }                                                                                                \
            if (WITHMIN)                                                                                     \
                for (int p = 0; p < NP; p++) {                                                               \
                    const vf mv = vload(mn + ((long)p * KB + kb) * VW);                                      \
                    for (int m = 0; m < MB; m++) acc[m][p] += xs[(long)m * KB + kb] * mv;                    \
                }                                                                                            \
        }                                                                                                    \
        for (int m = 0; m < MB; m++)                                                                         \
            for (int p = 0; p < NP; p++) vstore(y + m * ldy + p * VW, acc[m][p]);                            \
    }
"""

_ENTRY = r"""
/* y [M][N] (row stride ldy) = x [M][K] (row stride ldx) (q * s + mn)^T (+ bias [N]), mn NULL for none; N a
   multiple of VW, K of 32.
   Rows in blocks of even size up to CAP, a block of r rows against groups of PANELS[r] panels, the groups
   split over `threads` threads (torch's OpenMP pool). */
int zserve_qlinear(const float *x, long ldx, int M, const int8_t *q, const float *s, const float *mn, int N,
                   int K, const float *bias, float *y, long ldy, int threads) {
    if (K % 32) return -1;
    const int KB = K / 32;
    float *xs = 0; /* each row's sum over each block: what the blocks' minimums multiply */
    if (mn) {
        xs = malloc(sizeof(float) * (size_t)M * KB);
        if (!xs) return -2;
        for (int m = 0; m < M; m++)
            for (int kb = 0; kb < KB; kb++) {
                float t = 0.f;
                for (int k = kb * 32; k < kb * 32 + 32; k++) t += x[(long)m * ldx + k];
                xs[(long)m * KB + kb] = t;
            }
    }
    const int blocks = (M + CAP - 1) / CAP, rows = (M + blocks - 1) / blocks;
    const int np = PANELS[rows], panels = N / VW, groups = (panels + np - 1) / np;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * np, width = panels - p0 < np ? 1 : np; /* a last, partial group one panel at a time */
        for (int p = p0; p < p0 + np && p < panels; p += width) {
            const int8_t *qp = q + (long)p * K * VW;
            const float *sp = s + (long)p * (K / 32) * VW, *b = bias ? bias + p * VW : 0;
            const float *mp = mn ? mn + (long)p * (K / 32) * VW : 0;
            for (int m0 = 0; m0 < M; m0 += rows) {
                const int mb = M - m0 < rows ? M - m0 : rows;
                (mn ? TILES_MIN : TILES)[mb][width](x + (long)m0 * ldx, ldx, qp, sp, mp, xs ? xs + (long)m0 * KB : 0,
                                                    K, b, y + (long)m0 * ldy + p * VW, ldy);
            }
        }
    }
    free(xs);
    return 0;
}
"""


def source(isa: str) -> str:
    """The C source for ``isa``: the tiles its schedule runs and the entry point."""
    cap, panels = _SCHEDULES[isa]
    tiles = {(mb, np) for r in range(1, cap + 1) for mb in range(1, r + 1) for np in (panels[r - 1], 1)}
    max_panels = max(panels)

    def table(suffix: str) -> str:
        return "\n".join(
            "    {"
            + ", ".join(f"tile_{mb}_{np}{suffix}" if (mb, np) in tiles else "0" for np in range(max_panels + 1))
            + "},"
            for mb in range(cap + 1)
        )

    return (
        c_build.vectors(c_build.ISAS[isa].width)
        + f"#define CAP {cap}\nstatic const int PANELS[] = {{0, {', '.join(map(str, panels))}}};\n"
        + "typedef void (*tile_fn)(const float *, long, const int8_t *, const float *, const float *, const float *,"
        + " int, const float *, float *, long);\n"
        + _TILE
        + "\n".join(f"TILE({mb}, {np}, , 0)\nTILE({mb}, {np}, _min, 1)" for mb, np in sorted(tiles))
        + f"\nstatic const tile_fn TILES[{cap + 1}][{max_panels + 1}] = {{\n{table('')}\n}};\n"
        + f"static const tile_fn TILES_MIN[{cap + 1}][{max_panels + 1}] = {{\n{table('_min')}\n}};\n"
        + _ENTRY
    )


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    chosen = c_build.for_name(isa)
    lib = c_build.build(f"qlinear-{isa}", source(isa), [*chosen.flags, "-fopenmp"], "the int8 linear layers")
    if lib is None:
        return None
    ptr, c_long, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.zserve_qlinear.argtypes = [ptr, c_long, c_int, ptr, ptr, ptr, c_int, c_int, ptr, ptr, c_long, c_int]
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
    """(q [N, K] int8, s [N, ceil(K/32)], and a minimum per block m like s, or None) -> the fp32 weight
    [N, K] they stand for: q * s (+ m)."""
    w = q.float() * s.float().repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]
    return w if m is None else w + m.float().repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]


def pack(q: torch.Tensor, s: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, s [N, K/32]) -> the kernel's panels for ``isa``: q [N/W, K, W], s [N/W, K/32, W] fp32."""
    width = c_build.ISAS[isa or default_isa()].width
    n, k = q.shape
    qp = q.reshape(n // width, width, k).transpose(1, 2).contiguous()
    return qp, pack_blocks(s, isa)


def pack_blocks(s: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """Scales or minimums [N, K/32] -> the kernel's panels [N/W, K/32, W] fp32."""
    width = c_build.ISAS[isa or default_isa()].width
    n, blocks = s.shape
    return s.float().reshape(n // width, width, blocks).transpose(1, 2).contiguous()


def linear(
    x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, bias: torch.Tensor | None, isa: str | None = None,
    mp: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x`` [..., K] fp32 through ``pack``-ed weights for ``isa`` (and a contiguous fp32 ``bias`` [N], or None;
    ``mp``: the blocks' minimums, ``pack_blocks``-ed, or None)."""
    isa = isa or default_isa()
    panels, k, width = qp.shape
    n = panels * width
    rows = x.reshape(-1, k)
    if rows.dtype != torch.float32:
        rows = rows.float()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        rc = _library(isa).zserve_qlinear(
            rows.data_ptr(), rows.stride(0), m, qp.data_ptr(), sp.data_ptr(),
            None if mp is None else mp.data_ptr(), n, k,
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"int8 linear: K = {k} is not a multiple of {BLOCK}, or out of memory ({rc})")
    return y.view(*x.shape[:-1], n)
