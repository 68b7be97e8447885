#include "pipelines/flux_pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "backend/arena.h"
#include "loader/json_util.h"
#include "schedulers/flow_match_euler.h"
#include "core/torch_rng.h"
#include "encoders/clip_text.h"
#include "encoders/clip_tokenizer.h"
#include "encoders/t5_encoder.h"
#include "encoders/t5_tokenizer.h"
#include "vae/autoencoder_kl.h"

#define PIPE_PATH 4096

struct dit_pipeline {
    dit_backend *be;
    char dir[PIPE_PATH];
    dit_flux *transformer;
    dit_vae_decoder *vae;
    dit_clip_text *clip;
    dit_t5_encoder *t5;
    dit_clip_tokenizer *tok;
    dit_t5_tokenizer *tok2;
    dit_flow_scheduler sched;
    dit_arena *arena;
    dit_pipeline_info info;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static bool is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* 2^(len(block_out_channels) - 1), read from vae/config.json even when the
 * VAE weights are not loaded (ranks that never decode still validate sizes). */
static dit_status read_vae_scale(const char *dir, int *scale, dit_diag *diag)
{
    char path[PIPE_PATH + 32];
    snprintf(path, sizeof path, "%s/vae/config.json", dir);
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    int64_t blocks[16];
    int n = 0;
    st = dit_json_get_int_array(root, "block_out_channels", path, blocks, 16, &n, diag);
    if (st == DIT_OK && n < 1)
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: block_out_channels is empty", path);
    if (st == DIT_OK)
        *scale = 1 << (n - 1);
    cJSON_Delete(root);
    return st;
}

static bool is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* No model_index.json in dir. The usual slip is to name one component of a
 * pipeline (its transformer/, say) instead of the pipeline itself: say so,
 * and name the folder that would work. */
static dit_status not_a_pipeline(const char *dir, dit_diag *diag)
{
    char path[PIPE_PATH + 64], parent[PIPE_PATH];
    snprintf(parent, sizeof parent, "%s", dir);
    size_t n = strlen(parent);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = '\0';
    char *slash = strrchr(parent, '/');
    if (slash)
        *(slash == parent ? slash + 1 : slash) = '\0';
    else
        snprintf(parent, sizeof parent, ".");
    snprintf(path, sizeof path, "%s/config.json", dir);
    const bool component = is_file(path);
    snprintf(path, sizeof path, "%s/model_index.json", parent);
    const bool parent_is_pipeline = is_file(path);
    if (component && parent_is_pipeline)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s is one component of a pipeline, not the pipeline: point --model at "
                            "the pipeline folder that holds model_index.json, here %s",
                            dir, parent);
    if (component)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s holds a config.json but no model_index.json: it is a model "
                            "folder; point --model at the diffusers pipeline folder (with "
                            "model_index.json, transformer/, vae/, ...)",
                            dir);
    snprintf(path, sizeof path, "%s/model_index.json", dir);
    return dit_diag_set(diag, DIT_ERR_NOT_FOUND,
                        "%s: no such file; --model wants a diffusers pipeline folder (with "
                        "model_index.json, transformer/, vae/, ...)",
                        path);
}

dit_status dit_pipeline_probe(const char *dir, dit_pipeline_info *out, dit_diag *diag)
{
    char path[PIPE_PATH + 64];
    cJSON *index = NULL;
    dit_pipeline_info info;
    memset(&info, 0, sizeof info);
    snprintf(path, sizeof path, "%s/model_index.json", dir);
    if (!is_file(path))
        return not_a_pipeline(dir, diag);
    dit_status st = dit_json_load_file(path, &index, diag);
    if (st != DIT_OK)
        return st;
    const char *cls = NULL;
    DIT_CHECK(dit_json_get_string(index, "_class_name", path, true, &cls, diag));
    if (strcmp(cls, "FluxPipeline") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: pipeline class \"%s\" is not supported (FluxPipeline is)", path, cls);
        goto cleanup;
    }
    snprintf(path, sizeof path, "%s/transformer/config.json", dir);
    DIT_CHECK(dit_flux_config_load(path, &info.transformer, diag));
    if (info.transformer.in_channels % 4 != 0 || info.transformer.patch_size != 1) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: FluxPipeline needs patch_size 1 and in_channels divisible by 4",
                          path);
        goto cleanup;
    }
    info.latent_channels = info.transformer.in_channels / 4;
    DIT_CHECK(read_vae_scale(dir, &info.vae_scale, diag));
    char p1[PIPE_PATH + 32], p2[PIPE_PATH + 32];
    snprintf(p1, sizeof p1, "%s/text_encoder", dir);
    snprintf(p2, sizeof p2, "%s/text_encoder_2", dir);
    info.has_text_encoders = is_dir(p1) && is_dir(p2);
    *out = info;
