#include "pipelines/flux_probe.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "loader/json_util.h"
#include "models/flux/flux_config.h"

#define PROBE_PATH 4096
#define FLUX_MAX_SIDE 16384

/* transformer/config.json through the model's own config reader
 * (models/flux/flux_config.h: the keys, defaults and checks diffusers'
 * FluxTransformer2DModel has; it parses JSON only, so ditd links it without
 * any model code), and the rules a request depends on. */
static dit_status read_transformer(const char *path, dit_pipeline_info *info, dit_diag *diag)
{
    dit_flux_config c;
    dit_status st = dit_flux_config_load(path, &c, diag);
    if (st != DIT_OK)
        return st;
    if (c.in_channels % 4 != 0 || c.patch_size != 1)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "%s: FluxPipeline needs patch_size 1 and in_channels divisible by 4",
                            path);
    dit_transformer_info *t = &info->transformer;
    snprintf(t->class_name, sizeof t->class_name, "FluxTransformer2DModel");
    t->num_layers = c.num_layers;
    t->num_single_layers = c.num_single_layers;
    t->inner_dim = c.inner_dim;
    t->in_channels = c.in_channels;
    t->joint_attention_dim = c.joint_attention_dim;
    t->pooled_projection_dim = c.pooled_projection_dim;
    t->guidance_embeds = c.guidance_embeds;
    /* What FluxTransformer2DModel's parallel_req says (models/flux). */
    info->parallel = (dit_parallel_req){
        .num_heads = c.num_attention_heads,
        .n_widths = 1,
        .widths = {c.mlp_dim},
        .width_names = {"the FFN width"},
        .n_seqs = 2,
        .seq_names = {"image tokens", "text tokens"},
    };
    return DIT_OK;
}

/* 2^(len(block_out_channels) - 1), read from vae/config.json even when the
 * VAE weights are not loaded (ranks that never decode still validate sizes). */
