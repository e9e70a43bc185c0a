/* y = x @ w.T on the CPU for any number of rows: the projections and LM head of a float32 model
 * (float32 weights) or of an int8 one (per-channel int8 weights), over weights packed once at load
 * time (kernels/cpu_gemm.py packs; F.linear and reference_int8_gemm there are the references).
 *
 * The weights are stored in panels of PANEL output columns. A float32 panel is (k, PANEL): one k step
 * is one contiguous 64-byte line. A tile of up to TILE_ROWS rows of x and one panel keeps its 6 x 16
 * outputs in twelve AVX2 registers and, for each k, loads the panel's line once and multiplies-adds
 * it with each row's x[k] (broadcast). One to three rows take two panels at a time (more independent
 * sums in flight).
 *
 * int8 panels are (ceil(k / 2), PANEL, 2): one line holds two consecutive k of the 16 columns. Each
 * row of x is first rounded to int16 codes with its own scale (max |x_row| / 32767: a relative step
 * of 3e-5 of the row's largest value, finer than the bfloat16 activations of torch's int8 kernel),
 * and a line is multiplied with a row's pair of codes by VNNI's dpwssd (or AVX2's madd): two exact
 * integer products per 32-bit lane and instruction, twice the float FMA's work, with no int8 ->
 * float conversion in the loop. The int32 sums of CHUNK_PAIRS pairs (at most 256 x 2 x 128 x 32767
 * < 2^31) are added to float32 sums before they could overflow; each output is then that sum times
 * its row's scale times its column's scale.
 *
 * Every output y[i][j] is computed in one fixed order from its own row of x, whatever the number of
 * rows, the tile a row lands in and the threads: float32, one chain of fused multiply-adds over
 * k = 0, 1, ..., k - 1 from zero; int8, exact integer sums per chunk, added in chunk order. So a row's
 * result is bit-identical alone, in a batch, or in a prefill of any length (batch invariance by
 * construction). Threads (OpenMP: torch's runtime, so torch.set_num_threads applies) split the panels.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define TILE_ROWS 6
/* rows of a tile: TILE_ROWS, but 4 for AVX2's int4 tiles, whose 6-row form needs more than AVX2's 16
 * registers (12 int32 sums, 2 lines of nibbles, their 2 halves, the mask and a broadcast code) */
#define ROWS_PER_TILE(MODE) (IS_Q4(MODE) && !WIDE ? 4 : TILE_ROWS)
#define CHUNK_BYTES (512L * 1024) /* rows of x taken per pass over the weights: ~half an L2 */
#define QMAX 32767.0f             /* int16 activation codes: -32767..32767 */
#define CHUNK_PAIRS 256L          /* int32 sums of at most 256 pairs of products, then float32 */
#define W8A8_MAX_K 65536L         /* w8a8: 255 x 127 x 65,536 < 2^31, one int32 sum per output */
#define Q4_MAX_GROUP 4096L        /* int4: 4,096 x 15 x 32767 < 2^31, one int32 sum per group */
/* float32 x, w; int16 x, int8 w; int8 x, w (w8a8, VNNI); int16 x, int4 w with float32 / float16 scales and
 * offsets; W16: w8a8 without VNNI, its int8 codes of x held as int16 (I16's tiles, one int32 sum over all k) */
enum { F32 = 0, I16 = 1, W8 = 2, Q4 = 3, Q4H = 4, W16 = 5 };
#define IS_PAIRS(MODE) ((MODE) == I16 || (MODE) == W16)
#define IS_Q4(MODE) ((MODE) == Q4 || (MODE) == Q4H)
/* a group's 16 scales and 16 offsets: float32, or float16 (GGUF Q4_1's own) */
#define Q4_SCALE_BYTES(MODE) (2L * PANEL * ((MODE) == Q4H ? 2 : 4))

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTORIZED 1
typedef __m256 v8;
typedef __m256i v8i;

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
        _mm256_storeu_ps(o, c##i##a);                                                                        \
        _mm256_storeu_ps(o + 8, c##i##b);                                                                    \
        if (P == 2) {                                                                                        \
            _mm256_storeu_ps(o + PANEL, c##i##c);                                                            \
            _mm256_storeu_ps(o + PANEL + 8, c##i##d);                                                        \
        }                                                                                                    \
    }

/* out[i][j] for R rows of x (R <= TILE_ROWS) and P consecutive float32 panels (P = 1, or 2 with
 * R <= 3); R and P are constants where inlined. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, long k_len, const float *panel,
                                                           float *out, long ldo, const int R, const int P) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5)
    const float *next = panel + k_len * PANEL;
    for (long k = 0; k < k_len; k++) {
        v8 b0 = _mm256_loadu_ps(panel + k * PANEL), b1 = _mm256_loadu_ps(panel + k * PANEL + 8);
        v8 b2 = _mm256_setzero_ps(), b3 = b2;
        if (P == 2) {
            b2 = _mm256_loadu_ps(next + k * PANEL);
            b3 = _mm256_loadu_ps(next + k * PANEL + 8);
        }
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

/* acc's eight int32 lanes += a.w pairwise (int16 pairs) in a tile of R rows: VNNI's dpwssd where the
 * CPU has it. No product pair overflows (|w| <= 128, |a| <= 32767), so dpwssd and madd + add agree
 * bit for bit. Without VNNI, from 4 rows on, madd and add are one asm block: GCC otherwise computes
 * a step's madds first, into as many more registers, which with the sums, codes and lines is more
 * than AVX2's 16; it spilled sums, a store and a reload a step on the loop's critical path (the
 * int8 product at 32 rows ran at half its speed). At 1-3 rows the registers suffice, and GCC's own
 * schedule is faster (measured: the asm block cost 10-20% at one row). */
static inline __attribute__((always_inline)) v8i dot_pairs(v8i acc, v8i a, v8i w, const int R) {
#if defined(__AVXVNNI__)
    (void)R;
    return _mm256_dpwssd_avx_epi32(acc, a, w);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)R;
    return _mm256_dpwssd_epi32(acc, a, w);
#else
    if (R < 4) return _mm256_add_epi32(acc, _mm256_madd_epi16(a, w));
    v8i product;
    __asm__("vpmaddwd %[w], %[a], %[p]\n\tvpaddd %[p], %[acc], %[acc]"
            : [acc] "+x"(acc), [p] "=&x"(product)
            : [a] "x"(a), [w] "x"(w));
    return acc;
#endif
}

/* Line t of an int8 panel (16 columns x 2 k) widened to int16: columns 0-7 and 8-15. */
static inline __attribute__((always_inline)) void line_i8(const int8_t *panel, long t, v8i *lo, v8i *hi) {
    const int8_t *at = panel + t * 2 * PANEL;
    *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)at));
    *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + PANEL)));
}

