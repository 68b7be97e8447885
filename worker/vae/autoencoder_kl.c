/* AutoencoderKL's decoder on the backend interface. See autoencoder_kl.h for
 * the structure; the diffusers modules each piece mirrors are named where
 * it is built. */
#include "vae/autoencoder_kl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

/* Every GroupNorm of the decoder (resnets, attention, conv_norm_out) is
 * built with eps=1e-6 in diffusers' Decoder. */
#define VAE_EPS 1e-6f
#define VAE_MAX_BLOCKS 8
/* Bound on one side of a latent, so h * scale * w * scale * channels stays
 * far from int64 overflow whatever the config. */
#define VAE_MAX_LATENT_SIDE (1 << 16)
#define VAE_ALIGN 64

typedef struct vae_config {
    int64_t block_out[VAE_MAX_BLOCKS];
    int n_blocks;
    int layers_per_block;
    int latent_channels;
    int out_channels;
    int groups;
    bool post_quant_conv;
    bool mid_attention;
    float scaling_factor;
    float shift_factor;
} vae_config;

typedef struct vae_conv {
    dit_tensor w; /* (Cout, Cin, k, k) */
    dit_tensor b; /* (Cout) */
} vae_conv;

typedef struct vae_norm {
    dit_tensor w, b; /* (C) each */
} vae_norm;

/* ResnetBlock2D without time embedding (temb_channels=None). */
typedef struct vae_resnet {
    int64_t cin, cout;
    vae_norm norm1, norm2;
    vae_conv conv1, conv2;
    vae_conv shortcut; /* 1x1, only when cin != cout */
    bool has_shortcut;
} vae_resnet;

/* Attention(C, heads=1, dim_head=C, norm_num_groups, residual_connection). */
typedef struct vae_attn {
    vae_norm norm;
    dit_tensor q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b; /* (C, C), (C) */
} vae_attn;

/* UpDecoderBlock2D: layers_per_block + 1 resnets, then Upsample2D. */
typedef struct vae_up {
    int64_t ch;
    vae_resnet *resnets;
    bool has_upsample;
    vae_conv upsample; /* 3x3 after nearest 2x */
} vae_up;

struct dit_vae_decoder {
    dit_backend *be;
    vae_config cfg;
    void *weights;
    size_t weight_bytes;
    vae_conv post_quant, conv_in, conv_out;
    vae_resnet mid_res[2];
    vae_attn mid_attn;
    vae_up ups[VAE_MAX_BLOCKS];
    vae_resnet *resnet_pool; /* n_blocks * (layers_per_block + 1) */
    vae_norm norm_out;
};

/* ------------------------------------------------------------------------ */
/* Config                                                                    */

/* Reads the keys AutoencoderKL's decoder depends on, with AutoencoderKL's
 * __init__ defaults for absent ones (diffusers fills them in the same way
 * when it loads an older config.json). */
