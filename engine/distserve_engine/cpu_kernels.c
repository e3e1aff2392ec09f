/* The CPU engine's C kernels, float32 (loaded by native.py):
 *
 * paged_decode_f32: decode attention over the paged KV cache, one new token per
 * sequence, each query head attending its sequence's whole context, read in place
 * through the block table (nothing gathered, no mask, no padding).
 * Layouts (all contiguous, row-major):
 *   q        (batch, num_heads, head_dim)
 *   k_cache  (num_blocks, block_size, num_kv_heads, head_dim), v_cache the same
 *   tables   (batch, max_blocks) block ids; context_lens (batch,) tokens to attend
 *   out      (batch, num_heads, head_dim)
 * Query heads are grouped: head h reads KV head h / (num_heads / num_kv_heads), so each
 * key and value is loaded once for its whole group. Sequences run in parallel over
 * `num_threads` OpenMP threads.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* e^x for x in [-60, 0], vectorisable (libm's expf is a call per element): x = n ln2 + r
 * with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (within 1e-7 of e^x, relative), 2^n
 * built in the exponent bits (n >= -87, so 2^n is a normal float). */
static inline float exp_nonpositive(float x) {
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t bits; float value; } scale = {.bits = ((int32_t)n + 127) << 23};
    return p * scale.value;
}

typedef struct {
    const float *k_cache, *v_cache;
    int64_t block_size, num_heads, num_kv_heads, head_dim;
    float scale;
} Cache;

static const float *token_row(const float *cache, const int64_t *table, int64_t t,
                              const Cache *c, int64_t kv_head) {
    int64_t slot = table[t / c->block_size] * c->block_size + t % c->block_size;
    return cache + (slot * c->num_kv_heads + kv_head) * c->head_dim;
}

/* One sequence: out (num_heads, head_dim) from q (num_heads, head_dim); scores is
 * scratch for (group, len) floats. */
static void attend_one(const float *q, const int64_t *table, int64_t len, const Cache *c,
                       float *out, float *scores) {
    const int64_t group = c->num_heads / c->num_kv_heads, dim = c->head_dim;
    for (int64_t kv_head = 0; kv_head < c->num_kv_heads; ++kv_head) {
        const float *q_group = q + kv_head * group * dim;
        float *o_group = out + kv_head * group * dim;
        for (int64_t t = 0; t < len; ++t) {
            const float *k = token_row(c->k_cache, table, t, c, kv_head);
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = q_group + g * dim;
                float dot = 0.f;
                for (int64_t d = 0; d < dim; ++d) dot += qg[d] * k[d];
                scores[g * len + t] = dot * c->scale;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float *row = scores + g * len, top = -FLT_MAX, total = 0.f;
            for (int64_t t = 0; t < len; ++t) top = row[t] > top ? row[t] : top;
            for (int64_t t = 0; t < len; ++t) {
                /* A weight below e^-60 of the largest is taken as 0: a smaller one would
                 * make subnormal products in the sum over values, each ~100x slower. */
                const float shifted = row[t] - top;
                row[t] = shifted < -60.f ? 0.f : exp_nonpositive(shifted);
                total += row[t];
            }
            const float inverse = 1.f / total;
            for (int64_t t = 0; t < len; ++t) row[t] *= inverse;
            for (int64_t d = 0; d < dim; ++d) o_group[g * dim + d] = 0.f;
        }
        for (int64_t t = 0; t < len; ++t) {
            const float *v = token_row(c->v_cache, table, t, c, kv_head);
            for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g * len + t];
                float *o = o_group + g * dim;
                for (int64_t d = 0; d < dim; ++d) o[d] += p * v[d];
            }
        }
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then partial). */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *tables, const int64_t *context_lens, int64_t batch,
                     int64_t max_blocks, int64_t block_size, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, float scale, float *out,
                     int num_threads) {
    const Cache c = {k_cache, v_cache, block_size, num_heads, num_kv_heads, head_dim, scale};
    const int64_t group = num_heads / num_kv_heads;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = context_lens[b] > longest ? context_lens[b] : longest;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * (longest > 0 ? longest : 1)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            if (scores == NULL) {
                failed = 1;
                continue;
            }
            attend_one(q + b * num_heads * head_dim, tables + b * max_blocks, context_lens[b],
                       &c, out + b * num_heads * head_dim, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* RMSNorm, float32: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, the sum of
 * squares accumulated in double. x rows are row_stride floats apart; out is contiguous. */
void rms_norm_f32(const float *x, int64_t row_stride, const float *weight, float *out,
                  int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * row_stride;
        double squares = 0.0;
        for (int64_t d = 0; d < dim; ++d) squares += (double)row[d] * row[d];
        const float inverse = (float)(1.0 / sqrt(squares / (double)dim + (double)eps));
        float *o = out + r * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = row[d] * inverse * weight[d];
    }
}