#define IDECLARE(i)                                                                                          \
    v8i n##i##a = _mm256_setzero_si256(), n##i##b = n##i##a;                                                 \
    v8 f##i##a = _mm256_setzero_ps(), f##i##b = f##i##a;
#define ISTEP(i)                                                                                             \
    if (R > i) {                                                                                             \
        int32_t pair;                                                                                        \
        memcpy(&pair, xq + i * ldx + 2 * t, sizeof pair);                                                    \
        v8i a = _mm256_set1_epi32(pair);                                                                     \
        n##i##a = dot_pairs(n##i##a, a, b0, R);                                                              \
        n##i##b = dot_pairs(n##i##b, a, b1, R);                                                              \
    }
#define FOLD(i)                                                                                              \
    if (R > i) {                                                                                             \
        f##i##a = _mm256_add_ps(f##i##a, _mm256_cvtepi32_ps(n##i##a));                                       \
        f##i##b = _mm256_add_ps(f##i##b, _mm256_cvtepi32_ps(n##i##b));                                       \
        n##i##a = n##i##b = _mm256_setzero_si256();                                                          \
    }
#define ISTORE(i)                                                                                            \
    if (R > i) {                                                                                             \
        v8 r = _mm256_set1_ps(row_scales[i]);                                                                \
        _mm256_storeu_ps(out + i * ldo, _mm256_mul_ps(_mm256_mul_ps(f##i##a, r), s0));                       \
        _mm256_storeu_ps(out + i * ldo + 8, _mm256_mul_ps(_mm256_mul_ps(f##i##b, r), s1));                   \
    }

/* out[i][j] for R rows of int16 codes (row stride ldx, `pairs` pairs each) and one int8 panel (one
 * panel a tile at every row count: measured faster than two at 1-3 rows, unlike float32), the int32
 * sums of `chunk` pairs at a time added to float32 (I16: CHUNK_PAIRS; W16: all of them, one exact sum). */
static inline __attribute__((always_inline)) void tile_i8(const int16_t *xq, long ldx, const float *row_scales,
                                                          long pairs, long chunk, const int8_t *panel,
                                                          const float *scales, float *out, long ldo, const int R) {
    IDECLARE(0) IDECLARE(1) IDECLARE(2) IDECLARE(3) IDECLARE(4) IDECLARE(5)
    for (long t0 = 0; t0 < pairs; t0 += chunk) {
        long t1 = t0 + chunk < pairs ? t0 + chunk : pairs;
        for (long t = t0; t < t1; t++) {
            v8i b0, b1;
            line_i8(panel, t, &b0, &b1);
            ISTEP(0) ISTEP(1) ISTEP(2) ISTEP(3) ISTEP(4) ISTEP(5)
        }
        FOLD(0) FOLD(1) FOLD(2) FOLD(3) FOLD(4) FOLD(5)
    }
    v8 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
    ISTORE(0) ISTORE(1) ISTORE(2) ISTORE(3) ISTORE(4) ISTORE(5)
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* AVX-512: a panel's 16 columns are one register. The same sums as the AVX2 tiles above (each output
 * one chain of fused multiply-adds over k in order; int8: exact int32 sums per chunk, added in chunk
 * order), so the same bits, with half the instructions: a 6-row tile takes two panels at every row
 * count (12 sums in flight for 8 loads a step). */
#define WIDE 1
typedef __m512 v16;
typedef __m512i v16i;

#define ZDECLARE(i) v16 z##i##a = _mm512_setzero_ps(), z##i##b = z##i##a;
#define ZSTEP(i)                                                                                             \
    if (R > i) {                                                                                             \
        v16 a = _mm512_set1_ps(x[i * k_len + k]);                                                            \
        z##i##a = _mm512_fmadd_ps(a, b0, z##i##a);                                                           \
        if (P == 2) z##i##b = _mm512_fmadd_ps(a, b1, z##i##b);                                               \
    }
#define ZSTORE(i)                                                                                            \
    if (R > i) {                                                                                             \
        _mm512_storeu_ps(out + i * ldo, z##i##a);                                                            \
        if (P == 2) _mm512_storeu_ps(out + i * ldo + PANEL, z##i##b);                                        \
    }

static inline __attribute__((always_inline)) void tile_f32_wide(const float *x, long k_len, const float *panel,
                                                                float *out, long ldo, const int R, const int P) {
    ZDECLARE(0) ZDECLARE(1) ZDECLARE(2) ZDECLARE(3) ZDECLARE(4) ZDECLARE(5)
    const float *next = panel + k_len * PANEL;
    for (long k = 0; k < k_len; k++) {
        v16 b0 = _mm512_loadu_ps(panel + k * PANEL), b1 = _mm512_setzero_ps();
        if (P == 2) b1 = _mm512_loadu_ps(next + k * PANEL);
        ZSTEP(0) ZSTEP(1) ZSTEP(2) ZSTEP(3) ZSTEP(4) ZSTEP(5)
    }
    ZSTORE(0) ZSTORE(1) ZSTORE(2) ZSTORE(3) ZSTORE(4) ZSTORE(5)
}

static inline __attribute__((always_inline)) v16i dot_pairs_wide(v16i acc, v16i a, v16i w) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, w);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, w));
#endif
}

#define ZIDECLARE(i)                                                                                         \
    v16i y##i##a = _mm512_setzero_si512(), y##i##b = y##i##a;                                                \
    v16 g##i##a = _mm512_setzero_ps(), g##i##b = g##i##a;
#define ZISTEP(i)                                                                                            \
    if (R > i) {                                                                                             \
        int32_t pair;                                                                                        \
        memcpy(&pair, xq + i * ldx + 2 * t, sizeof pair);                                                    \
        v16i a = _mm512_set1_epi32(pair);                                                                    \
        y##i##a = dot_pairs_wide(y##i##a, a, b0);                                                            \
        if (P == 2) y##i##b = dot_pairs_wide(y##i##b, a, b1);                                                \
    }
#define ZIFOLD(i)                                                                                            \
    if (R > i) {                                                                                             \
        g##i##a = _mm512_add_ps(g##i##a, _mm512_cvtepi32_ps(y##i##a));                                       \
        if (P == 2) g##i##b = _mm512_add_ps(g##i##b, _mm512_cvtepi32_ps(y##i##b));                           \
        y##i##a = y##i##b = _mm512_setzero_si512();                                                          \
    }
#define ZISTORE(i)                                                                                           \
    if (R > i) {                                                                                             \
        v16 r = _mm512_set1_ps(row_scales[i]);                                                               \
        _mm512_storeu_ps(out + i * ldo, _mm512_mul_ps(_mm512_mul_ps(g##i##a, r), s0));                       \
        if (P == 2) _mm512_storeu_ps(out + i * ldo + PANEL, _mm512_mul_ps(_mm512_mul_ps(g##i##b, r), s1));   \
    }

static inline __attribute__((always_inline)) void tile_i8_wide(const int16_t *xq, long ldx, const float *row_scales,
                                                               long pairs, long chunk, const int8_t *panel,
                                                               const float *scales, float *out, long ldo, const int R,
                                                               const int P) {
    ZIDECLARE(0) ZIDECLARE(1) ZIDECLARE(2) ZIDECLARE(3) ZIDECLARE(4) ZIDECLARE(5)
    const int8_t *next = panel + pairs * 2 * PANEL;
    for (long t0 = 0; t0 < pairs; t0 += chunk) {
        long t1 = t0 + chunk < pairs ? t0 + chunk : pairs;
        for (long t = t0; t < t1; t++) {
            v16i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(panel + t * 2 * PANEL)));
            v16i b1 = _mm512_setzero_si512();
            if (P == 2) b1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(next + t * 2 * PANEL)));
            ZISTEP(0) ZISTEP(1) ZISTEP(2) ZISTEP(3) ZISTEP(4) ZISTEP(5)
        }
        ZIFOLD(0) ZIFOLD(1) ZIFOLD(2) ZIFOLD(3) ZIFOLD(4) ZIFOLD(5)
    }
    v16 s0 = _mm512_loadu_ps(scales), s1 = _mm512_setzero_ps();
    if (P == 2) s1 = _mm512_loadu_ps(scales + PANEL);
    ZISTORE(0) ZISTORE(1) ZISTORE(2) ZISTORE(3) ZISTORE(4) ZISTORE(5)
}

#define ZQFOLD(i)                                                                                            \
    if (R > i) {                                                                                             \
        v16 sum = _mm512_set1_ps(group_sums[i * groups + g]);                                                \
        g##i##a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(y##i##a), d0, g##i##a);                                 \
        g##i##a = _mm512_fmadd_ps(m0, sum, g##i##a);                                                         \
        if (P == 2) {                                                                                        \
            g##i##b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(y##i##b), d1, g##i##b);                             \
            g##i##b = _mm512_fmadd_ps(m1, sum, g##i##b);                                                     \
        }                                                                                                    \
        y##i##a = y##i##b = _mm512_setzero_si512();                                                          \
    }
#define ZQSTORE(i)                                                                                           \
    if (R > i) {                                                                                             \
        v16 r = _mm512_set1_ps(row_scales[i]);                                                               \
        _mm512_storeu_ps(out + i * ldo, _mm512_mul_ps(g##i##a, r));                                          \
        if (P == 2) _mm512_storeu_ps(out + i * ldo + PANEL, _mm512_mul_ps(g##i##b, r));                      \
    }

/* tile_q4's sums (the same bits) with a panel's quad of nibbles widened into one register. */
static inline __attribute__((always_inline)) void tile_q4_wide(const int16_t *xq, long ldx, const float *row_scales,
                                                               const float *group_sums, long groups,
                                                               long group_quads, const uint8_t *panel, float *out,
                                                               long ldo, const int R, const int P, const int MODE) {
    ZIDECLARE(0) ZIDECLARE(1) ZIDECLARE(2) ZIDECLARE(3) ZIDECLARE(4) ZIDECLARE(5)
    const v16i nibble = _mm512_set1_epi16(0x0F);
    const long group_bytes = group_quads * 2 * PANEL + Q4_SCALE_BYTES(MODE);
    const uint8_t *next = panel + groups * group_bytes;
    for (long g = 0; g < groups; g++) {
        const uint8_t *at = panel + g * group_bytes, *at1 = next + g * group_bytes;
        for (long s = 0; s < group_quads; s++) {
            v16i wa = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(at + s * 2 * PANEL)));
            v16i wb = _mm512_setzero_si512();
            if (P == 2) wb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(at1 + s * 2 * PANEL)));
            long t = 2 * (g * group_quads + s);
            v16i b0 = _mm512_and_si512(wa, nibble), b1 = _mm512_and_si512(wb, nibble);
            ZISTEP(0) ZISTEP(1) ZISTEP(2) ZISTEP(3) ZISTEP(4) ZISTEP(5)
            t += 1;
            b0 = _mm512_srli_epi16(wa, 4), b1 = _mm512_srli_epi16(wb, 4);
            ZISTEP(0) ZISTEP(1) ZISTEP(2) ZISTEP(3) ZISTEP(4) ZISTEP(5)
        }
        const uint8_t *d = at + group_quads * 2 * PANEL, *d_next = at1 + group_quads * 2 * PANEL;
        v16 d0, m0, d1, m1;
        if (MODE == Q4H) {
            d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
            m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 2 * PANEL)));
            d1 = d0, m1 = m0;
            if (P == 2) {
                d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d_next));
                m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d_next + 2 * PANEL)));
            }
        } else {
            d0 = _mm512_loadu_ps((const float *)d), m0 = _mm512_loadu_ps((const float *)d + PANEL), d1 = d0, m1 = m0;
            if (P == 2) d1 = _mm512_loadu_ps((const float *)d_next), m1 = _mm512_loadu_ps((const float *)d_next + PANEL);
        }
        ZQFOLD(0) ZQFOLD(1) ZQFOLD(2) ZQFOLD(3) ZQFOLD(4) ZQFOLD(5)
    }
    ZQSTORE(0) ZQSTORE(1) ZQSTORE(2) ZQSTORE(3) ZQSTORE(4) ZQSTORE(5)
}
#else
#define WIDE 0
#endif

