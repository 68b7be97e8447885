/* FluxTransformer2DModel configuration, read from a diffusers config.json.
 *
 * Owner: plain value, copied freely. */
#ifndef DIT_MODELS_FLUX_FLUX_CONFIG_H
#define DIT_MODELS_FLUX_FLUX_CONFIG_H

#include <stdbool.h>

#include "core/status.h"

#define DIT_FLUX_MAX_AXES 8

typedef struct dit_flux_config {
    int patch_size;
    int in_channels;
    int out_channels; /* null in config.json means in_channels */
    int num_layers;   /* double-stream blocks */
    int num_single_layers;
    int attention_head_dim;
    int num_attention_heads;
    int joint_attention_dim;
    int pooled_projection_dim;
    bool guidance_embeds;
    int n_axes;
    int axes_dims_rope[DIT_FLUX_MAX_AXES];

    /* Derived by dit_flux_config_finish. */
    int inner_dim; /* heads * head_dim */
    int mlp_dim;   /* 4 * inner_dim */
    int out_dim;   /* patch_size^2 * out_channels */
} dit_flux_config;

/* FLUX.1-dev's shape (19 + 38 blocks, 24 x 128, guidance embeds). */
dit_flux_config dit_flux_config_flux1_dev(void);

/* Fills the derived fields and checks every constraint diffusers relies on
 * (positive sizes, even rope axes summing to the head dim, ...). */
dit_status dit_flux_config_finish(dit_flux_config *cfg, const char *what, dit_diag *diag);

/* Parses a diffusers config.json (e.g. transformer/config.json). */
dit_status dit_flux_config_load(const char *path, dit_flux_config *cfg, dit_diag *diag);

#endif
