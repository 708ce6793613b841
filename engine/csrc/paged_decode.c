/* Paged decode attention on CPU, float32: one query token per sequence, reading K and V straight
 * from the paged cache through the block table (no gather into a contiguous copy).
 *
 * cache layout (see engine/kv_cache.py): [num_blocks][2][block_size][n_kv_heads][head_dim]
 * q, out: [batch][n_heads][head_dim]; block_tables: [batch][max_blocks] (int64);
 * context_lens: [batch] (int32). Query heads h use KV head h / (n_heads / n_kv_heads).
 *
 * Work item = (sequence, kv head): the K/V rows of one KV head are read once for all the query
 * heads that share it. Single-threaded: the caller runs slices of the batch on its threads, since
 * a second OpenMP team here fights torch's own thread pool. Scores go to a scratch row, then an exact softmax, then the V sum.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void paged_decode_f32(const float *q, const float *cache, const int64_t *block_tables,
                      const int32_t *context_lens, float *out, int batch, int n_heads,
                      int n_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                      int n_threads) {
    const int group = n_heads / n_kv_heads;
    const size_t slot_stride = (size_t)n_kv_heads * head_dim;
    const size_t half_block = (size_t)block_size * slot_stride;
    (void)n_threads; /* the caller splits the batch across its own threads */
    for (int b = 0; b < batch; b++) {
        for (int kh = 0; kh < n_kv_heads; kh++) {
            const int len = context_lens[b];
            float *scores = (float *)malloc(sizeof(float) * (size_t)group * len);
            float *acc = (float *)calloc((size_t)group * head_dim, sizeof(float));
            const float *qb = q + ((size_t)b * n_heads + (size_t)kh * group) * head_dim;
            const int64_t *table = block_tables + (size_t)b * max_blocks;
            for (int t0 = 0, j = 0; t0 < len; t0 += block_size, j++) {
                const float *kblk = cache + (size_t)table[j] * 2 * half_block + kh * head_dim;
                const int n = len - t0 < block_size ? len - t0 : block_size;
                for (int o = 0; o < n; o++) {
                    const float *k = kblk + o * slot_stride;
                    for (int g = 0; g < group; g++) {
                        const float *qg = qb + g * head_dim;
                        float s = 0.f;
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < head_dim; d++) s += qg[d] * k[d];
                        scores[(size_t)g * len + t0 + o] = s * scale;
                    }
                }
            }
            for (int g = 0; g < group; g++) {
                float *row = scores + (size_t)g * len;
                float m = -INFINITY;
                for (int t = 0; t < len; t++) m = row[t] > m ? row[t] : m;
                float sum = 0.f;
                for (int t = 0; t < len; t++) {
                    row[t] = expf(row[t] - m);
                    sum += row[t];
                }
                const float inv = 1.f / sum;
                for (int t = 0; t < len; t++) row[t] *= inv;
            }
            for (int t0 = 0, j = 0; t0 < len; t0 += block_size, j++) {
                const float *vblk =
                    cache + ((size_t)table[j] * 2 + 1) * half_block + kh * head_dim;
                const int n = len - t0 < block_size ? len - t0 : block_size;
                for (int o = 0; o < n; o++) {
                    const float *v = vblk + o * slot_stride;
                    for (int g = 0; g < group; g++) {
                        const float p = scores[(size_t)g * len + t0 + o];
                        float *a = acc + g * head_dim;
#pragma omp simd
                        for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
                    }
                }
            }
            for (int g = 0; g < group; g++)
                memcpy(out + ((size_t)b * n_heads + (size_t)kh * group + g) * head_dim,
                       acc + g * head_dim, sizeof(float) * head_dim);
            free(scores);
            free(acc);
        }
    }
}