static dit_status config_load(const char *path, vae_config *c, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    memset(c, 0, sizeof *c);
    const char *s = NULL;
    int64_t v;
    bool b;
    double d;
    const int64_t big = 1 << 16;

    DIT_CHECK(dit_json_get_string(root, "_class_name", path, false, &s, diag));
    if (s && strcmp(s, "AutoencoderKL") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: _class_name is \"%s\"; this loader reads AutoencoderKL", path, s);
        goto cleanup;
    }

    if (cJSON_GetObjectItemCaseSensitive(root, "block_out_channels")) {
        int64_t chans[VAE_MAX_BLOCKS];
        DIT_CHECK(dit_json_get_int_array(root, "block_out_channels", path, chans, VAE_MAX_BLOCKS,
                                         &c->n_blocks, diag));
        for (int i = 0; i < c->n_blocks; i++) {
            if (chans[i] < 1 || chans[i] > big) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT,
                                  "%s: \"block_out_channels\"[%d] = %lld is outside [1, %lld]",
                                  path, i, (long long)chans[i], (long long)big);
                goto cleanup;
            }
            c->block_out[i] = chans[i];
        }
        if (c->n_blocks < 1) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"block_out_channels\" is empty", path);
            goto cleanup;
        }
    } else {
        c->n_blocks = 1;
        c->block_out[0] = 64;
    }

    /* up_block_types: one UpDecoderBlock2D per entry of block_out_channels
     * (the Decoder indexes block_out_channels by the up block's position). */
    const cJSON *ub = cJSON_GetObjectItemCaseSensitive(root, "up_block_types");
    if (ub && !cJSON_IsNull(ub)) {
        if (!cJSON_IsArray(ub)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: \"up_block_types\" must be an array of strings", path);
            goto cleanup;
        }
        int n = cJSON_GetArraySize(ub), i = 0;
        const cJSON *el;
        cJSON_ArrayForEach(el, ub)
        {
            const char *t = cJSON_GetStringValue(el);
            if (!t || strcmp(t, "UpDecoderBlock2D") != 0) {
                st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                                  "%s: \"up_block_types\"[%d] is %s%s%s; only UpDecoderBlock2D "
                                  "is supported",
                                  path, i, t ? "\"" : "", t ? t : "not a string", t ? "\"" : "");
                goto cleanup;
            }
            i++;
        }
        if (n != c->n_blocks) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: \"up_block_types\" has %d entries but \"block_out_channels\" "
                              "has %d",
                              path, n, c->n_blocks);
            goto cleanup;
        }
    } else if (c->n_blocks != 1) {
        /* The default is a single UpDecoderBlock2D. */
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: \"up_block_types\" is missing but \"block_out_channels\" has %d "
                          "entries",
                          path, c->n_blocks);
        goto cleanup;
    }

    DIT_CHECK(dit_json_get_int(root, "layers_per_block", path, false, 1, 0, 64, &v, diag));
    c->layers_per_block = (int)v;
    DIT_CHECK(dit_json_get_int(root, "latent_channels", path, false, 4, 1, big, &v, diag));
    c->latent_channels = (int)v;
    DIT_CHECK(dit_json_get_int(root, "out_channels", path, false, 3, 1, big, &v, diag));
    c->out_channels = (int)v;
    DIT_CHECK(dit_json_get_int(root, "norm_num_groups", path, false, 32, 1, big, &v, diag));
    c->groups = (int)v;
    for (int i = 0; i < c->n_blocks; i++) {
        if (c->block_out[i] % c->groups != 0) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: \"norm_num_groups\" = %d does not divide "
                              "\"block_out_channels\"[%d] = %lld",
                              path, c->groups, i, (long long)c->block_out[i]);
            goto cleanup;
        }
    }

    /* get_activation maps both names to nn.SiLU. */
    DIT_CHECK(dit_json_get_string(root, "act_fn", path, false, &s, diag));
    if (s && strcmp(s, "silu") != 0 && strcmp(s, "swish") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: \"act_fn\" is \"%s\"; only silu is supported", path, s);
        goto cleanup;
    }

    DIT_CHECK(dit_json_get_bool(root, "use_post_quant_conv", path, false, true, &b, diag));
    c->post_quant_conv = b;
    DIT_CHECK(dit_json_get_bool(root, "mid_block_add_attention", path, false, true, &b, diag));
    c->mid_attention = b;
    /* use_quant_conv, force_upcast, latents_mean/std concern the encoder or
     * other pipelines; they are ignored, like every other key. */

    DIT_CHECK(dit_json_get_double(root, "scaling_factor", path, false, 0.18215, &d, diag));
    if (!(d > 0.0) || !isfinite(d)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"scaling_factor\" must be positive", path);
        goto cleanup;
    }
    c->scaling_factor = (float)d;
    /* FluxPipeline adds shift_factor; older VAEs have null (no shift). */
    DIT_CHECK(dit_json_get_double(root, "shift_factor", path, false, 0.0, &d, diag));
    if (!isfinite(d)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"shift_factor\" must be finite", path);
        goto cleanup;
    }
    c->shift_factor = (float)d;
cleanup:
    cJSON_Delete(root);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */

static void add_conv(dit_weight_list *l, vae_conv *cv, int64_t cout, int64_t cin, int64_t k,
                     const char *name)
{
    const int64_t ws[4] = {cout, cin, k, k}, bs[1] = {cout};
    dit_weight_list_add(l, &cv->w, false, 4, ws, "%s.weight", name);
    dit_weight_list_add(l, &cv->b, false, 1, bs, "%s.bias", name);
}

static void add_norm(dit_weight_list *l, vae_norm *n, int64_t c, const char *name)
{
    const int64_t s[1] = {c};
    dit_weight_list_add(l, &n->w, false, 1, s, "%s.weight", name);
    dit_weight_list_add(l, &n->b, false, 1, s, "%s.bias", name);
}

