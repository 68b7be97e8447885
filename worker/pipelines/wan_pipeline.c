#include "pipelines/wan_pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/arena.h"
#include "core/torch_rng.h"
#include "encoders/t5_tokenizer.h"
#include "encoders/umt5_encoder.h"
#include "pipelines/wan_probe.h"
#include "schedulers/scheduler.h"
#include "vae/autoencoder_kl_wan.h"

#define PIPE_PATH 4096

typedef struct wan_pipe {
    dit_backend *be;
    dit_model *transformer;
    dit_wan_vae *vae;
    dit_umt5_encoder *umt5;
    dit_t5_tokenizer *tok;
    dit_scheduler *sched;
    dit_arena *arena;
} wan_pipe;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void wan_pipe_free(void *pv);

static dit_status wan_pipe_load(dit_backend *be, const char *dir, const dit_pipeline_info *info,
                                const dit_shard *shard, bool load_vae, void **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char path[PIPE_PATH + 64];
    wan_pipe *p = calloc(1, sizeof *p);
    if (!p)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    p->be = be;
    snprintf(path, sizeof path, "%s/transformer", dir);
    DIT_CHECK(dit_model_load(be, path, shard, &p->transformer, diag));
    snprintf(path, sizeof path, "%s/scheduler/scheduler_config.json", dir);
    DIT_CHECK(dit_scheduler_load(path, "UniPCMultistepScheduler", &p->sched, diag));
    if (load_vae) {
        snprintf(path, sizeof path, "%s/vae", dir);
        DIT_CHECK(dit_wan_vae_load(be, path, &p->vae, diag));
        if (dit_wan_vae_z_dim(p->vae) != info->latent_channels ||
            dit_wan_vae_spatial_scale(p->vae) != info->vae_scale ||
            dit_wan_vae_frames(p->vae, 2) != 1 + info->frame_step) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: the VAE (z_dim %d, %dx spatial, %lld frames from 2 latent "
                              "frames) disagrees with its config's probe (%d, %dx, %d)",
                              dir, dit_wan_vae_z_dim(p->vae), dit_wan_vae_spatial_scale(p->vae),
                              (long long)dit_wan_vae_frames(p->vae, 2), info->latent_channels,
                              info->vae_scale, 1 + info->frame_step);
            goto cleanup;
        }
    }
    /* The text side is optional: a pipeline saved without it serves requests
     * that bring their own embeddings. */
    if (info->has_text_encoders) {
        snprintf(path, sizeof path, "%s/text_encoder", dir);
        DIT_CHECK(dit_umt5_encoder_load(be, path, &p->umt5, diag));
        snprintf(path, sizeof path, "%s/tokenizer", dir);
        DIT_CHECK(dit_t5_tokenizer_load(path, &p->tok, diag));
        if (dit_umt5_encoder_d_model(p->umt5) != info->transformer.joint_attention_dim) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: UMT5 d_model %d differs from the transformer's text_dim %d", dir,
                              dit_umt5_encoder_d_model(p->umt5),
                              info->transformer.joint_attention_dim);
            goto cleanup;
        }
    }
    if ((st = dit_arena_create(be, 0, &p->arena)) != DIT_OK) {
        st = dit_diag_set(diag, st, "pipeline: cannot create an arena");
        goto cleanup;
    }
    *out = p;
    p = NULL;
cleanup:
    wan_pipe_free(p);
    return st;
}

static void wan_pipe_free(void *pv)
{
    wan_pipe *p = pv;
    if (!p)
        return;
    dit_arena_destroy(p->arena);
    dit_t5_tokenizer_free(p->tok);
    dit_umt5_encoder_free(p->umt5);
    dit_wan_vae_free(p->vae);
    dit_scheduler_free(p->sched);
    dit_model_destroy(p->transformer);
    free(p);
}

static dit_model *wan_pipe_transformer(void *p)
{
    return ((wan_pipe *)p)->transformer;
}

