#include "pipelines/flux_pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/arena.h"
#include "core/torch_rng.h"
#include "encoders/clip_text.h"
#include "encoders/clip_tokenizer.h"
#include "encoders/t5_encoder.h"
#include "encoders/t5_tokenizer.h"
#include "pipelines/gen_batch.h"
#include "schedulers/scheduler.h"
#include "vae/autoencoder_kl.h"

#define PIPE_PATH 4096

typedef struct flux_pipe {
    dit_backend *be;
    char dir[PIPE_PATH];
    dit_model *transformer;
    dit_vae_decoder *vae;
    dit_clip_text *clip;
    dit_t5_encoder *t5;
    dit_clip_tokenizer *tok;
    dit_t5_tokenizer *tok2;
    dit_scheduler *sched;
    dit_arena *arena;
} flux_pipe;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void flux_pipe_free(void *pv);

static dit_status flux_pipe_load(dit_backend *be, const char *dir, const dit_pipeline_info *info,
                                 const dit_shard *shard, bool load_vae, void **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char path[PIPE_PATH + 64];
    flux_pipe *p = calloc(1, sizeof *p);
    if (!p)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    p->be = be;
    snprintf(p->dir, sizeof p->dir, "%s", dir);

    snprintf(path, sizeof path, "%s/transformer", dir);
    DIT_CHECK(dit_model_load(be, path, shard, &p->transformer, diag));
    const dit_transformer_info *fc = &info->transformer;
    snprintf(path, sizeof path, "%s/scheduler/scheduler_config.json", dir);
    DIT_CHECK(dit_scheduler_load(path, "FlowMatchEulerDiscreteScheduler", &p->sched, diag));
    if (load_vae) {
        snprintf(path, sizeof path, "%s/vae", dir);
        DIT_CHECK(dit_vae_decoder_load(be, path, &p->vae, diag));
        if (dit_vae_latent_channels(p->vae) != info->latent_channels) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: the VAE has %d latent channels but the transformer expects %d",
                              dir, dit_vae_latent_channels(p->vae), info->latent_channels);
            goto cleanup;
        }
    }
    /* The text side is optional: a pipeline saved without it serves requests
     * that bring their own embeddings. */
    snprintf(path, sizeof path, "%s/text_encoder", dir);
    if (dit_probe_is_dir(path)) {
        DIT_CHECK(dit_clip_text_load(be, path, &p->clip, diag));
        snprintf(path, sizeof path, "%s/tokenizer", dir);
        DIT_CHECK(dit_clip_tokenizer_load(path, &p->tok, diag));
        if (dit_clip_text_hidden_size(p->clip) != fc->pooled_projection_dim) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: CLIP hidden size %d differs from the transformer's "
                              "pooled_projection_dim %d",
                              dir, dit_clip_text_hidden_size(p->clip), fc->pooled_projection_dim);
            goto cleanup;
        }
    }
    snprintf(path, sizeof path, "%s/text_encoder_2", dir);
    if (dit_probe_is_dir(path)) {
        DIT_CHECK(dit_t5_encoder_load(be, path, &p->t5, diag));
        snprintf(path, sizeof path, "%s/tokenizer_2", dir);
        DIT_CHECK(dit_t5_tokenizer_load(path, &p->tok2, diag));
        if (dit_t5_encoder_d_model(p->t5) != fc->joint_attention_dim) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: T5 d_model %d differs from the transformer's "
                              "joint_attention_dim %d",
                              dir, dit_t5_encoder_d_model(p->t5), fc->joint_attention_dim);
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
    flux_pipe_free(p);
    return st;
}

static void flux_pipe_free(void *pv)
{
    flux_pipe *p = pv;
    if (!p)
        return;
    dit_arena_destroy(p->arena);
    dit_t5_tokenizer_free(p->tok2);
    dit_t5_encoder_free(p->t5);
    dit_clip_tokenizer_free(p->tok);
    dit_clip_text_free(p->clip);
    dit_vae_decoder_free(p->vae);
    dit_scheduler_free(p->sched);
    dit_model_destroy(p->transformer);
    free(p);
}

static dit_model *flux_pipe_transformer(void *p)
{
    return ((flux_pipe *)p)->transformer;
}

/* Prompts one CLIP and one T5 forward encode together: several requests'
 * prompts (and their negative prompts) share a forward, at most this many,
 * which bounds the encoders' activations (T5-XXL's feed-forward at 512
 * tokens is 21 MB a prompt). */
