/* tinygpt's CPU products for decode: y (M, N) = x (M, K) @ W^T, W (N, K), M small.
 *
 * At batch 1 a product reads every weight once and does two flops with it, so its speed is
 * the speed the weights stream from memory. Two things get this close to the machine's
 * bandwidth where torch's kernels fall short on 1-4 MB matrices:
 *
 *   the layout   W is stored in tiles of 16 rows: tile t holds, for k = 0 .. K-1, the 16
 *                weights W[16t .. 16t+15, k] next to each other ((N/16, K, 16) in memory).
 *                A tile is one sequential stream; each step of k is one 16-wide fused
 *                multiply-add of 16 weights by the broadcast x[k] into 16 running sums, and
 *                no horizontal sums are needed at the end. (bfloat16 tiles hold two
 *                columns per step: see "bfloat16 weights" below.)
 *   the threads  every product is split across the cores by tiles. The split must cost far
 *                less than a product (40-120 us on the AVX-512 EPYC, 2026-11-25), so the
 *                helper threads are started once and spin between products (briefly: then
 *                they sleep). The thread that calls takes work too, and work is handed out by
 *                an atomic counter, so a helper that the operating system has not scheduled (a
 *                busy machine) makes a product no slower than one core would; it never waits
 *                for a helper that took nothing.
 *                When the caller keeps waiting for chunks a helper took and then lost its
 *                core, the pool runs alone for a while (pool.h says how).
 *
 * Weights come as float32, bfloat16 (16-bit: the top half of a float32, widened by a shift),
 * llama.cpp's Q8_0 blocks (8-bit integers, one float16 scale per row and block of 32 columns)
 * or its Q4_1 blocks (4-bit integers with a float16 scale and minimum per block). x and y are
 * float32. fp32 sums in float32 (the compiler vectorizes the 16-wide loops with
 * -O3 -march=native); bf16 widens the weights to float32, or, built for a CPU with
 * avx512_bf16, rounds x to bfloat16 and multiplies with VDPBF16PS (see "bfloat16 weights"
 * below), float32 sums either way; Q8_0 and Q4_1 quantize x to 8 bits per block of 32 and sum
 * in integers (AVX-512 VNNI where the CPU has it, else AVX2; see "integer dot products"
 * below). Built and loaded by tinygpt/cpu_kernels.py.
 *
 * float32 products of more than MAX_ROWS rows (the engine's decode steps of 5 or more
 * sequences, through the decode layers below) run cpu_gemm.c's register-blocked tiles
 * (gemm_tiles.h), whose sums go in the same order: a row's outputs have the same bits however
 * many rows are multiplied with it.
 */
#define _GNU_SOURCE             /* pthread_setname_np */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"                /* the helper threads (POOL_* are its tuning knobs) */
#include "attention.h"           /* a decode query's attention over a (paged) cache */
#include "vec.h"                 /* vf: VW floats, the registers' width; loadv, storev */

#define TILE 16
#define MAX_ROWS 4      /* rows of x per product (float32: any number, beyond these the gemm's) */
#include "gemm_tiles.h"          /* float32 products of many rows: tiles_range, gemm_chunk */

/* fn(..., rows) with rows a constant 1 .. MAX_ROWS, so each case compiles its own loop */
#define ROWS_SWITCH(fn, ...)                                                                  \
    switch (m_rows) {                                                                         \
        case 1: fn(__VA_ARGS__, 1); break;                                                    \
        case 2: fn(__VA_ARGS__, 2); break;                                                    \
        case 3: fn(__VA_ARGS__, 3); break;                                                    \
        default: fn(__VA_ARGS__, 4); break;                                                   \
    }

/* 1: the products run their plain loops instead of the fast ones (float32: row by row instead
 * of f32_rows; Q8_0 and Q4_1: the portable integer loops instead of VNNI); the tests compare
 * the two */
static int portable;

int tg_use_portable(int on) {
    int before = portable;
    portable = on != 0;
    return before;
}

/* float32 weights. The portable loop below runs row by row: per row two chains of running
 * sums (even and odd columns), each multiply-add waiting on the one before it, so a row runs
 * at the multiply-add's latency, not its throughput. At one row that is faster than the
 * weights arrive from memory; at 2-4 rows (a few sequences decoding together, speculative
 * decoding's verify pass) the rows' chains one after another made a product of 4 rows cost
 * 3.5x one row from the cache (AVX-512 EPYC, 2026-11-28). f32_rows loads each pair of weight
 * vectors once for all rows and runs every row's two chains side by side (up to 8 independent
 * chains; vectors as wide as the registers, vec.h, so it compiles for any CPU). Each row's sums
 * are the portable loop's, in the same order (even columns into one sum, odd into the other,
 * added at the end; multiply-adds fused or not as the compiler fuses both), so the two give
 * the same bits and a row's result does not depend on how many rows share the product. */
static inline __attribute__((always_inline)) void f32_rows(
        const float *w, const float *x, float *y, long n, long k, long t0, long t1,
        const int rows) {
    /* a tile row's VPT vectors in one pass while its running sums (two per row and vector)
     * fit in registers with room to spare, else one vector per pass over the tile */
    const int per_pass = rows * VPT <= 4 ? VPT : 1;
    for (long t = t0; t < t1; t++) {
        const float *wt = w + t * k * TILE;
        for (int s0 = 0; s0 < VPT; s0 += per_pass) {
            vf a0[MAX_ROWS][VPT], a1[MAX_ROWS][VPT];
            for (int r = 0; r < rows; r++)
                for (int s = 0; s < per_pass; s++) a0[r][s] = a1[r][s] = (vf){0};
            long j = 0;
            for (; j + 2 <= k; j += 2) {
                vf w0[VPT], w1[VPT];
                for (int s = 0; s < per_pass; s++) {
                    w0[s] = loadv(wt + j * TILE + (s0 + s) * VW);
                    w1[s] = loadv(wt + (j + 1) * TILE + (s0 + s) * VW);
                }
                for (int r = 0; r < rows; r++) {
                    float x0 = x[r * k + j], x1 = x[r * k + j + 1];
                    for (int s = 0; s < per_pass; s++) {
                        a0[r][s] += w0[s] * x0;
                        a1[r][s] += w1[s] * x1;
                    }
                }
            }
            if (j < k)
                for (int s = 0; s < per_pass; s++) {
                    vf w0 = loadv(wt + j * TILE + (s0 + s) * VW);
                    for (int r = 0; r < rows; r++) a0[r][s] += w0 * x[r * k + j];
                }
            for (int r = 0; r < rows; r++)
                for (int s = 0; s < per_pass; s++)
                    storev(y + r * n + t * TILE + (s0 + s) * VW, a0[r][s] + a1[r][s]);
        }
    }
}