static void add_linear(dit_weight_list *l, dit_tensor *w, dit_tensor *b, int64_t c,
                       const char *name)
{
    const int64_t ws[2] = {c, c}, bs[1] = {c};
    dit_weight_list_add(l, w, false, 2, ws, "%s.weight", name);
    dit_weight_list_add(l, b, false, 1, bs, "%s.bias", name);
}

static void add_resnet(dit_weight_list *l, vae_resnet *r, int64_t cin, int64_t cout,
                       const char *pre)
{
    char buf[160];
    r->cin = cin;
    r->cout = cout;
    r->has_shortcut = cin != cout;
#define NAME(suffix) (snprintf(buf, sizeof buf, "%s.%s", pre, suffix), buf)
    add_norm(l, &r->norm1, cin, NAME("norm1"));
    add_conv(l, &r->conv1, cout, cin, 3, NAME("conv1"));
    add_norm(l, &r->norm2, cout, NAME("norm2"));
    add_conv(l, &r->conv2, cout, cout, 3, NAME("conv2"));
    if (r->has_shortcut)
        add_conv(l, &r->shortcut, cout, cin, 1, NAME("conv_shortcut"));
#undef NAME
}

static void build_list(dit_vae_decoder *v, dit_weight_list *l)
{
    const vae_config *c = &v->cfg;
    const int L = c->n_blocks, n_res = c->layers_per_block + 1;
    const int64_t lat = c->latent_channels;
    int64_t rev[VAE_MAX_BLOCKS]; /* reversed(block_out_channels) */
    char pre[96];
    for (int i = 0; i < L; i++)
        rev[i] = c->block_out[L - 1 - i];

    if (c->post_quant_conv)
        add_conv(l, &v->post_quant, lat, lat, 1, "post_quant_conv");
    add_conv(l, &v->conv_in, rev[0], lat, 3, "decoder.conv_in");

    add_resnet(l, &v->mid_res[0], rev[0], rev[0], "decoder.mid_block.resnets.0");
    if (c->mid_attention) {
        vae_attn *a = &v->mid_attn;
        add_norm(l, &a->norm, rev[0], "decoder.mid_block.attentions.0.group_norm");
        add_linear(l, &a->q_w, &a->q_b, rev[0], "decoder.mid_block.attentions.0.to_q");
        add_linear(l, &a->k_w, &a->k_b, rev[0], "decoder.mid_block.attentions.0.to_k");
        add_linear(l, &a->v_w, &a->v_b, rev[0], "decoder.mid_block.attentions.0.to_v");
        add_linear(l, &a->o_w, &a->o_b, rev[0], "decoder.mid_block.attentions.0.to_out.0");
    }
    add_resnet(l, &v->mid_res[1], rev[0], rev[0], "decoder.mid_block.resnets.1");

    for (int i = 0; i < L; i++) {
        vae_up *u = &v->ups[i];
        u->ch = rev[i];
        u->resnets = v->resnet_pool + (size_t)i * (size_t)n_res;
        for (int j = 0; j < n_res; j++) {
            snprintf(pre, sizeof pre, "decoder.up_blocks.%d.resnets.%d", i, j);
            add_resnet(l, &u->resnets[j], j == 0 ? rev[i > 0 ? i - 1 : 0] : rev[i], rev[i], pre);
        }
        u->has_upsample = i != L - 1;
        if (u->has_upsample) {
            snprintf(pre, sizeof pre, "decoder.up_blocks.%d.upsamplers.0.conv", i);
            add_conv(l, &u->upsample, rev[i], rev[i], 3, pre);
        }
    }
    add_norm(l, &v->norm_out, rev[L - 1], "decoder.conv_norm_out");
    add_conv(l, &v->conv_out, c->out_channels, rev[L - 1], 3, "decoder.conv_out");
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static bool has_prefix(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* The checkpoint holds the whole AutoencoderKL. The encoder half (encoder.*,
 * quant_conv.*) is skipped without being read; anything else must be one of
 * the decoder's parameters, so a config that disagrees with the weights
 * (e.g. use_post_quant_conv false for a checkpoint that has one) is an error
 * instead of silently decoding with parts missing. */
static dit_status check_unexpected(const dit_st_set *set, const dit_weight_list *l, dit_diag *diag)
{
    const char **names = malloc((l->n ? l->n : 1) * sizeof *names);
    if (!names)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "vae: out of memory");
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
                              "%s: unexpected tensor '%s': AutoencoderKL's decoder with this "
                              "config.json has no such parameter",
                              e->file, e->name);
            break;
        }
    }
    free(names);
    return st;
}

