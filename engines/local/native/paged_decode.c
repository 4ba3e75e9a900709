/* Paged decode attention for the local engine (float32, CPU): each sequence's one new query attends to its
 * keys where they lie in the arena's pages, without gathering a dense copy first.
 *
 * Why native: the torch path copies every sequence's K/V pages out of the arena (index_select) and then runs
 * SDPA over the copy: the bytes are read, written and read again, and SDPA runs one small GEMM per (sequence,
 * head). Decode attention is memory-bound; reading each key and value once in place is the whole point.
 *
 * Layout (engines/local/arena.py): a page is [2][block_tokens][kv_heads][head_dim] floats (K then V), pages
 * are page_stride floats apart. Query head q belongs to kv head q / groups (GQA, as the torch path's view).
 * Softmax is computed block by block with a running maximum (one rescale per page, not per key).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

#define MAX_HEADS 256
#define MAX_BLOCK 512
#define MAX_DIM 512

/* exp(x) for x <= 0 (a score minus the running maximum): fast_exp.h's polynomial, 0 below -87. */
static inline float exp_nonpositive(float x)
{
    const float clamped = x < -87.0f ? -87.0f : x;
    const float e = exp_in_range(clamped);
    return x < -87.0f ? 0.0f : e;
}

/* One sequence, every head: pages in order, and within a page every kv head (a page's K half and V half are each
 * one contiguous run, read front to back), with a running maximum, sum and output per query head. The next
 * page is prefetched, a share per head, while this one is computed: pages lie anywhere in the arena, so the
 * hardware prefetcher cannot guess them, and at serving sizes the keys come from DRAM (measured: the same
 * kernel reads pages 2.5x faster when they sit in the L3 cache). DIM is a compile-time constant in the
 * specialised copies (64, 128: the output row and the query stay in registers) and head_dim otherwise. */
#define ATTEND_SEQUENCE(NAME, DIM)                                                                              \
static void NAME(const float *q, const float *kv_base, int64_t page_stride, int64_t v_offset,                   \
                 const int64_t *pages, int64_t length, int64_t heads, int64_t kv_heads, int64_t head_dim,       \
                 int64_t block_tokens, float scale, float *out)                                                 \
{                                                                                                               \
    const int64_t dim = (DIM);                                                                                  \
    const int64_t groups = heads / kv_heads;                                                                    \
    const int64_t token_stride = kv_heads * dim;                                                                \
    const int64_t page_bytes = 2 * block_tokens * token_stride * (int64_t)sizeof(float);                        \
    float m[MAX_HEADS], l[MAX_HEADS];                                                                           \
    float probs[MAX_BLOCK];                                                                                     \
    (void)head_dim;                                                                                             \
    for (int64_t qh = 0; qh < heads; qh++) {                                                                    \
        m[qh] = -INFINITY;                                                                                      \
        l[qh] = 0.0f;                                                                                           \
    }                                                                                                           \
    memset(out, 0, sizeof(float) * heads * dim);                                                                \
    for (int64_t start = 0; start < length; start += block_tokens) {                                            \
        const int64_t n = length - start < block_tokens ? length - start : block_tokens;                        \
        const float *page = kv_base + pages[start / block_tokens] * page_stride;                                \
        const char *next = start + block_tokens < length                                                        \
            ? (const char *)(kv_base + pages[start / block_tokens + 1] * page_stride) : NULL;                   \
        for (int64_t qh = 0; qh < heads; qh++) {                                                                \
            if (next != NULL) {              /* a share of the next page per head: a few misses in flight */   \
                for (int64_t b = qh * page_bytes / heads; b < (qh + 1) * page_bytes / heads; b += 64)          \
                    __builtin_prefetch(next + b);                                                               \
            }                                                                                                   \
            const float *k = page + (qh / groups) * dim;                                                        \
            const float *v = k + v_offset;                                                                      \
            const float *qv = q + qh * dim;                                                                     \
            float block_max = -INFINITY;                                                                        \
            for (int64_t j = 0; j < n; j++) {                                                                   \
                const float *kj = k + j * token_stride;                                                         \
                float dot = 0.0f;                                                                               \
                _Pragma("omp simd reduction(+:dot)")                                                            \
                for (int64_t d = 0; d < dim; d++)                                                               \
                    dot += qv[d] * kj[d];                                                                       \
                probs[j] = dot * scale;                                                                         \
                block_max = probs[j] > block_max ? probs[j] : block_max;                                        \
            }                                                                                                   \
            const float new_max = block_max > m[qh] ? block_max : m[qh];                                        \
            const float rescale = expf(m[qh] - new_max);        /* exp(-inf) = 0 on the first page */           \
            float sum = l[qh] * rescale;                                                                        \
            _Pragma("omp simd reduction(+:sum)")                                                                \
            for (int64_t j = 0; j < n; j++) {                                                                   \
                probs[j] = exp_nonpositive(probs[j] - new_max);                                                 \
                sum += probs[j];                                                                                \
            }                                                                                                   \
            float acc[(DIM) > 0 ? (DIM) : MAX_DIM];                                                             \
            float *o = out + qh * dim;                                                                          \
            for (int64_t d = 0; d < dim; d++)                                                                   \
                acc[d] = o[d] * rescale;                                                                        \
            for (int64_t j = 0; j < n; j++) {                                                                   \
                const float pj = probs[j];                                                                      \
                const float *vj = v + j * token_stride;                                                         \
                _Pragma("omp simd")                                                                             \
                for (int64_t d = 0; d < dim; d++)                                                               \
                    acc[d] += pj * vj[d];                                                                       \
            }                                                                                                   \
            for (int64_t d = 0; d < dim; d++)                                                                   \
                o[d] = acc[d];                                                                                  \
            m[qh] = new_max;                                                                                    \
            l[qh] = sum;                                                                                        \
        }                                                                                                       \
    }                                                                                                           \
    for (int64_t qh = 0; qh < heads; qh++) {                                                                    \
        const float inv = 1.0f / l[qh];                                                                         \
        for (int64_t d = 0; d < dim; d++)                                                                       \
            out[qh * dim + d] *= inv;                                                                           \
    }                                                                                                           \
}