/* One prompt's embeddings (L, d_model) on the host, as
 * WanPipeline._get_t5_prompt_embeds makes them. */
static dit_status encode_prompt(wan_pipe *p, const char *prompt, int64_t L, float *embeds,
                                dit_gen_result *res, dit_diag *diag)
{
    dit_status st = DIT_OK;
    const int64_t d = dit_umt5_encoder_d_model(p->umt5);
    const double t0 = now_ms();
    dit_tensor emb;
    const int64_t es[3] = {1, L, d};
    DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 3, es, &emb));
    DIT_CHECK(dit_umt5_prompt_embeds(p->umt5, p->tok, p->arena, &prompt, 1, (int)L, &emb, NULL,
                                     &res->prompt_truncated, diag));
    dit_tensor host = dit_tensor_3d(embeds, DIT_F32, 1, L, d);
    DIT_CHECK(p->be->ops->download(p->be, &host, &emb));
cleanup:
    res->encode_ms += now_ms() - t0;
    dit_arena_reset(p->arena);
    return st;
}

static dit_status wan_pipe_generate(void *pv, const dit_pipeline_info *info,
                                    const dit_denoiser *den, const dit_gen_params *gp, bool decode,
                                    dit_gen_progress_fn progress, void *progress_ctx,
                                    dit_gen_result *res, dit_diag *diag)
{
    wan_pipe *p = pv;
    dit_status st = DIT_OK;
    memset(res, 0, sizeof *res);
    st = dit_gen_check(info, gp, diag);
    if (st != DIT_OK)
        return st;
    if (decode && !p->vae)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "this rank has no VAE to decode with");
    const int64_t C = info->latent_channels;
    int64_t nf, h, w;
    dit_wan_latent_dims(info, gp, &nf, &h, &w);
    const int64_t n = C * nf * h * w;
    const bool cfg = gp->guidance_scale > 1.0f;
    /* CFG as one forward of batch 2: [cond, uncond] stacked (see
     * dit_gen_params.cfg_two_pass). */
    const bool cfg_batch = cfg && !gp->cfg_two_pass;
    /* num_videos_per_prompt: ni latents in one batch (2 ni with CFG). */
    const int64_t ni = dit_gen_num_images(gp);
    const int64_t nb = (cfg ? 2 : 1) * ni;
    const int64_t L = gp->prompt_embeds         ? gp->prompt_embeds_len
                      : gp->max_sequence_length ? gp->max_sequence_length
                                                : info->default_max_sequence_length;
    const int64_t Ct = info->transformer.joint_attention_dim;

    float *embeds = NULL, *neg_embeds = NULL, *v = NULL, *v_neg = NULL, *z = NULL;
    float *lat_in = NULL;
    /* Batch entries: the prompt ni times, then the negative prompt ni times. */
    embeds = malloc(sizeof(float) * (size_t)(nb * L * Ct));
    v = malloc(sizeof(float) * (size_t)(nb * n));
    lat_in = cfg_batch ? malloc(sizeof(float) * (size_t)(2 * ni * n)) : NULL;
    res->initial_latents = malloc(sizeof(float) * (size_t)(ni * n));
    res->latents = malloc(sizeof(float) * (size_t)(ni * n));
    if (!embeds || (cfg_batch && !lat_in) || !res->initial_latents || !res->latents || !v) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for a %dx%d, %d-frame generation",
                          gp->width, gp->height, gp->frames);
        goto cleanup;
    }
    if (cfg) {
        neg_embeds = embeds + ni * L * Ct;
        v_neg = v + ni * n;
    }
    res->num_images = (int)ni;
    res->width = gp->width;
    res->height = gp->height;
    res->frames = gp->frames;
    res->channels = 3;
    res->latents_ndim = dit_gen_latents_shape(info, gp, res->latents_shape);
    res->latents_shape[0] = ni;
    res->latent_tokens = nf * h * w;
    res->latent_dim = C;

    /* Conditioning: the caller's embeddings or UMT5's; the negative side
     * from its own embeddings or the negative prompt (default ""). */
    if (gp->prompt_embeds)
        memcpy(embeds, gp->prompt_embeds, sizeof(float) * (size_t)(L * Ct));
    else
        DIT_CHECK(encode_prompt(p, gp->prompt, L, embeds, res, diag));
    if (cfg && gp->negative_prompt_embeds)
        memcpy(neg_embeds, gp->negative_prompt_embeds, sizeof(float) * (size_t)(L * Ct));
    else if (cfg)
        DIT_CHECK(encode_prompt(p, gp->negative_prompt ? gp->negative_prompt : "", L, neg_embeds,
                                res, diag));
    /* prompt_embeds.repeat(1, n, 1): each side's entry 0 copied to 1 .. ni - 1. */
    for (int64_t k = 1; k < ni; k++) {
        memcpy(embeds + k * L * Ct, embeds, sizeof(float) * (size_t)(L * Ct));
        if (cfg)
            memcpy(neg_embeds + k * L * Ct, neg_embeds, sizeof(float) * (size_t)(L * Ct));
    }

    /* Initial latents: the caller's, or torch.randn((ni, C, F', h, w)) from
     * the seed (one draw). */
    if (gp->latents) {
        memcpy(res->initial_latents, gp->latents, sizeof(float) * (size_t)(ni * n));
    } else {
        dit_mt19937 g;
        dit_mt19937_seed(&g, gp->seed);
        dit_torch_randn(&g, res->initial_latents, (size_t)(ni * n));
    }
    memcpy(res->latents, res->initial_latents, sizeof(float) * (size_t)(ni * n));

    DIT_CHECK(dit_scheduler_set_timesteps(p->sched, gp->steps, res->latent_tokens, diag));
    float t[2 * DIT_GEN_MAX_IMAGES] = {0};
    /* WanTransformer3DModel.forward's arguments, whole. */
    dit_named_tensors in = {0};
    const int64_t sh_lat[5] = {ni, C, nf, h, w}, sh_emb[3] = {ni, L, Ct}, sh_one[1] = {ni};
    const int64_t sh_lat2[5] = {2 * ni, C, nf, h, w}, sh_emb2[3] = {2 * ni, L, Ct};
    const int64_t sh_two[1] = {2 * ni};
    const dit_tensor t_lat = dit_tensor_make(res->latents, DIT_F32, 5, sh_lat);
    const dit_tensor t_emb = dit_tensor_make(embeds, DIT_F32, 3, sh_emb);
    const dit_tensor t_nemb = dit_tensor_make(neg_embeds, DIT_F32, 3, sh_emb);
    const dit_tensor t_t = dit_tensor_make(t, DIT_F32, 1, sh_one);
    const dit_tensor t_v = dit_tensor_make(v, DIT_F32, 5, sh_lat);
    const dit_tensor t_vneg = dit_tensor_make(v_neg, DIT_F32, 5, sh_lat);
    DIT_CHECK(dit_named_tensors_set(&in, "hidden_states", &t_lat));
    DIT_CHECK(dit_named_tensors_set(&in, "timestep", &t_t));
    const dit_tensor t_lat2 = dit_tensor_make(lat_in, DIT_F32, 5, sh_lat2);
    const dit_tensor t_emb2 = dit_tensor_make(embeds, DIT_F32, 3, sh_emb2);
    const dit_tensor t_t2 = dit_tensor_make(t, DIT_F32, 1, sh_two);
    const dit_tensor t_v2 = dit_tensor_make(v, DIT_F32, 5, sh_lat2);
    if (cfg_batch) {
        DIT_CHECK(dit_named_tensors_set(&in, "hidden_states", &t_lat2));
        DIT_CHECK(dit_named_tensors_set(&in, "encoder_hidden_states", &t_emb2));
        DIT_CHECK(dit_named_tensors_set(&in, "timestep", &t_t2));
    }
    const double t_loop = now_ms();
    res->step_ms_min = INFINITY;
    for (int i = 0; i < gp->steps; i++) {
        const double t0 = now_ms();
        /* UniPC's int64 timestep, which the transformer takes unscaled. */
        const float ts = dit_scheduler_timestep(p->sched, i);
        for (int64_t k = 0; k < nb; k++)
            t[k] = ts;
        if (cfg_batch) {
            memcpy(lat_in, res->latents, sizeof(float) * (size_t)(ni * n));
            memcpy(lat_in + ni * n, res->latents, sizeof(float) * (size_t)(ni * n));
            DIT_CHECK(den->forward(den->ctx, &in, &t_v2, diag));
        } else {
            DIT_CHECK(dit_named_tensors_set(&in, "encoder_hidden_states", &t_emb));
            DIT_CHECK(den->forward(den->ctx, &in, &t_v, diag));
        }
        if (cfg && !cfg_batch) {
            DIT_CHECK(dit_named_tensors_set(&in, "encoder_hidden_states", &t_nemb));
            DIT_CHECK(den->forward(den->ctx, &in, &t_vneg, diag));
        }
        if (cfg) {
            /* noise_uncond + guidance_scale * (noise_pred - noise_uncond),
             * rounded in diffusers' order. */
            for (int64_t k = 0; k < ni * n; k++) {
                const float diff = v[k] - v_neg[k];
                const float scaled = gp->guidance_scale * diff;
                v[k] = v_neg[k] + scaled;
            }
        }
        dit_scheduler_step(p->sched, i, res->latents, v, (size_t)(ni * n));
        const double dt = now_ms() - t0;
        res->step_ms_min = dt < res->step_ms_min ? dt : res->step_ms_min;
        res->step_ms_max = dt > res->step_ms_max ? dt : res->step_ms_max;
        if (progress)
            DIT_CHECK(progress(progress_ctx, i + 1, gp->steps, now_ms() - t_loop));
    }
    res->denoise_ms = now_ms() - t_loop;

    if (decode) {
        const double t0 = now_ms();
        const int64_t F = dit_wan_vae_frames(p->vae, nf);
        const int64_t s = dit_wan_vae_spatial_scale(p->vae);
        const int64_t H = h * s, W = w * s;
        if (F != gp->frames || H != gp->height || W != gp->width) {
            st = dit_diag_set(diag, DIT_ERR_INTERNAL,
                              "the VAE decodes %lldx%lld, %lld frames for a %dx%d, %d-frame "
                              "request",
                              (long long)W, (long long)H, (long long)F, gp->width, gp->height,
                              gp->frames);
            goto cleanup;
        }
        z = malloc(sizeof(float) * (size_t)n);
        res->image = malloc(sizeof(float) * (size_t)(ni * 3 * F * H * W));
        if (!z || !res->image) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the video");
            goto cleanup;
        }
        /* One video at a time: the VAE's memory stays that of one. */
        for (int64_t m = 0; m < ni; m++) {
            memcpy(z, res->latents + m * n, sizeof(float) * (size_t)n);
            dit_wan_vae_denormalize(p->vae, z, nf * h * w);
            const int64_t vs[5] = {1, 3, F, H, W}, zs[5] = {1, C, nf, h, w};
            const dit_tensor zt = dit_tensor_make(z, DIT_F32, 5, zs);
            const dit_tensor vt = dit_tensor_make(res->image + m * 3 * F * H * W, DIT_F32, 5, vs);
            DIT_CHECK(dit_wan_vae_decode(p->vae, &zt, &vt, diag));
        }
        res->vae_ms = now_ms() - t0;
    }
cleanup:
    if (st != DIT_OK)
        dit_gen_result_free(res);
    dit_arena_reset(p->arena);
    free(embeds);
    free(v);
    free(lat_in);
    free(z);
    return st;
}

const dit_pipeline_class dit_wan_pipeline_class = {
    .diffusers_class = "WanPipeline",
    .load = wan_pipe_load,
    .free = wan_pipe_free,
    .transformer = wan_pipe_transformer,
    .generate = wan_pipe_generate,
};
