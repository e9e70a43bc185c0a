/* y = x @ w.T for a few rows of x, float32, on the CPU: a decode step's projections and LM head.
 *
 * Built and loaded by kernels/cpu_gemv.py (the launcher; F.linear is the reference). At one row a
 * projection is a matrix-vector product bound by memory bandwidth: the weights are read once per
 * step. MKL's sgemv/sgemm reads them at 8-17 GB/s on the 2-core VMs we measure on; this loop, one
 * weight row streamed at a time with two accumulators, reaches what the memory gives (~30 GB/s,
 * docs/BENCHMARKS.md). Past 2-3 rows MKL's blocked kernels win, and the launcher hands it over.
 *
 * Every output element is one dot product computed the same way whatever the number of rows and
 * threads: 16-wide lanes, two accumulators (k mod 32 < 16 and >= 16), a 16-wide step, a scalar tail,
 * then a fixed fold of the lanes. A row's result is therefore bit-identical alone or in a batch.
 * Threads (OpenMP: torch's own runtime, so torch.set_num_threads applies) split the weight rows.
 */
#include <omp.h>

#include "cpu_vec.h"

/* 16 int8 values as floats (GCC's generic vector conversion of int8 is scalar code: intrinsics). */
static inline v16 load16_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
    v16 v;
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
#else
    v16 v;
    for (int i = 0; i < 16; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* Weight row w's elements k..k+15 as floats: float32 weights, or int8 ones (`int8` a constant
 * where inlined). */
static inline __attribute__((always_inline)) v16 weights16(const void *w, long k, const int int8) {
    return int8 ? load16_i8((const int8_t *)w + k) : load16((const float *)w + k);
}

static inline __attribute__((always_inline)) float weight1(const void *w, long k, const int int8) {
    return int8 ? (float)((const int8_t *)w)[k] : ((const float *)w)[k];
}

/* out[i * stride] = scale * dot(xr[i], wn) for R rows of x (R a constant where inlined: 1 to 4). */
static inline __attribute__((always_inline)) void dots(const float *const xr[4], const void *wn, long k_len,
                                                       float scale, float *out, long stride, const int R,
                                                       const int int8) {
    v16 a0[4], a1[4];
    for (int i = 0; i < R; i++) {
        a0[i] = (v16){0};
        a1[i] = (v16){0};
    }
    long k = 0;
    for (; k + 32 <= k_len; k += 32) {
        v16 w0 = weights16(wn, k, int8), w1 = weights16(wn, k + 16, int8);
        for (int i = 0; i < R; i++) {
            a0[i] += load16(xr[i] + k) * w0;
            a1[i] += load16(xr[i] + k + 16) * w1;
        }
    }
    if (k + 16 <= k_len) {
        v16 w0 = weights16(wn, k, int8);
        for (int i = 0; i < R; i++) a0[i] += load16(xr[i] + k) * w0;
        k += 16;
    }
    for (int i = 0; i < R; i++) {
        float tail = 0.0f;
        for (long t = k; t < k_len; t++) tail += xr[i][t] * weight1(wn, t, int8);
        out[i * stride] = (fold16(a0[i] + a1[i]) + tail) * scale; /* scale 1 for float32: exact */
    }
}

/* y (rows, n_out) = x (rows, k_len) @ (w (n_out, k_len) * scales (n_out,) or 1).T, row-major. */
static inline __attribute__((always_inline)) void gemv(const float *x, long rows, long k_len, const void *w,
                                                       const float *scales, long n_out, float *y,
                                                       const int int8) {
    long row_bytes = k_len * (int8 ? (long)sizeof(int8_t) : (long)sizeof(float));
#pragma omp parallel for schedule(static)
    for (long n = 0; n < n_out; n++) {
        const void *wn = (const char *)w + n * row_bytes;
        float scale = scales == NULL ? 1.0f : scales[n];
        for (long r0 = 0; r0 < rows; r0 += 4) {
            const float *xr[4];
            for (int i = 0; i < 4; i++) xr[i] = x + (r0 + i < rows ? r0 + i : rows - 1) * k_len;
            float *out = y + r0 * n_out + n;
            switch (rows - r0 < 4 ? rows - r0 : 4) {
            case 1: dots(xr, wn, k_len, scale, out, n_out, 1, int8); break;
            case 2: dots(xr, wn, k_len, scale, out, n_out, 2, int8); break;
            case 3: dots(xr, wn, k_len, scale, out, n_out, 3, int8); break;
            default: dots(xr, wn, k_len, scale, out, n_out, 4, int8);
            }
        }
    }
}

/* y (rows, n_out) = x (rows, k_len) @ w (n_out, k_len).T; all three contiguous, row-major. */
void gemv_f32(const float *x, long rows, long k_len, const float *w, long n_out, float *y) {
    gemv(x, rows, k_len, w, NULL, n_out, y, 0);
}

/* y (rows, n_out) = x (rows, k_len) @ (w (n_out, k_len) int8 * scales (n_out,)).T, per-channel int8. */
void gemv_i8(const float *x, long rows, long k_len, const int8_t *w, const float *scales, long n_out, float *y) {
    gemv(x, rows, k_len, w, scales, n_out, y, 1);
}

/* The OpenMP threads a parallel region here gets (tests check it follows torch.set_num_threads). */
int gemv_max_threads(void) {
    int n = 0;
#pragma omp parallel
    {
#pragma omp single
        n = omp_get_num_threads();
    }
    return n;
}
