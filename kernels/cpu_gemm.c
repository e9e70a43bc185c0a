/* y = x @ w.T on the CPU, float32, for any number of rows: the projections and LM head of a float32
 * model, over weights packed once at load time (kernels/cpu_gemm.py packs; F.linear is the reference).
 *
 * The weights are stored in panels of PANEL output columns, each panel as (k, PANEL): one k step of
 * a panel is one contiguous 64-byte line. A tile of up to TILE_ROWS rows of x and one panel keeps
 * its 6 x 16 outputs in twelve AVX2 registers and, for each k, loads the panel's line once and
 * multiplies-adds it with each row's x[k] (broadcast). One to three rows take two panels at a time
 * (more independent sums in flight). On the 2-core EPYC VMs this reaches 150-175 GFLOP/s from 16
 * rows on, against 90-150 for MKL's sgemm, and what the memory gives at one row (docs/BENCHMARKS.md).
 *
 * Every output y[i][j] is one chain of fused multiply-adds over k = 0, 1, ..., k_len - 1 from zero,
 * whatever the number of rows, the tile a row lands in and the threads: a row's result is
 * bit-identical alone, in a batch, or in a prefill of any length (batch invariance by construction).
 * Threads (OpenMP: torch's runtime, so torch.set_num_threads applies) split the panels.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define TILE_ROWS 6
#define CHUNK_BYTES (512L * 1024) /* rows of x taken per pass over the weights: ~half an L2 */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTORIZED 1
typedef __m256 v8;

/* A panel's line k as two 8-float halves: float32 panels, or int8 ones (`I8` a constant where
 * inlined) widened to floats exactly. */
static inline __attribute__((always_inline)) void line(const void *panel, long k, v8 *lo, v8 *hi, const int I8) {
    if (I8) {
        __m128i raw = _mm_loadu_si128((const __m128i *)((const int8_t *)panel + k * PANEL));
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
    } else {
        *lo = _mm256_loadu_ps((const float *)panel + k * PANEL);
        *hi = _mm256_loadu_ps((const float *)panel + k * PANEL + 8);
    }
}

/* Named accumulators: GCC keeps arrays of vectors in memory, which halves the speed. */
#define DECLARE(i) v8 c##i##a = _mm256_setzero_ps(), c##i##b = c##i##a, c##i##c = c##i##a, c##i##d = c##i##a;
#define STEP(i)                                                                                              \
    if (R > i) {                                                                                             \
        v8 a = _mm256_broadcast_ss(x + i * k_len + k);                                                       \
        c##i##a = _mm256_fmadd_ps(a, b0, c##i##a);                                                           \
        c##i##b = _mm256_fmadd_ps(a, b1, c##i##b);                                                           \
        if (P == 2) {                                                                                        \
            c##i##c = _mm256_fmadd_ps(a, b2, c##i##c);                                                       \
            c##i##d = _mm256_fmadd_ps(a, b3, c##i##d);                                                       \
        }                                                                                                    \
    }
