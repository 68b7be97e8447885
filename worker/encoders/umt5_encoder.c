/* UMT5EncoderModel on the backend interface. See umt5_encoder.h for the
 * forward pass; where it equals T5's, t5_encoder.c explains the details
 * that follow transformers' exact behaviour (bucket arithmetic, the gated
 * product through gated_add, ReLU on the host). */
#include "encoders/umt5_encoder.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "encoders/encoder_common.h"
#include "encoders/prompt_clean.h"
#include "encoders/t5_encoder.h"
#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

typedef struct umt5_block {
    dit_tensor q, k, v;  /* (inner, d_model), no biases */
    dit_tensor o;        /* (d_model, inner) */
    dit_tensor ln0, ln1; /* (d_model) */
    dit_tensor wi0, wi1; /* gated: (d_ff, d_model) each */
    dit_tensor wi;       /* non-gated: (d_ff, d_model) */
    dit_tensor wo;       /* (d_model, d_ff) */
    /* relative_attention_bias (n_buckets, H), on the host in f32 at full
     * checkpoint precision: each layer's (H, S, S) bias is built from it. */
    float *rel_bias;
} umt5_block;

struct dit_umt5_encoder {
    dit_backend *be;
    int64_t vocab, d_model, d_kv, n_heads, n_layers, d_ff, n_buckets, max_distance;
    float eps;
    bool gated;
    dit_act act;
    bool act_relu;
    void *weights;
    size_t weight_bytes;
    dit_tensor embed;   /* (V, d_model) */
    dit_tensor final_w; /* (d_model) */
    umt5_block *blocks;
    float *rel_bias; /* n_layers tables of (n_buckets, H), one allocation */
};

static dit_status umt5_config_load(const char *path, dit_umt5_encoder *m, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    const char *type = NULL, *ffp = NULL, *act_override = NULL;
    double eps = 0;
    bool gated_override = false;
    const int64_t big = 1 << 20;
    char act[64];

    DIT_CHECK(dit_json_get_string(root, "model_type", path, false, &type, diag));
    if (type && strcmp(type, "umt5") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: model_type is \"%s\"; this loader reads a UMT5EncoderModel "
                          "(\"umt5\"), as WanPipeline's text_encoder/ holds",
                          path, type);
        goto cleanup;
    }
    /* Missing keys take UMT5Config's defaults, as transformers does. */
    DIT_CHECK(
        dit_json_get_int(root, "vocab_size", path, false, 250112, 1, 1 << 24, &m->vocab, diag));
    DIT_CHECK(dit_json_get_int(root, "d_model", path, false, 512, 1, big, &m->d_model, diag));
    DIT_CHECK(dit_json_get_int(root, "d_kv", path, false, 64, 1, big, &m->d_kv, diag));
    DIT_CHECK(dit_json_get_int(root, "num_heads", path, false, 6, 1, 4096, &m->n_heads, diag));
    DIT_CHECK(dit_json_get_int(root, "num_layers", path, false, 8, 0, 4096, &m->n_layers, diag));
    DIT_CHECK(dit_json_get_int(root, "d_ff", path, false, 1024, 1, big, &m->d_ff, diag));
    DIT_CHECK(dit_json_get_int(root, "relative_attention_num_buckets", path, false, 32, 4, 1 << 16,
                               &m->n_buckets, diag));
    DIT_CHECK(dit_json_get_int(root, "relative_attention_max_distance", path, false, 128, 1,
                               1 << 30, &m->max_distance, diag));
    DIT_CHECK(dit_json_get_double(root, "layer_norm_epsilon", path, false, 1e-6, &eps, diag));
    DIT_CHECK(dit_json_get_string(root, "feed_forward_proj", path, false, &ffp, diag));
    if (!(eps >= 0.0 && eps < 1.0)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: layer_norm_epsilon = %g is not in [0, 1)",
                          path, eps);
        goto cleanup;
    }
    m->eps = (float)eps;
    if (m->n_heads * m->d_kv > big) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: num_heads * d_kv is implausibly large", path);
        goto cleanup;
    }
    if (m->max_distance <= m->n_buckets / 4) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: relative_attention_max_distance %lld must exceed "
                          "relative_attention_num_buckets / 4 = %lld",
                          path, (long long)m->max_distance, (long long)(m->n_buckets / 4));
        goto cleanup;
    }
    /* UMT5Config derives dense_act_fn and is_gated_act from
     * feed_forward_proj exactly as T5Config does ("gated-gelu" means
     * gelu_new); explicit keys override. */
    if (!ffp)
        ffp = "gated-gelu";
    {
        const char *dash = strchr(ffp, '-');
        const bool bad = dash && (strncmp(ffp, "gated-", 6) != 0 || strchr(dash + 1, '-'));
        if (bad || strlen(ffp) >= sizeof act) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: feed_forward_proj \"%s\" is not of the form \"gated-ACT\" or "
                              "\"ACT\" (e.g. \"gated-gelu\", \"relu\")",
                              path, ffp);
            goto cleanup;
        }
        m->gated = dash != NULL;
        snprintf(act, sizeof act, "%s", dash ? dash + 1 : ffp);
        if (strcmp(ffp, "gated-gelu") == 0)
            snprintf(act, sizeof act, "gelu_new");
    }
    DIT_CHECK(dit_json_get_string(root, "dense_act_fn", path, false, &act_override, diag));
    if (act_override)
        snprintf(act, sizeof act, "%s", act_override);
    if (cJSON_GetObjectItemCaseSensitive(root, "is_gated_act")) {
        DIT_CHECK(
            dit_json_get_bool(root, "is_gated_act", path, false, m->gated, &gated_override, diag));
        m->gated = gated_override;
    }
    if (!dit_encoder_parse_act(act, &m->act, &m->act_relu)) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: dense activation \"%s\" is not supported (gelu_new, gelu, "
                          "gelu_pytorch_tanh, silu, quick_gelu, relu are)",
                          path, act);
        goto cleanup;
    }
