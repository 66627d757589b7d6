/* A prefill chunk's attention over the engine's paged pool, for tinygpt/csrc/cpu_gemm.c.
 *
 * A chunk is `count` tokens of one sequence at positions start .. start + count - 1, their
 * keys and values already in the pool; query j sees positions 0 .. start + j. A decode's one
 * query reads each key once and does a dot product with it (attention.h); a chunk's hundreds
 * of queries read the same keys, so their scores are a matrix product, and this file does
 * them the way gemm_tiles.h does the weights' products, with register blocks.
 *
 *   a unit of work   one kv head and a run of the chunk's rows: the query heads that share
 *                  the kv head times those rows are the unit's query vectors (about
 *                  UNIT_QUERIES), scaled and stored transposed (qt: head_dim rows of them);
 *                  the pool's threads take units (each chunk's last rows first: they see the
 *                  most keys).
 *   per span of keys  about SPAN_KEYS positions, block by block from the pool: the scores
 *                  s (keys, queries) = keys qt, KROWS keys against KQ vectors of queries at a
 *                  time (a key's column broadcast, the queries in the vector's lanes); each
 *                  query's running softmax updated in the lanes (its maximum so far and the
 *                  total of its weights; what it has summed is rescaled when the maximum
 *                  grows); then the weights times the values, QROWS queries against two
 *                  vectors of columns at a time. Spans past the unit's last position are never
 *                  read; a position a query may not see weighs 0.
 *   the end        each query's sum divided by its total.
 *
 * One layer, 256 queries at positions 744-999 of SmolLM2's shape (9 heads, 3 kv heads,
 * head_dim 64), the 2-core AVX2 EPYC, 2026-11-29, counting only the causal products: 87-90
 * GFLOP/s on two threads, 52-55 on one (torch's scaled_dot_product_attention on the padded
 * batch: about 54 on one thread, 49-52 in two slices on two Python threads); with one span per
 * block of 16 keys 3-4% slower, and 43 on one thread while the keys were transposed instead
 * of the queries (once per block, not once per unit).
 *
 * The sums run in another order than a decode's (and than torch's): the oracle is the plain
 * attention within float32 rounding (tests/test_cpu_gemm.py). Include after pool.h and
 * attention.h (exp_nonpositive, cache_at, vec.h's vf).
 */
#ifndef TINYGPT_CHUNK_ATTENTION_H
#define TINYGPT_CHUNK_ATTENTION_H

/* scores: keys per register block (KROWS x KQ running sums: 24 of AVX-512's 32 registers,
 * 12 of AVX2's 16; the layer described above, on the AVX-512 EPYC, 2026-11-29: 8 keys
 * 117-118 GFLOP/s on two threads and 74-75 on one, 4 keys 105-111 and 69-70, torch's padded
 * batch 71-92 and 49-51), */
#ifndef KROWS
#define KROWS (VW == 16 ? 8 : 4)
#endif
#ifndef KQ
#define KQ 3                  /* against this many vectors of queries */
#endif
#ifndef QROWS
#define QROWS 6               /* values: queries per register block (np is a multiple) */
#endif
_Static_assert(KQ * VW % QROWS == 0, "QROWS must divide KQ * VW (np is a multiple of both)");
#ifndef SPAN_KEYS
#define SPAN_KEYS 64          /* keys per step of the running softmax, about */
#endif
#ifndef UNIT_QUERIES
#define UNIT_QUERIES 48       /* query vectors per unit of work, about */
#endif

struct chunk_job {
    const float *q;                   /* (T, heads, d), row r at q + r * ldq */
    long ldq;
    const float *k, *v;               /* one layer's pools (blocks, kv_heads, block, d) */
    const long *tables;               /* chunk c's blocks: tables + c * width */
    long width;
    const long *first, *start, *count;     /* chunk c: rows first[c] .., positions start[c] .. */
    const long *units_before;         /* units of the chunks before chunk c (n_chunks + 1) */
    long n_chunks, heads, kv_heads, d, block, rows_per_unit;
    float scale, *y;                  /* y (T, heads, d) contiguous */
};