#define STORE(i)                                                                                             \
    if (R > i) {                                                                                             \
        float *o = out + i * ldo;                                                                            \
        _mm256_storeu_ps(o, I8 ? _mm256_mul_ps(c##i##a, s0) : c##i##a);                                      \
        _mm256_storeu_ps(o + 8, I8 ? _mm256_mul_ps(c##i##b, s1) : c##i##b);                                  \
        if (P == 2) {                                                                                        \
            _mm256_storeu_ps(o + PANEL, I8 ? _mm256_mul_ps(c##i##c, s2) : c##i##c);                          \
            _mm256_storeu_ps(o + PANEL + 8, I8 ? _mm256_mul_ps(c##i##d, s3) : c##i##d);                      \
        }                                                                                                    \
    }

/* out[i][j] for R rows of x (R <= TILE_ROWS) and P consecutive panels (P = 1, or 2 with R <= 3);
 * R, P and I8 are constants where inlined. int8 panels: each sum times its column's scale. */
static inline __attribute__((always_inline)) void tile(const float *x, long k_len, const void *panel,
                                                       const float *scales, float *out, long ldo, const int R,
                                                       const int P, const int I8) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5)
    const void *next = (const char *)panel + k_len * PANEL * (I8 ? 1 : (long)sizeof(float));
    for (long k = 0; k < k_len; k++) {
        v8 b0, b1, b2 = _mm256_setzero_ps(), b3 = b2;
        line(panel, k, &b0, &b1, I8);
        if (P == 2) line(next, k, &b2, &b3, I8);
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
    }
    v8 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    if (I8) {
        s0 = _mm256_loadu_ps(scales);
        s1 = _mm256_loadu_ps(scales + 8);
        if (P == 2) {
            s2 = _mm256_loadu_ps(scales + PANEL);
            s3 = _mm256_loadu_ps(scales + PANEL + 8);
        }
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

#else
#define VECTORIZED 0

/* The same sums one output at a time (compiled where AVX2 and FMA are missing; the engine does
 * not pack weights there, see gemm_vectorized). */
static void tile(const float *x, long k_len, const void *panel, const float *scales, float *out, long ldo,
                 const int R, const int P, const int I8) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < P * PANEL; j++) {
            long first = (j / PANEL) * k_len * PANEL + j % PANEL;
            float sum = 0.0f;
            for (long k = 0; k < k_len; k++) {
                long at = first + k * PANEL;
                float w = I8 ? (float)((const int8_t *)panel)[at] : ((const float *)panel)[at];
                sum = fmaf(x[i * k_len + k], w, sum);
            }
            out[i * ldo + j] = I8 ? sum * scales[j] : sum;
        }
}
#endif

/* R rows (1 to TILE_ROWS) by one panel, or by two when `pair` (R <= 3): the constant-shape tiles. */
static inline __attribute__((always_inline)) void rows_by_panels(const float *x, long rows, long k_len,
                                                                 const void *panel, const float *scales,
                                                                 float *out, long ldo, int pair, const int I8) {
    if (pair) {
        switch (rows) {
        case 1: tile(x, k_len, panel, scales, out, ldo, 1, 2, I8); return;
        case 2: tile(x, k_len, panel, scales, out, ldo, 2, 2, I8); return;
        default: tile(x, k_len, panel, scales, out, ldo, 3, 2, I8); return;
        }
    }
    switch (rows) {
    case 1: tile(x, k_len, panel, scales, out, ldo, 1, 1, I8); return;
    case 2: tile(x, k_len, panel, scales, out, ldo, 2, 1, I8); return;
    case 3: tile(x, k_len, panel, scales, out, ldo, 3, 1, I8); return;
    case 4: tile(x, k_len, panel, scales, out, ldo, 4, 1, I8); return;
    case 5: tile(x, k_len, panel, scales, out, ldo, 5, 1, I8); return;
    default: tile(x, k_len, panel, scales, out, ldo, 6, 1, I8); return;
    }
}

/* Rows [r0, r1) of y for panel p (and p + 1 when `pair`); a panel past n_out's end goes through a
 * buffer so that only y's own columns are written. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, long r0, long r1, long k_len,
                                                             const void *packed, const float *scales, long p,
                                                             long n_out, float *y, int pair, const int I8) {
    const void *panel = (const char *)packed + p * k_len * PANEL * (I8 ? 1 : (long)sizeof(float));
    const float *panel_scales = I8 ? scales + p * PANEL : NULL;
    long col = p * PANEL, width = (pair ? 2 : 1) * PANEL;
    for (long i = r0; i < r1; i += TILE_ROWS) {
        long rows = r1 - i < TILE_ROWS ? r1 - i : TILE_ROWS; /* <= 3 when `pair` (gemm) */
        if (col + width <= n_out) {
            rows_by_panels(x + i * k_len, rows, k_len, panel, panel_scales, y + i * n_out + col, n_out, pair, I8);
        } else {
            float buffer[TILE_ROWS * 2 * PANEL];
            rows_by_panels(x + i * k_len, rows, k_len, panel, panel_scales, buffer, width, pair, I8);
            for (long r = 0; r < rows; r++)
                memcpy(y + (i + r) * n_out + col, buffer + r * width, (size_t)(n_out - col) * sizeof(float));
        }
    }
}

/* y (rows, n_out) = x (rows, k_len) @ w.T over the packed w (float32 panels, or int8 ones with
 * `scales` per column when I8). */
static inline __attribute__((always_inline)) void gemm(const float *x, long rows, long k_len, const void *packed,
                                                       const float *scales, long n_out, float *y, const int I8) {
    long panels = (n_out + PANEL - 1) / PANEL;
    if (rows <= 3) { /* a decode step's few rows: two panels per tile, one pass over the weights */
        long pairs = (panels + 1) / 2;
#pragma omp parallel for schedule(static)
        for (long q = 0; q < pairs; q++) {
            long p = 2 * q;
            panel_rows(x, 0, rows, k_len, packed, scales, p, n_out, y, p + 1 < panels, I8);
        }
        return;
    }
    long chunk = CHUNK_BYTES / (k_len * (long)sizeof(float)) / TILE_ROWS * TILE_ROWS;
    if (chunk < TILE_ROWS) chunk = TILE_ROWS;
    for (long r0 = 0; r0 < rows; r0 += chunk) { /* x's chunk stays in cache while the panels stream by */
        long r1 = r0 + chunk < rows ? r0 + chunk : rows;
#pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++) panel_rows(x, r0, r1, k_len, packed, scales, p, n_out, y, 0, I8);
    }
}

/* y (rows, n_out) = x (rows, k_len) @ w.T, where `packed` holds w (n_out, k_len) as
 * ceil(n_out / PANEL) panels of (k_len, PANEL), zero past n_out. x and y contiguous, row-major. */
void gemm_f32(const float *x, long rows, long k_len, const float *packed, long n_out, float *y) {
    gemm(x, rows, k_len, packed, NULL, n_out, y, 0);
}

/* The same for per-channel int8 weights: packed int8 panels, w[j] = codes[j] * scales[j] (scales
 * padded to the panels' width). Each output is its float32 sum of x * code, times its scale. */
void gemm_i8(const float *x, long rows, long k_len, const int8_t *packed, const float *scales, long n_out,
             float *y) {
    gemm(x, rows, k_len, packed, scales, n_out, y, 1);
}

/* The OpenMP threads a parallel region here gets (tests check it follows torch.set_num_threads). */
int gemm_max_threads(void) {
    int n = 0;
#pragma omp parallel
    {
#pragma omp single
        n = omp_get_num_threads();
    }
    return n;
}

/* Output columns per panel: the packing the launcher must write. */
int gemm_panel_width(void) { return PANEL; }

/* 1 where the tiles are vectorized (AVX2 and FMA); 0: the scalar sums, correct but slow. */
int gemm_vectorized(void) { return VECTORIZED; }
