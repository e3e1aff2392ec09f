/* The CPU engine's C kernels, float32, and bfloat16 for RMSNorm, SwiGLU, rotary and
 * paged decode attention, and greedy sampling's argmax (loaded by native.py):
 *
 * paged_decode_f32: decode attention over the paged KV cache, one new token per
 * sequence, each query head attending its sequence's whole context, read in place
 * through the block table (nothing gathered, no mask, no padding).
 * Layouts (all contiguous, row-major):
 *   q        (batch, num_heads, head_dim)
 *   k_cache  (num_blocks, block_size, num_kv_heads, head_dim), v_cache the same
 *   tables   (batch, max_blocks) block ids; context_lens (batch,) tokens to attend
 *   out      (batch, num_heads, head_dim)
 * Query heads are grouped: head h reads KV head h / (num_heads / num_kv_heads). With AVX2
 * and FMA and head_dim a multiple of 8 (attend_one_x8), tokens are the outer loop, so the
 * cache is read front to back through each block, keys then values, in 8-float vectors
 * (16 in AVX-512 builds), the next block prefetched; elsewhere (attend_one) each KV
 * head's tokens are read once for its whole group. Sequences run in parallel over
 * `num_threads` OpenMP threads.
 *
 * pack_linear_f32 / packed_linear_f32: y = x W^T (+ bias) for the few rows of a decode
 * step (AVX2 and FMA; elsewhere both return -1 and torch's GEMMs run). W (n, k) is
 * packed once into panels of 16 output features, each panel k rows of 16 floats, so a
 * product reads the weight once, front to back, one cache line per input feature. Each
 * panel is multiplied by the rows of x in blocks of at most 6 (12 accumulators of 8
 * floats), the blocks' sizes evened out (8 rows: 4 + 4, not 6 + 2). Built for AVX-512
 * (x86-64-v4), three rows or more go two panels at a time in blocks of at most 12 rows
 * (24 accumulators of 16 floats: half the broadcasts per multiply-add, and a product of
 * 32 rows in 3 blocks where 6 read each panel again). Panels run in parallel over
 * `num_threads` OpenMP threads.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
/* GCC 11 and later on x86-64: a function may enable instructions the build does not (the
 * AMX kernels below, in every x86 build) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define HAS_TARGET_ATTRIBUTES
#include <immintrin.h>
#endif

#if defined(__AVX512F__) || defined(HAS_TARGET_ATTRIBUTES)
/* 16 floats rounded to bfloat16 as f32_to_bf16 rounds them (nearest even, NaN quiet). */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __m256i narrow_bf16_16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), high = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}
#endif

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

/* bfloat16 is a float32's upper half: widened by a shift, narrowed rounding to nearest
 * even as torch rounds (a NaN stays a quiet NaN). The `_bf16` kernels below read and
 * write bfloat16 and compute in float32, rounding once where torch's bfloat16 operators
 * round after each step. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float as_float(float x) { return x; }

typedef struct {
    int64_t block_size, num_heads, num_kv_heads, head_dim;
    float scale;
} Cache;

static void softmax_in_place(float *row, int64_t len);

/* One sequence: out (num_heads, head_dim, float32) from q (num_heads, head_dim,
 * float32) over caches of T, each element widened by WIDEN as it is read; scores is
 * scratch for (group, len) floats. attend_one for float32 caches, attend_one_bf16 for
 * bfloat16 ones. */
