/* exp(x) for float32, vectorizable (the native kernels' shared exponential).
 *
 * libm's expf is a call per element and glibc offers its vector variants only under -ffast-math. Range reduction
 * x = n ln2 + r, |r| <= ln2/2, then the classic degree-6 minimax polynomial (Cephes' coefficients): within 2 ulp
 * of expf over [-87, 88]. Callers clamp first: below -87 the true value is under 1.7e-38 and they return 0. */
#ifndef MFS_FAST_EXP_H
#define MFS_FAST_EXP_H

#include <stdint.h>

/* x already within [-87, 88]. */
static inline float exp_in_range(float x)
{
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

#endif