cleanup:
    cJSON_Delete(root);
    return st;
}

static const char *const EMBED_NAMES[2] = {"shared.weight", "encoder.embed_tokens.weight"};

static void umt5_weight_list(dit_umt5_encoder *m, const char *embed_name, dit_weight_list *l)
{
    const int64_t Dm = m->d_model, In = m->n_heads * m->d_kv, F = m->d_ff;
    const int64_t sh_vd[2] = {m->vocab, Dm}, sh_id[2] = {In, Dm}, sh_di[2] = {Dm, In};
    const int64_t sh_fd[2] = {F, Dm}, sh_df[2] = {Dm, F}, sh_d[1] = {Dm};
    dit_weight_list_add(l, &m->embed, false, 2, sh_vd, "%s", embed_name);
    for (int64_t i = 0; i < m->n_layers; i++) {
        umt5_block *b = &m->blocks[i];
        char p[96];
        snprintf(p, sizeof p, "encoder.block.%lld.layer", (long long)i);
        dit_weight_list_add(l, &b->q, false, 2, sh_id, "%s.0.SelfAttention.q.weight", p);
        dit_weight_list_add(l, &b->k, false, 2, sh_id, "%s.0.SelfAttention.k.weight", p);
        dit_weight_list_add(l, &b->v, false, 2, sh_id, "%s.0.SelfAttention.v.weight", p);
        dit_weight_list_add(l, &b->o, false, 2, sh_di, "%s.0.SelfAttention.o.weight", p);
        dit_weight_list_add(l, &b->ln0, false, 1, sh_d, "%s.0.layer_norm.weight", p);
        if (m->gated) {
            dit_weight_list_add(l, &b->wi0, false, 2, sh_fd, "%s.1.DenseReluDense.wi_0.weight", p);
            dit_weight_list_add(l, &b->wi1, false, 2, sh_fd, "%s.1.DenseReluDense.wi_1.weight", p);
        } else {
            dit_weight_list_add(l, &b->wi, false, 2, sh_fd, "%s.1.DenseReluDense.wi.weight", p);
        }
        dit_weight_list_add(l, &b->wo, false, 2, sh_df, "%s.1.DenseReluDense.wo.weight", p);
        dit_weight_list_add(l, &b->ln1, false, 1, sh_d, "%s.1.layer_norm.weight", p);
    }
    dit_weight_list_add(l, &m->final_w, false, 1, sh_d, "encoder.final_layer_norm.weight");
}

/* A tensor the backend never sees: checked here, with the weight loader's
 * wording. */
