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
 *                no horizontal sums are needed at the end.
 *   the threads  every product is split across the cores by tiles. The split must cost far
 *                less than a product (40-120 us here), so the helper threads are started once
 *                and spin between products (briefly: then they sleep). The thread that calls
 *                takes work too, and work is handed out by an atomic counter, so a helper that
 *                the operating system has not scheduled (a busy machine) makes a product no
 *                slower than one core would; it never waits for a helper that took nothing.
 *                When the caller keeps waiting for chunks a helper took and then lost its
 *                core, the pool runs alone for a while (STALL_NS, STRIKES, SOLO_PRODUCTS).
 *
 * Weights come as float32, bfloat16 (16-bit: the top half of a float32, widened by a shift)
 * 8-bit integers with one float32 scale per row and block of 32 columns (tiles_q8), or
 * 4-bit integers with a scale and a minimum per block (tiles_q4); x and y are float32, and
 * every sum is float32. The compiler vectorizes the 16-wide
 * loops (-O3 -march=native). Built and loaded by tinygpt/cpu_kernels.py.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define TILE 16
#define MAX_THREADS 64
#ifndef YIELD
#define YIELD 1
#endif
#define SPIN_NS 300000L
/* A product whose caller waited this long for a helper's chunk had a helper the operating
 * system took off its core (a busy machine). After STRIKES such products in a row the pool
 * runs the next SOLO_PRODUCTS products on the calling thread alone, then tries again. */
