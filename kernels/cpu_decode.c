/* A decode step's small operations, fused, float32, on the CPU: what surrounds the projections.
 *
 * Launchers in kernels/cpu_decode.py; references in kernels/reference.py (rms_norm,
 * fused_add_rms_norm, silu_and_mul, rotary_embedding + store_kv + paged_decode_attention). One
 * decode row of a layer is ~40 torch operations of a few microseconds each around four products;
 * at batch 1 that dispatch costs more than the products themselves (docs/BENCHMARKS.md). Here the
 * attention block between the QKV and output projections is one call, each norm one call.
 * Used without batch invariance only: the sums run in another order than the references'.
 */
#include <math.h>
#include <stdlib.h>

#include "cpu_vec.h"

/* lanes of a where mask (a comparison's all-ones), of b elsewhere */
static inline vf selectv(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* exp(x) for VL lanes: 2^n * 2^f with n = round(x log2 e) and a degree-6 polynomial for 2^f,
 * f in [-0.5, 0.5] (relative error ~2e-7); 0 below -87 (expf: under 2e-38), +inf past
 * ln(FLT_MAX). 2^n is built as 2 * 2^(n - 1) so that n = 128 stays finite. */
static inline vf expv(vf x) {
    vf y = x * 1.44269504088896341f;
    y = selectv(y < -125.0f, splatv(-125.0f), y);
    y = selectv(y > 128.0f, splatv(128.0f), y);
    vf half = selectv(y >= 0.0f, splatv(0.5f), splatv(-0.5f));
    vf n = __builtin_convertvector(__builtin_convertvector(y + half, vi), vf); /* y rounded */
    vf f = (y - n) * 0.693147180559945309f; /* e^f = 2^(y - n) */
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    vi bits = (__builtin_convertvector(n, vi) + 126) << 23;
    vf scale; /* 2^(n - 1) */
    memcpy(&scale, &bits, sizeof scale);
    vf out = (p * 2.0f) * scale;
    out = selectv(x < -87.0f, splatv(0.0f), out);
    return selectv(x > 88.7228391f, splatv(INFINITY), out);
}

/* out = rms_norm(x) * weight, row by row; with `residual`: residual_out = x + residual first and
 * the norm is taken of it (fused_add_rms_norm). rows x dim, contiguous. */
void add_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps, long rows, long dim,
                      float *out, float *residual_out) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float *h = xr;
        if (residual != NULL) {
            float *res = residual_out + r * dim;
            const float *rr = residual + r * dim;
            for (long i = 0; i < dim; i++) res[i] = xr[i] + rr[i];
            h = res;
        }
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (long i = 0; i < dim; i++) sum += (double)h[i] * h[i];
        float inv = 1.0f / sqrtf((float)(sum / dim) + eps);
        for (long i = 0; i < dim; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* out (rows, d) = silu(x[:, :d]) * x[:, d:], x (rows, 2d). */
void silu_and_mul_f32(const float *x, long rows, long d, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *g = x + r * 2 * d, *u = g + d;
        float *o = out + r * d;
        long i = 0;
        for (; i + VL <= d; i += VL) {
            vf gv = loadv(g + i);
            storev(o + i, gv / (1.0f + expv(-gv)) * loadv(u + i));
        }
        for (; i < d; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 16 /* consecutive rows of one sequence attended together */
#define KEY_CHUNK 64 /* keys (and values) a block reads before the next ones */

/* rows[t - t0] = the cached vectors of positions t0..t1-1 (of one head, `offset` into a token) in the
 * paged cache through a sequence's block table. */
static inline void head_rows(const float *cache, const int32_t *table, long block_size, long token_stride, long offset,
                             long t0, long t1, const float **rows) {
    long entry = t0 / block_size, within = t0 % block_size; /* one division, not two a position */
    const float *base = cache + ((long)table[entry] * block_size) * token_stride + offset;
    for (long t = t0; t < t1; t++) {
        rows[t - t0] = base + within * token_stride;
        if (++within == block_size && t + 1 < t1) {
            within = 0;
            base = cache + ((long)table[++entry] * block_size) * token_stride + offset;
        }
    }
}

/* scores[t] = (q . keys[t - t0]) * scale for t0 <= t < end, q and each key `lanes` vectors long.
 * Four keys at a time (four independent chains of multiply-adds instead of one: the adds' latency
 * bounded the loop), each key's sum the same operations in the same order as alone: lanes in
 * order, then folded. Inlined with a constant `lanes`, the query stays in registers. */
static inline __attribute__((always_inline)) void key_scores(const float *q, const float *const *keys, long t0,
                                                             long end, long lanes, float scale, float *scores) {
    vf qv[MAX_HEAD_DIM / VL];
    for (long l = 0; l < lanes; l++) qv[l] = loadv(q + l * VL);
    long t = t0;
    for (; t + 4 <= end; t += 4) {
        const float *k0 = keys[t - t0], *k1 = keys[t - t0 + 1], *k2 = keys[t - t0 + 2], *k3 = keys[t - t0 + 3];
        vf d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};
        for (long l = 0; l < lanes; l++) {
            d0 += qv[l] * loadv(k0 + l * VL);
            d1 += qv[l] * loadv(k1 + l * VL);
            d2 += qv[l] * loadv(k2 + l * VL);
            d3 += qv[l] * loadv(k3 + l * VL);
        }
        scores[t] = foldv(d0) * scale;
        scores[t + 1] = foldv(d1) * scale;
        scores[t + 2] = foldv(d2) * scale;
        scores[t + 3] = foldv(d3) * scale;
    }
    for (; t < end; t++) {
        const float *k = keys[t - t0];
        vf dot = {0};
        for (long l = 0; l < lanes; l++) dot += qv[l] * loadv(k + l * VL);
        scores[t] = foldv(dot) * scale;
    }
}

/* acc += sum of weights[t] * values[t - t0] for t0 <= t < end (acc: `lanes` vectors), t in order;
 * inlined with a constant `lanes`, the sums stay in registers across the chunk. */
static inline __attribute__((always_inline)) void weigh_values(const float *weights, const float *const *values,
                                                               long t0, long end, long lanes, vf *acc) {
    vf a[MAX_HEAD_DIM / VL];
    for (long l = 0; l < lanes; l++) a[l] = acc[l];
    for (long t = t0; t < end; t++) {
        const float *v = values[t - t0];
        float p = weights[t];
        for (long l = 0; l < lanes; l++) a[l] += p * loadv(v + l * VL);
    }
    for (long l = 0; l < lanes; l++) acc[l] = a[l];
}

/* NeoX rotary of one head in place: x * cos + rotate_half(x) * sin (cos, sin: head_dim each). */
static void rotate(float *x, const float *cos_row, const float *sin_row, long head_dim) {
    long half = head_dim / 2;
    for (long i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos_row[i] - b * sin_row[i];
        x[i + half] = b * cos_row[i + half] + a * sin_row[i + half];
    }
}

/* One decode row per sequence: split the QKV projection, rotate q and k at the row's position,
 * store k and v in the paged cache at the row's slot, then attend over the row's context.
 *
 * qkv: (rows, (heads + 2 * kv_heads) * head_dim); positions, slots: (rows,) int64 (slot < 0, or a
 * position outside the tables: a padding row, nothing stored, output zeros); cos, sin:
 * (max_positions, head_dim);
 * k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim); block_tables: (rows, table_width)
 * int32; context_lens: (rows,) int32, the new token included; out: (rows, heads * head_dim).
 * head_dim a multiple of 16, at most MAX_HEAD_DIM; heads / kv_heads at most MAX_GROUP (the launcher
 * checks). Each job is one row's KV head: its keys and values are read once for the group of query
 * heads that share them, in one fixed order, on one thread, so a row's output does not depend on
 * the rows beside it or the threads. A prefill's rows are rows like any other (each with its own
 * position, table and context length): every row's K and V are stored before any row attends.
 * Returns 0, or -1 when a thread's scores (group * max_context floats) cannot be allocated. */
int decode_attention_f32(const float *qkv, long rows, long heads, long kv_heads, long head_dim,
                          const int64_t *positions, long max_positions, const float *cos, const float *sin,
                          float *k_cache,
                          float *v_cache, long block_size, const int64_t *slots, const int32_t *block_tables,
                          long table_width, const int32_t *context_lens, long max_context, float scale, float *out) {
    long q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    long token_stride = kv_heads * head_dim;
    /* the new tokens' keys and values, rotated, into the cache first (every head reads them) */
    for (long r = 0; r < rows; r++) {
        if (slots[r] < 0 || positions[r] < 0 || positions[r] >= max_positions) continue;
        const float *row = qkv + r * width;
        const float *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        float *k_dst = k_cache + slots[r] * token_stride, *v_dst = v_cache + slots[r] * token_stride;
        memcpy(k_dst, row + q_size, kv_size * sizeof(float));
        memcpy(v_dst, row + q_size + kv_size, kv_size * sizeof(float));
        for (long h = 0; h < kv_heads; h++) rotate(k_dst + h * head_dim, c, s, head_dim);
    }
    long group = heads / kv_heads, lanes = head_dim / VL;
    /* Rows in blocks: consecutive rows of one sequence (a prefill chunk: the same table, positions
     * one apart) share each key and value they read; a decode row is a block of one. Each row's sums
     * are the same whatever its block (the same operations in the same order: t ascending), so the
     * blocks change the memory traffic, never the bits. A block's scores take at most ~1 MiB. */
    long most = (1L << 18) / (group * (max_context > 0 ? max_context : 1));
    most = most < 1 ? 1 : (most > MAX_BLOCK ? MAX_BLOCK : most);
    long *starts = malloc((size_t)(rows + 1) * sizeof(long));
    if (starts == NULL) return -1;
    long blocks = 0;
    for (long r = 0; r < rows; r++) {
        long b = blocks > 0 ? starts[blocks - 1] : -1;
        /* the block reads its first row's table up to its last row's context: those entries must match */
        long reads = context_lens[r] < max_context ? context_lens[r] : max_context;
        reads = reads > 0 ? (reads + block_size - 1) / block_size : 0;
        int joins = b >= 0 && r - b < most && slots[r] >= 0 && slots[b] >= 0 && positions[r] == positions[r - 1] + 1
                    && memcmp(block_tables + r * table_width, block_tables + b * table_width,
                              (size_t)reads * sizeof(int32_t)) == 0;
        if (!joins) starts[blocks++] = r;
    }
    starts[blocks] = rows;
    int failed = 0;
    /* threads from a few thousand row x head x position steps on (a 16-row step at a 200-token context:
     * 56 -> 46 ms for the default model's whole decode step, docs/BENCHMARKS.md) */
#pragma omp parallel if (rows * kv_heads * (long)max_context > 4096)
    {
    /* per thread: a block's scores (rows, group, max_context), rotated queries and output sums */
    float *scores = malloc((size_t)(most * group * max_context) * sizeof(float));
    float *queries = malloc((size_t)(most * group * head_dim) * sizeof(float));
    vf *acc = aligned_alloc(sizeof(vf), (size_t)(most * group * lanes) * sizeof(vf)); /* vf-aligned */
    if (scores == NULL || queries == NULL || acc == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (long job = 0; job < blocks * kv_heads; job++) {
        if (scores == NULL || queries == NULL || acc == NULL) continue;
        long b = job / kv_heads, kvh = job % kv_heads, r0 = starts[b], n = starts[b + 1] - r0;
        long lengths[MAX_BLOCK], longest = 0;
        for (long i = 0; i < n; i++) {
            long r = r0 + i;
            long length = context_lens[r] < max_context ? context_lens[r] : max_context;
            if (slots[r] < 0 || positions[r] < 0 || positions[r] >= max_positions || length < 0) length = 0;
            lengths[i] = length;
            longest = length > longest ? length : longest;
            /* this KV head's queries of row r, rotated: (group, head_dim) */
            for (long j = 0; j < group; j++) {
                float *q = queries + (i * group + j) * head_dim;
                memcpy(q, qkv + r * width + (kvh * group + j) * head_dim, head_dim * sizeof(float));
                if (length > 0) rotate(q, cos + positions[r] * head_dim, sin + positions[r] * head_dim, head_dim);
            }
        }
        const int32_t *table = block_tables + r0 * table_width;
        const float *keys[KEY_CHUNK];
        for (long t0 = 0; t0 < longest; t0 += KEY_CHUNK) { /* a chunk of keys stays in cache for the block */
            long t1 = t0 + KEY_CHUNK < longest ? t0 + KEY_CHUNK : longest;
            head_rows(k_cache, table, block_size, token_stride, kvh * head_dim, t0, t1, keys);
            for (long i = 0; i < n; i++) {
                long end = t1 < lengths[i] ? t1 : lengths[i];
                for (long j = 0; j < group; j++) {
                    const float *q = queries + (i * group + j) * head_dim;
                    float *sj = scores + (i * group + j) * max_context;
                    switch (lanes) { /* a constant count of lanes keeps the query in registers */
                    case 4: key_scores(q, keys, t0, end, 4, scale, sj); break;
                    case 8: key_scores(q, keys, t0, end, 8, scale, sj); break;
                    case 16: key_scores(q, keys, t0, end, 16, scale, sj); break;
                    default: key_scores(q, keys, t0, end, lanes, scale, sj);
                    }
                }
            }
        }
        float inverse[MAX_BLOCK * MAX_GROUP];
        for (long i = 0; i < n; i++)
            for (long j = 0; j < group; j++) { /* softmax numerators, 1 / their sum kept for the end */
                long length = lengths[i];
                float *sj = scores + (i * group + j) * max_context, top = -INFINITY, total = 0.0f;
                for (long t = 0; t < length; t++) top = sj[t] > top ? sj[t] : top;
                long t = 0;
                vf sum = {0};
                for (; t + VL <= length; t += VL) {
                    vf e = expv(loadv(sj + t) - top);
                    storev(sj + t, e);
                    sum += e;
                }
                total = foldv(sum);
                for (; t < length; t++) {
                    sj[t] = expf(sj[t] - top);
                    total += sj[t];
                }
                inverse[i * group + j] = 1.0f / total;
            }
        for (long l = 0; l < n * group * lanes; l++) acc[l] = (vf){0};
        const float *values[KEY_CHUNK];
        for (long t0 = 0; t0 < longest; t0 += KEY_CHUNK) {
            long t1 = t0 + KEY_CHUNK < longest ? t0 + KEY_CHUNK : longest;
            head_rows(v_cache, table, block_size, token_stride, kvh * head_dim, t0, t1, values);
            for (long i = 0; i < n; i++) {
                long end = t1 < lengths[i] ? t1 : lengths[i];
                for (long j = 0; j < group; j++) {
                    const float *sj = scores + (i * group + j) * max_context;
                    vf *a = acc + (i * group + j) * lanes;
                    switch (lanes) {
                    case 4: weigh_values(sj, values, t0, end, 4, a); break;
                    case 8: weigh_values(sj, values, t0, end, 8, a); break;
                    case 16: weigh_values(sj, values, t0, end, 16, a); break;
                    default: weigh_values(sj, values, t0, end, lanes, a);
                    }
                }
            }
        }
        for (long i = 0; i < n; i++) {
            float *o = out + (r0 + i) * q_size + kvh * group * head_dim;
            if (lengths[i] <= 0) {
                memset(o, 0, group * head_dim * sizeof(float));
                continue;
            }
            for (long j = 0; j < group; j++)
                for (long l = 0; l < lanes; l++)
                    storev(o + j * head_dim + l * VL, acc[(i * group + j) * lanes + l] * inverse[i * group + j]);
        }
    }
    free(scores);
    free(queries);
    free(acc);
    }
    free(starts);
    return failed ? -1 : 0;
}