/* tiles [t0, t1) of one product, for all M rows of x */
static void tiles_f32(const float *w, const float *x, float *y, long m_rows, long n, long k,
                      long t0, long t1) {
    if (!portable) {
        ROWS_SWITCH(f32_rows, w, x, y, n, k, t0, t1)
        return;
    }
    for (long t = t0; t < t1; t++) {
        const float *wt = w + t * k * TILE;
        for (long m = 0; m < m_rows; m++) {
            const float *xm = x + m * k;
            float a0[TILE] = {0}, a1[TILE] = {0};
            long j = 0;
            for (; j + 2 <= k; j += 2) {
                const float *w0 = wt + j * TILE, *w1 = w0 + TILE;
                float x0 = xm[j], x1 = xm[j + 1];
#pragma omp simd
                for (int i = 0; i < TILE; i++) {
                    a0[i] += w0[i] * x0;
                    a1[i] += w1[i] * x1;
                }
            }
            for (; j < k; j++) {
                const float *w0 = wt + j * TILE;
                float x0 = xm[j];
#pragma omp simd
                for (int i = 0; i < TILE; i++) a0[i] += w0[i] * x0;
            }
            float *ym = y + m * n + t * TILE;
#pragma omp simd
            for (int i = 0; i < TILE; i++) ym[i] = a0[i] + a1[i];
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* bfloat16 weights: widened to float32, or multiplied as bfloat16 by VDPBF16PS              */
/*
 * A bfloat16 tile stores its weights by pairs of columns: for columns (2p, 2p+1) the 16 rows'
 * two weights side by side, row i's pair in 32-bit lane i (W[i][2p] in the low half, W[i][2p+1]
 * in the high half; an odd K is padded with a zero column). One 64-byte load then holds two
 * columns of the tile, in the shape both paths below want:
 *
 *   widened      (any CPU) the low halves shifted up 16 bits are column 2p as float32, the
 *                lanes with their low halves cleared are column 2p+1: one shift, one and, two
 *                float32 multiply-adds by x[2p] and x[2p+1]. Each product (bfloat16 weight
 *                times float32 x) is exact inside its fused multiply-add, which rounds only
 *                the sum (a build without FMA, such as -mno-avx, rounds the product too); the
 *                sums float32: even columns into one set of running sums, odd into another,
 *                added at the end (the float32 tiles' order).
 *   dot          (compiled where the compiler targets avx512_bf16: -march=native on a CPU with
 *                the flag) VDPBF16PS multiplies 32 bfloat16 values (16 pairs) by 32 others and
 *                adds each lane's two products into its float32 sum: one instruction per pair
 *                of columns. Its operands are both bfloat16, so x is rounded to bfloat16 first
 *                (to nearest, ties to even, as torch's x.bfloat16() does), once per product by
 *                the calling thread, and (x[2p], x[2p+1]) is broadcast to every lane. The
 *                products of two bfloat16 values are exact in float32; the sums float32 (pairs
 *                0, 1, 2, 3 mod 4 in four sets of running sums, added at the end); the
 *                instruction treats subnormal inputs and results as zero (below 1.2e-38:
 *                nothing a model's sums can see). So the result is
 *                F.linear(x.bfloat16().float(), W) up to the order of the float32 sums: a
 *                bfloat16 model's own forward rounds x the same way.
 *
 * tg_bf16_path() says which one the library was built with (0 widened, 1 dot).
 */
static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 bits, to nearest with ties to even (torch's rounding); a NaN becomes
 * the quiet NaN 0x7fc0 (as c10::BFloat16 converts one value; torch's vectorized conversion
 * writes 0xffff, a NaN too), never the infinity or zero that rounding its bits can give: x for
 * the dot path, and a bfloat16 cache's rows (store_row) */
static inline uint32_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

static __attribute__((unused)) void tiles_bf16_widened(
        const uint32_t *w, const float *x, float *y, long m_rows, long n, long k, long t0,
        long t1) {
    long pairs = (k + 1) / 2;
    for (long t = t0; t < t1; t++) {
        const uint32_t *wt = w + t * pairs * TILE;
        for (long m = 0; m < m_rows; m++) {
            const float *xm = x + m * k;
            float a0[TILE] = {0}, a1[TILE] = {0};
            for (long p = 0; p < k / 2; p++) {
                const uint32_t *wp = wt + p * TILE;
                float x0 = xm[2 * p], x1 = xm[2 * p + 1];
#pragma omp simd
                for (int i = 0; i < TILE; i++) {
                    a0[i] += bits_to_float(wp[i] << 16) * x0;
                    a1[i] += bits_to_float(wp[i] & 0xffff0000u) * x1;
                }
            }
            if (k & 1) {
                const uint32_t *wp = wt + (pairs - 1) * TILE;
                float x0 = xm[k - 1];
#pragma omp simd
                for (int i = 0; i < TILE; i++) a0[i] += bits_to_float(wp[i] << 16) * x0;
            }
            float *ym = y + m * n + t * TILE;
#pragma omp simd
            for (int i = 0; i < TILE; i++) ym[i] = a0[i] + a1[i];
        }
    }
}

/* The widened loop prefetches the line BF16_AHEAD pairs of columns (64 bytes each) ahead of
 * the one it reads. SmolLM2's 30 layers' products and its head at one row (270 MB), two
 * threads, medians of 15 runs taking turns, the AVX2 EPYC, 2026-11-29: 16.2-16.7 ms without,
 * 15.1-15.3 with 16 lines ahead (8: 15.7, 12: 15.5, 24: 15.6, 32: 16.6). The same in f32_rows
 * made the float32 products slower (29.9 -> 31.8-33.5 ms): the hardware's prefetchers keep
 * up with a stream that has less arithmetic per byte. */
#ifndef BF16_AHEAD
#define BF16_AHEAD 16
#endif

/* the widened loop with every row's sums side by side, as f32_rows does for float32 (the
 * same sums in the same order as tiles_bf16_widened, so the same bits): where the build has
 * no VDPBF16PS (an AVX2 CPU, or one whose avx512_bf16 the build leaves out) */
static inline __attribute__((always_inline, unused)) void bf16_widened_rows(
        const uint32_t *w, const float *x, float *y, long n, long k, long t0, long t1,
        const int rows) {
    long pairs = (k + 1) / 2;
    const int per_pass = rows * VPT <= 4 ? VPT : 1;
    for (long t = t0; t < t1; t++) {
        const uint32_t *wt = w + t * pairs * TILE;
        for (int s0 = 0; s0 < VPT; s0 += per_pass) {
            vf a0[MAX_ROWS][VPT], a1[MAX_ROWS][VPT];
            for (int r = 0; r < rows; r++)
                for (int s = 0; s < per_pass; s++) a0[r][s] = a1[r][s] = (vf){0};
            for (long p = 0; p < k / 2; p++) {
                vf w0[VPT], w1[VPT];
                __builtin_prefetch(wt + (p + BF16_AHEAD) * TILE, 0, 0);   /* see BF16_AHEAD */
                for (int s = 0; s < per_pass; s++) {
                    vu pair = loadu(wt + p * TILE + (s0 + s) * VW);
                    w0[s] = (vf)(pair << 16);              /* column 2p as float32 */
                    w1[s] = (vf)(pair & 0xffff0000u);      /* column 2p + 1 */
                }
                for (int r = 0; r < rows; r++) {
                    float x0 = x[r * k + 2 * p], x1 = x[r * k + 2 * p + 1];
                    for (int s = 0; s < per_pass; s++) {
                        a0[r][s] += w0[s] * x0;
                        a1[r][s] += w1[s] * x1;
                    }
                }
            }
            if (k & 1)
                for (int s = 0; s < per_pass; s++) {
                    vf w0 = (vf)(loadu(wt + (pairs - 1) * TILE + (s0 + s) * VW) << 16);
                    for (int r = 0; r < rows; r++) a0[r][s] += w0 * x[r * k + k - 1];
                }
            for (int r = 0; r < rows; r++)
                for (int s = 0; s < per_pass; s++)
                    storev(y + r * n + t * TILE + (s0 + s) * VW, a0[r][s] + a1[r][s]);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1

/* x rounded to bfloat16, (m, pairs) 32-bit pairs (an odd K's last pair padded with zero),
 * written by the calling thread before the helpers start */
static uint32_t *xbf_buf;
static long xbf_capacity;

/* 0 on success, -1 when the buffer could not grow */
static int round_x_bf16(const float *x, long m, long k) {
    long pairs = (k + 1) / 2;
    if (m * pairs > xbf_capacity) {
        uint32_t *grown = realloc(xbf_buf, m * pairs * sizeof(uint32_t));
        if (grown == NULL) return -1;
        xbf_buf = grown;
        xbf_capacity = m * pairs;
    }
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * k;
        uint32_t *out = xbf_buf + r * pairs;
        for (long p = 0; p < k / 2; p++)
            out[p] = float_to_bf16(xr[2 * p]) | float_to_bf16(xr[2 * p + 1]) << 16;
        if (k & 1) out[pairs - 1] = float_to_bf16(xr[k - 1]);
    }
    return 0;
}

/* rows is a constant in each caller (always inlined), so the sums stay in registers: four
 * sets per row (pairs p = 0, 1, 2, 3 mod 4), so that four VDPBF16PS per row are in flight
 * (one chain of sums would wait out the instruction's latency at every step) */
#define DOT_SETS 4
static inline __attribute__((always_inline)) void bf16_dot(
        const uint32_t *w, float *y, long n, long k, long t0, long t1, const int rows) {
    long pairs = (k + 1) / 2;
    for (long t = t0; t < t1; t++) {
        const uint32_t *wt = w + t * pairs * TILE;
        __m512 acc[DOT_SETS][MAX_ROWS];
        for (int s = 0; s < DOT_SETS; s++)
            for (int r = 0; r < rows; r++) acc[s][r] = _mm512_setzero_ps();
        long p = 0;
        for (; p + DOT_SETS <= pairs; p += DOT_SETS)
            for (int s = 0; s < DOT_SETS; s++) {
                __m512bh wv = (__m512bh)_mm512_loadu_si512(wt + (p + s) * TILE);
                for (int r = 0; r < rows; r++) {
                    int xp = (int)xbf_buf[r * pairs + p + s];
                    acc[s][r] = _mm512_dpbf16_ps(acc[s][r], wv, (__m512bh)_mm512_set1_epi32(xp));
                }
            }
        for (int s = 0; p < pairs; p++, s++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wt + p * TILE);
            for (int r = 0; r < rows; r++) {
                int xp = (int)xbf_buf[r * pairs + p];
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], wv, (__m512bh)_mm512_set1_epi32(xp));
            }
        }
        for (int r = 0; r < rows; r++)
            _mm512_storeu_ps(y + r * n + t * TILE,
                             _mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]),
                                           _mm512_add_ps(acc[2][r], acc[3][r])));
    }
}
#else
#define HAVE_BF16_DOT 0
#endif