#define DEFINE_ATTEND_ONE_SCALAR(NAME, T, WIDEN)                                               \
    static void NAME(const float *q, const T *k_cache, const T *v_cache, const int64_t *table, \
                     int64_t len, const Cache *c, float *out, float *scores) {                 \
        const int64_t group = c->num_heads / c->num_kv_heads, dim = c->head_dim;               \
        const int64_t size = c->block_size, stride = c->num_kv_heads * dim;                    \
        for (int64_t kv_head = 0; kv_head < c->num_kv_heads; ++kv_head) {                      \
            const float *q_group = q + kv_head * group * dim;                                  \
            float *o_group = out + kv_head * group * dim;                                      \
            for (int64_t t = 0; t < len; ++t) {                                                \
                const T *k = k_cache + (table[t / size] * size + t % size) * stride + kv_head * dim; \
                for (int64_t g = 0; g < group; ++g) {                                          \
                    const float *qg = q_group + g * dim;                                       \
                    float dot = 0.f;                                                           \
                    for (int64_t d = 0; d < dim; ++d) dot += qg[d] * WIDEN(k[d]);              \
                    scores[g * len + t] = dot * c->scale;                                      \
                }                                                                              \
            }                                                                                  \
            for (int64_t g = 0; g < group; ++g) {                                              \
                softmax_in_place(scores + g * len, len);                                       \
                for (int64_t d = 0; d < dim; ++d) o_group[g * dim + d] = 0.f;                  \
            }                                                                                  \
            for (int64_t t = 0; t < len; ++t) {                                                \
                const T *v = v_cache + (table[t / size] * size + t % size) * stride + kv_head * dim; \
                for (int64_t g = 0; g < group; ++g) {                                          \
                    const float p = scores[g * len + t];                                       \
                    float *o = o_group + g * dim;                                              \
                    for (int64_t d = 0; d < dim; ++d) o[d] += p * WIDEN(v[d]);                 \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_ATTEND_ONE_SCALAR(attend_one, float, as_float)
DEFINE_ATTEND_ONE_SCALAR(attend_one_bf16, uint16_t, bf16_to_f32)

/* The vector kernels below are written once for a vector of W floats (the macros
 * DEFINE_*(W)) over these operations, and made for W = 8 (AVX2 and FMA) and, in AVX-512
 * builds, W = 16. The 8-lane operations are the intrinsics the kernels have always
 * called, so the AVX2 build computes what it did. */
#if defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec8;
static inline vec8 vzero8(void) { return _mm256_setzero_ps(); }
static inline vec8 vload8(const float *p) { return _mm256_loadu_ps(p); }
static inline vec8 vload_bf16_8(const uint16_t *p) {  /* 8 bfloat16 widened */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void vstore8(float *p, vec8 x) { _mm256_storeu_ps(p, x); }
static inline vec8 vset8(float x) { return _mm256_set1_ps(x); }
static inline vec8 vbroadcast8(const float *p) { return _mm256_broadcast_ss(p); }
static inline vec8 vfmadd8(vec8 a, vec8 b, vec8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec8 vmul8(vec8 a, vec8 b) { return _mm256_mul_ps(a, b); }
static inline vec8 vadd8(vec8 a, vec8 b) { return _mm256_add_ps(a, b); }
static inline vec8 vsub8(vec8 a, vec8 b) { return _mm256_sub_ps(a, b); }
static inline vec8 vmax8(vec8 a, vec8 b) { return _mm256_max_ps(a, b); }

static inline float vsum8(vec8 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float vmax_lanes8(vec8 v) {
    float lanes[8], top = -FLT_MAX;
    _mm256_storeu_ps(lanes, v);
    for (int l = 0; l < 8; ++l) top = lanes[l] > top ? lanes[l] : top;
    return top;
}

static inline vec8 vfloor8(vec8 x) { return _mm256_floor_ps(x); }
/* 2^n for whole n in [-126, 127], built in the exponent bits */
static inline vec8 vpow2_8(vec8 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
/* e where x >= limit, 0 elsewhere */
static inline vec8 vkeep_from8(vec8 x, float limit, vec8 e) {
    return _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_GE_OQ));
}
static inline vec8 vdiv8(vec8 a, vec8 b) { return _mm256_div_ps(a, b); }
static inline vec8 vneg_abs8(vec8 x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.f)); }  /* -|x| */
/* a where x < 0, b elsewhere */
static inline vec8 vif_negative8(vec8 x, vec8 a, vec8 b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
/* bfloat16 bits of each lane, rounded as f32_to_bf16 rounds, in the low 16 bits of 32 */
static inline __m256i vround_bf16_8(vec8 x) {
    const __m256i u = _mm256_castps_si256(x), high = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
static inline void vstore_bf16_8(uint16_t *p, vec8 x) {  /* 8 floats rounded to bfloat16 */
    const __m256i packed = _mm256_packus_epi32(vround_bf16_8(x), _mm256_setzero_si256());
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
#endif

#if defined(__AVX512F__)
typedef __m512 vec16;
static inline vec16 vzero16(void) { return _mm512_setzero_ps(); }
static inline vec16 vload16(const float *p) { return _mm512_loadu_ps(p); }
static inline vec16 vload_bf16_16(const uint16_t *p) {  /* 16 bfloat16 widened */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void vstore16(float *p, vec16 x) { _mm512_storeu_ps(p, x); }
static inline vec16 vset16(float x) { return _mm512_set1_ps(x); }
static inline vec16 vbroadcast16(const float *p) { return _mm512_set1_ps(*p); }
static inline vec16 vfmadd16(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec16 vmul16(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
static inline vec16 vadd16(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
static inline vec16 vsub16(vec16 a, vec16 b) { return _mm512_sub_ps(a, b); }
static inline vec16 vmax16(vec16 a, vec16 b) { return _mm512_max_ps(a, b); }
static inline float vsum16(vec16 v) { return _mm512_reduce_add_ps(v); }
static inline float vmax_lanes16(vec16 v) { return _mm512_reduce_max_ps(v); }

static inline vec16 vfloor16(vec16 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
static inline vec16 vpow2_16(vec16 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vec16 vkeep_from16(vec16 x, float limit, vec16 e) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_GE_OQ), e);
}
static inline vec16 vdiv16(vec16 a, vec16 b) { return _mm512_div_ps(a, b); }
static inline vec16 vneg_abs16(vec16 x) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}
static inline vec16 vif_negative16(vec16 x, vec16 a, vec16 b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
}
static inline void vstore_bf16_16(uint16_t *p, vec16 x) {  /* 16 floats rounded as f32_to_bf16 */
    _mm256_storeu_si256((__m256i *)p, narrow_bf16_16(x));
}
#endif

/* exp##W##_nonpositive: exp_nonpositive on W lanes, and 0 where x < -60 (as the scalar
 * loop below). */
#define DEFINE_EXP_NONPOSITIVE(W)                                                            \
    static inline vec##W exp##W##_nonpositive(vec##W x) {                                    \
        const vec##W n = vfloor##W(vadd##W(vmul##W(x, vset##W(1.44269504088896341f)), vset##W(0.5f))); \
        const vec##W r = vadd##W(vsub##W(x, vmul##W(n, vset##W(0.693359375f))),               \
                                 vmul##W(n, vset##W(2.12194440e-4f)));                         \
        vec##W p = vset##W(1.9875691500e-4f);                                                \
        p = vfmadd##W(p, r, vset##W(1.3981999507e-3f));                                      \
        p = vfmadd##W(p, r, vset##W(8.3334519073e-3f));                                      \
        p = vfmadd##W(p, r, vset##W(4.1665795894e-2f));                                      \
        p = vfmadd##W(p, r, vset##W(1.6666665459e-1f));                                      \
        p = vfmadd##W(p, r, vset##W(5.0000001201e-1f));                                      \
        p = vadd##W(vfmadd##W(vmul##W(p, r), r, r), vset##W(1.0f));                          \
        return vkeep_from##W(x, -60.f, vmul##W(p, vpow2_##W(n)));                            \
    }

/* softmax_weights##W: row[t] = e^(row[t] - max(row)) over row[0..len), in place (0 below
 * e^-60, as attend_one), W lanes at a time; returns their sum: softmax's weights before
 * dividing. The max too goes W lanes at a time (a scalar max is one dependent chain
 * through the row); vmax(x, m) is x > m ? x : m, as the scalar tail, so the same value
 * comes out. */
#define DEFINE_SOFTMAX_WEIGHTS(W)                                                            \
    static inline float softmax_weights##W(float *row, int64_t len) {                        \
        float top = -FLT_MAX, total = 0.f;                                                   \
        vec##W max_w = vset##W(-FLT_MAX);                                                    \
        int64_t t = 0;                                                                       \
        for (; t + W <= len; t += W) max_w = vmax##W(vload##W(row + t), max_w);              \
        for (; t < len; ++t) top = row[t] > top ? row[t] : top;                              \
        const float lanes_top = vmax_lanes##W(max_w);                                        \
        top = lanes_top > top ? lanes_top : top;                                             \
        const vec##W top_w = vset##W(top);                                                   \
        vec##W total_w = vzero##W();                                                         \
        for (t = 0; t + W <= len; t += W) {                                                  \
            const vec##W e = exp##W##_nonpositive(vsub##W(vload##W(row + t), top_w));        \
            vstore##W(row + t, e);                                                           \
            total_w = vadd##W(total_w, e);                                                   \
        }                                                                                    \
        for (; t < len; ++t) {                                                               \
            const float shifted = row[t] - top;                                              \
            row[t] = shifted < -60.f ? 0.f : exp_nonpositive(shifted);                       \
            total += row[t];                                                                 \
        }                                                                                    \
        return total + vsum##W(total_w);                                                     \
    }

/* attend_one_x##W##SUFFIX: attend_one in W-float vectors, for head_dim a multiple of W,
 * over caches of T whose rows LOAD##W widens to floats (float32's, and bfloat16's). Tokens
 * are the outer loop, so each token's keys (then values) of all KV heads are read in one
 * pass, in the order the cache holds them: front to back through each block. The blocks
 * lie anywhere in the cache, where the hardware's prefetchers do not follow, so while a
 * block's keys are scored the next block's keys and this block's values are prefetched,
 * a token's rows at a time (32 sequences of 40-80 tokens, SmolLM2's heads, each layer's
 * cache read cold, float32: 0.455 ms a layer where 0.558 without). q is float32; scores
 * (num_heads, len) is scratch; out (float32) accumulates in place. */
#define DEFINE_ATTEND_ONE(W, SUFFIX, T, LOAD)                                                \
    static void attend_one_x##W##SUFFIX(const float *q, const T *k_cache, const T *v_cache,  \
                                        const int64_t *table, int64_t len, const Cache *c,   \
                                        float *out, float *scores) {                         \
        const int64_t group = c->num_heads / c->num_kv_heads, dim = c->head_dim;             \
        const int64_t size = c->block_size, stride = c->num_kv_heads * dim;                  \
        const int64_t line = 64 / (int64_t)sizeof(T);                                        \
        for (int64_t first = 0, b = 0; first < len; first += size, ++b) {                    \
            const T *keys_block = k_cache + table[b] * size * stride;                        \
            const T *values_block = v_cache + table[b] * size * stride;                      \
            const T *next_keys = first + size < len ? k_cache + table[b + 1] * size * stride \
                                                    : NULL;                                  \
            const int64_t tokens = len - first < size ? len - first : size;                  \
            for (int64_t i = 0; i < tokens; ++i) {                                           \
                const T *keys = keys_block + i * stride;                                     \
                for (int64_t l = 0; l < stride; l += line) {                                 \
                    if (next_keys != NULL)                                                   \
                        _mm_prefetch((const char *)(next_keys + i * stride + l), _MM_HINT_T0); \
                    _mm_prefetch((const char *)(values_block + i * stride + l), _MM_HINT_T1); \
                }                                                                            \
                for (int64_t h = 0; h < c->num_heads; ++h) {                                 \
                    const float *qh = q + h * dim;                                           \
                    const T *k = keys + (h / group) * dim;                                   \
                    vec##W dot = vzero##W();                                                 \
                    for (int64_t d = 0; d < dim; d += W)                                     \
                        dot = vfmadd##W(vload##W(qh + d), LOAD##W(k + d), dot);              \
                    scores[h * len + first + i] = vsum##W(dot) * c->scale;                   \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int64_t h = 0; h < c->num_heads; ++h) {                                         \
            float *row = scores + h * len;                                                   \
            const float inverse = 1.f / softmax_weights##W(row, len);                        \
            for (int64_t t = 0; t < len; ++t) row[t] *= inverse;                             \
        }                                                                                    \
        memset(out, 0, sizeof(float) * (size_t)(c->num_heads * dim));                        \
        for (int64_t first = 0, b = 0; first < len; first += size, ++b) {                    \
            const T *values_block = v_cache + table[b] * size * stride;                      \
            const int64_t tokens = len - first < size ? len - first : size;                  \
            for (int64_t i = 0; i < tokens; ++i) {                                           \
                const T *values = values_block + i * stride;                                 \
                for (int64_t h = 0; h < c->num_heads; ++h) {                                 \
                    const T *v = values + (h / group) * dim;                                 \
                    const vec##W weight = vset##W(scores[h * len + first + i]);              \
                    float *o = out + h * dim;                                                \
                    for (int64_t d = 0; d < dim; d += W)                                     \
                        vstore##W(o + d, vfmadd##W(weight, LOAD##W(v + d), vload##W(o + d))); \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

#if defined(__AVX2__) && defined(__FMA__)
DEFINE_EXP_NONPOSITIVE(8)
DEFINE_SOFTMAX_WEIGHTS(8)
DEFINE_ATTEND_ONE(8, , float, vload)
DEFINE_ATTEND_ONE(8, _bf16, uint16_t, vload_bf16_)
#endif
#if defined(__AVX512F__)
DEFINE_EXP_NONPOSITIVE(16)
DEFINE_SOFTMAX_WEIGHTS(16)
DEFINE_ATTEND_ONE(16, , float, vload)
DEFINE_ATTEND_ONE(16, _bf16, uint16_t, vload_bf16_)
#endif

/* A row of scores made its softmax weights, in the widest vectors the build has. A
 * weight below e^-60 of the largest is taken as 0: a smaller one would make subnormal
 * products in the sum over values, each ~100x slower. */
static void softmax_in_place(float *row, int64_t len) {
#if defined(__AVX512F__)
    const float total = softmax_weights16(row, len);
#elif defined(__AVX2__) && defined(__FMA__)
    const float total = softmax_weights8(row, len);
#else
    float top = -FLT_MAX, total = 0.f;
    for (int64_t t = 0; t < len; ++t) top = row[t] > top ? row[t] : top;
    for (int64_t t = 0; t < len; ++t) {
        const float shifted = row[t] - top;
        row[t] = shifted < -60.f ? 0.f : exp_nonpositive(shifted);
        total += row[t];
    }
#endif
    const float inverse = 1.f / total;
    for (int64_t t = 0; t < len; ++t) row[t] *= inverse;
}

/* attend##SUFFIX: one sequence's attention over caches of T (float32's, bfloat16's), by
 * the widest vector loops head_dim allows, else attend_one's scalar loops. */
#define ATTEND_IN(W, SUFFIX)                                                                 \
    if (c->head_dim % W == 0) {                                                              \
        attend_one_x##W##SUFFIX(q, k_cache, v_cache, table, len, c, out, scores);            \
        return;                                                                              \
    }
#if defined(__AVX512F__)
#define ATTEND_X16(SUFFIX) ATTEND_IN(16, SUFFIX)
#else
#define ATTEND_X16(SUFFIX)
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define ATTEND_X8(SUFFIX) ATTEND_IN(8, SUFFIX)
#else
#define ATTEND_X8(SUFFIX)
#endif
#define DEFINE_ATTEND(SUFFIX, T)                                                             \
    static void attend##SUFFIX(const float *q, const T *k_cache, const T *v_cache,           \
                               const int64_t *table, int64_t len, const Cache *c, float *out, \
                               float *scores) {                                              \
        ATTEND_X16(SUFFIX)                                                                   \
        ATTEND_X8(SUFFIX)                                                                    \
        attend_one##SUFFIX(q, k_cache, v_cache, table, len, c, out, scores);                 \
    }

DEFINE_ATTEND(, float)
DEFINE_ATTEND(_bf16, uint16_t)

/* Returns 0, or -1 when scratch memory could not be allocated (out is then partial). */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *tables, const int64_t *context_lens, int64_t batch,
                     int64_t max_blocks, int64_t block_size, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, float scale, float *out,
                     int num_threads) {
    const Cache c = {block_size, num_heads, num_kv_heads, head_dim, scale};
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = context_lens[b] > longest ? context_lens[b] : longest;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * (longest > 0 ? longest : 1)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            if (scores == NULL) {
                failed = 1;
                continue;
            }
            attend(q + b * num_heads * head_dim, k_cache, v_cache, tables + b * max_blocks,
                   context_lens[b], &c, out + b * num_heads * head_dim, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* VEC_W: the widest vectors of this build (undefined where it has none); VEC_OP(vload,
 * VEC_W) is vload16 or vload8. */
#if defined(__AVX512F__)
#define VEC_W 16
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_W 8
#endif
#define VEC_CAT(a, b) a##b
#define VEC_OP(op, w) VEC_CAT(op, w)

/* RMSNorm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; rms_norm_f32 for float32
 * rows and weight, rms_norm_bf16 for bfloat16 ones (float32 inside, each result rounded
 * once). x rows are row_stride elements apart; out is contiguous. The sum of squares runs
 * in two accumulators of VEC_W floats (where the build has no vectors, in double, one
 * element at a time). The norms of a bfloat16 64 x 32 prefill of SmolLM2 took 27 ms
 * where they took 40 with the double sum and scalar loops (engine_profile.py). */
#ifdef VEC_W
typedef float rms_sum_t;
#define RMS_SQUARES_VECTORS(LOAD)                                                              \
    {                                                                                          \
        VEC_OP(vec, VEC_W) a0 = VEC_OP(vzero, VEC_W)(), a1 = VEC_OP(vzero, VEC_W)();           \
        for (; d + 2 * VEC_W <= dim; d += 2 * VEC_W) {                                         \
            const VEC_OP(vec, VEC_W) v0 = VEC_OP(LOAD, VEC_W)(row + d);                        \
            const VEC_OP(vec, VEC_W) v1 = VEC_OP(LOAD, VEC_W)(row + d + VEC_W);                \
            a0 = VEC_OP(vfmadd, VEC_W)(v0, v0, a0);                                            \
            a1 = VEC_OP(vfmadd, VEC_W)(v1, v1, a1);                                            \
        }                                                                                      \
        squares = VEC_OP(vsum, VEC_W)(VEC_OP(vadd, VEC_W)(a0, a1));                            \
    }
#define RMS_SCALE_VECTORS(LOAD, STORE)                                                         \
    {                                                                                          \
        const VEC_OP(vec, VEC_W) inverse_w = VEC_OP(vset, VEC_W)(inverse);                     \
        for (; d + VEC_W <= dim; d += VEC_W)                                                   \
            VEC_OP(STORE, VEC_W)(o + d, VEC_OP(vmul, VEC_W)(                                   \
                VEC_OP(vmul, VEC_W)(VEC_OP(LOAD, VEC_W)(row + d), inverse_w),                  \
                VEC_OP(LOAD, VEC_W)(weight + d)));                                             \
    }
#else
typedef double rms_sum_t;
#define RMS_SQUARES_VECTORS(LOAD)
#define RMS_SCALE_VECTORS(LOAD, STORE)
#endif
#define DEFINE_RMS_NORM(NAME, T, WIDEN, NARROW, LOAD, STORE)                                  \
    void NAME(const T *x, int64_t row_stride, const T *weight, T *out, int64_t rows,          \
              int64_t dim, float eps) {                                                        \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            const T *row = x + r * row_stride;                                                 \
            rms_sum_t squares = 0;                                                             \
            int64_t d = 0;                                                                     \
            RMS_SQUARES_VECTORS(LOAD)                                                          \
            for (; d < dim; ++d) squares += (rms_sum_t)WIDEN(row[d]) * WIDEN(row[d]);          \
            const float inverse = (float)(1.0 / sqrt((double)squares / (double)dim + (double)eps)); \
            T *o = out + r * dim;                                                              \
            d = 0;                                                                             \
            RMS_SCALE_VECTORS(LOAD, STORE)                                                     \
            for (; d < dim; ++d) o[d] = NARROW(WIDEN(row[d]) * inverse * WIDEN(weight[d]));    \
        }                                                                                      \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, as_float, as_float, vload, vstore)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16, vload_bf16_, vstore_bf16_)

/* paged_decode_bf16: paged_decode_f32's attention for bfloat16 q, caches and out, in
 * float32 inside (`attend_bf16`: each key and value widened as it is loaded); each
 * sequence's q widened first and its output rounded once. MAX_BF16_HEAD_DIM floats a
 * head at most, else -2 and torch's path runs. */
#define MAX_BF16_HEAD_DIM 512

/* Returns 0, -1 when scratch memory could not be allocated (out is then partial), -2
 * when head_dim is over MAX_BF16_HEAD_DIM (nothing written). */
int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int64_t *tables, const int64_t *context_lens, int64_t batch,
                      int64_t max_blocks, int64_t block_size, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, float scale, uint16_t *out,
                      int num_threads) {
    if (head_dim > MAX_BF16_HEAD_DIM) return -2;
    const Cache c = {block_size, num_heads, num_kv_heads, head_dim, scale};
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = context_lens[b] > longest ? context_lens[b] : longest;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * (longest > 0 ? longest : 1)));
        float *acc = malloc(sizeof(float) * (size_t)(num_heads * head_dim));
        float *qf = malloc(sizeof(float) * (size_t)(num_heads * head_dim));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            if (scores == NULL || acc == NULL || qf == NULL) {
                failed = 1;
                continue;
            }
            const uint16_t *qb = q + b * num_heads * head_dim;
            uint16_t *ob = out + b * num_heads * head_dim;
            for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = bf16_to_f32(qb[i]);
            attend_bf16(qf, k_cache, v_cache, tables + b * max_blocks, context_lens[b], &c, acc,
                        scores);
            for (int64_t i = 0; i < num_heads * head_dim; ++i) ob[i] = f32_to_bf16(acc[i]);
        }
        free(scores);
        free(acc);
        free(qf);
    }
    return failed ? -1 : 0;
}

#define PANEL 16   /* output features per packed panel: two vectors of 8 floats */
#define MAX_ROWS 6 /* rows of x per block: 6 x 2 accumulators + 2 panel vectors + 1 broadcast */

#if defined(__AVX2__) && defined(__FMA__)
int packed_linear_supported(void) { return 1; }

/* c (rows, cols <= PANEL) = a (rows, k) x panel (k, PANEL) (+ bias), rows a constant
 * once inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_times_panel(
    const int rows, const float *a, int64_t lda, const float *panel, int64_t k,
    const float *bias, float *c, int64_t ldc, int64_t cols) {
    __m256 lo[MAX_ROWS], hi[MAX_ROWS];
    float edge[PANEL] = {0};
    if (bias != NULL) memcpy(edge, bias, (size_t)cols * sizeof(float));
    const __m256 lo0 = _mm256_loadu_ps(edge), hi0 = _mm256_loadu_ps(edge + 8);
#pragma GCC unroll 6
    for (int r = 0; r < rows; ++r) {
        lo[r] = lo0;
        hi[r] = hi0;
    }
    for (int64_t j = 0; j < k; ++j) {
        const __m256 w_lo = _mm256_load_ps(panel + j * PANEL);
        const __m256 w_hi = _mm256_load_ps(panel + j * PANEL + 8);
#pragma GCC unroll 6
        for (int r = 0; r < rows; ++r) {
            const __m256 x = _mm256_broadcast_ss(a + r * lda + j);
            lo[r] = _mm256_fmadd_ps(x, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(x, w_hi, hi[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; ++r) {
        if (cols == PANEL) {
            _mm256_storeu_ps(c + r * ldc, lo[r]);
            _mm256_storeu_ps(c + r * ldc + 8, hi[r]);
        } else {
            _mm256_storeu_ps(edge, lo[r]);
            _mm256_storeu_ps(edge + 8, hi[r]);
            memcpy(c + r * ldc, edge, (size_t)cols * sizeof(float));
        }
    }
}

static void rows_times_panel(int rows, const float *a, int64_t lda, const float *panel,
                             int64_t k, const float *bias, float *c, int64_t ldc, int64_t cols) {
    switch (rows) {
    case 6: block_times_panel(6, a, lda, panel, k, bias, c, ldc, cols); break;
    case 5: block_times_panel(5, a, lda, panel, k, bias, c, ldc, cols); break;
    case 4: block_times_panel(4, a, lda, panel, k, bias, c, ldc, cols); break;
    case 3: block_times_panel(3, a, lda, panel, k, bias, c, ldc, cols); break;
    case 2: block_times_panel(2, a, lda, panel, k, bias, c, ldc, cols); break;
    default: block_times_panel(1, a, lda, panel, k, bias, c, ldc, cols); break;
    }
}

/* c (rows <= 2, 16) of two panels at once, first and second = a x panel (+ bias): two
 * streams of the weight in flight, where one row's few FMAs per cache line leave a single
 * stream waiting on memory. */
static inline __attribute__((always_inline)) void rows_times_two_panels(
    const int rows, const float *a, int64_t lda, const float *first, const float *second,
    int64_t k, const float *bias_first, const float *bias_second, float *c_first,
    float *c_second, int64_t ldc) {
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int r = 0; r < rows; ++r) {
        acc[r][0] = bias_first != NULL ? _mm256_loadu_ps(bias_first) : _mm256_setzero_ps();
        acc[r][1] = bias_first != NULL ? _mm256_loadu_ps(bias_first + 8) : _mm256_setzero_ps();
        acc[r][2] = bias_second != NULL ? _mm256_loadu_ps(bias_second) : _mm256_setzero_ps();
        acc[r][3] = bias_second != NULL ? _mm256_loadu_ps(bias_second + 8) : _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < k; ++j) {
        const __m256 w0 = _mm256_load_ps(first + j * PANEL), w1 = _mm256_load_ps(first + j * PANEL + 8);
        const __m256 w2 = _mm256_load_ps(second + j * PANEL), w3 = _mm256_load_ps(second + j * PANEL + 8);
#pragma GCC unroll 2
        for (int r = 0; r < rows; ++r) {
            const __m256 x = _mm256_broadcast_ss(a + r * lda + j);
            acc[r][0] = _mm256_fmadd_ps(x, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(x, w2, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(x, w3, acc[r][3]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < rows; ++r) {
        _mm256_storeu_ps(c_first + r * ldc, acc[r][0]);
        _mm256_storeu_ps(c_first + r * ldc + 8, acc[r][1]);
        _mm256_storeu_ps(c_second + r * ldc, acc[r][2]);
        _mm256_storeu_ps(c_second + r * ldc + 8, acc[r][3]);
    }
}

#if defined(__AVX512F__)
#define MAX_ROWS_512 12 /* 12 x 2 accumulators + 2 panel vectors + 1 broadcast of 32 zmm */

/* c (rows, cols <= 2 PANEL) = a (rows, k) x [panel | the panel after it] (+ bias), the
 * second panel only when `two` (cols <= PANEL otherwise); rows and two constants once
 * inlined, so the accumulators stay in registers. A partial panel is stored by mask. */
static inline __attribute__((always_inline)) void block_times_panels_512(
    const int rows, const int two, const float *a, int64_t lda, const float *panel,
    int64_t k, const float *bias, float *c, int64_t ldc, int64_t cols, const float *ahead) {
    __m512 first[MAX_ROWS_512], second[MAX_ROWS_512];
    const __mmask16 mask0 = cols >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1u);
    const __mmask16 mask1 = !two || cols <= PANEL ? (__mmask16)0
        : cols >= 2 * PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - PANEL)) - 1u);
    const __m512 bias0 = bias != NULL ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
    const __m512 bias1 = bias != NULL && two ? _mm512_maskz_loadu_ps(mask1, bias + PANEL)
                                             : _mm512_setzero_ps();
    const float *next = panel + k * PANEL;
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r) {
        first[r] = bias0;
        second[r] = bias1;
    }
    for (int64_t j = 0; j < k; ++j) {
        const __m512 w0 = _mm512_loadu_ps(panel + j * PANEL);
        const __m512 w1 = two ? _mm512_loadu_ps(next + j * PANEL) : w0;
        if (ahead != NULL) {  /* a hint: past the last panel it reads nothing */
            _mm_prefetch((const char *)(ahead + 2 * j * PANEL), _MM_HINT_T0);
            _mm_prefetch((const char *)(ahead + (2 * j + 1) * PANEL), _MM_HINT_T0);
        }
#pragma GCC unroll 12
        for (int r = 0; r < rows; ++r) {
            const __m512 x = _mm512_set1_ps(a[r * lda + j]);
            first[r] = _mm512_fmadd_ps(x, w0, first[r]);
            if (two) second[r] = _mm512_fmadd_ps(x, w1, second[r]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r) {
        _mm512_mask_storeu_ps(c + r * ldc, mask0, first[r]);
        if (two) _mm512_mask_storeu_ps(c + r * ldc + PANEL, mask1, second[r]);
    }
}

#define ROWS_CASE_512(n)                                                                     \
    case n:                                                                                  \
        if (two) block_times_panels_512(n, 1, a, lda, panel, k, bias, c, ldc, cols, ahead); \
        else block_times_panels_512(n, 0, a, lda, panel, k, bias, c, ldc, cols, ahead);     \
        break;

static void rows_times_panels_512(int rows, int two, const float *a, int64_t lda,
                                  const float *panel, int64_t k, const float *bias, float *c,
                                  int64_t ldc, int64_t cols, const float *ahead) {
    switch (rows) {
    ROWS_CASE_512(12) ROWS_CASE_512(11) ROWS_CASE_512(10) ROWS_CASE_512(9)
    ROWS_CASE_512(8) ROWS_CASE_512(7) ROWS_CASE_512(6) ROWS_CASE_512(5)
    ROWS_CASE_512(4) ROWS_CASE_512(3) ROWS_CASE_512(2)
    default: ROWS_CASE_512(1)
    }
}

/* packed_linear_f32's rows (three or more) two panels at a time, blocks of at most
 * MAX_ROWS_512 rows evened out; an odd last panel alone. */
static void packed_linear_512(const float *a, int64_t lda, int64_t m, const float *packed,
                              int64_t n, int64_t k, const float *bias, float *c, int64_t ldc,
                              int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, pairs = (panels + 1) / 2;
    const int64_t blocks = (m + MAX_ROWS_512 - 1) / MAX_ROWS_512;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
        const int64_t p = 2 * pair, left = n - p * PANEL;
        const int64_t cols = left < 2 * PANEL ? left : 2 * PANEL;
        const int two = p + 1 < panels;
        int64_t first = 0;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t rows = (m - first + (blocks - b) - 1) / (blocks - b);
            rows_times_panels_512((int)rows, two, a + first * lda, lda, packed + p * k * PANEL,
                                  k, bias != NULL ? bias + p * PANEL : NULL,
                                  c + first * ldc + p * PANEL, ldc, cols,
                                  b == blocks - 1 && p + 2 < panels ? packed + (p + 2) * k * PANEL : NULL);
            first += rows;
        }
    }
}
#endif

/* packed (whole panels: n rounded up to 16, times k floats; 32-byte aligned) from W (n, k),
 * row-major; the last panel's missing features are zeros. */
int pack_linear_f32(const float *w, int64_t n, int64_t k, float *packed) {
    for (int64_t p = 0; p < (n + PANEL - 1) / PANEL; ++p)
        for (int64_t j = 0; j < k; ++j)
            for (int64_t f = 0; f < PANEL; ++f) {
                const int64_t feature = p * PANEL + f;
                packed[(p * k + j) * PANEL + f] = feature < n ? w[feature * k + j] : 0.f;
            }
    return 0;
}

/* c (m, n), rows ldc floats apart = a (m, k), rows lda apart, x W^T (+ bias (n,) or NULL). */
int packed_linear_f32(const float *a, int64_t lda, int64_t m, const float *packed, int64_t n,
                      int64_t k, const float *bias, float *c, int64_t ldc, int num_threads) {
#if defined(__AVX512F__)
    if (m > 2) {
        packed_linear_512(a, lda, m, packed, n, k, bias, c, ldc, num_threads);
        return 0;
    }
#endif
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = (m + MAX_ROWS - 1) / MAX_ROWS;
    /* One or two rows: whole panels p and p + half side by side (the last, partial or odd
     * panel goes the usual way below). */
    const int64_t half = m <= 2 ? (n / PANEL) / 2 : 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t p = 0; p < half; ++p) {
        const float *first = packed + p * k * PANEL, *second = packed + (p + half) * k * PANEL;
        const float *b0 = bias != NULL ? bias + p * PANEL : NULL;
        const float *b1 = bias != NULL ? bias + (p + half) * PANEL : NULL;
        if (m == 2)
            rows_times_two_panels(2, a, lda, first, second, k, b0, b1, c + p * PANEL,
                                  c + (p + half) * PANEL, ldc);
        else
            rows_times_two_panels(1, a, lda, first, second, k, b0, b1, c + p * PANEL,
                                  c + (p + half) * PANEL, ldc);
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t p = 2 * half; p < panels; ++p) {
        const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        int64_t first = 0;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t rows = (m - first + (blocks - b) - 1) / (blocks - b);
            rows_times_panel((int)rows, a + first * lda, lda, packed + p * k * PANEL, k,
                             bias != NULL ? bias + p * PANEL : NULL, c + first * ldc + p * PANEL,
                             ldc, cols);
            first += rows;
        }
    }
    return 0;
}
#else
int packed_linear_supported(void) { return 0; }
int pack_linear_f32(const float *w, int64_t n, int64_t k, float *packed) { return -1; }
int packed_linear_f32(const float *a, int64_t lda, int64_t m, const float *packed, int64_t n,
                      int64_t k, const float *bias, float *c, int64_t ldc, int num_threads) {
    return -1;
}
#endif

/* SwiGLU in place, float32: silu(gate[j]) * up[j] for each row of a fused gate_up
 * product (row r at x + r * row_stride: `width` gate floats, then `width` up floats), one
 * pass where torch's silu_ then mul_ read the gate twice. Row r's result goes over its
 * gate, or with `compact` to x + r * width: the results then form one contiguous (rows,
 * width) matrix at x, which the next GEMM reads without copying it first (a row's result
 * only overwrites rows already read, so compact rows run in order, on one thread).
 * silu(g) = g * sigmoid(g), the sigmoid from e = e^-|g| (never overflows): 1 / (1 + e)
 * for g >= 0, e / (1 + e) below (0 below -60, as exp_nonpositive's vector form). Rows
 * otherwise run in parallel over `num_threads` OpenMP threads. */
static inline float sigmoid_from(float g, float e) { return (g >= 0.f ? 1.f : e) / (1.f + e); }

/* swiglu rows of T (float32's, bfloat16's widened as LOAD loads them and rounded once as
 * STORE stores them): VEC_W lanes at a time where the build has vectors, the tail one
 * by one. A (2048, 2 x 1536) gate_up product took 1.97 ms in 16 lanes where it took 2.45
 * in 8 (float32), and 1.76 where 2.62 in bfloat16 (widened into row buffers, then 8
 * lanes). The division bounds it: a reciprocal estimate would change the results. */
#ifdef VEC_W
#define SWIGLU_VECTORS(LOAD, STORE)                                                            \
    {                                                                                          \
        const VEC_OP(vec, VEC_W) one = VEC_OP(vset, VEC_W)(1.f);                               \
        for (; j + VEC_W <= width; j += VEC_W) {                                               \
            const VEC_OP(vec, VEC_W) g = VEC_OP(LOAD, VEC_W)(gate + j);                        \
            const VEC_OP(vec, VEC_W) e =  /* e^-|g| */                                         \
                VEC_OP(VEC_OP(exp, VEC_W), _nonpositive)(VEC_OP(vneg_abs, VEC_W)(g));          \
            const VEC_OP(vec, VEC_W) sig = VEC_OP(vdiv, VEC_W)(                                \
                VEC_OP(vif_negative, VEC_W)(g, e, one), VEC_OP(vadd, VEC_W)(one, e));          \
            VEC_OP(STORE, VEC_W)(out + j, VEC_OP(vmul, VEC_W)(VEC_OP(vmul, VEC_W)(g, sig),     \
                                                              VEC_OP(LOAD, VEC_W)(up + j)));   \
        }                                                                                      \
    }
#else
#define SWIGLU_VECTORS(LOAD, STORE)
#endif
#define DEFINE_SWIGLU_ROW(NAME, T, WIDEN, NARROW, LOAD, STORE)                                  \
    static void NAME(const T *gate, const T *up, T *out, int64_t width) {                      \
        int64_t j = 0;                                                                         \
        SWIGLU_VECTORS(LOAD, STORE)                                                            \
        for (; j < width; ++j) {                                                               \
            const float g = WIDEN(gate[j]), minus = -fabsf(g);                                 \
            const float e = minus < -60.f ? 0.f : exp_nonpositive(minus);                      \
            out[j] = NARROW(g * sigmoid_from(g, e) * WIDEN(up[j]));                            \
        }                                                                                      \
    }

DEFINE_SWIGLU_ROW(swiglu_row, float, as_float, as_float, vload, vstore)
DEFINE_SWIGLU_ROW(swiglu_row_bf16, uint16_t, bf16_to_f32, f32_to_bf16, vload_bf16_, vstore_bf16_)

void swiglu_f32(float *x, int64_t row_stride, int64_t rows, int64_t width, int compact,
                int num_threads) {
    if (compact) {
        for (int64_t r = 0; r < rows; ++r)
            swiglu_row(x + r * row_stride, x + r * row_stride + width, x + r * width, width);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t r = 0; r < rows; ++r)
        swiglu_row(x + r * row_stride, x + r * row_stride + width, x + r * row_stride, width);
}

/* SwiGLU in place, bfloat16: as swiglu_f32, float32 inside, each result rounded once.
 * Returns 0. */
int swiglu_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t width, int compact,
                int num_threads) {
    if (compact) {
        for (int64_t r = 0; r < rows; ++r)
            swiglu_row_bf16(x + r * row_stride, x + r * row_stride + width, x + r * width, width);
        return 0;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t r = 0; r < rows; ++r)
        swiglu_row_bf16(x + r * row_stride, x + r * row_stride + width, x + r * row_stride, width);
    return 0;
}

