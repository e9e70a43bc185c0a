/* Float vectors of the CPU's own width (GCC vector extensions): VL = 16 lanes (AVX-512) or 8
 * (AVX2 and others; GCC splits a vector wider than the registers into slow piecewise code), shared
 * by the fused decode kernels (cpu_decode.c). */
#ifndef SWITCHBOARD_CPU_VEC_H
#define SWITCHBOARD_CPU_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splatv(float x) { return (vf){0} + x; }

/* The lanes summed in a fixed order: halves folded VL -> VL / 2 -> ... -> 1. */
static inline float foldv(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v); /* the same halving tree, in registers */
#elif defined(__AVX2__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float a[VL];
    memcpy(a, &v, sizeof a);
    for (int width = VL / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] += a[i + width];
    return a[0];
#endif
}

#endif
