"""Compiled per-pixel kernels of the per-pixel solve (CPU, float64).

What they do (each replaces an eager function of :mod:`~gridsolve.stages.solve.linalg`):

* ``gs_cholesky``, ``gs_solve``, ``gs_spread``: the packed Cholesky factor of every
  pixel's normal equations, its solves, and the spread ``Z = L⁻¹T`` with
  ``diag(ZᵀZ)`` (:func:`linalg.packed_cholesky`, :meth:`linalg.PackedFactor.solve_`,
  :func:`linalg._primal_spread`). In torch these are a loop over the matrix order of
  elementwise operations on (·, pixels) arrays: hundreds of operations per batch, each
  a pass through memory. Here the pixels are the innermost loop, 64 at a time, so a
  block's factors stay in the L1 cache. ``gs_cholesky`` also solves the first
  right-hand side (``rhs=``) and, when only the variances are wanted, computes
  them (``spread=``) block by block as it factors, instead of further reads of
  every factor.
* ``gs_moments``: the residual RMS of every pixel and the moments of the uncertainty
  option (weighted residual RMS, RMS about the weighted mean, uncentred RMS), in one
  read of the batch's data instead of a product, a mask and a pairwise sum each
  (:func:`linalg.residual_moments`).

* ``gs_fit``: all of the above for the usual case, unit weights (the data's missing
  values) in the primal form without ridge (:func:`linalg.fit_unit`): each pixel's
  data read once, its Gram matrix, factor, solve, refinement, residual sums and
  variances in registers, instead of the separate passes over float64 copies of the
  batch, which are bound by memory.
* ``gs_step``: a refinement step's correction and convergence test (:func:`linalg._step`).
* ``gs_load``, ``gs_statistics``, ``gs_gap_solve``: a batch's data as float64 (and its
  0/1 weights), the uncertainty's statistics straight into the outputs, and the
  gap-wise dual's gather-solve-scatter.

The refinement's residuals stay torch's: they are matrix products, which MKL does
with fused multiply-adds; a compiled per-pixel loop without them is compute-bound
and no faster (measured on this project's machine: 1.2-1.4 ms against 1.1 ms per
batch of 16,384 pixels).

The eager functions stay the reference and the fallback (no C compiler, a device
other than the CPU, or ``GRIDSOLVE_SOLVE_KERNEL=eager``). Both are free of fused
multiply-adds (``-ffp-contract=off``), but they round differently (the kernel
multiplies by reciprocal square roots, sums residuals in row order), so they are
held, like any CPU code path, to the agreement bound of
:mod:`gridsolve.stages.engine.agreement` (tests/stages/test_kernel.py) and which
one ran is not part of a cache key. Every kernel works pixel by pixel: its result
for a pixel depends on that pixel's inputs alone, never on the other pixels of the
batch or on how they are shared out over threads (the matrix products that feed it
are MKL's, which round by the batch's width as the bound allows). The source below
is part of the solve stage's code digest: editing it invalidates cached solves.

The library (x86-64 Linux only; elsewhere the eager path runs) is built on first use
(about 25 s, once per machine and compiler) with the system's C compiler (``$CC``,
which may carry arguments, else ``cc``/``gcc``) into ``$GRIDSOLVE_KERNEL_DIR``
(default ``~/.cache/gridsolve/kernels``; if that cannot be written, a folder of the
temporary directory that only this user can write to), named by a digest of the
source, the flags, the compiler and its version; processes that build at once (Dask
workers) each write a temporary file and rename it. It holds AVX-512, AVX2 and SSE2 versions and
picks one by the CPU it runs on; none uses fused multiply-adds, so they round alike.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

#: Choice of kernel: ``auto`` (C where it builds, else eager), ``c`` (C, or an
#: error saying why it cannot be built), ``eager`` (torch only).
ENV = "GRIDSOLVE_SOLVE_KERNEL"
#: Where built libraries are kept.
DIR_ENV = "GRIDSOLVE_KERNEL_DIR"
#: Pixels per block: a coef-10 factor block (55 × 64 doubles) fits the L1 cache.
BLOCK = 64
#: Fewest pixels per thread: handing a range to the pool costs about as much as
#: factoring a few hundred pixels (the dual's gap groups are often that small).
MIN_PART = 2048
#: The most gaps per pixel that :func:`gap_solve` takes.
MAX_GAPS = 64
#: The largest order (coefficients) that the residual kernel takes:
#: they keep a pixel's coefficients in registers.
MAX_ORDER = 16

SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(GS_CLONES)
#define GS_API __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GS_API
#endif

#define BW 64
/* the most gaps gs_gap_solve takes (its scratch is on the stack) */
#define NMAX_GAP 64

/* Entry (r, j), r >= j, of a lower triangle packed column after column. */
static inline long at(long r, long j, long n) { return j * n - j * (j - 1) / 2 + (r - j); }

/* Entry (r, j), r >= j, of a factor: packed (sq 0) or square n x n row-major (sq 1). */
static inline long ix(long r, long j, long n, long sq) { return sq ? r * n + j : at(r, j, n); }

/* Solve L Lt x = h in place for the w pixels from b0: h's rows are hs apart. */
static inline void solve_block(long n, long sq, long P, const double *G, long b0, long w,
                               double *h, long hs)
{
    for (long i = 0; i < n; ++i) {
        double *restrict hi = h + i * hs;
        const double *restrict lii = G + ix(i, i, n, sq) * P + b0;
        for (long p = 0; p < w; ++p) hi[p] /= lii[p];
        for (long r = i + 1; r < n; ++r) {
            double *restrict hr = h + r * hs;
            const double *restrict l = G + ix(r, i, n, sq) * P + b0;
            for (long p = 0; p < w; ++p) hr[p] -= l[p] * hi[p];
        }
    }
    for (long i = n - 1; i >= 0; --i) {
        double *restrict hi = h + i * hs;
        const double *restrict lii = G + ix(i, i, n, sq) * P + b0;
        for (long p = 0; p < w; ++p) hi[p] /= lii[p];
        for (long k = 0; k < i; ++k) {
            double *restrict hk = h + k * hs;
            const double *restrict l = G + ix(i, k, n, sq) * P + b0;
            for (long p = 0; p < w; ++p) hk[p] -= l[p] * hi[p];
        }
    }
}

/* Cholesky in place, pixels [p0, p1) of G: packed (n(n+1)/2, P), linalg.packed_cholesky,
   or square (n, n, P) with sq, linalg.batched_cholesky (its lower triangle becomes the
   factor; the upper is left alone). ok[p] = 1 where every pivot exceeds tol times its
   diagonal entry (and the smallest normal double). With var (packed only, n <= 16), each
   block's gs_spread_var too, and with h (n, P), each block's solve_block, while its
   factor is in cache. Returns -1 when out of memory. */
int gs_spread_var(long n, long P, const double *G, const double *T, double *var, long p0,
                  long p1);

GS_API int gs_cholesky(long n, long sq, long P, double *G, unsigned char *ok, double tol,
                       const double *T, double *var, double *h, long p0, long p1)
{
    double *diag = malloc(sizeof(double) * (size_t)(n * BW + 1));
    if (!diag) return -1;
    for (long b0 = p0; b0 < p1; b0 += BW) {
        long w = p1 - b0 < BW ? p1 - b0 : BW;
        unsigned char *restrict okb = ok + b0;
        for (long p = 0; p < w; ++p) okb[p] = 1;
        for (long j = 0; j < n; ++j) {
            const double *restrict g = G + ix(j, j, n, sq) * P + b0;
            double *restrict d = diag + j * BW;
            for (long p = 0; p < w; ++p) d[p] = g[p];
        }
        for (long j = 0; j < n; ++j) {
            double piv[BW];
            const double *restrict d = diag + j * BW;
            const double *restrict gjj = G + ix(j, j, n, sq) * P + b0;
            for (long p = 0; p < w; ++p) {
                double d2 = gjj[p], lim = tol * d[p];
                /* torch: d2 > clamp_min(tol * diag, tiny); NaN compares false */
                okb[p] &= (unsigned char)((d2 > lim) & (d2 > DBL_MIN));
                piv[p] = 1.0 / sqrt(isnan(d2) ? d2 : (d2 > DBL_MIN ? d2 : DBL_MIN));
            }
            for (long r = j; r < n; ++r) {
                double *restrict g = G + ix(r, j, n, sq) * P + b0;
                for (long p = 0; p < w; ++p) g[p] *= piv[p];
            }
            for (long c = j + 1; c < n; ++c) {
                const double *restrict lc = G + ix(c, j, n, sq) * P + b0;
                for (long r = c; r < n; ++r) {
                    double *restrict dst = G + ix(r, c, n, sq) * P + b0;
                    const double *restrict lr = G + ix(r, j, n, sq) * P + b0;
                    for (long p = 0; p < w; ++p) dst[p] -= lr[p] * lc[p];
                }
            }
        }
        if (h) solve_block(n, sq, P, G, b0, w, h + b0, P);
        if (var && !sq && gs_spread_var(n, P, G, T, var, b0, b0 + w)) {
            free(diag);
            return -1;
        }
    }
    free(diag);
    return 0;
}

/* Solve L Lt x = h in place, pixels [p0, p1) of h (n, P), L packed or square (sq):
   linalg.PackedFactor.solve_, linalg.cholesky_solve. */
GS_API void gs_solve(long n, long sq, long P, const double *G, double *h, long p0, long p1)
{
    for (long b0 = p0; b0 < p1; b0 += BW) {
        long w = p1 - b0 < BW ? p1 - b0 : BW;
        solve_block(n, sq, P, G, b0, w, h + b0, P);
    }
}

/* B0 = src where finite, else 0, as double (torch's nan_to_num(0, 0, 0) after the
   conversion) and, when W is given, W = 1 where finite, else 0; rows [0, m), columns
   [p0, p1); src rows are `stride` elements apart. */
#define GS_LOAD(NAME, T)                                                                    \
    GS_API void NAME(long m, long P, const T *src, long stride, double *B0, double *W,      \
                     long p0, long p1)                                                      \
    {                                                                                       \
        for (long t = 0; t < m; ++t) {                                                      \
            const T *restrict s = src + t * stride;                                         \
            double *restrict b = B0 + t * P;                                                \
            if (W) {                                                                        \
                double *restrict w = W + t * P;                                             \
                for (long p = p0; p < p1; ++p) {                                            \
                    double x = (double)s[p];                                                \
                    int finite = x - x == 0.0; /* NaN and inf give NaN */                   \
                    b[p] = finite ? x : 0.0;                                                \
                    w[p] = finite ? 1.0 : 0.0;                                              \
                }                                                                           \
            } else {                                                                        \
                for (long p = p0; p < p1; ++p) {                                            \
                    double x = (double)s[p];                                                \
                    b[p] = (x - x == 0.0) ? x : 0.0;                                        \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }
GS_LOAD(gs_load_f32, float)
GS_LOAD(gs_load_f64, double)

/* linalg._step for one (x, dx) pair, pixels [p0, p1): x += dx where the pixel is refined
   (every pixel when conv_in is NULL, else those with ok and not conv_in); conv_out =
   conv_in, or refined with ok and max|dx| <= tol * max|x|, max|x| finite (NaN never is). */
GS_API void gs_step(long n, long P, double *x, const double *dx, const unsigned char *ok,
                    const unsigned char *conv_in, unsigned char *conv_out, double tol, long p0,
                    long p1)
{
    for (long b0 = p0; b0 < p1; b0 += BW) {
        long w = p1 - b0 < BW ? p1 - b0 : BW;
        /* flags as doubles: selects on bytes keep GCC from vectorising */
        double act[BW], was[BW], okd[BW], xm[BW], dm[BW];
        for (long p = 0; p < w; ++p) {
            okd[p] = (double)ok[b0 + p];
            was[p] = conv_in ? (double)conv_in[b0 + p] : 0.0;
        }
        for (long p = 0; p < w; ++p) {
            act[p] = conv_in ? okd[p] * (1.0 - was[p]) : 1.0;
            xm[p] = 0.0, dm[p] = 0.0;
        }
        for (long k = 0; k < n; ++k) {
            double *restrict xk = x + k * P + b0;
            const double *restrict dk = dx + k * P + b0;
            for (long p = 0; p < w; ++p) {
                double nx = act[p] > 0.5 ? xk[p] + dk[p] : xk[p];
                xk[p] = nx;
                double a = fabs(nx), d = fabs(dk[p]);
                xm[p] = (a > xm[p]) | (a != a) ? a : xm[p];
                dm[p] = (d > dm[p]) | (d != d) ? d : dm[p];
            }
        }
        for (long p = 0; p < w; ++p) {
            int now = (act[p] > 0.5) & (okd[p] > 0.5) & (xm[p] <= DBL_MAX) & (dm[p] <= tol * xm[p]);
            conv_out[b0 + p] = (unsigned char)((was[p] > 0.5) | now);
        }
    }
}

/* The gap-wise dual's solve (linalg._dual_schur) for pixels [p0, p1) of a group of np
   pixels with k gaps each, which are columns a + p of u and Z (P columns, row-major):
   Z[rows[i][p]][a + p] = ((L L^T)^-1 h)[i] with h[i] = u[rows[i][p]][a + p], L square
   (k, k, np), rows (k, np). */
GS_API void gs_gap_solve(long k, long np, const double *L, const int64_t *rows, const double *u,
                         double *Z, long P, long a, long p0, long p1)
{
    double h[NMAX_GAP * BW];
    for (long b0 = p0; b0 < p1; b0 += BW) {
        long w = p1 - b0 < BW ? p1 - b0 : BW;
        for (long i = 0; i < k; ++i) {
            const int64_t *restrict ri = rows + i * np + b0;
            for (long p = 0; p < w; ++p) h[i * BW + p] = u[ri[p] * P + a + b0 + p];
        }
        solve_block(k, 1, np, L, b0, w, h, BW);
        for (long i = 0; i < k; ++i) {
            const int64_t *restrict ri = rows + i * np + b0;
            for (long p = 0; p < w; ++p) Z[ri[p] * P + a + b0 + p] = h[i * BW + p];
        }
    }
}

/* lstsq._statistics for pixels [p0, p1), each pixel's coefficients C (rows cs apart) and
   unscaled variances var (rows vs apart): standard errors and t (rows os apart), dof,
   R² and flags. A pixel is solved when its status is one of ok[0..3] and its
   coefficients are finite. dof = n − edf, rounded to an integer within 1e-6 unless
   ridge or the pixel fell back to ridge (status fell); sigma = wrms √(n/dof) (scaled)
   or 1; stderr = √var · sigma; R² = 1 − (wrms/trms)²; flags: 1 a
   coefficient not identifiable (NaN var), 2 no dof, 4 not solved. */
GS_API void gs_statistics(long coef, const double *C, long cs, const signed char *status,
                          const int *n_valid, const double *wrms, const double *trms,
                          const double *var, long vs, const double *edf, long ridge, long scaled,
                          const signed char *okc, signed char fell, double *se, long os,
                          double *dof_out, double *r2, signed char *flags, long p0, long p1)
{
    for (long b0 = p0; b0 < p1; b0 += BW) {
        long w = p1 - b0 < BW ? p1 - b0 : BW;
        double sig[BW], fin[BW], nan[BW];
        for (long p = 0; p < w; ++p) fin[p] = 1.0, nan[p] = 0.0;
        for (long k = 0; k < coef; ++k) {
            const double *restrict c = C + k * cs + b0, *restrict v = var + k * vs + b0;
            for (long p = 0; p < w; ++p) {
                fin[p] = (c[p] - c[p] == 0.0) ? fin[p] : 0.0; /* inf - inf and NaN: not 0 */
                nan[p] = (v[p] != v[p]) ? 1.0 : nan[p];
            }
        }
        /* branch-free, on doubles only (loaded first), so that GCC vectorises it */
        const double o0 = okc[0], o1 = okc[1], o2 = okc[2], o3 = okc[3];
        const double fr = fell, nan_ = NAN;
        const double round_rank = ridge ? 0.0 : 1.0, residual = scaled ? 1.0 : 0.0;
        double sol[BW], dofs[BW], svs[BW], nvs[BW];
        for (long p = 0; p < w; ++p) svs[p] = (double)status[b0 + p];
        for (long p = 0; p < w; ++p) nvs[p] = (double)n_valid[b0 + p];
        for (long p = 0; p < w; ++p) {
            double sv = svs[p], n = nvs[p], e = edf[b0 + p], wr = wrms[b0 + p];
            double tr = trms[b0 + p], fi = fin[p];
            double sd = sv == o0 ? 1.0 : 0.0;
            sd = sv == o1 ? 1.0 : sd;
            sd = sv == o2 ? 1.0 : sd;
            sd = sv == o3 ? 1.0 : sd;
            sd = fi > 0.5 ? sd : 0.0;
            double dof = sd > 0.5 ? n - e : nan_;
            double whole = rint(dof);
            double keep = fabs(dof - whole) <= 1e-6 ? round_rank : 0.0;
            keep = sv != fr ? keep : 0.0;
            dof = (keep > 0.5 ? whole : dof) + 0.0; /* no -0 (n - edf is never -0 itself) */
            double by_residual = dof > 0 ? wr * sqrt(n / dof) : nan_;
            by_residual = sd > 0.5 ? by_residual : nan_;
            double plain = sd > 0.5 ? 1.0 : nan_;
            sig[p] = residual > 0.5 ? by_residual : plain;
            double q = wr / tr;
            r2[b0 + p] = sd > 0.5 ? 1.0 - q * q : nan_;
            dof_out[b0 + p] = dof;
            dofs[p] = dof;
            sol[p] = sd;
        }
        for (long p = 0; p < w; ++p)
            flags[b0 + p] = (signed char)(sol[p] > 0.5 ? (nan[p] > 0.5) + 2 * !(dofs[p] > 0) : 4);
        for (long k = 0; k < coef; ++k) {
            const double *restrict v = var + k * vs + b0;
            double *restrict e = se + k * os + b0;
            for (long p = 0; p < w; ++p) e[p] = sqrt(v[p]) * sig[p];
        }
    }
}

/* Z = L^-1 T per pixel (T: n x n lower triangular, row-major, shared; NULL: the
   identity) and var[k] = sum_i Z[i][k]^2, pixels [p0, p1): linalg._primal_spread.
   Z (n, n, P) is written when given (zeros above the diagonal). Returns -1 when
   out of memory. */
GS_API int gs_spread(long n, long P, const double *G, const double *T, double *Z, double *var,
                     long p0, long p1)
{
    double *scratch = NULL;
    if (!Z) {
        scratch = malloc(sizeof(double) * (size_t)(n * n * BW));
        if (!scratch) return -1;
    }
    for (long b0 = p0; b0 < p1; b0 += BW) {
        long w = p1 - b0 < BW ? p1 - b0 : BW;
        /* row r, column k of this block's Z */
        double *base = Z ? Z + b0 : scratch;
        long rs = Z ? n * P : n * BW, cs = Z ? P : BW;
        for (long r = 0; r < n; ++r)
            for (long k = 0; k < n; ++k) {
                double t = T ? T[r * n + k] : (double)(r == k);
                double *restrict z = base + r * rs + k * cs;
                for (long p = 0; p < w; ++p) z[p] = t;
            }
        for (long k = 0; k < n; ++k) {
            double *restrict v = var + k * P + b0;
            for (long p = 0; p < w; ++p) v[p] = 0.0;
        }
        for (long i = 0; i < n; ++i) {
            const double *restrict lii = G + at(i, i, n) * P + b0;
            double inv[BW];
            for (long p = 0; p < w; ++p) inv[p] = 1.0 / lii[p];
            for (long k = 0; k <= i; ++k) {
                double *restrict zi = base + i * rs + k * cs;
                double *restrict v = var + k * P + b0;
                for (long p = 0; p < w; ++p) zi[p] *= inv[p];
                for (long r = i + 1; r < n; ++r) {
                    double *restrict zr = base + r * rs + k * cs;
                    const double *restrict l = G + at(r, i, n) * P + b0;
                    for (long p = 0; p < w; ++p) zr[p] -= l[p] * zi[p];
                }
                for (long p = 0; p < w; ++p) v[p] += zi[p] * zi[p];
            }
        }
    }
    free(scratch);
    return 0;
}

"""

