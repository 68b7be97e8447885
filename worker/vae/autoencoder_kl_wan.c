/* AutoencoderKLWan's decoder on the backend interface. See
 * autoencoder_kl_wan.h for the structure and the frame-by-frame decoding
 * with a causal cache. */
#include "vae/autoencoder_kl_wan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

#define WAN_MAX_BLOCKS 8
#define WAN_MAX_Z 256
#define WAN_MAX_RES 16
/* Bound on the latent frames and sides, so that frame and pixel counts stay
 * far from int64 overflow whatever the config. */
#define WAN_MAX_SIDE (1 << 14)

typedef struct wan_config {
    int64_t dim, z_dim, out_channels;
    int64_t mult[WAN_MAX_BLOCKS];
    int n_mult, n_res;
    bool tup[WAN_MAX_BLOCKS]; /* temporal upsampling per up block */
    float mean[WAN_MAX_Z], std[WAN_MAX_Z];
} wan_config;

/* A convolution: raw is the checkpoint tensor, kt its temporal kernel (1 or
 * 3), k its spatial one. Temporal kernels of 3 are rearranged at load so
 * that raw reads (Cout, kt, Cin, k, k). */
typedef struct wan_conv {
    dit_tensor raw, b;
    int64_t cin, cout;
    int kt, k;
} wan_conv;

typedef struct wan_resnet {
    int64_t cin, cout;
    dit_tensor g1, g2; /* RMS gammas (C, 1, 1, 1) */
    wan_conv conv1, conv2, shortcut;
    bool has_shortcut;
} wan_resnet;

typedef struct wan_up {
    wan_resnet res[WAN_MAX_RES];
    int mode;          /* 0 none, 2 upsample2d, 3 upsample3d */
    wan_conv resample; /* 2-D 3x3, C -> C / 2 */
    wan_conv time_conv;
} wan_up;

struct dit_wan_vae {
    dit_backend *be;
    wan_config cfg;
    void *weights, *gammas;
    size_t weight_bytes;
    int64_t dims[WAN_MAX_BLOCKS + 1];
    wan_conv post_quant, conv_in, conv_out;
    wan_resnet mid_res[2];
    dit_tensor attn_g, qkv_w, qkv_b, proj_w, proj_b;
    wan_up ups[WAN_MAX_BLOCKS];
    dit_tensor norm_out_g;
};

/* ------------------------------------------------------------------------ */
/* Config                                                                    */

static dit_status get_floats(const cJSON *root, const char *key, const char *path, float *out,
                             int64_t n, dit_diag *diag)
{
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!a || !cJSON_IsArray(a) || cJSON_GetArraySize(a) != n)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" must be an array of %lld numbers",
                            path, key, (long long)n);
    int i = 0;
    const cJSON *el;
    cJSON_ArrayForEach(el, a)
    {
        if (!cJSON_IsNumber(el))
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\"[%d] is not a number", path, key,
                                i);
        out[i++] = (float)el->valuedouble;
    }
    return DIT_OK;
}

