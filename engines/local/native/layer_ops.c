/* Fused element-wise steps of a decoder layer for the local engine (float32, CPU).
 *
 * Why native: at decode sizes (tens of rows of a few hundred floats) each torch operator costs microseconds of
 * dispatch and allocation for nanoseconds of arithmetic, and a layer ran about a dozen of them around its four
 * matmuls: RMSNorm (pow, mean, add, rsqrt, mul, mul), rotary embedding (roll, mul, addcmul), the K/V write
 * (cat, index_put) and SiLU-and-multiply (silu, mul). Each function below does one of those groups in one pass.
 * Same arithmetic as the torch path, in float32; only the summation order of the RMSNorm's mean differs.
 */
#include <math.h>
#include <stdint.h>

#include "fast_exp.h"

#define MAX_DIM 1024

/* exp(x) for any float: fast_exp.h's polynomial, 0 below -87, exp(88) above 88 (silu only divides by 1 + it). */
static inline float exp_clamped(float x)
{
    const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float e = exp_in_range(clamped);
    return x < -87.0f ? 0.0f : e;
}

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight, rows of dim floats (x and out row-contiguous). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, int64_t rows, int64_t dim, float eps,
                  float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        float sum = 0.0f;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t d = 0; d < dim; d++)
            sum += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        _Pragma("omp simd")
        for (int64_t d = 0; d < dim; d++)
            o[d] = xr[d] * inv * weight[d];
    }
}

/* gate_up: [rows][2 * inter] (gate then up, the fused matmul's output); out[r][i] = silu(gate) * up. */
void silu_mul_f32(const float *gate_up, int64_t rows, int64_t inter, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter;
        const float *u = g + inter;
        float *o = out + r * inter;
        _Pragma("omp simd")
        for (int64_t i = 0; i < inter; i++)
            o[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
    }
}

/* qkv: [rows][(heads + 2 kv_heads) * dim] (q heads, k heads, v heads), row-contiguous. Rotates q and k in
 * place (rotate-half rope: x * cos + roll(x, dim / 2) * signed_sin, signed_sin carrying the first half's minus,
 * as model.py's _rope), then copies each row's k and v heads into its slot of its page: the arena's
 * [pages][2][block][kv_heads][dim] layout, pages page_stride floats apart, V half_stride floats after K.
 * cos, signed_sin: [rows][dim]. Returns -1 (nothing written) when a page or slot is out of range, or dim is odd
 * or over MAX_DIM. */
int rope_write_kv_f32(float *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                      const float *cos_, const float *signed_sin, float *kv_base, int64_t page_stride,
                      int64_t half_stride, int64_t block_tokens, int64_t num_pages, const int64_t *pages,
                      const int64_t *slots)
{
    const int64_t width = (heads + 2 * kv_heads) * dim;
    const int64_t half = dim / 2;
    if (dim > MAX_DIM || dim % 2)
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        if (pages[r] < 0 || pages[r] >= num_pages || slots[r] < 0 || slots[r] >= block_tokens)
            return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * width;
        const float *c = cos_ + r * dim;
        const float *s = signed_sin + r * dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * dim;
            float rotated[MAX_DIM];
            _Pragma("omp simd")
            for (int64_t d = 0; d < half; d++) {
                rotated[d] = x[d + half] * s[d] + x[d] * c[d];
                rotated[d + half] = x[d] * s[d + half] + x[d + half] * c[d + half];
            }
            for (int64_t d = 0; d < dim; d++)
                x[d] = rotated[d];
        }
        float *k_dst = kv_base + pages[r] * page_stride + slots[r] * kv_heads * dim;
        float *v_dst = k_dst + half_stride;
        const float *k_src = row + heads * dim;
        const float *v_src = k_src + kv_heads * dim;
        for (int64_t d = 0; d < kv_heads * dim; d++) {
            k_dst[d] = k_src[d];
            v_dst[d] = v_src[d];
        }
    }
    return 0;
}