#define Q4FOLD(i)                                                                                            \
    if (R > i) {                                                                                             \
        v8 sum = _mm256_set1_ps(group_sums[i * groups + g]);                                                 \
        f##i##a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(n##i##a), d0, f##i##a);                                 \
        f##i##b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(n##i##b), d1, f##i##b);                                 \
        f##i##a = _mm256_fmadd_ps(m0, sum, f##i##a);                                                         \
        f##i##b = _mm256_fmadd_ps(m1, sum, f##i##b);                                                         \
        n##i##a = n##i##b = _mm256_setzero_si256();                                                          \
    }
#define Q4STORE(i)                                                                                           \
    if (R > i) {                                                                                             \
        v8 r = _mm256_set1_ps(row_scales[i]);                                                                \
        _mm256_storeu_ps(out + i * ldo, _mm256_mul_ps(f##i##a, r));                                          \
        _mm256_storeu_ps(out + i * ldo + 8, _mm256_mul_ps(f##i##b, r));                                      \
    }

/* out[i][j] for R rows of int16 codes (row stride ldx) and one int4 panel: per group of inputs, the
 * group's nibbles (a quad of inputs of the 16 columns in 32 bytes: byte 2j + u holds column j's
 * input 4s + u in its low nibble and 4s + 2 + u in its high one), then its 16 float32 scales d and
 * 16 float32 offsets m (w = q * d + m, q in 0..15). Each group's exact int32 sum of q times the codes
 * is added as sum * d, then m times the group's sum of codes (`group_sums`, float32), in order. */
static inline __attribute__((always_inline)) void tile_q4(const int16_t *xq, long ldx, const float *row_scales,
                                                          const float *group_sums, long groups,
                                                          long group_quads, const uint8_t *panel, float *out,
                                                          long ldo, const int R, const int MODE) {
    IDECLARE(0) IDECLARE(1) IDECLARE(2) IDECLARE(3) IDECLARE(4) IDECLARE(5)
    const v8i nibble = _mm256_set1_epi16(0x0F);
    for (long g = 0; g < groups; g++) {
        const uint8_t *at = panel + g * (group_quads * 2 * PANEL + Q4_SCALE_BYTES(MODE));
        for (long s = 0; s < group_quads; s++) {
            v8i wa = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(at + s * 2 * PANEL)));
            v8i wb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(at + s * 2 * PANEL + PANEL)));
            long t = 2 * (g * group_quads + s);
            v8i b0 = _mm256_and_si256(wa, nibble), b1 = _mm256_and_si256(wb, nibble);
            ISTEP(0) ISTEP(1) ISTEP(2) ISTEP(3) ISTEP(4) ISTEP(5)
            t += 1;
            b0 = _mm256_srli_epi16(wa, 4), b1 = _mm256_srli_epi16(wb, 4);
            ISTEP(0) ISTEP(1) ISTEP(2) ISTEP(3) ISTEP(4) ISTEP(5)
        }
        v8 d0, d1, m0, m1;
        if (MODE == Q4H) { /* (the launcher refuses Q4H where F16C is missing) */
#if defined(__F16C__)
            const __m128i *h = (const __m128i *)(at + group_quads * 2 * PANEL);
            d0 = _mm256_cvtph_ps(_mm_loadu_si128(h)), d1 = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
            m0 = _mm256_cvtph_ps(_mm_loadu_si128(h + 2)), m1 = _mm256_cvtph_ps(_mm_loadu_si128(h + 3));
#else
            d0 = d1 = m0 = m1 = _mm256_set1_ps(NAN);
#endif
        } else {
            const float *d = (const float *)(at + group_quads * 2 * PANEL);
            d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
            m0 = _mm256_loadu_ps(d + PANEL), m1 = _mm256_loadu_ps(d + PANEL + 8);
        }
        Q4FOLD(0) Q4FOLD(1) Q4FOLD(2) Q4FOLD(3) Q4FOLD(4) Q4FOLD(5)
    }
    Q4STORE(0) Q4STORE(1) Q4STORE(2) Q4STORE(3) Q4STORE(4) Q4STORE(5)
}

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define VNNI 1