static dit_status check_host_tensor(const dit_st_set *set, const char *dir, const char *name,
                                    int64_t n0, int64_t n1, const dit_st_entry **out,
                                    dit_diag *diag)
{
    const dit_st_entry *e = dit_st_set_find(set, name);
    if (!e)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s' is missing from the checkpoint (does config.json "
                            "belong to these weights?)",
                            dir, name);
    if (e->view.ndim != 2 || e->view.ne[0] != n0 || e->view.ne[1] != n1) {
        char got[64];
        dit_tensor_shape_str(&e->view, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s' has shape %s, but config.json implies (%lld, %lld)",
                            e->file, name, got, (long long)n0, (long long)n1);
    }
    *out = e;
    return DIT_OK;
}

static dit_status check_backend(const dit_backend *be, dit_diag *diag)
{
    const dit_backend_ops *o = be->ops;
    const char *missing = !o->embedding          ? "embedding"
                          : !o->rms_norm         ? "rms_norm"
                          : !o->linear           ? "linear"
                          : !o->attention_masked ? "attention_masked"
                          : !o->gated_add        ? "gated_add"
                          : !o->fill             ? "fill"
                          : !o->copy             ? "copy"
                          : !o->upload           ? "upload"
                          : !o->download         ? "download"
                                                 : NULL;
    if (missing)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "backend '%s' has no %s op, which UMT5EncoderModel needs", o->name,
                            missing);
    return DIT_OK;
}

dit_status dit_umt5_encoder_load(dit_backend *be, const char *dir, dit_umt5_encoder **out,
                                 dit_diag *diag)
{
    char path[4096];
    dit_status st;
    dit_st_set *set = NULL;
    dit_weight_list list;
    const char **extra = NULL;
    memset(&list, 0, sizeof list);
    *out = NULL;
    dit_umt5_encoder *m = calloc(1, sizeof *m);
    if (!m)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
    m->be = be;

    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(umt5_config_load(path, m, diag));
    DIT_CHECK(check_backend(be, diag));
    const size_t table = (size_t)(m->n_buckets * m->n_heads);
    m->blocks = calloc((size_t)m->n_layers + 1, sizeof *m->blocks);
    m->rel_bias = calloc(table * (size_t)m->n_layers + 1, sizeof *m->rel_bias);
    extra = calloc((size_t)m->n_layers + 1, sizeof *extra);
    char(*names)[96] = calloc((size_t)m->n_layers + 1, sizeof *names);
    if (!m->blocks || !m->rel_bias || !extra || !names) {
        free(names);
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
        goto cleanup;
    }
    st = dit_st_set_open_dir(dir, "model", &set, diag);
    if (st != DIT_OK) {
        free(names);
        goto cleanup;
    }

    /* The tied input embedding: load the first present; a second copy only
     * has to have the right shape. */
    const bool has[2] = {dit_st_set_find(set, EMBED_NAMES[0]) != NULL,
                         dit_st_set_find(set, EMBED_NAMES[1]) != NULL};
    if (!has[0] && !has[1]) {
        free(names);
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: the input embedding is missing from the checkpoint (neither '%s' "
                          "nor '%s' is present)",
                          dir, EMBED_NAMES[0], EMBED_NAMES[1]);
        goto cleanup;
    }
    umt5_weight_list(m, EMBED_NAMES[has[0] ? 0 : 1], &list);
    st = dit_weights_load(be, set, &list, false, dir, &m->weights, &m->weight_bytes, diag);
    if (st == DIT_OK && has[0] && has[1]) {
        const dit_st_entry *dup;
        st = check_host_tensor(set, dir, EMBED_NAMES[1], m->vocab, m->d_model, &dup, diag);
        extra[m->n_layers] = EMBED_NAMES[1];
    }
    /* Every layer's own relative_attention_bias (UMT5Attention is built
     * with has_relative_attention_bias=True in every block). */
    for (int64_t i = 0; st == DIT_OK && i < m->n_layers; i++) {
        const dit_st_entry *e = NULL;
        snprintf(names[i], sizeof names[i],
                 "encoder.block.%lld.layer.0.SelfAttention.relative_attention_bias.weight",
                 (long long)i);
        st = check_host_tensor(set, dir, names[i], m->n_buckets, m->n_heads, &e, diag);
        if (st == DIT_OK) {
            m->blocks[i].rel_bias = m->rel_bias + table * (size_t)i;
            dit_convert_to_f32(m->blocks[i].rel_bias, e->view.data, e->view.dtype, table);
            extra[i] = names[i];
        }
    }
    /* Strict: unlike T5EncoderModel's loader, decoder tensors are errors
     * too (a text_encoder/ folder holds the encoder only). */
    if (st == DIT_OK)
        st = dit_encoder_check_unexpected(set, &list, NULL, extra, (size_t)m->n_layers + 1,
                                          "UMT5EncoderModel", diag);
    free(names);
    if (st != DIT_OK)
        goto cleanup;
    *out = m;
    m = NULL;
cleanup:
    free(extra);
    dit_weight_list_free(&list);
    dit_st_set_close(set);
    dit_umt5_encoder_free(m);
    return st;
}

