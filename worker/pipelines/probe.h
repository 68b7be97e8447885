/* What a pipeline folder is, from its config files alone (no weights, no
 * compute code): the pipeline class (model_index.json's `_class_name`),
 * the sizes and token rules a request is checked against, the defaults and
 * the task. ditd links this and nothing of the compute layers; the workers
 * and ditrun read the same answers.
 *
 * Adding a pipeline: a dit_pipeline_probe_class (probe + request check) in
 * its own file and one line in probe.c.
 *
 * Owner: plain values; the functions keep no state. */
#ifndef DIT_PIPELINES_PROBE_H
#define DIT_PIPELINES_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "parallel/mesh.h"

/* The generation request, as every pipeline reads it. Fields a pipeline does
 * not use are refused or ignored by its check. */
typedef struct dit_gen_params {
    const char *prompt;   /* first text encoder's prompt (and the second's unless prompt_2) */
    const char *prompt_2; /* second text encoder's prompt; NULL: prompt */
    const char *negative_prompt;   /* with true_cfg_scale > 1: true CFG */
    const char *negative_prompt_2; /* NULL: negative_prompt */
    int width, height;             /* pixels */
    int frames;                    /* 0: the pipeline's default (1 for images) */
    int fps;                       /* video frame rate; 0: the pipeline's default */
    int steps;                     /* 1 .. 1000 */
    /* FLUX: distilled guidance (guidance_embeds models); Wan: classic CFG,
     * above 1 (see cfg_two_pass). NaN: the pipeline's default. */
    float guidance_scale;
    float true_cfg_scale;    /* > 1 with a negative prompt: true CFG (see cfg_two_pass) */
    uint64_t seed;           /* torch.Generator("cpu").manual_seed(seed) */
    int max_sequence_length; /* text tokens (0: the pipeline's default) */
    /* Optional: initial latents in the shape dit_gen_latents_shape gives
     * (FLUX: packed (1, tokens, latent_dim); Wan: (1, C, F', H', W')),
     * instead of noise from the seed. */
    const float *latents;
    /* Optional caller embeddings instead of the text encoders: prompt_embeds
     * (1, embeds_len, joint_attention_dim), pooled (1, pooled_projection_dim),
     * and the negative pair for true CFG. */
    const float *prompt_embeds, *pooled_prompt_embeds;
    int64_t prompt_embeds_len;
    const float *negative_prompt_embeds, *negative_pooled_prompt_embeds;
    int64_t negative_prompt_embeds_len;
    /* CFG (FLUX's true CFG, Wan's classic CFG) as two transformer forwards
     * per step, conditional then unconditional, instead of one forward of
     * batch 2 (the default). For comparisons: the results agree to float
     * rounding, not bit for bit. */
    bool cfg_two_pass;
    /* diffusers' num_images_per_prompt: 0 or 1 one image, at most
     * DIT_GEN_MAX_IMAGES, made as one batch; the noise is one
     * torch.randn((n, ...)) from the seed, so image 0 is the n = 1 image.
     * With `latents`, n images' latents one after the other. */
    int num_images;
} dit_gen_params;

#define DIT_GEN_MAX_IMAGES 8

/* The request's image count: num_images, 1 for 0. */
static inline int dit_gen_num_images(const dit_gen_params *gp)
{
    return gp->num_images > 1 ? gp->num_images : 1;
}

/* The transformer's config, as far as requests and ListModels need it. */
typedef struct dit_transformer_info {
    char class_name[64]; /* config.json's _class_name */
    int num_layers, num_single_layers;
    int inner_dim;
    int in_channels;
    int joint_attention_dim;   /* width of prompt_embeds rows */
    int pooled_projection_dim; /* width of pooled_prompt_embeds (0: none) */
    bool guidance_embeds;
} dit_transformer_info;

#define DIT_PIPELINE_MAX_CONFIG 16

typedef struct dit_pipeline_info {
    char class_name[64]; /* model_index.json's _class_name, e.g. "FluxPipeline" */
    const char *task;    /* "text-to-image" */
    dit_transformer_info transformer;
    dit_parallel_req parallel; /* what the transformer asks of a mesh */
    int vae_scale;             /* pixels per latent pixel (8 for FLUX's VAE) */
    int latent_channels;       /* VAE latent channels */
    int size_multiple;         /* width and height must be multiples (16 for FLUX) */
    int latent_dim;            /* width of a packed latent token (64 for FLUX) */
    int frame_step;            /* num_frames - 1 a multiple of this (4 for Wan); 0: images */
    int default_width, default_height, default_frames, default_steps, default_fps;
    float default_guidance;
    int default_max_sequence_length;
    bool has_text_encoders; /* the text encoders the pipeline needs are present */
    /* The config values a client needs to build tensors (prompt_embeds,
     * latents), under their diffusers config names (ListModels' config). */
    struct {
        const char *key; /* static storage */
        int64_t value;
    } config[DIT_PIPELINE_MAX_CONFIG];
    int n_config;
} dit_pipeline_info;