/* acc's eight int32 lanes += the four products of each lane's bytes, w unsigned, a signed. */
static inline __attribute__((always_inline)) v8i dot_quads(v8i acc, v8i w, v8i a) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, a);
#else
    return _mm256_dpbusd_epi32(acc, w, a);
#endif
}

#define QDECLARE(i) v8i m##i##a = _mm256_setzero_si256(), m##i##b = m##i##a;
#define QSTEP(i)                                                                                             \
    if (R > i) {                                                                                             \
        int32_t quad;                                                                                        \
        memcpy(&quad, xq + i * ldx + 4 * t, sizeof quad);                                                    \
        v8i a = _mm256_set1_epi32(quad);                                                                     \
        m##i##a = dot_quads(m##i##a, b0, a);                                                                 \
        m##i##b = dot_quads(m##i##b, b1, a);                                                                 \
    }
#define QSTORE(i)                                                                                            \
    if (R > i) {                                                                                             \
        v8i c = _mm256_set1_epi32(128 * row_sums[i]);                                                        \
        v8 r = _mm256_set1_ps(row_scales[i]);                                                                \
        v8 da = _mm256_cvtepi32_ps(_mm256_sub_epi32(m##i##a, c)), db = _mm256_cvtepi32_ps(_mm256_sub_epi32(m##i##b, c)); \
        _mm256_storeu_ps(out + i * ldo, _mm256_mul_ps(_mm256_mul_ps(da, r), s0));                            \
        _mm256_storeu_ps(out + i * ldo + 8, _mm256_mul_ps(_mm256_mul_ps(db, r), s1));                        \
    }

/* out[i][j] for R rows of int8 codes (row stride ldx, `quads` groups of 4) and one w8a8 panel: its
 * codes stored + 128 (unsigned, as dpbusd takes them), so each sum holds 128 x the row's code sum
 * too, taken off before the scales. */
static inline __attribute__((always_inline)) void tile_w8(const int8_t *xq, long ldx, const float *row_scales,
                                                          const int32_t *row_sums, long quads,
                                                          const uint8_t *panel, const float *scales, float *out,
                                                          long ldo, const int R) {
    QDECLARE(0) QDECLARE(1) QDECLARE(2) QDECLARE(3) QDECLARE(4) QDECLARE(5)
    for (long t = 0; t < quads; t++) {
        v8i b0 = _mm256_loadu_si256((const __m256i *)(panel + t * 4 * PANEL));
        v8i b1 = _mm256_loadu_si256((const __m256i *)(panel + t * 4 * PANEL + 32));
        QSTEP(0) QSTEP(1) QSTEP(2) QSTEP(3) QSTEP(4) QSTEP(5)
    }
    v8 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
    QSTORE(0) QSTORE(1) QSTORE(2) QSTORE(3) QSTORE(4) QSTORE(5)
}
#else
#define VNNI 0 /* no dpbusd: gemm_w8a8 runs on int8 panels and int16 codes (W16) */
#endif

#else
#define VECTORIZED 0
#define VNNI 0
#define WIDE 0

/* The same sums one output at a time (compiled where AVX2 and FMA are missing; the engine does
 * not pack weights there, see gemm_vectorized). */
static void tile_f32(const float *x, long k_len, const float *panel, float *out, long ldo, const int R,
                     const int P) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < P * PANEL; j++) {
            const float *w = panel + (j / PANEL) * k_len * PANEL + j % PANEL;
            float sum = 0.0f;
            for (long k = 0; k < k_len; k++) sum = fmaf(x[i * k_len + k], w[k * PANEL], sum);
            out[i * ldo + j] = sum;
        }
}