#: The vector kernels, written once for a lane count VL and instantiated per
#: instruction set (the library picks one by the CPU it runs on).
_SHARED = r"""
#define NMAX 16

/* Copies of the last (< VL) pixels into VL lanes, rows VL apart (the other lanes
   filled with `fill`), so that they take the same arithmetic. */
static void pad_lanes(long rows, const double *src, long stride, long w, long vl, double fill,
                      double *dst)
{
    for (long r = 0; r < rows; ++r)
        for (long l = 0; l < vl; ++l) dst[r * vl + l] = l < w ? src[r * stride + l] : fill;
}

#define DISPATCH(N, CALL)                                                                   \
    switch (N) {                                                                            \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;                 \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break;                 \
    case 7: CALL(7); break; case 8: CALL(8); break; case 9: CALL(9); break;                 \
    case 10: CALL(10); break; case 11: CALL(11); break; case 12: CALL(12); break;           \
    case 13: CALL(13); break; case 14: CALL(14); break; case 15: CALL(15); break;           \
    default: CALL(16); break;                                                               \
    }
"""

_TEMPLATE = r"""
/* Pixels VL at a time (one vector register: 8 lanes with AVX-512, 4 with AVX2, 2
   with SSE2), a pixel's coefficients in registers: GCC vector extensions, whose lanes
   are IEEE operations like scalar code (no fused multiply-adds). Rows go four at a
   time so that four residuals are in flight; each row's arithmetic is unchanged. */
typedef double vd_SFX __attribute__((vector_size(8 * VL)));
typedef long vi_SFX __attribute__((vector_size(8 * VL)));
#define TGT __attribute__((target(TARGET)))
#define AIT static inline __attribute__((always_inline)) TGT
#define vd vd_SFX
#define vi vi_SFX

AIT vd ld_SFX(const double *p) { vd v; memcpy(&v, p, sizeof v); return v; }
AIT void st_SFX(double *p, vd v) { memcpy(p, &v, sizeof v); }
AIT vd sel_SFX(vi c, vd a, vd b) { return (vd)(((vi)a & c) | ((vi)b & ~c)); }

/* Rows are bs apart, each read VL pixels at a time: dozens of streams at once, more
   than the hardware prefetcher follows, so each row's next lines are fetched ahead. */
#define PF_SFX(p) __builtin_prefetch((p) + PF_AHEAD * VL)
#ifndef PF_AHEAD
#define PF_AHEAD 4
#endif

/* r = B0 - A x for R rows from t, into r[] */
#define RES_SFX(R)                                                                          \
    for (int u = 0; u < R; ++u) PF_SFX(B0 + (t + u) * bs), PF_SFX(W + (t + u) * bs);        \
    for (int u = 0; u < R; ++u) r[u] = ld_SFX(B0 + (t + u) * bs);                           \
    for (long k = 0; k < n; ++k)                                                            \
        for (int u = 0; u < R; ++u) r[u] -= A[(t + u) * n + k] * xr[k];

/* With ALL 0 (full == 2), without W r^2 and W b^2 */
#define MOM_SFX(R, ALL)                                                                     \
    {                                                                                       \
        vd r[R];                                                                            \
        RES_SFX(R)                                                                          \
        for (int u = 0; u < R; ++u) {                                                       \
            vd b = ld_SFX(B0 + (t + u) * bs), w = ld_SFX(W + (t + u) * bs);                 \
            vi v = w > 0.0;                                                                 \
            vd rr = r[u] * r[u];                                                            \
            ss += sel_SFX(v, rr, zero);                                                     \
            if (ALL) wss += sel_SFX(v, w * rr, zero);                                       \
            sw += w;                                                                        \
            swb += sel_SFX(v, w * b, zero);                                                 \
            if (ALL) uss += sel_SFX(v, w * (b * b), zero);                                  \
        }                                                                                   \
    }

#define SS_SFX(R)                                                                           \
    {                                                                                       \
        vd r[R];                                                                            \
        RES_SFX(R)                                                                          \
        for (int u = 0; u < R; ++u) {                                                       \
            vd rr = r[u] * r[u];                                                            \
            ss += sel_SFX(ld_SFX(W + (t + u) * bs) > 0.0, rr, zero);                        \
        }                                                                                   \
    }

/* Sums over the rows of VL pixels with weights W (W > 0: valid), r = B0 - A x:
   out[0] of r^2 where valid and, with full, out[1] of W r^2, out[2] of W (b - mean)^2
   about the weighted mean, out[3] of W b^2; with full == 2, out[2] only of these
   (out[1] and out[3] are 0). */
AIT void moments_SFX(const long n, long m, const double *A, const double *B0, const double *W,
                     long bs, const double *x, long xs, long full, vd out[4])
{
    vd xr[NMAX];
    const vd zero = {0};
    vd ss = zero, wss = zero, sw = zero, swb = zero, uss = zero, tss = zero;
    for (long k = 0; k < n; ++k) xr[k] = ld_SFX(x + k * xs);
    long t = 0;
    if (!full) {
        for (; t + 4 <= m; t += 4) SS_SFX(4)
        for (; t < m; ++t) SS_SFX(1)
        out[0] = ss, out[1] = out[2] = out[3] = zero;
        return;
    }
    if (full == 2) {
        for (; t + 4 <= m; t += 4) MOM_SFX(4, 0)
        for (; t < m; ++t) MOM_SFX(1, 0)
    } else {
        for (; t + 4 <= m; t += 4) MOM_SFX(4, 1)
        for (; t < m; ++t) MOM_SFX(1, 1)
    }
    vd mean = swb / sw;
    for (t = 0; t < m; ++t) {
        vd w = ld_SFX(W + t * bs), d = ld_SFX(B0 + t * bs) - mean;
        tss += sel_SFX(w > 0.0, w * (d * d), zero);
    }
    out[0] = ss, out[1] = wss, out[2] = tss, out[3] = uss;
}

/* diag(Z^T Z) of Z = L^-1 T for VL pixels (L packed, rows gs apart; T lower triangular,
   row-major, or NULL for the identity): forward substitution of T's columns. Column k
   of Z is zero above row k. All columns advance together, row j of each at step j:
   their updates are independent, where a column at a time is a chain of dependent
   operations (latency-bound); each entry gets the same operations in the same order. */
AIT void spread_SFX(const long n, const double *G, long gs, const double *T, double *var,
                    long vs)
{
    vd inv[NMAX], acc[NMAX], z[NMAX][NMAX]; /* z[i][k], k <= i */
    const vd zero = {0}, one = zero + 1.0;
    for (long i = 0; i < n; ++i) {
        inv[i] = one / ld_SFX(G + at(i, i, n) * gs);
        acc[i] = zero;
        for (long k = 0; k <= i; ++k) z[i][k] = zero + (T ? T[i * n + k] : (double)(i == k));
    }
    for (long j = 0; j < n; ++j) {
        for (long k = 0; k <= j; ++k) {
            vd zj = z[j][k] * inv[j];
            acc[k] += zj * zj;
            z[j][k] = zj;
        }
        for (long i = j + 1; i < n; ++i) {
            vd l = ld_SFX(G + at(i, j, n) * gs);
            for (long k = 0; k <= j; ++k) z[i][k] -= l * z[j][k];
        }
    }
    for (long k = 0; k < n; ++k) st_SFX(var + k * vs, acc[k]);
}

static TGT int spread_all_SFX(long n, long P, const double *G, const double *T, double *var,
                              long p0, long p1)
{
    long np = n * (n + 1) / 2;
    double *pad = malloc(sizeof(double) * (size_t)(VL * (np + n)));
    if (!pad) return -1;
    for (long b0 = p0; b0 < p1; b0 += VL) {
        long w = p1 - b0 < VL ? p1 - b0 : VL;
        if (w == VL) {
#define SPREAD_SFX(K) spread_SFX(K, G + b0, P, T, var + b0, P)
            DISPATCH(n, SPREAD_SFX)
        } else {
            double *pg = pad, *pv = pad + VL * np;
            pad_lanes(np, G + b0, P, w, VL, 1.0, pg);
#define SPREAD_TAIL_SFX(K) spread_SFX(K, pg, VL, T, pv, VL)
            DISPATCH(n, SPREAD_TAIL_SFX)
            for (long k = 0; k < n; ++k)
                for (long l = 0; l < w; ++l) var[k * P + b0 + l] = pv[k * VL + l];
        }
    }
    free(pad);
    return 0;
}

static TGT int moments_all_SFX(long n, long m, long P, const double *A, const double *B0,
                               const double *W, const double *x, long full, double *ss,
                               double *wss, double *tss, double *uss, long p0, long p1)
{
    double *pad = malloc(sizeof(double) * (size_t)(VL * (2 * m + n)));
    if (!pad) return -1;
    for (long b0 = p0; b0 < p1; b0 += VL) {
        long w = p1 - b0 < VL ? p1 - b0 : VL;
        vd out[4];
        double o[4][VL];
        const double *pb = B0 + b0, *pw = W + b0, *px = x + b0;
        long bs = P, xs = P;
        if (w < VL) {
            double *qb = pad, *qw = qb + VL * m, *qx = qw + VL * m;
            pad_lanes(m, B0 + b0, P, w, VL, 0.0, qb);
            pad_lanes(m, W + b0, P, w, VL, 0.0, qw);
            pad_lanes(n, x + b0, P, w, VL, 0.0, qx);
            pb = qb, pw = qw, px = qx, bs = VL, xs = VL;
        }
#define MOMENTS_SFX(K) moments_SFX(K, m, A, pb, pw, bs, px, xs, full, out)
        DISPATCH(n, MOMENTS_SFX)
        for (int q = 0; q < 4; ++q) st_SFX(o[q], out[q]);
        for (long l = 0; l < w; ++l) {
            ss[b0 + l] = o[0][l], wss[b0 + l] = o[1][l];
            tss[b0 + l] = o[2][l], uss[b0 + l] = o[3][l];
        }
    }
    free(pad);
    return 0;
}

typedef float vf_SFX __attribute__((vector_size(4 * VL)));

AIT vd vabs_SFX(vd a)
{
    const vi mag = (vi){0} + 0x7fffffffffffffffL;
    return (vd)((vi)a & mag);
}

/* lane by lane: GCC makes it one vector square root */
AIT vd vsqrt_SFX(vd a)
{
    double t[VL];
    st_SFX(t, a);
    for (int l = 0; l < VL; ++l) t[l] = sqrt(t[l]);
    return ld_SFX(t);
}

/* L L^T y = h in place (L packed): the arithmetic of solve_block, per lane */
AIT void fsolve_SFX(const long n, const vd *L, vd *h)
{
    for (long i = 0; i < n; ++i) {
        h[i] /= L[at(i, i, n)];
        for (long r = i + 1; r < n; ++r) h[r] -= L[at(r, i, n)] * h[i];
    }
    for (long i = n - 1; i >= 0; --i) {
        h[i] /= L[at(i, i, n)];
        for (long k = 0; k < i; ++k) h[k] -= L[at(i, k, n)] * h[i];
    }
}

/* The whole per-pixel primal fit of VL pixels whose weights are their 0/1 masks
   (linalg.fit_unit), with every intermediate in registers or the L1 cache: the
   data's m rows bv (0 where invalid) and masks wv, VL apart; Q (m x n) the design's
   orthonormal basis, pairs its packed Gram rows (np x m), A (m x n) the design, T
   = R^-T (n x n lower triangular, row-major; NULL: Q is A). Out: the coefficients
   x = T^T x_Q (rows xs apart), good (1.0: every pivot passed and the refinement
   converged), ss the sum of squared residuals r = b - A x over valid rows and, with
   want, var = diag(Z^T Z), Z = L^-1 T, and tss the sum of squares about the mean.
   Each step's arithmetic is that of the separate kernels (gs_cholesky, gs_step; the
   sums and the spread are moments_SFX and spread_SFX themselves); G, Q^T b and the
   refinement's residuals are summed in row order. */
AIT void fit_SFX(const long n, long m, const double *restrict bv, const double *restrict wv,
                 const double *Q, const double *pairs, const double *A, const double *T,
                 double tol, double rtol, long steps, long want, double *xo, long xs,
                 double *go, double *sso, double *varo, double *tsso)
{
    const long np = n * (n + 1) / 2;
    const vd zero = {0}, one = zero + 1.0, dmin = zero + DBL_MIN, dmax = zero + DBL_MAX;
    vd L[NMAX * (NMAX + 1) / 2], dg[NMAX], h[NMAX], x[NMAX], xf[NMAX];
    long c0 = 0;
    for (; c0 + 8 <= np; c0 += 8) {
        vd acc[8];
        for (int c = 0; c < 8; ++c) acc[c] = zero;
        for (long t = 0; t < m; ++t) {
            vd w = ld_SFX(wv + t * VL);
            for (int c = 0; c < 8; ++c) acc[c] += pairs[(c0 + c) * m + t] * w;
        }
        for (int c = 0; c < 8; ++c) L[c0 + c] = acc[c];
    }
    if (c0 < np) {
        vd acc[8];
        const long cn = np - c0;
        for (int c = 0; c < 8; ++c) acc[c] = zero;
        for (long t = 0; t < m; ++t) {
            vd w = ld_SFX(wv + t * VL);
            for (long c = 0; c < cn; ++c) acc[c] += pairs[(c0 + c) * m + t] * w;
        }
        for (long c = 0; c < cn; ++c) L[c0 + c] = acc[c];
    }
    for (long k = 0; k < n; ++k) h[k] = zero;
    for (long t = 0; t < m; ++t) {
        vd b = ld_SFX(bv + t * VL);
        for (long k = 0; k < n; ++k) h[k] += Q[t * n + k] * b;
    }
    /* gs_cholesky */
    vi ok = (vi){0} - 1;
    for (long j = 0; j < n; ++j) dg[j] = L[at(j, j, n)];
    for (long j = 0; j < n; ++j) {
        vd d2 = L[at(j, j, n)];
        ok &= (d2 > tol * dg[j]) & (d2 > dmin);
        vd piv = one / vsqrt_SFX(sel_SFX((d2 != d2) | (d2 > dmin), d2, dmin));
        for (long r = j; r < n; ++r) L[at(r, j, n)] *= piv;
        for (long c = j + 1; c < n; ++c)
            for (long r = c; r < n; ++r) L[at(r, c, n)] -= L[at(r, j, n)] * L[at(c, j, n)];
    }
    fsolve_SFX(n, L, h);
    for (long k = 0; k < n; ++k) x[k] = h[k];
    /* refinement: gs_step, the first step on every lane, later ones on lanes not yet
       converged (ok and not conv) */
    vi conv = (vi){0};
    for (long s = 0; s < steps; ++s) {
        vi act = s ? ok & ~conv : (vi){0} - 1;
        vi any = act;
        long some = 0;
        for (int l = 0; l < VL; ++l) some |= any[l];
        if (!some) break;
        for (long k = 0; k < n; ++k) h[k] = zero;
        for (long t = 0; t < m; ++t) {
            vd r = ld_SFX(bv + t * VL);
            for (long k = 0; k < n; ++k) r -= Q[t * n + k] * x[k];
            r *= ld_SFX(wv + t * VL);
            for (long k = 0; k < n; ++k) h[k] += Q[t * n + k] * r;
        }
        fsolve_SFX(n, L, h);
        vd xm = zero, dm = zero;
        for (long k = 0; k < n; ++k) {
            vd nx = sel_SFX(act, x[k] + h[k], x[k]);
            x[k] = nx;
            vd a = vabs_SFX(nx), d = vabs_SFX(h[k]);
            xm = sel_SFX((a > xm) | (a != a), a, xm);
            dm = sel_SFX((d > dm) | (d != d), d, dm);
        }
        vi now = act & ok & (xm <= dmax) & (dm <= rtol * xm);
        conv |= now;
    }
    if (T) {
        for (long i = 0; i < n; ++i) {
            vd acc = zero;
            for (long k = 0; k < n; ++k) acc += T[k * n + i] * x[k];
            xf[i] = acc;
        }
    } else {
        for (long i = 0; i < n; ++i) xf[i] = x[i];
    }
    for (long k = 0; k < n; ++k) st_SFX(xo + k * xs, xf[k]);
    st_SFX(go, sel_SFX(ok & conv, one, zero));
    /* the residual sums on the final coefficients, and the spread: the separate
       kernels' own code, on this block's data and factor */
    vd out[4];
    moments_SFX(n, m, A, bv, wv, VL, xo, xs, want ? 2 : 0, out);
    st_SFX(sso, out[0]);
    if (!want) return;
    st_SFX(tsso, out[2]);
    spread_SFX(n, (const double *)L, VL, T, varo, xs);
}

/* fit_SFX over pixels [p0, p1) of the data src (m rows, `stride` elements apart,
   float64 with f64 else float32): each VL pixels' rows converted (NaN and +-inf: 0,
   weight 0) into scratch, then fitted. Returns -1 when out of memory. */
static TGT int fit_all_SFX(long n, long m, long P, const void *src, long stride, long f64,
                           const double *Q, const double *pairs, const double *A,
                           const double *T, double tol, double rtol, long steps, long want,
                           double *x, unsigned char *good, double *ss, double *var, double *tss,
                           long p0, long p1)
{
    double *pad = malloc(sizeof(double) * (size_t)(VL * (2 * m + 2 * n + 4)));
    if (!pad) return -1;
    double *bv = pad, *wv = pad + VL * m, *qx = wv + VL * m, *qv = qx + VL * n;
    double *qg = qv + VL * n, *qs = qg + VL, *qt = qs + VL;
    const vd zero = {0}, one = zero + 1.0;
    const float *s32 = src;
    const double *s64 = src;
    for (long b0 = p0; b0 < p1; b0 += VL) {
        long w = p1 - b0 < VL ? p1 - b0 : VL;
        for (long t = 0; t < m; ++t) {
            vd v;
            if (w == VL && f64) {
                PF_SFX(s64 + t * stride + b0);
                v = ld_SFX(s64 + t * stride + b0);
            } else if (w == VL) {
                vf_SFX f;
                PF_SFX(s32 + t * stride + b0);
                memcpy(&f, s32 + t * stride + b0, sizeof f);
                v = __builtin_convertvector(f, vd);
            } else {
                double lane[VL];
                for (long l = 0; l < VL; ++l)
                    lane[l] = l >= w ? NAN : f64 ? s64[t * stride + b0 + l]
                                                 : (double)s32[t * stride + b0 + l];
                v = ld_SFX(lane);
            }
            vi fin = (v - v) == zero; /* NaN and inf give NaN */
            st_SFX(bv + t * VL, sel_SFX(fin, v, zero));
            st_SFX(wv + t * VL, sel_SFX(fin, one, zero));
        }
        double g[VL];
        if (w == VL) {
            fit_SFX(n, m, bv, wv, Q, pairs, A, T, tol, rtol, steps, want, x + b0, P, g, ss + b0,
                    want ? var + b0 : NULL, want ? tss + b0 : NULL);
        } else {
            fit_SFX(n, m, bv, wv, Q, pairs, A, T, tol, rtol, steps, want, qx, VL, g, qs, qv, qt);
            for (long l = 0; l < w; ++l) {
                for (long k = 0; k < n; ++k) {
                    x[k * P + b0 + l] = qx[k * VL + l];
                    if (want) var[k * P + b0 + l] = qv[k * VL + l];
                }
                ss[b0 + l] = qs[l];
                if (want) tss[b0 + l] = qt[l];
            }
        }
        for (long l = 0; l < w; ++l) good[b0 + l] = g[l] > 0.5;
    }
    free(pad);
    return 0;
}
#undef vd
#undef vi
#undef TGT
#undef AIT
"""

