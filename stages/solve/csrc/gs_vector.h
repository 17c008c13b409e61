/* The vector kernels of gs_kernels.c, written once for a lane count VL and included
   once per instruction set with VL (lanes), SFX (the names' suffix) and TARGET (the
   GCC target) defined: S(name) is name_SFX. Not a translation unit of its own. */
/* Pixels VL at a time (one vector register: 8 lanes with AVX-512, 4 with AVX2, 2
   with SSE2), a pixel's coefficients in registers: GCC vector extensions, whose lanes
   are IEEE operations like scalar code (no fused multiply-adds). Rows go four at a
   time so that four residuals are in flight; each row's arithmetic is unchanged. */
typedef double S(vd) __attribute__((vector_size(8 * VL)));
typedef long S(vi) __attribute__((vector_size(8 * VL)));
#define TGT __attribute__((target(TARGET)))
#define AIT static inline __attribute__((always_inline)) TGT
#define vd S(vd)
#define vi S(vi)

AIT vd S(ld)(const double *p) { vd v; memcpy(&v, p, sizeof v); return v; }
AIT void S(st)(double *p, vd v) { memcpy(p, &v, sizeof v); }
AIT vd S(sel)(vi c, vd a, vd b) { return (vd)(((vi)a & c) | ((vi)b & ~c)); }

/* Rows are bs apart, each read VL pixels at a time: dozens of streams at once, more
   than the hardware prefetcher follows, so each row's next lines are fetched ahead. */
#define V_PF(p) __builtin_prefetch((p) + PF_AHEAD * VL)
#ifndef PF_AHEAD
#define PF_AHEAD 4
#endif

/* r = B0 - A x for R rows from t, into r[] */
#define V_RES(R)                                                                          \
    for (int u = 0; u < R; ++u) V_PF(B0 + (t + u) * bs), V_PF(W + (t + u) * bs);        \
    for (int u = 0; u < R; ++u) r[u] = S(ld)(B0 + (t + u) * bs);                           \
    for (long k = 0; k < n; ++k)                                                            \
        for (int u = 0; u < R; ++u) r[u] -= A[(t + u) * n + k] * xr[k];

/* With ALL 0 (full == 2), without W r^2 and W b^2 */
#define V_MOM(R, ALL)                                                                     \
    {                                                                                       \
        vd r[R];                                                                            \
        V_RES(R)                                                                          \
        for (int u = 0; u < R; ++u) {                                                       \
            vd b = S(ld)(B0 + (t + u) * bs), w = S(ld)(W + (t + u) * bs);                 \
            vi v = w > 0.0;                                                                 \
            vd rr = r[u] * r[u];                                                            \
            ss += S(sel)(v, rr, zero);                                                     \
            if (ALL) wss += S(sel)(v, w * rr, zero);                                       \
            sw += w;                                                                        \
            swb += S(sel)(v, w * b, zero);                                                 \
            if (ALL) uss += S(sel)(v, w * (b * b), zero);                                  \
        }                                                                                   \
    }

#define V_SS(R)                                                                           \
    {                                                                                       \
        vd r[R];                                                                            \
        V_RES(R)                                                                          \
        for (int u = 0; u < R; ++u) {                                                       \
            vd rr = r[u] * r[u];                                                            \
            ss += S(sel)(S(ld)(W + (t + u) * bs) > 0.0, rr, zero);                        \
        }                                                                                   \
    }

/* Sums over the rows of VL pixels with weights W (W > 0: valid), r = B0 - A x:
   out[0] of r^2 where valid and, with full, out[1] of W r^2, out[2] of W (b - mean)^2
   about the weighted mean, out[3] of W b^2; with full == 2, out[2] only of these
   (out[1] and out[3] are 0). */
AIT void S(moments)(const long n, long m, const double *A, const double *B0, const double *W,
                     long bs, const double *x, long xs, long full, vd out[4])
{
    vd xr[NMAX];
    const vd zero = {0};
    vd ss = zero, wss = zero, sw = zero, swb = zero, uss = zero, tss = zero;
    for (long k = 0; k < n; ++k) xr[k] = S(ld)(x + k * xs);
    long t = 0;
    if (!full) {
        for (; t + 4 <= m; t += 4) V_SS(4)
        for (; t < m; ++t) V_SS(1)
        out[0] = ss, out[1] = out[2] = out[3] = zero;
        return;
    }
    if (full == 2) {
        for (; t + 4 <= m; t += 4) V_MOM(4, 0)
        for (; t < m; ++t) V_MOM(1, 0)
    } else {
        for (; t + 4 <= m; t += 4) V_MOM(4, 1)
        for (; t < m; ++t) V_MOM(1, 1)
    }
    vd mean = swb / sw;
    for (t = 0; t < m; ++t) {
        vd w = S(ld)(W + t * bs), d = S(ld)(B0 + t * bs) - mean;
        tss += S(sel)(w > 0.0, w * (d * d), zero);
    }
    out[0] = ss, out[1] = wss, out[2] = tss, out[3] = uss;
}