/* s (R keys, KQ * VW queries, row stride nq) = keys (R, row stride d) @ qt (d, row stride nq):
 * R keys against KQ vectors of queries, R * KQ running sums in registers */
static inline __attribute__((always_inline)) void scores_block(int R, const float *keys,
                                                               long d, const float *qt,
                                                               long nq, float *s) {
    vf acc[KROWS][KQ];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < KQ; j++) acc[r][j] = (vf){0};
    for (long c = 0; c < d; c++) {
        vf qc[KQ];
        for (int j = 0; j < KQ; j++) qc[j] = loadv(qt + c * nq + j * VW);
        for (int r = 0; r < R; r++) {
            float kc = keys[r * d + c];
            for (int j = 0; j < KQ; j++) acc[r][j] += qc[j] * kc;
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < KQ; j++) storev(s + r * nq + j * VW, acc[r][j]);
}

typedef int vi __attribute__((vector_size(VW * 4)));

static inline vf splat(float x) { return (vf){0} + x; }

/* attention.h's exp_nonpositive on a vector (the compiler leaves that one's loop here
 * scalar): to nearest by adding and taking away 1.5 * 2^23, the selects as bit masks */
static inline vf exp_nonpositive_v(vf x) {
    vi under = x < splat(-87.0f);
    x = (vf)(((vi)x & ~under) | ((vi)splat(-87.0f) & under));
    vf n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693145752f - n * 1.42860677e-6f;
    vf p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f
           + r * (0.00833333377f + r * 0.00138888892f)))));
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~under);
}

/* o (QROWS queries, NV vectors of columns from col, row stride dp) += p (n keys, those
 * queries, row stride nq)^T @ the n value rows at vrow[t] (their columns from col) */
static inline __attribute__((always_inline)) void values_block(int nv, const float *p, long nq,
                                                               const float *const *vrow,
                                                               long col, long n, float *o,
                                                               long dp) {
    vf a[QROWS][2];
    for (int r = 0; r < QROWS; r++)
        for (int j = 0; j < nv; j++) a[r][j] = loadv(o + r * dp + col + j * VW);
    for (long t = 0; t < n; t++) {
        const float *v = vrow[t] + col;
        vf v0 = loadv(v), v1 = nv > 1 ? loadv(v + VW) : v0;
        for (int r = 0; r < QROWS; r++) {
            float pr = p[t * nq + r];
            a[r][0] += v0 * pr;
            if (nv > 1) a[r][1] += v1 * pr;
        }
    }
    for (int r = 0; r < QROWS; r++)
        for (int j = 0; j < nv; j++) storev(o + r * dp + col + j * VW, a[r][j]);
}

