/* A decode query's attention over its sequence's cached keys and values, shared by
 * tinygpt/csrc/cpu_gemv.c (a step's layers in one call: tg_layer) and tinygpt/csrc/cpu_gemm.c
 * (the engine's batched step: tg_paged_attention).
 *
 * attend_group is the whole of it for the query heads that share one kv head: scores against
 * every cached key, softmax, the weighted sum of the values. The heads of a group are done
 * together, so each key and value row is read from the cache (and widened from bfloat16)
 * once for all of them, and for head_dim 32, 64 or 128 the sums stay in vector registers
 * (GCC's and Clang's vector extensions, as wide as the CPU's registers: vec.h). Three things
 * set a long context's speed, measured on SmolLM2 (9 heads, 3 kv heads, head_dim 64): a dot
 * product whose 16 lanes were added one after another (16 dependent additions per key: now a
 * tree, 4 deep), an exponential the compiler could not vectorize (a branch: now a select),
 * and the values' sums going through memory at every position (now registers, each value row
 * loaded once for the group).
 */
#ifndef TINYGPT_ATTENTION_H
#define TINYGPT_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"      /* vf: VW floats, the registers' width; VPT of them per 16 floats */

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a cache row of hd values, float32 or bfloat16, as float32 */
static inline void cache_row(const void *cache, long at, int bf16, float *out, long hd) {
    if (!bf16) {
        memcpy(out, (const float *)cache + at, hd * sizeof(float));
        return;
    }
    const uint16_t *row = (const uint16_t *)cache + at;
#pragma omp simd
    for (long i = 0; i < hd; i++) out[i] = bf16_to_float(row[i]);
}

/* e^x for x <= 0 (softmax weights after subtracting the maximum), within 3e-7 of expf
 * (relative), written so that the compiler vectorizes a loop of them (expf stays scalar: one
 * per cached position per head, most of attention's time on a small model's long context).
 * x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so n ln 2 is exact enough),
 * e^r by its Taylor polynomial of degree 6, times 2^n built in the exponent bits; below
 * -87 the result (under e^-87, about 1.6e-38) is taken as 0. */
static inline float exp_nonpositive(float x) {
    int under = x < -87.0f;
    x = under ? -87.0f : x;                    /* no branch: the loop stays vectorized */
    float n = __builtin_rintf(x * 1.44269504f);      /* to nearest: vroundps, not a call */
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f
              + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return under ? 0.0f : p * scale;
}

/* Where the cache keeps a sequence's keys and values. Its positions are grouped in blocks of
 * `block`: position t is entry t % block of block number table[t / block], and kv head g of
 * block n starts at ((n * kv_heads + g) * block) * hd. The plain cache (cache_batch, kv_heads,
 * max_len, hd) is the case block = max_len, one entry per table (the sequence's index); the
 * engine's paged pool (blocks, kv_heads, block_size, hd) is the general case. */
static inline long cache_at(const long *table, long block, long kv_heads, long g, long t,
                            long hd) {
    return ((table[t / block] * kv_heads + g) * block + t % block) * hd;
}

typedef float vec4 __attribute__((vector_size(16)));

/* a . b over nv * 16 floats (nv a constant once inlined): 16 lanes, lane l summing the
 * products at l, l + 16, ..., then the lanes added as a tree, in registers (4 additions deep
 * instead of 16 in a row: a compiler may not reorder a reduction itself). The 16 lanes are
 * VPT vectors (vec.h); the tree is the same on every width: lanes i and i + 8, then i and
 * i + 4, then 0 + 2 and 1 + 3. */
