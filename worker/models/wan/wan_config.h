/* WanTransformer3DModel configuration, read from a diffusers config.json
 * (JSON only, so the pipeline probe may link it).
 *
 * Owner: plain value, copied freely. */
#ifndef DIT_MODELS_WAN_WAN_CONFIG_H
#define DIT_MODELS_WAN_WAN_CONFIG_H

#include <stdbool.h>

#include "core/status.h"

typedef struct dit_wan_config {
    int patch_size[3]; /* (t, h, w) */
    int num_attention_heads;
    int attention_head_dim;
    int in_channels;
    int out_channels; /* null in config.json means in_channels */
    int text_dim;
    int freq_dim;
    int ffn_dim;
    int num_layers;
    bool cross_attn_norm;
    float eps;
    int rope_max_seq_len;
    /* Derived by dit_wan_config_finish. */
    int inner_dim;              /* heads * head_dim */
    int patch_dim;              /* in_channels * pt * ph * pw */
    int out_dim;                /* out_channels * pt * ph * pw */
    int rope_t, rope_h, rope_w; /* RoPE widths per axis: h = w = 2 (D / 6) */
} dit_wan_config;

/* Wan 2.1 T2V 1.3B's shape (12 x 128, 30 layers, FFN 8960). */
dit_wan_config dit_wan_config_wan21_1_3b(void);

/* Fills the derived fields and checks what diffusers relies on. */
dit_status dit_wan_config_finish(dit_wan_config *cfg, const char *what, dit_diag *diag);

/* Parses a diffusers config.json (transformer/config.json). The
 * image-conditioned variant (image_dim, added_kv_proj_dim) is refused. */
dit_status dit_wan_config_load(const char *path, dit_wan_config *cfg, dit_diag *diag);

#endif