/* rows r0 .. r1 - 1 of chunk c, kv head g (see the opening comment) */
static void chunk_unit(const struct chunk_job *a, long c, long g, long r0, long r1) {
    long d = a->d, group = a->heads / a->kv_heads, block = a->block;
    long dp = (d + VW - 1) / VW * VW;                  /* a row of o or v in whole vectors */
    long nq = (r1 - r0) * group, np = (nq + KQ * VW - 1) / (KQ * VW) * (KQ * VW);
    long span = SPAN_KEYS > block ? SPAN_KEYS / block * block : block;    /* keys a step */
    float qt[d * np], o[np * dp], s[span * np], top[np], total[np];
    float vpad[d % VW ? span * dp : 1];
    const float *vrow[span];
    long pos0 = a->start[c] + r0, last = pos0 + (r1 - r0) - 1;
    const long *table = a->tables + c * a->width;
    memset(qt, 0, sizeof(qt));
    memset(o, 0, sizeof(o));
    if (d % VW) memset(vpad, 0, sizeof(vpad));
    for (long i = 0; i < nq; i++) {       /* query i: row r0 + i / group, head i % group */
        const float *src = a->q + (a->first[c] + r0 + i / group) * a->ldq
                           + (g * group + i % group) * d;
        for (long col = 0; col < d; col++) qt[col * np + i] = src[col] * a->scale;
    }
    for (long i = 0; i < np; i++) {
        top[i] = -INFINITY;
        total[i] = 0;
    }
    for (long t0 = 0; t0 <= last; t0 += span) {
        long n = last + 1 - t0 < span ? last + 1 - t0 : span, t;
        for (long b0 = 0; b0 < n; b0 += block) {       /* the span's blocks, one by one */
            long nb = n - b0 < block ? n - b0 : block;
            long at = cache_at(table, block, a->kv_heads, g, t0 + b0, d);
            const float *keys = a->k + at;
            float *sb = s + b0 * np;
            for (t = 0; t < nb; t++) {
                vrow[b0 + t] = a->v + at + t * d;
                if (d % VW) {                          /* rows padded to whole vectors */
                    memcpy(vpad + (b0 + t) * dp, vrow[b0 + t], d * 4);
                    vrow[b0 + t] = vpad + (b0 + t) * dp;
                }
            }
            for (t = 0; t + KROWS <= nb; t += KROWS)
                for (long i = 0; i < np; i += KQ * VW)
                    scores_block(KROWS, keys + t * d, d, qt + i, np, sb + t * np + i);
            for (; KROWS > 4 && t + 4 <= nb; t += 4)      /* a block of fewer than KROWS */
                for (long i = 0; i < np; i += KQ * VW)
                    scores_block(4, keys + t * d, d, qt + i, np, sb + t * np + i);
            for (; t < nb; t++)
                for (long i = 0; i < np; i += KQ * VW)
                    scores_block(1, keys + t * d, d, qt + i, np, sb + t * np + i);
        }
        if (t0 + n - 1 > pos0)                /* a query may not see every key here */
            for (t = 0; t < n; t++)
                for (long i = 0; i < nq; i++)
                    if (t0 + t > pos0 + i / group) s[t * np + i] = -INFINITY;
        /* the running softmax, query by query in the vector lanes (a query that sees none
         * of these keys keeps its maximum and total: its weights here are 0, not e^(-inf +
         * inf)) */
        float grown[np], sum[np];
        for (long i = 0; i < np; i += VW) {
            vf top_i = loadv(top + i), total_i = (vf){0};
            for (t = 0; t < n; t++) {
                vf st = loadv(s + t * np + i);
                top_i = (vf)(((vi)st & (st > top_i)) | ((vi)top_i & ~(st > top_i)));
            }
            for (t = 0; t < n; t++) {
                vf st = loadv(s + t * np + i);
                vf w = (vf)((vi)exp_nonpositive_v(st - top_i) & (st > splat(-INFINITY)));
                storev(s + t * np + i, w);
                total_i += w;
            }
            storev(grown + i, top_i);
            storev(sum + i, total_i);
        }
        for (long i = 0; i < np; i++) {
            if (grown[i] > top[i]) {          /* the maximum grew: rescale what was summed */
                float shrink = exp_nonpositive(top[i] - grown[i]);
                total[i] *= shrink;
                for (long col = 0; col < d; col++) o[i * dp + col] *= shrink;
                top[i] = grown[i];
            }
            total[i] += sum[i];
        }
        for (long i0 = 0; i0 + QROWS <= np; i0 += QROWS) {
            long col = 0;
            for (; col + 2 * VW <= dp; col += 2 * VW)
                values_block(2, s + i0, np, vrow, col, n, o + i0 * dp, dp);
            for (; col < dp; col += VW)
                values_block(1, s + i0, np, vrow, col, n, o + i0 * dp, dp);
        }
    }
    for (long i = 0; i < nq; i++) {
        float *dst = a->y + ((a->first[c] + r0 + i / group) * a->heads + g * group + i % group)
                            * d;
        float inv = 1.0f / total[i];
        for (long col = 0; col < d; col++) dst[col] = o[i * dp + col] * inv;
    }
}

/* unit u of the job: its chunk, then (last rows first) its run of rows and its kv head */
static void chunk_attention_unit(const struct chunk_job *a, long u) {
    long c = 0;
    while (a->units_before[c + 1] <= u) c++;
    long local = u - a->units_before[c], runs = local / a->kv_heads;
    long r1 = a->count[c] - runs * a->rows_per_unit;
    long r0 = r1 > a->rows_per_unit ? r1 - a->rows_per_unit : 0;
    chunk_unit(a, c, local % a->kv_heads, r0, r1);
}

#endif
