#include "models/wan/wan_config.h"

#include <string.h>

#include "loader/json_util.h"

dit_wan_config dit_wan_config_wan21_1_3b(void)
{
    dit_wan_config c;
    memset(&c, 0, sizeof c);
    c.patch_size[0] = 1;
    c.patch_size[1] = 2;
    c.patch_size[2] = 2;
    c.num_attention_heads = 12;
    c.attention_head_dim = 128;
    c.in_channels = 16;
    c.out_channels = 16;
    c.text_dim = 4096;
    c.freq_dim = 256;
    c.ffn_dim = 8960;
    c.num_layers = 30;
    c.cross_attn_norm = true;
    c.eps = 1e-6f;
    c.rope_max_seq_len = 1024;
    dit_wan_config_finish(&c, "Wan2.1-T2V-1.3B", NULL);
    return c;
}

dit_status dit_wan_config_finish(dit_wan_config *c, const char *what, dit_diag *diag)
{
    if (c->num_attention_heads < 1 || c->attention_head_dim < 1 || c->in_channels < 1 ||
        c->out_channels < 1 || c->text_dim < 1 || c->freq_dim < 2 || c->ffn_dim < 1 ||
        c->num_layers < 0 || c->rope_max_seq_len < 1 || !(c->eps > 0.0f))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: sizes must be positive", what);
    for (int i = 0; i < 3; i++)
        if (c->patch_size[i] < 1 || c->patch_size[i] > 64)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: patch_size[%d] = %d is out of range",
                                what, i, c->patch_size[i]);
    if (c->freq_dim % 2 != 0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: freq_dim %d must be even", what,
                            c->freq_dim);
    /* WanRotaryPosEmbed: h = w = 2 (D // 6), t the rest; each rotates pairs. */
    const int D = c->attention_head_dim;
    c->rope_h = c->rope_w = 2 * (D / 6);
    c->rope_t = D - c->rope_h - c->rope_w;
    if (D % 2 != 0 || c->rope_h < 2 || c->rope_t < 2)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: attention_head_dim %d leaves no even RoPE width per axis", what,
                            D);
    const long inner = (long)c->num_attention_heads * D;
    const long pvol = (long)c->patch_size[0] * c->patch_size[1] * c->patch_size[2];
    if (inner > (1L << 20) || pvol * c->in_channels > (1L << 20) ||
        pvol * c->out_channels > (1L << 20))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: dimensions are implausibly large", what);
    c->inner_dim = (int)inner;
    c->patch_dim = (int)(pvol * c->in_channels);
    c->out_dim = (int)(pvol * c->out_channels);
    return DIT_OK;
}

dit_status dit_wan_config_load(const char *path, dit_wan_config *cfg, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    dit_wan_config c;
    memset(&c, 0, sizeof c);
    const char *cls = NULL;
    int64_t v, patch[4];
    int np = 0;
    double eps;
    const int64_t big = 1 << 20;
    DIT_CHECK(dit_json_get_string(root, "_class_name", path, false, &cls, diag));
    if (cls && strcmp(cls, "WanTransformer3DModel") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: _class_name is \"%s\"; this loader reads WanTransformer3DModel",
                          path, cls);
        goto cleanup;
    }
#define GET_INT(key, def, lo, field)                                                               \
    DIT_CHECK(dit_json_get_int(root, key, path, false, def, lo, big, &v, diag));                   \
    c.field = (int)v
    GET_INT("num_attention_heads", 40, 1, num_attention_heads);
    GET_INT("attention_head_dim", 128, 1, attention_head_dim);
    GET_INT("in_channels", 16, 1, in_channels);
    GET_INT("out_channels", c.in_channels, 1, out_channels);
    GET_INT("text_dim", 4096, 1, text_dim);
    GET_INT("freq_dim", 256, 2, freq_dim);
    GET_INT("ffn_dim", 13824, 1, ffn_dim);
    GET_INT("num_layers", 40, 0, num_layers);
    GET_INT("rope_max_seq_len", 1024, 1, rope_max_seq_len);
#undef GET_INT
    /* The image-conditioned (i2v) variant: its image embedder and added
     * key/value projections are not implemented. */
    static const char *const i2v_keys[] = {"image_dim", "added_kv_proj_dim"};
    for (int i = 0; i < 2; i++) {
        DIT_CHECK(dit_json_get_int(root, i2v_keys[i], path, false, -1, -1, big, &v, diag));
        if (v >= 0) {
            st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                              "%s: %s is set: the image-conditioned (i2v) WanTransformer3DModel "
                              "is not supported",
                              path, i2v_keys[i]);
            goto cleanup;
        }
    }
    DIT_CHECK(
        dit_json_get_bool(root, "cross_attn_norm", path, false, true, &c.cross_attn_norm, diag));
    DIT_CHECK(dit_json_get_double(root, "eps", path, false, 1e-6, &eps, diag));
    c.eps = (float)eps;
    if (cJSON_GetObjectItemCaseSensitive(root, "patch_size")) {
        DIT_CHECK(dit_json_get_int_array(root, "patch_size", path, patch, 4, &np, diag));
        if (np != 3) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: patch_size needs 3 entries (t, h, w)",
                              path);
            goto cleanup;
        }
        for (int i = 0; i < 3; i++)
            c.patch_size[i] = patch[i] < 1 || patch[i] > 64 ? 0 : (int)patch[i];
    } else {
        c.patch_size[0] = 1;
        c.patch_size[1] = c.patch_size[2] = 2;
    }
    DIT_CHECK(dit_wan_config_finish(&c, path, diag));
    *cfg = c;
cleanup:
    cJSON_Delete(root);
    return st;
}