static dit_status read_vae_scale(const char *dir, int *scale, dit_diag *diag)
{
    char path[PROBE_PATH + 32];
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

static dit_status flux_probe(const char *dir, dit_pipeline_info *info, dit_diag *diag)
{
    char path[PROBE_PATH + 64];
    snprintf(path, sizeof path, "%s/transformer/config.json", dir);
    dit_status st = read_transformer(path, info, diag);
    if (st != DIT_OK)
        return st;
    info->task = "text-to-image";
    info->latent_channels = info->transformer.in_channels / 4;
    info->latent_dim = info->transformer.in_channels;
    DIT_CHECK(read_vae_scale(dir, &info->vae_scale, diag));
    info->size_multiple = 2 * info->vae_scale;
    info->default_width = info->default_height = 1024;
    info->default_frames = 1;
    info->default_steps = 28;
    info->default_guidance = 3.5f;
    info->default_max_sequence_length = 512;
    info->frame_step = 0;
    info->default_fps = 0;
    char p1[PROBE_PATH + 32], p2[PROBE_PATH + 32];
    snprintf(p1, sizeof p1, "%s/text_encoder", dir);
    snprintf(p2, sizeof p2, "%s/text_encoder_2", dir);
    info->has_text_encoders = dit_probe_is_dir(p1) && dit_probe_is_dir(p2);
    const dit_transformer_info *t = &info->transformer;
    dit_probe_add_config(info, "num_layers", t->num_layers);
    dit_probe_add_config(info, "num_single_layers", t->num_single_layers);
    dit_probe_add_config(info, "num_attention_heads", info->parallel.num_heads);
    dit_probe_add_config(info, "attention_head_dim", t->inner_dim / info->parallel.num_heads);
    dit_probe_add_config(info, "in_channels", t->in_channels);
    dit_probe_add_config(info, "joint_attention_dim", t->joint_attention_dim);
    dit_probe_add_config(info, "pooled_projection_dim", t->pooled_projection_dim);
    dit_probe_add_config(info, "guidance_embeds", t->guidance_embeds ? 1 : 0);
    dit_probe_add_config(info, "latent_channels", info->latent_channels);
    dit_probe_add_config(info, "vae_scale_factor", info->vae_scale);
cleanup:
    return st;
}

static bool finite_f(float v)
{
    return isfinite(v);
}

static dit_status flux_check(const dit_pipeline_info *info, const dit_gen_params *gp,
                             dit_diag *diag)
{
    const int mult = info->size_multiple;
    if (gp->width < mult || gp->width > FLUX_MAX_SIDE || gp->width % mult != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "width %d must be a positive multiple of %d (at most %d)", gp->width,
                            mult, FLUX_MAX_SIDE);
    if (gp->height < mult || gp->height > FLUX_MAX_SIDE || gp->height % mult != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "height %d must be a positive multiple of %d (at most %d)", gp->height,
                            mult, FLUX_MAX_SIDE);
    if (gp->frames < 0 || gp->frames > 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "FluxPipeline makes images: frames %d must be 1 (or 0)", gp->frames);
    if (gp->fps != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "FluxPipeline makes images, which have no frame rate: leave fps 0");
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
    const bool cfg =
        gp->true_cfg_scale > 1.0f && (gp->negative_prompt || gp->negative_prompt_embeds);
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
    return DIT_OK;
}

/* Image tokens: one per 2x2 latent pixels; text tokens: the embeddings'
 * length or max_sequence_length. */
static void flux_seq_lens(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *lens)
{
    const int mult = info->size_multiple;
    lens[0] = (int64_t)(gp->height / mult) * (gp->width / mult);
    lens[1] = gp->prompt_embeds ? gp->prompt_embeds_len
                                : (gp->max_sequence_length ? gp->max_sequence_length
                                                           : info->default_max_sequence_length);
}

/* What the client can change when the mesh refuses a request: the nearest
 * sizes whose image tokens split evenly, or a max_sequence_length (or
 * prompt_embeds length) that does. */
static bool flux_mesh_advice(const dit_pipeline_info *info, const dit_gen_params *gp,
                             const dit_parallel_config *pc, char *buf, size_t cap)
{
    const int C = pc->ring_degree * pc->ulysses_degree;
    const int mult = info->size_multiple;
    const int64_t img = (int64_t)(gp->height / mult) * (gp->width / mult);
    const int64_t txt = gp->prompt_embeds
                            ? gp->prompt_embeds_len
                            : (gp->max_sequence_length ? gp->max_sequence_length
                                                       : info->default_max_sequence_length);
    const bool plain = C > 1 && !dit_parallel_uneven(pc);
    if (plain && img % C != 0) {
        char sizes[128];
        dit_gen_nearest_sizes(gp->width, gp->height, mult, FLUX_MAX_SIDE, 1, C, sizes,
                              sizeof sizes);
        snprintf(buf, cap,
                 "a %dx%d image is %lld tokens (one per %dx%d pixels), which this server's %d "
                 "context-parallel ranks cannot split evenly: it needs a multiple of %d. The "
                 "nearest sizes that work: %s",
                 gp->width, gp->height, (long long)img, mult, mult, C, C, sizes);
    } else if (plain && txt % C != 0) {
        const int64_t down = txt - txt % C, up = down + C;
        if (gp->prompt_embeds)
            snprintf(buf, cap,
                     "prompt_embeds has %lld tokens, which this server's %d context-parallel "
                     "ranks cannot split evenly: it needs a multiple of %d (e.g. %lld)",
                     (long long)txt, C, C, (long long)up);
        else if (down > 0 && up <= info->default_max_sequence_length)
            snprintf(buf, cap,
                     "max_sequence_length %lld cannot be split evenly over this server's %d "
                     "context-parallel ranks: use a multiple of %d, e.g. %lld or %lld",
                     (long long)txt, C, C, (long long)down, (long long)up);
        else if (down > 0)
            snprintf(buf, cap,
                     "max_sequence_length %lld cannot be split evenly over this server's %d "
                     "context-parallel ranks: use a multiple of %d, e.g. %lld",
                     (long long)txt, C, C, (long long)down);
        else
            snprintf(buf, cap,
                     "max_sequence_length %lld cannot be split evenly over this server's %d "
                     "context-parallel ranks: use a multiple of %d, e.g. %d",
                     (long long)txt, C, C, C);
    } else {
        return false;
    }
    return true;
}

/* Packed latents (1, tokens, 4 C): one token per 2x2 latent pixels. */
static int flux_latents_shape(const dit_pipeline_info *info, const dit_gen_params *gp,
                              int64_t *shape)
{
    const int mult = info->size_multiple;
    shape[0] = 1;
    shape[1] = (int64_t)(gp->height / mult) * (gp->width / mult);
    shape[2] = info->latent_dim;
    return 3;
}

/* True CFG needs both a negative prompt and true_cfg_scale above 1, and
 * either alone has no effect, as diffusers warns. */
static bool flux_warning(const dit_pipeline_info *info, const dit_gen_params *gp,
                         const dit_gen_field_names *names, char *buf, size_t cap)
{
    (void)info;
    return dit_gen_true_cfg_warning(gp, names->negative_prompt, names->true_cfg_scale, buf, cap);
}

static bool flux_cfg(const dit_pipeline_info *info, const dit_gen_params *gp)
{
    (void)info;
    return dit_gen_true_cfg(gp);
}

const dit_pipeline_probe_class dit_probe_flux_pipeline = {
    .diffusers_class = "FluxPipeline",
    .probe = flux_probe,
    .check = flux_check,
    .seq_lens = flux_seq_lens,
    .mesh_advice = flux_mesh_advice,
    .latents_shape = flux_latents_shape,
    .warning = flux_warning,
    .cfg = flux_cfg,
};
