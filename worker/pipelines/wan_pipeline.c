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
#include "pipelines/gen_batch.h"
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

/* Prompts one UMT5 forward encodes together (several requests' prompts
 * and negative prompts), at most this many: it bounds UMT5-XXL's
 * activations at 512 tokens. */
enum { ENCODE_BATCH = 8 };

/* One prompt of an encoder batch: its text, where its embeddings (L,
 * d_model) go on the host, and its member's result (truncation, time). */
typedef struct prompt_job {
    const char *prompt;
    float *embeds;
    dit_gen_result *res;
} prompt_job;

/* jobs[0 .. n) as WanPipeline._get_t5_prompt_embeds makes them, in forwards
 * of up to ENCODE_BATCH prompts (masked, so a prompt's rows do not depend
 * on the others beyond the GEMMs' last bits). A forward's time is shared
 * equally by its prompts' members. */
static dit_status encode_prompts(wan_pipe *p, const prompt_job *jobs, int n, int64_t L,
                                 dit_diag *diag)
{
    if (n == 0)
        return DIT_OK; /* every member brought embeddings (maybe with no encoder loaded) */
    dit_status st = DIT_OK;
    const int64_t d = dit_umt5_encoder_d_model(p->umt5);
    float *host = malloc(sizeof(float) * (size_t)ENCODE_BATCH * (size_t)L * (size_t)d);
    if (!host)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the text encoder");
    for (int j0 = 0; j0 < n; j0 += ENCODE_BATCH) {
        const int nb = n - j0 < ENCODE_BATCH ? n - j0 : ENCODE_BATCH;
        const char *texts[ENCODE_BATCH];
        bool cut[ENCODE_BATCH] = {false};
        for (int j = 0; j < nb; j++)
            texts[j] = jobs[j0 + j].prompt;
        const double t0 = now_ms();
        dit_tensor emb;
        const int64_t es[3] = {nb, L, d};
        DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 3, es, &emb));
        DIT_CHECK(dit_umt5_prompt_embeds(p->umt5, p->tok, p->arena, texts, nb, (int)L, &emb, NULL,
                                         cut, diag));
        dit_tensor h = dit_tensor_3d(host, DIT_F32, nb, L, d);
        DIT_CHECK(p->be->ops->download(p->be, &h, &emb));
        dit_arena_reset(p->arena);
        const double share = (now_ms() - t0) / nb;
        for (int j = 0; j < nb; j++) {
            const prompt_job *pj = &jobs[j0 + j];
            memcpy(pj->embeds, host + (size_t)j * (size_t)L * (size_t)d,
                   sizeof(float) * (size_t)L * (size_t)d);
            pj->res->prompt_truncated = pj->res->prompt_truncated || cut[j];
            pj->res->encode_ms += share;
        }
    }
cleanup:
    dit_arena_reset(p->arena);
    free(host);
    return st;
}

/* dit_pipeline_generate_batch for Wan (pipelines/gen_batch.h has the
 * layout). Batch entries of a forward: the active members' videos in
 * member order, each video's conditional entry; with CFG in one forward
 * then the same videos' unconditional entries, so that the first half is
 * conditional. */