static void tile_i8(const int16_t *xq, long ldx, const float *row_scales, long pairs, long chunk,
                    const int8_t *panel, const float *scales, float *out, long ldo, const int R) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < PANEL; j++) {
            const int8_t *w = panel + j * 2;
            float sum = 0.0f;
            for (long t0 = 0; t0 < pairs; t0 += chunk) {
                int32_t part = 0;
                for (long t = t0; t < t0 + chunk && t < pairs; t++)
                    part += xq[i * ldx + 2 * t] * w[t * 2 * PANEL] + xq[i * ldx + 2 * t + 1] * w[t * 2 * PANEL + 1];
                sum += (float)part;
            }
            out[i * ldo + j] = sum * row_scales[i] * scales[j];
        }
}

/* an IEEE half's value as a float (every half is exactly a float) */
static float half_value(const uint8_t *at) {
    uint16_t h = (uint16_t)(at[0] | at[1] << 8);
    int exponent = (h >> 10) & 31, mantissa = h & 1023;
    float magnitude = exponent == 0    ? ldexpf((float)mantissa, -24)
                      : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                       : ldexpf((float)(mantissa | 1024), exponent - 25);
    return h >> 15 ? -magnitude : magnitude;
}

static void tile_q4(const int16_t *xq, long ldx, const float *row_scales, const float *group_sums, long groups,
                    long group_quads, const uint8_t *panel, float *out, long ldo, const int R, const int MODE) {
    long group_bytes = group_quads * 2 * PANEL + Q4_SCALE_BYTES(MODE);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < PANEL; j++) {
            float sum = 0.0f;
            for (long g = 0; g < groups; g++) {
                const uint8_t *at = panel + g * group_bytes;
                int32_t chunk = 0;
                for (long s = 0; s < group_quads; s++)
                    for (int u = 0; u < 2; u++) {
                        uint8_t b = at[s * 2 * PANEL + 2 * j + u];
                        const int16_t *xs = xq + i * ldx + 4 * (g * group_quads + s);
                        chunk += xs[u] * (b & 15) + xs[2 + u] * (b >> 4);
                    }
                float d, m;
                if (MODE == Q4H) {
                    d = half_value(at + group_quads * 2 * PANEL + 2 * j);
                    m = half_value(at + group_quads * 2 * PANEL + 2 * (PANEL + j));
                } else {
                    memcpy(&d, at + group_quads * 2 * PANEL + 4 * j, sizeof d);
                    memcpy(&m, at + group_quads * 2 * PANEL + 4 * (PANEL + j), sizeof m);
                }
                sum = fmaf((float)chunk, d, sum);
                sum = fmaf(m, group_sums[i * groups + g], sum);
            }
            out[i * ldo + j] = sum * row_scales[i];
        }
}
#endif

