/* PyTorch's CPU random numbers, so that a seed gives the same initial noise
 * here as `torch.Generator("cpu").manual_seed(seed)` + `torch.randn` does in
 * diffusers, and an image can be reproduced on either side.
 *
 * torch's CPU generator is a 32-bit Mersenne Twister (mt19937) seeded with
 * the low 32 bits of the seed. randn on an f32 tensor of at least 16
 * elements draws one uniform per element, (r & 0xffffff) / 2^24 from one
 * 32-bit output, then turns each run of 16 into normals by Box-Muller on the
 * pairs (j, j + 8); when the size is not a multiple of 16 the last 16 values
 * are drawn again and transformed in place.
 *
 * Owner: the caller (plain value). */
#ifndef DIT_CORE_TORCH_RNG_H
#define DIT_CORE_TORCH_RNG_H

#include <stddef.h>
#include <stdint.h>

typedef struct dit_mt19937 {
    uint32_t state[624];
    int index;
} dit_mt19937;

void dit_mt19937_seed(dit_mt19937 *g, uint64_t seed);
uint32_t dit_mt19937_next(dit_mt19937 *g);

/* torch.randn(n, generator=g) for n >= 16 (the vectorisable path every
 * latent tensor takes); smaller n is filled by the same rule applied to a
 * 16-element buffer, which is not torch's rule and is documented as such. */
void dit_torch_randn(dit_mt19937 *g, float *out, size_t n);

#endif