/* diag(Z^T Z) of Z = L^-1 T for VL pixels (L packed, rows gs apart; T lower triangular,
   row-major, or NULL for the identity): forward substitution of T's columns. Column k
   of Z is zero above row k. All columns advance together, row j of each at step j:
   their updates are independent, where a column at a time is a chain of dependent
   operations (latency-bound); each entry gets the same operations in the same order. */
AIT void S(spread)(const long n, const double *G, long gs, const double *T, double *var,
                    long vs)
{
    vd inv[NMAX], acc[NMAX], z[NMAX][NMAX]; /* z[i][k], k <= i */
    const vd zero = {0}, one = zero + 1.0;
    for (long i = 0; i < n; ++i) {
        inv[i] = one / S(ld)(G + at(i, i, n) * gs);
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
            vd l = S(ld)(G + at(i, j, n) * gs);
            for (long k = 0; k <= j; ++k) z[i][k] -= l * z[j][k];
        }
    }
    for (long k = 0; k < n; ++k) S(st)(var + k * vs, acc[k]);
}

static TGT int S(spread_all)(long n, long P, const double *G, const double *T, double *var,
                              long p0, long p1)
{
    long np = n * (n + 1) / 2;
    double *pad = malloc(sizeof(double) * (size_t)(VL * (np + n)));
    if (!pad) return -1;
    for (long b0 = p0; b0 < p1; b0 += VL) {
        long w = p1 - b0 < VL ? p1 - b0 : VL;
        if (w == VL) {
#define V_SPREAD(K) S(spread)(K, G + b0, P, T, var + b0, P)
            DISPATCH(n, V_SPREAD)
        } else {
            double *pg = pad, *pv = pad + VL * np;
            pad_lanes(np, G + b0, P, w, VL, 1.0, pg);
#define V_SPREAD_TAIL(K) S(spread)(K, pg, VL, T, pv, VL)
            DISPATCH(n, V_SPREAD_TAIL)
            for (long k = 0; k < n; ++k)
                for (long l = 0; l < w; ++l) var[k * P + b0 + l] = pv[k * VL + l];
        }
    }
    free(pad);
    return 0;
}

static TGT int S(moments_all)(long n, long m, long P, const double *A, const double *B0,
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
#define V_MOMENTS(K) S(moments)(K, m, A, pb, pw, bs, px, xs, full, out)
        DISPATCH(n, V_MOMENTS)
        for (int q = 0; q < 4; ++q) S(st)(o[q], out[q]);
        for (long l = 0; l < w; ++l) {
            ss[b0 + l] = o[0][l], wss[b0 + l] = o[1][l];
            tss[b0 + l] = o[2][l], uss[b0 + l] = o[3][l];
        }
    }
    free(pad);
    return 0;
}

typedef float S(vf) __attribute__((vector_size(4 * VL)));

AIT vd S(vabs)(vd a)
{
    const vi mag = (vi){0} + 0x7fffffffffffffffL;
    return (vd)((vi)a & mag);
}

/* lane by lane: GCC makes it one vector square root */
AIT vd S(vsqrt)(vd a)
{
    double t[VL];
    S(st)(t, a);
    for (int l = 0; l < VL; ++l) t[l] = sqrt(t[l]);
    return S(ld)(t);
}

/* L L^T y = h in place (L packed): the arithmetic of solve_block, per lane */
AIT void S(fsolve)(const long n, const vd *L, vd *h)
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
   sums and the spread are S(moments) and S(spread) themselves); G, Q^T b and the
   refinement's residuals are summed in row order. */