/* Per row of x after quantization (I16, W8, Q4): its scale, (W8) the sum of its codes, (Q4) the
 * sum of its codes in each of the weight's `groups` groups of inputs, and their size. */
typedef struct {
    const float *scales;
    const int32_t *sums;
    const float *group_sums;
    long groups, group;
} RowCodes;

static inline RowCodes rows_from(RowCodes q, long i) {
    return (RowCodes){q.scales ? q.scales + i : NULL, q.sums ? q.sums + i : NULL,
                      q.group_sums ? q.group_sums + i * q.groups : NULL, q.groups, q.group};
}

/* R rows (1 to TILE_ROWS) by P panels (1, or 2 with R <= 3: float32 only) as a constant-shape tile.
 * `x` is float32 (F32, depth = k), int16 pairs (I16, W16: depth = the pairs) or int8 quads (W8,
 * depth = the quads), the latter two with `q`; a row of x takes depth * 4 bytes in each. */
static inline __attribute__((always_inline)) void tile(const void *x, RowCodes q, long depth, const void *panel,
                                                       const float *scales, float *out, long ldo, const int R,
                                                       const int P, const int MODE) {
#if WIDE
    if (MODE == F32)
        tile_f32_wide((const float *)x, depth, (const float *)panel, out, ldo, R, P);
    else if (IS_PAIRS(MODE))
        tile_i8_wide((const int16_t *)x, 2 * depth, q.scales, depth, MODE == I16 ? CHUNK_PAIRS : depth,
                     (const int8_t *)panel, scales, out, ldo, R, P);
    else if (IS_Q4(MODE))
        tile_q4_wide((const int16_t *)x, 2 * depth, q.scales, q.group_sums, q.groups, q.group / 4,
                     (const uint8_t *)panel, out, ldo, R, P, MODE);
#else
    if (MODE == F32)
        tile_f32((const float *)x, depth, (const float *)panel, out, ldo, R, P);
    else if (IS_PAIRS(MODE))
        tile_i8((const int16_t *)x, 2 * depth, q.scales, depth, MODE == I16 ? CHUNK_PAIRS : depth,
                (const int8_t *)panel, scales, out, ldo, R);
    else if (IS_Q4(MODE))
        tile_q4((const int16_t *)x, 2 * depth, q.scales, q.group_sums, q.groups, q.group / 4,
                (const uint8_t *)panel, out, ldo, R, MODE);
#endif
#if VNNI
    if (MODE == W8)
        tile_w8((const int8_t *)x, 4 * depth, q.scales, q.sums, depth, (const uint8_t *)panel, scales, out, ldo, R);
#endif
}

static inline __attribute__((always_inline)) void rows_by_panels(const void *x, RowCodes q, long rows, long depth,
                                                                 const void *panel, const float *scales,
                                                                 float *out, long ldo, int pair, const int MODE) {
#define TILE(r, p) tile(x, q, depth, panel, scales, out, ldo, r, p, MODE)
    if (pair) {
        switch (rows) {
        case 1: TILE(1, 2); return;
        case 2: TILE(2, 2); return;
#if WIDE
        case 3: TILE(3, 2); return;
        case 4: TILE(4, 2); return;
        case 5: TILE(5, 2); return;
        default: TILE(6, 2); return;
#else
        default: TILE(3, 2); return;
#endif
        }
    }
    switch (rows) {
    case 1: TILE(1, 1); return;
    case 2: TILE(2, 1); return;
    case 3: TILE(3, 1); return;
    case 4: TILE(4, 1); return;
    case 5: TILE(5, 1); return;
    default: TILE(6, 1); return;
    }
#undef TILE
}

/* Rows [r0, r1) of y for panel p (and p + 1 when `pair`); a panel past n_out's end goes through a
 * buffer so that only y's own columns are written. */
static inline __attribute__((always_inline)) void panel_rows(const void *x, RowCodes q, long r0, long r1, long depth,
                                                             const void *packed, const float *scales, long p,
                                                             long n_out, float *y, int pair, const int MODE) {
    /* a line of a panel: 16 floats (F32), 16 x 2 int8 (I16, W16), 16 x 4 int8 (W8); Q4: a group of
     * inputs takes 16 x group / 2 bytes of nibbles and 16 x 2 floats */
    long panel_bytes = IS_Q4(MODE) ? q.groups * (PANEL * q.group / 2 + Q4_SCALE_BYTES(MODE))
                                   : depth * PANEL * (IS_PAIRS(MODE) ? 2 : 4);
    const void *panel = (const char *)packed + p * panel_bytes;
    const float *panel_scales = MODE == F32 || IS_Q4(MODE) ? NULL : scales + p * PANEL;
    long col = p * PANEL, width = (pair ? 2 : 1) * PANEL;
    const long step = ROWS_PER_TILE(MODE);
    for (long i = r0; i < r1; i += step) {
        long rows = r1 - i < step ? r1 - i : step; /* <= 3 when `pair` without AVX-512 (gemm) */
        const void *xi = (const char *)x + i * depth * 4;
        RowCodes qi = rows_from(q, i);
        if (col + width <= n_out) {
            rows_by_panels(xi, qi, rows, depth, panel, panel_scales, y + i * n_out + col, n_out, pair, MODE);
        } else {
            float buffer[TILE_ROWS * 2 * PANEL];
            rows_by_panels(xi, qi, rows, depth, panel, panel_scales, buffer, width, pair, MODE);
            for (long r = 0; r < rows; r++)
                memcpy(y + (i + r) * n_out + col, buffer + r * width, (size_t)(n_out - col) * sizeof(float));
        }
    }
}

/* y (rows, n_out) = x @ w.T over the packed w: float32 x and panels (F32, depth = k), or codes of x
 * with `q` and int8 panels with `scales` per column (I16, W16: depth = pairs of k; W8: quads of k). */