/* Rotary positions in place, HF's half-split form as the torch path computes it: x =
 * (x1, x2) halves of each head, x' = x * cos + (x2, x1) * sin_signed. Row r (a token)
 * holds `heads` heads of head_dim elements at x + r * row_stride; cos and sin_signed hold
 * the token's (head_dim) row each, contiguous: cos repeats its half, sin is negated in
 * its first half (`RotaryEmbedding.table`). rotary_f32 for float32 x and table,
 * rotary_bf16 for bfloat16 ones (float32 inside, each result rounded once). Each half
 * goes in the build's widest vectors, a fused multiply-add per result as in the tail. */
#ifdef VEC_W
#define ROTARY_VECTORS(T, LOAD, STORE)                                                         \
    for (; d + VEC_W <= half; d += VEC_W) {                                                    \
        const VEC_OP(vec, VEC_W) a = VEC_OP(LOAD, VEC_W)(x1 + d), b = VEC_OP(LOAD, VEC_W)(x2 + d); \
        VEC_OP(STORE, VEC_W)(x1 + d, VEC_OP(vfmadd, VEC_W)(b, VEC_OP(LOAD, VEC_W)(s + d),      \
            VEC_OP(vmul, VEC_W)(a, VEC_OP(LOAD, VEC_W)(c + d))));                               \
        VEC_OP(STORE, VEC_W)(x2 + d, VEC_OP(vfmadd, VEC_W)(a, VEC_OP(LOAD, VEC_W)(s + half + d), \
            VEC_OP(vmul, VEC_W)(b, VEC_OP(LOAD, VEC_W)(c + half + d))));                        \
    }
