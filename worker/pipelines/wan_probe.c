#include "pipelines/wan_probe.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "loader/json_util.h"
#include "models/wan/wan_config.h"

#define PROBE_PATH 4096
/* Frames a request may ask for: 4 k + 1 up to this (Wan 2.1 makes 81). */
#define WAN_MAX_FRAMES 1025
#define WAN_MAX_SIDE 8192

/* The VAE's spatial factor (2^len(temperal_downsample)) and temporal
 * factor (2^(its true entries)), and z_dim, from vae/config.json; the full
 * check is the VAE loader's. */
static dit_status read_vae(const char *dir, int *spatial, int *temporal, int *z_dim, dit_diag *diag)
{
    char path[PROBE_PATH + 32];
    snprintf(path, sizeof path, "%s/vae/config.json", dir);
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    int64_t z = 0;
    DIT_CHECK(dit_json_get_int(root, "z_dim", path, false, 16, 1, 4096, &z, diag));
    *z_dim = (int)z;
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(root, "temperal_downsample");
    if (!a) {
        /* AutoencoderKLWan's default: [False, True, True]. */
        *spatial = 8;
        *temporal = 4;
        goto cleanup;
    }
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) < 1 || cJSON_GetArraySize(a) > 6) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: \"temperal_downsample\" must be an array of 1 to 6 booleans", path);
        goto cleanup;
    }
    *spatial = 1 << cJSON_GetArraySize(a);
    *temporal = 1;
    const cJSON *e;
    cJSON_ArrayForEach(e, a)
    {
        if (!cJSON_IsBool(e)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: \"temperal_downsample\" must be an array of booleans", path);
            goto cleanup;
        }
        if (cJSON_IsTrue(e))
            *temporal *= 2;
    }
cleanup:
    cJSON_Delete(root);
    return st;
}

static dit_status wan_probe(const char *dir, dit_pipeline_info *info, dit_diag *diag)
{
    char path[PROBE_PATH + 64];
    snprintf(path, sizeof path, "%s/transformer/config.json", dir);
    dit_wan_config c;
    dit_status st = dit_wan_config_load(path, &c, diag);
    if (st != DIT_OK)
        return st;
    int spatial = 0, temporal = 0, z_dim = 0;
    DIT_CHECK(read_vae(dir, &spatial, &temporal, &z_dim, diag));
    if (c.patch_size[0] != 1 || c.patch_size[1] != c.patch_size[2])
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "%s: patch_size (%d, %d, %d): WanPipeline is served with one latent "
                            "frame per patch and square spatial patches (Wan 2.1's (1, 2, 2))",
                            path, c.patch_size[0], c.patch_size[1], c.patch_size[2]);
    if (c.in_channels != z_dim || c.out_channels != z_dim)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: the transformer has %d input and %d output channels but the VAE's "
                            "z_dim is %d",
                            dir, c.in_channels, c.out_channels, z_dim);
    dit_transformer_info *t = &info->transformer;
    snprintf(t->class_name, sizeof t->class_name, "WanTransformer3DModel");
    t->num_layers = c.num_layers;
    t->num_single_layers = 0;
    t->inner_dim = c.inner_dim;
    t->in_channels = c.in_channels;
    t->joint_attention_dim = c.text_dim;
    t->pooled_projection_dim = 0;
    t->guidance_embeds = false;
    /* What WanTransformer3DModel's parallel_req says (models/wan). */
    info->parallel = (dit_parallel_req){
        .num_heads = c.num_attention_heads,
        .n_widths = 1,
        .widths = {c.ffn_dim},
        .width_names = {"ffn_dim"},
        .n_seqs = 1,
        .seq_names = {"video tokens"},
    };
    info->task = "text-to-video";
    info->vae_scale = spatial;
    info->latent_channels = c.in_channels;
    info->latent_dim = c.in_channels;
    info->size_multiple = spatial * c.patch_size[1];
    info->frame_step = temporal;
    /* WanPipeline.__call__'s defaults (Wan 2.1 at 480p) and its examples'
     * 16 frames per second. */
    info->default_width = 832;
    info->default_height = 480;
    info->default_frames = 81;
    info->default_fps = 16;
    info->default_steps = 50;
    info->default_guidance = 5.0f;
    info->default_max_sequence_length = 512;
    char p1[PROBE_PATH + 32], p2[PROBE_PATH + 32];
    snprintf(p1, sizeof p1, "%s/text_encoder", dir);
    snprintf(p2, sizeof p2, "%s/tokenizer", dir);
    info->has_text_encoders = dit_probe_is_dir(p1) && dit_probe_is_dir(p2);
    /* Under WanTransformer3DModel's and AutoencoderKLWan's config names. */
    dit_probe_add_config(info, "num_layers", c.num_layers);
    dit_probe_add_config(info, "num_attention_heads", c.num_attention_heads);
    dit_probe_add_config(info, "attention_head_dim", c.attention_head_dim);
    dit_probe_add_config(info, "in_channels", c.in_channels);
    dit_probe_add_config(info, "text_dim", c.text_dim);
    dit_probe_add_config(info, "z_dim", z_dim);
    dit_probe_add_config(info, "vae_scale_factor_spatial", spatial);
    dit_probe_add_config(info, "vae_scale_factor_temporal", temporal);