static void tiles_bf16(const uint32_t *w, const float *x, float *y, long m_rows, long n,
                       long k, long t0, long t1) {
#if HAVE_BF16_DOT
    (void)x;
    ROWS_SWITCH(bf16_dot, w, y, n, k, t0, t1)
#else
    if (!portable) {
        ROWS_SWITCH(bf16_widened_rows, w, x, y, n, k, t0, t1)
        return;
    }
    tiles_bf16_widened(w, x, y, m_rows, n, k, t0, t1);
#endif
}

/* 1 when the bfloat16 products use VDPBF16PS (x rounded to bfloat16), 0 when they widen */
int tg_bf16_path(void) { return HAVE_BF16_DOT; }

/* ---------------------------------------------------------------------------------------- */
/* 8-bit and 4-bit weights: integer dot products                                             */
/*
 * For Q8_0 and Q4_1 weights the activation x is quantized too, once per product, to 8 bits
 * per block of 32 values (one float scale per block, llama.cpp's Q8_0 / Q8_1 shape for the
 * activation): xd = max |x| / 127, xq = round(x * (1 / xd)), half to even. A block of a row's
 * product is then a sum of 32 products of small integers, exact in int32, and the float scales
 * are applied once per block:
 *
 *   Q8_0   W = wd * wq            sum_j W_j x_j  ~  wd * xd * sum_j wq_j xq_j
 *   Q4_1   W = wd * wq + wm       sum_j W_j x_j  ~  wd * xd * sum_j wq_j xq_j + wm * xd * sum_j xq_j
 *
 * which is exactly the float product of the dequantized weights with the dequantized
 * activation xd * xq (up to float rounding): the only new error is x's 8-bit rounding, at most
 * xd / 2 per value. AVX-512 VNNI's vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes
 * and adds each group of 4 products into one of 16 int32 lanes: one lane per row of a tile,
 * so a tile's block stores, for each group of 4 columns, the 16 rows' 4 weights side by side
 * (64 bytes), and x's 4 bytes of that group are broadcast to every lane. vpdpbusd needs one
 * unsigned operand: Q4_1's 0..15 already is; Q8_0's weights are stored plus 128 (0..254) and
 * 128 * sum_j xq_j is subtracted from the block's sum.
 *
 * Layouts (per tile of 16 rows and block of 32 columns; row i, column j of the block):
 *   Q8_0  16 float16 wd, then 8 groups x 16 rows x 4 bytes: byte 64g + 4i + c = wq[i][4g+c] + 128
 *   Q4_1  16 float16 wd, 16 float16 wm, then 4 x 16 x 4 bytes: byte 64g + 4i + c holds
 *         wq[i][4g+c] in its low nibble and wq[i][16+4g+c] in its high one
 * The portable loops below compute the same integer sums without VNNI (any x86-64 compiler
 * with _Float16, for the scales: GCC 12 or Clang 15 and later), and so do the AVX2 loops
 * after the VNNI ones; tg_use_portable(1) selects the portable loops at run time (the tests
 * compare them).
 */
#define QBLOCK 32
#define Q8_BLOCK_BYTES (TILE * 2 + QBLOCK * TILE)
#define Q4_BLOCK_BYTES (TILE * 4 + QBLOCK / 2 * TILE)