dit_status dit_vae_decoder_load(dit_backend *be, const char *dir, dit_vae_decoder **out,
                                dit_diag *diag)
{
    char path[4096];
    dit_st_set *set = NULL;
    dit_weight_list list;
    memset(&list, 0, sizeof list);
    dit_status st;
    *out = NULL;

    dit_vae_decoder *v = calloc(1, sizeof *v);
    if (!v)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "vae: out of memory");
    v->be = be;
    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(config_load(path, &v->cfg, diag));
    v->resnet_pool = calloc((size_t)v->cfg.n_blocks * (size_t)(v->cfg.layers_per_block + 1),
                            sizeof *v->resnet_pool);
    if (!v->resnet_pool) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "vae: out of memory");
        goto cleanup;
    }
    build_list(v, &list);
    if (list.oom) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "vae: out of memory");
        goto cleanup;
    }
    DIT_CHECK(dit_st_set_open_dir(dir, "diffusion_pytorch_model", &set, diag));
    /* Missing and mis-shaped tensors first (they say more about a wrong
     * config than an extra tensor does), then the extra ones. */
    DIT_CHECK(dit_weights_load(be, set, &list, false, dir, &v->weights, &v->weight_bytes, diag));
    DIT_CHECK(check_unexpected(set, &list, diag));
    *out = v;
    v = NULL;
cleanup:
    dit_weight_list_free(&list);
    dit_st_set_close(set);
    dit_vae_decoder_free(v);
    return st;
}

void dit_vae_decoder_free(dit_vae_decoder *v)
{
    if (!v)
        return;
    dit_backend_free(v->be, v->weights);
    free(v->resnet_pool);
    free(v);
}

float dit_vae_scaling_factor(const dit_vae_decoder *v)
{
    return v->cfg.scaling_factor;
}

float dit_vae_shift_factor(const dit_vae_decoder *v)
{
    return v->cfg.shift_factor;
}

int dit_vae_latent_channels(const dit_vae_decoder *v)
{
    return v->cfg.latent_channels;
}

int dit_vae_out_channels(const dit_vae_decoder *v)
{
    return v->cfg.out_channels;
}

int dit_vae_scale_factor(const dit_vae_decoder *v)
{
    return 1 << (v->cfg.n_blocks - 1);
}