static inline __attribute__((always_inline)) float dot_by16(int nv, const float *a,
                                                             const float *b) {
    vf acc[VPT];
    for (int s = 0; s < VPT; s++) acc[s] = (vf){0};
    for (int k = 0; k < nv; k++)
        for (int s = 0; s < VPT; s++)
            acc[s] += loadv(a + 16 * k + VW * s) * loadv(b + 16 * k + VW * s);
#if VW == 16
    typedef float vec8 __attribute__((vector_size(32)));
    vec8 s8 = (vec8){acc[0][0], acc[0][1], acc[0][2], acc[0][3], acc[0][4], acc[0][5],
                     acc[0][6], acc[0][7]}
              + (vec8){acc[0][8], acc[0][9], acc[0][10], acc[0][11], acc[0][12], acc[0][13],
                       acc[0][14], acc[0][15]};
    vec4 s4 = (vec4){s8[0], s8[1], s8[2], s8[3]} + (vec4){s8[4], s8[5], s8[6], s8[7]};
#elif VW == 8
    vf s8 = acc[0] + acc[1];
    vec4 s4 = (vec4){s8[0], s8[1], s8[2], s8[3]} + (vec4){s8[4], s8[5], s8[6], s8[7]};
#else
    vec4 s4 = (acc[0] + acc[2]) + (acc[1] + acc[3]);
#endif
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* a . b over n floats */
static inline float dot(const float *a, const float *b, long n) {
    switch (n) {
    case 32: return dot_by16(2, a, b);
    case 64: return dot_by16(4, a, b);
    case 128: return dot_by16(8, a, b);
    }
    float s = 0;
    for (long c = 0; c < n; c++) s += a[c] * b[c];
    return s;
}

/* running sums a block of weigh_values keeps in registers: half the registers (32 with
 * AVX-512, 16 otherwise), the rest for a value row's vectors */
#define ACC_VECS (VW == 16 ? 16 : 8)

/* The attention-weighted values of nh query heads that share kv head g, columns c0 ..
 * c0 + nv * VW - 1 of each: out + j * hd + c = sum over t of weights[j * span + t] *
 * inv_total[j] * value t [c], the values at positions 0 .. span - 1 in cache order. nv and nh
 * are constants once inlined, so the nh * nv accumulators stay in registers, and each value
 * row is loaded (and widened from bfloat16) once for the nh heads. Each lane adds in position
 * order, as weigh_values' plain loop does. */
static inline __attribute__((always_inline)) void
weigh_values_block(int nv, int nh, long c0, float *out, const float *weights,
                   const float *inv_total, const void *vc, int bf16, const long *table,
                   long block, long kv_heads, long g, long span, long hd, float *row) {
    vf acc[4][ACC_VECS];
    for (int j = 0; j < nh; j++)
        for (int k = 0; k < nv; k++) acc[j][k] = (vf){0};
    for (long t0 = 0; t0 < span; t0 += block) {
        long base = cache_at(table, block, kv_heads, g, t0, hd);
        long n = span - t0 < block ? span - t0 : block;
        for (long i = 0; i < n; i++) {
            const float *value = (const float *)vc + base + i * hd;
            if (bf16) {
                cache_row(vc, base + i * hd, bf16, row, hd);
                value = row;
            }
            vf v[ACC_VECS];
            for (int k = 0; k < nv; k++) v[k] = loadv(value + c0 + VW * k);
            for (int j = 0; j < nh; j++) {
                float p = weights[j * span + t0 + i] * inv_total[j];
                for (int k = 0; k < nv; k++) acc[j][k] += p * v[k];
            }
        }
    }
    for (int j = 0; j < nh; j++)
        for (int k = 0; k < nv; k++) storev(out + j * hd + c0 + VW * k, acc[j][k]);
}

#define WEIGH(nv, nh)                                                                        \
    for (long c0 = 0; c0 < hd; c0 += (nv) * VW)                                              \
        weigh_values_block(nv, nh, c0, out + j * hd, weights + j * span, inv_total + j, vc,  \
                           bf16, table, block, kv_heads, g, span, hd, row)

/* every head of the group, head_dim HD (a constant), in blocks of NH heads by windows of NV
 * vectors: a head's HD / VW vectors if they fit in ACC_VECS, up to 4 heads as far as they fit;
 * AVX-512 at head_dim 64: 4 heads x 4 vectors, AVX2: 1 head x 8 vectors */
#define WEIGH_HEADS(HD)                                                                      \
    do {                                                                                     \
        enum { NVH = (HD) / VW, NV = NVH < ACC_VECS ? NVH : ACC_VECS,                        \
               NH = ACC_VECS / NV < 4 ? ACC_VECS / NV : 4 };                                 \
        for (; j + NH <= count; j += NH) WEIGH(NV, NH);                                      \
        switch (count - j) {                                                                 \
        case 3: WEIGH(NV, 3); break;                                                         \
        case 2: WEIGH(NV, 2); break;                                                         \
        case 1: WEIGH(NV, 1); break;                                                         \
        }                                                                                    \
    } while (0)

/* the same for `count` heads and any head_dim: in register blocks (WEIGH_HEADS) where
 * head_dim is 32, 64 or 128, otherwise head by head in out itself */
static void weigh_values(float *out, long count, const float *weights, const float *inv_total,
                         const void *vc, int bf16, const long *table, long block,
                         long kv_heads, long g, long span, long hd, float *row) {
    long j = 0;
    switch (hd) {
    case 32: WEIGH_HEADS(32); return;
    case 64: WEIGH_HEADS(64); return;
    case 128: WEIGH_HEADS(128); return;
    }
    for (; j < count; j++) {
        float *o = out + j * hd;
        for (long c = 0; c < hd; c++) o[c] = 0;
        for (long t0 = 0; t0 < span; t0 += block) {
            long base = cache_at(table, block, kv_heads, g, t0, hd);
            long n = span - t0 < block ? span - t0 : block;
            for (long i = 0; i < n; i++) {
                float p = weights[j * span + t0 + i] * inv_total[j];
                const float *value = (const float *)vc + base + i * hd;
                if (bf16) {
                    cache_row(vc, base + i * hd, bf16, row, hd);
                    value = row;
                }
#pragma omp simd
                for (long c = 0; c < hd; c++) o[c] += p * value[c];
            }
        }
    }
}

#undef WEIGH
#undef WEIGH_HEADS

/* out (group, hd) = softmax(q k^T * scale) v for the `group` query heads q (group, hd) that
 * share kv head g, over the sequence's positions 0 .. span - 1 (table, block: cache_at), the
 * cache float32 or (bf16) bfloat16; scores: group * span floats of scratch. Per head: the
 * scaled dot products in position order, their maximum subtracted, exp_nonpositive, each
 * weight times 1 / their sum, the values summed lane by lane in position order. */
static void attend_group(const float *q, long group, const void *kc, const void *vc, int bf16,
                         const long *table, long block, long kv_heads, long g, long span,
                         long hd, float scale, float *scores, float *out) {
    float row[hd], top[group], inv_total[group];
    for (long j = 0; j < group; j++) top[j] = -INFINITY;
    for (long t0 = 0; t0 < span; t0 += block) {
        long base = cache_at(table, block, kv_heads, g, t0, hd);
        long n = span - t0 < block ? span - t0 : block;
        for (long i = 0; i < n; i++) {
            const float *key = (const float *)kc + base + i * hd;     /* float32: in place */
            if (bf16) {
                cache_row(kc, base + i * hd, bf16, row, hd);
                key = row;
            }
            for (long j = 0; j < group; j++) {
                float s = dot(q + j * hd, key, hd) * scale;
                scores[j * span + t0 + i] = s;
                top[j] = s > top[j] ? s : top[j];
            }
        }
    }
    for (long j = 0; j < group; j++) {
        float *sj = scores + j * span, sum = 0, topj = top[j];
#pragma omp simd reduction(+ : sum)
        for (long t = 0; t < span; t++) {
            sj[t] = exp_nonpositive(sj[t] - topj);
            sum += sj[t];
        }
        inv_total[j] = 1.0f / sum;
    }
    weigh_values(out, group, scores, inv_total, vc, bf16, table, block, kv_heads, g, span, hd,
                 row);
}

/* the most scores a unit keeps on its thread's stack (64 KiB); more go to the heap: the pool's
 * helpers have the default stack (the stack limit, often 8 MiB; glibc's 2 MiB where it is
 * unlimited), and a 128k-position context with groups of 4 needs 2 MiB of scores */
#define STACK_SCORES 16384

/* attend_group with its scores on the calling thread's stack (a fixed array) while they fit,
 * in a heap buffer of the call's own beyond: what one unit of the pool's attention runs
 * (cpu_gemm.c's paged attention, cpu_gemv.c's layers beyond MAX_ROWS rows). Returns 0, or -1
 * (nothing computed) when that buffer could not be allocated. */
static int attend_group_unit(const float *q, long group, const void *kc, const void *vc,
                             int bf16, const long *table, long block, long kv_heads, long g,
                             long span, long hd, float scale, float *out) {
    float stack[STACK_SCORES];
    float *scores = stack;
    if (span * group > STACK_SCORES
            && (scores = (float *)malloc(sizeof(float) * span * group)) == NULL)
        return -1;
    attend_group(q, group, kc, vc, bf16, table, block, kv_heads, g, span, hd, scale, scores,
                 out);
    if (scores != stack) free(scores);
    return 0;
}

#endif
