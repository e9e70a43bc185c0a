/* 16-lane float vectors (GCC vector extensions: AVX-512 where the CPU has it, two AVX2 halves or
 * scalar code elsewhere) shared by cpu_gemv.c and cpu_decode.c. */
#ifndef SWITCHBOARD_CPU_VEC_H
#define SWITCHBOARD_CPU_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat16(float x) { return (v16){0} + x; }

/* The lanes summed in a fixed order: halves folded 16 -> 8 -> 4 -> 2 -> 1. */
static inline float fold16(v16 v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v); /* the same halving tree, in registers */
#else
    float a[16];
    memcpy(a, &v, sizeof a);
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] += a[i + width];
    return a[0];
#endif
}

#endif