static inline void halves_to_floats(const uint8_t *src, float *dst) {
    _Float16 h[TILE];
    memcpy(h, src, sizeof h);
#pragma omp simd
    for (int i = 0; i < TILE; i++) dst[i] = (float)h[i];
}

/* the activation of the current product, quantized by the calling thread before the helpers
 * start: xq (m, k) int8, xd and xs (m, k / 32): each block's scale and sum of xq */
static int8_t *xq_buf;
static float *xd_buf;
static int32_t *xs_buf;
static long x_capacity;

/* 0 on success, -1 when the buffers could not grow */
static int quantize_x(const float *x, long m, long k) {
    if (m * k > x_capacity) {
        long cap = m * k;
        int8_t *q = realloc(xq_buf, cap);
        if (q == NULL) return -1;
        xq_buf = q;
        float *d = realloc(xd_buf, cap / QBLOCK * sizeof(float));
        if (d == NULL) return -1;
        xd_buf = d;
        int32_t *s = realloc(xs_buf, cap / QBLOCK * sizeof(int32_t));
        if (s == NULL) return -1;
        xs_buf = s;
        x_capacity = cap;
    }
    for (long b = 0; b < m * k / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0;
        for (int j = 0; j < QBLOCK; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f, inv = d > 0 ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QBLOCK; j++) {
            int32_t q = (int32_t)nearbyintf(xb[j] * inv);
            xq_buf[b * QBLOCK + j] = (int8_t)q;
            sum += q;
        }
        xd_buf[b] = d;
        xs_buf[b] = sum;
    }
    return 0;
}

static void tiles_q8_portable(const uint8_t *w, float *y, long m_rows, long n, long k,
                              long t0, long t1) {
    long blocks = k / QBLOCK;
    for (long t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * blocks * Q8_BLOCK_BYTES;
        for (long r = 0; r < m_rows; r++) {
            float acc[TILE] = {0};
            for (long b = 0; b < blocks; b++) {
                const uint8_t *blk = wt + b * Q8_BLOCK_BYTES;
                const int8_t *xb = xq_buf + r * k + b * QBLOCK;
                float scale[TILE];
                halves_to_floats(blk, scale);
                int32_t dot[TILE] = {0};
                for (int g = 0; g < QBLOCK / 4; g++)
                    for (int i = 0; i < TILE; i++)
                        for (int c = 0; c < 4; c++)
                            dot[i] += (int32_t)blk[TILE * 2 + g * 64 + i * 4 + c]
                                      * xb[4 * g + c];
                float xd = xd_buf[r * blocks + b];
                int32_t shift = 128 * xs_buf[r * blocks + b];
                for (int i = 0; i < TILE; i++)
                    acc[i] += (float)(dot[i] - shift) * (scale[i] * xd);
            }
            memcpy(y + r * n + t * TILE, acc, sizeof acc);
        }
    }
}

static void tiles_q4_portable(const uint8_t *w, float *y, long m_rows, long n, long k,
                              long t0, long t1) {
    long blocks = k / QBLOCK;
    for (long t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * blocks * Q4_BLOCK_BYTES;
        for (long r = 0; r < m_rows; r++) {
            float acc[TILE] = {0};
            for (long b = 0; b < blocks; b++) {
                const uint8_t *blk = wt + b * Q4_BLOCK_BYTES;
                const int8_t *xb = xq_buf + r * k + b * QBLOCK;
                float d[TILE], mn[TILE];
                halves_to_floats(blk, d);
                halves_to_floats(blk + TILE * 2, mn);
                int32_t dot[TILE] = {0};
                for (int g = 0; g < QBLOCK / 8; g++)
                    for (int i = 0; i < TILE; i++)
                        for (int c = 0; c < 4; c++) {
                            uint8_t v = blk[TILE * 4 + g * 64 + i * 4 + c];
                            dot[i] += (v & 15) * xb[4 * g + c] + (v >> 4) * xb[16 + 4 * g + c];
                        }
                float xd = xd_buf[r * blocks + b];
                float xsum = xd * (float)xs_buf[r * blocks + b];
                for (int i = 0; i < TILE; i++)
                    acc[i] += (float)dot[i] * (d[i] * xd) + mn[i] * xsum;
            }
            memcpy(y + r * n + t * TILE, acc, sizeof acc);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1

/* rows is a constant in each caller (always inlined), so the accumulators stay registers */
static inline __attribute__((always_inline)) void q8_vnni(
        const uint8_t *w, float *y, long n, long k, long t0, long t1, const int rows) {
    long blocks = k / QBLOCK;
    for (long t = t0; t < t1; t++) {
        const uint8_t *blk = w + t * blocks * Q8_BLOCK_BYTES;
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (long b = 0; b < blocks; b++, blk += Q8_BLOCK_BYTES) {
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            __m512i dot[MAX_ROWS];
            for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
            for (int g = 0; g < QBLOCK / 4; g++) {
                __m512i wv = _mm512_loadu_si512(blk + TILE * 2 + g * 64);
                for (int r = 0; r < rows; r++) {
                    int32_t x4;
                    memcpy(&x4, xq_buf + r * k + b * QBLOCK + 4 * g, 4);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(x4));
                }
            }
            for (int r = 0; r < rows; r++) {
                __m512i fixed = _mm512_sub_epi32(dot[r],
                                                 _mm512_set1_epi32(128 * xs_buf[r * blocks + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fixed),
                                         _mm512_mul_ps(scale,
                                                       _mm512_set1_ps(xd_buf[r * blocks + b])),
                                         acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n + t * TILE, acc[r]);
    }
}

static inline __attribute__((always_inline)) void q4_vnni(
        const uint8_t *w, float *y, long n, long k, long t0, long t1, const int rows) {
    long blocks = k / QBLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    for (long t = t0; t < t1; t++) {
        const uint8_t *blk = w + t * blocks * Q4_BLOCK_BYTES;
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (long b = 0; b < blocks; b++, blk += Q4_BLOCK_BYTES) {
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + TILE * 2)));
            __m512i dot[MAX_ROWS];
            for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
            for (int g = 0; g < QBLOCK / 8; g++) {
                __m512i v = _mm512_loadu_si512(blk + TILE * 4 + g * 64);
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < rows; r++) {
                    int32_t x_lo, x_hi;
                    memcpy(&x_lo, xq_buf + r * k + b * QBLOCK + 4 * g, 4);
                    memcpy(&x_hi, xq_buf + r * k + b * QBLOCK + 16 + 4 * g, 4);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(x_lo));
                    dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(x_hi));
                }
            }
            for (int r = 0; r < rows; r++) {
                float xd = xd_buf[r * blocks + b];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                         _mm512_mul_ps(d, _mm512_set1_ps(xd)), acc[r]);
                acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xd * (float)xs_buf[r * blocks + b]),
                                         acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n + t * TILE, acc[r]);
    }
}

#else
#define HAVE_VNNI 0
#endif