#else
#define ROTARY_VECTORS(T, LOAD, STORE)
#endif
#define DEFINE_ROTARY(NAME, T, WIDEN, NARROW, LOAD, STORE)                                      \
    void NAME(T *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,         \
              const T *cos, const T *sin_signed, int num_threads) {                            \
        const int64_t half = head_dim / 2;                                                     \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)") \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            const T *c = cos + r * head_dim, *s = sin_signed + r * head_dim;                   \
            for (int64_t h = 0; h < heads; ++h) {                                              \
                T *x1 = x + r * row_stride + h * head_dim, *x2 = x1 + half;                    \
                int64_t d = 0;                                                                 \
                ROTARY_VECTORS(T, LOAD, STORE)                                                 \
                for (; d < half; ++d) {                                                        \
                    const float a = WIDEN(x1[d]), b = WIDEN(x2[d]);                            \
                    x1[d] = NARROW(fmaf(b, WIDEN(s[d]), a * WIDEN(c[d])));                     \
                    x2[d] = NARROW(fmaf(a, WIDEN(s[half + d]), b * WIDEN(c[half + d])));       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_ROTARY(rotary_f32, float, as_float, as_float, vload, vstore)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16, vload_bf16_, vstore_bf16_)

/* prefill_attention_f32: causal attention over a prefill's own new tokens (no cached
 * prefix), sequences side by side without padding: sequence b holds lens[b] rows of q, k
 * and v, after those of the sequences before it. q (T, num_heads, head_dim), k and v (T,
 * num_kv_heads, head_dim), views whose rows are q_stride and kv_stride floats apart (the
 * fused qkv projection's); out (T, num_heads * head_dim), contiguous. Query i of a
 * sequence attends its keys 0..i; query head h reads KV head h / (num_heads /
 * num_kv_heads). AVX2 and FMA, head_dim a multiple of 8; elsewhere it returns -1 and
 * torch's SDPA runs.
 *
 * Per (sequence, KV head), its keys are packed once, transposed, in tiles of 8 keys
 * (tile, head_dim, 8), zero past the last key. The rows attending that KV head, (query
 * i, head h) in order, go in blocks of up to ATTN_ROWS (a query's grouped heads together;
 * for one head per KV head, consecutive queries): scores for 4 tiles of keys at a time
 * (ATTN_ROWS x 4 accumulators, each key vector loaded once for the block's rows), an
 * exact softmax per row over its own keys, then the values summed into ATTN_ROWS x 4
 * accumulators per 32 floats of head_dim, each value vector loaded once for the block.
 * Returns -1 where scratch memory cannot be had. */