cleanup:
    cJSON_Delete(index);
    return st;
}

const dit_pipeline_info *dit_pipeline_get_info(const dit_pipeline *p)
{
    return &p->info;
}

dit_status dit_pipeline_load(dit_backend *be, const char *dir, const dit_flux_shard *shard,
                             bool load_vae, dit_pipeline **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char path[PIPE_PATH + 64];
    dit_pipeline *p = calloc(1, sizeof *p);
    if (!p)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    p->be = be;
    snprintf(p->dir, sizeof p->dir, "%s", dir);

    DIT_CHECK(dit_pipeline_probe(dir, &p->info, diag));
    snprintf(path, sizeof path, "%s/transformer", dir);
    DIT_CHECK(dit_flux_load(be, path, shard, &p->transformer, diag));
    const dit_flux_config *fc = dit_flux_config_of(p->transformer);
    snprintf(path, sizeof path, "%s/scheduler/scheduler_config.json", dir);
    DIT_CHECK(dit_flow_scheduler_load(path, &p->sched, diag));
    if (load_vae) {
        snprintf(path, sizeof path, "%s/vae", dir);
        DIT_CHECK(dit_vae_decoder_load(be, path, &p->vae, diag));
        if (dit_vae_latent_channels(p->vae) != p->info.latent_channels) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: the VAE has %d latent channels but the transformer expects %d",
                              dir, dit_vae_latent_channels(p->vae), p->info.latent_channels);
            goto cleanup;
        }
    }
    /* The text side is optional: a pipeline saved without it serves requests
     * that bring their own embeddings. */
    snprintf(path, sizeof path, "%s/text_encoder", dir);
    if (is_dir(path)) {
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
    if (is_dir(path)) {
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
    dit_pipeline_free(p);
    return st;
}

void dit_pipeline_free(dit_pipeline *p)
{
    if (!p)
        return;
    dit_arena_destroy(p->arena);
    dit_t5_tokenizer_free(p->tok2);
    dit_t5_encoder_free(p->t5);
    dit_clip_tokenizer_free(p->tok);
    dit_clip_text_free(p->clip);
    dit_vae_decoder_free(p->vae);
    dit_flux_destroy(p->transformer);
    free(p);
}

dit_flux *dit_pipeline_transformer(dit_pipeline *p)
{
    return p->transformer;
}

static bool finite_f(float v)
{
    return isfinite(v);
}

dit_status dit_gen_check(const dit_pipeline_info *info, const dit_gen_params *gp, dit_diag *diag)
{
    const int mult = 2 * info->vae_scale;
    const dit_flux_config *fc = &info->transformer;
    if (gp->width < mult || gp->width > 16384 || gp->width % mult != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "width %d must be a positive multiple of %d (at most 16384)",
                            gp->width, mult);
    if (gp->height < mult || gp->height > 16384 || gp->height % mult != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "height %d must be a positive multiple of %d (at most 16384)",
                            gp->height, mult);
    if (gp->steps < 1 || gp->steps > 1000)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_inference_steps %d must be between 1 and 1000", gp->steps);
    if (!finite_f(gp->guidance_scale) || gp->guidance_scale < 0 || gp->guidance_scale > 100)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "guidance_scale %g must be between 0 and 100", gp->guidance_scale);
    if (!finite_f(gp->true_cfg_scale) || gp->true_cfg_scale < 0 || gp->true_cfg_scale > 100)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "true_cfg_scale %g must be between 0 and 100", gp->true_cfg_scale);
    if (gp->max_sequence_length < 0 || gp->max_sequence_length > 512)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "max_sequence_length %d must be between 1 and 512 (0: 512)",
                            gp->max_sequence_length);
    const bool own_embeds = gp->prompt_embeds != NULL;
    if (own_embeds != (gp->pooled_prompt_embeds != NULL))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "prompt_embeds and pooled_prompt_embeds come together");
    if (own_embeds && (gp->prompt_embeds_len < 1 || gp->prompt_embeds_len > 4096))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "prompt_embeds must hold 1 to 4096 tokens, not %lld",
                            (long long)gp->prompt_embeds_len);
    if (!own_embeds && !gp->prompt)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "a prompt (or prompt_embeds) is required");
    if (!own_embeds && !info->has_text_encoders)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "this pipeline has no text encoders: send prompt_embeds and "
                            "pooled_prompt_embeds");
    const bool cfg = gp->true_cfg_scale > 1.0f &&
                     (gp->negative_prompt || gp->negative_prompt_embeds);
    if (cfg && own_embeds != (gp->negative_prompt_embeds != NULL))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "with your own prompt_embeds, true CFG needs negative_prompt_embeds "
                            "(and the other way round)");
    if (cfg && own_embeds &&
        (!gp->negative_pooled_prompt_embeds ||
         gp->negative_prompt_embeds_len != gp->prompt_embeds_len))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "negative_prompt_embeds must match prompt_embeds in shape and come "
                            "with negative_pooled_prompt_embeds");
    (void)fc;
    return DIT_OK;
}

