/* The functions of the per-pixel solve's kernel library (gs_kernels.c) that Python calls
   through ctypes (stages/solve/kernel.py, _bind): a test checks _bind's signatures
   against these declarations, and the library includes this file, so the compiler
   checks them against the definitions. What each does: gs_kernels.c. */
#ifndef GS_KERNELS_H
#define GS_KERNELS_H

#include <stdint.h>

int gs_cholesky(long n, long sq, long P, double *G, unsigned char *ok, double tol,
                const double *T, double *var, double *h, long p0, long p1);
void gs_solve(long n, long sq, long P, const double *G, double *h, long p0, long p1);
void gs_load_f32(long m, long P, const float *src, long stride, double *B0, double *W, long p0,
                 long p1);
void gs_load_f64(long m, long P, const double *src, long stride, double *B0, double *W,
                 long p0, long p1);
void gs_step(long n, long P, double *x, const double *dx, const unsigned char *ok,
             const unsigned char *conv_in, unsigned char *conv_out, double tol, long p0,
             long p1);
void gs_gap_solve(long k, long np, const double *L, const int64_t *rows, const double *u,
                  double *Z, long P, long a, long p0, long p1);
int gs_gap_factor(long k, long np, const double *H, long m, const int64_t *rows, double *L,
                  unsigned char *ok, double tol, long p0, long p1);
void gs_statistics(long coef, const double *C, long cs, const signed char *status,
                   const int *n_valid, const double *wrms, const double *trms, const double *var,
                   long vs, const double *edf, long ridge, long scaled, const signed char *okc,
                   signed char fell, double *se, long os, double *dof_out, double *r2,
                   signed char *flags, long p0, long p1);
int gs_spread(long n, long P, const double *G, const double *T, double *Z, double *var, long p0,
              long p1);
int gs_use_isa(int limit);
int gs_spread_var(long n, long P, const double *G, const double *T, double *var, long p0,
                  long p1);
int gs_moments(long n, long m, long P, const double *A, const double *B0, const double *W,
               const double *x, long full, double *ss, double *wss, double *tss, double *uss,
               long p0, long p1);
int gs_fit(long n, long m, long P, const void *src, long stride, long f64, const double *Q,
           const double *pairs, const double *A, const double *T, double tol, double rtol,
           long steps, long want, double *x, unsigned char *good, double *ss, double *var,
           double *tss, long p0, long p1);

#endif