size_t dit_vae_weight_bytes(const dit_vae_decoder *v)
{
    return v->weight_bytes;
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

/* Activation plan for one image of latent size h x w: two ping-pong buffers
 * of `pp` floats hold a stage's input and output, and `scratch` floats are
 * the most any one block needs on top (taken and released per block). */
typedef struct vae_sizes {
    int64_t pp;
    int64_t scratch;
} vae_sizes;

static int64_t max64(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

static vae_sizes plan_sizes(const dit_vae_decoder *v, int64_t h, int64_t w)
{
    const vae_config *c = &v->cfg;
    vae_sizes s = {0, 0};
    int64_t hw = h * w;
    const int64_t c0 = v->ups[0].ch;
    s.pp = max64((int64_t)c->latent_channels, c0) * hw;
    /* Mid block resnets: conv1 output; attention: tokens, q, k, v. */
    s.scratch = c->mid_attention ? 4 * c0 * hw : c0 * hw;
    for (int i = 0; i < c->n_blocks; i++) {
        const vae_up *u = &v->ups[i];
        const int64_t cin = i == 0 ? c0 : v->ups[i - 1].ch;
        /* The first resnet writes GroupNorm(x) (cin) into its output
         * buffer, then its result (cout); conv1's output is scratch. */
        s.pp = max64(s.pp, max64(cin, u->ch) * hw);
        s.scratch = max64(s.scratch, u->ch * hw);
        if (u->has_upsample) {
            hw *= 4;
            s.pp = max64(s.pp, u->ch * hw);
        }
    }
    return s;
}

static size_t aligned_bytes(int64_t floats)
{
    return ((size_t)floats * sizeof(float) + VAE_ALIGN - 1) / VAE_ALIGN * VAE_ALIGN;
}

size_t dit_vae_decode_workspace(const dit_vae_decoder *v, int64_t h, int64_t w)
{
    vae_sizes s = plan_sizes(v, h, w);
    /* The attention scratch is four allocations, each rounded up. */
    return 2 * aligned_bytes(s.pp) + aligned_bytes(s.scratch) + 4 * VAE_ALIGN;
}

typedef struct fwd {
    dit_vae_decoder *v;
    dit_backend *be;
    dit_arena *arena;
    dit_diag *diag;
} fwd;

#define BE(call)                                                                                   \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st =                                                                                   \
                dit_diag_set(f->diag, st, "vae decode: %s failed: %s", #call, dit_status_str(st)); \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

static dit_tensor nchw(float *data, int64_t c, int64_t h, int64_t w)
{
    return dit_tensor_4d(data, DIT_F32, 1, c, h, w);
}

/* (1, C, H*W): NCHW seen as one row of H*W values per channel, the shape
 * gated_add takes for a plain elementwise add. */
static dit_tensor rows(const dit_tensor *t)
{
    return dit_tensor_3d(t->data, DIT_F32, t->ne[0], t->ne[1], t->ne[2] * t->ne[3]);
}

static dit_status scratch(fwd *f, int64_t n, float **out)
{
    void *p;
    dit_status st = dit_arena_bytes(f->arena, (size_t)n * sizeof(float), &p);
    if (st != DIT_OK)
        return dit_diag_set(f->diag, st, "vae decode: activation memory exhausted");
    *out = p;
    return DIT_OK;
}

/* ResnetBlock2D (pre-norm, no time embedding, output_scale_factor 1):
 *   y = shortcut(x) + conv2(silu(gn2(conv1(silu(gn1(x))))))
 * x (1, cin, H, W) in `xb`; y (1, cout, H, W) into `yb`, which first holds
 * silu(gn1(x)) (conv1's input, dead once conv1 ran). */
static dit_status resnet(fwd *f, const vae_resnet *r, float *xb, float *yb, int64_t H, int64_t W)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const int groups = f->v->cfg.groups;
    dit_arena_mark mark = dit_arena_get_mark(f->arena);
    float *sb = NULL;
    DIT_CHECK(scratch(f, r->cout * H * W, &sb));
    dit_tensor x = nchw(xb, r->cin, H, W), h = nchw(yb, r->cin, H, W);
    dit_tensor s = nchw(sb, r->cout, H, W), y = nchw(yb, r->cout, H, W);

    BE(be->ops->group_norm(be, &h, &x, &r->norm1.w, &r->norm1.b, groups, VAE_EPS, DIT_ACT_SILU));
    BE(be->ops->conv2d(be, &s, &h, &r->conv1.w, &r->conv1.b, 1, 1));
    BE(be->ops->group_norm(be, &s, &s, &r->norm2.w, &r->norm2.b, groups, VAE_EPS, DIT_ACT_SILU));
    /* dropout is the identity at inference. */
    BE(be->ops->conv2d(be, &y, &s, &r->conv2.w, &r->conv2.b, 1, 1));
    dit_tensor yr = rows(&y);
    if (r->has_shortcut) {
        BE(be->ops->conv2d(be, &s, &x, &r->shortcut.w, &r->shortcut.b, 1, 0));
        dit_tensor sr = rows(&s);
        BE(be->ops->gated_add(be, &yr, &sr, NULL));
    } else {
        dit_tensor xr = rows(&x);
        BE(be->ops->gated_add(be, &yr, &xr, NULL));
    }
cleanup:
    dit_arena_release(f->arena, mark);
    return st;
}

/* The mid block's Attention with AttnProcessor2_0, in place on x (1, C, H, W):
 *   n = GroupNorm(x) viewed as tokens (1, HW, C)
 *   x = x + to_out(softmax(q k^T / sqrt(C)) v)^T,  q, k, v = to_q/k/v(n)
 * with a single head of dim C. `free_b` (at least C*H*W floats) is the
 * other ping-pong buffer, unused at this point. */
static dit_status attention(fwd *f, float *xb, float *free_b, int64_t C, int64_t H, int64_t W)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const vae_attn *a = &f->v->mid_attn;
    const int64_t S = H * W;
    dit_arena_mark mark = dit_arena_get_mark(f->arena);
    float *tb = NULL, *qb = NULL, *kb = NULL, *vb = NULL;
    DIT_CHECK(scratch(f, S * C, &tb));
    DIT_CHECK(scratch(f, S * C, &qb));
    DIT_CHECK(scratch(f, S * C, &kb));
    DIT_CHECK(scratch(f, S * C, &vb));

    dit_tensor x = nchw(xb, C, H, W), n = nchw(free_b, C, H, W);
    BE(be->ops->group_norm(be, &n, &x, &a->norm.w, &a->norm.b, f->v->cfg.groups, VAE_EPS,
                           DIT_ACT_NONE));
    /* (1, C, HW) -> (1, HW, C): the transposed view of the NCHW buffer has
     * a channel stride of HW floats; copy makes the token rows dense. */
    dit_tensor tok = dit_tensor_3d(tb, DIT_F32, 1, S, C);
    dit_tensor n_t = tok;
    n_t.data = free_b;
    n_t.nb[1] = (int64_t)sizeof(float);
    n_t.nb[2] = S * (int64_t)sizeof(float);
    BE(be->ops->copy(be, &tok, &n_t));

    dit_tensor q = dit_tensor_3d(qb, DIT_F32, 1, S, C), k = dit_tensor_3d(kb, DIT_F32, 1, S, C);
    dit_tensor vv = dit_tensor_3d(vb, DIT_F32, 1, S, C);
    BE(be->ops->linear(be, &q, &tok, &a->q_w, &a->q_b, DIT_ACT_NONE, 0.0f));
    BE(be->ops->linear(be, &k, &tok, &a->k_w, &a->k_b, DIT_ACT_NONE, 0.0f));
    BE(be->ops->linear(be, &vv, &tok, &a->v_w, &a->v_b, DIT_ACT_NONE, 0.0f));
    /* (1, S, 1 head, C); the output reuses the token buffer. */
    dit_tensor q4 = dit_tensor_split_last(&q, C), k4 = dit_tensor_split_last(&k, C);
    dit_tensor v4 = dit_tensor_split_last(&vv, C), o4 = dit_tensor_split_last(&tok, C);
    BE(be->ops->attention(be, &o4, NULL, &q4, &k4, &v4, (float)(1.0 / sqrt((double)C))));
    BE(be->ops->linear(be, &q, &tok, &a->o_w, &a->o_b, DIT_ACT_NONE, 0.0f));
    /* Back to NCHW in the free buffer, then the residual connection
     * (rescale_output_factor is 1). */
    BE(be->ops->copy(be, &n_t, &q));
    dit_tensor xr = rows(&x), nr = rows(&n);
    BE(be->ops->gated_add(be, &xr, &nr, NULL));
cleanup:
    dit_arena_release(f->arena, mark);
    return st;
}

/* One image: z (1, latent, h, w) -> img (1, out_channels, h*s, w*s). */
static dit_status decode_one(fwd *f, const dit_tensor *z, const dit_tensor *img, float *p0,
                             float *p1)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const dit_vae_decoder *v = f->v;
    const vae_config *c = &v->cfg;
    int64_t H = z->ne[2], W = z->ne[3];
    float *cur = p0, *other = p1, *tmp;
    const int64_t lat = c->latent_channels, c0 = v->ups[0].ch;
#define SWAP() (tmp = cur, cur = other, other = tmp)

    dit_tensor in = *z;
    if (c->post_quant_conv) {
        dit_tensor pq = nchw(other, lat, H, W);
        BE(be->ops->conv2d(be, &pq, z, &v->post_quant.w, &v->post_quant.b, 1, 0));
        in = pq;
    }
    {
        dit_tensor y = nchw(cur, c0, H, W);
        BE(be->ops->conv2d(be, &y, &in, &v->conv_in.w, &v->conv_in.b, 1, 1));
    }

    /* UNetMidBlock2D: resnet, attention, resnet. */
    DIT_CHECK(resnet(f, &v->mid_res[0], cur, other, H, W));
    SWAP();
    if (c->mid_attention)
        DIT_CHECK(attention(f, cur, other, c0, H, W));
    DIT_CHECK(resnet(f, &v->mid_res[1], cur, other, H, W));
    SWAP();

    for (int i = 0; i < c->n_blocks; i++) {
        const vae_up *u = &v->ups[i];
        for (int j = 0; j <= c->layers_per_block; j++) {
            st = resnet(f, &u->resnets[j], cur, other, H, W);
            if (st != DIT_OK) {
                dit_diag_prefix(f->diag, "up block %d, resnet %d: ", i, j);
                goto cleanup;
            }
            SWAP();
        }
        if (u->has_upsample) {
            /* Upsample2D: F.interpolate(nearest, 2x), then the 3x3 conv. */
            dit_tensor x = nchw(cur, u->ch, H, W), up = nchw(other, u->ch, 2 * H, 2 * W);
            BE(be->ops->upsample2x(be, &up, &x));
            H *= 2;
            W *= 2;
            dit_tensor y = nchw(cur, u->ch, H, W);
            BE(be->ops->conv2d(be, &y, &up, &u->upsample.w, &u->upsample.b, 1, 1));
        }
    }

    /* conv_norm_out + SiLU (fused), conv_out straight into the image. */
    {
        const int64_t cl = v->ups[c->n_blocks - 1].ch;
        dit_tensor x = nchw(cur, cl, H, W);
        BE(be->ops->group_norm(be, &x, &x, &v->norm_out.w, &v->norm_out.b, c->groups, VAE_EPS,
                               DIT_ACT_SILU));
        BE(be->ops->conv2d(be, img, &x, &v->conv_out.w, &v->conv_out.b, 1, 1));
    }
#undef SWAP
cleanup:
    return st;
}