#define ATTN_ROWS 3
#define ATTN_TILES 4

/* For W-float vectors (keys packed in tiles of W) and blocks of up to ROWS rows:
 * attention_scores##W: scores[r][tile0 * W ..] = scale * q_r . keys, for `tiles` tiles;
 * attention_values##W: out_r[c .. c + W * vectors) = sum over keys j < n of
 *   p_r[j] * v_j[c ..] * inverse_r;
 * attention_block##W: one block of `rows` rows whose queries see up to n keys.
 * rows, tiles and vectors are constants once inlined. */
#define DEFINE_PREFILL_ATTENTION(W, ROWS)                                                    \
    static inline __attribute__((always_inline)) void attention_scores##W(                   \
        const int rows, const int tiles, const float *const *q, const float *kt,             \
        int64_t tile0, int64_t head_dim, float scale, float *const *scores) {                \
        vec##W acc[ROWS][ATTN_TILES];                                                        \
        for (int r = 0; r < rows; ++r)                                                       \
            for (int t = 0; t < tiles; ++t) acc[r][t] = vzero##W();                          \
        const float *base = kt + tile0 * head_dim * W;                                       \
        for (int64_t d = 0; d < head_dim; ++d) {                                             \
            vec##W keys[ATTN_TILES];                                                         \
            for (int t = 0; t < tiles; ++t) keys[t] = vload##W(base + (t * head_dim + d) * W); \
            for (int r = 0; r < rows; ++r) {                                                 \
                const vec##W x = vbroadcast##W(q[r] + d);                                    \
                for (int t = 0; t < tiles; ++t) acc[r][t] = vfmadd##W(x, keys[t], acc[r][t]); \
            }                                                                                \
        }                                                                                    \
        const vec##W s = vset##W(scale);                                                     \
        for (int r = 0; r < rows; ++r)                                                       \
            for (int t = 0; t < tiles; ++t)                                                  \
                vstore##W(scores[r] + (tile0 + t) * W, vmul##W(acc[r][t], s));               \
    }                                                                                        \
                                                                                             \
    static inline __attribute__((always_inline)) void attention_values##W(                   \
        const int rows, const int vectors, const float *const *p, const float *v,            \
        int64_t kv_stride, int64_t n, const float *inverse, float *const *out, int64_t c) {  \
        vec##W acc[ROWS][ATTN_TILES];                                                        \
        for (int r = 0; r < rows; ++r)                                                       \
            for (int x = 0; x < vectors; ++x) acc[r][x] = vzero##W();                        \
        for (int64_t j = 0; j < n; ++j) {                                                    \
            vec##W values[ATTN_TILES];                                                       \
            for (int x = 0; x < vectors; ++x) values[x] = vload##W(v + j * kv_stride + c + W * x); \
            for (int r = 0; r < rows; ++r) {                                                 \
                const vec##W w = vbroadcast##W(p[r] + j);                                    \
                for (int x = 0; x < vectors; ++x) acc[r][x] = vfmadd##W(w, values[x], acc[r][x]); \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < rows; ++r) {                                                     \
            const vec##W inv = vset##W(inverse[r]);                                          \
            for (int x = 0; x < vectors; ++x)                                                \
                vstore##W(out[r] + c + W * x, vmul##W(acc[r][x], inv));                      \
        }                                                                                    \
    }                                                                                        \
                                                                                             \
    static inline __attribute__((always_inline)) void attention_block##W(                    \
        const int rows, const float *const *q, const int64_t *counts, const float *kt,       \
        const float *v, int64_t kv_stride, int64_t n, int64_t head_dim, float scale,         \
        float *const *scores, float *const *out) {                                           \
        const int64_t tiles = (n + W - 1) / W;                                               \
        int64_t tile = 0;                                                                    \
        for (; tile + ATTN_TILES <= tiles; tile += ATTN_TILES)                               \
            attention_scores##W(rows, ATTN_TILES, q, kt, tile, head_dim, scale, scores);     \
        for (; tile < tiles; ++tile)                                                         \
            attention_scores##W(rows, 1, q, kt, tile, head_dim, scale, scores);              \
        float inverse[ROWS];                                                                 \
        for (int r = 0; r < rows; ++r) { /* softmax over the row's own keys; 0 past them */  \
            inverse[r] = 1.f / softmax_weights##W(scores[r], counts[r]);                     \
            for (int64_t j = counts[r]; j < n; ++j) scores[r][j] = 0.f;                      \
        }                                                                                    \
        int64_t c = 0;                                                                       \
        for (; c + W * ATTN_TILES <= head_dim; c += W * ATTN_TILES)                          \
            attention_values##W(rows, ATTN_TILES, (const float *const *)scores, v, kv_stride, \
                                n, inverse, out, c);                                         \
        for (; c < head_dim; c += W)                                                         \
            attention_values##W(rows, 1, (const float *const *)scores, v, kv_stride, n,      \
                                inverse, out, c);                                            \
    }

#if defined(__AVX2__) && defined(__FMA__)
DEFINE_PREFILL_ATTENTION(8, ATTN_ROWS)
#endif
#if defined(__AVX512F__)
/* In AVX-512 builds (head_dim a multiple of 16), 16-float vectors: keys packed in tiles
 * of 16, blocks of up to ATTN_ROWS_WIDE rows (two queries' grouped heads at SmolLM2's
 * 3), so each key and value vector is loaded once for twice the rows. */
#define ATTN_ROWS_WIDE 6
#define KEY_TILE_WIDE 16
DEFINE_PREFILL_ATTENTION(16, ATTN_ROWS_WIDE)
#else
#define ATTN_ROWS_WIDE ATTN_ROWS
#define KEY_TILE_WIDE 8
#endif

/* one case of prefill_attention_f32's switch on a block's rows: W-float vectors, ROWS
 * rows (a constant, so attention_block##W unrolls for it) */
#define ATTN_BLOCK(W, ROWS)                                                                  \
    case ROWS:                                                                               \
        attention_block##W(ROWS, qs, counts, kt, values, kv_stride, n, head_dim, scale, scores, outs); \
        break;

#if defined(__AVX2__) && defined(__FMA__)
int prefill_attention_f32(const float *q, const float *k, const float *v, const int64_t *lens,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t q_stride, int64_t kv_stride, float scale,
                          float *out, int num_threads) {
    if (head_dim % 8 != 0) return -1;
#if defined(__AVX512F__)
    const int wide = head_dim % 16 == 0;
#else
    const int wide = 0;
#endif
    /* keys per packed tile, and rows per block */
    const int64_t width = wide ? KEY_TILE_WIDE : 8, most_rows = wide ? ATTN_ROWS_WIDE : ATTN_ROWS;
    const int64_t group = num_heads / num_kv_heads;
    int64_t longest = 0, *firsts = malloc(sizeof(int64_t) * (batch > 0 ? batch : 1));
    if (firsts == NULL) return -1;
    for (int64_t b = 0, first = 0; b < batch; first += lens[b], ++b) {
        firsts[b] = first;
        longest = lens[b] > longest ? lens[b] : longest;
    }
    const int64_t padded = (longest + width - 1) / width * width;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed) if (num_threads > 1)
    {
        float *kt = malloc(sizeof(float) * (padded * head_dim + most_rows * padded + 1));
        if (kt == NULL) {
            failed = 1;
        } else {
            float *scratch = kt + padded * head_dim;
#pragma omp for schedule(dynamic)
            for (int64_t task = 0; task < batch * num_kv_heads; ++task) {
                const int64_t b = task / num_kv_heads, g = task % num_kv_heads, len = lens[b];
                const int64_t first = firsts[b], tiles = (len + width - 1) / width;
                for (int64_t j = 0; j < tiles * width; ++j) {  /* keys, transposed by tiles */
                    const float *key = k + (first + j) * kv_stride + g * head_dim;
                    float *column = kt + (j / width) * head_dim * width + j % width;
                    for (int64_t d = 0; d < head_dim; ++d) column[d * width] = j < len ? key[d] : 0.f;
                }
                const float *values = v + first * kv_stride + g * head_dim;
                /* the rows (query i, head h of the group) in order, most_rows at a time */
                for (int64_t row = 0; row < len * group; row += most_rows) {
                    const int rows = (int)(len * group - row < most_rows ? len * group - row : most_rows);
                    const float *qs[ATTN_ROWS_WIDE];
                    float *scores[ATTN_ROWS_WIDE], *outs[ATTN_ROWS_WIDE];
                    int64_t counts[ATTN_ROWS_WIDE], n = 0;
                    for (int r = 0; r < rows; ++r) {
                        const int64_t i = (row + r) / group, h = g * group + (row + r) % group;
                        qs[r] = q + (first + i) * q_stride + h * head_dim;
                        outs[r] = out + ((first + i) * num_heads + h) * head_dim;
                        scores[r] = scratch + r * padded;
                        counts[r] = i + 1;
                        n = i + 1 > n ? i + 1 : n;
                    }
#if defined(__AVX512F__)
                    if (wide) {
                        switch (rows) {
                        ATTN_BLOCK(16, 6) ATTN_BLOCK(16, 5) ATTN_BLOCK(16, 4) ATTN_BLOCK(16, 3)
                        ATTN_BLOCK(16, 2) default: ATTN_BLOCK(16, 1)
                        }
                        continue;
                    }
#endif
                    switch (rows) { ATTN_BLOCK(8, 3) ATTN_BLOCK(8, 2) default: ATTN_BLOCK(8, 1) }
                }
            }
            free(kt);
        }
    }
    free(firsts);
    return failed ? -1 : 0;
}
#else
int prefill_attention_f32(const float *q, const float *k, const float *v, const int64_t *lens,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t q_stride, int64_t kv_stride, float scale,
                          float *out, int num_threads) {
    return -1;
}
#endif

