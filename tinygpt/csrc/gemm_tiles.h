/* The register-blocked float32 products of many rows, shared by cpu_gemm.c (the engine's
 * batched road) and cpu_gemv.c (its C decode layers beyond MAX_ROWS rows): tiles_range runs
 * tiles [t0, t1) of one product for every row of x, gemm_chunk sizes the chunks the pool
 * hands out. Include after pool.h and vec.h, with TILE defined (16). cpu_gemm.c's opening
 * comment explains the register block and the order of the sums.
 */
#ifndef TINYGPT_GEMM_TILES_H
#define TINYGPT_GEMM_TILES_H

/* y[r, VW u ..] for rows r < R of x and S vectors u, u + 1, .. of outputs (VW each; vector u
 * is part VW (u % VPT) of tile u / VPT): the register block */
#define BLOCK(R, S)                                                                          \
    static void block_##R##_##S(const float *w, const float *x, float *y, long n, long k,     \
                                long u, const char *pf, unsigned long pf_step) {             \
        const float *ws[S];                                                                  \
        for (int s = 0; s < S; s++)                                                          \
            ws[s] = w + (u + s) / VPT * k * TILE + (u + s) % VPT * VW;                       \
        vf a0[R][S], a1[R][S];                                                               \
        for (int r = 0; r < R; r++)                                                          \
            for (int s = 0; s < S; s++) a0[r][s] = a1[r][s] = (vf){0};                        \
        long j = 0, line = 0;                                                                \
        unsigned long at = 0;                                                                \
        for (; j + 2 <= k; j += 2) {                                                         \
            vf w0[S], w1[S];                                                                 \
            for (at += pf_step; line < (long)(at >> 16); line++)                             \
                __builtin_prefetch(pf + line * 64, 0, 2);                                    \
            for (int s = 0; s < S; s++) {                                                    \
                w0[s] = loadv(ws[s] + j * TILE);                                             \
                w1[s] = loadv(ws[s] + (j + 1) * TILE);                                       \
            }                                                                                \
            for (int r = 0; r < R; r++) {                                                    \
                float x0 = x[r * k + j], x1 = x[r * k + j + 1];                              \
                for (int s = 0; s < S; s++) {                                                \
                    a0[r][s] += w0[s] * x0;                                                  \
                    a1[r][s] += w1[s] * x1;                                                  \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (; j < k; j++)                                                                   \
            for (int r = 0; r < R; r++)                                                      \
                for (int s = 0; s < S; s++)                                                  \
                    a0[r][s] += loadv(ws[s] + j * TILE) * x[r * k + j];                      \
        for (int r = 0; r < R; r++)                                                          \
            for (int s = 0; s < S; s++) storev(y + r * n + (u + s) * VW, a0[r][s] + a1[r][s]); \
    }

#pragma GCC push_options
#pragma GCC optimize("unroll-loops")
BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1) BLOCK(4, 1) BLOCK(5, 1) BLOCK(6, 1)
BLOCK(1, 2) BLOCK(2, 2) BLOCK(3, 2) BLOCK(4, 2) BLOCK(5, 2) BLOCK(6, 2)
#pragma GCC pop_options

/* The block: BLOCK_ROWS rows x BLOCK_VECS vectors, 2 x BLOCK_ROWS x BLOCK_VECS running sums
 * plus 2 x BLOCK_VECS weight vectors and the broadcasts in the registers. AVX-512 (32
 * registers, 16 floats): 6 x 2 (on this project's 2-core AVX-512 EPYC, 2026-11-25: 3 tiles
 * x 4 rows 51 ms, 2 x 4 52 ms, 2 x 5 45 ms, 2 x 6 45-48 ms for SmolLM2's 120 layer products
 * at 16 rows on one core, torch's F.linear 74 ms). 16 registers (AVX2's 8 floats, SSE's 4):
 * 6 x 1. */
#ifndef BLOCK_ROWS
#define BLOCK_ROWS 6
#endif
#ifndef BLOCK_VECS
#define BLOCK_VECS (VW == 16 ? 2 : 1)
#endif
#define BLOCK_TILES (BLOCK_VECS > VPT ? BLOCK_VECS / VPT : 1)   /* tiles a block spans */
typedef void (*block_fn)(const float *, const float *, float *, long, long, long,
                         const char *, unsigned long);
static const block_fn blocks[3][7] = {
    {0},
    {0, block_1_1, block_2_1, block_3_1, block_4_1, block_5_1, block_6_1},
    {0, block_1_2, block_2_2, block_3_2, block_4_2, block_5_2, block_6_2}};

/* tiles [t0, t1) of one product, every row of x, a group of BLOCK_TILES tiles at a time.
 *
 * A group's tiles are read once from memory and then again from the cache, once for each
 * further block of rows (and, with AVX2, for each half of a tile row): the first pass waits
 * on the memory while the others only compute. So every block call also prefetches its share
 * of the NEXT group's lines (PREFETCH, into the core's L2): the group's 64-byte lines split
 * evenly over the calls of the current one, a line or so per pair of columns. The memory
 * then works while the cores compute (the hardware's own prefetchers follow each pass, not
 * the next group). Measured on the 2-core AVX2 EPYC, 2026-11-29: one thread, 16 rows against
 * SmolLM2's head (49,152 x 576, 113 MB), medians of 7 runs taking turns: 30.9 GFLOP/s without,
 * 42.9 with; 6 rows 16.8 and 24.6. Splitting the passes into slices of columns that fit the
 * L1 cache gained nothing there (the first pass is what waited). */
#ifndef PREFETCH
#define PREFETCH 1
#endif
/* a thread's chunk of a product: every group but its first has its lines prefetched, so the
 * chunks are larger than the 96 KB they were before: 16 rows through SmolLM2's 30 layers'
 * products and its head (538 MB, each read once), two threads, medians of 9 runs taking
 * turns (2026-11-29, AVX2 EPYC): 71.7 ms without prefetching in 96 KB chunks, 62.3 with,
 * 51.5 with 384 KB chunks; 256 rows (a prefill's chunk), whose chunks shrink: 645, 622,
 * 621 ms. The machine's speed moves by a quarter between runs; the order held in each. */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES 393216L
#endif
static void tiles_range(const float *w, const float *x, float *y, long m, long n, long k,
                        long t0, long t1) {
    long row_blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    long calls = (BLOCK_VECS < VPT ? VPT / BLOCK_VECS : 1) * row_blocks;    /* per group */
    long lines = (BLOCK_TILES * k + calls - 1) / calls;      /* of the next group, per call */
    unsigned long step = PREFETCH && k >= 2 ? ((unsigned long)lines << 16) / (k / 2) : 0;
    long u = t0 * VPT, u1 = t1 * VPT, call = 0;
    for (; u + BLOCK_VECS <= u1; u += BLOCK_VECS) {
        long next = (u / VPT / BLOCK_TILES + 1) * BLOCK_TILES;    /* the next group's tile */
        for (long r = 0; r < m; r += BLOCK_ROWS, call++) {
            int rows = m - r < BLOCK_ROWS ? (int)(m - r) : BLOCK_ROWS;
            const char *pf = next < t1 ? (const char *)(w + next * k * TILE)
                                             + call % calls * lines * 64 : (const char *)w;
            blocks[BLOCK_VECS][rows](w, x + r * k, y + r * n, n, k, u, pf,
                                     next < t1 ? step : 0);
        }
    }
    for (; u < u1; u++)
        for (long r = 0; r < m; r += BLOCK_ROWS) {
            int rows = m - r < BLOCK_ROWS ? (int)(m - r) : BLOCK_ROWS;
            blocks[1][rows](w, x + r * k, y + r * n, n, k, u, (const char *)w, 0);
        }
}

/* tiles per chunk of a product of m rows: whole register blocks, about CHUNK_BYTES of
 * weights each up to 16 rows and proportionally fewer beyond (a prefill's hundreds of rows
 * make a tile long work: a thread left waiting on another's last chunk idles that long), at
 * least 3 per thread */
static long gemm_chunk(long m, long k, long tiles) {
    long bytes = m <= 16 ? CHUNK_BYTES : CHUNK_BYTES * 16 / m;
    long chunk = (bytes / (k * TILE * 4) + BLOCK_TILES - 1) / BLOCK_TILES * BLOCK_TILES;
    if (chunk < BLOCK_TILES) chunk = BLOCK_TILES;
    while (chunk > BLOCK_TILES && tiles / chunk < 3L * (pool_helpers + 1)) chunk -= BLOCK_TILES;
    if ((tiles + chunk - 1) / chunk > POOL_MAX_CHUNKS)
        chunk = (tiles + POOL_MAX_CHUNKS - 1) / POOL_MAX_CHUNKS;
    return chunk;
}

#endif
