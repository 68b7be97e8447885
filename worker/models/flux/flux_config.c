#include "models/flux/flux_config.h"

#include <string.h>

#include "loader/json_util.h"

dit_flux_config dit_flux_config_flux1_dev(void)
{
    dit_flux_config c;
    memset(&c, 0, sizeof c);
    c.patch_size = 1;
    c.in_channels = 64;
    c.out_channels = 64;
    c.num_layers = 19;
    c.num_single_layers = 38;
    c.attention_head_dim = 128;
    c.num_attention_heads = 24;
    c.joint_attention_dim = 4096;
    c.pooled_projection_dim = 768;
    c.guidance_embeds = true;
    c.n_axes = 3;
    c.axes_dims_rope[0] = 16;
    c.axes_dims_rope[1] = 56;
    c.axes_dims_rope[2] = 56;
    dit_flux_config_finish(&c, "FLUX.1-dev", NULL);
    return c;
}

dit_status dit_flux_config_finish(dit_flux_config *c, const char *what, dit_diag *diag)
{
    if (c->patch_size < 1 || c->in_channels < 1 || c->out_channels < 1 ||
        c->attention_head_dim < 1 || c->num_attention_heads < 1 || c->joint_attention_dim < 1 ||
        c->pooled_projection_dim < 1 || c->num_layers < 0 || c->num_single_layers < 0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: sizes must be positive", what);
    if (c->n_axes < 1 || c->n_axes > DIT_FLUX_MAX_AXES)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: axes_dims_rope needs 1 to %d entries", what,
                            DIT_FLUX_MAX_AXES);
    int sum = 0;
    for (int i = 0; i < c->n_axes; i++) {
        if (c->axes_dims_rope[i] < 2 || c->axes_dims_rope[i] % 2 != 0)
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: axes_dims_rope[%d] = %d must be even and positive", what, i,
                                c->axes_dims_rope[i]);
        sum += c->axes_dims_rope[i];
    }
    if (sum != c->attention_head_dim)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: axes_dims_rope sums to %d but attention_head_dim is %d", what, sum,
                            c->attention_head_dim);
    long inner = (long)c->num_attention_heads * c->attention_head_dim;
    long out = (long)c->patch_size * c->patch_size * c->out_channels;
    if (inner > (1L << 20) || out > (1L << 20))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: dimensions are implausibly large", what);
    c->inner_dim = (int)inner;
    c->mlp_dim = 4 * (int)inner;
    c->out_dim = (int)out;
    return DIT_OK;
}

dit_status dit_flux_config_load(const char *path, dit_flux_config *cfg, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    dit_flux_config c;
    memset(&c, 0, sizeof c);
    const char *cls = NULL;
    int64_t v, axes[DIT_FLUX_MAX_AXES];
    const int64_t big = 1 << 20;

    DIT_CHECK(dit_json_get_string(root, "_class_name", path, false, &cls, diag));
    if (cls && strcmp(cls, "FluxTransformer2DModel") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: _class_name is \"%s\"; this loader reads FluxTransformer2DModel",
                          path, cls);
        goto cleanup;
    }
#define GET_INT(key, def, lo, field)                                                               \
    DIT_CHECK(dit_json_get_int(root, key, path, false, def, lo, big, &v, diag));                   \
    c.field = (int)v
    GET_INT("patch_size", 1, 1, patch_size);
    GET_INT("in_channels", 64, 1, in_channels);
    GET_INT("out_channels", c.in_channels, 1, out_channels);
    GET_INT("num_layers", 19, 0, num_layers);
    GET_INT("num_single_layers", 38, 0, num_single_layers);
    GET_INT("attention_head_dim", 128, 1, attention_head_dim);
    GET_INT("num_attention_heads", 24, 1, num_attention_heads);
    GET_INT("joint_attention_dim", 4096, 1, joint_attention_dim);
    GET_INT("pooled_projection_dim", 768, 1, pooled_projection_dim);
#undef GET_INT
    DIT_CHECK(
        dit_json_get_bool(root, "guidance_embeds", path, false, false, &c.guidance_embeds, diag));
    if (cJSON_GetObjectItemCaseSensitive(root, "axes_dims_rope")) {
        DIT_CHECK(dit_json_get_int_array(root, "axes_dims_rope", path, axes, DIT_FLUX_MAX_AXES,
                                         &c.n_axes, diag));
        for (int i = 0; i < c.n_axes; i++) {
            if (axes[i] < 0 || axes[i] > big) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: axes_dims_rope[%d] out of range", path,
                                  i);
                goto cleanup;
            }
            c.axes_dims_rope[i] = (int)axes[i];
        }
    } else {
        c.n_axes = 3;
        c.axes_dims_rope[0] = 16;
        c.axes_dims_rope[1] = 56;
        c.axes_dims_rope[2] = 56;
    }
    DIT_CHECK(dit_flux_config_finish(&c, path, diag));
    *cfg = c;
cleanup:
    cJSON_Delete(root);
    return st;
}
