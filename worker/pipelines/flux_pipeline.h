/* FluxPipeline: prompt in, image out, equal to diffusers' FluxPipeline on
 * the same weights.
 *
 * A pipeline folder as diffusers saves it (model_index.json, transformer/,
 * vae/, text_encoder/ (CLIP), text_encoder_2/ (T5), tokenizer/,
 * tokenizer_2/, scheduler/). Generation: tokenize, encode the prompt (CLIP
 * pooled output, T5 hidden states), draw the initial noise from the seed
 * exactly as torch does (or take caller latents), run the denoising loop
 * (FlowMatchEuler, optional true CFG with a negative prompt), unpack the
 * latents and decode them with the VAE.
 *
 * Under a parallel mesh every rank runs the whole pipeline with the same
 * seed; only the transformer forward (through the runner) is split, and
 * ranks other than 0 may skip the VAE.
 *
 * Owner: the thread that loaded it. */
#ifndef DIT_PIPELINES_FLUX_PIPELINE_H
#define DIT_PIPELINES_FLUX_PIPELINE_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "models/flux/flux.h"
#include "runtime/runner.h"

typedef struct dit_pipeline dit_pipeline;

/* What a pipeline folder holds, read from its config files alone (no
 * weights): enough to validate a request before loading anything. */
typedef struct dit_pipeline_info {
    dit_flux_config transformer;
    int vae_scale;         /* pixels per latent pixel (8 for FLUX's VAE) */
    int latent_channels;   /* transformer in_channels / 4 */
    bool has_text_encoders; /* text_encoder/ and text_encoder_2/ present */
} dit_pipeline_info;

dit_status dit_pipeline_probe(const char *dir, dit_pipeline_info *out, dit_diag *diag);

/* Loads every component. shard: this rank's tensor-parallel slice of the
 * transformer (NULL: whole). load_vae false skips the VAE (ranks that never
 * decode). */
dit_status dit_pipeline_load(dit_backend *be, const char *dir, const dit_flux_shard *shard,
                             bool load_vae, dit_pipeline **out, dit_diag *diag);
void dit_pipeline_free(dit_pipeline *p);

dit_flux *dit_pipeline_transformer(dit_pipeline *p);

const dit_pipeline_info *dit_pipeline_get_info(const dit_pipeline *p);

typedef struct dit_gen_params {
    const char *prompt;            /* CLIP prompt (and T5's unless prompt_2) */
    const char *prompt_2;          /* T5 prompt; NULL: prompt */
    const char *negative_prompt;   /* with true_cfg_scale > 1: true CFG */
    const char *negative_prompt_2; /* NULL: negative_prompt */
    int width, height;             /* pixels, multiples of 2 * vae scale */
    int steps;                     /* 1 .. 1000 */
    float guidance_scale;          /* distilled guidance, for guidance_embeds models */
    float true_cfg_scale;          /* > 1 with a negative prompt: two passes per step */
    uint64_t seed;                 /* torch.Generator("cpu").manual_seed(seed) */
    int max_sequence_length;       /* T5 tokens, 1 .. 512 (0: 512) */
    /* Optional: initial packed latents (1, tokens, 4 * latent channels),
     * instead of noise from the seed. */
    const float *latents;
    /* Optional caller embeddings instead of the text encoders: prompt_embeds
     * (1, embeds_len, joint_attention_dim), pooled (1, pooled_projection_dim),
     * and the negative pair for true CFG. */
    const float *prompt_embeds, *pooled_prompt_embeds;
    int64_t prompt_embeds_len;
    const float *negative_prompt_embeds, *negative_pooled_prompt_embeds;
    int64_t negative_prompt_embeds_len;
} dit_gen_params;

/* Called after each denoising step; a status other than DIT_OK stops the
 * generation with that status (cancellation). */
typedef dit_status (*dit_gen_progress_fn)(void *ctx, int step, int total, double elapsed_ms);

typedef struct dit_gen_result {
    int width, height;
    int64_t latent_tokens, latent_dim;
    float *initial_latents; /* (1, tokens, dim) packed, malloc'ed */
    float *latents;         /* (1, tokens, dim) packed, after the last step */
    float *image;           /* (3, height, width) as vae.decode returns it; NULL if not decoded */
    bool prompt_truncated;  /* a prompt was longer than its tokenizer allows */
    double tokenize_ms, encode_ms, denoise_ms, vae_ms;
    double step_ms_min, step_ms_max;
} dit_gen_result;

/* Validates a request against a pipeline, with messages a user can act on
 * (width and height multiples of 2 * vae_scale, steps, scales, embeddings). */
dit_status dit_gen_check(const dit_pipeline_info *info, const dit_gen_params *gp, dit_diag *diag);

/* Whether the generation runs true classifier-free guidance: a scale above
 * 1 and a negative prompt (text or embeddings), as diffusers decides it. */
bool dit_gen_true_cfg(const dit_gen_params *gp);

/* When one of the two true-CFG inputs is given without the other (and so
 * has no effect), writes a warning in diffusers' sense to buf and returns
 * true. neg_name and cfg_name are what the caller's users call the two
 * (request fields "negative_prompt", "true_cfg_scale"; flags "--negative-
 * prompt", "--true-cfg"). */
bool dit_gen_true_cfg_warning(const dit_gen_params *gp, const char *neg_name, const char *cfg_name,
                              char *buf, size_t cap);

dit_status dit_pipeline_generate(dit_pipeline *p, dit_runner *runner, const dit_gen_params *gp,
                                 bool decode, dit_gen_progress_fn progress, void *progress_ctx,
                                 dit_gen_result *res, dit_diag *diag);

void dit_gen_result_free(dit_gen_result *r);

/* FluxPipeline's 2x2 latent packing: (1, C, h, w) <-> (1, (h/2)(w/2), 4C),
 * where token (i, j) holds channel c's pixel (2i + di, 2j + dj) at c*4 +
 * di*2 + dj. */
void dit_flux_pack_latents(const float *lat, int64_t C, int64_t h, int64_t w, float *packed);
void dit_flux_unpack_latents(const float *packed, int64_t C, int64_t h, int64_t w, float *lat);

#endif