AIT void S(fit)(const long n, long m, const double *restrict bv, const double *restrict wv,
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
            vd w = S(ld)(wv + t * VL);
            for (int c = 0; c < 8; ++c) acc[c] += pairs[(c0 + c) * m + t] * w;
        }
        for (int c = 0; c < 8; ++c) L[c0 + c] = acc[c];
    }
    if (c0 < np) {
        vd acc[8];
        const long cn = np - c0;
        for (int c = 0; c < 8; ++c) acc[c] = zero;
        for (long t = 0; t < m; ++t) {
            vd w = S(ld)(wv + t * VL);
            for (long c = 0; c < cn; ++c) acc[c] += pairs[(c0 + c) * m + t] * w;
        }
        for (long c = 0; c < cn; ++c) L[c0 + c] = acc[c];
    }
    for (long k = 0; k < n; ++k) h[k] = zero;
    for (long t = 0; t < m; ++t) {
        vd b = S(ld)(bv + t * VL);
        for (long k = 0; k < n; ++k) h[k] += Q[t * n + k] * b;
    }
    /* gs_cholesky */
    vi ok = (vi){0} - 1;
    for (long j = 0; j < n; ++j) dg[j] = L[at(j, j, n)];
    for (long j = 0; j < n; ++j) {
        vd d2 = L[at(j, j, n)];
        ok &= (d2 > tol * dg[j]) & (d2 > dmin);
        vd piv = one / S(vsqrt)(S(sel)((d2 != d2) | (d2 > dmin), d2, dmin));
        for (long r = j; r < n; ++r) L[at(r, j, n)] *= piv;
        for (long c = j + 1; c < n; ++c)
            for (long r = c; r < n; ++r) L[at(r, c, n)] -= L[at(r, j, n)] * L[at(c, j, n)];
    }
    S(fsolve)(n, L, h);
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
            vd r = S(ld)(bv + t * VL);
            for (long k = 0; k < n; ++k) r -= Q[t * n + k] * x[k];
            r *= S(ld)(wv + t * VL);
            for (long k = 0; k < n; ++k) h[k] += Q[t * n + k] * r;
        }
        S(fsolve)(n, L, h);
        vd xm = zero, dm = zero;
        for (long k = 0; k < n; ++k) {
            vd nx = S(sel)(act, x[k] + h[k], x[k]);
            x[k] = nx;
            vd a = S(vabs)(nx), d = S(vabs)(h[k]);
            xm = S(sel)((a > xm) | (a != a), a, xm);
            dm = S(sel)((d > dm) | (d != d), d, dm);
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
    for (long k = 0; k < n; ++k) S(st)(xo + k * xs, xf[k]);
    S(st)(go, S(sel)(ok & conv, one, zero));
    /* the residual sums on the final coefficients, and the spread: the separate
       kernels' own code, on this block's data and factor */
    vd out[4];
    S(moments)(n, m, A, bv, wv, VL, xo, xs, want ? 2 : 0, out);
    S(st)(sso, out[0]);
    if (!want) return;
    S(st)(tsso, out[2]);
    S(spread)(n, (const double *)L, VL, T, varo, xs);
}

/* S(fit) over pixels [p0, p1) of the data src (m rows, `stride` elements apart,
   float64 with f64 else float32): each VL pixels' rows converted (NaN and +-inf: 0,
   weight 0) into scratch, then fitted. Returns -1 when out of memory. */
static TGT int S(fit_all)(long n, long m, long P, const void *src, long stride, long f64,
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
                V_PF(s64 + t * stride + b0);
                v = S(ld)(s64 + t * stride + b0);
            } else if (w == VL) {
                S(vf) f;
                V_PF(s32 + t * stride + b0);
                memcpy(&f, s32 + t * stride + b0, sizeof f);
                v = __builtin_convertvector(f, vd);
            } else {
                double lane[VL];
                for (long l = 0; l < VL; ++l)
                    lane[l] = l >= w ? NAN : f64 ? s64[t * stride + b0 + l]
                                                 : (double)s32[t * stride + b0 + l];
                v = S(ld)(lane);
            }
            vi fin = (v - v) == zero; /* NaN and inf give NaN */
            S(st)(bv + t * VL, S(sel)(fin, v, zero));
            S(st)(wv + t * VL, S(sel)(fin, one, zero));
        }
        double g[VL];
        if (w == VL) {
            S(fit)(n, m, bv, wv, Q, pairs, A, T, tol, rtol, steps, want, x + b0, P, g, ss + b0,
                    want ? var + b0 : NULL, want ? tss + b0 : NULL);
        } else {
            S(fit)(n, m, bv, wv, Q, pairs, A, T, tol, rtol, steps, want, qx, VL, g, qs, qv, qt);
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
#undef V_MOM
#undef V_MOMENTS
#undef V_PF
#undef V_RES
#undef V_SPREAD
#undef V_SPREAD_TAIL
#undef V_SS
