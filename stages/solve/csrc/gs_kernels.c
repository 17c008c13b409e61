/* The per-pixel solve's compiled kernels (see stages/solve/kernel.py for what each does
   and why): one translation unit, built into a shared library on first use with the
   flags kernel.FLAGS names, and in CI with -Wall -Wextra -Werror besides. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gs_kernels.h"

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

/* The gap-wise dual's factors (dual._gap_groups) for pixels [p0, p1) of a group of np
   pixels with k gaps each: L[i][j][p] = H[rows[i][p]][rows[j][p]] (H: m x m, row-major;
   L square (k, k, np), all of it, as torch's H[rows[:, None], rows[None]] gathers it),
   then gs_cholesky of each block of pixels while it is in cache. Returns -1 when out of
   memory. */
GS_API int gs_gap_factor(long k, long np, const double *H, long m, const int64_t *rows,
                         double *L, unsigned char *ok, double tol, long p0, long p1)
{
    for (long b0 = p0; b0 < p1; b0 += BW) {
        long w = p1 - b0 < BW ? p1 - b0 : BW;
        for (long i = 0; i < k; ++i) {
            const int64_t *restrict ri = rows + i * np + b0;
            for (long j = 0; j < k; ++j) {
                const int64_t *restrict rj = rows + j * np + b0;
                double *restrict dst = L + (i * k + j) * np + b0;
                for (long p = 0; p < w; ++p) dst[p] = H[ri[p] * m + rj[p]];
            }
        }
        if (gs_cholesky(k, 1, np, L, ok, tol, NULL, NULL, NULL, b0, b0 + w)) return -1;
    }
    return 0;
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

/* ---- the vector kernels, per instruction set (gs_vector.h) ---- */
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

#define GS_CAT2(a, b) a##_##b
#define GS_CAT(a, b) GS_CAT2(a, b)
#define S(name) GS_CAT(name, SFX)

#define SFX avx512
#define VL 8
#define TARGET "avx512f"
#include "gs_vector.h"
#undef SFX
#undef VL
#undef TARGET

#define SFX avx2
#define VL 4
#define TARGET "avx2"
#include "gs_vector.h"
#undef SFX
#undef VL
#undef TARGET

#define SFX sse2
#define VL 2
#define TARGET "sse2"
#include "gs_vector.h"
#undef SFX
#undef VL
#undef TARGET

/* ---- entry points ---- *//* The widest vector version this CPU runs (3 AVX-512, 2 AVX2, 1 SSE2), or a narrower
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
