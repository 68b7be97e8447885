/* The pipeline registry: one line per pipeline class. */
#include <stdlib.h>
#include <string.h>

#include "pipelines/flux_pipeline.h"
#include "pipelines/pipeline.h"
#include "pipelines/wan_pipeline.h"

static const dit_pipeline_class *const classes[] = {
    &dit_flux_pipeline_class,
    &dit_wan_pipeline_class,
};
#define N_CLASSES (sizeof classes / sizeof classes[0])

struct dit_pipeline {
    const dit_pipeline_class *cls;
    void *impl;
    dit_pipeline_info info;
};

dit_status dit_pipeline_load(dit_backend *be, const char *dir, const dit_shard *shard,
                             bool load_vae, dit_pipeline **out, dit_diag *diag)
{
    dit_pipeline_info info;
    dit_status st = dit_pipeline_probe(dir, &info, diag);
    if (st != DIT_OK)
        return st;
    const dit_pipeline_class *cls = NULL;
    for (size_t i = 0; i < N_CLASSES && !cls; i++)
        if (strcmp(classes[i]->diffusers_class, info.class_name) == 0)
            cls = classes[i];
    if (!cls)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "%s: pipeline class \"%s\" has no loader",
                            dir, info.class_name);
    dit_pipeline *p = calloc(1, sizeof *p);
    if (!p)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    p->cls = cls;
    p->info = info;
    st = cls->load(be, dir, &p->info, shard, load_vae, &p->impl, diag);
    if (st != DIT_OK) {
        free(p);
        return st;
    }
    *out = p;
    return DIT_OK;
}

void dit_pipeline_free(dit_pipeline *p)
{
    if (!p)
        return;
    p->cls->free(p->impl);
    free(p);
}

dit_model *dit_pipeline_transformer(dit_pipeline *p)
{
    return p->cls->transformer(p->impl);
}

const dit_pipeline_info *dit_pipeline_get_info(const dit_pipeline *p)
{
    return &p->info;
}

/* A single generation's callback, called from the batch of one's. */
typedef struct single_progress {
    dit_gen_progress_fn fn;
    void *ctx;
} single_progress;

static dit_status single_step(void *ctx, int step, int total, double elapsed_ms, bool *active)
{
    (void)active;
    const single_progress *sp = ctx;
    return sp->fn(sp->ctx, step, total, elapsed_ms);
}

dit_status dit_pipeline_generate(dit_pipeline *p, const dit_denoiser *den, const dit_gen_params *gp,
                                 bool decode, dit_gen_progress_fn progress, void *progress_ctx,
                                 dit_gen_result *res, dit_diag *diag)
{
    single_progress sp = {progress, progress_ctx};
    dit_status member_st;
    const dit_gen_decode all = DIT_GEN_DECODE_ALL;
    return p->cls->generate_batch(p->impl, &p->info, den, 1, gp, decode ? &all : NULL,
                                  progress ? single_step : NULL, &sp, res, &member_st, diag);
}

dit_status dit_pipeline_generate_batch(dit_pipeline *p, const dit_denoiser *den, int n,
                                       const dit_gen_params *gps, const dit_gen_decode *decode,
                                       dit_gen_batch_progress_fn progress, void *progress_ctx,
                                       dit_gen_result *res, dit_status *member_st, dit_diag *diag)
{
    return p->cls->generate_batch(p->impl, &p->info, den, n, gps, decode, progress, progress_ctx,
                                  res, member_st, diag);
}

float *dit_gen_result_media(const dit_gen_result *r)
{
    if (!r->image)
        return NULL;
    const int64_t F = r->frames, C = r->channels, H = r->height, W = r->width;
    float *m = malloc(sizeof(float) * (size_t)(F * H * W * C));
    if (!m)
        return NULL;
    for (int64_t f = 0; f < F; f++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t y = 0; y < H; y++)
                for (int64_t x = 0; x < W; x++)
                    m[((f * H + y) * W + x) * C + c] = r->image[((c * F + f) * H + y) * W + x];
    return m;
}

void dit_gen_result_free(dit_gen_result *r)
{
    if (!r)
        return;
    free(r->initial_latents);
    free(r->latents);
    free(r->image);
    r->initial_latents = r->latents = r->image = NULL;
}
