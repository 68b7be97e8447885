/* The pipeline interface: prompt in, media out, for any pipeline class
 * registered in pipelines/registry.c by model_index.json's `_class_name`.
 *
 * A pipeline loads its own components (text encoders, tokenizers,
 * scheduler, VAE) and the transformer's weights for this rank's
 * tensor-parallel shard, but calls the transformer only through a
 * dit_denoiser (models/denoiser.h): who splits it over ranks is not its
 * business. Under a parallel mesh every rank runs the whole pipeline with
 * the same seed; ranks other than 0 may skip the VAE.
 *
 * Results are media, channels x frames x height x width (an image is one
 * frame), as f32 in [-1, 1] the way the VAE decodes them, plus the
 * latents for tests and raw outputs.
 *
 * Owner: the thread that loaded it. */
#ifndef DIT_PIPELINES_PIPELINE_H
#define DIT_PIPELINES_PIPELINE_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "models/denoiser.h"
#include "models/model.h"
#include "pipelines/probe.h"

typedef struct dit_pipeline dit_pipeline;

/* Called after each denoising step; a status other than DIT_OK stops the
 * generation with that status (cancellation). */
typedef dit_status (*dit_gen_progress_fn)(void *ctx, int step, int total, double elapsed_ms);

/* The batched generation's callback, after each denoising step (step 1 ..
 * total): active has one entry per member, true for those still in the
 * batch; the callback may clear entries to make members leave before the
 * next step (a cleared entry stays cleared: setting one again does
 * nothing). A status other than DIT_OK stops the whole generation with that
 * status. */
typedef dit_status (*dit_gen_batch_progress_fn)(void *ctx, int step, int total, double elapsed_ms,
                                                bool *active);

typedef struct dit_gen_result {
    int num_images; /* images (or videos) in the buffers below, one after another */
    int width, height;
    int frames;                        /* 1 for an image */
    int channels;                      /* 3 (RGB) */
    int64_t latent_tokens, latent_dim; /* the latents' size: tokens x dim floats */
    /* The latents' shape, as dit_gen_latents_shape gives it with the batch
     * num_images (FLUX: packed (n, tokens, dim); Wan: (n, C, F', H', W')). */
    int latents_ndim;
    int64_t latents_shape[5];
    float *initial_latents; /* malloc'ed, in that shape */
    float *latents;         /* malloc'ed, after the last step */
    /* (channels, frames, height, width) as the VAE decodes it, per image
     * (num_images of them in a row): for an image (3, height, width); NULL
     * if none was decoded, and an image the decode mask left out is not
     * written. dit_gen_result_media gives image 0's frames x H x W x
     * C layout. */
    float *image;
    bool prompt_truncated; /* a prompt was longer than its tokenizer allows */
    double tokenize_ms, encode_ms, denoise_ms, vae_ms;
    double step_ms_min, step_ms_max;
} dit_gen_result;

/* Which of a batch member's images dit_pipeline_generate_batch decodes:
 * bit i for image i (DIT_GEN_DECODE_ALL: every one). A mesh spreads the
 * images of a batch, and of one request of several, over its ranks. */
typedef uint32_t dit_gen_decode;
#define DIT_GEN_DECODE_ALL UINT32_MAX
_Static_assert(DIT_GEN_MAX_IMAGES <= 32, "a dit_gen_decode mask holds one bit per image");

typedef struct dit_pipeline_class {
    const char *diffusers_class; /* "FluxPipeline" */
    dit_status (*load)(dit_backend *be, const char *dir, const dit_pipeline_info *info,
                       const dit_shard *shard, bool load_vae, void **out, dit_diag *diag);
    void (*free)(void *p);
    dit_model *(*transformer)(void *p);
    /* dit_pipeline_generate_batch's contract; a single generation is a
     * batch of one. */
    dit_status (*generate_batch)(void *p, const dit_pipeline_info *info, const dit_denoiser *den,
                                 int n, const dit_gen_params *gps, const dit_gen_decode *decode,
                                 dit_gen_batch_progress_fn progress, void *progress_ctx,
                                 dit_gen_result *res, dit_status *member_st, dit_diag *diag);
} dit_pipeline_class;

/* Probes dir, finds its class and loads every component. shard: this
 * rank's tensor-parallel slice of the transformer (NULL: whole). load_vae
 * false skips the VAE (ranks that never decode). */
dit_status dit_pipeline_load(dit_backend *be, const char *dir, const dit_shard *shard,
                             bool load_vae, dit_pipeline **out, dit_diag *diag);
void dit_pipeline_free(dit_pipeline *p);

/* The transformer the pipeline loaded, to build a runner (runtime/) on. */
dit_model *dit_pipeline_transformer(dit_pipeline *p);

const dit_pipeline_info *dit_pipeline_get_info(const dit_pipeline *p);

dit_status dit_pipeline_generate(dit_pipeline *p, const dit_denoiser *den, const dit_gen_params *gp,
                                 bool decode, dit_gen_progress_fn progress, void *progress_ctx,
                                 dit_gen_result *res, dit_diag *diag);

/* n requests in the same transformer forwards (request batching, ditd
 * --max-batch). gps[0 .. n-1]: the members, each checked as
 * dit_pipeline_generate checks one, and all pairwise batchable
 * (dit_gen_batch_compatible: same size, frames, steps, text length, CFG on
 * or off, cfg_two_pass); each has its own prompts or embeddings, seed,
 * guidance_scale, true_cfg_scale, latents and num_images. res[0 .. n-1] and
 * member_st[0 .. n-1]: each member's result and status.
 *
 * Each member's conditioning is encoded on its own and its noise drawn
 * from its own seed exactly as a lone generation draws it. Per step one
 * transformer forward (two with cfg_two_pass) runs over the images of the
 * active members in member order; with CFG the batch is every active
 * member's conditional entries, then their unconditional ones in the same
 * order (the first half conditional: cfg-parallel splits it in halves).
 * Timesteps and FLUX's guidance are per batch entry. Each member's result
 * equals its lone generation to float rounding (the transformer's GEMMs
 * round differently for another batch size), bit for bit when n is 1.
 *
 * After each step `progress` may clear members of `active`: such a member
 * leaves before the next step, its result is empty (freed) and its status
 * DIT_ERR_CANCELLED; the others go on unchanged. Returns DIT_OK when at
 * least one member finished (statuses in member_st), DIT_ERR_CANCELLED when
 * every member left, or the failure (a bad member fails the whole batch,
 * every result empty, every member_st that status). decode: n masks, the
 * images of each finished member this call decodes (one image at a time),
 * or NULL to decode none. A member's res.image has room for all of its
 * images; those its mask leaves out are not written (another rank decodes
 * them). */
dit_status dit_pipeline_generate_batch(dit_pipeline *p, const dit_denoiser *den, int n,
                                       const dit_gen_params *gps, const dit_gen_decode *decode,
                                       dit_gen_batch_progress_fn progress, void *progress_ctx,
                                       dit_gen_result *res, dit_status *member_st, dit_diag *diag);

/* The decoded media as frames x height x width x channels f32 in [-1, 1]
 * (malloc'ed, caller frees), or NULL without an image or memory. */
float *dit_gen_result_media(const dit_gen_result *r);

void dit_gen_result_free(dit_gen_result *r);

#endif