#define STALL_NS 100000L
#define STRIKES 3
#define SOLO_PRODUCTS 512          /* how long an idle helper spins before it sleeps */

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* tiles [t0, t1) of one product, for all M rows of x */
static void tiles_f32(const float *w, const float *x, float *y, long m_rows, long n, long k,
                      long t0, long t1) {
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

static void tiles_bf16(const uint16_t *w, const float *x, float *y, long m_rows, long n,
                       long k, long t0, long t1) {
    for (long t = t0; t < t1; t++) {
        const uint16_t *wt = w + t * k * TILE;
        for (long m = 0; m < m_rows; m++) {
            const float *xm = x + m * k;
            float a0[TILE] = {0}, a1[TILE] = {0};
            long j = 0;
            for (; j + 2 <= k; j += 2) {
                const uint16_t *w0 = wt + j * TILE, *w1 = w0 + TILE;
                float x0 = xm[j], x1 = xm[j + 1];
#pragma omp simd
                for (int i = 0; i < TILE; i++) {
                    a0[i] += bf16_to_float(w0[i]) * x0;
                    a1[i] += bf16_to_float(w1[i]) * x1;
                }
            }
            for (; j < k; j++) {
                const uint16_t *w0 = wt + j * TILE;
                float x0 = xm[j];
#pragma omp simd
                for (int i = 0; i < TILE; i++) a0[i] += bf16_to_float(w0[i]) * x0;
            }
            float *ym = y + m * n + t * TILE;
#pragma omp simd
            for (int i = 0; i < TILE; i++) ym[i] = a0[i] + a1[i];
        }
    }
}

/* 8-bit weights in blocks of 32 (llama.cpp's Q8_0): a tile of 16 rows is K / 32 blocks, each
 * 16 float16 scales (one per row) followed by 32 x 16 int8 weights, column by column:
 * W[16t + i, 32b + j] = scale[i] * q[j][i]. Per block the 16 sums run over the 32 columns,
 * then each is scaled once. */
#define QBLOCK 32
#define Q8_BLOCK_BYTES (TILE * 2 + QBLOCK * TILE)

static inline void halves_to_floats(const uint8_t *src, float *dst) {
    _Float16 h[TILE];
    memcpy(h, src, sizeof h);
#pragma omp simd
    for (int i = 0; i < TILE; i++) dst[i] = (float)h[i];
}

static void tiles_q8(const uint8_t *w, const float *x, float *y, long m_rows, long n, long k,
                     long t0, long t1) {
    long blocks = k / QBLOCK;
    for (long t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * blocks * Q8_BLOCK_BYTES;
        for (long m = 0; m < m_rows; m++) {
            const float *xm = x + m * k;
            float acc[TILE] = {0};
            for (long b = 0; b < blocks; b++) {
                const uint8_t *blk = wt + b * Q8_BLOCK_BYTES;
                float scale[TILE];
                halves_to_floats(blk, scale);
                const int8_t *q = (const int8_t *)(blk + TILE * 2);
                const float *xb = xm + b * QBLOCK;
                float a0[TILE] = {0}, a1[TILE] = {0};
                for (int j = 0; j < QBLOCK; j += 2) {
                    float x0 = xb[j], x1 = xb[j + 1];
                    const int8_t *q0 = q + j * TILE, *q1 = q0 + TILE;
#pragma omp simd
                    for (int i = 0; i < TILE; i++) {
                        a0[i] += (float)q0[i] * x0;
                        a1[i] += (float)q1[i] * x1;
                    }
                }
#pragma omp simd
                for (int i = 0; i < TILE; i++) acc[i] += scale[i] * (a0[i] + a1[i]);
            }
            float *ym = y + m * n + t * TILE;
            memcpy(ym, acc, sizeof acc);
        }
    }
}

/* 4-bit weights in blocks of 32 with a scale and a minimum (llama.cpp's Q4_1): per tile and
 * block, 16 float16 scales d, 16 float16 minimums m, then 16 x 16 bytes, byte (p, i) holding
 * column 2p of row i in its low nibble and column 2p + 1 in its high one:
 * W[16t + i, 32b + j] = d[i] * q[j][i] + m[i]. A block's product is d * (q . x) + m * sum(x),
 * and sum(x) is shared by the 16 rows. */
#define Q4_BLOCK_BYTES (TILE * 4 + QBLOCK / 2 * TILE)

static void tiles_q4(const uint8_t *w, const float *x, float *y, long m_rows, long n, long k,
                     long t0, long t1) {
    long blocks = k / QBLOCK;
    for (long t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * blocks * Q4_BLOCK_BYTES;
        for (long r = 0; r < m_rows; r++) {
            const float *xm = x + r * k;
            float acc[TILE] = {0};
            for (long b = 0; b < blocks; b++) {
                const uint8_t *blk = wt + b * Q4_BLOCK_BYTES;
                float d[TILE], mn[TILE];
                halves_to_floats(blk, d);
                halves_to_floats(blk + TILE * 2, mn);
                const uint8_t *q = blk + TILE * 4;
                const float *xb = xm + b * QBLOCK;
                float sum = 0;
                for (int j = 0; j < QBLOCK; j++) sum += xb[j];
                float a[TILE] = {0};
                for (int p = 0; p < QBLOCK / 2; p++) {
                    float x0 = xb[2 * p], x1 = xb[2 * p + 1];
                    const uint8_t *qp = q + p * TILE;
#pragma omp simd
                    for (int i = 0; i < TILE; i++)
                        a[i] += (float)(qp[i] & 15) * x0 + (float)(qp[i] >> 4) * x1;
                }
#pragma omp simd
                for (int i = 0; i < TILE; i++) acc[i] += d[i] * a[i] + mn[i] * sum;
            }
            memcpy(y + r * n + t * TILE, acc, sizeof acc);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* the pool: one job at a time, handed out in chunks of tiles by an atomic counter           */

typedef struct {
    int dtype;       /* 0: float32 weights, 1: bfloat16, 2: Q8_0 blocks, 3: Q4_1 blocks */
    const void *w;
    const float *x;
    float *y;
    long m, n, k, tiles, chunk;
} job_t;

static job_t job;
/* One atomic word says everything a helper needs to claim work: the job's generation (bits
 * 40-63), its number of chunks (bits 20-39) and the next chunk to take (bits 0-19). A claim is
 * a compare-and-swap of the whole word, so a helper that read an old word can only claim a
 * chunk of the job it read, and only while that job still has one. */
#define GEN(v) ((uint32_t)((v) >> 40))
#define TOTAL(v) ((long)(((v) >> 20) & 0xfffff))
#define NEXT(v) ((long)((v) & 0xfffff))
#define MAX_CHUNKS 0xfffff
static _Atomic uint64_t ticket = 0;
static _Atomic long chunks_done = 0;
static _Atomic int sleepers = 0;
static _Atomic int stopping = 0;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_t helpers[MAX_THREADS];
static int n_helpers = 0;
static int strikes = 0;
static long solo_left = 0;

static void run_chunk(long c) {
    long t0 = c * job.chunk, t1 = t0 + job.chunk < job.tiles ? t0 + job.chunk : job.tiles;
    if (job.dtype == 0)
        tiles_f32((const float *)job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
    else if (job.dtype == 1)
        tiles_bf16((const uint16_t *)job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
    else if (job.dtype == 2)
        tiles_q8((const uint8_t *)job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
    else
        tiles_q4((const uint8_t *)job.w, job.x, job.y, job.m, job.n, job.k, t0, t1);
}

/* take chunks of generation `gen` until none is left; returns how many were done */
static long take_chunks(uint32_t gen) {
    long done = 0;
    for (;;) {
        uint64_t v = atomic_load(&ticket);
        if (GEN(v) != gen || NEXT(v) >= TOTAL(v)) break;
        if (!atomic_compare_exchange_weak(&ticket, &v, v + 1)) continue;
        run_chunk(NEXT(v));
        done++;
        atomic_fetch_add(&chunks_done, 1);
    }
    return done;
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *helper_main(void *arg) {
    (void)arg;
    uint32_t seen = GEN(atomic_load(&ticket));
    while (!atomic_load(&stopping)) {
        long start = now_ns();
        uint32_t gen;
        int spins = 0;
        while ((gen = GEN(atomic_load(&ticket))) == seen) {
            __builtin_ia32_pause();
            if (++spins % 256 == 0) {
                if (now_ns() - start > SPIN_NS) break;
                if (YIELD) sched_yield();
            }
        }
        if (gen == seen) {                      /* idle long enough: sleep until a job */
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleepers, 1);
            while (GEN(atomic_load(&ticket)) == seen && !atomic_load(&stopping))
                pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&lock);
            continue;
        }
        seen = gen;
        take_chunks(gen);
    }
    return NULL;
}

/* start `threads` - 1 helper threads (the caller is the other one); returns the count */
int tg_start(int threads) {
    if (n_helpers > 0) return n_helpers + 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int i = 0; i < threads - 1; i++) {
        if (pthread_create(&helpers[i], NULL, helper_main, NULL) != 0) break;
        n_helpers++;
    }
    return n_helpers + 1;
}

/* in a child process after fork(): the helpers did not come along; forget them (and any lock
 * state a helper held at the fork) so that products run on the calling thread until
 * tg_start is called again */
void tg_after_fork(void) {
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
    atomic_store(&sleepers, 0);
    atomic_store(&stopping, 0);
    n_helpers = 0;
}

void tg_stop(void) {
    atomic_store(&stopping, 1);
    pthread_mutex_lock(&lock);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    for (int i = 0; i < n_helpers; i++) pthread_join(helpers[i], NULL);
    n_helpers = 0;
    atomic_store(&stopping, 0);
}

/* y (m, n) = x (m, k) @ W^T with W tiled (n / 16 tiles); n must be a multiple of 16 (and k of
 * 32 for dtypes 2 and 3).
 * Not reentrant: one product at a time (the Python side holds a lock). */
void tg_gemv(int dtype, const void *w, const float *x, float *y, long m, long n, long k) {
    long tiles = n / TILE;
    /* chunks of about 64 KB of weights, so that a free helper always finds some */
    long bytes_per_tile = dtype == 3 ? k / QBLOCK * Q4_BLOCK_BYTES
                          : dtype == 2 ? k / QBLOCK * Q8_BLOCK_BYTES
                          : k * TILE * (dtype == 0 ? 4 : 2);
    long chunk = (65536 + bytes_per_tile - 1) / bytes_per_tile;
    if (chunk < 1) chunk = 1;
    if ((tiles + chunk - 1) / chunk > MAX_CHUNKS) chunk = (tiles + MAX_CHUNKS - 1) / MAX_CHUNKS;
    if (n_helpers == 0 || tiles <= chunk || solo_left > 0) {
        if (solo_left > 0) solo_left--;
        job.dtype = dtype; job.w = w; job.x = x; job.y = y; job.m = m; job.n = n; job.k = k;
        job.tiles = tiles; job.chunk = tiles;
        run_chunk(0);
        return;
    }
    job.dtype = dtype; job.w = w; job.x = x; job.y = y; job.m = m; job.n = n; job.k = k;
    job.tiles = tiles; job.chunk = chunk;
    long total = (tiles + chunk - 1) / chunk;
    atomic_store(&chunks_done, 0);
    uint32_t gen = (GEN(atomic_load(&ticket)) + 1) & 0xffffff;
    atomic_store(&ticket, (uint64_t)gen << 40 | (uint64_t)total << 20);  /* helpers may take */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    take_chunks(gen);
    long waited_from = now_ns();
    for (int spins = 1; atomic_load(&chunks_done) < total; spins++) {
        __builtin_ia32_pause();
        if (YIELD && spins % 256 == 0) sched_yield();
    }
    if (now_ns() - waited_from > STALL_NS) {
        if (++strikes >= STRIKES) {
            strikes = 0;
            solo_left = SOLO_PRODUCTS;
        }
    } else {
        strikes = 0;
    }
}