/* CLIP pooled output (pooled_dim) and T5 hidden states (len, d_model) of
 * one prompt, on the host. */
static dit_status encode_prompt(dit_pipeline *p, const char *prompt, const char *prompt_2,
                                int max_len, float *pooled, float *embeds, bool *truncated,
                                double *tok_ms, double *enc_ms, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = p->be;
    const int clip_len = dit_clip_tokenizer_max_length(p->tok);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(clip_len > max_len ? clip_len : max_len));
    if (!ids)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    int n = 0;
    bool cut = false;
    dit_tensor pooled_t, emb_t;
    const int64_t hidden = dit_clip_text_hidden_size(p->clip), d = dit_t5_encoder_d_model(p->t5);

    double t0 = now_ms();
    DIT_CHECK(dit_clip_tokenizer_encode(p->tok, prompt, ids, clip_len, &n, &cut, diag));
    *truncated = *truncated || cut;
    *tok_ms += now_ms() - t0;
    t0 = now_ms();
    const int64_t ps[2] = {1, hidden};
    DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 2, ps, &pooled_t));
    DIT_CHECK(dit_clip_text_forward(p->clip, p->arena, ids, 1, clip_len, &pooled_t, NULL, diag));
    dit_tensor hp = dit_tensor_2d(pooled, DIT_F32, 1, hidden);
    DIT_CHECK(be->ops->download(be, &hp, &pooled_t));
    *enc_ms += now_ms() - t0;

    t0 = now_ms();
    DIT_CHECK(dit_t5_tokenizer_encode(p->tok2, prompt_2 ? prompt_2 : prompt, ids, max_len, &n,
                                      &cut, diag));
    *truncated = *truncated || cut;
    *tok_ms += now_ms() - t0;
    t0 = now_ms();
    const int64_t es[3] = {1, max_len, d};
    DIT_CHECK(dit_arena_tensor(p->arena, DIT_F32, 3, es, &emb_t));
    DIT_CHECK(dit_t5_encoder_forward(p->t5, p->arena, ids, 1, max_len, &emb_t, diag));
    dit_tensor he = dit_tensor_3d(embeds, DIT_F32, 1, max_len, d);
    DIT_CHECK(be->ops->download(be, &he, &emb_t));
    *enc_ms += now_ms() - t0;
cleanup:
    dit_arena_reset(p->arena);
    free(ids);
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

bool dit_gen_true_cfg(const dit_gen_params *gp)
{
    return gp->true_cfg_scale > 1.0f && (gp->negative_prompt || gp->negative_prompt_embeds);
}

bool dit_gen_true_cfg_warning(const dit_gen_params *gp, const char *neg_name, const char *cfg_name,
                              char *buf, size_t cap)
{
    const bool neg = gp->negative_prompt || gp->negative_prompt_embeds;
    if (neg && !(gp->true_cfg_scale > 1.0f)) {
        snprintf(buf, cap,
                 "%s has no effect: true classifier-free guidance needs %s above 1 "
                 "(it is %g)",
                 neg_name, cfg_name, (double)gp->true_cfg_scale);
        return true;
    }
    if (!neg && gp->true_cfg_scale > 1.0f) {
        snprintf(buf, cap, "%s %g has no effect: true classifier-free guidance needs a %s",
                 cfg_name, (double)gp->true_cfg_scale, neg_name);
        return true;
    }
    return false;
}

