"""A C kernel for the fp32 linear layers of the engine's model on a CPU: y = x w^T + b with the weight
packed once at load into panels of W output columns ([N/W][K][W], each panel's W weights of one input next to
each other; W the floats in one vector register of the ISA it is built for: 16 on AVX-512, 8 on AVX2, 4
portable), so that a product reads the weight once, in order, as one sequential stream.

Why our own: oneDNN's prepacked products (``cpu_linear.py``'s other path, what vLLM's CPU build runs) take a
decode step's few rows far from what the machine can do. SmolLM2-135M's 211 products (its lm_head included) at
1 thread on an AVX-512 core (AMD EPYC, ``python -m bench.studies.linear --rows 1,8,17,32,256``): 1 row 24
against oneDNN's 44 ms (the weights read at ~22 GB/s, near a sequential read's speed), 8 rows 30 against 48,
17 rows 53 against 64, 32 rows 89 against 100, and the same at prefill's 256 (652 against 647 ms).

The tile: a block of rows of x against a group of panels, every weight vector loaded once per tile and used
by every row, one accumulator register per row and panel. How many of each fits the register file is the
ISA's: AVX-512's 32 registers take 8 rows x 3 panels (24 accumulators), AVX2's 16 take 6 x 2 or 4 x 3 (BLIS's
haswell kernel is 6 x 16 floats); the AVX-512 tiles built for AVX2 needed 48 registers and ran 12-14x slower
than oneDNN there (issue 33). ``Variant`` is one such schedule (how many rows a block takes at most, how many
panels for each block size); ``variants(isa)`` the candidates ``kernel_tune`` times at an engine's start.
Rows come in blocks of even size (17 = 6 + 6 + 5, not 8 + 8 + 1). Torch's threads split the panel groups (an
OpenMP loop: the library links the libgomp torch already loaded, so both use one thread pool).

Sums each output over the inputs in order, one accumulator per output: not the order of MKL or oneDNN, so
results differ from theirs by rounding (~1e-6 relative), as theirs differ from each other's.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from zserve.generator import c_build

_TILE = r"""
/* y[MB rows][NP * VW columns] = x[MB][K] w^T (+ bias): w is NP panels [K][VW], one after the other */
#define TILE(MB, NP)                                                                                         \
    static void tile_##MB##_##NP(const float *x, long ldx, const float *w, int K, const float *bias, float *y, \
                                 long ldy) {                                                                 \
        vf acc[MB][NP];                                                                                      \
        for (int p = 0; p < NP; p++) {                                                                       \
            const vf b = bias ? vload(bias + p * VW) : (vf){0};                                              \
            for (int m = 0; m < MB; m++) acc[m][p] = b;                                                      \
        }                                                                                                    \
        for (int k = 0; k < K; k++) {                                                                        \
            vf wv[NP];                                                                                       \
            for (int p = 0; p < NP; p++) wv[p] = vload(w + ((long)p * K + k) * VW);                          \
            for (int m = 0; m < MB; m++) {                                                                   \
                const float xv = x[m * ldx + k];                                                             \
                for (int p = 0; p < NP; p++) acc[m][p] += xv * wv[p];                                        \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MB; m++)                                                                         \
            for (int p = 0; p < NP; p++) vstore(y + m * ldy + p * VW, acc[m][p]);                            \
    }
"""


def fp32_tile_source(macro: str = "TILE", prefix: str = "tile") -> str:
    """The fp32 tile macro, named ``macro`` and making functions ``prefix_MB_NP``: the quantised kernels run their
    many-row products through the same tiles (``zserve.generator.native_quant``)."""
    return _TILE.replace("#define TILE(", f"#define {macro}(").replace(
        "static void tile_##", f"static void {prefix}_##"
    )


_ENTRY = r"""
/* y [M][N] (row stride ldy) = x [M][K] (row stride ldx) w^T (+ bias [N]); wp: w packed in panels of VW,
   N a multiple of VW. Rows in blocks of even size up to `cap`, a block of r rows against groups of
   panels[r] panels (the variant's schedule; TILES has every tile it names). The panel groups are split over
   `threads` threads. Returns -1 where the schedule names a tile this library lacks. */
int zserve_linear(const float *x, long ldx, int M, const float *wp, int N, int K, const float *bias, float *y,
                  long ldy, int threads, int cap, const int32_t *panels_of) {
    if (cap < 1 || cap > MAXR) return -1;
    const int blocks = (M + cap - 1) / cap, rows = (M + blocks - 1) / blocks;
    const int np = panels_of[rows], panels = N / VW, groups = (panels + np - 1) / np;
    if (np < 1 || np > MAXP) return -1;
    for (int mb = 1; mb <= rows; mb++)
        if (!TILES[mb][np] || !TILES[mb][1]) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * np, width = panels - p0 < np ? 1 : np; /* a last, partial group one panel at a time */
        for (int p = p0; p < p0 + np && p < panels; p += width) {
            const float *w = wp + (long)p * K * VW, *b = bias ? bias + p * VW : 0;
            for (int m0 = 0; m0 < M; m0 += rows) {
                const int mb = M - m0 < rows ? M - m0 : rows;
                TILES[mb][width](x + (long)m0 * ldx, ldx, w, K, b, y + (long)m0 * ldy + p * VW, ldy);
            }
        }
    }
    return 0;
}
"""


@dataclass(frozen=True)
class Variant:
    """A schedule of the kernel on one ISA: row blocks of up to ``cap`` rows, a block of r rows against
    groups of ``panels[r - 1]`` panels."""

    name: str
    isa: str
    cap: int
    panels: tuple[int, ...]

    def tiles(self) -> set[tuple[int, int]]:
        """The (rows, panels) tiles it runs: each block size's, every smaller block's (the last block of
        rows), and one panel for each (the last, partial group)."""
        return {(mb, np) for r in range(1, self.cap + 1) for mb in range(1, r + 1) for np in (self.panels[r - 1], 1)}


# Each fits its ISA's registers: rows x panels accumulators, plus the panels' weight vectors, plus one
# broadcast input (AVX-512: 31 of 32; AVX2 and portable: 15 of 16). "wide" is the AVX-512 kernel as it was
# before issue 33 (8 rows x 3 panels at most, more panels for fewer rows).
_VARIANTS = {
    "avx512": (
        Variant("8x3", "avx512", 8, (8, 6, 4, 4, 4, 4, 3, 3)),
        Variant("12x2", "avx512", 12, (8, 6, 4, 4, 4, 4, 3, 3, 2, 2, 2, 2)),
        Variant("4x6", "avx512", 4, (8, 8, 6, 6)),
    ),
    "avx2": (
        Variant("6x2", "avx2", 6, (4, 4, 3, 3, 2, 2)),
        Variant("4x3", "avx2", 4, (4, 4, 3, 3)),
        Variant("12x1", "avx2", 12, (4, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1)),
    ),
}
_VARIANTS["portable"] = tuple(Variant(v.name, "portable", v.cap, v.panels) for v in _VARIANTS["avx2"])


def variants(isa: str | None = None) -> tuple[Variant, ...]:
    """The kernel's schedules for ``isa`` (default: the one the kernels are built for here)."""
    return _VARIANTS[isa or c_build.isa().name]