enum { ENCODE_BATCH = 8 };

/* One prompt of an encoder batch: its texts, and where its CLIP pooled
 * output (pooled_dim) and T5 hidden states (len, d_model) go on the host. */
typedef struct prompt_job {
    const char *prompt, *prompt_2;
    float *pooled, *embeds;
    bool *truncated;
    double *tok_ms, *enc_ms; /* the member's; its share of the forwards' time is added */
} prompt_job;

/* Encodes jobs[0 .. n) in forwards of up to ENCODE_BATCH prompts. Each
 * prompt's rows are computed on their own (CLIP and T5 mix no rows of a
 * batch), so a prompt's embeddings do not depend on its company beyond the
 * GEMMs' last bits. A forward's time is shared equally by its prompts. */
static dit_status encode_prompts(flux_pipe *p, const prompt_job *jobs, int n, int max_len,
                                 dit_diag *diag)
{
    if (n == 0)
        return DIT_OK; /* every member brought embeddings (maybe with no encoders loaded) */
    dit_status st = DIT_OK;
    dit_backend *be = p->be;
    const int clip_len = dit_clip_tokenizer_max_length(p->tok);
    const int64_t hidden = dit_clip_text_hidden_size(p->clip), d = dit_t5_encoder_d_model(p->t5);
    int32_t *ids_clip = malloc(sizeof(int32_t) * (size_t)ENCODE_BATCH * (size_t)clip_len);
    int32_t *ids_t5 = malloc(sizeof(int32_t) * (size_t)ENCODE_BATCH * (size_t)max_len);
    float *pooled = malloc(sizeof(float) * (size_t)(ENCODE_BATCH * hidden));
    float *embeds = malloc(sizeof(float) * (size_t)ENCODE_BATCH * (size_t)max_len * (size_t)d);
    if (!ids_clip || !ids_t5 || !pooled || !embeds) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the text encoders");
        goto cleanup;
    }
    for (int j0 = 0; j0 < n; j0 += ENCODE_BATCH) {
        const int nb = n - j0 < ENCODE_BATCH ? n - j0 : ENCODE_BATCH;
        for (int j = 0; j < nb; j++) {
            const prompt_job *pj = &jobs[j0 + j];
            int got = 0;
            bool cut = false;
            const double t0 = now_ms();
            DIT_CHECK(dit_clip_tokenizer_encode(p->tok, pj->prompt, ids_clip + j * clip_len,
                                                clip_len, &got, &cut, diag));
            *pj->truncated = *pj->truncated || cut;
            cut = false;
            DIT_CHECK(dit_t5_tokenizer_encode(p->tok2, pj->prompt_2 ? pj->prompt_2 : pj->prompt,
                                              ids_t5 + (size_t)j * (size_t)max_len, max_len, &got,
                                              &cut, diag));
            *pj->truncated = *pj->truncated || cut;
            *pj->tok_ms += now_ms() - t0;
        }
        const double t0 = now_ms();
        dit_tensor pooled_t, emb_t;
        const int64_t ps[2] = {nb, hidden}, es[3] = {nb, max_len, d};
        DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 2, ps, &pooled_t));
        DIT_CHECK(dit_clip_text_forward(p->clip, p->arena, ids_clip, nb, clip_len, &pooled_t, NULL,
                                        diag));
        dit_tensor hp = dit_tensor_2d(pooled, DIT_F32, nb, hidden);
        DIT_CHECK(be->ops->download(be, &hp, &pooled_t));
        DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 3, es, &emb_t));
        DIT_CHECK(dit_t5_encoder_forward(p->t5, p->arena, ids_t5, nb, max_len, &emb_t, diag));
        dit_tensor he = dit_tensor_3d(embeds, DIT_F32, nb, max_len, d);
        DIT_CHECK(be->ops->download(be, &he, &emb_t));
        dit_arena_reset(p->arena);
        const double share = (now_ms() - t0) / nb;
        for (int j = 0; j < nb; j++) {
            const prompt_job *pj = &jobs[j0 + j];
            memcpy(pj->pooled, pooled + j * hidden, sizeof(float) * (size_t)hidden);
            memcpy(pj->embeds, embeds + (size_t)j * (size_t)max_len * (size_t)d,
                   sizeof(float) * (size_t)max_len * (size_t)d);
            *pj->enc_ms += share;
        }
    }
cleanup:
    dit_arena_reset(p->arena);
    free(ids_clip);
    free(ids_t5);
    free(pooled);
    free(embeds);
    return st;
}

