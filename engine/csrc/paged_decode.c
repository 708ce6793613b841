/* Paged decode attention on CPU, float32: one query token per sequence, reading K and V straight
 * from the paged cache through the block table (no gather into a contiguous copy).
 *
 * cache layout (see engine/kv_cache.py): [num_blocks][2][block_size][n_kv_heads][head_dim]
 * q, out: [batch][n_heads][head_dim]; block_tables: [batch][max_blocks] (int64);
 * context_lens: [batch] (int32). Query head h reads KV head h / (n_heads / n_kv_heads).
 *
 * One sequence at a time: each block's K (then V) rows are read in address order, one slot row
 * (all KV heads) after another, and serve every query head. Scores go to a scratch row per head,
 * then an exact softmax, then the V sum. With n_threads > 1 the batch is cut into parts of about
 * equal total context, one per OpenMP thread: torch's own threads (see paged_decode_f32).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* Sequences [lo, hi) of the batch, on the calling thread. Inlined into each caller below, so
 * that a literal head_dim specialises it (dots and sums of a known length vectorise fully). */
static inline __attribute__((always_inline)) void decode_rows(const float *q, const float *cache, const int64_t *block_tables,
                        const int32_t *context_lens, float *out, int lo, int hi, int n_heads,
                        int n_kv_heads, int head_dim, int block_size, int max_blocks,
                        float scale) {
    const int group = n_heads / n_kv_heads;
    const size_t slot_stride = (size_t)n_kv_heads * head_dim;
    const size_t half_block = (size_t)block_size * slot_stride;
    int cap = 0;
    float *scores = NULL;
    for (int b = lo; b < hi; b++) {
        const int len = context_lens[b];
        if (len > cap) {
            free(scores);
            cap = len;
            scores = (float *)malloc(sizeof(float) * (size_t)n_heads * cap);
        }
        const float *qb = q + (size_t)b * n_heads * head_dim;
        float *ob = out + (size_t)b * n_heads * head_dim;
        const int64_t *table = block_tables + (size_t)b * max_blocks;
        for (int t0 = 0, j = 0; t0 < len; t0 += block_size, j++) {
            const float *kblk = cache + (size_t)table[j] * 2 * half_block;
            const int n = len - t0 < block_size ? len - t0 : block_size;
            for (int o = 0; o < n; o++) {
                const float *krow = kblk + o * slot_stride;
                for (int h = 0; h < n_heads; h++)
                    scores[(size_t)h * cap + t0 + o] =
                        dot(qb + (size_t)h * head_dim, krow + (h / group) * head_dim, head_dim);
            }
        }
        for (int h = 0; h < n_heads; h++) {
            float *row = scores + (size_t)h * cap;
            float m = row[0] * scale;
#pragma omp simd reduction(max : m)
            for (int t = 0; t < len; t++) m = row[t] * scale > m ? row[t] * scale : m;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < len; t++) {
                row[t] = expf(row[t] * scale - m);
                sum += row[t];
            }
            const float inv = 1.f / sum;
#pragma omp simd
            for (int t = 0; t < len; t++) row[t] *= inv;
        }
        memset(ob, 0, sizeof(float) * (size_t)n_heads * head_dim);
        for (int t0 = 0, j = 0; t0 < len; t0 += block_size, j++) {
            const float *vblk = cache + ((size_t)table[j] * 2 + 1) * half_block;
            const int n = len - t0 < block_size ? len - t0 : block_size;
            for (int o = 0; o < n; o++) {
                const float *vrow = vblk + o * slot_stride;
                for (int h = 0; h < n_heads; h++) {
                    const float p = scores[(size_t)h * cap + t0 + o];
                    const float *v = vrow + (h / group) * head_dim;
                    float *a = ob + (size_t)h * head_dim;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
                }
            }
        }
    }
    free(scores);
}

static void decode_rows_any(const float *q, const float *cache, const int64_t *block_tables,
                            const int32_t *context_lens, float *out, int lo, int hi, int n_heads,
                            int n_kv_heads, int head_dim, int block_size, int max_blocks,
                            float scale) {
#define ROWS(D)                                                                                   \
    decode_rows(q, cache, block_tables, context_lens, out, lo, hi, n_heads, n_kv_heads, D,        \
                block_size, max_blocks, scale)
    switch (head_dim) {
    case 16: ROWS(16); break;
    case 32: ROWS(32); break;
    case 64: ROWS(64); break;
    case 128: ROWS(128); break;
    default: ROWS(head_dim);
    }
#undef ROWS
}

/* The first sequence of part `t` of `parts`: parts of about equal total context. */
static int cut(const int32_t *context_lens, int batch, long total, int t, int parts) {
    const long want = total * t / parts;
    long seen = 0;
    int b = 0;
    while (b < batch && seen + context_lens[b] <= want) seen += context_lens[b++];
    return t == 0 ? 0 : (t == parts ? batch : b);
}

void paged_decode_f32(const float *q, const float *cache, const int64_t *block_tables,
                      const int32_t *context_lens, float *out, int batch, int n_heads,
                      int n_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                      int n_threads) {
    if (n_threads > batch) n_threads = batch;
    if (n_threads <= 1) {
        decode_rows_any(q, cache, block_tables, context_lens, out, 0, batch, n_heads, n_kv_heads,
                    head_dim, block_size, max_blocks, scale);
        return;
    }
    long total = 0;
    for (int b = 0; b < batch; b++) total += context_lens[b];
    /* The process's one OpenMP runtime: the library is linked against libgomp.so.1, which
     * resolves to the copy torch already loaded, so these are torch's own (still spinning)
     * worker threads, not a second team competing with them for the cores. */
#pragma omp parallel num_threads(n_threads)
    {
        const int parts = omp_get_num_threads();
        const int t = omp_get_thread_num();
        const int lo = cut(context_lens, batch, total, t, parts);
        const int hi = cut(context_lens, batch, total, t + 1, parts);
        decode_rows_any(q, cache, block_tables, context_lens, out, lo, hi, n_heads, n_kv_heads,
                        head_dim, block_size, max_blocks, scale);
    }
}
