"""C kernels for the small per-layer operations of our Llama-family model on a CPU, in fp32: the residual
add and RMSNorm, rotary, SiLU times up, and the greedy argmax.

Why: in eager torch each is several ops (RMSNorm alone is pow, mean, add, rsqrt and two products, 61 calls a
step for SmolLM2), and a decode step pays ~40 op dispatches per layer. Here each is one pass over its rows in
vectors of one register of the ISA they are built for (``c_build.vectors``: 16 floats on AVX-512, 8 on
AVX2, as ``native.py`` and ``native_linear.py``; 16-float vectors built for AVX2 ran 1.4-8.6x slower, issue
33). A decode step's time outside the products and the attention, SmolLM2 at 1 thread on an AVX-512 core
(``python -m bench.studies.step``, before and after, back to back): 6.8 -> 3.6 ms at 1 decode, 7.8 -> 4.2
at 8, 13.6 -> 7.0 at 32 (the span also holds the C products and attention, whose own commit left this part
unchanged).

Not bit for bit torch's: the sums of squares and the exp are ours (Cephes' polynomial, within 2 ulp), so
results differ from HF's by rounding; greedy output still equals ``generate``'s in the engine's tests.
Everything that does not fit (not fp32, not on a CPU, a head size or width not a multiple of 16, no C
compiler) stays on torch: ``applies`` says which.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from zserve.generator import c_build

_KERNELS = r"""
/* rows [T][G] of D floats (x at x + t*xt + g*xg; residual likewise when not NULL): with a residual,
   res_out = x + residual first and the norm is over it; out = r * (1 / sqrt(mean(r^2) + eps)) * w[g]
   (w + g*wg: wg 0 for one weight for every g). out, res_out: [T][G][D] contiguous. D % 16 == 0. */
void zserve_rms_norm(const float *x, long xt, long xg, const float *res, long rt, long rg, const float *w, long wg,
                     int T, int G, int D, float eps, float *out, float *res_out) {
    for (int t = 0; t < T; t++)
        for (int g = 0; g < G; g++) {
            const float *xr = x + t * xt + g * xg;
            float *o = out + ((long)t * G + g) * D;
            const float *r = xr;
            if (res) {
                const float *rr = res + t * rt + g * rg;
                float *ro = res_out + ((long)t * G + g) * D;
                for (int i = 0; i < D; i += VW) vstore(ro + i, vload(rr + i) + vload(xr + i));
                r = ro;
            }
            vf ss = {0};
            for (int i = 0; i < D; i += VW) {
                const vf v = vload(r + i);
                ss += v * v;
            }
            const float inv = 1.f / sqrtf(vhsum(ss) / D + eps);
            const float *wr = w + g * wg;
            for (int i = 0; i < D; i += VW) vstore(o + i, vload(r + i) * inv * vload(wr + i));
        }
}

/* out [T][G][D] = x rotated: out[..i] = x1*cos - x2*sin, out[..i+D/2] = x2*cos + x1*sin (x1, x2 the halves),
   cos/sin [T][D/2] contiguous; x at x + t*xt + g*xg. D % 32 == 0. */
void zserve_rotary(const float *x, long xt, long xg, const float *cs, const float *sn, int T, int G, int D,
                   float *out) {
    const int h = D / 2;
    for (int t = 0; t < T; t++)
        for (int g = 0; g < G; g++) {
            const float *xr = x + t * xt + g * xg, *c = cs + (long)t * h, *s = sn + (long)t * h;
            float *o = out + ((long)t * G + g) * D;
            for (int i = 0; i < h; i += VW) {
                const vf x1 = vload(xr + i), x2 = vload(xr + h + i), cv = vload(c + i), sv = vload(s + i);
                vstore(o + i, x1 * cv - x2 * sv);
                vstore(o + h + i, x2 * cv + x1 * sv);
            }
        }
}

/* out [T][I] = silu(gate) * up, gate_up [T][2I] (row stride ld): gate its first I, up its last. I % 16 == 0. */
void zserve_silu_mul(const float *gu, long ld, int T, int I, float *out) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + t * ld, *u = g + I;
        float *o = out + (long)t * I;
        for (int i = 0; i < I; i += VW) {
            const vf gv = vload(g + i);
            vstore(o + i, gv / (1.f + vexp(-gv)) * vload(u + i));
        }
    }
}

/* out[r] = the first index of row r's largest value, or of its first NaN (as torch.argmax); x [R][V] (row
   stride ld) */