ATTEND_SEQUENCE(attend_sequence_64, 64)
ATTEND_SEQUENCE(attend_sequence_128, 128)
ATTEND_SEQUENCE(attend_sequence_any, head_dim)

typedef void (*attend_sequence_fn)(const float *, const float *, int64_t, int64_t, const int64_t *, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, float, float *);

/* q, out: [seqs][heads][head_dim]; pages: [seqs][max_blocks] ids below num_pages; lengths: keys per sequence.
 * Returns 0, or -1 (nothing written) when a shape is outside what the fixed scratch holds or an id or length is
 * out of range: the caller falls back to its torch path, which raises on bad ids. */
int paged_decode_f32(const float *q, const float *kv_base, int64_t page_stride, int64_t v_offset,
                     const int64_t *pages, int64_t max_blocks, int64_t num_pages, const int64_t *lengths,
                     int64_t seqs,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_tokens, float scale,
                     float *out)
{
    if (heads > MAX_HEADS || block_tokens > MAX_BLOCK || head_dim > MAX_DIM || kv_heads < 1 || heads % kv_heads)
        return -1;
    for (int64_t s = 0; s < seqs; s++) {
        if (lengths[s] < 1 || lengths[s] > max_blocks * block_tokens)
            return -1;
    }
    for (int64_t i = 0; i < seqs * max_blocks; i++) {
        if (pages[i] < 0 || pages[i] >= num_pages)
            return -1;
    }
    for (int64_t s = 0; s < seqs; s++) {
        attend_sequence_fn attend = head_dim == 64 ? attend_sequence_64
                                    : head_dim == 128 ? attend_sequence_128 : attend_sequence_any;
        attend(q + s * heads * head_dim, kv_base, page_stride, v_offset, pages + s * max_blocks,
                        lengths[s], heads, kv_heads, head_dim, block_tokens, scale, out + s * heads * head_dim);
    }
    return 0;
}