dit_status dit_pipeline_generate(dit_pipeline *p, dit_runner *runner, const dit_gen_params *gp,
                                 bool decode, dit_gen_progress_fn progress, void *progress_ctx,
                                 dit_gen_result *res, dit_diag *diag)
{
    dit_status st = DIT_OK;
    memset(res, 0, sizeof *res);
    st = dit_gen_check(&p->info, gp, diag);
    if (st != DIT_OK)
        return st;
    if (decode && !p->vae)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "this rank has no VAE to decode with");
    const dit_flux_config *fc = dit_flux_config_of(p->transformer);
    const int64_t C = p->info.latent_channels;
    const int vs = p->info.vae_scale;
    const int64_t h = 2 * (gp->height / (vs * 2)), w = 2 * (gp->width / (vs * 2));
    const int64_t tokens = (h / 2) * (w / 2), dim = 4 * C;
    const int max_len = gp->max_sequence_length ? gp->max_sequence_length : 512;
    const bool cfg = dit_gen_true_cfg(gp);
    const int64_t L = gp->prompt_embeds ? gp->prompt_embeds_len : max_len;
    const int64_t Cj = fc->joint_attention_dim, Cp = fc->pooled_projection_dim;

    float *embeds = NULL, *pooled = NULL, *neg_embeds = NULL, *neg_pooled = NULL;
    float *ids = NULL, *noise = NULL, *v = NULL, *v_neg = NULL, *sigmas = NULL, *timesteps = NULL;
    float *z = NULL;
    embeds = malloc(sizeof(float) * (size_t)(L * Cj));
    pooled = malloc(sizeof(float) * (size_t)Cp);
    neg_embeds = cfg ? malloc(sizeof(float) * (size_t)(L * Cj)) : NULL;
    neg_pooled = cfg ? malloc(sizeof(float) * (size_t)Cp) : NULL;
    ids = calloc((size_t)((tokens + L) * 3), sizeof(float));
    res->initial_latents = malloc(sizeof(float) * (size_t)(tokens * dim));
    res->latents = malloc(sizeof(float) * (size_t)(tokens * dim));
    v = malloc(sizeof(float) * (size_t)(tokens * dim));
    v_neg = cfg ? malloc(sizeof(float) * (size_t)(tokens * dim)) : NULL;
    sigmas = malloc(sizeof(float) * (size_t)(gp->steps + 1));
    timesteps = malloc(sizeof(float) * (size_t)gp->steps);
    if (!embeds || !pooled || (cfg && (!neg_embeds || !neg_pooled)) || !ids ||
        !res->initial_latents || !res->latents || !v || (cfg && !v_neg) || !sigmas || !timesteps) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for a %dx%d generation", gp->width,
                          gp->height);
        goto cleanup;
    }
    res->width = gp->width;
    res->height = gp->height;
    res->latent_tokens = tokens;
    res->latent_dim = dim;

    /* Conditioning. */
    if (gp->prompt_embeds) {
        memcpy(embeds, gp->prompt_embeds, sizeof(float) * (size_t)(L * Cj));
        memcpy(pooled, gp->pooled_prompt_embeds, sizeof(float) * (size_t)Cp);
        if (cfg) {
            memcpy(neg_embeds, gp->negative_prompt_embeds, sizeof(float) * (size_t)(L * Cj));
            memcpy(neg_pooled, gp->negative_pooled_prompt_embeds, sizeof(float) * (size_t)Cp);
        }
    } else {
        DIT_CHECK(encode_prompt(p, gp->prompt, gp->prompt_2, max_len, pooled, embeds,
                                &res->prompt_truncated, &res->tokenize_ms, &res->encode_ms, diag));
        if (cfg)
            DIT_CHECK(encode_prompt(p, gp->negative_prompt,
                                    gp->negative_prompt_2 ? gp->negative_prompt_2
                                                          : gp->negative_prompt,
                                    max_len, neg_pooled, neg_embeds, &res->prompt_truncated,
                                    &res->tokenize_ms, &res->encode_ms, diag));
    }

    /* Initial latents: the caller's, or torch.randn((1, C, h, w)) from the
     * seed, packed 2x2. */
    if (gp->latents) {
        memcpy(res->initial_latents, gp->latents, sizeof(float) * (size_t)(tokens * dim));
    } else {
        noise = malloc(sizeof(float) * (size_t)(tokens * dim));
        if (!noise) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
            goto cleanup;
        }
        dit_mt19937 g;
        dit_mt19937_seed(&g, gp->seed);
        dit_torch_randn(&g, noise, (size_t)(tokens * dim));
        dit_flux_pack_latents(noise, C, h, w, res->initial_latents);
    }
    memcpy(res->latents, res->initial_latents, sizeof(float) * (size_t)(tokens * dim));

    /* Position ids: text all zero, image [0, row, col]. */
    float *txt_ids = ids, *img_ids = ids + L * 3;
    for (int64_t i = 0; i < h / 2; i++)
        for (int64_t j = 0; j < w / 2; j++) {
            img_ids[(i * (w / 2) + j) * 3 + 1] = (float)i;
            img_ids[(i * (w / 2) + j) * 3 + 2] = (float)j;
        }

    DIT_CHECK(dit_flow_scheduler_schedule(&p->sched, gp->steps, tokens, sigmas, timesteps, diag));
    const float guidance = gp->guidance_scale;
    dit_forward_inputs in = {
        .batch = 1,
        .img_tokens = tokens,
        .txt_tokens = L,
        .hidden_states = res->latents,
        .encoder_hidden_states = embeds,
        .pooled_projections = pooled,
        .guidance = fc->guidance_embeds ? &guidance : NULL,
        .img_ids = img_ids,
        .txt_ids = txt_ids,
    };
    const double t_loop = now_ms();
    res->step_ms_min = INFINITY;
    for (int i = 0; i < gp->steps; i++) {
        const double t0 = now_ms();
        /* diffusers passes timestep / 1000 (f32); the model multiplies back. */
        const float t = timesteps[i] / 1000.0f;
        in.timestep = &t;
        in.encoder_hidden_states = embeds;
        in.pooled_projections = pooled;
        DIT_CHECK(dit_runner_forward(runner, &in, v, diag));
        if (cfg) {
            in.encoder_hidden_states = neg_embeds;
            in.pooled_projections = neg_pooled;
            DIT_CHECK(dit_runner_forward(runner, &in, v_neg, diag));
            /* noise = neg + scale * (pos - neg), in diffusers' order. */
            for (int64_t k = 0; k < tokens * dim; k++) {
                const float diff = v[k] - v_neg[k];
                const float scaled = gp->true_cfg_scale * diff;
                v[k] = v_neg[k] + scaled;
            }
        }
        dit_flow_scheduler_step(res->latents, v, (size_t)(tokens * dim), sigmas[i], sigmas[i + 1]);
        const double dt = now_ms() - t0;
        res->step_ms_min = dt < res->step_ms_min ? dt : res->step_ms_min;
        res->step_ms_max = dt > res->step_ms_max ? dt : res->step_ms_max;
        if (progress)
            DIT_CHECK(progress(progress_ctx, i + 1, gp->steps, now_ms() - t_loop));
    }
    res->denoise_ms = now_ms() - t_loop;

    if (decode) {
        const double t0 = now_ms();
        const int64_t H = h * vs, W = w * vs;
        z = malloc(sizeof(float) * (size_t)(C * h * w));
        res->image = malloc(sizeof(float) * (size_t)(3 * H * W));
        if (!z || !res->image) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the image");
            goto cleanup;
        }
        dit_flux_unpack_latents(res->latents, C, h, w, z);
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
        dit_tensor hi = dit_tensor_make(res->image, DIT_F32, 4, is);
        DIT_CHECK(p->be->ops->download(p->be, &hi, &img));
        res->vae_ms = now_ms() - t0;
    }
cleanup:
    if (st != DIT_OK)
        dit_gen_result_free(res);
    dit_arena_reset(p->arena);
    free(embeds);
    free(pooled);
    free(neg_embeds);
    free(neg_pooled);
    free(ids);
    free(noise);
    free(v);
    free(v_neg);
    free(sigmas);
    free(timesteps);
    free(z);
    return st;
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