/* AVX2 (no VNNI): the same integer sums from vpmaddubsw, which multiplies 32 unsigned bytes
 * by 32 signed bytes and adds neighbouring products into 16-bit lanes (saturating), then
 * vpmaddwd by ones, which adds neighbouring 16-bit lanes into 32-bit ones: a lane's 4
 * products, one row of the tile's group, as vpdpbusd gives. 8 rows of a tile per 32 bytes,
 * so a tile is done as two halves. Nothing saturates: Q8_0 multiplies |x| (<= 127, unsigned)
 * by the weight with x's sign (|wq| <= 127: vpsignb negates -128 to -128, and
 * tinygpt.cpu_kernels.tile_q8_0 refuses it), a pair at most 2 x 127 x 127 = 32,258; Q4_1's
 * nibbles (<= 15) times x, a pair at most 3,810, so the four groups' pairs of both nibbles add
 * up in 16 bits (at most 30,480) before one vpmaddwd per block. The float scales are applied
 * per block as in the portable loops. */
#if !HAVE_VNNI && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_INT 1

/* the 4 bytes of x at xq_buf + at in every 32-bit lane */
static inline __m256i x_group(long at) {
    int32_t v;
    memcpy(&v, xq_buf + at, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void q8_avx2(
        const uint8_t *w, float *y, long n, long k, long t0, long t1, const int rows) {
    long blocks = k / QBLOCK;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (long t = t0; t < t1; t++)
        for (int h = 0; h < 2; h++) {                     /* rows 8h .. 8h + 7 of the tile */
            const uint8_t *blk = w + t * blocks * Q8_BLOCK_BYTES;
            __m256 acc[MAX_ROWS];
            for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
            for (long b = 0; b < blocks; b++, blk += Q8_BLOCK_BYTES) {
                __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
                __m256i dot[MAX_ROWS];
                for (int r = 0; r < rows; r++) dot[r] = _mm256_setzero_si256();
                for (int g = 0; g < QBLOCK / 4; g++) {
                    /* wq + 128 stored; flipping the top bit gives wq as a signed byte */
                    __m256i wq = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(blk + TILE * 2 + g * 64 + 32 * h)),
                        flip);
                    for (int r = 0; r < rows; r++) {
                        __m256i xv = x_group(r * k + b * QBLOCK + 4 * g);
                        __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv),
                                                             _mm256_sign_epi8(wq, xv));
                        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
                    }
                }
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                             _mm256_mul_ps(scale,
                                                           _mm256_set1_ps(xd_buf[r * blocks + b])),
                                             acc[r]);
            }
            for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * n + t * TILE + 8 * h, acc[r]);
        }
}

static inline __attribute__((always_inline)) void q4_avx2(
        const uint8_t *w, float *y, long n, long k, long t0, long t1, const int rows) {
    long blocks = k / QBLOCK;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (long t = t0; t < t1; t++)
        for (int h = 0; h < 2; h++) {
            const uint8_t *blk = w + t * blocks * Q4_BLOCK_BYTES;
            __m256 acc[MAX_ROWS];
            for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
            for (long b = 0; b < blocks; b++, blk += Q4_BLOCK_BYTES) {
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
                __m256 mn = _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)(blk + TILE * 2 + 16 * h)));
                __m256i sum16[MAX_ROWS];
                for (int r = 0; r < rows; r++) sum16[r] = _mm256_setzero_si256();
                for (int g = 0; g < QBLOCK / 8; g++) {
                    __m256i v = _mm256_loadu_si256(
                        (const __m256i *)(blk + TILE * 4 + g * 64 + 32 * h));
                    __m256i lo = _mm256_and_si256(v, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int r = 0; r < rows; r++) {
                        long at = r * k + b * QBLOCK + 4 * g;
                        sum16[r] = _mm256_add_epi16(
                            sum16[r],
                            _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_group(at)),
                                             _mm256_maddubs_epi16(hi, x_group(at + 16))));
                    }
                }
                for (int r = 0; r < rows; r++) {
                    float xd = xd_buf[r * blocks + b];
                    __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r], ones));
                    acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xd)), acc[r]);
                    acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xd * (float)xs_buf[r * blocks + b]),
                                             acc[r]);
                }
            }
            for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * n + t * TILE + 8 * h, acc[r]);
        }
}
#else
#define HAVE_AVX2_INT 0
#endif

static void tiles_q8(const uint8_t *w, float *y, long m_rows, long n, long k, long t0,
                     long t1) {
#if HAVE_VNNI
    if (!portable) {
        ROWS_SWITCH(q8_vnni, w, y, n, k, t0, t1)
        return;
    }
#elif HAVE_AVX2_INT
    if (!portable) {
        ROWS_SWITCH(q8_avx2, w, y, n, k, t0, t1)
        return;
    }
#endif
    tiles_q8_portable(w, y, m_rows, n, k, t0, t1);
}

static void tiles_q4(const uint8_t *w, float *y, long m_rows, long n, long k, long t0,
                     long t1) {
#if HAVE_VNNI
    if (!portable) {
        ROWS_SWITCH(q4_vnni, w, y, n, k, t0, t1)
        return;
    }
#elif HAVE_AVX2_INT
    if (!portable) {
        ROWS_SWITCH(q4_avx2, w, y, n, k, t0, t1)
        return;
    }
#endif
    tiles_q4_portable(w, y, m_rows, n, k, t0, t1);
}

/* how the integer kernels run when not portable: 2 AVX-512 VNNI, 1 AVX2, 0 the portable loops
 * (what the CPU the library was compiled for has) */
int tg_int_path(void) { return HAVE_VNNI ? 2 : HAVE_AVX2_INT ? 1 : 0; }

/* ---------------------------------------------------------------------------------------- */
/* the pool: one job at a time, handed out in chunks of tiles by an atomic counter           */

typedef struct {
    int dtype;       /* 0: float32 weights, 1: bfloat16, 2: Q8_0 blocks, 3: Q4_1 blocks,
                        4: float32 beyond MAX_ROWS rows (gemm_tiles.h), 5: attention units */
    const void *w;
    const float *x;
    float *y;
    long m, n, k, tiles, chunk;
    struct attend_job *attention;            /* dtype 5 */
} job_t;

static job_t job;
static void attend_unit(long unit);

