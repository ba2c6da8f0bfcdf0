"""A C kernel for the CPU decode attention: every one-token decode of a step attends to its KV where it lies
in the paged cache (read once, through the block table), in one call per layer.

The torch path gathers each sequence's K and V out of the cache (a copy per sequence, layer and K/V), then
calls SDPA once per sequence: at 32 decodes that is ~2,000 small ops per step, and the gathered copies cost
as much memory traffic as the attention itself. This kernel is what vLLM's CPU build does with its own
C++ paged attention, kept small: plain C (no torch headers), compiled on first use with the system's C
compiler (``$CC`` or ``cc``) for this CPU (``-march=native``), cached under the zserve cache folder by the
hash of its source, flags and CPU, and called through ctypes (which releases the GIL). Without a compiler,
or on a cache that is not fp32 on a CPU, ``decode_kernel()`` is None and the torch path runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zserve.gguf_cache import zserve_cache

log = logging.getLogger("zserve.engine")

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their max), Cephes' expf polynomial: within 2 ulp of expf, and it
   vectorises (expf from libm does not, without -ffast-math). */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Decodes rows [0, B): query row b, head h at q + b*q_sb + h*q_sh (head_dim D contiguous); the same for out.
   k, v: [slots, Hkv, D] contiguous; sequence b's KV is its first lengths[b] slots, block by block through
   tables[b * max_blocks ...]. Softmax(q k^T * scale) v per query head; query head h reads KV head h / G. */
/* The same row of the sequence's next block, a block ahead: blocks lie anywhere in the pool, and the
   hardware prefetcher stops at the end of each. */
static inline void prefetch_next_block(const float *cache, const int32_t *table, int t, int L, int block_size,
                                       int row_floats) {
    const int ahead = t + block_size;
    if (ahead >= L) return;
    const char *row = (const char *)(cache + ((long)table[ahead / block_size] * block_size + ahead % block_size) *
                                                 row_floats);
    for (int i = 0; i < row_floats * 4; i += 64) __builtin_prefetch(row + i);
}

static inline __attribute__((always_inline)) void decode(
    const float *q, long q_sb, long q_sh, const float *k, const float *v, const int32_t *tables, long max_blocks,
    const int32_t *lengths, int B, int H, int Hkv, const int D, int block_size, float scale, float *out,
    long out_sb, long out_sh, float *scores) {
    const int G = H / Hkv;
    for (int b = 0; b < B; b++) {
        const int L = lengths[b];
        const int32_t *table = tables + (long)b * max_blocks;
        const float *qb = q + b * q_sb;
        float *ob = out + b * out_sb;
        /* token by token, every head of a slot's row at once: the row is read from memory once, in order */
        for (int t = 0; t < L; t++) {
            const long slot = (long)table[t / block_size] * block_size + t % block_size;
            const float *row = k + slot * Hkv * D;
            prefetch_next_block(k, table, t, L, block_size, Hkv * D);
            for (int h = 0; h < H; h++) {
                const float *qr = qb + h * q_sh, *kr = row + (h / G) * D;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int d = 0; d < D; d++) acc += qr[d] * kr[d];
                scores[(long)h * L + t] = acc * scale;
            }
        }
        for (int h = 0; h < H; h++) {
            float *s = scores + (long)h * L, m = -INFINITY, sum = 0.f;
            for (int t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < L; t++) {
                s[t] = exp_nonpositive(s[t] - m);
                sum += s[t];
            }
            const float inv = 1.f / sum;
            for (int t = 0; t < L; t++) s[t] *= inv;
            float *o = ob + h * out_sh;
            for (int d = 0; d < D; d++) o[d] = 0.f;
        }
        for (int t = 0; t < L; t++) {
            const long slot = (long)table[t / block_size] * block_size + t % block_size;
            const float *row = v + slot * Hkv * D;
            prefetch_next_block(v, table, t, L, block_size, Hkv * D);
            for (int h = 0; h < H; h++) {
                float *o = ob + h * out_sh;
                const float *vr = row + (h / G) * D, p = scores[(long)h * L + t];
#pragma omp simd
                for (int d = 0; d < D; d++) o[d] += p * vr[d];
            }
        }
    }
}

int zserve_paged_decode(const float *q, long q_sb, long q_sh, const float *k, const float *v,
                        const int32_t *tables, long max_blocks, const int32_t *lengths, int B, int H, int Hkv,
                        int D, int block_size, float scale, float *out, long out_sb, long out_sh) {
    int max_len = 1;
    for (int b = 0; b < B; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
    float *scores = malloc(sizeof(float) * (size_t)H * (size_t)max_len); /* [H][L] of one sequence */
    if (!scores) return -1;
    /* the common head sizes as constants: their loops unroll fully */
    if (D == 64)
        decode(q, q_sb, q_sh, k, v, tables, max_blocks, lengths, B, H, Hkv, 64, block_size, scale, out, out_sb,
               out_sh, scores);
    else if (D == 128)
        decode(q, q_sb, q_sh, k, v, tables, max_blocks, lengths, B, H, Hkv, 128, block_size, scale, out, out_sb,
               out_sh, scores);
    else
        decode(q, q_sb, q_sh, k, v, tables, max_blocks, lengths, B, H, Hkv, D, block_size, scale, out, out_sb,
               out_sh, scores);
    free(scores);
    return 0;
}
"""
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC"]


