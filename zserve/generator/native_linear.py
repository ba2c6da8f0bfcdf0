"""A C kernel for the fp32 linear layers of the engine's model on a CPU: y = x w^T + b with the weight
packed once at load into panels of 16 output columns ([N/16][K][16], each panel's 16 weights of one input
next to each other), so that a product reads the weight once, in order, as one sequential stream.

Why our own: oneDNN's prepacked products (``cpu_linear.py``'s other path, what vLLM's CPU build runs) take a
decode step's few rows far from what the machine can do. SmolLM2-135M's 211 products (its lm_head included) at
1 thread, ``python -m bench.studies.linear --rows 1,8,17,32,256``: 1 row 24 against oneDNN's 44 ms (the
weights read at ~22 GB/s, near a sequential read's speed), 8 rows 30 against 48, 17 rows 53 against 64, 32
rows 89 against 100, and the same at prefill's 256 (652 against 647 ms, ~105 GFLOP/s, this core's fp32 peak).
The tile: up to 8 rows of x against 3-8 panels (up to 24 accumulators of 16 floats), every weight vector
loaded once per tile and used by every row; rows come in blocks of even size (17 = 6 + 6 + 5, not 8 + 8 + 1).
Written with GCC/clang vector extensions, so it compiles for any CPU (one AVX-512 register per 16 floats, or
two AVX2 ones, or four NEON ones). Torch's threads split the panels (an OpenMP loop: the library links the
libgomp torch already loaded, so both use one thread pool).

Sums each output over the inputs in order, one accumulator per output: not the order of MKL or oneDNN, so
results differ from theirs by rounding (~1e-6 relative), as theirs differ from each other's.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from zserve.generator import c_build

_TILE = r"""
/* y[MB rows][NP * 16 columns] = x[MB][K] w^T (+ bias): w is NP panels [K][16], one after the other */
#define TILE(MB, NP)                                                                                         \
    static void tile_##MB##_##NP(const float *x, long ldx, const float *w, int K, const float *bias, float *y, \
                                 long ldy) {                                                                 \
        v16 acc[MB][NP];                                                                                     \
        for (int p = 0; p < NP; p++) {                                                                       \
            const v16 b = bias ? load(bias + p * 16) : (v16){0};                                             \
            for (int m = 0; m < MB; m++) acc[m][p] = b;                                                      \
        }                                                                                                    \
        for (int k = 0; k < K; k++) {                                                                        \
            v16 wv[NP];                                                                                      \
            for (int p = 0; p < NP; p++) wv[p] = load(w + ((long)p * K + k) * 16);                           \
            for (int m = 0; m < MB; m++) {                                                                   \
                const float xv = x[m * ldx + k];                                                             \
                for (int p = 0; p < NP; p++) acc[m][p] += xv * wv[p];                                        \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MB; m++)                                                                         \
            for (int p = 0; p < NP; p++) *(v16u *)(y + m * ldy + p * 16) = acc[m][p];                        \
    }
"""
_PANELS = (1, 3, 4, 6, 8)  # panels per tile: zserve_linear picks by rows per block; 1 for a last, partial group
_SOURCE = (
    c_build.VECTORS
    + r"""
typedef void (*tile_fn)(const float *, long, const float *, int, const float *, float *, long);
"""
    + _TILE
    + "\n".join(" ".join(f"TILE({mb}, {np})" for np in _PANELS) for mb in range(1, 9))
    + "\nstatic const tile_fn TILES[9][9] = {\n"
    + "\n".join(
        "    {" + ", ".join(f"tile_{mb}_{np}" if mb and np in _PANELS else "0" for np in range(9)) + "},"
        for mb in range(9)
    )
    + r"""
};

/* y [M][N] (row stride ldy) = x [M][K] (row stride ldx) w^T (+ bias [N]); wp: w packed by zserve_pack_rows'
   layout, N a multiple of 16. The panels are split over `threads` threads. */
void zserve_linear(const float *x, long ldx, int M, const float *wp, int N, int K, const float *bias, float *y,
                   long ldy, int threads) {
    const int blocks = (M + 7) / 8, rows = (M + blocks - 1) / blocks; /* row blocks of even size, <= 8 */
    const int np = rows >= 7 ? 3 : rows >= 3 ? 4 : rows == 2 ? 6 : 8; /* <= 24 accumulators */
    const int panels = N / 16, groups = (panels + np - 1) / np;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * np, width = panels - p0 < np ? 1 : np;
        for (int p = p0; p < p0 + np && p < panels; p += width) {
            const float *w = wp + (long)p * K * 16, *b = bias ? bias + p * 16 : 0;
            for (int m0 = 0; m0 < M; m0 += rows) {
                const int mb = M - m0 < rows ? M - m0 : rows;
                TILES[mb][width](x + (long)m0 * ldx, ldx, w, K, b, y + (long)m0 * ldy + p * 16, ldy);
            }
        }
    }
}
"""
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = c_build.build("linear", _SOURCE, [*c_build.FLAGS, "-fopenmp"], "the CPU linear layers")
    if lib is None:
        return None
    ptr, c_long, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.zserve_linear.argtypes = [ptr, c_long, c_int, ptr, c_int, c_int, ptr, ptr, c_long, c_int]
    lib.zserve_linear.restype = None
    return lib


def applies(weight: torch.Tensor) -> bool:
    """The kernel can take this layer: fp32 on a CPU, whole panels of 16 outputs, and it builds here."""
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.shape[0] % 16 == 0
        and _library() is not None
    )  # fmt: skip


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's panels [N/16, K, 16], contiguous."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., K] fp32 through a ``pack``-ed weight (and a contiguous fp32 ``bias`` [N], or None)."""
    panels, k, _ = packed.shape
    n = panels * 16
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _library().zserve_linear(
            rows.data_ptr(), rows.stride(0), m, packed.data_ptr(), n, k, None if bias is None else bias.data_ptr(),
            y.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
    return y.view(*x.shape[:-1], n)