static dit_status config_load(const char *path, wan_config *c, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    memset(c, 0, sizeof *c);
    const char *s = NULL;
    int64_t v;
    bool b;
    const int64_t big = 1 << 14;

    DIT_CHECK(dit_json_get_string(root, "_class_name", path, false, &s, diag));
    if (s && strcmp(s, "AutoencoderKLWan") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: _class_name is \"%s\"; this loader reads AutoencoderKLWan", path, s);
        goto cleanup;
    }
    DIT_CHECK(dit_json_get_int(root, "base_dim", path, false, 96, 1, big, &v, diag));
    c->dim = v;
    const cJSON *dbd = cJSON_GetObjectItemCaseSensitive(root, "decoder_base_dim");
    if (dbd && !cJSON_IsNull(dbd)) {
        DIT_CHECK(dit_json_get_int(root, "decoder_base_dim", path, true, 0, 1, big, &v, diag));
        c->dim = v;
    }
    DIT_CHECK(dit_json_get_int(root, "z_dim", path, false, 16, 1, WAN_MAX_Z, &v, diag));
    c->z_dim = v;
    DIT_CHECK(dit_json_get_int(root, "out_channels", path, false, 3, 1, big, &v, diag));
    c->out_channels = v;
    DIT_CHECK(
        dit_json_get_int(root, "num_res_blocks", path, false, 2, 0, WAN_MAX_RES - 1, &v, diag));
    c->n_res = (int)v;
    if (cJSON_GetObjectItemCaseSensitive(root, "dim_mult")) {
        DIT_CHECK(dit_json_get_int_array(root, "dim_mult", path, c->mult, WAN_MAX_BLOCKS,
                                         &c->n_mult, diag));
    } else {
        const int64_t def[4] = {1, 2, 4, 4};
        memcpy(c->mult, def, sizeof def);
        c->n_mult = 4;
    }
    if (c->n_mult < 1) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"dim_mult\" is empty", path);
        goto cleanup;
    }
    for (int i = 0; i < c->n_mult; i++) {
        if (c->mult[i] < 1 || c->mult[i] * c->dim > big || (c->mult[i] * c->dim) % 2 != 0) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: \"dim_mult\"[%d] = %lld gives a width that is not even or "
                              "outside [2, %lld]",
                              path, i, (long long)c->mult[i], (long long)big);
            goto cleanup;
        }
    }
    /* temperal_downsample has one entry per down block but the last; the
     * decoder reads it reversed. */
    bool td[WAN_MAX_BLOCKS] = {false, true, true};
    int n_td = 3;
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(root, "temperal_downsample");
    if (a) {
        if (!cJSON_IsArray(a)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: \"temperal_downsample\" must be an array of booleans", path);
            goto cleanup;
        }
        n_td = 0;
        const cJSON *el;
        cJSON_ArrayForEach(el, a)
        {
            if (!cJSON_IsBool(el) || n_td >= WAN_MAX_BLOCKS) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT,
                                  "%s: \"temperal_downsample\" must be an array of at most %d "
                                  "booleans",
                                  path, WAN_MAX_BLOCKS);
                goto cleanup;
            }
            td[n_td++] = cJSON_IsTrue(el);
        }
    }
    if (n_td != c->n_mult - 1) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: \"temperal_downsample\" has %d entries; \"dim_mult\" has %d, so "
                          "it needs %d",
                          path, n_td, c->n_mult, c->n_mult - 1);
        goto cleanup;
    }
    for (int i = 0; i < n_td; i++)
        c->tup[i] = td[n_td - 1 - i];

    DIT_CHECK(dit_json_get_bool(root, "is_residual", path, false, false, &b, diag));
    if (b) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: \"is_residual\" is true (Wan 2.2's VAE); only the Wan 2.1 decoder "
                          "is supported",
                          path);
        goto cleanup;
    }
    const cJSON *ps = cJSON_GetObjectItemCaseSensitive(root, "patch_size");
    if (ps && !cJSON_IsNull(ps)) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: \"patch_size\" is set; only the unpatched Wan 2.1 decoder is "
                          "supported",
                          path);
        goto cleanup;
    }
    DIT_CHECK(get_floats(root, "latents_mean", path, c->mean, c->z_dim, diag));
    DIT_CHECK(get_floats(root, "latents_std", path, c->std, c->z_dim, diag));
    for (int64_t i = 0; i < c->z_dim; i++) {
        if (!(c->std[i] > 0.0f) || !isfinite(c->std[i]) || !isfinite(c->mean[i])) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: \"latents_std\"[%lld] must be positive and finite and "
                              "\"latents_mean\"[%lld] finite",
                              path, (long long)i, (long long)i);
            goto cleanup;
        }
    }
cleanup:
    cJSON_Delete(root);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */

static void add_conv(dit_weight_list *l, wan_conv *c, int64_t cin, int64_t cout, int kt, int k,
                     bool is3d, const char *name)
{
    c->cin = cin;
    c->cout = cout;
    c->kt = kt;
    c->k = k;
    int64_t ws[5] = {cout, cin, kt, k, k};
    int64_t w2[4] = {cout, cin, k, k};
    int64_t bs[1] = {cout};
    if (is3d)
        dit_weight_list_add(l, &c->raw, false, 5, ws, "%s.weight", name);
    else
        dit_weight_list_add(l, &c->raw, false, 4, w2, "%s.weight", name);
    dit_weight_list_add(l, &c->b, false, 1, bs, "%s.bias", name);
}

static void add_gamma(dit_weight_list *l, dit_tensor *g, int64_t c, int ndim, const char *name)
{
    int64_t s[4] = {c, 1, 1, 1};
    dit_weight_list_add(l, g, false, ndim, s, "%s.gamma", name);
}

static void add_resnet(dit_weight_list *l, wan_resnet *r, int64_t cin, int64_t cout,
                       const char *name)
{
    char n[160];
    r->cin = cin;
    r->cout = cout;
    snprintf(n, sizeof n, "%s.norm1", name);
    add_gamma(l, &r->g1, cin, 4, n);
    snprintf(n, sizeof n, "%s.conv1", name);
    add_conv(l, &r->conv1, cin, cout, 3, 3, true, n);
    snprintf(n, sizeof n, "%s.norm2", name);
    add_gamma(l, &r->g2, cout, 4, n);
    snprintf(n, sizeof n, "%s.conv2", name);
    add_conv(l, &r->conv2, cout, cout, 3, 3, true, n);
    r->has_shortcut = cin != cout;
    if (r->has_shortcut) {
        snprintf(n, sizeof n, "%s.conv_shortcut", name);
        add_conv(l, &r->shortcut, cin, cout, 1, 1, true, n);
    }
}

