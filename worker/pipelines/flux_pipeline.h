/* FluxPipeline: prompt in, image out, equal to diffusers' FluxPipeline on
 * the same weights, as a pipeline class (pipelines/pipeline.h).
 *
 * A pipeline folder as diffusers saves it (model_index.json, transformer/,
 * vae/, text_encoder/ (CLIP), text_encoder_2/ (T5), tokenizer/,
 * tokenizer_2/, scheduler/). Generation: tokenize, encode the prompt (CLIP
 * pooled output, T5 hidden states), draw the initial noise from the seed
 * exactly as torch does (or take caller latents), run the denoising loop
 * (the scheduler of scheduler/, optional true CFG with a negative prompt)
 * calling the transformer through the caller's dit_denoiser, unpack the
 * latents and decode them with the VAE. Its config-only part (probe,
 * request rules) is pipelines/flux_probe.h.
 *
 * Owner: a static table. */
#ifndef DIT_PIPELINES_FLUX_PIPELINE_H
#define DIT_PIPELINES_FLUX_PIPELINE_H

#include <stdint.h>

#include "pipelines/pipeline.h"

extern const dit_pipeline_class dit_flux_pipeline_class;

/* FluxPipeline's 2x2 latent packing: (1, C, h, w) <-> (1, (h/2)(w/2), 4C),
 * where token (i, j) holds channel c's pixel (2i + di, 2j + dj) at c*4 +
 * di*2 + dj. */
void dit_flux_pack_latents(const float *lat, int64_t C, int64_t h, int64_t w, float *packed);
void dit_flux_unpack_latents(const float *packed, int64_t C, int64_t h, int64_t w, float *lat);

#endif