void dit_flux_pack_latents(const float *lat, int64_t C, int64_t h, int64_t w, float *out)
{
    const int64_t h2 = h / 2, w2 = w / 2;
    for (int64_t i = 0; i < h2; i++)
        for (int64_t j = 0; j < w2; j++)
            for (int64_t c = 0; c < C; c++)
                for (int di = 0; di < 2; di++)
                    for (int dj = 0; dj < 2; dj++)
                        out[(i * w2 + j) * 4 * C + c * 4 + di * 2 + dj] =
                            lat[(c * h + 2 * i + di) * w + 2 * j + dj];
}

void dit_flux_unpack_latents(const float *packed, int64_t C, int64_t h, int64_t w, float *lat)
{
    const int64_t h2 = h / 2, w2 = w / 2;
    for (int64_t i = 0; i < h2; i++)
        for (int64_t j = 0; j < w2; j++)
            for (int64_t c = 0; c < C; c++)
                for (int di = 0; di < 2; di++)
                    for (int dj = 0; dj < 2; dj++)
                        lat[(c * h + 2 * i + di) * w + 2 * j + dj] =
                            packed[(i * w2 + j) * 4 * C + c * 4 + di * 2 + dj];
}

/* dit_pipeline_generate_batch for FLUX (pipelines/gen_batch.h has the
 * layout). Batch entries of a forward: the active members' images in
 * member order, each image's conditional entry; with CFG in one forward
 * then the same images' unconditional entries, so that the first half is
 * conditional. Per entry: the member's prompt (repeated for its images),
 * its guidance (guidance_embeds) and the step's timestep. */