static void build_list(dit_wan_vae *v, dit_weight_list *l)
{
    const wan_config *c = &v->cfg;
    const int L = c->n_mult;
    char n[160];
    v->dims[0] = c->dim * c->mult[L - 1];
    for (int i = 0; i < L; i++)
        v->dims[i + 1] = c->dim * c->mult[L - 1 - i];

    add_conv(l, &v->post_quant, c->z_dim, c->z_dim, 1, 1, true, "post_quant_conv");
    add_conv(l, &v->conv_in, c->z_dim, v->dims[0], 3, 3, true, "decoder.conv_in");
    for (int i = 0; i < 2; i++) {
        snprintf(n, sizeof n, "decoder.mid_block.resnets.%d", i);
        add_resnet(l, &v->mid_res[i], v->dims[0], v->dims[0], n);
    }
    const int64_t C = v->dims[0];
    add_gamma(l, &v->attn_g, C, 3, "decoder.mid_block.attentions.0.norm");
    int64_t qs[4] = {3 * C, C, 1, 1}, qb[1] = {3 * C}, pws[4] = {C, C, 1, 1}, pb[1] = {C};
    dit_weight_list_add(l, &v->qkv_w, false, 4, qs, "decoder.mid_block.attentions.0.to_qkv.weight");
    dit_weight_list_add(l, &v->qkv_b, false, 1, qb, "decoder.mid_block.attentions.0.to_qkv.bias");
    dit_weight_list_add(l, &v->proj_w, false, 4, pws, "decoder.mid_block.attentions.0.proj.weight");
    dit_weight_list_add(l, &v->proj_b, false, 1, pb, "decoder.mid_block.attentions.0.proj.bias");

    for (int i = 0; i < L; i++) {
        wan_up *u = &v->ups[i];
        int64_t in = i > 0 ? v->dims[i] / 2 : v->dims[i], out = v->dims[i + 1];
        for (int j = 0; j <= c->n_res; j++) {
            snprintf(n, sizeof n, "decoder.up_blocks.%d.resnets.%d", i, j);
            add_resnet(l, &u->res[j], j == 0 ? in : out, out, n);
        }
        u->mode = i == L - 1 ? 0 : c->tup[i] ? 3 : 2;
        if (u->mode) {
            snprintf(n, sizeof n, "decoder.up_blocks.%d.upsamplers.0.resample.1", i);
            add_conv(l, &u->resample, out, out / 2, 1, 3, false, n);
        }
        if (u->mode == 3) {
            snprintf(n, sizeof n, "decoder.up_blocks.%d.upsamplers.0.time_conv", i);
            add_conv(l, &u->time_conv, out, 2 * out, 3, 1, true, n);
        }
    }
    add_gamma(l, &v->norm_out_g, v->dims[L], 4, "decoder.norm_out");
    add_conv(l, &v->conv_out, v->dims[L], c->out_channels, 3, 3, true, "decoder.conv_out");
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static bool has_prefix(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* The checkpoint holds the whole AutoencoderKLWan; the encoder half
 * (encoder.*, quant_conv.*) is skipped, anything else must be one of the
 * decoder's parameters. */
static dit_status check_unexpected(const dit_st_set *set, const dit_weight_list *l, dit_diag *diag)
{
    const char **names = malloc((l->n ? l->n : 1) * sizeof *names);
    if (!names)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "wan vae: out of memory");
    for (size_t i = 0; i < l->n; i++)
        names[i] = l->items[i].name;
    qsort(names, l->n, sizeof *names, cmp_str);
    dit_status st = DIT_OK;
    for (size_t i = 0; i < dit_st_set_count(set); i++) {
        const dit_st_entry *e = dit_st_set_at(set, i);
        if (has_prefix(e->name, "encoder.") || has_prefix(e->name, "quant_conv."))
            continue;
        const char *key = e->name;
        if (!bsearch(&key, names, l->n, sizeof *names, cmp_str)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: unexpected tensor '%s': AutoencoderKLWan's decoder with this "
                              "config.json has no such parameter",
                              e->file, e->name);
            break;
        }
    }
    free(names);
    return st;
}

/* (Cout, Cin, 3, k, k) -> (Cout, 3, Cin, k, k) in place, through scratch,
 * so that the three input frames of an output frame, contiguous in the
 * (T, C, H, W) layout, meet the weight as one conv2d over 3 Cin channels. */
static dit_status rearrange_time(dit_backend *be, wan_conv *c, void *scratch)
{
    if (c->kt != 3)
        return DIT_OK;
    const int64_t es = (int64_t)dit_dtype_size(c->raw.dtype), k2 = (int64_t)c->k * c->k;
    dit_tensor src = {.dtype = c->raw.dtype, .ndim = 4, .data = c->raw.data};
    src.ne[0] = c->cout, src.ne[1] = 3, src.ne[2] = c->cin, src.ne[3] = k2;
    src.nb[0] = c->cin * 3 * k2 * es, src.nb[1] = k2 * es, src.nb[2] = 3 * k2 * es, src.nb[3] = es;
    dit_tensor tmp = dit_tensor_4d(scratch, c->raw.dtype, c->cout, 3, c->cin, k2);
    dit_tensor dst = dit_tensor_4d(c->raw.data, c->raw.dtype, c->cout, 3, c->cin, k2);
    dit_status st = be->ops->copy(be, &tmp, &src);
    if (st == DIT_OK)
        st = be->ops->copy(be, &dst, &tmp);
    return st;
}

