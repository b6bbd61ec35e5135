/* y[m, n] = x[m, k] @ W[n, k]^T (+ b) for a few rows m, W stored as float16 in panels of 64
 * output columns, [n / 64][k][64]: a panel is read once, front to back, for up to 8 rows at a
 * time, each float16 weight widened to float32 in registers; products and sums in float32 (FMA),
 * so it is the float32 linear of a weight float16 holds, in another summation order.
 *
 * Why: at batch 1 a CPU step's linears are bound by reading their weights, and torch's kernels
 * (MKL float32, FBGEMM float16) cost 1.5-2.2x as much at 6 rows as at 1. Here a step of 6 rows
 * does 24 FMAs per 128 bytes of weight read, and prefetching PREFETCH rows of the panel ahead
 * keeps the reads streaming, so 6 rows cost about what 1 does (pipeline/model/native.py).
 *
 * Compiled on the running machine by pipeline/model/native.py (-O3 -march=native); AVX-512F only:
 * elsewhere it does not compile and the engine keeps torch's kernels. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#ifndef __AVX512F__
#error "half_gemm needs AVX-512F"
#endif

#define PANEL 64          /* output columns per panel: 4 vectors of 16 floats */
#define ROWS 8            /* rows per pass: 8 x 4 accumulators fill the 32 vector registers; measured
                             no slower than 6-row passes at 1-6 rows, 1.1-1.65x faster at 7-8 */
#define PREFETCH 16       /* panel rows (128 bytes each) read ahead */

static inline void panel(int m, int k, const float *x, const uint16_t *p, const float *b,
                         float *y, int n, int col0) {
    __m512 acc[ROWS][4];
    for (int j = 0; j < 4; j++) {
        __m512 bj = b ? _mm512_loadu_ps(b + j * 16) : _mm512_setzero_ps();
        for (int r = 0; r < ROWS; r++) acc[r][j] = bj;
    }
    for (int i = 0; i < k; i++) {
        const uint16_t *q = p + (size_t)i * PANEL;
        _mm_prefetch((const char *)(q + PREFETCH * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + PREFETCH * PANEL + 32), _MM_HINT_T0);
        __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)q));
        __m512 w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(q + 16)));
        __m512 w2 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(q + 32)));
        __m512 w3 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(q + 48)));
        for (int r = 0; r < ROWS; r++) {
            if (r < m) {                 /* m is a constant where this is inlined: no branch */
                __m512 xv = _mm512_set1_ps(x[(size_t)r * k + i]);
                acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
            }
        }
    }
    for (int r = 0; r < m; r++)
        for (int j = 0; j < 4; j++) {
            int c = col0 + j * 16;
            float *out = y + (size_t)r * n + c;
            if (c + 16 <= n) _mm512_storeu_ps(out, acc[r][j]);
            else if (c < n) _mm512_mask_storeu_ps(out, (__mmask16)((1u << (n - c)) - 1), acc[r][j]);
        }
}

#define PASS(M) \
    static void pass##M(int k, int n, const float *x, const uint16_t *w, const float *b, float *y) { \
        for (int c = 0; c < n; c += PANEL) \
            panel(M, k, x, w + (size_t)c * k, b ? b + c : NULL, y, n, c); \
    }
PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)

/* x: [m, k] float32; w: [ceil(n / 64)][k][64] float16 bits, zero past n; b: NULL or
 * ceil(n / 64) * 64 floats; y: [m, n] float32. */
void half_gemm(int m, int k, int n, const float *x, const uint16_t *w, const float *b, float *y) {
    static void (*const passes[ROWS + 1])(int, int, const float *, const uint16_t *, const float *, float *) =
        {NULL, pass1, pass2, pass3, pass4, pass5, pass6, pass7, pass8};
    for (int r = 0; r < m; r += ROWS) {
        int rows = m - r < ROWS ? m - r : ROWS;
        passes[rows](k, n, x + (size_t)r * k, w, b, y + (size_t)r * n);
    }
}

/* RMSNorm of a few rows, y = w * (x * 1 / sqrt(mean(x^2) + eps)) per row of dim floats: one C call
 * where torch's float32 rms_norm is ~10 small ops (~20 us a call at batch 1, 25 calls a demo
 * forward). The sum of squares in another order than torch's; the scaling as transformers'. */
void rms_norm(int rows, int dim, const float *x, const float *w, float eps, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        __m512 acc = _mm512_setzero_ps();
        int i = 0;
        for (; i + 16 <= dim; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float ss = _mm512_reduce_add_ps(acc);
        for (; i < dim; i++) ss += xr[i] * xr[i];
        __m512 inv = _mm512_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(ss / (float)dim + eps))));
        for (i = 0; i < dim; i += 16) {
            __mmask16 m = dim - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dim - i)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(m, xr + i);
            _mm512_mask_storeu_ps(yr + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_mul_ps(v, inv)));
        }
    }
}