def _cpu_id() -> str:
    """What -march=native compiles for: the machine and its CPU feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "paged_decode.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(source), "-lm"],
            check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        os.replace(built, target)  # atomic: engines starting together each build, the last one wins


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%s) found: CPU decode attention runs on torch (slower)", compiler)
        return None
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    target = zserve_cache() / "kernels" / f"paged_decode-{key}.so"
    try:
        if not target.exists():
            _compile(compiler, target)
            log.info("compiled the CPU decode attention kernel into %s", target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the CPU decode attention kernel (%s): it runs on torch (slower)", detail)
        return None
    fn = lib.zserve_paged_decode
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, c_long, c_long, ptr, ptr, ptr, c_long, ptr, c_int, c_int, c_int, c_int, c_int,
                   ctypes.c_float, ptr, c_long, c_long]  # fmt: skip
    fn.restype = c_int
    return lib


def decode_kernel(cache: torch.Tensor) -> PagedDecode | None:
    """The kernel for a cache layer like ``cache``, or None where it does not apply (or cannot be built)."""
    if cache.device.type != "cpu" or cache.dtype != torch.float32 or not cache.is_contiguous():
        return None
    lib = _library()
    return None if lib is None else PagedDecode(lib.zserve_paged_decode)


class PagedDecode:
    """The kernel over a step's decodes; with torch's thread count above 1, the rows split into that many
    parts of about equal KV, run on a small thread pool (ctypes releases the GIL for the call)."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0
        self._split: tuple[torch.Tensor | None, int, list[tuple[int, int]]] = (None, 0, [])  # lengths, parts, rows

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
        parts = min(torch.get_num_threads(), q.shape[0])
        if parts < 2:
            return self._run(q, k, v, tables, lengths, block_size, scale, out)
        if self._workers < parts - 1:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._workers = ThreadPoolExecutor(parts - 1, thread_name_prefix="zserve-attention"), parts - 1
        bounds = self._bounds(lengths, parts)
        futures = [
            self._pool.submit(self._run, q[a:b], k, v, tables[a:b], lengths[a:b], block_size, scale, out[a:b])
            for a, b in bounds[1:] if b > a
        ]  # fmt: skip
        a, b = bounds[0]
        if b > a:
            self._run(q[a:b], k, v, tables[a:b], lengths[a:b], block_size, scale, out[a:b])
        for f in futures:
            f.result()

    def _bounds(self, lengths: torch.Tensor, parts: int) -> list[tuple[int, int]]:
        """Row ranges of about equal KV, computed once per step: every layer gets the step's same lengths."""
        last, last_parts, bounds = self._split
        if lengths is not last or parts != last_parts:
            cum = lengths.cumsum(0)
            cuts = torch.searchsorted(cum, cum[-1] * torch.arange(1, parts) // parts, right=True).tolist()
            bounds = list(zip([0, *cuts], [*cuts, lengths.shape[0]], strict=True))
            self._split = (lengths, parts, bounds)
        return bounds

    def _run(self, q, k, v, tables, lengths, block_size: int, scale: float, out) -> None:
        B, H, D = q.shape
        rc = self._fn(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), tables.data_ptr(),
            tables.shape[1], lengths.data_ptr(), B, H, k.shape[1], D, block_size, scale, out.data_ptr(),
            out.stride(0), out.stride(1),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("paged decode: out of memory for the scores")