_ENTRY = r"""
/* The widest vector version this CPU runs (3 AVX-512, 2 AVX2, 1 SSE2), or a narrower
   one asked for by gs_use_isa (tests run every version on one machine). */
static int gs_isa_limit = 3;

static int gs_isa(void)
{
    __builtin_cpu_init();
    int best = __builtin_cpu_supports("avx512f") ? 3 : __builtin_cpu_supports("avx2") ? 2 : 1;
    return best < gs_isa_limit ? best : gs_isa_limit;
}

int gs_use_isa(int limit)
{
    gs_isa_limit = limit;
    return gs_isa();
}

/* var[k] = sum_i Z[i][k]^2 of Z = L^-1 T per pixel of [p0, p1) (L packed, n <= 16; T
   lower triangular row-major, NULL: the identity): gs_spread without Z. Returns -1
   when n > 16 or out of memory. */
int gs_spread_var(long n, long P, const double *G, const double *T, double *var, long p0,
                  long p1)
{
    if (n < 1 || n > NMAX) return -1;
    int isa = gs_isa();
    if (isa >= 3) return spread_all_avx512(n, P, G, T, var, p0, p1);
    if (isa == 2) return spread_all_avx2(n, P, G, T, var, p0, p1);
    return spread_all_sse2(n, P, G, T, var, p0, p1);
}

/* Per pixel of [p0, p1), with r = B0 - A x (A: m x n row-major, n <= 16) and weights W
   (W > 0: valid rows): ss = sum of r^2 over valid rows and, with full (2: tss only, the
   others 0), wss of W r^2,
   tss of W (b - mean)^2 about the weighted mean, uss of W b^2 (else 0), each summed
   in row order. Returns -1 when n > 16 or out of memory. */
int gs_moments(long n, long m, long P, const double *A, const double *B0, const double *W,
               const double *x, long full, double *ss, double *wss, double *tss, double *uss,
               long p0, long p1)
{
    if (n < 1 || n > NMAX) return -1;
    int isa = gs_isa();
    if (isa >= 3)
        return moments_all_avx512(n, m, P, A, B0, W, x, full, ss, wss, tss, uss, p0, p1);
    if (isa == 2)
        return moments_all_avx2(n, m, P, A, B0, W, x, full, ss, wss, tss, uss, p0, p1);
    return moments_all_sse2(n, m, P, A, B0, W, x, full, ss, wss, tss, uss, p0, p1);
}


/* The fused primal fit (fit_SFX) of pixels [p0, p1): see fit_all. Returns -1 when
   n > 16 or out of memory. */
int gs_fit(long n, long m, long P, const void *src, long stride, long f64, const double *Q,
           const double *pairs, const double *A, const double *T, double tol, double rtol,
           long steps, long want, double *x, unsigned char *good, double *ss, double *var,
           double *tss, long p0, long p1)
{
    if (n < 1 || n > NMAX) return -1;
    int isa = gs_isa();
    if (isa >= 3)
        return fit_all_avx512(n, m, P, src, stride, f64, Q, pairs, A, T, tol, rtol, steps,
                              want, x, good, ss, var, tss, p0, p1);
    if (isa == 2)
        return fit_all_avx2(n, m, P, src, stride, f64, Q, pairs, A, T, tol, rtol, steps,
                            want, x, good, ss, var, tss, p0, p1);
    return fit_all_sse2(n, m, P, src, stride, f64, Q, pairs, A, T, tol, rtol, steps, want,
                        x, good, ss, var, tss, p0, p1);
}
"""

