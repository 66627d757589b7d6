/* A small pool of helper threads that share one job's chunks with the calling thread.
 *
 * Included by cpu_gemv.c and cpu_gemm.c (each library gets its own pool: everything here is
 * static). A job is `total` chunks numbered 0 .. total - 1 and a function that runs one chunk;
 * pool_run hands them out and returns when all are done.
 *
 *   claiming      one atomic word holds the job's generation (bits 40-63), its number of
 *                 chunks (bits 20-39) and the next chunk to take (bits 0-19). A claim is a
 *                 compare-and-swap of the whole word, so a helper that read an old word can
 *                 only claim a chunk of the job it read, and only while that job has one left.
 *   the caller    takes chunks too, and never waits for a helper that took none: a helper the
 *                 operating system has not scheduled (a busy machine) makes a job no slower
 *                 than one core would.
 *   idle helpers  spin (with pause, and sched_yield every 256 pauses while POOL_YIELD is 1)
 *                 for POOL_SPIN_NS after a job, then sleep on a condition variable until the
 *                 next one. The caller, waiting for chunks that helpers took, pauses and
 *                 yields the same way (and never sleeps).
 *   stalls        when the caller waited POOL_STALL_NS for chunks a helper took and then lost
 *                 its core (and longer than two of its own chunks took: a long chunk is not a
 *                 lost core), POOL_STRIKES times in a row, the next POOL_SOLO_JOBS jobs run
 *                 on the calling thread alone (pool_solo says so), then the pool tries again.
 *
 * Not reentrant: one job at a time (the Python side holds a lock).
 */
#ifndef TINYGPT_POOL_H
#define TINYGPT_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define POOL_MAX_THREADS 64
#ifndef POOL_SPIN_NS
#define POOL_SPIN_NS 300000L
#endif
#ifndef POOL_STALL_NS
#define POOL_STALL_NS 100000L
#endif
#ifndef POOL_STRIKES
#define POOL_STRIKES 3
#endif
#ifndef POOL_SOLO_JOBS
#define POOL_SOLO_JOBS 512
#endif
#ifndef POOL_YIELD
#define POOL_YIELD 1
#endif

#define POOL_GEN(v) ((uint32_t)((v) >> 40))
#define POOL_TOTAL(v) ((long)(((v) >> 20) & 0xfffff))
#define POOL_NEXT(v) ((long)((v) & 0xfffff))
#define POOL_MAX_CHUNKS 0xfffff

typedef void (*pool_chunk_fn)(long chunk);

static _Atomic uint64_t pool_ticket = 0;
static _Atomic long pool_done = 0;
static _Atomic int pool_sleepers = 0;
static _Atomic int pool_stopping = 0;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_t pool_threads[POOL_MAX_THREADS];
static int pool_helpers = 0;
static int pool_strikes = 0;
static long pool_solo_left = 0;
static pool_chunk_fn pool_fn = 0;

static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* take chunks of generation `gen` until none is left; returns how many this thread ran */
static long pool_take(uint32_t gen) {
    long ran = 0;
    for (;;) {
        uint64_t v = atomic_load(&pool_ticket);
        if (POOL_GEN(v) != gen || POOL_NEXT(v) >= POOL_TOTAL(v)) return ran;
        if (!atomic_compare_exchange_weak(&pool_ticket, &v, v + 1)) continue;
        pool_fn(POOL_NEXT(v));
        atomic_fetch_add(&pool_done, 1);
        ran++;
    }
}