void dit_umt5_encoder_free(dit_umt5_encoder *m)
{
    if (!m)
        return;
    dit_backend_free(m->be, m->weights);
    free(m->blocks);
    free(m->rel_bias);
    free(m);
}

int dit_umt5_encoder_d_model(const dit_umt5_encoder *m)
{
    return (int)m->d_model;
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

#define BE(call)                                                                                   \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "umt5 encoder forward: %s failed: %s", #call,              \
                              dit_status_str(st));                                                 \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

/* bias (H, S, n) contiguous on the host: bias[h][i][j] = tab[bucket(j - i)][h]
 * for keys j < n; bk[r + S - 1] is the bucket of relative position r. */
static void position_bias(const float *tab, int64_t H, int64_t S, int64_t n, const int32_t *bk,
                          float *bias)
{
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < S; i++) {
            float *row = bias + (h * S + i) * n;
            const int32_t *b = bk + (S - 1 - i); /* b[j] = bucket(j - i) */
            for (int64_t j = 0; j < n; j++)
                row[j] = tab[(int64_t)b[j] * H + h];
        }
}

dit_status dit_umt5_encoder_forward(dit_umt5_encoder *m, dit_arena *arena, const int32_t *ids,
                                    const int32_t *lengths, int64_t B, int64_t S,
                                    const dit_tensor *out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = m->be;
    const int64_t Dm = m->d_model, H = m->n_heads, Dk = m->d_kv, In = H * Dk, F = m->d_ff;
    float *host_bias = NULL;
    int32_t *buckets = NULL;

    if (!ids || B < 1 || S < 1 || S > (1 << 20))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "umt5 encoder forward: need ids of shape (B >= 1, 1 <= S <= 2^20), "
                            "got (%lld, %lld)",
                            (long long)B, (long long)S);
    if (!out || out->dtype != DIT_F32 || out->ndim != 3 || out->ne[0] != B || out->ne[1] != S ||
        out->ne[2] != Dm || !dit_tensor_rows_dense(out)) {
        char got[64] = "NULL";
        if (out)
            dit_tensor_shape_str(out, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "umt5 encoder forward: output is %s, expected (%lld, %lld, %lld) f32 "
                            "with dense rows",
                            got, (long long)B, (long long)S, (long long)Dm);
    }
    for (int64_t b = 0; lengths && b < B; b++)
        if (lengths[b] < 1 || lengths[b] > S)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "umt5 encoder forward: lengths[%lld] = %d is not in [1, %lld] "
                                "(every row needs an unmasked token)",
                                (long long)b, (int)lengths[b], (long long)S);
    st = dit_encoder_check_ids(ids, B, S, m->vocab, "umt5 encoder forward", diag);
    if (st != DIT_OK)
        return st;

    const dit_arena_mark mark = dit_arena_get_mark(arena);

#define ALLOC(t, nd, ...)                                                                          \
    do {                                                                                           \
        const int64_t shp_[] = {__VA_ARGS__};                                                      \
        st = dit_arena_tensor(arena, DIT_F32, nd, shp_, &(t));                                     \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "umt5 encoder forward: activation memory exhausted");      \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

    dit_tensor x, n, qkv, attn, o, h0;
    dit_tensor h1 = {0}, prod = {0}, bias = {0};
    ALLOC(x, 3, B, S, Dm);       /* residual stream */
    ALLOC(n, 3, B, S, Dm);       /* RMSNorm output */
    ALLOC(qkv, 3, B, S, 3 * In); /* [q | k | v] */
    ALLOC(attn, 3, B, S, In);
    ALLOC(o, 3, B, S, Dm);
    ALLOC(h0, 3, B, S, F);
    if (m->gated) {
        ALLOC(h1, 3, B, S, F);
        ALLOC(prod, 3, B, S, F);
    }
    if (m->n_layers > 0)
        ALLOC(bias, 3, H, S, S); /* viewed as (H, S, n) for n masked keys */