static void run_chunk(long c) {
    long t0 = c * job.chunk, t1 = t0 + job.chunk < job.tiles ? t0 + job.chunk : job.tiles;
    if (job.dtype == 5)
        for (long u = t0; u < t1; u++) attend_unit(u);
    else if (job.dtype == 4)
        tiles_range((const float *)job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
    else if (job.dtype == 0)
        tiles_f32((const float *)job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
    else if (job.dtype == 1)
        tiles_bf16((const uint32_t *)job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
    else if (job.dtype == 2)
        tiles_q8((const uint8_t *)job.w, job.y, job.m, job.n, job.k, t0, t1);
    else
        tiles_q4((const uint8_t *)job.w, job.y, job.m, job.n, job.k, t0, t1);
}

/* start `threads` - 1 helper threads (the caller is the other one); returns the count */
int tg_start(int threads) { return pool_start(threads, "tinygpt-gemv"); }

/* in a child process after fork(): forget the helpers (tg_start starts new ones) */
void tg_after_fork(void) { pool_after_fork(); }

void tg_stop(void) { pool_stop(); }

/* y (m, n) = x (m, k) @ W^T with W tiled (n / 16 tiles); n must be a multiple of 16 (and k of
 * 32 for dtypes 2 and 3, whose x is quantized to 8 bits first), 1 <= m <= MAX_ROWS, or any
 * m >= 1 for float32 weights (dtype 0; beyond MAX_ROWS the register-blocked tiles).
 * Returns 0, -1 when memory for the quantized (or bfloat16-rounded) x ran out, -2 for m out
 * of range.
 * Not reentrant: one product at a time (the Python side holds a lock). */
int tg_gemv(int dtype, const void *w, const float *x, float *y, long m, long n, long k) {
    long tiles = n / TILE;
    if (dtype == 0 && m > MAX_ROWS) {
        job.dtype = 4; job.w = w; job.x = x; job.y = y; job.m = m; job.n = n; job.k = k;
        job.tiles = tiles;
        job.chunk = gemm_chunk(m, k, tiles);
        if (tiles <= job.chunk || pool_solo()) {
            job.chunk = tiles;
            run_chunk(0);
        } else {
            pool_run((tiles + job.chunk - 1) / job.chunk, run_chunk);
        }
        return 0;
    }
    if (m < 1 || m > MAX_ROWS) return -2;
    if (dtype >= 2 && quantize_x(x, m, k) != 0) return -1;
#if HAVE_BF16_DOT
    if (dtype == 1 && round_x_bf16(x, m, k) != 0) return -1;
#endif
    /* chunks of about 64 KB of weights, so that a free helper always finds some */
    long bytes_per_tile = dtype == 3 ? k / QBLOCK * Q4_BLOCK_BYTES
                          : dtype == 2 ? k / QBLOCK * Q8_BLOCK_BYTES
                          : dtype == 1 ? (k + 1) / 2 * TILE * 4 : k * TILE * 4;
    long chunk = (65536 + bytes_per_tile - 1) / bytes_per_tile;
    if (chunk < 1) chunk = 1;
    if ((tiles + chunk - 1) / chunk > POOL_MAX_CHUNKS)
        chunk = (tiles + POOL_MAX_CHUNKS - 1) / POOL_MAX_CHUNKS;
    job.dtype = dtype; job.w = w; job.x = x; job.y = y; job.m = m; job.n = n; job.k = k;
    job.tiles = tiles;
    if (tiles <= chunk || pool_solo()) {
        job.chunk = tiles;
        run_chunk(0);
        return 0;
    }
    job.chunk = chunk;
    pool_run((tiles + chunk - 1) / chunk, run_chunk);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* one whole decoder layer of a float32 decode step                                          */
/*
 * Between its four products a layer does small things: two RMS norms, RoPE on q and k, the
 * cache write, attention of each new query over the cached positions, SiLU(gate) * up and two
 * residual adds. Run as torch operations from Python these cost a few microseconds each, a
 * fifth of a SmolLM2-sized step; here they run on the calling thread (the products on the
 * pool) and the layer is one call. Everything is float32 (a bfloat16 cache is read and written
 * in bfloat16), computed as the model's forward does (tinygpt.model.TinyGPT; RoPE to the bit,
 * the rest up to float rounding: other summation orders, fused multiply-adds, attention's own
 * exp in attention.h, SiLU through expf): RMS norm x / sqrt(mean(x^2) + eps) * w, RoPE
 * x * cos + roll(x, head_dim / 2) * sin_signed, attention softmax(q . K / sqrt(head_dim)) V
 * with query head h reading kv head h / (heads / kv_heads), SiLU g / (1 + exp(-g)).
 */
static float *scratch;
static long scratch_capacity;

static void rms_norm_rows(const float *x, const float *w, float *out, long rows, long d,
                          float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float ss = 0;
#pragma omp simd reduction(+ : ss)
        for (long i = 0; i < d; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (long i = 0; i < d; i++) out[r * d + i] = xr[i] * inv * w[i];
    }
}

/* x * cos + roll(x) * sin_signed with each product and the sum rounded on its own (no fused
 * multiply-add), the same bits as torch's three operations and as cpu_gemm.c's tg_rope_store:
 * from the same projection the engine's two roads (these layers, and the batched one) write
 * the same key (a contracted multiply-add here once made them differ by a rounding step).
 * Not inlined, so that the attribute holds whatever calls it. */
__attribute__((noinline, optimize("fp-contract=off")))
static void rope(const float *x, const float *cos, const float *sin_signed, float *out,
                 long hd) {
    long half = hd / 2;
#pragma omp simd
    for (long i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin_signed[i];
#pragma omp simd
    for (long i = half; i < hd; i++) out[i] = x[i] * cos[i] + x[i - half] * sin_signed[i];
}

/* store hd float32 values at a cache row, rounded to bfloat16 (float_to_bf16: to nearest, ties
 * to even, as torch converts; a NaN stays a NaN) when the cache is bfloat16 */
static inline void store_row(void *cache, long at, int bf16, const float *in, long hd) {
    if (!bf16) {
        memcpy((float *)cache + at, in, hd * sizeof(float));
        return;
    }
    uint16_t *row = (uint16_t *)cache + at;
    for (long i = 0; i < hd; i++) row[i] = (uint16_t)float_to_bf16(in[i]);
}

/* row b's key (rotated) and value for each kv head into the cache at its position */
static void write_kv(const float *yb, void *kc, void *vc, int bf16, const long *table,
                     long at_pos, long block, const float *cb, const float *sb, long heads,
                     long kv_heads, long hd) {
    float row[hd];
    for (long g = 0; g < kv_heads; g++) {
        long at = cache_at(table, block, kv_heads, g, at_pos, hd);
        rope(yb + (heads + g) * hd, cb, sb, row, hd);
        store_row(kc, at, bf16, row, hd);
        store_row(vc, at, bf16, yb + (heads + kv_heads + g) * hd, hd);
    }
}

struct attend_job {                 /* the pool's share of attend: see attend_unit */
    const float *q;                 /* (rows, heads, hd), rotated */
    void *kc, *vc;
    int bf16;
    const long *row_pos, *tables;
    long width, block, heads, kv_heads, hd;
    float scale, *out;
};

static _Atomic int attend_failed;    /* 1 when a unit could not allocate its scores */

/* one (row, kv head) of attend's many-row form: its group of query heads over the positions
 * up to the row's own, on whichever thread takes it */
static void attend_unit(long unit) {
    const struct attend_job *a = job.attention;
    long b = unit / a->kv_heads, g = unit % a->kv_heads, group = a->heads / a->kv_heads;
    if (attend_group_unit(a->q + (b * a->heads + g * group) * a->hd, group, a->kc, a->vc,
                          a->bf16, a->tables + b * a->width, a->block, a->kv_heads, g,
                          a->row_pos[b] + 1, a->hd, a->scale,
                          a->out + (b * a->heads + g * group) * a->hd))
        atomic_store(&attend_failed, 1);
}

/* Row b is the token at position row_pos[b] of the sequence whose block table is
 * tables[b * width ..]: its key and value are written there, then it attends to its own
 * position and every one before it (attend_group, attention.h, per kv head). cos and
 * sin_signed are the whole rotation tables. Rows of one sequence (speculative decoding's
 * verify pass) share a table and go in position order, so each sees the keys the rows before
 * it wrote. scores holds heads / kv_heads * (row_pos + 1) floats. Beyond MAX_ROWS rows every
 * row's keys and values are written first and the (row, kv head) units of attention then go
 * to the pool (attend_unit), the rotated queries in q_buf (rows * heads * hd floats): each
 * unit reads only positions up to its row's own, so it sees what the one-thread order shows
 * it, and computes it the same way (the same bits). Returns 0, or -1 when a unit's scores
 * found no memory. */
static int attend(const float *yqkv, long ystride, void *kc, void *vc, int bf16,
                  const long *row_pos, const long *tables, long width, long block,
                  const float *cos, const float *sin_signed, float *out, long rows,
                  long heads, long kv_heads, long hd, float *scores, float *q_buf) {
    long group = heads / kv_heads;
    float scale = 1.0f / sqrtf((float)hd);
    float q[group * hd];
    if (rows > MAX_ROWS) {
        for (long b = 0; b < rows; b++) {
            const float *yb = yqkv + b * ystride;
            long at_pos = row_pos[b];
            const float *cb = cos + at_pos * hd, *sb = sin_signed + at_pos * hd;
            write_kv(yb, kc, vc, bf16, tables + b * width, at_pos, block, cb, sb, heads,
                     kv_heads, hd);
            for (long h = 0; h < heads; h++)
                rope(yb + h * hd, cb, sb, q_buf + (b * heads + h) * hd, hd);
        }
        struct attend_job a = {q_buf, kc, vc, bf16, row_pos, tables, width, block, heads,
                               kv_heads, hd, scale, out};
        job.dtype = 5; job.attention = &a; job.tiles = rows * kv_heads;
        job.chunk = pool_units_per_chunk(job.tiles);
        atomic_store(&attend_failed, 0);
        if (pool_solo()) {
            for (long u = 0; u < job.tiles; u++) attend_unit(u);
        } else {
            pool_run((job.tiles + job.chunk - 1) / job.chunk, run_chunk);
        }
        return atomic_load(&attend_failed) ? -1 : 0;
    }
    for (long b = 0; b < rows; b++) {
        const float *yb = yqkv + b * ystride;
        const long *table = tables + b * width;
        long at_pos = row_pos[b];
        const float *cb = cos + at_pos * hd, *sb = sin_signed + at_pos * hd;
        write_kv(yb, kc, vc, bf16, table, at_pos, block, cb, sb, heads, kv_heads, hd);
        for (long g = 0; g < kv_heads; g++) {
            for (long j = 0; j < group; j++)
                rope(yb + (g * group + j) * hd, cb, sb, q + j * hd, hd);
            attend_group(q, group, kc, vc, bf16, table, block, kv_heads, g, at_pos + 1, hd,
                         scale, scores, out + (b * heads + g * group) * hd);
        }
    }
    return 0;
}

/* x (rows, d) += y (rows, first d of each ystride) */
static void add_rows(float *x, const float *y, long rows, long d, long ystride) {
    for (long r = 0; r < rows; r++)
#pragma omp simd
        for (long i = 0; i < d; i++) x[r * d + i] += y[r * ystride + i];
}

/* One layer on x (rows, d), in place. The products' weights are tiled in format `dtype`
 * with n_* rows (multiples of 16: q, k, v stacked; gate and up stacked); the cache kc, vc
 * holds float32 or (cache_bf16) bfloat16 rows where cache_at says (blocks of `block`
 * positions, each row's block table `width` entries of `tables`), and row b of x, the token at
 * position row_pos[b], is written there; x, the norm weights and the rotation tables (whole,
 * one row per position) are float32 whatever the weights and the cache hold. Returns 0,
 * tg_gemv's error, or -1 when memory for the scratch or attention's scores ran out. */
int tg_layer(int dtype, float *x, long rows, long d, const float *attention_norm,
             const float *ffn_norm, float eps, const void *w_qkv, long n_qkv, const void *w_o,
             long n_o, const void *w_gate_up, long n_gate_up, const void *w_down, long n_down,
             void *kc, void *vc, int cache_bf16, const long *row_pos, const long *tables,
             long width, long block, const float *cos, const float *sin_signed,
             long heads, long kv_heads, long hd, long d_ff) {
    long need = rows * (d + n_qkv + 2 * heads * hd + n_o + n_gate_up + d_ff + n_down)
                + heads / kv_heads * width * block;
    if (need > scratch_capacity) {
        float *grown = realloc(scratch, need * sizeof(float));
        if (grown == NULL) return -1;
        scratch = grown;
        scratch_capacity = need;
    }
    float *h = scratch, *yqkv = h + rows * d, *att = yqkv + rows * n_qkv;
    float *yo = att + rows * heads * hd, *ygu = yo + rows * n_o, *act = ygu + rows * n_gate_up;
    float *ydown = act + rows * d_ff, *q_buf = ydown + rows * n_down;
    float *scores = q_buf + rows * heads * hd;
    int status;
    rms_norm_rows(x, attention_norm, h, rows, d, eps);
    if ((status = tg_gemv(dtype, w_qkv, h, yqkv, rows, n_qkv, d))) return status;
    if ((status = attend(yqkv, n_qkv, kc, vc, cache_bf16, row_pos, tables, width, block, cos,
                         sin_signed, att, rows, heads, kv_heads, hd, scores, q_buf)))
        return status;
    if ((status = tg_gemv(dtype, w_o, att, yo, rows, n_o, heads * hd))) return status;
    add_rows(x, yo, rows, d, n_o);
    rms_norm_rows(x, ffn_norm, h, rows, d, eps);
    if ((status = tg_gemv(dtype, w_gate_up, h, ygu, rows, n_gate_up, d))) return status;
    for (long r = 0; r < rows; r++)
        for (long i = 0; i < d_ff; i++) {
            float g = ygu[r * n_gate_up + i];
            act[r * d_ff + i] = g / (1.0f + expf(-g)) * ygu[r * n_gate_up + d_ff + i];
        }
    if ((status = tg_gemv(dtype, w_down, act, ydown, rows, n_down, d_ff))) return status;
    add_rows(x, ydown, rows, d, n_down);
    return 0;
}

/* tg_layer over `count` layers in turn, layer i's weights, norms and cache at index i of each
 * array (the shapes shared): a whole step's layers in one call from Python, which then takes
 * back its interpreter lock once a step instead of once a layer. With final_norm (not NULL)
 * x is then RMS-normed in place with it, and with w_head (not NULL, n_head rows tiled in
 * `dtype`) logits (rows, n_head) = the head's product of x: the step's end in the same call,
 * because the first torch operation after streaming the layers' weights costs 0.1-0.2 ms of
 * cold instruction and data caches, about 1% of a SmolLM2 step (AVX-512 EPYC, 2026-11-27).
 * Stops at the first error. */
int tg_layers(long count, int dtype, float *x, long rows, long d,
              const float *const *attention_norm, const float *const *ffn_norm, float eps,
              const void *const *w_qkv, long n_qkv, const void *const *w_o, long n_o,
              const void *const *w_gate_up, long n_gate_up, const void *const *w_down,
              long n_down, void *const *kc, void *const *vc, int cache_bf16,
              const long *row_pos, const long *tables, long width, long block,
              const float *cos, const float *sin_signed, long heads, long kv_heads, long hd,
              long d_ff, const float *final_norm, const void *w_head, long n_head,
              float *logits) {
    for (long i = 0; i < count; i++) {
        int status = tg_layer(dtype, x, rows, d, attention_norm[i], ffn_norm[i], eps, w_qkv[i],
                              n_qkv, w_o[i], n_o, w_gate_up[i], n_gate_up, w_down[i], n_down,
                              kc[i], vc[i], cache_bf16, row_pos, tables, width, block, cos,
                              sin_signed, heads, kv_heads, hd, d_ff);
        if (status) return status;
    }
    if (final_norm != NULL) rms_norm_rows(x, final_norm, x, rows, d, eps);
    return w_head != NULL ? tg_gemv(dtype, w_head, x, logits, rows, n_head, d) : 0;
}

/* ---------------------------------------------------------------------------------------- */
/* a mixture-of-experts layer of a decode step: the attention half, then the chosen experts  */
/*
 * A MoE layer's feed-forward depends on the router's choice, which tinygpt.moe makes in torch
 * between the two halves. tg_attention is tg_layer up to its feed-forward: x += the attention
 * block, then h = ffn_norm(x), the feed-forward's input, written for the caller to route.
 * tg_experts then runs the chosen experts: each a SwiGLU whose gate and up are one tiled
 * product (gate rows first) and whose down is another, over the rows routed to it, weighted
 * and summed into a zeroed accumulator group after group, row by row (tinygpt.moe.dispatch's
 * order: experts in the caller's order, a shared expert last with weight 1), and the
 * accumulator added to x. A dense layer is one group of weight 1.
 */

/* tg_layer's attention half on x (rows, d), in place, and h (rows, d) = ffn_norm(x) */
int tg_attention(int dtype, float *x, float *h, long rows, long d, const float *attention_norm,
                 const float *ffn_norm, float eps, const void *w_qkv, long n_qkv,
                 const void *w_o, long n_o, void *kc, void *vc, int cache_bf16,
                 const long *row_pos, const long *tables, long width, long block,
                 const float *cos, const float *sin_signed, long heads, long kv_heads,
                 long hd) {
    long need = rows * (d + n_qkv + 2 * heads * hd + n_o) + heads / kv_heads * width * block;
    if (need > scratch_capacity) {
        float *grown = realloc(scratch, need * sizeof(float));
        if (grown == NULL) return -1;
        scratch = grown;
        scratch_capacity = need;
    }
    float *hn = scratch, *yqkv = hn + rows * d, *att = yqkv + rows * n_qkv;
    float *yo = att + rows * heads * hd, *q_buf = yo + rows * n_o;
    float *scores = q_buf + rows * heads * hd;
    int status;
    rms_norm_rows(x, attention_norm, hn, rows, d, eps);
    if ((status = tg_gemv(dtype, w_qkv, hn, yqkv, rows, n_qkv, d))) return status;
    if ((status = attend(yqkv, n_qkv, kc, vc, cache_bf16, row_pos, tables, width, block, cos,
                         sin_signed, att, rows, heads, kv_heads, hd, scores, q_buf)))
        return status;
    if ((status = tg_gemv(dtype, w_o, att, yo, rows, n_o, heads * hd))) return status;
    add_rows(x, yo, rows, d, n_o);
    rms_norm_rows(x, ffn_norm, h, rows, d, eps);
    return 0;
}

/* x (rows, d) += sum over `count` groups of weight * SwiGLU_e(h row) for the rows of each
 * group. Group g: expert experts[g] of the tables (gate_up[e] tiled with n_gate_up[e] rows,
 * gate then up of d_ff[e] each; down[e] tiled with n_down rows, d padded to 16), m[g] rows
 * (1 .. MAX_ROWS) listed in rows_of, their weights in weights (both concatenated over the
 * groups). Returns 0, tg_gemv's error, -1 when memory ran out, -3 for a row out of range. */
int tg_experts(int dtype, float *x, const float *h, long rows, long d, long count,
               const long *experts, const long *m, const long *rows_of, const float *weights,
               const void *const *gate_up, const void *const *down, const long *n_gate_up,
               const long *d_ff, long n_down) {
    long widest = 0;
    for (long g = 0; g < count; g++) {
        long e = experts[g];
        long w = n_gate_up[e] + d_ff[e];
        if (m[g] < 1 || m[g] > MAX_ROWS) return -2;
        widest = w > widest ? w : widest;
    }
    long need = rows * d + MAX_ROWS * (d + widest + n_down);
    if (need > scratch_capacity) {
        float *grown = realloc(scratch, need * sizeof(float));
        if (grown == NULL) return -1;
        scratch = grown;
        scratch_capacity = need;
    }
    float *acc = scratch, *xg = acc + rows * d, *ydown = xg + MAX_ROWS * d;
    float *ygu = ydown + MAX_ROWS * n_down;
    for (long i = 0; i < rows * d; i++) acc[i] = 0;
    long at = 0;
    for (long g = 0; g < count; g++) {
        long e = experts[g], mg = m[g], ff = d_ff[e], ngu = n_gate_up[e];
        float *act = ygu + mg * ngu;
        for (long j = 0; j < mg; j++) {
            long r = rows_of[at + j];
            if (r < 0 || r >= rows) return -3;
            memcpy(xg + j * d, h + r * d, d * sizeof(float));
        }
        int status;
        if ((status = tg_gemv(dtype, gate_up[e], xg, ygu, mg, ngu, d))) return status;
        for (long j = 0; j < mg; j++)
            for (long i = 0; i < ff; i++) {
                float g_ = ygu[j * ngu + i];
                act[j * ff + i] = g_ / (1.0f + expf(-g_)) * ygu[j * ngu + ff + i];
            }
        if ((status = tg_gemv(dtype, down[e], act, ydown, mg, n_down, ff))) return status;
        for (long j = 0; j < mg; j++) {
            float *a = acc + rows_of[at + j] * d, w = weights[at + j];
            const float *y = ydown + j * n_down;
#pragma omp simd
            for (long i = 0; i < d; i++) a[i] += w * y[i];
        }
        at += mg;
    }
    add_rows(x, acc, rows, d, d);
    return 0;
}
