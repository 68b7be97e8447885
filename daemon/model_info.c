#include "model_info.h"

#include "serve/request.h"

static void add_config(dit_model_info *m, const char *key, int64_t value)
{
    if (m->n_config < DIT_MODEL_MAX_CONFIG)
        m->config[m->n_config++] = (dit_model_config_value){key, value};
}

void dit_model_info_from_flux(const dit_pipeline_info *info, const dit_parallel_config *pc,
                              int64_t max_pixels, dit_model_info *out)
{
    const dit_flux_config *fc = &info->transformer;
    *out = (dit_model_info){0};
    out->pipeline_class = "FluxPipeline";
    out->transformer_class = "FluxTransformer2DModel";
    out->task = DIT_TASK_TEXT_TO_IMAGE;
    out->has_text_encoders = info->has_text_encoders;
    out->default_width = DIT_REQUEST_DEFAULT_SIZE;
    out->default_height = DIT_REQUEST_DEFAULT_SIZE;
    out->default_steps = DIT_REQUEST_DEFAULT_STEPS;
    out->default_num_frames = 1;
    out->default_fps = 0;
    /* FluxPipeline packs 2x2 latent pixels into one token. */
    out->size_multiple = 2 * info->vae_scale;
    out->pixels_per_token = 2 * info->vae_scale;
    const int cp = pc->ring_degree * pc->ulysses_degree;
    out->token_divisor = cp > 1 && !dit_parallel_uneven(pc) ? cp : 1;
    out->max_pixels = max_pixels;
    out->max_steps = 1000;
    out->max_sequence_length = 512;
    out->frame_step = 0;
    add_config(out, "num_layers", fc->num_layers);
    add_config(out, "num_single_layers", fc->num_single_layers);
    add_config(out, "num_attention_heads", fc->num_attention_heads);
    add_config(out, "attention_head_dim", fc->attention_head_dim);
    add_config(out, "in_channels", fc->in_channels);
    add_config(out, "joint_attention_dim", fc->joint_attention_dim);
    add_config(out, "pooled_projection_dim", fc->pooled_projection_dim);
    add_config(out, "guidance_embeds", fc->guidance_embeds ? 1 : 0);
    add_config(out, "latent_channels", info->latent_channels);
    add_config(out, "vae_scale_factor", info->vae_scale);
}

dit_status dit_model_info_check_frames(const dit_model_info *m, int num_frames, int fps,
                                       dit_diag *diag)
{
    if (m->task != DIT_TASK_TEXT_TO_VIDEO) {
        if (num_frames != 0 && num_frames != 1)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "num_frames %d: %s makes images (num_frames 0 or 1)", num_frames,
                                m->pipeline_class);
        if (fps != 0)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "fps %d: %s makes images, which have no frame rate (leave fps 0)",
                                fps, m->pipeline_class);
        return DIT_OK;
    }
    if (num_frames < 0 || (num_frames > 0 && m->frame_step > 0 && (num_frames - 1) % m->frame_step))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_frames %d: %s wants 0 (its default, %d) or %d x k + 1 frames",
                            num_frames, m->pipeline_class, m->default_num_frames, m->frame_step);
    if (fps < 0 || fps > 240)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "fps %d: use 0 (the default, %d) or 1 to 240", fps, m->default_fps);
    return DIT_OK;
}

const char *dit_task_name(dit_task t)
{
    switch (t) {
    case DIT_TASK_TEXT_TO_IMAGE:
        return "text-to-image";
    case DIT_TASK_TEXT_TO_VIDEO:
        return "text-to-video";
    }
    return "unknown";
}