/* llama_decode_f32: a decode step's layers of a Llama on one tp rank, float32, in one call
 * (one new token per sequence, every linear packed: at most PACKED_MAX_ROWS sequences).
 * Each layer runs the kernels above in the order the Python path calls them one by one:
 * RMSNorm, the fused qkv product, rotary on q's and k's heads, k and v written into the
 * layer's cache at each sequence's slot, paged decode attention, the output product added
 * to the residual stream, RMSNorm, the gate_up product, SwiGLU, the down product added to
 * the residual stream; so the hidden states come out bit for bit the same, without the
 * Python and operator dispatch each layer costs there.
 * hidden (batch, hidden_size): the residual stream, updated in place. weights: per layer,
 * 7 pointers: input norm, packed qkv, qkv bias (or NULL), packed o, post-attention norm,
 * packed gate_up, packed down. Layer l's caches start layer_stride floats after layer
 * l - 1's, each (num_blocks, block_size, num_kv_heads, head_dim). cos and sin_signed:
 * each sequence's rotary row (`rotary_f32`). Returns 0; -2, having done nothing, where
 * the kernels cannot run (no AVX2 and FMA); -1 where scratch memory cannot be had or a
 * kernel fails on the way (hidden is then partial). */
static inline float add_f32(float a, float b) { return a + b; }
static inline uint16_t add_bf16(uint16_t a, uint16_t b) {
    return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b));
}

#define DEFINE_LLAMA_DECODE(S, T, SUPPORTED, SWIGLU_ROW)                                       \
    int llama_decode_##S(T *hidden, int64_t batch, int64_t hidden_size, int64_t num_layers,     \
                         const T *const *weights, float eps, T *k_cache, T *v_cache,           \
                         int64_t layer_stride, const int64_t *slots, const int64_t *tables,    \
                         int64_t max_blocks, const int64_t *context_lens, int64_t block_size,  \
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,            \
                         int64_t intermediate, const T *cos, const T *sin_signed,              \
                         float scale, int num_threads) {                                       \
        if (!(SUPPORTED)) return -2;                                                            \
        const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;        \
        const int64_t qkv_size = q_size + 2 * kv_size;                                         \
        const int64_t count = batch * (hidden_size + qkv_size + 2 * q_size + hidden_size       \
                                       + 3 * intermediate);                                    \
        T *scratch = malloc(sizeof(T) * (size_t)(count > 0 ? count : 1));                      \
        if (scratch == NULL) return -1;                                                        \
        T *normed = scratch, *qkv = normed + batch * hidden_size, *q = qkv + batch * qkv_size; \
        T *attended = q + batch * q_size, *projected = attended + batch * q_size;              \
        T *gate_up = projected + batch * hidden_size, *act = gate_up + batch * 2 * intermediate; \
        int failed = 0;                                                                        \
        for (int64_t l = 0; l < num_layers && !failed; ++l) {                                  \
            const T *const *w = weights + 7 * l;                                               \
            T *k_layer = k_cache + l * layer_stride, *v_layer = v_cache + l * layer_stride;    \
            rms_norm_##S(hidden, hidden_size, w[0], normed, batch, hidden_size, eps);          \
            failed |= packed_linear_##S(normed, hidden_size, batch, w[1], qkv_size, hidden_size, \
                                        w[2], qkv, qkv_size, num_threads) != 0;                \
            rotary_##S(qkv, qkv_size, batch, num_heads + num_kv_heads, head_dim, cos,          \
                       sin_signed, num_threads);                                               \
            for (int64_t b = 0; b < batch; ++b) {                                              \
                const T *row = qkv + b * qkv_size;                                             \
                memcpy(q + b * q_size, row, sizeof(T) * (size_t)q_size);                       \
                memcpy(k_layer + slots[b] * kv_size, row + q_size, sizeof(T) * (size_t)kv_size); \
                memcpy(v_layer + slots[b] * kv_size, row + q_size + kv_size,                   \
                       sizeof(T) * (size_t)kv_size);                                           \
            }                                                                                  \
            failed |= paged_decode_##S(q, k_layer, v_layer, tables, context_lens, batch,       \
                                       max_blocks, block_size, num_heads, num_kv_heads,        \
                                       head_dim, scale, attended, num_threads) != 0;           \
            failed |= packed_linear_##S(attended, q_size, batch, w[3], hidden_size, q_size,    \
                                        NULL, projected, hidden_size, num_threads) != 0;       \
            for (int64_t i = 0; i < batch * hidden_size; ++i)                                  \
                hidden[i] = add_##S(hidden[i], projected[i]);                                  \
            rms_norm_##S(hidden, hidden_size, w[4], normed, batch, hidden_size, eps);          \
            failed |= packed_linear_##S(normed, hidden_size, batch, w[5], 2 * intermediate,    \
                                        hidden_size, NULL, gate_up, 2 * intermediate,          \
                                        num_threads) != 0;                                     \
            for (int64_t b = 0; b < batch; ++b)                                                \
                SWIGLU_ROW(gate_up + b * 2 * intermediate,                                     \
                           gate_up + b * 2 * intermediate + intermediate,                      \
                           act + b * intermediate, intermediate);                              \
            failed |= packed_linear_##S(act, intermediate, batch, w[6], hidden_size,           \
                                        intermediate, NULL, projected, hidden_size,            \
                                        num_threads) != 0;                                     \
            for (int64_t i = 0; i < batch * hidden_size; ++i)                                  \
                hidden[i] = add_##S(hidden[i], projected[i]);                                  \
        }                                                                                      \
        free(scratch);                                                                         \
        return failed ? -1 : 0;                                                                \
    }

DEFINE_LLAMA_DECODE(f32, float, packed_linear_supported(), swiglu_row)

/* pack_linear_bf16 / packed_linear_bf16: y = x W^T (+ bias) in bfloat16 for the rows of a
 * decode step, on AMX's tiles (Intel's Advanced Matrix Extensions; where the CPU lacks
 * them, or the kernel refuses them, packed_linear_bf16 returns -1 and oneDNN's GEMMs run).
 * W (n, k) is packed once in AMX's pair layout: panels of 16 output features, k padded
 * with zeros to a multiple of 32, each pair of input features one row of 32 bfloat16
 * (feature f's two at 2f, 2f + 1); a tile of B is then 16 such rows, 1 KiB read front to
 * back. x is copied into rows padded to tiles of 16 (zeros past m and k). Each pair of
 * panels is multiplied by blocks of 32 rows (two tiles of A, four accumulator tiles of
 * 16 x 16 floats), the next pair of panels prefetched; the products are rounded once to
 * bfloat16 after the bias is added in float32. Panel pairs run in parallel over
 * `num_threads` OpenMP threads, each with its own tile configuration. */
int64_t packed_linear_bf16_size(int64_t n, int64_t k) {
    return (n + PANEL - 1) / PANEL * ((k + 31) / 32) * 32 * PANEL;
}

int pack_linear_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t pairs = (k + 31) / 32 * 16;
    for (int64_t p = 0; p < (n + PANEL - 1) / PANEL; ++p)
        for (int64_t i = 0; i < pairs; ++i)
            for (int64_t f = 0; f < PANEL; ++f)
                for (int64_t h = 0; h < 2; ++h) {
                    const int64_t feature = p * PANEL + f, j = 2 * i + h;
                    packed[((p * pairs + i) * PANEL + f) * 2 + h] =
                        feature < n && j < k ? w[feature * k + j] : 0;
                }
    return 0;
}

#ifdef HAS_TARGET_ATTRIBUTES /* the functions below enable the instructions they use */
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif
#define ARCH_REQ_XCOMP_PERM_ 0x1023 /* asm/prctl.h */
#define XFEATURE_XTILEDATA_ 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Whether this process may use AMX's tiles: the CPU has them and Linux grants the
 * process their state (asked once). */
int packed_linear_bf16_supported(void) {
    static int granted = -1;
    if (granted < 0)
        granted = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bw") &&
                  syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM_, XFEATURE_XTILEDATA_) == 0;
    return granted;
}

/* `rows` rows of c (ldc apart), their first `cols` columns (cols <= 32), from the float
 * tile rows in sums (32 floats apart), the bias added, rounded to bfloat16. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void store_bf16_rows(const float *sums, int64_t rows, int64_t cols, const uint16_t *bias,
                            uint16_t *c, int64_t ldc) {
    for (int64_t half = 0; half * 16 < cols; ++half) {
        const int64_t width = cols - half * 16 < 16 ? cols - half * 16 : 16;
        const __mmask16 mask = (__mmask16)((1u << width) - 1u);
        const __m512 b = bias == NULL ? _mm512_setzero_ps()
            : _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + half * 16)), 16));
        for (int64_t r = 0; r < rows; ++r)
            _mm256_mask_storeu_epi16(c + r * ldc + half * 16, mask,
                                     narrow_bf16_16(_mm512_add_ps(_mm512_loadu_ps(sums + r * 32 + half * 16), b)));
    }
}

/* c's columns of one panel for m > 32 rows, blocks of 64 rows (4 accumulator tiles, the
 * rows' tiles loaded in turn into two tiles of A). */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