def source(isa: str) -> str:
    """The C source for ``isa``: every tile any of its variants runs, and the entry point."""
    tiles = set().union(*(v.tiles() for v in _VARIANTS[isa]))
    max_rows, max_panels = max(t[0] for t in tiles), max(t[1] for t in tiles)
    table = "\n".join(
        "    {" + ", ".join(f"tile_{mb}_{np}" if (mb, np) in tiles else "0" for np in range(max_panels + 1)) + "},"
        for mb in range(max_rows + 1)
    )
    return (
        c_build.vectors(c_build.ISAS[isa].width)
        + f"#include <stdint.h>\n#define MAXR {max_rows}\n#define MAXP {max_panels}\n"
        + "typedef void (*tile_fn)(const float *, long, const float *, int, const float *, float *, long);\n"
        + fp32_tile_source()
        + "\n".join(f"TILE({mb}, {np})" for mb, np in sorted(tiles))
        + f"\nstatic const tile_fn TILES[{max_rows + 1}][{max_panels + 1}] = {{\n{table}\n}};\n"
        + _ENTRY
    )


@functools.cache
def _library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel built for ``isa`` (default: ``c_build.isa()``), or None where it cannot be."""
    chosen = c_build.isa() if isa is None else c_build.for_name(isa)
    lib = c_build.build(f"linear-{chosen.name}", source(chosen.name), [*chosen.flags, "-fopenmp"],
                        "the CPU linear layers")  # fmt: skip
    if lib is None:
        return None
    ptr, c_long, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.zserve_linear.argtypes = [ptr, c_long, c_int, ptr, c_int, c_int, ptr, ptr, c_long, c_int, c_int, ptr]
    lib.zserve_linear.restype = c_int
    return lib


def default(isa: str | None = None) -> Variant:
    """The variant the kernel runs without measuring: its ISA's first."""
    return variants(isa)[0]


def applies(weight: torch.Tensor, variant: Variant | None = None) -> bool:
    """The kernel can take this layer: fp32 on a CPU, whole panels of outputs, and it builds here."""
    variant = variant or default()
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32
        and weight.shape[0] % c_build.ISAS[variant.isa].width == 0 and _library(variant.isa) is not None
    )  # fmt: skip


def pack(weight: torch.Tensor, variant: Variant | None = None) -> torch.Tensor:
    """[N, K] -> the kernel's panels [N/W, K, W] for ``variant``'s ISA, contiguous."""
    width = c_build.ISAS[(variant or default()).isa].width
    n, k = weight.shape
    return weight.detach().reshape(n // width, width, k).transpose(1, 2).contiguous()


@functools.cache
def _schedule(variant: Variant) -> ctypes.Array:
    return (ctypes.c_int32 * (variant.cap + 1))(0, *variant.panels)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, variant: Variant | None = None):
    """``x`` [..., K] fp32 through a ``pack``-ed weight (and a contiguous fp32 ``bias`` [N], or None), with
    ``variant``'s schedule (the one it was packed for)."""
    variant = variant or default()
    panels, k, width = packed.shape
    n = panels * width
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        rc = _library(variant.isa).zserve_linear(
            rows.data_ptr(), rows.stride(0), m, packed.data_ptr(), n, k, None if bias is None else bias.data_ptr(),
            y.data_ptr(), n, torch.get_num_threads(), variant.cap, _schedule(variant),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"native linear: variant {variant} names a tile its library lacks")
    return y.view(*x.shape[:-1], n)