static inline __attribute__((always_inline)) void gemm(const void *x, RowCodes q, long rows, long depth,
                                                       const void *packed, const float *scales, long n_out,
                                                       float *y, const int MODE) {
    long panels = (n_out + PANEL - 1) / PANEL;
    /* two panels a tile: float32 at a decode step's few rows (AVX2), float32, int8 and int4 at every
     * row count (AVX-512: a panel is one register, so a 6-row tile of two panels keeps 12 sums) */
    int paired = (MODE == F32 && (rows <= 3 || WIDE)) || ((IS_PAIRS(MODE) || IS_Q4(MODE)) && WIDE);
    long units = paired ? (panels + 1) / 2 : panels;
    const long step = ROWS_PER_TILE(MODE); /* a chunk holds whole tiles */
    long chunk = CHUNK_BYTES / (depth * 4) / step * step;
    if (chunk < step) chunk = step;
    for (long r0 = 0; r0 < rows; r0 += chunk) { /* x's chunk stays in cache while the panels stream by */
        long r1 = r0 + chunk < rows ? r0 + chunk : rows;
#pragma omp parallel for schedule(static)
        for (long u = 0; u < units; u++) {
            long p = paired ? 2 * u : u;
            panel_rows(x, q, r0, r1, depth, packed, scales, p, n_out, y, paired && p + 1 < panels, MODE);
        }
    }
}

/* Row r of x (rows, k_len) as integer codes round(x / s_r) with s_r = max(max |x_r| / qmax, FLT_MIN)
 * (a normal float: a subnormal scale keeps a few bits, and x / s_r could pass qmax),
 * rounded half to even (torch.round's rule): int16 codes, qmax 32767 (I16), int8 codes, qmax 127,
 * and their sum (W8), or the same codes as int16 (W16); `width` codes a row, zeros past k_len. A row holding a NaN or an infinity gets
 * zero codes and the scale NaN: its outputs are NaN, as a float product's. */
static inline __attribute__((always_inline)) void quantize_rows(const float *x, long rows, long k_len, long width,
                                                                void *codes, float *row_scales,
                                                                int32_t *row_sums, const int MODE) {
    const float qmax = MODE == W8 || MODE == W16 ? 127.0f : QMAX;
    const size_t code_bytes = MODE == W8 ? 1 : 2;
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * k_len;
        char *row = (char *)codes + r * width * code_bytes;
        float amax = 0.0f;
        int finite = 1;
        long k = 0;
#if VECTORIZED
        v8 top = _mm256_setzero_ps(), odd = top;
        const v8 sign = _mm256_set1_ps(-0.0f);
        for (; k + 8 <= k_len; k += 8) {
            v8 v = _mm256_loadu_ps(xr + k);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
            odd = _mm256_or_ps(odd, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
        finite = _mm256_movemask_ps(odd) == 0;
#endif
        for (; k < k_len; k++) {
            finite = finite && !isnan(xr[k]);
            amax = fmaxf(amax, fabsf(xr[k]));
        }
        memset(row + k_len * code_bytes, 0, (size_t)(width - k_len) * code_bytes); /* padding */
        if (!finite || isinf(amax)) {
            memset(row, 0, (size_t)k_len * code_bytes);
            row_scales[r] = NAN;
            if (MODE == W8) row_sums[r] = 0;
            continue;
        }
        float scale = fmaxf(amax / qmax, FLT_MIN);
        row_scales[r] = scale;
        int32_t sum = 0;
        k = 0;
#if VECTORIZED
        const v8 step = _mm256_set1_ps(scale);
        v8i sums = _mm256_setzero_si256();
        for (; k + 8 <= k_len; k += 8) { /* |x / scale| <= qmax + 0.002: in range once rounded */
            v8i c = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k), step)); /* half to even */
            __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            if (MODE == W8) {
                _mm_storel_epi64((__m128i *)(row + k), _mm_packs_epi16(halves, halves));
                sums = _mm256_add_epi32(sums, c);
            } else {
                _mm_storeu_si128((__m128i *)(row + 2 * k), halves);
            }
        }
        int32_t lane_sums[8];
        _mm256_storeu_si256((__m256i *)lane_sums, sums);
        for (int l = 0; l < 8; l++) sum += lane_sums[l];
#endif
        for (; k < k_len; k++) {
            int32_t c = (int32_t)nearbyintf(xr[k] / scale);
            if (MODE == W8) {
                ((int8_t *)row)[k] = (int8_t)c;
                sum += c;
            } else {
                ((int16_t *)row)[k] = (int16_t)c;
            }
        }
        if (MODE == W8) row_sums[r] = sum;
    }
}

/* y (rows, n_out) = x (rows, k_len) @ w.T, where `packed` holds w (n_out, k_len) as
 * ceil(n_out / PANEL) panels of (k_len, PANEL), zero past n_out. x and y contiguous, row-major. */
void gemm_f32(const float *x, long rows, long k_len, const float *packed, long n_out, float *y) {
    gemm(x, (RowCodes){NULL, NULL, NULL, 0, 0}, rows, k_len, packed, NULL, n_out, y, F32);
}

/* The same for per-channel int8 weights, w[j] = codes[j] * scales[j]: `packed` holds the codes as
 * ceil(n_out / PANEL) panels of (ceil(k_len / 2), PANEL, 2), zero past n_out and k_len, `scales`
 * is padded to the panels' width. Returns 0, or -1 when the activations' codes cannot be allocated. */
int gemm_i8(const float *x, long rows, long k_len, const int8_t *packed, const float *scales, long n_out,
            float *y) {
    long pairs = (k_len + 1) / 2;
    int16_t *xq = malloc((size_t)(rows * 2 * pairs) * sizeof(int16_t));
    float *row_scales = malloc((size_t)rows * sizeof(float));
    if (xq == NULL || row_scales == NULL) {
        free(xq);
        free(row_scales);
        return -1;
    }
    quantize_rows(x, rows, k_len, 2 * pairs, xq, row_scales, NULL, I16);
    gemm(xq, (RowCodes){row_scales, NULL, NULL, 0, 0}, rows, pairs, packed, scales, n_out, y, I16);
    free(xq);
    free(row_scales);
    return 0;
}

