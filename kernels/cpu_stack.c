/* A Llama-family decoder stack in one call, float32, on the CPU: every layer's norms, projections,
 * attention block and SwiGLU for a step's rows, then the final norm.
 *
 * Launcher in kernels/cpu_stack.py. A decode step of the default model makes ~240 calls from
 * Python to the C kernels (four products, two norms, the attention block and SiLU-and-mul a layer,
 * 30 layers), each paying Python's dispatch, argument checks and a fresh output tensor: at batch 1
 * that costs about as much as the kernels' own work. Here the same kernels (cpu_gemm.c,
 * cpu_decode.c) run in the same order on the same inputs, so the result is bit for bit what the
 * layer-by-layer path computes (tests/kernels/test_cpu_stack.py compares), each row on its own.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* cpu_gemm.c */
void gemm_f32(const float *x, long rows, long k_len, const float *packed, long n_out, float *y);
int gemm_i8(const float *x, long rows, long k_len, const int8_t *packed, const float *scales, long n_out, float *y);
int gemm_w8a8(const float *x, long rows, long k_len, const void *packed, const float *scales, long n_out,
              float *y);
int gemm_q4(const float *x, long rows, long k_len, const uint8_t *packed, long group, long n_out, float *y);
int gemm_q4h(const float *x, long rows, long k_len, const uint8_t *packed, long group, long n_out, float *y);
/* cpu_decode.c */
void add_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps, long rows, long dim,
                      float *out, float *residual_out);
void silu_and_mul_f32(const float *x, long rows, long d, float *out);
int decode_attention_f32(const float *qkv, long rows, long heads, long kv_heads, long head_dim,
                         const int64_t *positions, long max_positions, const float *cos, const float *sin,
                         float *k_cache, float *v_cache, long block_size, const int64_t *slots,
                         const int32_t *block_tables, long table_width, const int32_t *context_lens,
                         long max_context, float scale, float *out);

/* kernels/cpu_gemm.py's PanelProduct kinds */
enum { STACK_F32 = 0, STACK_I8 = 1, STACK_W8A8 = 2, STACK_Q4 = 3, STACK_Q4H = 4 };

/* One projection's packed weight: y (rows, n) = x (rows, k) @ w.T (+ bias). */
typedef struct {
    long kind;
    const void *packed;
    const float *scales; /* int8, w8a8: per-column scales padded to the panels; else NULL */
    long group;          /* int4 (float32 or float16 scales): inputs a group; else 0 */
    long k, n;
    const float *bias; /* (n,) or NULL */
} StackProjection;

typedef struct {
    const float *input_norm, *post_norm; /* (hidden,) */
    StackProjection qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* (num_blocks, block_size, kv_heads, head_dim) */
} StackLayer;

typedef struct {
    long num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale; /* the norms' epsilon; the attention's softmax scale */
    const float *final_norm;
    long max_positions; /* rows of the rotary tables */
    const float *cos, *sin;
    long block_size;
} StackModel;

/* y = x @ w.T (+ bias); 0, or the product's failure (-1: no memory, -2: refused). */
static int project(const StackProjection *p, const float *x, long rows, float *y) {
    int failed = 0;
    switch (p->kind) {
    case STACK_F32: gemm_f32(x, rows, p->k, p->packed, p->n, y); break;
    case STACK_I8: failed = gemm_i8(x, rows, p->k, p->packed, p->scales, p->n, y); break;
    case STACK_W8A8: failed = gemm_w8a8(x, rows, p->k, p->packed, p->scales, p->n, y); break;
    case STACK_Q4: failed = gemm_q4(x, rows, p->k, p->packed, p->group, p->n, y); break;
    case STACK_Q4H: failed = gemm_q4h(x, rows, p->k, p->packed, p->group, p->n, y); break;
    default: return -2;
    }
    if (failed || p->bias == NULL) return failed;
    for (long r = 0; r < rows; r++)
        for (long j = 0; j < p->n; j++) y[r * p->n + j] += p->bias[j];
    return 0;
}

/* h (rows, hidden): in, the rows' embeddings; out (rows, hidden): the final norm of the last layer's
 * residual stream (what the model's forward returns). The rows' positions, slots, block tables,
 * context lengths and max_context are the attention block's (decode_attention_f32), the same for
 * every layer. h is overwritten (the stream's scratch). Returns 0; -1 when scratch memory or a
 * kernel's cannot be allocated; -2 when a product refuses its shapes (checked when bound). */
int decode_stack_f32(const StackModel *m, const StackLayer *layers, long rows, float *h, const int64_t *positions,
                     const int64_t *slots, const int32_t *block_tables, long table_width,
                     const int32_t *context_lens, long max_context, float *out) {
    long hidden = m->hidden, q_size = m->heads * m->head_dim;
    long qkv_width = q_size + 2 * m->kv_heads * m->head_dim, inter = m->intermediate;
    /* the residual stream, the normed input, the QKV projection, the attention output, gate/up, SiLU */
    size_t floats = (size_t)rows * (2 * hidden + qkv_width + q_size + 3 * inter);
    float *residual = malloc(floats * sizeof(float));
    if (residual == NULL) return -1;
    float *x = residual + rows * hidden, *qkv = x + rows * hidden, *attn = qkv + rows * qkv_width;
    float *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * inter;
    int failed = 0;
    for (long l = 0; l < m->num_layers && !failed; l++) {
        const StackLayer *layer = layers + l;
        if (l == 0) { /* the embeddings are the residual stream */
            memcpy(residual, h, (size_t)(rows * hidden) * sizeof(float));
            add_rms_norm_f32(h, NULL, layer->input_norm, m->eps, rows, hidden, x, NULL);
        } else {
            add_rms_norm_f32(h, residual, layer->input_norm, m->eps, rows, hidden, x, residual);
        }
        if ((failed = project(&layer->qkv, x, rows, qkv))) break;
        failed = decode_attention_f32(qkv, rows, m->heads, m->kv_heads, m->head_dim, positions, m->max_positions,
                                      m->cos, m->sin, layer->k_cache, layer->v_cache, m->block_size, slots,
                                      block_tables, table_width, context_lens, max_context, m->scale, attn);
        if (failed || (failed = project(&layer->o, attn, rows, h))) break;
        add_rms_norm_f32(h, residual, layer->post_norm, m->eps, rows, hidden, x, residual);
        if ((failed = project(&layer->gate_up, x, rows, gate_up))) break;
        silu_and_mul_f32(gate_up, rows, inter, act);
        failed = project(&layer->down, act, rows, h);
    }
    if (!failed) add_rms_norm_f32(h, residual, m->final_norm, m->eps, rows, hidden, out, residual);
    free(residual);
    return failed;
}