static void each_conv(dit_wan_vae *v, wan_conv **list, int *n)
{
    int k = 0;
    list[k++] = &v->conv_in;
    list[k++] = &v->conv_out;
    for (int i = 0; i < 2; i++) {
        list[k++] = &v->mid_res[i].conv1;
        list[k++] = &v->mid_res[i].conv2;
    }
    for (int i = 0; i < v->cfg.n_mult; i++) {
        for (int j = 0; j <= v->cfg.n_res; j++) {
            list[k++] = &v->ups[i].res[j].conv1;
            list[k++] = &v->ups[i].res[j].conv2;
        }
        if (v->ups[i].mode == 3)
            list[k++] = &v->ups[i].time_conv;
    }
    *n = k;
}

/* Every RMS gamma as an f32 vector (C): the checkpoint's (C, 1, 1[, 1])
 * tensors load in the backend's weight dtype, rms_norm takes f32. */
static dit_status gammas_to_f32(dit_wan_vae *v)
{
    dit_tensor *g[4 + WAN_MAX_BLOCKS * 2 * WAN_MAX_RES];
    int n = 0;
    g[n++] = &v->attn_g;
    g[n++] = &v->norm_out_g;
    for (int i = 0; i < 2; i++) {
        g[n++] = &v->mid_res[i].g1;
        g[n++] = &v->mid_res[i].g2;
    }
    for (int i = 0; i < v->cfg.n_mult; i++)
        for (int j = 0; j <= v->cfg.n_res; j++) {
            g[n++] = &v->ups[i].res[j].g1;
            g[n++] = &v->ups[i].res[j].g2;
        }
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        total += g[i]->ne[0];
    dit_status st = dit_backend_alloc(v->be, (size_t)total * sizeof(float), &v->gammas);
    for (int64_t i = 0, off = 0; i < n && st == DIT_OK; off += g[i]->ne[0], i++) {
        dit_tensor src = dit_tensor_1d(g[i]->data, g[i]->dtype, g[i]->ne[0]);
        dit_tensor dst = dit_tensor_1d((float *)v->gammas + off, DIT_F32, g[i]->ne[0]);
        st = v->be->ops->copy(v->be, &dst, &src);
        *g[i] = dst;
    }
    return st;
}

dit_status dit_wan_vae_load(dit_backend *be, const char *dir, dit_wan_vae **out, dit_diag *diag)
{
    char path[4096];
    dit_st_set *set = NULL;
    dit_weight_list list;
    memset(&list, 0, sizeof list);
    dit_status st;
    void *scratch = NULL;
    wan_conv **convs = NULL;
    *out = NULL;

    dit_wan_vae *v = calloc(1, sizeof *v);
    if (!v)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "wan vae: out of memory");
    v->be = be;
    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(config_load(path, &v->cfg, diag));
    build_list(v, &list);
    if (list.oom) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "wan vae: out of memory");
        goto cleanup;
    }
    DIT_CHECK(dit_st_set_open_dir(dir, "diffusion_pytorch_model", &set, diag));
    DIT_CHECK(dit_weights_load(be, set, &list, false, dir, &v->weights, &v->weight_bytes, diag));
    DIT_CHECK(check_unexpected(set, &list, diag));

    int n = 0;
    convs = malloc((size_t)(8 + WAN_MAX_BLOCKS * (2 * WAN_MAX_RES + 1)) * sizeof *convs);
    if (!convs) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "wan vae: out of memory");
        goto cleanup;
    }
    each_conv(v, convs, &n);
    size_t most = 0;
    for (int i = 0; i < n; i++)
        if (dit_tensor_nbytes(&convs[i]->raw) > most)
            most = dit_tensor_nbytes(&convs[i]->raw);
    DIT_CHECK(dit_backend_alloc(be, most, &scratch));
    for (int i = 0; i < n; i++) {
        st = rearrange_time(be, convs[i], scratch);
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "%s: rearranging a 3-D convolution weight failed", dir);
            goto cleanup;
        }
    }
    st = gammas_to_f32(v);
    if (st != DIT_OK) {
        st = dit_diag_set(diag, st, "%s: converting the RMS norm weights failed", dir);
        goto cleanup;
    }
    DIT_CHECK(be->ops->sync(be));
    *out = v;
    v = NULL;
cleanup:
    free(convs);
    dit_backend_free(be, scratch);
    dit_weight_list_free(&list);
    dit_st_set_close(set);
    dit_wan_vae_free(v);
    return st;
}

void dit_wan_vae_free(dit_wan_vae *v)
{
    if (!v)
        return;
    dit_backend_free(v->be, v->weights);
    dit_backend_free(v->be, v->gammas);
    free(v);
}

int dit_wan_vae_z_dim(const dit_wan_vae *v)
{
    return (int)v->cfg.z_dim;
}

int dit_wan_vae_out_channels(const dit_wan_vae *v)
{
    return (int)v->cfg.out_channels;
}

int dit_wan_vae_spatial_scale(const dit_wan_vae *v)
{
    return 1 << (v->cfg.n_mult - 1);
}

int64_t dit_wan_vae_frames(const dit_wan_vae *v, int64_t latent_frames)
{
    int64_t t = latent_frames;
    for (int i = 0; i < v->cfg.n_mult - 1; i++)
        if (v->cfg.tup[i] && t > 0)
            t = 2 * t - 1;
    return t;
}