static void amx_panel_rows64(const uint16_t *padded, int64_t kp, int64_t m, const uint16_t *panel,
                             const uint16_t *ahead, int64_t chunks, int64_t cols,
                             const uint16_t *bias, uint16_t *c, int64_t ldc, float *sums) {
    for (int64_t row = 0; row < m; row += 64) {
        const int64_t tiles = (m - row + 15) / 16 < 4 ? (m - row + 15) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ch = 0; ch < chunks; ++ch) {
            const uint16_t *a = padded + row * kp + ch * 32;
            if (ahead != NULL && row == 0)
                for (int64_t l = 0; l < 16; ++l)
                    _mm_prefetch((const char *)(ahead + ch * 512 + l * 32), _MM_HINT_T0);
            _tile_loadd(6, panel + ch * 512, 64);
            _tile_loadd(4, a, kp * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (tiles > 1) {
                _tile_loadd(5, a + 16 * kp, kp * 2);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (tiles > 2) {
                _tile_loadd(4, a + 32 * kp, kp * 2);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (tiles > 3) {
                _tile_loadd(5, a + 48 * kp, kp * 2);
                _tile_dpbf16ps(3, 5, 6);
            }
        }
        /* sums holds 32 rows of 32 floats: two tiles of rows at a time */
        _tile_stored(0, sums, 128);
        if (tiles > 1) _tile_stored(1, sums + 16 * 32, 128);
        const int64_t rows = m - row < 64 ? m - row : 64;
        store_bf16_rows(sums, rows < 32 ? rows : 32, cols, bias, c + row * ldc, ldc);
        if (tiles > 2) {
            _tile_stored(2, sums, 128);
            if (tiles > 3) _tile_stored(3, sums + 16 * 32, 128);
            store_bf16_rows(sums, rows - 32, cols, bias, c + (row + 32) * ldc, ldc);
        }
    }
}

/* every tile 16 rows of 64 bytes (palette 1), the one shape the AMX kernels here use */
__attribute__((target("amx-tile")))
static inline void load_tile_config(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
static void amx_panel_pairs(const uint16_t *padded, int64_t kp, int64_t m, const uint16_t *packed,
                            int64_t n, int64_t first_pair, int64_t last_pair,
                            const uint16_t *bias, uint16_t *c, int64_t ldc, float *sums) {
    const int64_t chunks = kp / 32, panel_size = kp * PANEL, panels = (n + PANEL - 1) / PANEL;
    load_tile_config();
    for (int64_t pair = first_pair; pair < last_pair; ++pair) {
        const int64_t p = 2 * pair;
        const int two = p + 1 < panels;
        const uint16_t *b0 = packed + p * panel_size, *b1 = b0 + panel_size;
        /* the next pair's panels, one after the other: a chunk's share of their lines */
        const uint16_t *ahead = p + 2 < panels ? b0 + 2 * panel_size : NULL;
        const int64_t ahead_lines = p + 3 < panels ? 32 : 16;
        const int64_t cols = n - p * PANEL < 2 * PANEL ? n - p * PANEL : 2 * PANEL;
        if (m > 32) {  /* one panel at a time: B read once for 4 tiles of rows */
            for (int64_t half = 0; half < 1 + two; ++half)
                amx_panel_rows64(padded, kp, m, b0 + half * panel_size,
                                 p + half + 1 < panels ? b0 + (half + 1) * panel_size : NULL, chunks,
                                 cols - half * PANEL < PANEL ? cols - half * PANEL : PANEL,
                                 bias != NULL ? bias + (p + half) * PANEL : NULL,
                                 c + (p + half) * PANEL, ldc, sums);
            continue;
        }
        for (int64_t row = 0; row < m; row += 32) {
            const int two_rows = row + 16 < m;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t ch = 0; ch < chunks; ++ch) {
                if (ahead != NULL && row == 0)
                    for (int64_t l = ch * ahead_lines; l < (ch + 1) * ahead_lines; ++l)
                        _mm_prefetch((const char *)(ahead + l * 32), _MM_HINT_T0);
                _tile_loadd(4, padded + row * kp + ch * 32, kp * 2);
                _tile_loadd(6, b0 + ch * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(7, b1 + ch * 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_rows) {
                    _tile_loadd(5, padded + (row + 16) * kp + ch * 32, kp * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, sums, 128);
            if (two) _tile_stored(1, sums + 16, 128);
            if (two_rows) {
                _tile_stored(2, sums + 16 * 32, 128);
                if (two) _tile_stored(3, sums + 16 * 32 + 16, 128);
            }
            store_bf16_rows(sums, m - row < 32 ? m - row : 32, cols,
                            bias != NULL ? bias + p * PANEL : NULL, c + row * ldc + p * PANEL, ldc);
        }
    }
    _tile_release();
}

/* c (m, n), rows ldc apart = a (m, k), rows lda apart, x W^T (+ bias (n,) or NULL); 0, or
 * -1 (nothing written) without AMX or scratch memory. */
int packed_linear_bf16(const uint16_t *a, int64_t lda, int64_t m, const uint16_t *packed,
                       int64_t n, int64_t k, const uint16_t *bias, uint16_t *c, int64_t ldc,
                       int num_threads) {
    if (!packed_linear_bf16_supported()) return -1;
    const int64_t kp = (k + 31) / 32 * 32, rows = m > 32 ? (m + 63) / 64 * 64 : (m + 31) / 32 * 32;
    uint16_t *padded = malloc(sizeof(uint16_t) * (size_t)(rows * kp));
    if (padded == NULL) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        if (r < m) memcpy(padded + r * kp, a + r * lda, sizeof(uint16_t) * (size_t)k);
        memset(padded + r * kp + (r < m ? k : 0), 0, sizeof(uint16_t) * (size_t)(r < m ? kp - k : kp));
    }
    const int64_t pairs = ((n + PANEL - 1) / PANEL + 1) / 2;
    int failed = 0;
    if (num_threads < 1 || pairs < num_threads) num_threads = pairs > 0 ? (int)pairs : 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed) if (num_threads > 1)
    {
        float *sums = malloc(sizeof(float) * 32 * 32);
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = pairs * thread / threads, last = pairs * (thread + 1) / threads;
        if (sums == NULL) failed = 1;
        else amx_panel_pairs(padded, kp, m, packed, n, first, last, bias, c, ldc, sums);
        free(sums);
    }
    free(padded);
    return failed ? -1 : 0;
}

#else
int packed_linear_bf16_supported(void) { return 0; }
int packed_linear_bf16(const uint16_t *a, int64_t lda, int64_t m, const uint16_t *packed,
                       int64_t n, int64_t k, const uint16_t *bias, uint16_t *c, int64_t ldc,
                       int num_threads) {
    return -1;
}
#endif

/* prefill_attention_bf16: prefill_attention_f32's causal attention (the same arguments,
 * the same unpadded layout) for bfloat16 q, k, v and out, its two products on AMX's
 * tiles: head_dim a multiple of 32 up to ATTN_AMX_MAX_HEAD_DIM; -2 (nothing written)
 * for another head_dim or without AMX, -1 where scratch memory cannot be had.
 * Per (sequence, KV head): its keys are packed once in AMX's pair layout as the B of
 * q k^T (tiles of 16 keys by 32 features: each key's consecutive feature pair one
 * 32-bit word), its values as the B of p v (tiles of 32 keys by 16 features: consecutive
 * keys' values of a feature paired), zeros past the last key. Then for each query head
 * of the group, blocks of 16 queries: their scores against the keys up to the block's
 * last query (16 x 16 tiles, up to 4 accumulating at once), stored as floats; an exact
 * softmax per query over its own keys in 16-float vectors (softmax_weights_bf16), the
 * weights rounded to bfloat16 (0 past the query's keys); the weighted values summed on
 * the tiles (up to 4 panels of 16 features at once) in float32, divided by the weights'
 * float32 sum and rounded once to bfloat16. Tasks run over `num_threads` OpenMP
 * threads, each with its own tile configuration. In an AVX2 build it returns -2. */
#define ATTN_AMX_MAX_HEAD_DIM 128
/* row strides of the scores (floats) and weights (bfloat16s) of a block for `padded`
 * keys: a cache line past a multiple of 1 KiB, so that a tile's 16 rows do not all fall
 * in the same few sets of the L1 cache */
#define ATTN_SCORE_STRIDE(padded) ((padded) + 16)
#define ATTN_WEIGHT_STRIDE(padded) ((padded) + 32)

#if defined(HAS_TARGET_ATTRIBUTES) && defined(__AVX512F__)
/* 16 rows x 16 columns of 32-bit words at src (rows src_stride words apart; rows past
 * `rows` read as 0) written transposed: dst row w holds word w of each source row */
static inline void transpose_words16(const uint32_t *src, int64_t src_stride, int64_t rows,
                                     uint32_t *dst) {
    const __m512i index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)src_stride));
    const __mmask16 mask = (__mmask16)(rows >= 16 ? 0xffffu : (1u << rows) - 1u);
    for (int64_t w = 0; w < 16; ++w)
        _mm512_storeu_si512(dst + w * 16, _mm512_mask_i32gather_epi32(
                                              _mm512_setzero_si512(), mask, index, src + w, 4));
}

/* softmax's weights of one row of scores over its first `count` keys, e^(scale (x -
 * max)), rounded to bfloat16 into weights (AVX512-BF16's conversion: nearest even, as
 * f32_to_bf16 for every weight there can be, from 1 down to e^-60), 0 from count to the
 * next multiple of 16 (the scores themselves are left as they are); returns their
 * float32 sum. The last keys go as one masked vector. */