/* What the caller's users call the request fields, for messages: request
 * fields ("negative_prompt") in the daemon, flags ("--negative-prompt") in
 * ditrun. */
typedef struct dit_gen_field_names {
    const char *negative_prompt, *true_cfg_scale, *guidance_scale;
} dit_gen_field_names;

/* One pipeline class's config-only part. */
typedef struct dit_pipeline_probe_class {
    const char *diffusers_class; /* "FluxPipeline" */
    /* Fills everything but class_name (set by the caller); `index_path` is
     * model_index.json, for messages. */
    dit_status (*probe)(const char *dir, dit_pipeline_info *out, dit_diag *diag);
    /* Request rules with messages a user can act on. */
    dit_status (*check)(const dit_pipeline_info *info, const dit_gen_params *gp, dit_diag *diag);
    /* The lengths of the sequences parallel.seq_names name, for a checked
     * request. */
    void (*seq_lens)(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *lens);
    /* Optional: for a request the mesh refuses, what the client can change,
     * in request fields, into buf; false to let the mesh's message stand. */
    bool (*mesh_advice)(const dit_pipeline_info *info, const dit_gen_params *gp,
                        const dit_parallel_config *pc, char *buf, size_t cap);
    /* The latents' shape for a checked request, as the pipeline returns them
     * with output_type='latent' (and takes them as `latents`); returns the
     * number of dims (at most 5). */
    int (*latents_shape)(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *shape);
    /* Optional: a warning about request fields that have no effect, named as
     * the caller's users name them; false when there is none. */
    bool (*warning)(const dit_pipeline_info *info, const dit_gen_params *gp,
                    const dit_gen_field_names *names, char *buf, size_t cap);
    /* Whether a checked request runs classifier-free guidance (two batch
     * entries per image: conditional and unconditional). */
    bool (*cfg)(const dit_pipeline_info *info, const dit_gen_params *gp);
} dit_pipeline_probe_class;

/* Reads dir/model_index.json, finds the class and probes. A folder that is
 * one component of a pipeline gets a message naming the pipeline folder. */
dit_status dit_pipeline_probe(const char *dir, dit_pipeline_info *out, dit_diag *diag);

/* The probe class of a probed pipeline. */
const dit_pipeline_probe_class *dit_pipeline_probe_class_of(const dit_pipeline_info *info);

/* Validates a request against a pipeline, with messages a user can act on
 * (sizes, steps, scales, embeddings). */
dit_status dit_gen_check(const dit_pipeline_info *info, const dit_gen_params *gp, dit_diag *diag);

/* The request's split-sequence lengths (info->parallel.n_seqs values) and
 * the mesh's rules for them. */
void dit_gen_seq_lens(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *lens);
dit_status dit_gen_check_mesh(const dit_pipeline_info *info, const dit_gen_params *gp,
                              const dit_parallel_config *pc, dit_diag *diag);

/* The pipeline's advice for a request the mesh refuses (see mesh_advice):
 * false when it has none. */
bool dit_gen_mesh_advice(const dit_pipeline_info *info, const dit_gen_params *gp,
                         const dit_parallel_config *pc, char *buf, size_t cap);

/* Fills the request's zeros (sizes, frames, fps, steps, text length) and a
 * NaN guidance with the pipeline's defaults; idempotent. */
void dit_gen_apply_defaults(const dit_pipeline_info *info, dit_gen_params *gp);

/* The latents' shape for a checked request (see latents_shape); returns the
 * number of dims. */
int dit_gen_latents_shape(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *shape);

/* The pipeline's warning about request fields that have no effect (see
 * warning), false when there is none. */
bool dit_gen_warning(const dit_pipeline_info *info, const dit_gen_params *gp,
                     const dit_gen_field_names *names, char *buf, size_t cap);

/* Whether a checked request runs classifier-free guidance in this pipeline
 * (FLUX: true CFG; Wan: guidance_scale above 1). */
bool dit_gen_cfg(const dit_pipeline_info *info, const dit_gen_params *gp);

/* Whether two checked requests can run as one batch (ditd --max-batch):
 * the same size, frames, steps, text length (max_sequence_length or the
 * embeddings' length, negative ones included), CFG on or off and
 * cfg_two_pass, after the pipeline's defaults. Everything else (prompts,
 * seed, guidance and true-CFG scales, latents, num_images, fps) is each
 * member's own. */
bool dit_gen_batch_compatible(const dit_pipeline_info *info, const dit_gen_params *a,
                              const dit_gen_params *b);

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

/* Helpers for probe classes. */

/* Up to four sizes nearest to w x h, each changing one side in steps of
 * mult within mult .. max_side, for which frames * (w / mult) * (h / mult)
 * tokens are a multiple of C, as "WxH, WxH" into list (empty when none). */
void dit_gen_nearest_sizes(int64_t w, int64_t h, int mult, int max_side, int64_t frames, int C,
                           char *list, size_t cap);

void dit_probe_add_config(dit_pipeline_info *info, const char *key, int64_t value);
bool dit_probe_is_dir(const char *path);
bool dit_probe_is_file(const char *path);

#endif