void dit_wan_vae_denormalize(const dit_wan_vae *v, float *x, int64_t n)
{
    for (int64_t c = 0; c < v->cfg.z_dim; c++) {
        /* torch: 1.0 / tensor(latents_std) in f32, then a division. */
        const float inv = 1.0f / v->cfg.std[c], mean = v->cfg.mean[c];
        for (int64_t i = 0; i < n; i++)
            x[c * n + i] = x[c * n + i] / inv + mean;
    }
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

/* An activation (T, C, H, W) f32, contiguous, owned by the caller. */
static dit_status act_new(dit_backend *be, int64_t t, int64_t c, int64_t h, int64_t w,
                          dit_tensor *out)
{
    void *p = NULL;
    dit_status st = dit_backend_alloc(be, (size_t)(t * c * h * w) * sizeof(float), &p);
    if (st != DIT_OK)
        return st;
    *out = dit_tensor_4d(p, DIT_F32, t, c, h, w);
    return DIT_OK;
}

static void act_free(dit_backend *be, dit_tensor *t)
{
    dit_backend_free(be, t->data);
    t->data = NULL;
}

/* diffusers' feat_cache: per causal convolution (and time_conv), in the
 * order the decoder runs them, the last two frames of its input so far
 * (zeros before the first), so that a chunk of frames is convolved as part
 * of the whole sequence. Each chunk walks the list from 0 again. */
#define WAN_MAX_CACHES (8 + WAN_MAX_BLOCKS * (2 * WAN_MAX_RES + 1))
typedef struct wan_feat {
    dit_tensor buf; /* (2, C, H, W) */
    int64_t seen;   /* input frames this convolution has seen */
} wan_feat;

typedef struct wan_cache {
    wan_feat f[WAN_MAX_CACHES];
    int idx;
} wan_cache;

/* The next convolution's cache, zeroed on first use. */
static dit_status next_feat(dit_backend *be, wan_cache *cache, int64_t c, int64_t h, int64_t w,
                            wan_feat **out)
{
    if (cache->idx >= WAN_MAX_CACHES)
        return DIT_ERR_INTERNAL;
    wan_feat *f = &cache->f[cache->idx++];
    if (!f->buf.data) {
        dit_status st = act_new(be, 2, c, h, w, &f->buf);
        if (st == DIT_OK)
            st = be->ops->fill(be, &f->buf, 0.0f);
        if (st != DIT_OK)
            return st;
    }
    if (f->buf.ne[1] != c || f->buf.ne[2] != h || f->buf.ne[3] != w)
        return DIT_ERR_INTERNAL;
    *out = f;
    return DIT_OK;
}

/* p (n + 2, C, H, W) = [cache, x]; afterwards the cache holds p's last two
 * frames. */
static dit_status feat_push(dit_backend *be, wan_feat *f, const dit_tensor *x, dit_tensor *p)
{
    const int64_t n = x->ne[0];
    dit_status st = act_new(be, n + 2, x->ne[1], x->ne[2], x->ne[3], p);
    if (st != DIT_OK)
        return st;
    dit_tensor head = dit_tensor_narrow(p, 0, 0, 2), body = dit_tensor_narrow(p, 0, 2, n);
    dit_tensor tail = dit_tensor_narrow(p, 0, n, 2);
    st = be->ops->copy(be, &head, &f->buf);
    if (st == DIT_OK)
        st = be->ops->copy(be, &body, x);
    if (st == DIT_OK)
        st = be->ops->copy(be, &f->buf, &tail);
    f->seen += n;
    if (st != DIT_OK)
        act_free(be, p);
    return st;
}

/* Frames [t0, t0 + n) of x seen as one (1, n C, H, W) image. */
static dit_tensor frames_as_image(const dit_tensor *x, int64_t t0, int64_t n)
{
    const int64_t fsz = x->ne[1] * x->ne[2] * x->ne[3];
    return dit_tensor_4d((float *)x->data + t0 * fsz, DIT_F32, 1, n * x->ne[1], x->ne[2], x->ne[3]);
}

/* The conv weight as conv2d takes it: (Cout, kt Cin, k, k). */
static dit_tensor conv_weight(const wan_conv *c)
{
    return dit_tensor_4d(c->raw.data, c->raw.dtype, c->cout, c->kt * c->cin, c->k, c->k);
}

/* Causal 3-D convolution of x (T, Cin, H, W) into a new y (T, Cout, H, W):
 * kt = 1 is a per-frame conv2d; kt = 3 puts the two cached frames in front
 * and runs one conv2d per output frame over its three input frames. */
static dit_status causal_conv(dit_backend *be, wan_cache *cache, const wan_conv *c,
                              const dit_tensor *x, dit_tensor *y)
{
    const int64_t T = x->ne[0], H = x->ne[2], W = x->ne[3];
    const int pad = c->k / 2;
    dit_tensor w = conv_weight(c), p = {0};
    dit_status st = act_new(be, T, c->cout, H, W, y);
    if (st != DIT_OK)
        return st;
    if (c->kt == 1) {
        st = be->ops->conv2d(be, y, x, &w, &c->b, 1, pad);
        goto out;
    }
    wan_feat *f = NULL;
    st = next_feat(be, cache, c->cin, H, W, &f);
    if (st == DIT_OK)
        st = feat_push(be, f, x, &p);
    if (st != DIT_OK)
        goto out;
    for (int64_t t = 0; t < T && st == DIT_OK; t++) {
        dit_tensor in = frames_as_image(&p, t, 3), o = frames_as_image(y, t, 1);
        st = be->ops->conv2d(be, &o, &in, &w, &c->b, 1, pad);
    }
    act_free(be, &p);
out:
    if (st != DIT_OK)
        act_free(be, y);
    return st;
}

/* y = rms_norm over channels of x (T, C, H, W), then SiLU when `silu`:
 * F.normalize(x, dim=1) * sqrt(C) * gamma is x / sqrt(mean_c x^2) * gamma,
 * the backend's rms_norm over a transposed (T, H W, C) copy. The epsilon
 * stands for F.normalize's floor of 1e-12 on the norm. */
static dit_status rms_to_rows(dit_backend *be, const dit_tensor *x, const dit_tensor *gamma,
                              bool silu, dit_tensor *rows)
{
    const int64_t T = x->ne[0], C = x->ne[1], HW = x->ne[2] * x->ne[3];
    void *p = NULL;
    dit_status st = dit_backend_alloc(be, (size_t)(T * HW * C) * sizeof(float), &p);
    if (st != DIT_OK)
        return st;
    *rows = dit_tensor_3d(p, DIT_F32, T, HW, C);
    dit_tensor src = {.dtype = DIT_F32, .ndim = 3, .data = x->data};
    src.ne[0] = T, src.ne[1] = HW, src.ne[2] = C;
    src.nb[0] = C * HW * 4, src.nb[1] = 4, src.nb[2] = HW * 4;
    st = be->ops->copy(be, rows, &src);
    if (st == DIT_OK)
        st = be->ops->rms_norm(be, rows, rows, gamma, 1e-24f / (float)C);
    if (st == DIT_OK && silu)
        st = be->ops->activate(be, rows, rows, DIT_ACT_SILU);
    if (st != DIT_OK) {
        dit_backend_free(be, p);
        rows->data = NULL;
    }
    return st;
}

/* rows (T, H W, C) back into y (T, C, H, W). */
static dit_status rows_to_act(dit_backend *be, const dit_tensor *rows, const dit_tensor *y)
{
    const int64_t T = y->ne[0], C = y->ne[1], HW = y->ne[2] * y->ne[3];
    dit_tensor dst = {.dtype = DIT_F32, .ndim = 3, .data = y->data};
    dst.ne[0] = T, dst.ne[1] = HW, dst.ne[2] = C;
    dst.nb[0] = C * HW * 4, dst.nb[1] = 4, dst.nb[2] = HW * 4;
    return be->ops->copy(be, &dst, rows);
}

static dit_status rms_silu(dit_backend *be, const dit_tensor *x, const dit_tensor *gamma,
                           dit_tensor *y)
{
    dit_tensor rows = {0};
    dit_status st = rms_to_rows(be, x, gamma, true, &rows);
    if (st != DIT_OK)
        return st;
    st = act_new(be, x->ne[0], x->ne[1], x->ne[2], x->ne[3], y);
    if (st == DIT_OK) {
        st = rows_to_act(be, &rows, y);
        if (st != DIT_OK)
            act_free(be, y);
    }
    act_free(be, &rows);
    return st;
}

static dit_status add_into(dit_backend *be, const dit_tensor *res, const dit_tensor *x)
{
    const int64_t n = dit_tensor_numel(res);
    dit_tensor r = dit_tensor_3d(res->data, DIT_F32, 1, 1, n);
    dit_tensor a = dit_tensor_3d(x->data, DIT_F32, 1, 1, n);
    return be->ops->gated_add(be, &r, &a, NULL);
}

/* WanResidualBlock; consumes x. */
static dit_status resnet_fwd(dit_backend *be, wan_cache *cache, const wan_resnet *r, dit_tensor *x)
{
    dit_tensor h = {0}, a = {0}, b = {0};
    dit_status st = DIT_OK;
    if (r->has_shortcut)
        DIT_CHECK(causal_conv(be, cache, &r->shortcut, x, &h));
    DIT_CHECK(rms_silu(be, x, &r->g1, &a));
    if (r->has_shortcut)
        act_free(be, x);
    else
        h = *x;
    x->data = NULL;
    DIT_CHECK(causal_conv(be, cache, &r->conv1, &a, &b));
    act_free(be, &a);
    DIT_CHECK(rms_silu(be, &b, &r->g2, &a));
    act_free(be, &b);
    DIT_CHECK(causal_conv(be, cache, &r->conv2, &a, &b));
    DIT_CHECK(add_into(be, &b, &h));
    *x = b;
    b.data = NULL;
cleanup:
    act_free(be, &h);
    act_free(be, &a);
    act_free(be, &b);
    return st;
}

/* WanAttentionBlock: per frame, single head over the H W positions; adds
 * into x. */
static dit_status attn_fwd(dit_backend *be, const dit_wan_vae *v, dit_tensor *x)
{
    const int64_t T = x->ne[0], C = x->ne[1], HW = x->ne[2] * x->ne[3];
    dit_tensor rows = {0}, qkv = {0}, p = {0};
    dit_status st;
    DIT_CHECK(rms_to_rows(be, x, &v->attn_g, false, &rows));
    DIT_CHECK(act_new(be, T, HW, 3, C, &qkv));
    dit_tensor qkv3 = dit_tensor_3d(qkv.data, DIT_F32, T, HW, 3 * C);
    dit_tensor wq = dit_tensor_2d(v->qkv_w.data, v->qkv_w.dtype, 3 * C, C);
    dit_tensor wp = dit_tensor_2d(v->proj_w.data, v->proj_w.dtype, C, C);
    DIT_CHECK(be->ops->linear(be, &qkv3, &rows, &wq, &v->qkv_b, DIT_ACT_NONE, 0.0f));
    /* q, k, v (T, H W, 1, C): thirds of each qkv row. */
    dit_tensor q = {.dtype = DIT_F32, .ndim = 4, .data = qkv.data};
    q.ne[0] = T, q.ne[1] = HW, q.ne[2] = 1, q.ne[3] = C;
    q.nb[0] = HW * 3 * C * 4, q.nb[1] = 3 * C * 4, q.nb[2] = C * 4, q.nb[3] = 4;
    dit_tensor k = q, vv = q;
    k.data = (float *)qkv.data + C;
    vv.data = (float *)qkv.data + 2 * C;
    dit_tensor o = dit_tensor_4d(rows.data, DIT_F32, T, HW, 1, C);
    DIT_CHECK(be->ops->attention(be, &o, NULL, &q, &k, &vv, 1.0f / sqrtf((float)C)));
    dit_tensor o3 = dit_tensor_3d(rows.data, DIT_F32, T, HW, C);
    dit_tensor p3 = dit_tensor_3d(qkv.data, DIT_F32, T, HW, C);
    DIT_CHECK(be->ops->linear(be, &p3, &o3, &wp, &v->proj_b, DIT_ACT_NONE, 0.0f));
    DIT_CHECK(act_new(be, T, C, x->ne[2], x->ne[3], &p));
    DIT_CHECK(rows_to_act(be, &p3, &p));
    DIT_CHECK(add_into(be, x, &p));
cleanup:
    act_free(be, &rows);
    act_free(be, &qkv);
    act_free(be, &p);
    return st;
}

/* WanResample upsample2d / upsample3d; consumes x. */
static dit_status upsample_fwd(dit_backend *be, wan_cache *cache, const wan_up *u, dit_tensor *x)
{
    const int64_t T = x->ne[0], C = x->ne[1], H = x->ne[2], W = x->ne[3];
    dit_tensor xt = {0}, p = {0}, up = {0}, y = {0};
    dit_status st = DIT_OK;
    if (u->mode == 3) {
        /* The very first frame passes as is (diffusers' "Rep" chunk); every
         * later one goes through the causal time_conv to 2C channels, the
         * (2C, H, W) of output t being frames 2t and 2t+1 after the
         * passed ones. */
        wan_feat *f = NULL;
        DIT_CHECK(next_feat(be, cache, C, H, W, &f));
        const int64_t pass = f->seen == 0 ? 1 : 0, Tc = T - pass;
        if (f->seen == 0)
            f->seen = 1;
        if (Tc > 0) {
            DIT_CHECK(act_new(be, pass + 2 * Tc, C, H, W, &xt));
            if (pass) {
                dit_tensor d0 = dit_tensor_narrow(&xt, 0, 0, 1), s0 = dit_tensor_narrow(x, 0, 0, 1);
                DIT_CHECK(be->ops->copy(be, &d0, &s0));
            }
            dit_tensor rest = dit_tensor_narrow(x, 0, pass, Tc);
            DIT_CHECK(feat_push(be, f, &rest, &p));
            dit_tensor w = conv_weight(&u->time_conv);
            for (int64_t t = 0; t < Tc; t++) {
                dit_tensor in = frames_as_image(&p, t, 3);
                dit_tensor o = frames_as_image(&xt, pass + 2 * t, 2);
                DIT_CHECK(be->ops->conv2d(be, &o, &in, &w, &u->time_conv.b, 1, 0));
            }
            act_free(be, &p);
            act_free(be, x);
            *x = xt;
            xt.data = NULL;
        }
    }
    const int64_t T2 = x->ne[0];
    /* nearest-exact at scale 2 picks source pixel i / 2, as nearest does. */
    DIT_CHECK(act_new(be, T2, C, 2 * H, 2 * W, &up));
    DIT_CHECK(be->ops->upsample2x(be, &up, x));
    act_free(be, x);
    DIT_CHECK(act_new(be, T2, C / 2, 2 * H, 2 * W, &y));
    DIT_CHECK(be->ops->conv2d(be, &y, &up, &u->resample.raw, &u->resample.b, 1, 1));
    *x = y;
    y.data = NULL;
cleanup:
    act_free(be, &xt);
    act_free(be, &p);
    act_free(be, &up);
    act_free(be, &y);
    return st;
}

dit_status dit_wan_vae_decode(dit_wan_vae *v, const dit_tensor *z, const dit_tensor *video,
                              dit_diag *diag)
{
    dit_backend *be = v->be;
    const wan_config *c = &v->cfg;
    if (z->ndim != 5 || z->dtype != DIT_F32 || !dit_tensor_is_contiguous(z) || z->ne[0] != 1 ||
        z->ne[1] != c->z_dim || z->ne[2] < 1 || z->ne[3] < 1 || z->ne[4] < 1 ||
        z->ne[2] > WAN_MAX_SIDE || z->ne[3] > WAN_MAX_SIDE || z->ne[4] > WAN_MAX_SIDE)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "wan vae: latents must be (1, %lld, T, h, w) f32 contiguous, T, h "
                            "and w at most %d",
                            (long long)c->z_dim, WAN_MAX_SIDE);
    const int64_t T = z->ne[2], h = z->ne[3], w = z->ne[4], s = dit_wan_vae_spatial_scale(v);
    const int64_t F = dit_wan_vae_frames(v, T);
    if (video->ndim != 5 || video->dtype != DIT_F32 || !dit_tensor_is_contiguous(video) ||
        video->ne[0] != 1 || video->ne[1] != c->out_channels || video->ne[2] != F ||
        video->ne[3] != h * s || video->ne[4] != w * s)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "wan vae: video must be (1, %lld, %lld, %lld, %lld) f32 contiguous",
                            (long long)c->out_channels, (long long)F, (long long)(h * s),
                            (long long)(w * s));
    dit_tensor x = {0}, y = {0};
    dit_status st;
    wan_cache *cache = calloc(1, sizeof *cache);
    if (!cache)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "wan vae: out of memory");
    const int64_t HW = h * s * w * s, Co = c->out_channels;
    int64_t f0 = 0;
    /* One latent frame at a time, as diffusers' _decode: memory holds one
     * chunk's activations and the caches. */
    for (int64_t t = 0; t < T; t++) {
        cache->idx = 0;
        DIT_CHECK(act_new(be, 1, c->z_dim, h, w, &x));
        dit_tensor src = dit_tensor_2d((float *)z->data + t * h * w, DIT_F32, c->z_dim, h * w);
        src.nb[0] = T * h * w * 4;
        dit_tensor dst = dit_tensor_2d(x.data, DIT_F32, c->z_dim, h * w);
        DIT_CHECK(be->ops->upload(be, &dst, &src));
        DIT_CHECK(causal_conv(be, cache, &v->post_quant, &x, &y));
        act_free(be, &x);
        DIT_CHECK(causal_conv(be, cache, &v->conv_in, &y, &x));
        act_free(be, &y);
        DIT_CHECK(resnet_fwd(be, cache, &v->mid_res[0], &x));
        DIT_CHECK(attn_fwd(be, v, &x));
        DIT_CHECK(resnet_fwd(be, cache, &v->mid_res[1], &x));
        for (int i = 0; i < c->n_mult; i++) {
            for (int j = 0; j <= c->n_res; j++)
                DIT_CHECK(resnet_fwd(be, cache, &v->ups[i].res[j], &x));
            if (v->ups[i].mode)
                DIT_CHECK(upsample_fwd(be, cache, &v->ups[i], &x));
        }
        DIT_CHECK(rms_silu(be, &x, &v->norm_out_g, &y));
        act_free(be, &x);
        DIT_CHECK(causal_conv(be, cache, &v->conv_out, &y, &x));
        act_free(be, &y);
        /* (n, Cout, H, W) backend -> frames [f0, f0 + n) of (1, Cout, F, H, W). */
        const int64_t n = x.ne[0];
        if (f0 + n > F) {
            st = DIT_ERR_INTERNAL;
            goto cleanup;
        }
        for (int64_t ch = 0; ch < Co; ch++) {
            dit_tensor s2 = dit_tensor_2d((float *)x.data + ch * HW, DIT_F32, n, HW);
            s2.nb[0] = Co * HW * 4;
            dit_tensor d2 =
                dit_tensor_2d((float *)video->data + (ch * F + f0) * HW, DIT_F32, n, HW);
            DIT_CHECK(be->ops->download(be, &d2, &s2));
        }
        f0 += n;
        act_free(be, &x);
    }
    if (f0 != F) {
        st = DIT_ERR_INTERNAL;
        goto cleanup;
    }
    float *o = video->data;
    for (int64_t i = 0, n = dit_tensor_numel(video); i < n; i++)
        o[i] = o[i] < -1.0f ? -1.0f : o[i] > 1.0f ? 1.0f : o[i];
cleanup:
    if (st != DIT_OK)
        dit_diag_set(diag, st, "wan vae: decode failed: %s",
                     be->ops->last_error ? be->ops->last_error(be) : "");
    act_free(be, &x);
    act_free(be, &y);
    for (int i = 0; i < WAN_MAX_CACHES; i++)
        act_free(be, &cache->f[i].buf);
    free(cache);
    return st;
}