__attribute__((target("avx512bf16")))
static inline float softmax_weights_bf16(const float *row, int64_t count, float scale,
                                         uint16_t *weights) {
    const int64_t whole = count / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (count - whole)) - 1u);
    __m512 top_w = _mm512_mask_loadu_ps(_mm512_set1_ps(-FLT_MAX), tail, row + whole);
    for (int64_t j = 0; j < whole; j += 16) top_w = _mm512_max_ps(_mm512_loadu_ps(row + j), top_w);
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top_w)), scale_w = _mm512_set1_ps(scale);
    __m512 total_w = _mm512_setzero_ps();
    for (int64_t j = 0; j < whole; j += 16) {
        const __m512 e = exp16_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift), scale_w));
        total_w = _mm512_add_ps(total_w, e);
        _mm256_storeu_si256((__m256i *)(weights + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (tail) {
        const __m512 x = _mm512_maskz_loadu_ps(tail, row + whole);
        const __m512 e = _mm512_maskz_mov_ps(tail, exp16_nonpositive(_mm512_mul_ps(_mm512_sub_ps(
            _mm512_mask_mov_ps(shift, tail, x), shift), scale_w)));
        total_w = _mm512_add_ps(total_w, e);
        _mm256_storeu_si256((__m256i *)(weights + whole), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(total_w);
}

/* 16 rows of products on the tiles, `n` (1-4) column tiles at once: tile i of out (floats,
 * out + i * 16, rows out_stride bytes apart) = the sum over `chunks` chunks c of a's 16 x 32
 * chunk (a + c * 32, rows a_stride bytes apart) times B's tile at b + c * b_chunk + i * b_tile
 * (16 pairs x 16 columns in the pair layout, 64 bytes a row) */
__attribute__((target("amx-tile,amx-bf16")))
static inline void amx_rows16_tiles4(const uint16_t *a, int64_t a_stride, const uint16_t *b,
                                     int64_t b_chunk, int64_t b_tile, int64_t chunks, int64_t n,
                                     float *out, int64_t out_stride) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t *bc = b + c * b_chunk;
        _tile_loadd(4, a + c * 32, a_stride);
        _tile_loadd(5, bc, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (n > 1) {
            _tile_loadd(6, bc + b_tile, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (n > 2) {
            _tile_loadd(5, bc + 2 * b_tile, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (n > 3) {
            _tile_loadd(6, bc + 3 * b_tile, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    _tile_stored(0, out, out_stride);
    if (n > 1) _tile_stored(1, out + 16, out_stride);
    if (n > 2) _tile_stored(2, out + 32, out_stride);
    if (n > 3) _tile_stored(3, out + 48, out_stride);
}

/* one (sequence, KV head): see prefill_attention_bf16. kp, vp, scores, probs, qbuf and
 * sums are the thread's scratch, sized for `padded` keys (a multiple of 32). */
__attribute__((target("amx-tile,amx-bf16,avx512bf16")))
static void amx_attend_kv_head(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                               const uint16_t *v, int64_t kv_stride, int64_t len,
                               int64_t first_head, int64_t group, int64_t head_dim, float scale,
                               uint16_t *out, int64_t out_stride, int64_t padded, uint16_t *kp,
                               uint16_t *vp, float *scores, uint16_t *probs, uint16_t *qbuf,
                               float *sums) {
    const int64_t chunks = head_dim / 32, panels = head_dim / 16;
    const int64_t key_tiles = (len + 15) / 16, key_chunks = (len + 31) / 32;
    for (int64_t t = 0; t < key_tiles; ++t)  /* keys: tile (t, c) = 16 pairs x 16 keys */
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t rows = len - t * 16 < 16 ? len - t * 16 : 16;
            transpose_words16((const uint32_t *)(k + t * 16 * kv_stride + c * 32), kv_stride / 2,
                              rows, (uint32_t *)(kp + (t * chunks + c) * 512));
        }
    for (int64_t j = 0; j < key_chunks; ++j)  /* values: tile (j, p) = 16 key pairs x 16 features */
        for (int64_t p = 0; p < panels; ++p) {
            uint16_t *tile = vp + (j * panels + p) * 512;
            for (int64_t i = 0; i < 16; ++i) {  /* keys 2i and 2i + 1's 16 features interleaved */
                const int64_t key = j * 32 + 2 * i;
                const __m512i even = key < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    (const __m256i *)(v + key * kv_stride + p * 16))) : _mm512_setzero_si512();
                const __m512i odd = key + 1 < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    (const __m256i *)(v + (key + 1) * kv_stride + p * 16))) : _mm512_setzero_si512();
                _mm512_storeu_si512(tile + i * 32, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
            }
        }
    for (int64_t head = first_head; head < first_head + group; ++head) {
        for (int64_t i0 = 0; i0 < len; i0 += 16) {
            const int64_t rows = len - i0 < 16 ? len - i0 : 16, keys = i0 + rows;
            const uint16_t *a = q + i0 * q_stride + head * head_dim;
            int64_t a_stride = q_stride;
            if (rows < 16) {  /* a last partial block: its rows padded with zeros */
                memset(qbuf, 0, sizeof(uint16_t) * 16 * (size_t)head_dim);
                for (int64_t r = 0; r < rows; ++r)
                    memcpy(qbuf + r * head_dim, a + r * q_stride, sizeof(uint16_t) * (size_t)head_dim);
                a = qbuf;
                a_stride = head_dim;
            }
            const int64_t tiles = (keys + 15) / 16, stride_s = ATTN_SCORE_STRIDE(padded);
            for (int64_t t = 0; t < tiles; t += 4)  /* scores, 4 key tiles at a time */
                amx_rows16_tiles4(a, a_stride * 2, kp + t * chunks * 512, 512, chunks * 512, chunks,
                                  tiles - t < 4 ? tiles - t : 4, scores + t * 16, stride_s * 4);
            const int64_t width = (keys + 31) / 32 * 32;  /* the weights' columns */
            float inverse[16];
            for (int64_t r = 0; r < 16; ++r) {
                uint16_t *weights = probs + r * ATTN_WEIGHT_STRIDE(padded);
                const int64_t count = r < rows ? i0 + r + 1 : 0;
                if (count > 0)
                    inverse[r] = 1.f / softmax_weights_bf16(scores + r * stride_s, count, scale, weights);
                const int64_t written = (count + 15) / 16 * 16;
                memset(weights + written, 0, sizeof(uint16_t) * (size_t)(width - written));
            }
            for (int64_t p = 0; p < panels; p += 4)  /* the values, 4 panels at a time */
                amx_rows16_tiles4(probs, ATTN_WEIGHT_STRIDE(padded) * 2, vp + p * 512, panels * 512,
                                  512, width / 32, panels - p < 4 ? panels - p : 4, sums + p * 16,
                                  head_dim * 4);
            for (int64_t r = 0; r < rows; ++r) {
                const __m512 inv = _mm512_set1_ps(inverse[r]);
                uint16_t *o = out + (i0 + r) * out_stride + head * head_dim;
                for (int64_t d = 0; d < head_dim; d += 16)
                    vstore_bf16_16(o + d, _mm512_mul_ps(_mm512_loadu_ps(sums + r * head_dim + d), inv));
            }
        }
    }
}

/* this thread's share of the (sequence, KV head) tasks, on its own tile configuration
 * (an orphaned OpenMP loop: called inside prefill_attention_bf16's parallel region) */
__attribute__((target("amx-tile,amx-bf16,avx512bf16")))
static void amx_attend_tasks(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             const int64_t *lens, const int64_t *firsts, int64_t batch,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t q_stride, int64_t kv_stride, float scale, uint16_t *out,
                             int64_t padded, uint16_t *kp, uint16_t *vp, float *scores,
                             uint16_t *probs, uint16_t *qbuf, float *sums) {
    const int64_t group = num_heads / num_kv_heads;
    load_tile_config();
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < batch * num_kv_heads; ++task) {
        const int64_t b = task / num_kv_heads, g = task % num_kv_heads, first = firsts[b];
        amx_attend_kv_head(q + first * q_stride, q_stride, k + first * kv_stride + g * head_dim,
                           v + first * kv_stride + g * head_dim, kv_stride, lens[b], g * group,
                           group, head_dim, scale, out + first * num_heads * head_dim,
                           num_heads * head_dim, padded, kp, vp, scores, probs, qbuf, sums);
    }
    _tile_release();
}

int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const int64_t *lens, int64_t batch, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t q_stride,
                           int64_t kv_stride, float scale, uint16_t *out, int num_threads) {
    if (!packed_linear_bf16_supported() || !__builtin_cpu_supports("avx512bf16")
        || head_dim % 32 != 0 || head_dim > ATTN_AMX_MAX_HEAD_DIM
        || q_stride % 2 != 0 || kv_stride % 2 != 0)
        return -2;
    int64_t longest = 0, *firsts = malloc(sizeof(int64_t) * (batch > 0 ? batch : 1));
    if (firsts == NULL) return -1;
    for (int64_t b = 0, first = 0; b < batch; first += lens[b], ++b) {
        firsts[b] = first;
        longest = lens[b] > longest ? lens[b] : longest;
    }
    const int64_t padded = (longest + 31) / 32 * 32;
    const size_t keys_size = (size_t)(padded * head_dim);  /* bfloat16s of packed keys (or values) */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed) if (num_threads > 1)
    {
        uint16_t *kp = malloc(sizeof(uint16_t) * (2 * keys_size + 16 * (size_t)ATTN_WEIGHT_STRIDE(padded)
                                                  + 16 * (size_t)head_dim));
        float *scores = malloc(sizeof(float) * (16 * (size_t)ATTN_SCORE_STRIDE(padded) + 16 * (size_t)head_dim));
        if (kp == NULL || scores == NULL) {
            failed = 1;
        } else {
            uint16_t *vp = kp + keys_size, *probs = vp + keys_size;
            uint16_t *qbuf = probs + 16 * ATTN_WEIGHT_STRIDE(padded);
            float *sums = scores + 16 * ATTN_SCORE_STRIDE(padded);
            amx_attend_tasks(q, k, v, lens, firsts, batch, num_heads, num_kv_heads, head_dim,
                             q_stride, kv_stride, scale, out, padded, kp, vp, scores, probs,
                             qbuf, sums);
        }
        free(kp);
        free(scores);
    }
    free(firsts);
    return failed ? -1 : 0;
}
#else
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const int64_t *lens, int64_t batch, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t q_stride,
                           int64_t kv_stride, float scale, uint16_t *out, int num_threads) {
    return -2;
}
#endif

/* llama_decode_bf16: llama_decode_f32's step for bfloat16 weights, caches and hidden
 * states, through the bfloat16 kernels (the packed linears on AMX): the same results bit
 * for bit as the Python path running those kernels one by one. -2 (nothing done) where
 * a kernel would refuse: no AMX, a head over MAX_BF16_HEAD_DIM. */
DEFINE_LLAMA_DECODE(bf16, uint16_t,
                    packed_linear_bf16_supported() && head_dim <= MAX_BF16_HEAD_DIM,
                    swiglu_row_bf16)

/* argmax_rows_f32: out[r] = the index of row r's largest value, the first where several
 * tie; a row holding NaN gives its first NaN (as torch.argmax). One pass over each row in
 * 16 lanes (GCC vectors: a compare and two blends a block at any -march), each lane
 * keeping its maximum, where it first saw it and whether it saw a NaN; then the lanes'
 * answers are merged, and only a row with a NaN is read again, to its first. */
typedef float lanes16f __attribute__((vector_size(64)));
typedef int32_t lanes16i __attribute__((vector_size(64)));

static int64_t argmax_row(const float *row, int64_t cols) {
    enum { LANES = 16 };
    lanes16f lane_max;
    lanes16i lane_at = {0}, lane_nan = {0}, at_block = {0};
    for (int l = 0; l < LANES; ++l) lane_max[l] = -INFINITY;
    int64_t j = 0;
    if (cols < INT32_MAX - LANES)
        for (; j + LANES <= cols; j += LANES, at_block += LANES) {
            lanes16f v;
            memcpy(&v, row + j, sizeof v);
            const lanes16i above = v > lane_max;  /* strictly: a lane keeps its first maximum */
            lane_max = (lanes16f)(((lanes16i)v & above) | ((lanes16i)lane_max & ~above));
            lane_at = (at_block & above) | (lane_at & ~above);
            lane_nan |= v != v;
        }
    float best = -INFINITY;
    int64_t at = 0;
    int has_nan = 0;
    for (int l = 0; l < LANES; ++l) {
        const int64_t index = (int64_t)lane_at[l] + l;
        if (lane_max[l] > best || (lane_max[l] == best && index < at)) {
            best = lane_max[l];
            at = index;
        }
        has_nan |= lane_nan[l];
    }
    for (; j < cols; ++j) {
        if (row[j] > best) {
            best = row[j];
            at = j;
        }
        has_nan |= row[j] != row[j];
    }
    if (has_nan)
        for (j = 0; j < cols; ++j)
            if (row[j] != row[j]) return j;
    return at;  /* a row of -inf only: 0, as torch */
}

void argmax_rows_f32(const float *x, int64_t row_stride, int64_t rows, int64_t cols,
                     int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * row_stride, cols);
}