cleanup:
    return st;
}

void dit_wan_latent_dims(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *f,
                         int64_t *h, int64_t *w)
{
    *f = (gp->frames - 1) / info->frame_step + 1;
    *h = gp->height / info->vae_scale;
    *w = gp->width / info->vae_scale;
}

/* Classic CFG when guidance_scale > 1 (WanPipeline's
 * do_classifier_free_guidance), with the negative prompt or "". */
static bool wan_cfg(const dit_gen_params *gp)
{
    return gp->guidance_scale > 1.0f;
}

static dit_status wan_check(const dit_pipeline_info *info, const dit_gen_params *gp, dit_diag *diag)
{
    const int mult = info->size_multiple;
    if (gp->width < mult || gp->width > WAN_MAX_SIDE || gp->width % mult != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "width %d must be a positive multiple of %d (at most %d)", gp->width,
                            mult, WAN_MAX_SIDE);
    if (gp->height < mult || gp->height > WAN_MAX_SIDE || gp->height % mult != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "height %d must be a positive multiple of %d (at most %d)", gp->height,
                            mult, WAN_MAX_SIDE);
    const int fs = info->frame_step;
    if (gp->frames < 1 || gp->frames > WAN_MAX_FRAMES || (gp->frames - 1) % fs != 0) {
        /* The valid counts around it, within 1 .. WAN_MAX_FRAMES (so no
         * sum below can pass INT_MAX whatever the request asked). */
        const int near = gp->frames > WAN_MAX_FRAMES ? WAN_MAX_FRAMES : gp->frames;
        const int lo = near < 1 ? 1 : 1 + (near - 1) / fs * fs;
        const int hi = lo + fs > WAN_MAX_FRAMES ? lo : lo + fs;
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_frames %d: WanPipeline makes %d k + 1 frames (1, %d, %d, ... %d; "
                            "the VAE decodes %d frames per latent frame after the first), e.g. %d "
                            "or %d",
                            gp->frames, fs, fs + 1, 2 * fs + 1, WAN_MAX_FRAMES, fs, lo, hi);
    }
    if (gp->fps < 0 || gp->fps > 240)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "fps %d must be between 1 and 240 (0: %d)",
                            gp->fps, info->default_fps);
    if (gp->steps < 1 || gp->steps > 1000)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_inference_steps %d must be between 1 and 1000", gp->steps);
    if (!isfinite(gp->guidance_scale) || gp->guidance_scale < 0 || gp->guidance_scale > 100)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "guidance_scale %g must be between 0 and 100 (above 1: classifier-free "
                            "guidance)",
                            gp->guidance_scale);
    /* Up to 1 it is off, as on FLUX; anything else asks for what Wan lacks. */
    if (!isfinite(gp->true_cfg_scale) || gp->true_cfg_scale < 0 || gp->true_cfg_scale > 1.0f)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "true_cfg_scale %g: WanPipeline guides with guidance_scale (classic "
                            "classifier-free guidance with the negative prompt); leave "
                            "true_cfg_scale unset",
                            gp->true_cfg_scale);
    if (gp->prompt_2 || gp->negative_prompt_2)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "WanPipeline has one text encoder: prompt_2 and negative_prompt_2 do "
                            "not apply");
    if (gp->max_sequence_length < 0 || gp->max_sequence_length > 512)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "max_sequence_length %d must be between 1 and 512 (0: 512)",
                            gp->max_sequence_length);
    if (gp->pooled_prompt_embeds || gp->negative_pooled_prompt_embeds)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "WanPipeline has no pooled text embeddings: send prompt_embeds alone");
    const bool own = gp->prompt_embeds != NULL;
    if (own && (gp->prompt_embeds_len < 1 || gp->prompt_embeds_len > 4096))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "prompt_embeds must hold 1 to 4096 tokens, not %lld",
                            (long long)gp->prompt_embeds_len);
    if (!own && !gp->prompt)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "a prompt (or prompt_embeds) is required");
    const bool need_encoder = !own || (wan_cfg(gp) && !gp->negative_prompt_embeds);
    if (need_encoder && !info->has_text_encoders)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "this pipeline has no text encoder: send prompt_embeds (and, with "
                            "guidance_scale above 1, negative_prompt_embeds)");
    if (gp->negative_prompt_embeds && !own)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "negative_prompt_embeds come with prompt_embeds");
    if (own && wan_cfg(gp) && !gp->negative_prompt_embeds) {
        /* diffusers encodes the negative prompt at max_sequence_length and
         * runs it as a forward of its own; both sides here share one text
         * length, which equals diffusers' only at that length. */
        const int64_t msl =
            gp->max_sequence_length ? gp->max_sequence_length : info->default_max_sequence_length;
        if (gp->prompt_embeds_len != msl)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "with your own prompt_embeds (%lld tokens) and guidance_scale "
                                "above 1, send negative_prompt_embeds too, or prompt_embeds of "
                                "max_sequence_length (%lld) tokens, the length the negative "
                                "prompt is encoded at",
                                (long long)gp->prompt_embeds_len, (long long)msl);
    }
    if (gp->negative_prompt_embeds && gp->negative_prompt_embeds_len != gp->prompt_embeds_len)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "negative_prompt_embeds (%lld tokens) must match prompt_embeds (%lld)",
                            (long long)gp->negative_prompt_embeds_len,
                            (long long)gp->prompt_embeds_len);
    return DIT_OK;
}

