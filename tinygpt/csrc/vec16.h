/* A 16-float vector (one tile row of tinygpt's tiled weights) in GCC's vector extensions:
 * one AVX-512 register where the CPU has AVX-512, two or four narrower ones elsewhere, so the
 * kernels that use it stay portable. Loads and stores go through memcpy (no alignment
 * needed). Shared by cpu_gemv.c and cpu_gemm.c. */
#ifndef TINYGPT_VEC16_H
#define TINYGPT_VEC16_H

#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

#endif