#undef ALLOC

    {
        dit_tensor x2 = dit_tensor_2d(x.data, DIT_F32, B * S, Dm);
        BE(be->ops->embedding(be, &x2, &m->embed, ids, B * S));
    }
    if (m->n_layers > 0) {
        host_bias = malloc(sizeof *host_bias * (size_t)(H * S * S));
        buckets = malloc(sizeof *buckets * (size_t)(2 * S - 1));
        if (!host_bias || !buckets) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "umt5 encoder forward: out of memory");
            goto cleanup;
        }
        for (int64_t r = -(S - 1); r <= S - 1; r++)
            buckets[r + S - 1] = dit_t5_relative_bucket(r, (int)m->n_buckets, (int)m->max_distance);
    }

    dit_tensor q = dit_tensor_narrow(&qkv, 2, 0, In);
    dit_tensor k = dit_tensor_narrow(&qkv, 2, In, In);
    dit_tensor v = dit_tensor_narrow(&qkv, 2, 2 * In, In);
    dit_tensor q4 = dit_tensor_split_last(&q, Dk), k4 = dit_tensor_split_last(&k, Dk);
    dit_tensor v4 = dit_tensor_split_last(&v, Dk), a4 = dit_tensor_split_last(&attn, Dk);
    for (int64_t i = 0; i < m->n_layers; i++) {
        const umt5_block *blk = &m->blocks[i];
        BE(be->ops->rms_norm(be, &n, &x, &blk->ln0, m->eps));
        BE(be->ops->linear(be, &q, &n, &blk->q, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->linear(be, &k, &n, &blk->k, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->linear(be, &v, &n, &blk->v, NULL, DIT_ACT_NONE, 0.0f));
        /* One attention call per run of batch entries with the same number
         * of unmasked keys nk: keys narrowed to [0, nk), this layer's bias
         * built for (H, S, nk). Scale 1, as T5. */
        for (int64_t b0 = 0; b0 < B;) {
            const int64_t nk = lengths ? lengths[b0] : S;
            int64_t b1 = b0 + 1;
            while (b1 < B && (lengths ? lengths[b1] : S) == nk)
                b1++;
            position_bias(blk->rel_bias, H, S, nk, buckets, host_bias);
            dit_tensor bv = dit_tensor_3d(bias.data, DIT_F32, H, S, nk);
            dit_tensor hb = dit_tensor_3d(host_bias, DIT_F32, H, S, nk);
            BE(be->ops->upload(be, &bv, &hb));
            dit_tensor qb = dit_tensor_narrow(&q4, 0, b0, b1 - b0);
            dit_tensor kb = dit_tensor_narrow(&k4, 0, b0, b1 - b0);
            dit_tensor vb = dit_tensor_narrow(&v4, 0, b0, b1 - b0);
            dit_tensor ab = dit_tensor_narrow(&a4, 0, b0, b1 - b0);
            kb = dit_tensor_narrow(&kb, 1, 0, nk);
            vb = dit_tensor_narrow(&vb, 1, 0, nk);
            BE(be->ops->attention_masked(be, &ab, &qb, &kb, &vb, 1.0f, &bv, false));
            b0 = b1;
        }
        BE(be->ops->linear(be, &o, &attn, &blk->o, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->gated_add(be, &x, &o, NULL));
        BE(be->ops->rms_norm(be, &n, &x, &blk->ln1, m->eps));
        const dit_tensor *ffn_out = &h0;
        if (m->gated) {
            BE(be->ops->linear(be, &h0, &n, &blk->wi0, NULL, m->act, 0.0f));
            if (m->act_relu)
                BE(dit_encoder_relu_on_host(be, &h0));
            BE(be->ops->linear(be, &h1, &n, &blk->wi1, NULL, DIT_ACT_NONE, 0.0f));
            /* prod = h0 * h1 through gated_add, as in t5_encoder.c. */
            dit_tensor pr = dit_tensor_3d(prod.data, DIT_F32, B * S, 1, F);
            dit_tensor xr = dit_tensor_3d(h1.data, DIT_F32, B * S, 1, F);
            dit_tensor gr = dit_tensor_2d(h0.data, DIT_F32, B * S, F);
            BE(be->ops->fill(be, &prod, 0.0f));
            BE(be->ops->gated_add(be, &pr, &xr, &gr));
            ffn_out = &prod;
        } else {
            BE(be->ops->linear(be, &h0, &n, &blk->wi, NULL, m->act, 0.0f));
            if (m->act_relu)
                BE(dit_encoder_relu_on_host(be, &h0));
        }
        BE(be->ops->linear(be, &o, ffn_out, &blk->wo, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->gated_add(be, &x, &o, NULL));
    }
    BE(be->ops->rms_norm(be, out, &x, &m->final_w, m->eps));
cleanup:
    dit_arena_release(arena, mark);
    free(host_bias);
    free(buckets);
    return st;
}

/* ------------------------------------------------------------------------ */
/* WanPipeline's prompt -> prompt_embeds                                      */

dit_status dit_umt5_prompt_embeds(dit_umt5_encoder *m, const dit_t5_tokenizer *tok,
                                  dit_arena *arena, const char *const *prompts, int64_t B,
                                  int max_sequence_length, const dit_tensor *out, int32_t *n_tokens,
                                  bool *truncated, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = m->be;
    const int64_t L = max_sequence_length, Dm = m->d_model;
    int32_t *ids = NULL, *lens = NULL, *run_ids = NULL;
    char *clean = NULL;

    if (!prompts || B < 1 || L < 2 || L > (1 << 20))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "umt5 prompt embeds: need B >= 1 prompts and 2 <= "
                            "max_sequence_length <= 2^20, got %lld and %lld",
                            (long long)B, (long long)L);
    if (!out || out->dtype != DIT_F32 || out->ndim != 3 || out->ne[0] != B || out->ne[1] != L ||
        out->ne[2] != Dm || !dit_tensor_rows_dense(out)) {
        char got[64] = "NULL";
        if (out)
            dit_tensor_shape_str(out, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "umt5 prompt embeds: output is %s, expected (%lld, %lld, %lld) f32 "
                            "with dense rows",
                            got, (long long)B, (long long)L, (long long)Dm);
    }
    ids = malloc(sizeof *ids * (size_t)(B * L));
    lens = malloc(sizeof *lens * (size_t)B);
    if (!ids || !lens) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "umt5 prompt embeds: out of memory");
        goto cleanup;
    }
    int64_t S = 1;
    for (int64_t b = 0; b < B; b++) {
        int n = 0;
        bool cut = false;
        st = dit_wan_prompt_clean(prompts[b] ? prompts[b] : "", &clean, diag);
        if (st == DIT_OK)
            st = dit_t5_tokenizer_encode(tok, clean, ids + b * L, (int)L, &n, &cut, diag);
        if (truncated && cut)
            *truncated = true;
        free(clean);
        clean = NULL;
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "umt5 prompt embeds: prompt %lld", (long long)b);
            goto cleanup;
        }
        lens[b] = n < 1 ? 1 : n;
        if (n_tokens)
            n_tokens[b] = n;
        S = lens[b] > S ? lens[b] : S;
    }
    /* The forward over the first S ids of each row (see the header). */
    run_ids = malloc(sizeof *run_ids * (size_t)(B * S));
    if (!run_ids) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "umt5 prompt embeds: out of memory");
        goto cleanup;
    }
    for (int64_t b = 0; b < B; b++)
        memcpy(run_ids + b * S, ids + b * L, sizeof *run_ids * (size_t)S);
    {
        const dit_arena_mark mark = dit_arena_get_mark(arena);
        dit_tensor hidden;
        const int64_t shp[3] = {B, S, Dm};
        st = dit_arena_tensor(arena, DIT_F32, 3, shp, &hidden);
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "umt5 prompt embeds: activation memory exhausted");
            goto cleanup;
        }
        st = dit_umt5_encoder_forward(m, arena, run_ids, lens, B, S, &hidden, diag);
        if (st == DIT_OK) {
            /* Zero rows after each prompt, the prompt's rows copied. */
            st = be->ops->fill(be, out, 0.0f);
            for (int64_t b = 0; st == DIT_OK && b < B; b++) {
                dit_tensor src = dit_tensor_narrow(&hidden, 0, b, 1);
                dit_tensor dst = dit_tensor_narrow(out, 0, b, 1);
                src = dit_tensor_narrow(&src, 1, 0, lens[b]);
                dst = dit_tensor_narrow(&dst, 1, 0, lens[b]);
                st = be->ops->copy(be, &dst, &src);
            }
            if (st != DIT_OK)
                st = dit_diag_set(diag, st, "umt5 prompt embeds: writing the output failed: %s",
                                  dit_status_str(st));
        }
        dit_arena_release(arena, mark);
    }
cleanup:
    free(ids);
    free(lens);
    free(run_ids);
    return st;
}