/* Video tokens: latent frames / pt x rows / ph x columns / pw. */
static void wan_seq_lens(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *lens)
{
    int64_t f, h, w;
    dit_wan_latent_dims(info, gp, &f, &h, &w);
    const int64_t p = info->size_multiple / info->vae_scale;
    lens[0] = f * (h / p) * (w / p);
}

/* Frame counts nearest to a request's, the latent frame count f changed
 * by the fewest steps, within 1 .. WAN_MAX_FRAMES, whose f * per_frame
 * tokens are a multiple of C; "N or M" into list (empty when none). */
static void nearest_frames(int64_t f, int64_t per_frame, int fs, int C, char *list, size_t cap)
{
    list[0] = '\0';
    for (int k = 1; k <= C; k++) {
        for (int sign = -1; sign <= 1; sign += 2) {
            const int64_t nf = f + sign * k;
            const int64_t frames = (nf - 1) * fs + 1;
            if (nf < 1 || frames > WAN_MAX_FRAMES || (nf * per_frame) % C != 0)
                continue;
            const size_t used = strlen(list);
            snprintf(list + used, cap - used, "%s%lld", used ? " or " : "", (long long)frames);
        }
        if (list[0])
            return;
    }
}

/* What the client can change when the mesh cannot split the video tokens
 * evenly: the nearest sizes, or the nearest frame counts. */
static bool wan_mesh_advice(const dit_pipeline_info *info, const dit_gen_params *gp,
                            const dit_parallel_config *pc, char *buf, size_t cap)
{
    const int C = pc->ring_degree * pc->ulysses_degree;
    if (C <= 1 || dit_parallel_uneven(pc))
        return false;
    int64_t tokens;
    wan_seq_lens(info, gp, &tokens);
    if (tokens % C == 0)
        return false;
    const int mult = info->size_multiple;
    int64_t f, hw[2];
    dit_wan_latent_dims(info, gp, &f, &hw[0], &hw[1]);
    const int64_t per_frame = (int64_t)(gp->width / mult) * (gp->height / mult);
    char sizes[128], frames[64];
    dit_gen_nearest_sizes(gp->width, gp->height, mult, WAN_MAX_SIDE, f, C, sizes, sizeof sizes);
    nearest_frames(f, per_frame, info->frame_step, C, frames, sizeof frames);
    snprintf(buf, cap,
             "a %dx%d video of %d frame%s is %lld tokens (%lld latent frame%s of %dx%d, one token "
             "per %dx%d pixels), which this server's %d context-parallel ranks cannot split "
             "evenly: it needs a multiple of %d. The nearest sizes that work: %s%s%s",
             gp->width, gp->height, gp->frames, gp->frames == 1 ? "" : "s", (long long)tokens,
             (long long)f, f == 1 ? "" : "s", gp->width / mult, gp->height / mult, mult, mult, C, C,
             sizes[0] ? sizes : "none", frames[0] ? "; or num_frames " : "", frames);
    return true;
}

static int wan_latents_shape(const dit_pipeline_info *info, const dit_gen_params *gp,
                             int64_t *shape)
{
    shape[0] = 1;
    shape[1] = info->latent_channels;
    dit_wan_latent_dims(info, gp, &shape[2], &shape[3], &shape[4]);
    return 5;
}

/* A negative prompt only matters with guidance above 1. */
static bool wan_warning(const dit_pipeline_info *info, const dit_gen_params *gp,
                        const dit_gen_field_names *names, char *buf, size_t cap)
{
    (void)info;
    if ((gp->negative_prompt || gp->negative_prompt_embeds) && !wan_cfg(gp)) {
        snprintf(buf, cap, "%s has no effect: classifier-free guidance needs %s above 1 (it is %g)",
                 names->negative_prompt, names->guidance_scale, (double)gp->guidance_scale);
        return true;
    }
    return false;
}

static bool wan_cfg_hook(const dit_pipeline_info *info, const dit_gen_params *gp)
{
    (void)info;
    return wan_cfg(gp);
}

const dit_pipeline_probe_class dit_probe_wan_pipeline = {
    .diffusers_class = "WanPipeline",
    .probe = wan_probe,
    .check = wan_check,
    .seq_lens = wan_seq_lens,
    .mesh_advice = wan_mesh_advice,
    .latents_shape = wan_latents_shape,
    .warning = wan_warning,
    .cfg = wan_cfg_hook,
};