#: The whole C source: SOURCE's kernels, then the vector ones per instruction set.
SOURCE += (
    _SHARED
    + "".join(
        _TEMPLATE.replace("_SFX", f"_{sfx}").replace("VL", str(vl)).replace("TARGET", f'"{tgt}"')
        for sfx, vl, tgt in (("avx512", 8, "avx512f"), ("avx2", 4, "avx2"), ("sse2", 2, "sse2"))
    )
    + _ENTRY
)

#: Flags: no fused multiply-adds (the eager path has none; every clone rounds
#: alike); math-errno off so that sqrt vectorises (it changes no value).
FLAGS = (
    "-O3",
    "-std=gnu99",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-Wno-psabi",
)

#: Wall-clock limit of one compiler run: the compiler never waits on input, so this
#: only guards against a wedged toolchain, never against a slow, shared machine.
BUILD_TIMEOUT_S = 1800

_LOCK = threading.Lock()
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


class KernelUnavailable(RuntimeError):
    """The compiled kernel was required (``GRIDSOLVE_SOLVE_KERNEL=c``) but cannot be built."""


def choice() -> str:
    """The requested kernel (``auto``, ``c`` or ``eager``), checked."""
    how = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if how not in ("auto", "c", "eager"):
        raise ValueError(f"{ENV}={how!r} is not a kernel: set it to auto, c or eager")
    return how