static void *pool_helper_main(void *arg) {
    (void)arg;
    uint32_t seen = POOL_GEN(atomic_load(&pool_ticket));
    while (!atomic_load(&pool_stopping)) {
        long start = pool_now_ns();
        uint32_t gen;
        int spins = 0;
        while ((gen = POOL_GEN(atomic_load(&pool_ticket))) == seen) {
            pool_pause();
            if (++spins % 256 == 0) {
                if (pool_now_ns() - start > POOL_SPIN_NS) break;
                if (POOL_YIELD) sched_yield();
            }
        }
        if (gen == seen) {                      /* idle long enough: sleep until a job */
            pthread_mutex_lock(&pool_lock);
            atomic_fetch_add(&pool_sleepers, 1);
            while (POOL_GEN(atomic_load(&pool_ticket)) == seen && !atomic_load(&pool_stopping))
                pthread_cond_wait(&pool_wake, &pool_lock);
            atomic_fetch_sub(&pool_sleepers, 1);
            pthread_mutex_unlock(&pool_lock);
            continue;
        }
        seen = gen;
        pool_take(gen);
    }
    return NULL;
}

/* start `threads` - 1 helpers named `name` (the caller is the other one); returns the count */
static int pool_start(int threads, const char *name) {
    if (pool_helpers > 0) return pool_helpers + 1;
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    for (int i = 0; i < threads - 1; i++) {
        if (pthread_create(&pool_threads[i], NULL, pool_helper_main, NULL) != 0) break;
        pthread_setname_np(pool_threads[i], name);      /* as top -H and /proc name it */
        pool_helpers++;
    }
    return pool_helpers + 1;
}

static void pool_stop(void) {
    atomic_store(&pool_stopping, 1);
    pthread_mutex_lock(&pool_lock);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    for (int i = 0; i < pool_helpers; i++) pthread_join(pool_threads[i], NULL);
    pool_helpers = 0;
    atomic_store(&pool_stopping, 0);
}

/* in a child process after fork(): the helpers did not come along; forget them (and any lock
 * state a helper held at the fork) so that jobs run on the calling thread until pool_start */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
    atomic_store(&pool_sleepers, 0);
    atomic_store(&pool_stopping, 0);
    pool_helpers = 0;
}

/* 1 when the next job should run on the calling thread alone (no helpers, or a stall
 * recently); counts one solo job down */
static int pool_solo(void) {
    if (pool_helpers == 0) return 1;
    if (pool_solo_left > 0) {
        pool_solo_left--;
        return 1;
    }
    return 0;
}

/* units per chunk for a job of `units` units (attention's: one each while they fit), so that
 * the job has at most POOL_MAX_CHUNKS chunks */
static inline long pool_units_per_chunk(long units) {
    return units > POOL_MAX_CHUNKS ? (units + POOL_MAX_CHUNKS - 1) / POOL_MAX_CHUNKS : 1;
}

/* run chunks 0 .. total - 1 of `fn` on the caller and the helpers; total <= POOL_MAX_CHUNKS */
static void pool_run(long total, pool_chunk_fn fn) {
    pool_fn = fn;
    atomic_store(&pool_done, 0);
    uint32_t gen = (POOL_GEN(atomic_load(&pool_ticket)) + 1) & 0xffffff;
    atomic_store(&pool_ticket, (uint64_t)gen << 40 | (uint64_t)total << 20);
    if (atomic_load(&pool_sleepers) > 0) {
        pthread_mutex_lock(&pool_lock);
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_lock);
    }
    long started = pool_now_ns(), ran = pool_take(gen), waited_from = pool_now_ns();
    for (int spins = 1; atomic_load(&pool_done) < total; spins++) {
        pool_pause();
        if (POOL_YIELD && spins % 256 == 0) sched_yield();
    }
    /* a helper still on its last chunk keeps the caller waiting up to a chunk's time: a stall
     * is a wait beyond POOL_STALL_NS and beyond twice the caller's own time per chunk */
    long per_chunk = ran ? (waited_from - started) / ran : 0;
    if (pool_now_ns() - waited_from > (2 * per_chunk > POOL_STALL_NS ? 2 * per_chunk
                                                                        : POOL_STALL_NS)) {
        if (++pool_strikes >= POOL_STRIKES) {
            pool_strikes = 0;
            pool_solo_left = POOL_SOLO_JOBS;
        }
    } else {
        pool_strikes = 0;
    }
}

#endif