void zserve_argmax(const float *x, long ld, int R, int V, int64_t *out) {
    for (int r = 0; r < R; r++) {
        const float *row = x + r * ld;
        float m = row[0];
        int i = 0, nan = 0;
        if (V >= VW) {
            vf mv = vload(row);
            vfi nans = mv != mv;
            for (i = VW; i + VW <= V; i += VW) {
                const vf v = vload(row + i);
                mv = vselect(v > mv, v, mv);
                nans |= v != v;
            }
            for (int j = 0; j < VW; j++) {
                m = mv[j] > m ? mv[j] : m;
                nan |= nans[j];
            }
        }
        for (; i < V; i++) {
            m = row[i] > m ? row[i] : m;
            nan |= row[i] != row[i];
        }
        int64_t at = 0;
        if (nan)
            while (row[at] == row[at]) at++;
        else
            while (at < V - 1 && row[at] != m) at++;
        out[r] = at;
    }
}
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    isa = c_build.isa()  # its vectors divide 16, so every width that is a multiple of 16 suits every ISA
    source = c_build.vectors(isa.width) + _KERNELS
    lib = c_build.build(f"pointwise-{isa.name}", source, isa.flags, "the CPU norms, rotary and SiLU")
    if lib is None:
        return None
    ptr, c_long, c_int, c_float = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.zserve_rms_norm.argtypes = [ptr, c_long, c_long, ptr, c_long, c_long, ptr, c_long, c_int, c_int, c_int,
                                    c_float, ptr, ptr]  # fmt: skip
    lib.zserve_rotary.argtypes = [ptr, c_long, c_long, ptr, ptr, c_int, c_int, c_int, ptr]
    lib.zserve_silu_mul.argtypes = [ptr, c_long, c_int, c_int, ptr]
    lib.zserve_argmax.argtypes = [ptr, c_long, c_int, c_int, ptr]
    for fn in (lib.zserve_rms_norm, lib.zserve_rotary, lib.zserve_silu_mul, lib.zserve_argmax):
        fn.restype = None
    return lib


def applies(x: torch.Tensor, width: int | None = None) -> bool:
    """These kernels can take ``x``: fp32 on a CPU with unit stride along its rows, whose ``width`` (what the
    kernel vectorises over) is a multiple of 16; None for a kernel that takes any width (``argmax``)."""
    return (
        x.dtype == torch.float32 and x.device.type == "cpu" and (width is None or width % 16 == 0)
        and x.stride(-1) == 1 and _library() is not None
    )  # fmt: skip


def _rows3(x: torch.Tensor) -> tuple[int, int, int, int]:
    """``x`` [T, D] or [T, G, D] as (T, G, row stride, group stride)."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``llama.rms_norm``: ``x`` [T, D] or [T, G, D]; ``weight`` [D], or [G, D] one per group."""
    t, g, xt, xg = _rows3(x)
    out = torch.empty(x.shape, dtype=torch.float32)
    wg = weight.stride(0) if weight.dim() == 2 else 0
    _library().zserve_rms_norm(
        x.data_ptr(), xt, xg, None, 0, 0, weight.data_ptr(), wg, t, g, x.shape[-1], eps, out.data_ptr(), None
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``llama.add_rms_norm``: (norm(x + residual), x + residual), ``x`` and ``residual`` [T, D]."""
    out, summed = torch.empty(x.shape, dtype=torch.float32), torch.empty(x.shape, dtype=torch.float32)
    _library().zserve_rms_norm(
        x.data_ptr(), x.stride(0), 0, residual.data_ptr(), residual.stride(0), 0, weight.data_ptr(), 0,
        x.shape[0], 1, x.shape[-1], eps, out.data_ptr(), summed.data_ptr(),
    )  # fmt: skip
    return out, summed


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``llama.rotary``: ``x`` [T, G, D] (any row and group strides), cos/sin [T, 1, D/2] contiguous."""
    t, g, xt, xg = _rows3(x)
    out = torch.empty(x.shape, dtype=torch.float32)
    _library().zserve_rotary(x.data_ptr(), xt, xg, cos.data_ptr(), sin.data_ptr(), t, g, x.shape[-1], out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``llama.silu_mul``: ``gate_up`` [T, 2I] -> silu(gate) * up [T, I]."""
    t, width = gate_up.shape
    out = torch.empty(t, width // 2, dtype=torch.float32)
    _library().zserve_silu_mul(gate_up.data_ptr(), gate_up.stride(0), t, width // 2, out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for ``x`` [R, V] fp32 on a CPU with unit stride along V."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    _library().zserve_argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