def _compiler() -> list[str] | None:
    """The C compiler's command (``$CC`` may carry arguments: ``ccache gcc``), or None."""
    cc = shlex.split(os.environ.get("CC", ""))
    if cc:
        found = shutil.which(cc[0]) or (cc[0] if os.path.isfile(cc[0]) else None)
        return [found, *cc[1:]] if found else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _private_tmp() -> Path:
    """A build folder under the temporary directory that only this user can write to."""
    where = Path(tempfile.gettempdir()) / f"gridsolve-kernels-{os.getuid()}"
    where.mkdir(mode=0o700, exist_ok=True)
    st = where.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or where.is_symlink():
        # someone else's, or open to others: a library found there could be anyone's
        return Path(tempfile.mkdtemp(prefix="gridsolve-kernels-"))
    return where


def _cache_dir() -> Path:
    given = os.environ.get(DIR_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gridsolve" / "kernels"


def _build(cc: list[str], where: Path) -> Path:
    """The library for this source, flags and compiler: built into ``where`` unless there."""
    version = subprocess.run(
        [*cc, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    parts = [SOURCE, *FLAGS, *cc, version, platform.machine()]
    tag = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    lib = where / f"gridsolve-solve-{tag}.so"
    if lib.is_file():
        return lib
    where.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(SOURCE)
        out = Path(tmp) / "kernel.so"
        # function clones per instruction set where the compiler has them (GCC on glibc)
        for extra in (["-DGS_CLONES"], []):
            done = subprocess.run(
                [*cc, *FLAGS, *extra, str(src), "-o", str(out), "-lm"],
                capture_output=True,
                text=True,
                # 25 s of CPU on a quiet host, but over 2 min of wall time on a loaded
                # 2-core one (measured: 2m04 beside three busy jobs); a tight limit made
                # the build time out there and the run fall back to the eager path
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if done.returncode == 0:
                # a rename: concurrent builders (Dask workers) never see a partial file
                os.replace(out, lib)
                return lib
            errors.append(done.stderr.strip())
    raise OSError(f"{cc} failed: {errors[-1][-2000:]}")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    L, D, V = ctypes.c_long, ctypes.c_double, ctypes.c_void_p
    lib.gs_cholesky.argtypes = [L, L, L, V, V, D, V, V, V, L, L]
    lib.gs_cholesky.restype = ctypes.c_int
    lib.gs_solve.argtypes = [L, L, L, V, V, L, L]
    lib.gs_solve.restype = None
    lib.gs_spread.argtypes = [L, L, V, V, V, V, L, L]
    lib.gs_spread.restype = ctypes.c_int
    lib.gs_statistics.argtypes = [L, V, L, V, V, V, V, V, L, V, L, L, V, ctypes.c_byte]
    lib.gs_statistics.argtypes += [V, L, V, V, V, L, L]
    lib.gs_statistics.restype = None
    for fn in (lib.gs_load_f32, lib.gs_load_f64):
        fn.argtypes = [L, L, V, L, V, V, L, L]
        fn.restype = None
    lib.gs_spread_var.argtypes = [L, L, V, V, V, L, L]
    lib.gs_spread_var.restype = ctypes.c_int
    lib.gs_use_isa.argtypes = [ctypes.c_int]
    lib.gs_use_isa.restype = ctypes.c_int
    lib.gs_step.argtypes = [L, L, V, V, V, V, V, D, L, L]
    lib.gs_step.restype = None
    lib.gs_gap_solve.argtypes = [L, L, V, V, V, V, L, L, L, L]
    lib.gs_gap_solve.restype = None
    lib.gs_moments.argtypes = [L, L, L, V, V, V, V, L, V, V, V, V, L, L]
    lib.gs_moments.restype = ctypes.c_int
    lib.gs_fit.argtypes = [L, L, L, V, L, L, V, V, V, V, D, D, L, L, V, V, V, V, V, L, L]
    lib.gs_fit.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    how = choice()
    if how == "eager":
        return None
    cc = _compiler()
    problem = "no C compiler found (set CC, or install gcc)" if cc is None else ""
    if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith(
        "linux"
    ):
        # its vector code is written for x86-64 (AVX-512, AVX2, SSE2) and 64-bit longs
        cc, problem = None, f"written for x86-64 Linux, not {platform.machine()} {sys.platform}"
    if cc is not None:
        for place in (_cache_dir, _private_tmp):
            try:
                return _bind(ctypes.CDLL(str(_build(cc, place()))))
            except (OSError, subprocess.SubprocessError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
    if how == "c":
        raise KernelUnavailable(
            f"{ENV}=c, but the solve kernel cannot be built: {problem}. "
            f"Install a C compiler, or set {ENV}=auto to use the eager path."
        )
    warnings.warn(
        f"the compiled solve kernel is unavailable ({problem}); using the eager torch path "
        "(same results within the agreement bound, slower)",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _loaded() -> ctypes.CDLL:
    """The library, for the wrappers below (their callers checked :func:`usable`)."""
    lib = _library()
    if lib is None:
        raise KernelUnavailable(f"the solve kernel is not loaded ({ENV}={choice()})")
    return lib


def use_isa(limit: int) -> int:
    """Cap the register kernels' vector version; the one now used (3 AVX-512, 2 AVX2, 1 SSE2).

    For tests, which run every version on one machine.
    """
    lib = _loaded()
    return int(lib.gs_use_isa(int(limit)))


def name() -> str:
    """Which kernel the per-pixel solve uses on CPU tensors: ``c`` or ``eager``."""
    return "eager" if _library() is None else "c"


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernel can take these tensors (contiguous float64 on the CPU)."""
    if not all(
        t.device.type == "cpu" and t.dtype == torch.float64 and t.is_contiguous() for t in tensors
    ):
        return False
    return _library() is not None


def _parts(p: int) -> list[tuple[int, int]]:
    """Pixel ranges for torch's threads, in whole blocks, at least :data:`MIN_PART` pixels each."""
    if p <= 0:
        return []
    threads = max(1, min(torch.get_num_threads(), p // MIN_PART))
    step = math.ceil(math.ceil(p / threads) / BLOCK) * BLOCK
    return [(s, min(s + step, p)) for s in range(0, p, step)]


def _run(fn: Callable[..., object], args: tuple[object, ...], p: int) -> None:
    """``fn(*args, p0, p1)`` over the pixel ranges, in parallel (ctypes releases the GIL)."""
    global _POOL
    parts = _parts(p)
    if not parts:
        return
    if len(parts) == 1:
        results = [fn(*args, 0, p)]
    else:
        with _LOCK:
            if _POOL is None:
                _POOL = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, "gs-kernel")
        results = list(_POOL.map(lambda r: fn(*args, *r), parts))
    if any(r is not None and r != 0 for r in results):
        raise MemoryError("the solve kernel could not allocate its scratch")


def cholesky(
    G: torch.Tensor,
    n: int,
    tol: float,
    square: bool = False,
    spread: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    rhs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``G`` factored in place by the kernel; which pixels factored well.

    :func:`linalg.packed_cholesky`, or with ``square`` (G: n × n × P)
    :func:`linalg.batched_cholesky`. In the same pass over the factor:
    ``spread``: ``(T, var)``, and ``var`` (n, P) is filled as by :func:`spread`
    (packed, n ≤ :data:`MAX_ORDER`); ``rhs`` (n, P) is solved in place as by
    :func:`solve_`.
    """
    lib = _loaded()
    p = G.shape[-1]
    ok = torch.empty(p, dtype=torch.bool)
    if rhs is not None and not (rhs.shape == (n, p) and usable(rhs)):
        raise ValueError("the fused solve's right-hand side must be contiguous float64 (n, P)")
    hp = None if rhs is None else rhs.data_ptr()
    tp = vp = None
    if spread is not None:
        T, var = spread
        if square or not 1 <= n <= MAX_ORDER or var.shape != (n, p) or not usable(var):
            raise ValueError("the fused spread takes a packed factor of at most 16 columns")
        tp = None if T is None else T.data_ptr()
        vp = var.data_ptr()
        if T is not None and not (usable(T) and T.shape == (n, n)):
            raise ValueError("the fused spread's T must be a contiguous float64 n × n matrix")
    _run(lib.gs_cholesky, (n, int(square), p, G.data_ptr(), ok.data_ptr(), tol, tp, vp, hp), p)
    return ok


def solve_(G: torch.Tensor, n: int, h: torch.Tensor, square: bool = False) -> torch.Tensor:
    """``h`` (n, P) solved in place by the kernel.

    :meth:`linalg.PackedFactor.solve_`, or with ``square`` :func:`linalg.cholesky_solve`.
    """
    lib = _loaded()
    _run(lib.gs_solve, (n, int(square), h.shape[1], G.data_ptr(), h.data_ptr()), h.shape[1])
    return h


def step(
    x: torch.Tensor, dx: torch.Tensor, ok: torch.Tensor, conv: torch.Tensor | None, tol: float
) -> torch.Tensor:
    """:func:`linalg._step` for one pair, ``x`` corrected in place; which pixels converged."""
    lib = _loaded()
    n, p = x.shape
    flags = [ok] if conv is None else [ok, conv]
    if dx.shape != x.shape or not all(
        f.shape == (p,) and f.dtype == torch.bool and f.is_contiguous() for f in flags
    ):
        raise ValueError("step: x and dx (n, P), ok and conv (P,) contiguous bool")
    out = torch.empty(p, dtype=torch.bool)
    cp = None if conv is None else conv.data_ptr()
    args = (n, p, x.data_ptr(), dx.data_ptr(), ok.data_ptr(), cp, out.data_ptr(), tol)
    _run(lib.gs_step, args, p)
    return out


def gap_solve(
    L: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, Z: torch.Tensor, a: int
) -> None:
    """:func:`linalg._dual_schur`'s solve of one gap group, gathering and scattering in one pass.

    For the group's pixels (columns ``a`` on of ``u`` and ``Z``, both contiguous):
    ``Z[rows] = (L Lᵀ)⁻¹ u[rows]``; ``L`` (k, k, n), ``rows`` (k, n) int64.
    """
    lib = _loaded()
    k, n = rows.shape
    if not (
        rows.dtype == torch.int64
        and L.shape == (k, k, n)
        and u.shape == Z.shape
        and a + n <= u.shape[1]
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (L, rows, u, Z))
        and L.dtype == u.dtype == Z.dtype == torch.float64
    ):
        raise ValueError("gap_solve: L (k, k, n), rows (k, n) int64, u and Z contiguous float64")
    args = (k, n, L.data_ptr(), rows.data_ptr(), u.data_ptr(), Z.data_ptr(), u.shape[1], a)
    _run(lib.gs_gap_solve, args, n)


def _rows(a: np.ndarray, dtype: type) -> int:
    """The row stride, in elements, of a 2-D array whose rows are contiguous."""
    if (
        a.dtype != dtype
        or a.ndim != 2
        or not rows_contiguous(a)
        or a.strides[0] < 0
        or (a.shape[0] > 1 and a.strides[0] == 0)
    ):
        raise ValueError(f"expected a 2-D {np.dtype(dtype)} array with contiguous rows")
    return a.strides[0] // a.itemsize


def statistics(
    C: np.ndarray,
    status: np.ndarray,
    n_valid: np.ndarray,
    wrms: np.ndarray,
    trms: np.ndarray,
    var: np.ndarray,
    edf: np.ndarray,
    ridge: bool,
    scaled: bool,
    ok_codes: tuple[int, int, int, int],
    fell_back_ridge: int,
    out: dict[str, np.ndarray],
) -> None:
    """:func:`lstsq._statistics` (without covariance) of P pixels, into ``out``'s arrays.

    ``C``, ``var`` (coef, P) float64 and ``out``'s ``coef_stderr`` (coef, P) float64
    may be views whose rows are not adjacent; ``status`` (P,) int8,
    ``n_valid`` int32, ``wrms``, ``trms``, ``edf`` float64 and ``out``'s ``dof``,
    ``r2`` (float64) and ``uncertainty_flags`` (int8) are contiguous.
    """
    lib = _loaded()
    p = C.shape[1]
    se = out["coef_stderr"]
    # checked here, not asserted: they guard raw pointers (python -O drops asserts)
    if C.shape != se.shape or var.shape != C.shape:
        raise ValueError("statistics: C, var and the stderr output must share a shape")
    vectors = [status, n_valid, wrms, trms, edf, out["dof"], out["r2"], out["uncertainty_flags"]]
    if not all(v.flags.c_contiguous and v.shape == (p,) for v in vectors):
        raise ValueError("statistics: the per-pixel vectors must be contiguous, one per pixel")
    if status.dtype != np.int8 or n_valid.dtype != np.int32:
        raise ValueError("statistics: status must be int8 and n_valid int32")
    if out["uncertainty_flags"].dtype != np.int8 or not all(
        a.dtype == np.float64 for a in (wrms, trms, edf, out["dof"], out["r2"])
    ):
        raise ValueError("statistics: flags must be int8 and the other vectors float64")
    codes = np.asarray(ok_codes, dtype=np.int8)
    args = (
        C.shape[0],
        C.ctypes.data,
        _rows(C, np.float64),
        status.ctypes.data,
        n_valid.ctypes.data,
        wrms.ctypes.data,
        trms.ctypes.data,
        var.ctypes.data,
        _rows(var, np.float64),
        edf.ctypes.data,
        int(ridge),
        int(scaled),
        codes.ctypes.data,
        fell_back_ridge,
        se.ctypes.data,
        _rows(se, np.float64),
        out["dof"].ctypes.data,
        out["r2"].ctypes.data,
        out["uncertainty_flags"].ctypes.data,
    )
    _run(lib.gs_statistics, args, p)


def spread(
    G: torch.Tensor, n: int, T: torch.Tensor | None, want_z: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``diag(ZᵀZ)`` (n, P) for ``Z = L⁻¹T`` per pixel, and ``Z`` (n, n, P) when asked."""
    lib = _loaded()
    p = G.shape[1]
    var = torch.empty((n, p), dtype=torch.float64)
    Z = torch.empty((n, n, p), dtype=torch.float64) if want_z else None
    Tc = None if T is None else T.to(torch.float64).contiguous()
    if Z is None and 1 <= n <= MAX_ORDER:  # the variances only: the register kernel
        tp = None if Tc is None else Tc.data_ptr()
        _run(lib.gs_spread_var, (n, p, G.data_ptr(), tp, var.data_ptr()), p)
        return var, None
    _run(
        lib.gs_spread,
        (
            n,
            p,
            G.data_ptr(),
            None if Tc is None else Tc.data_ptr(),
            None if Z is None else Z.data_ptr(),
            var.data_ptr(),
        ),
        p,
    )
    return var, Z


def rows_contiguous(a: np.ndarray) -> bool:
    """Each row's elements adjacent (one column: whatever numpy says its stride is)."""
    return a.shape[1] == 1 or a.strides[1] == a.itemsize


def load(src: np.ndarray, finite: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``src`` (m, P) as float64 with NaN and ±inf as 0; None where the kernel cannot take it.

    With ``finite``, also where ``src`` is finite, as 0/1 floats. ``src``: float32 or
    float64 rows, each contiguous, any row stride (a column slice).
    """
    lib = _library()
    fn = {np.dtype(np.float32): "gs_load_f32", np.dtype(np.float64): "gs_load_f64"}
    name = fn.get(src.dtype)
    if lib is None or name is None or src.ndim != 2 or not rows_contiguous(src):
        return None
    if src.strides[0] % src.itemsize:
        return None
    m, p = src.shape
    B0 = torch.from_numpy(np.empty((m, p)))
    W = torch.from_numpy(np.empty((m, p))) if finite else None
    wp = None if W is None else W.data_ptr()
    args = (m, p, src.ctypes.data, src.strides[0] // src.itemsize, B0.data_ptr(), wp)
    _run(getattr(lib, name), args, p)
    return B0, W


def moments(
    A: torch.Tensor,
    B0: torch.Tensor,
    W: torch.Tensor,
    x: torch.Tensor,
    full: bool = True,
    centred_only: bool = False,
) -> torch.Tensor:
    """Per pixel, sums in row order of ``r = B0 − A x`` with weights ``W`` (> 0: valid rows).

    Rows of the (4, P) result: ``Σ r²`` over the valid rows and, with ``full``
    (else zeros), ``Σ W r²``, ``Σ W (b − b̄)²`` about the weighted mean ``b̄``, and
    ``Σ W b²``; with ``centred_only`` too, the second and fourth are zeros (not
    computed). ``A`` has at most :data:`MAX_ORDER` columns.
    """
    lib = _loaded()
    m, n = A.shape
    p = x.shape[1]
    Ac = A.contiguous()
    out = torch.empty((4, p), dtype=torch.float64)
    ptrs = [out[i].data_ptr() for i in range(4)]
    how = 0 if not full else 2 if centred_only else 1
    _run(
        lib.gs_moments,
        (n, m, p, Ac.data_ptr(), B0.data_ptr(), W.data_ptr(), x.data_ptr(), how, *ptrs),
        p,
    )
    return out


def fit(
    src: np.ndarray,
    Q: torch.Tensor,
    pairs: torch.Tensor,
    A: torch.Tensor,
    Rinv: torch.Tensor | None,
    tol: float,
    refine_tol: float,
    steps: int,
    want: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The per-pixel primal fit of every column of ``src`` (m, P) with its 0/1 mask as weights.

    :func:`linalg.fit_unit`'s kernel. ``src``: float32 or float64 rows, each contiguous
    (a column slice of the data); NaN and ±inf are invalid rows. ``Q`` (m, n) the design's
    basis, ``pairs`` its packed Gram rows (n(n+1)/2, m), ``A`` (m, n) the design,
    ``Rinv`` (n, n) the coefficients' change of basis (None: ``Q`` is ``A``). Returns the
    coefficients (n, P), which pixels factored and converged, the sum of squared
    residuals over valid rows and, with ``want``, the variances ``diag(ZᵀZ)`` (n, P) of
    ``Z = L⁻¹R⁻ᵀ`` and the sum of squares about the mean.
    """
    lib = _loaded()
    m, p = src.shape
    n = A.shape[1]
    if src.dtype not in (np.float32, np.float64) or src.ndim != 2 or p == 0:
        raise ValueError("fit: src must be a non-empty 2-D float32 or float64 array")
    if not rows_contiguous(src) or src.strides[0] % src.itemsize or src.strides[0] < 0:
        raise ValueError("fit: src's rows must each be contiguous")
    mats = [Q, pairs, A] + ([] if Rinv is None else [Rinv])
    shapes = [(m, n), (n * (n + 1) // 2, m), (m, n)] + ([] if Rinv is None else [(n, n)])
    if not 1 <= n <= MAX_ORDER or any(
        t.shape != s or not usable(t) for t, s in zip(mats, shapes, strict=True)
    ):
        raise ValueError("fit: Q, A (m, n ≤ 16), pairs and Rinv contiguous float64 on the CPU")
    T = None if Rinv is None else Rinv.T.contiguous()  # the kernels' spread takes R⁻ᵀ
    x = torch.empty((n, p), dtype=torch.float64)
    good = torch.empty(p, dtype=torch.bool)
    ss = torch.empty(p, dtype=torch.float64)
    var = torch.empty((n, p), dtype=torch.float64) if want else None
    tss = torch.empty(p, dtype=torch.float64) if want else None
    args = (
        n,
        m,
        p,
        src.ctypes.data,
        src.strides[0] // src.itemsize,
        int(src.dtype == np.float64),
        Q.data_ptr(),
        pairs.data_ptr(),
        A.data_ptr(),
        None if T is None else T.data_ptr(),
        tol,
        refine_tol,
        steps,
        int(want),
        x.data_ptr(),
        good.data_ptr(),
        ss.data_ptr(),
        None if var is None else var.data_ptr(),
        None if tss is None else tss.data_ptr(),
    )
    _run(lib.gs_fit, args, p)
    return x, good, ss, var, tss
