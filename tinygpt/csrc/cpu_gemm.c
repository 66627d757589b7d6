/* tinygpt's CPU products for the engine's batched steps: y (M, N) = x (M, K) @ W^T, M from one
 * row to a step's token budget (decodes and prefill chunks together: 256 rows by default,
 * tinygpt.scheduler). A step of at most 32 decodes and nothing else (tinygpt.runner's
 * decode_layers_rows) runs cpu_gemv.c's decode layers (tg_layers) instead, whose float32
 * products beyond 4 rows are the register blocks this file uses too (gemm_tiles.h).
 *
 * An engine step that decodes 16 sequences multiplies every weight matrix by 16 rows. Each
 * weight read from memory now feeds 16 multiply-adds instead of one, so the step is no longer
 * bound by the memory alone: at 16 rows SmolLM2-135M's step is 4.3 GFLOP against 538 MB, about
 * where a two-core machine's arithmetic and its memory take the same time. The products must
 * keep the multiply-add units busy, which a loop over one row at a time does not: it loads a
 * weight vector for every multiply-add.
 *
 *   the layout     the same tiles as tinygpt/csrc/cpu_gemv.c (tinygpt.cpu_kernels.tile):
 *                  W (N, K) stored as (N / 16, K, 16), tile t holding rows 16t .. 16t+15
 *                  column by column, so one step of k is one 16-wide vector per tile.
 *   the register block   6 rows of x against 2 tiles at once with AVX-512: per pair of
 *                  columns (k, k+1) it loads 4 weight vectors and broadcasts 12 values of x,
 *                  and does 24 multiply-adds into running sums that stay in registers (24 of
 *                  AVX-512's 32 vector registers); with AVX2 (16 registers of 8 floats), 6 rows
 *                  against half a tile, 12 running sums. The block's tiles are read again for
 *                  the next 6 rows, from the core's cache.
 *   the sums       every output is the sum of its even columns plus the sum of its odd
 *                  columns, each accumulated in column order with fused multiply-adds: the
 *                  order cpu_gemv.c uses for one row, so a row's result does not depend on
 *                  how many rows were multiplied with it.
 *   the threads    each product is split over the cores by blocks of tiles: helper threads
 *                  started once take chunks from an atomic counter (the calling thread takes
 *                  chunks too) and spin briefly between products, then sleep. When the caller
 *                  keeps waiting for a chunk that a helper took and then lost its core (a busy
 *                  machine), the next products run on the calling thread alone for a while.
 *
 * GCC's vector extensions keep the code portable: the vectors are as wide as the CPU's
 * registers (vec.h), 16 floats with AVX-512, 8 with AVX2, and the block is sized for their
 * number. Built and loaded by tinygpt/cpu_gemm.py.
 */
#define _GNU_SOURCE             /* pthread_setname_np, in pool.h */
#include <stdint.h>
#include <string.h>

/* a stalled helper is 200 us here (a product of 16 rows takes longer than one row's); after
 * 3 in a row the next 256 jobs run on the calling thread alone */
#define POOL_STALL_NS 200000L
#define POOL_SOLO_JOBS 256
#include "pool.h"
#include "attention.h"     /* attend_group: one group of query heads over the pool */
#include "chunk_attention.h"  /* a prefill chunk's queries over the pool */

#include "vec.h"           /* vf: VW floats, the registers' width; VPT of them per tile row */

#define TILE 16

#include "gemm_tiles.h"  /* the register block, tiles_range, gemm_chunk */

/* ---------------------------------------------------------------------------------------- */
/* the pool: one product at a time, handed out in chunks of tiles                            */

typedef struct {
    int kind;                       /* 0: a product, 1: paged attention, 2: chunks' attention */
    const float *w, *x;
    float *y;
    long m, n, k, tiles, chunk;
    /* paged attention (see tg_paged_attention) */
    const float *kp, *vp;
    const long *tables, *lengths;
    long heads, kv_heads, dim, block, width;
    float scale;
    const struct chunk_job *chunks;
} job_t;