static dit_status wan_pipe_generate_batch(void *pv, const dit_pipeline_info *info,
                                          const dit_denoiser *den, int n, const dit_gen_params *gps,
                                          const dit_gen_decode *decode,
                                          dit_gen_batch_progress_fn progress, void *progress_ctx,
                                          dit_gen_result *res, dit_status *member_st,
                                          dit_diag *diag)
{
    wan_pipe *p = pv;
    dit_gen_batch b;
    dit_status st = dit_gen_batch_init(&b, info, n, gps, res, member_st, diag);
    if (st != DIT_OK)
        return st;
    const dit_gen_params *gp = &gps[0]; /* what the members share */
    const int64_t C = info->latent_channels;
    int64_t nf, h, w;
    dit_wan_latent_dims(info, gp, &nf, &h, &w);
    const int64_t N = C * nf * h * w;
    const bool cfg = gp->guidance_scale > 1.0f;
    /* CFG as one forward of batch 2 per video: [cond..., uncond...]
     * stacked (see dit_gen_params.cfg_two_pass). */
    const bool cfg_batch = cfg && !gp->cfg_two_pass;
    const int64_t T = b.total, sides = cfg ? 2 : 1;
    const int64_t L = gp->prompt_embeds         ? gp->prompt_embeds_len
                      : gp->max_sequence_length ? gp->max_sequence_length
                                                : info->default_max_sequence_length;
    const int64_t Ct = info->transformer.joint_attention_dim;

    float *embeds = NULL, *lat = NULL, *v = NULL, *z = NULL, *in_lat = NULL, *in_emb = NULL;
    float *out = NULL, *t = NULL;
    prompt_job *jobs = NULL;
    /* Every member is active yet: the VAE must be there for any named. */
    if (dit_gen_batch_decodes_any(&b, decode) && !p->vae) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "this rank has no VAE to decode with");
        goto cleanup;
    }
    /* Per video of the batch: its member's prompt (0 .. T-1), then with CFG
     * its negative prompt (T .. 2T-1). */
    embeds = malloc(sizeof(float) * (size_t)(sides * T * L * Ct));
    in_emb = malloc(sizeof(float) * (size_t)(sides * T * L * Ct));
    in_lat = malloc(sizeof(float) * (size_t)((cfg_batch ? 2 : 1) * T * N));
    out = malloc(sizeof(float) * (size_t)(sides * T * N));
    lat = malloc(sizeof(float) * (size_t)(T * N));
    v = calloc((size_t)(T * N), sizeof(float));
    t = calloc((size_t)(2 * T), sizeof(float));
    if (!embeds || !in_emb || !in_lat || !out || !lat || !v || !t) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM,
                          "out of memory for a %dx%d, %d-frame generation of %lld videos",
                          gp->width, gp->height, gp->frames, (long long)T);
        goto cleanup;
    }

    /* The prompts UMT5 encodes, the members' together, one side at a
     * time: their prompts unless they bring embeddings, then with CFG their
     * negative prompts (default "") unless they bring those, each into
     * entry 0 of the member's videos. Sides are never mixed in a forward,
     * so a request alone encodes as it always did (prompt, then negative
     * prompt, each a forward of one). */
    jobs = malloc(sizeof *jobs * (size_t)(n > 0 ? n : 1));
    if (!jobs) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    for (int side = 0; side < (cfg ? 2 : 1); side++) {
        int n_jobs = 0;
        for (int m = 0; m < n; m++) {
            const dit_gen_params *g = &gps[m];
            float *emb_m = embeds + b.off[m] * L * Ct + side * T * L * Ct;
            if (side == 0 && !g->prompt_embeds)
                jobs[n_jobs++] = (prompt_job){g->prompt, emb_m, &res[m]};
            else if (side == 1 && !g->negative_prompt_embeds)
                jobs[n_jobs++] =
                    (prompt_job){g->negative_prompt ? g->negative_prompt : "", emb_m, &res[m]};
        }
        DIT_CHECK(encode_prompts(p, jobs, n_jobs, L, diag));
    }

    for (int m = 0; m < n; m++) {
        const dit_gen_params *g = &gps[m];
        dit_gen_result *r = &res[m];
        const int64_t ni = b.ni[m];
        float *emb_m = embeds + b.off[m] * L * Ct, *nemb_m = emb_m + T * L * Ct;
        r->initial_latents = malloc(sizeof(float) * (size_t)(ni * N));
        r->latents = malloc(sizeof(float) * (size_t)(ni * N));
        if (!r->initial_latents || !r->latents) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for a %dx%d, %d-frame generation",
                              gp->width, gp->height, gp->frames);
            goto cleanup;
        }
        r->num_images = (int)ni;
        r->width = gp->width;
        r->height = gp->height;
        r->frames = gp->frames;
        r->channels = 3;
        r->latents_ndim = dit_gen_latents_shape(info, g, r->latents_shape);
        r->latents_shape[0] = ni;
        r->latent_tokens = nf * h * w;
        r->latent_dim = C;

        /* Conditioning: the caller's embeddings or UMT5's; the negative side
         * from its own embeddings or the negative prompt (default ""). */
        if (g->prompt_embeds)
            memcpy(emb_m, g->prompt_embeds, sizeof(float) * (size_t)(L * Ct));
        if (cfg && g->negative_prompt_embeds)
            memcpy(nemb_m, g->negative_prompt_embeds, sizeof(float) * (size_t)(L * Ct));
        /* prompt_embeds.repeat(1, n, 1): each side's entry 0 copied to 1 .. ni - 1. */
        for (int64_t k = 1; k < ni; k++) {
            memcpy(emb_m + k * L * Ct, emb_m, sizeof(float) * (size_t)(L * Ct));
            if (cfg)
                memcpy(nemb_m + k * L * Ct, nemb_m, sizeof(float) * (size_t)(L * Ct));
        }

        /* Initial latents: the caller's, or torch.randn((ni, C, F', h, w))
         * from the member's seed (one draw). */
        if (g->latents) {
            memcpy(r->initial_latents, g->latents, sizeof(float) * (size_t)(ni * N));
        } else {
            dit_mt19937 gen;
            dit_mt19937_seed(&gen, g->seed);
            dit_torch_randn(&gen, r->initial_latents, (size_t)(ni * N));
        }
        memcpy(lat + b.off[m] * N, r->initial_latents, sizeof(float) * (size_t)(ni * N));
    }

    DIT_CHECK(dit_scheduler_set_timesteps(p->sched, gp->steps, nf * h * w, diag));
    bool regather = true;
    int64_t E = 0; /* videos in the forwards */
    const double t_loop = now_ms();
    double step_min = INFINITY, step_max = 0;
    for (int i = 0; i < gp->steps; i++) {
        const double t0 = now_ms();
        if (regather) {
            /* The active members' conditioning: conditional entries, then
             * unconditional ones. */
            E = dit_gen_batch_gather(&b, embeds, L * Ct, in_emb);
            if (cfg)
                dit_gen_batch_gather(&b, embeds + T * L * Ct, L * Ct, in_emb + E * L * Ct);
            regather = false;
        }
        const int64_t nb = (cfg_batch ? 2 : 1) * E;
        const int64_t sh_lat[5] = {nb, C, nf, h, w}, sh_emb[3] = {nb, L, Ct}, sh_one[1] = {nb};
        /* WanTransformer3DModel.forward's arguments, whole. */
        dit_named_tensors in = {0};
        const dit_tensor t_lat = dit_tensor_make(in_lat, DIT_F32, 5, sh_lat);
        const dit_tensor t_emb = dit_tensor_make(in_emb, DIT_F32, 3, sh_emb);
        const dit_tensor t_nemb = dit_tensor_make(in_emb + E * L * Ct, DIT_F32, 3, sh_emb);
        const dit_tensor t_t = dit_tensor_make(t, DIT_F32, 1, sh_one);
        const dit_tensor t_v = dit_tensor_make(out, DIT_F32, 5, sh_lat);
        const dit_tensor t_vneg = dit_tensor_make(out + E * N, DIT_F32, 5, sh_lat);
        DIT_CHECK(dit_named_tensors_set(&in, "hidden_states", &t_lat));
        DIT_CHECK(dit_named_tensors_set(&in, "timestep", &t_t));
        DIT_CHECK(dit_named_tensors_set(&in, "encoder_hidden_states", &t_emb));

        /* UniPC's int64 timestep, which the transformer takes unscaled. */
        const float ts = dit_scheduler_timestep(p->sched, i);
        for (int64_t k = 0; k < nb; k++)
            t[k] = ts;
        dit_gen_batch_gather(&b, lat, N, in_lat);
        if (cfg_batch)
            memcpy(in_lat + E * N, in_lat, sizeof(float) * (size_t)(E * N));
        DIT_CHECK(den->forward(den->ctx, &in, &t_v, diag));
        if (cfg && !cfg_batch) {
            DIT_CHECK(dit_named_tensors_set(&in, "encoder_hidden_states", &t_nemb));
            DIT_CHECK(den->forward(den->ctx, &in, &t_vneg, diag));
        }
        if (cfg)
            dit_gen_batch_cfg(&b, out, N, gps, DIT_GEN_CFG_GUIDANCE);
        dit_gen_batch_scatter(&b, out, N, v);
        DIT_CHECK(dit_scheduler_step(p->sched, i, lat, v, (size_t)(T * N), diag));
        dit_gen_batch_step_time(res, n, now_ms() - t0, &step_min, &step_max);
        DIT_CHECK(dit_gen_batch_progress(&b, progress, progress_ctx, i + 1, gp->steps,
                                         now_ms() - t_loop, res, member_st, v, N, &regather, diag));
    }
    dit_gen_batch_finish(&b, res, lat, N, now_ms() - t_loop);

    if (dit_gen_batch_decodes_any(&b, decode)) {
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
        z = malloc(sizeof(float) * (size_t)N);
        if (!z) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the video");
            goto cleanup;
        }
        for (int mb = 0; mb < n; mb++) {
            if (!dit_gen_batch_decodes(&b, decode, mb))
                continue;
            const double t0 = now_ms();
            dit_gen_result *r = &res[mb];
            const int64_t ni = b.ni[mb];
            r->image = malloc(sizeof(float) * (size_t)(ni * 3 * F * H * W));
            if (!r->image) {
                st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the video");
                goto cleanup;
            }
            /* One video at a time: the VAE's memory stays that of one. */
            for (int64_t m = 0; m < ni; m++) {
                if (!dit_gen_batch_decodes_image(&b, decode, mb, m))
                    continue; /* another rank's */
                memcpy(z, r->latents + m * N, sizeof(float) * (size_t)N);
                dit_wan_vae_denormalize(p->vae, z, nf * h * w);
                const int64_t vsh[5] = {1, 3, F, H, W}, zs[5] = {1, C, nf, h, w};
                const dit_tensor zt = dit_tensor_make(z, DIT_F32, 5, zs);
                const dit_tensor vt =
                    dit_tensor_make(r->image + m * 3 * F * H * W, DIT_F32, 5, vsh);
                DIT_CHECK(dit_wan_vae_decode(p->vae, &zt, &vt, diag));
            }
            r->vae_ms = now_ms() - t0;
        }
    }
cleanup:
    if (st != DIT_OK)
        dit_gen_batch_fail(&b, st, res, member_st);
    dit_gen_batch_free(&b);
    dit_arena_reset(p->arena);
    free(jobs);
    free(embeds);
    free(lat);
    free(v);
    free(in_lat);
    free(in_emb);
    free(out);
    free(t);
    free(z);
    return st;
}

const dit_pipeline_class dit_wan_pipeline_class = {
    .diffusers_class = "WanPipeline",
    .load = wan_pipe_load,
    .free = wan_pipe_free,
    .transformer = wan_pipe_transformer,
    .generate_batch = wan_pipe_generate_batch,
};