/* w8a8: x's rows rounded to int8 codes (one scale a row, max |x| / 127) times int8 weight codes, in
 * exact int32 sums, each output float(sum) * row scale * column scale: torch._int_mm's answer on the
 * same codes, bit for bit. Where the CPU has VNNI, `packed` holds the codes + 128 as unsigned bytes
 * in ceil(n_out / PANEL) panels of (ceil(k_len / 4), PANEL, 4) (128 past n_out and k_len), and
 * dpbusd takes four products per lane and instruction. Elsewhere (torch._int_mm is then oneDNN's
 * reference loop, ~30x slower than float32 at 32 rows) `packed` holds the signed codes as gemm_i8's
 * panels of (ceil(k_len / 2), PANEL, 2) and x's codes are held as int16: gemm_i8's tiles with one
 * int32 sum over all of k (|sum| <= 65,536 x 127 x 128 < 2^31). Returns 0; -1 when the codes cannot
 * be allocated; -2 past W8A8_MAX_K inputs (the sums could overflow). */
int gemm_w8a8(const float *x, long rows, long k_len, const void *packed, const float *scales, long n_out,
              float *y) {
    if (k_len > W8A8_MAX_K) return -2;
#if VNNI
    long depth = (k_len + 3) / 4;
    size_t code_bytes = 4 * sizeof(int8_t);
#else
    long depth = (k_len + 1) / 2;
    size_t code_bytes = 2 * sizeof(int16_t);
#endif
    void *xq = malloc((size_t)(rows * depth) * code_bytes);
    float *row_scales = malloc((size_t)rows * sizeof(float));
    int32_t *row_sums = malloc((size_t)rows * sizeof(int32_t));
    int failed = xq == NULL || row_scales == NULL || row_sums == NULL;
    if (!failed) {
#if VNNI
        quantize_rows(x, rows, k_len, 4 * depth, xq, row_scales, row_sums, W8);
        gemm(xq, (RowCodes){row_scales, row_sums, NULL, 0, 0}, rows, depth, packed, scales, n_out, y, W8);
#else
        quantize_rows(x, rows, k_len, 2 * depth, xq, row_scales, NULL, W16);
        gemm(xq, (RowCodes){row_scales, NULL, NULL, 0, 0}, rows, depth, packed, scales, n_out, y, W16);
#endif
    }
    free(xq);
    free(row_scales);
    free(row_sums);
    return failed ? -1 : 0;
}

/* int4 weights in groups, w[j][i] = q * d + m with q in 0..15 and float32 (d, m) per column and group
 * of `group` consecutive inputs: x's rows rounded to int16 codes (as gemm_i8), each group's exact
 * int32 sum of q times the codes, then per group y += sum * d + m * (the group's sum of codes), in
 * group order, and y times the row's scale. `packed` holds ceil(n_out / PANEL) panels, each the
 * k_len / group groups in order: group / 4 quads of 32 bytes of nibbles (see tile_q4), 16 scales d,
 * 16 offsets m (zeros past n_out). Returns 0; -1 when the codes cannot be allocated; -2 when k_len
 * is not a multiple of `group` or `group` is not a multiple of 4 up to Q4_MAX_GROUP. */
static inline __attribute__((always_inline)) int q4_product(const float *x, long rows, long k_len,
                                                            const uint8_t *packed, long group, long n_out, float *y,
                                                            const int MODE) {
    if (group <= 0 || group % 4 || group > Q4_MAX_GROUP || k_len % group) return -2;
    long groups = k_len / group;
    int16_t *xq = malloc((size_t)(rows * k_len) * sizeof(int16_t));
    float *row_scales = malloc((size_t)rows * sizeof(float));
    float *group_sums = malloc((size_t)(rows * groups) * sizeof(float));
    int failed = xq == NULL || row_scales == NULL || group_sums == NULL;
    if (!failed) {
        quantize_rows(x, rows, k_len, k_len, xq, row_scales, NULL, I16);
        for (long r = 0; r < rows; r++)
            for (long g = 0; g < groups; g++) {
                const int16_t *codes = xq + r * k_len + g * group;
                int32_t sum = 0;
                for (long i = 0; i < group; i++) sum += codes[i];
                group_sums[r * groups + g] = (float)sum;
            }
        gemm(xq, (RowCodes){row_scales, NULL, group_sums, groups, group}, rows, k_len / 2, packed, NULL, n_out,
             y, MODE);
    }
    free(xq);
    free(row_scales);
    free(group_sums);
    return failed ? -1 : 0;
}

int gemm_q4(const float *x, long rows, long k_len, const uint8_t *packed, long group, long n_out, float *y) {
    return q4_product(x, rows, k_len, packed, group, n_out, y, Q4);
}

/* gemm_q4 with float16 scales and offsets (GGUF Q4_1's own: 16 d then 16 m as halves, two bytes
 * each, after a group's nibbles): the same sums of the same values, 5 bits a weight instead of 6.
 * Returns -2 also where the vectorized build lacks F16C (gemm_half_scales says so). */
int gemm_q4h(const float *x, long rows, long k_len, const uint8_t *packed, long group, long n_out, float *y) {
#if VECTORIZED && !defined(__F16C__)
    (void)x, (void)rows, (void)k_len, (void)packed, (void)group, (void)n_out, (void)y;
    return -2;
#else
    return q4_product(x, rows, k_len, packed, group, n_out, y, Q4H);
#endif
}

/* 1 where gemm_q4h runs (F16C's conversions in the vectorized build; the scalar one converts itself). */
int gemm_half_scales(void) {
#if VECTORIZED && !defined(__F16C__)
    return 0;
#else
    return 1;
#endif
}

/* 1 where gemm_w8a8 runs (VNNI's dpbusd: AVX-VNNI, or AVX-512 VNNI with VL). */
int gemm_vnni(void) { return VNNI; }

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