static void attend(long unit);

static job_t job;

static void run_chunk(long c) {
    long t0 = c * job.chunk, t1 = t0 + job.chunk < job.tiles ? t0 + job.chunk : job.tiles;
    if (job.kind == 0)
        tiles_range(job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
    else if (job.kind == 1)
        for (long u = t0; u < t1; u++) attend(u);
    else
        for (long u = t0; u < t1; u++) chunk_attention_unit(job.chunks, u);
}

/* start `n` - 1 helper threads (the caller is the n-th); returns the threads now working */
int tg_gemm_start(int n) { return pool_start(n, "tinygpt-gemm"); }

void tg_gemm_stop(void) { pool_stop(); }

/* in a forked child the helpers stayed behind: forget them (start again with tg_gemm_start) */
void tg_gemm_after_fork(void) { pool_after_fork(); }

/* y (m, n) = x (m, k) @ W^T, W tiled as (n / 16, k, 16) float32, n a multiple of 16; x and y
 * row-major and contiguous. Not reentrant: one product or attention at a time
 * (tinygpt/cpu_gemm.py holds a lock). */
void tg_gemm(const float *w, const float *x, float *y, long m, long n, long k) {
    long tiles = n / TILE, chunk = gemm_chunk(m, k, tiles);
    if (tiles <= chunk || pool_solo()) {
        tiles_range(w, x, y, m, n, k, 0, tiles);
        return;
    }
    job.kind = 0;
    job.w = w; job.x = x; job.y = y; job.m = m; job.n = n; job.k = k;
    job.tiles = tiles; job.chunk = chunk;
    pool_run((tiles + chunk - 1) / chunk, run_chunk);
}

/* ---------------------------------------------------------------------------------------- */
/* paged decode attention: one new query per sequence against its keys in the block pool     */

static _Atomic int attend_failed;    /* 1 when a unit could not allocate its scores */

/* unit = (sequence, kv head): attend_group (attention.h) for the query heads that share the kv
 * head, over positions 0 .. length - 1 of the sequence */
static void attend(long unit) {
    long seq = unit / job.kv_heads, h = unit % job.kv_heads;
    long d = job.dim, group = job.heads / job.kv_heads;
    if (attend_group_unit(job.x + seq * job.m + h * group * d, group, job.kp, job.vp, 0,
                          job.tables + seq * job.width, job.block, job.kv_heads, h,
                          job.lengths[seq], d, job.scale,
                          job.y + (seq * job.heads + h * group) * d))
        atomic_store(&attend_failed, 1);
}

/* y (n_seq, heads, dim) = attention of q (n_seq, heads, dim; sequence s's row at q + s * ldq),
 * one query per sequence, over
 * the first lengths[s] positions of sequence s in the pools k, v (blocks, kv_heads, block,
 * dim), sequence s's blocks listed in tables[s * width ..]. heads is a multiple of kv_heads
 * (query head h uses kv head h / (heads / kv_heads)), and
 * every length is at least 1. Returns 0, or -1 when a unit's scores found no memory. */
int tg_paged_attention(const float *q, long ldq, const float *k, const float *v,
                       const long *tables, const long *lengths, float *y, long n_seq,
                       long heads, long kv_heads, long dim, long block, long width,
                       float scale) {
    job.kind = 1;
    job.x = q; job.m = ldq; job.y = y; job.kp = k; job.vp = v; job.tables = tables; job.lengths = lengths;
    job.heads = heads; job.kv_heads = kv_heads; job.dim = dim; job.block = block;
    job.width = width; job.scale = scale;
    job.tiles = n_seq * kv_heads;
    job.chunk = pool_units_per_chunk(job.tiles);
    atomic_store(&attend_failed, 0);
    if (job.tiles == 1 || pool_solo()) {
        for (long u = 0; u < job.tiles; u++) attend(u);
    } else {
        pool_run((job.tiles + job.chunk - 1) / job.chunk, run_chunk);
    }
    return atomic_load(&attend_failed) ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------- */
/* RMSNorm of a few rows on the calling thread: y = x / sqrt(mean(x^2) + eps) * w, row by row */

void tg_rms_norm(const float *x, const float *w, float *y, long rows, long dim, float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        float squares = 0;
#pragma omp simd reduction(+ : squares)
        for (long i = 0; i < dim; i++) squares += xr[i] * xr[i];
        float scale = 1.0f / __builtin_sqrtf(squares / (float)dim + eps);
#pragma omp simd
        for (long i = 0; i < dim; i++) yr[i] = xr[i] * scale * w[i];
    }
}

/* RoPE and the cache write of one layer's new tokens, in one pass. q, k, v: (T, heads * dim),
 * (T, kv_heads * dim) and (T, kv_heads * dim) with rows `ld` floats apart (the views of one
 * q|k|v product); cos, sin: (T, dim), sin with its first half negated. q and k are rotated in
 * place, x * cos + roll(x, dim / 2) * sin, each product and the sum rounded on its own (no
 * fused multiply-add: the same bits as torch's three operations); then each token's k and v
 * rows go to rows slots[t * kv_heads + h] of the pools viewed as (rows, dim). */
__attribute__((optimize("fp-contract=off")))
void tg_rope_store(float *q, float *k, const float *v, long ld, const float *cos,
                   const float *sin, long tokens, long heads, long kv_heads, long dim,
                   float *k_pool, float *v_pool, const int64_t *slots) {
    long half = dim / 2;
    float rolled[dim];
    for (long t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (long h = 0; h < heads + kv_heads; h++) {
            float *x = h < heads ? q + t * ld + h * dim : k + t * ld + (h - heads) * dim;
            memcpy(rolled, x + half, sizeof(float) * (dim - half));      /* roll by half */
            memcpy(rolled + (dim - half), x, sizeof(float) * half);
            for (long i = 0; i < dim; i++) {
                float a = x[i] * c[i], b = rolled[i] * s[i];
                x[i] = a + b;
            }
        }
        for (long h = 0; h < kv_heads; h++) {
            long slot = slots[t * kv_heads + h];
            memcpy(k_pool + slot * dim, k + t * ld + h * dim, sizeof(float) * dim);
            memcpy(v_pool + slot * dim, v + t * ld + h * dim, sizeof(float) * dim);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* prefill chunks' attention: chunk_attention.h                                              */

/* y (T, heads, dim) = the attention of n_chunks chunks' queries q (T, heads, dim; row r at
 * q + r * ldq) over the pools k, v (blocks, kv_heads, block, dim): chunk c's rows first[c] ..
 * first[c] + count[c] - 1 are the tokens at positions start[c] .., each seeing the positions
 * up to its own, the sequence's blocks listed in tables[c * width ..]. heads is a multiple of
 * kv_heads; every count is at least 1. */
void tg_chunk_attention(const float *q, long ldq, const float *k, const float *v,
                        const long *tables, long width, const long *first, const long *start,
                        const long *count, long n_chunks, float *y, long heads, long kv_heads,
                        long dim, long block, float scale) {
    long group = heads / kv_heads, rows = UNIT_QUERIES / group > 1 ? UNIT_QUERIES / group : 1;
    long units_before[n_chunks + 1];
    units_before[0] = 0;
    for (long c = 0; c < n_chunks; c++)
        units_before[c + 1] = units_before[c] + (count[c] + rows - 1) / rows * kv_heads;
    struct chunk_job a = {q, ldq, k, v, tables, width, first, start, count, units_before,
                          n_chunks, heads, kv_heads, dim, block, rows, scale, y};
    long units = units_before[n_chunks];
    if (units == 1 || pool_solo()) {
        for (long u = 0; u < units; u++) chunk_attention_unit(&a, u);
        return;
    }
    job.kind = 2;
    job.chunks = &a;
    job.tiles = units;
    job.chunk = pool_units_per_chunk(units);
    pool_run((units + job.chunk - 1) / job.chunk, run_chunk);
}