static dit_status flux_pipe_generate_batch(void *pv, const dit_pipeline_info *info,
                                           const dit_denoiser *den, int n,
                                           const dit_gen_params *gps, const dit_gen_decode *decode,
                                           dit_gen_batch_progress_fn progress, void *progress_ctx,
                                           dit_gen_result *res, dit_status *member_st,
                                           dit_diag *diag)
{
    flux_pipe *p = pv;
    dit_gen_batch b;
    dit_status st = dit_gen_batch_init(&b, info, n, gps, res, member_st, diag);
    if (st != DIT_OK)
        return st;
    const dit_gen_params *gp = &gps[0]; /* what the members share */
    const dit_transformer_info *fc = &info->transformer;
    const int64_t C = info->latent_channels;
    const int vs = info->vae_scale;
    const int64_t h = 2 * (gp->height / (vs * 2)), w = 2 * (gp->width / (vs * 2));
    const int64_t tokens = (h / 2) * (w / 2), dim = 4 * C;
    const int max_len = gp->max_sequence_length ? gp->max_sequence_length : 512;
    const bool cfg = dit_gen_true_cfg(gp);
    /* CFG as one forward of batch 2 per image: [cond..., uncond...]
     * stacked (see dit_gen_params.cfg_two_pass). */
    const bool cfg_batch = cfg && !gp->cfg_two_pass;
    const int64_t T = b.total, N = tokens * dim, sides = cfg ? 2 : 1;
    const int64_t L = gp->prompt_embeds ? gp->prompt_embeds_len : max_len;
    const int64_t Cj = fc->joint_attention_dim, Cp = fc->pooled_projection_dim;

    float *embeds = NULL, *pooled = NULL, *ids = NULL, *noise = NULL, *lat = NULL, *v = NULL;
    float *in_lat = NULL, *in_emb = NULL, *in_pool = NULL, *out = NULL, *t = NULL, *guid = NULL;
    float *z = NULL;
    prompt_job *jobs = NULL;
    /* Every member is active yet: the VAE must be there for any named. */
    if (dit_gen_batch_decodes_any(&b, decode) && !p->vae) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "this rank has no VAE to decode with");
        goto cleanup;
    }
    /* Per image of the batch: its member's prompt (images 0 .. T-1), then
     * with CFG its negative prompt (T .. 2T-1). */
    embeds = malloc(sizeof(float) * (size_t)(sides * T * L * Cj));
    pooled = malloc(sizeof(float) * (size_t)(sides * T * Cp));
    in_emb = malloc(sizeof(float) * (size_t)(sides * T * L * Cj));
    in_pool = malloc(sizeof(float) * (size_t)(sides * T * Cp));
    in_lat = malloc(sizeof(float) * (size_t)((cfg_batch ? 2 : 1) * T * N));
    out = malloc(sizeof(float) * (size_t)(sides * T * N));
    lat = malloc(sizeof(float) * (size_t)(T * N));
    v = calloc((size_t)(T * N), sizeof(float));
    t = calloc((size_t)(2 * T), sizeof(float));
    guid = calloc((size_t)(2 * T), sizeof(float));
    ids = calloc((size_t)((tokens + L) * 3), sizeof(float));
    if (!embeds || !pooled || !in_emb || !in_pool || !in_lat || !out || !lat || !v || !t || !guid ||
        !ids) {
        st =
            dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for a %dx%d generation of %lld images",
                         gp->width, gp->height, (long long)T);
        goto cleanup;
    }

    /* The prompts of the members that bring no embeddings, encoded
     * together one side at a time (the members' prompts, then with CFG their
     * negative prompts), each into entry 0 of the member's images on that
     * side. Sides are never mixed in a forward, so a request alone encodes
     * as it always did (each prompt a forward of one). */
    jobs = malloc(sizeof *jobs * (size_t)(n > 0 ? n : 1));
    if (!jobs) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    for (int side = 0; side < (cfg ? 2 : 1); side++) {
        int n_jobs = 0;
        for (int m = 0; m < n; m++) {
            const dit_gen_params *g = &gps[m];
            if (g->prompt_embeds)
                continue;
            dit_gen_result *r = &res[m];
            float *emb_m = embeds + (side * T + b.off[m]) * L * Cj;
            float *pool_m = pooled + (side * T + b.off[m]) * Cp;
            const char *p1 = side ? g->negative_prompt : g->prompt;
            const char *p2 =
                side ? (g->negative_prompt_2 ? g->negative_prompt_2 : g->negative_prompt)
                     : g->prompt_2;
            jobs[n_jobs++] = (prompt_job){
                p1, p2, pool_m, emb_m, &r->prompt_truncated, &r->tokenize_ms, &r->encode_ms};
        }
        /* L tokens: the batch's text length, which every member has
         * (dit_gen_batch_compatible), whoever brings embeddings. */
        DIT_CHECK(encode_prompts(p, jobs, n_jobs, (int)L, diag));
    }

    for (int m = 0; m < n; m++) {
        const dit_gen_params *g = &gps[m];
        dit_gen_result *r = &res[m];
        const int64_t ni = b.ni[m];
        float *emb_m = embeds + b.off[m] * L * Cj, *pool_m = pooled + b.off[m] * Cp;
        float *nemb_m = emb_m + T * L * Cj, *npool_m = pool_m + T * Cp;
        r->initial_latents = malloc(sizeof(float) * (size_t)(ni * N));
        r->latents = malloc(sizeof(float) * (size_t)(ni * N));
        if (!r->initial_latents || !r->latents) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for a %dx%d generation",
                              gp->width, gp->height);
            goto cleanup;
        }
        r->num_images = (int)ni;
        r->width = gp->width;
        r->height = gp->height;
        r->frames = 1;
        r->channels = 3;
        r->latent_tokens = tokens;
        r->latent_dim = dim;
        r->latents_ndim = 3;
        r->latents_shape[0] = ni;
        r->latents_shape[1] = tokens;
        r->latents_shape[2] = dim;

        /* Conditioning: the member's own embeddings (the others were
         * encoded above). */
        if (g->prompt_embeds) {
            memcpy(emb_m, g->prompt_embeds, sizeof(float) * (size_t)(L * Cj));
            memcpy(pool_m, g->pooled_prompt_embeds, sizeof(float) * (size_t)Cp);
            if (cfg) {
                memcpy(nemb_m, g->negative_prompt_embeds, sizeof(float) * (size_t)(L * Cj));
                memcpy(npool_m, g->negative_pooled_prompt_embeds, sizeof(float) * (size_t)Cp);
            }
        }
        /* prompt_embeds.repeat(1, n, 1): each side's entry 0 copied to 1 .. ni - 1. */
        for (int64_t k = 1; k < ni; k++) {
            memcpy(emb_m + k * L * Cj, emb_m, sizeof(float) * (size_t)(L * Cj));
            memcpy(pool_m + k * Cp, pool_m, sizeof(float) * (size_t)Cp);
            if (cfg) {
                memcpy(nemb_m + k * L * Cj, nemb_m, sizeof(float) * (size_t)(L * Cj));
                memcpy(npool_m + k * Cp, npool_m, sizeof(float) * (size_t)Cp);
            }
        }

        /* Initial latents: the caller's, or torch.randn((ni, C, h, w)) from
         * the member's seed (one draw, as prepare_latents makes it for
         * num_images_per_prompt), each image packed 2x2. */
        if (g->latents) {
            memcpy(r->initial_latents, g->latents, sizeof(float) * (size_t)(ni * N));
        } else {
            free(noise);
            noise = malloc(sizeof(float) * (size_t)(ni * N));
            if (!noise) {
                st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
                goto cleanup;
            }
            dit_mt19937 gen;
            dit_mt19937_seed(&gen, g->seed);
            dit_torch_randn(&gen, noise, (size_t)(ni * N));
            for (int64_t k = 0; k < ni; k++)
                dit_flux_pack_latents(noise + k * N, C, h, w, r->initial_latents + k * N);
        }
        memcpy(lat + b.off[m] * N, r->initial_latents, sizeof(float) * (size_t)(ni * N));
    }

    /* Position ids: text all zero, image [0, row, col]. */
    float *txt_ids = ids, *img_ids = ids + L * 3;
    for (int64_t i = 0; i < h / 2; i++)
        for (int64_t j = 0; j < w / 2; j++) {
            img_ids[(i * (w / 2) + j) * 3 + 1] = (float)i;
            img_ids[(i * (w / 2) + j) * 3 + 2] = (float)j;
        }

    DIT_CHECK(dit_scheduler_set_timesteps(p->sched, gp->steps, tokens, diag));
    const int64_t sh_img[2] = {tokens, 3}, sh_txt[2] = {L, 3};
    const dit_tensor t_img = dit_tensor_make(img_ids, DIT_F32, 2, sh_img);
    const dit_tensor t_txt = dit_tensor_make(txt_ids, DIT_F32, 2, sh_txt);
    bool regather = true;
    int64_t E = 0; /* images in the forwards */
    const double t_loop = now_ms();
    double step_min = INFINITY, step_max = 0;
    for (int i = 0; i < gp->steps; i++) {
        const double t0 = now_ms();
        if (regather) {
            /* The active members' conditioning, conditional entries then
             * unconditional ones, and their guidance per entry. */
            E = dit_gen_batch_gather(&b, embeds, L * Cj, in_emb);
            dit_gen_batch_gather(&b, pooled, Cp, in_pool);
            if (cfg) {
                dit_gen_batch_gather(&b, embeds + T * L * Cj, L * Cj, in_emb + E * L * Cj);
                dit_gen_batch_gather(&b, pooled + T * Cp, Cp, in_pool + E * Cp);
            }
            int64_t e = 0;
            for (int m = 0; m < n; m++)
                for (int64_t k = 0; b.active[m] && k < b.ni[m]; k++, e++)
                    guid[e] = guid[E + e] = gps[m].guidance_scale;
            regather = false;
        }
        const int64_t nb = (cfg_batch ? 2 : 1) * E;
        const int64_t sh_lat[3] = {nb, tokens, dim}, sh_emb[3] = {nb, L, Cj};
        const int64_t sh_pool[2] = {nb, Cp}, sh_one[1] = {nb};
        /* FluxTransformer2DModel.forward's arguments, whole. */
        dit_named_tensors in = {0};
        const dit_tensor t_lat = dit_tensor_make(in_lat, DIT_F32, 3, sh_lat);
        const dit_tensor t_emb = dit_tensor_make(in_emb, DIT_F32, 3, sh_emb);
        const dit_tensor t_pool = dit_tensor_make(in_pool, DIT_F32, 2, sh_pool);
        const dit_tensor t_nemb = dit_tensor_make(in_emb + E * L * Cj, DIT_F32, 3, sh_emb);
        const dit_tensor t_npool = dit_tensor_make(in_pool + E * Cp, DIT_F32, 2, sh_pool);
        const dit_tensor t_t = dit_tensor_make(t, DIT_F32, 1, sh_one);
        const dit_tensor t_g = dit_tensor_make(guid, DIT_F32, 1, sh_one);
        const dit_tensor t_v = dit_tensor_make(out, DIT_F32, 3, sh_lat);
        const dit_tensor t_vneg = dit_tensor_make(out + E * N, DIT_F32, 3, sh_lat);
        DIT_CHECK(dit_named_tensors_set(&in, "hidden_states", &t_lat));
        DIT_CHECK(dit_named_tensors_set(&in, "encoder_hidden_states", &t_emb));
        DIT_CHECK(dit_named_tensors_set(&in, "pooled_projections", &t_pool));
        DIT_CHECK(dit_named_tensors_set(&in, "timestep", &t_t));
        if (fc->guidance_embeds)
            DIT_CHECK(dit_named_tensors_set(&in, "guidance", &t_g));
        DIT_CHECK(dit_named_tensors_set(&in, "img_ids", &t_img));
        DIT_CHECK(dit_named_tensors_set(&in, "txt_ids", &t_txt));

        /* diffusers passes timestep / 1000 (f32); the model multiplies back. */
        const float ts = dit_scheduler_timestep(p->sched, i) / 1000.0f;
        for (int64_t k = 0; k < nb; k++)
            t[k] = ts;
        dit_gen_batch_gather(&b, lat, N, in_lat);
        if (cfg_batch)
            memcpy(in_lat + E * N, in_lat, sizeof(float) * (size_t)(E * N));
        DIT_CHECK(den->forward(den->ctx, &in, &t_v, diag));
        if (cfg && !cfg_batch) {
            DIT_CHECK(dit_named_tensors_set(&in, "encoder_hidden_states", &t_nemb));
            DIT_CHECK(dit_named_tensors_set(&in, "pooled_projections", &t_npool));
            DIT_CHECK(den->forward(den->ctx, &in, &t_vneg, diag));
        }
        if (cfg)
            dit_gen_batch_cfg(&b, out, N, gps, DIT_GEN_CFG_TRUE);
        dit_gen_batch_scatter(&b, out, N, v);
        DIT_CHECK(dit_scheduler_step(p->sched, i, lat, v, (size_t)(T * N), diag));
        dit_gen_batch_step_time(res, n, now_ms() - t0, &step_min, &step_max);
        DIT_CHECK(dit_gen_batch_progress(&b, progress, progress_ctx, i + 1, gp->steps,
                                         now_ms() - t_loop, res, member_st, v, N, &regather, diag));
    }
    dit_gen_batch_finish(&b, res, lat, N, now_ms() - t_loop);

    if (dit_gen_batch_decodes_any(&b, decode)) {
        const int64_t H = h * vs, W = w * vs;
        z = malloc(sizeof(float) * (size_t)(C * h * w));
        if (!z) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the image");
            goto cleanup;
        }
        for (int mb = 0; mb < n; mb++) {
            if (!dit_gen_batch_decodes(&b, decode, mb))
                continue;
            const double t0 = now_ms();
            dit_gen_result *r = &res[mb];
            const int64_t ni = b.ni[mb];
            r->image = malloc(sizeof(float) * (size_t)(ni * 3 * H * W));
            if (!r->image) {
                st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the image");
                goto cleanup;
            }
            /* One image at a time: the VAE's memory stays that of one. */
            for (int64_t m = 0; m < ni; m++) {
                if (!dit_gen_batch_decodes_image(&b, decode, mb, m))
                    continue; /* another rank's */
                dit_flux_unpack_latents(r->latents + m * N, C, h, w, z);
                const float sf = dit_vae_scaling_factor(p->vae), shf = dit_vae_shift_factor(p->vae);
                for (int64_t k = 0; k < C * h * w; k++) {
                    const float q = z[k] / sf;
                    z[k] = q + shf;
                }
                dit_tensor zt, img;
                const int64_t zs[4] = {1, C, h, w}, is[4] = {1, 3, H, W};
                DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 4, zs, &zt));
                DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 4, is, &img));
                dit_tensor hz = dit_tensor_make(z, DIT_F32, 4, zs);
                DIT_CHECK(p->be->ops->upload(p->be, &zt, &hz));
                DIT_CHECK(dit_vae_decode(p->vae, p->arena, &zt, &img, diag));
                dit_tensor hi = dit_tensor_make(r->image + m * 3 * H * W, DIT_F32, 4, is);
                DIT_CHECK(p->be->ops->download(p->be, &hi, &img));
                dit_arena_reset(p->arena);
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
    free(pooled);
    free(ids);
    free(noise);
    free(lat);
    free(v);
    free(in_lat);
    free(in_emb);
    free(in_pool);
    free(out);
    free(t);
    free(guid);
    free(z);
    return st;
}

const dit_pipeline_class dit_flux_pipeline_class = {
    .diffusers_class = "FluxPipeline",
    .load = flux_pipe_load,
    .free = flux_pipe_free,
    .transformer = flux_pipe_transformer,
    .generate_batch = flux_pipe_generate_batch,
};