static dit_status check_tensor(const dit_tensor *t, const int64_t *want, const char *name,
                               dit_diag *diag)
{
    bool ok = t && t->dtype == DIT_F32 && t->ndim == 4 && dit_tensor_is_contiguous(t);
    for (int i = 0; ok && i < 4; i++)
        ok = t->ne[i] == want[i];
    if (ok)
        return DIT_OK;
    char got[64] = "NULL";
    if (t)
        dit_tensor_shape_str(t, got, sizeof got);
    return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                        "vae decode: '%s' is %s%s, expected contiguous (%lld, %lld, %lld, %lld) "
                        "f32",
                        name, got, t && !dit_tensor_is_contiguous(t) ? " (strided)" : "",
                        (long long)want[0], (long long)want[1], (long long)want[2],
                        (long long)want[3]);
}

dit_status dit_vae_decode(dit_vae_decoder *v, dit_arena *arena, const dit_tensor *z,
                          const dit_tensor *image, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = v->be;
    const dit_backend_ops *o = be->ops;
    if (!o->conv2d || !o->group_norm || !o->upsample2x || !o->gated_add || !o->copy ||
        (v->cfg.mid_attention && (!o->attention || !o->linear)))
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "vae decode: the %s backend lacks the image ops the VAE needs",
                            o->name);
    if (!z || z->ndim != 4)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "vae decode: 'z' must be (B, %d, h, w) f32",
                            v->cfg.latent_channels);
    const int64_t B = z->ne[0], h = z->ne[2], w = z->ne[3], s = dit_vae_scale_factor(v);
    if (B < 1 || h < 1 || w < 1 || h > VAE_MAX_LATENT_SIDE || w > VAE_MAX_LATENT_SIDE)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "vae decode: latent batch %lld of %lld x %lld is empty or too large",
                            (long long)B, (long long)h, (long long)w);
    const int64_t zs[4] = {B, v->cfg.latent_channels, h, w};
    const int64_t is[4] = {B, v->cfg.out_channels, h * s, w * s};
    DIT_CHECK(check_tensor(z, zs, "z", diag));
    DIT_CHECK(check_tensor(image, is, "image (output)", diag));

    fwd fs = {.v = v, .be = be, .arena = arena, .diag = diag};
    fwd *f = &fs;
    dit_arena_mark mark = dit_arena_get_mark(arena);
    /* Images are decoded one at a time: nothing in the decoder mixes batch
     * entries (GroupNorm is per sample), so this gives the batched result
     * while the activations (about 1 GiB per ping-pong buffer for a
     * 1024x1024 FLUX image) do not scale with B. */
    const vae_sizes sz = plan_sizes(v, h, w);
    float *p0 = NULL, *p1 = NULL;
    st = scratch(f, sz.pp, &p0);
    if (st == DIT_OK)
        st = scratch(f, sz.pp, &p1);
    for (int64_t b = 0; st == DIT_OK && b < B; b++) {
        dit_tensor zb = dit_tensor_narrow(z, 0, b, 1);
        dit_tensor ib = dit_tensor_narrow(image, 0, b, 1);
        st = decode_one(f, &zb, &ib, p0, p1);
        if (st != DIT_OK && B > 1)
            dit_diag_prefix(diag, "image %lld of %lld: ", (long long)b, (long long)B);
    }
    dit_arena_release(arena, mark);
cleanup:
    return st;
}
