/* T5EncoderModel on the backend interface. See t5_encoder.h for the forward
 * pass; the comments here explain where it has to follow transformers'
 * exact behaviour. */
#include "encoders/t5_encoder.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "encoders/encoder_common.h"
#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

/* ------------------------------------------------------------------------ */
/* Model                                                                     */

typedef struct t5_block {
    dit_tensor q, k, v;  /* (inner, d_model), no biases */
    dit_tensor o;        /* (d_model, inner) */
    dit_tensor ln0, ln1; /* (d_model) */
    dit_tensor wi0, wi1; /* gated: (d_ff, d_model) each */
    dit_tensor wi;       /* non-gated: (d_ff, d_model) */
    dit_tensor wo;       /* (d_model, d_ff) */
} t5_block;

struct dit_t5_encoder {
    dit_backend *be;
    /* config.json */
    int64_t vocab, d_model, d_kv, n_heads, n_layers, d_ff, n_buckets, max_distance;
    float eps;
    bool gated;
    dit_act act;   /* dense_act_fn, when the backend has it */
    bool act_relu; /* dense_act_fn "relu": applied on the host (no backend op) */
    /* weights, all inside one backend allocation */
    void *weights;
    size_t weight_bytes;
    dit_tensor embed;   /* (V, d_model) */
    dit_tensor final_w; /* (d_model) */
    t5_block *blocks;
    /* Block 0's relative_attention_bias (n_buckets, H), kept on the host in
     * f32 at full checkpoint precision: the (H, S, S) bias is built on the
     * host from it for each sequence length. */
    float *rel_bias;
};

static dit_status t5_config_load(const char *path, dit_t5_encoder *m, dit_diag *diag)
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
    if (type && strcmp(type, "t5") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: model_type is \"%s\"; this loader reads a T5EncoderModel (\"t5\"), "
                          "as FluxPipeline's text_encoder_2/ holds",
                          path, type);
        goto cleanup;
    }
    /* Missing keys take T5Config's defaults, as transformers does. */
    DIT_CHECK(
        dit_json_get_int(root, "vocab_size", path, false, 32128, 1, 1 << 24, &m->vocab, diag));
    DIT_CHECK(dit_json_get_int(root, "d_model", path, false, 512, 1, big, &m->d_model, diag));
    DIT_CHECK(dit_json_get_int(root, "d_kv", path, false, 64, 1, big, &m->d_kv, diag));
    DIT_CHECK(dit_json_get_int(root, "num_heads", path, false, 8, 1, 4096, &m->n_heads, diag));
    DIT_CHECK(dit_json_get_int(root, "num_layers", path, false, 6, 0, 4096, &m->n_layers, diag));
    DIT_CHECK(dit_json_get_int(root, "d_ff", path, false, 2048, 1, big, &m->d_ff, diag));
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
    /* The log-spaced buckets need max_exact = num_buckets / 4 >= 1 and a
     * max_distance beyond it; anything else makes transformers' formula
     * divide by log(1) = 0 or index outside the table. */
    if (m->max_distance <= m->n_buckets / 4) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: relative_attention_max_distance %lld must exceed "
                          "relative_attention_num_buckets / 4 = %lld",
                          path, (long long)m->max_distance, (long long)(m->n_buckets / 4));
        goto cleanup;
    }

    /* T5Config: feed_forward_proj is "ACT" or "gated-ACT"; dense_act_fn is
     * its last part, except that "gated-gelu" means gelu_new. Explicit
     * dense_act_fn / is_gated_act keys in config.json override both (the
     * config sets leftover keys after deriving them). */
    if (!ffp)
        ffp = "relu";
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

static void t5_weight_list(dit_t5_encoder *m, const char *embed_name, dit_weight_list *l)
{
    const int64_t Dm = m->d_model, In = m->n_heads * m->d_kv, F = m->d_ff;
    const int64_t sh_vd[2] = {m->vocab, Dm}, sh_id[2] = {In, Dm}, sh_di[2] = {Dm, In};
    const int64_t sh_fd[2] = {F, Dm}, sh_df[2] = {Dm, F}, sh_d[1] = {Dm};
    dit_weight_list_add(l, &m->embed, false, 2, sh_vd, "%s", embed_name);
    for (int64_t i = 0; i < m->n_layers; i++) {
        t5_block *b = &m->blocks[i];
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

static const char *const REL_BIAS_NAME =
    "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";

static void shape2(char *buf, size_t cap, int64_t a, int64_t b)
{
    snprintf(buf, cap, "(%lld, %lld)", (long long)a, (long long)b);
}

/* A tensor the backend never sees: checked here, with the same wording as
 * the weight loader's errors. */
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
        char want[64], got[64];
        shape2(want, sizeof want, n0, n1);
        dit_tensor_shape_str(&e->view, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s' has shape %s, but config.json implies %s", e->file,
                            name, got, want);
    }
    *out = e;
    return DIT_OK;
}

static dit_status check_backend(const dit_backend *be, bool need_fill, dit_diag *diag)
{
    const dit_backend_ops *o = be->ops;
    const char *missing = !o->embedding           ? "embedding"
                          : !o->rms_norm          ? "rms_norm"
                          : !o->linear            ? "linear"
                          : !o->attention_masked  ? "attention_masked"
                          : !o->gated_add         ? "gated_add"
                          : need_fill && !o->fill ? "fill"
                          : !o->upload            ? "upload"
                          : !o->download          ? "download"
                                                  : NULL;
    if (missing)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "backend '%s' has no %s op, which T5EncoderModel needs", o->name,
                            missing);
    return DIT_OK;
}

dit_status dit_t5_encoder_load(dit_backend *be, const char *dir, dit_t5_encoder **out,
                               dit_diag *diag)
{
    char path[4096];
    dit_status st;
    dit_st_set *set = NULL;
    dit_weight_list list;
    memset(&list, 0, sizeof list);
    *out = NULL;
    dit_t5_encoder *m = calloc(1, sizeof *m);
    if (!m)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
    m->be = be;

    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(t5_config_load(path, m, diag));
    DIT_CHECK(check_backend(be, m->gated, diag));
    m->blocks = calloc((size_t)m->n_layers + 1, sizeof *m->blocks);
    m->rel_bias = calloc((size_t)(m->n_buckets * m->n_heads), sizeof *m->rel_bias);
    if (!m->blocks || !m->rel_bias) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
        goto cleanup;
    }
    DIT_CHECK(dit_st_set_open_dir(dir, "model", &set, diag));

    /* The input embedding is tied: T5EncoderModel saves shared.weight, other
     * writers encoder.embed_tokens.weight, some both (the same values). Load
     * the first present; a second copy only has to have the right shape. */
    const bool has[2] = {dit_st_set_find(set, EMBED_NAMES[0]) != NULL,
                         dit_st_set_find(set, EMBED_NAMES[1]) != NULL};
    if (!has[0] && !has[1]) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: the input embedding is missing from the checkpoint (neither '%s' "
                          "nor '%s' is present)",
                          dir, EMBED_NAMES[0], EMBED_NAMES[1]);
        goto cleanup;
    }
    const char *extra[2] = {NULL, NULL};
    t5_weight_list(m, EMBED_NAMES[has[0] ? 0 : 1], &list);
    DIT_CHECK(dit_weights_load(be, set, &list, false, dir, &m->weights, &m->weight_bytes, diag));
    if (has[0] && has[1]) {
        const dit_st_entry *dup;
        DIT_CHECK(check_host_tensor(set, dir, EMBED_NAMES[1], m->vocab, m->d_model, &dup, diag));
        extra[0] = EMBED_NAMES[1];
    }
    if (m->n_layers > 0) {
        const dit_st_entry *e;
        DIT_CHECK(check_host_tensor(set, dir, REL_BIAS_NAME, m->n_buckets, m->n_heads, &e, diag));
        dit_convert_to_f32(m->rel_bias, e->view.data, e->view.dtype,
                           (size_t)(m->n_buckets * m->n_heads));
        extra[1] = REL_BIAS_NAME;
    }
    /* The decoder of a full T5 checkpoint is ignored, as T5EncoderModel
     * ignores it. */
    DIT_CHECK(
        dit_encoder_check_unexpected(set, &list, "decoder.", extra, 2, "T5EncoderModel", diag));
    *out = m;
    m = NULL;
cleanup:
    dit_weight_list_free(&list);
    dit_st_set_close(set);
    dit_t5_encoder_free(m);
    return st;
}

void dit_t5_encoder_free(dit_t5_encoder *m)
{
    if (!m)
        return;
    dit_backend_free(m->be, m->weights);
    free(m->blocks);
    free(m->rel_bias);
    free(m);
}

int dit_t5_encoder_d_model(const dit_t5_encoder *m)
{
    return (int)m->d_model;
}

int dit_t5_relative_bucket(int64_t rel, int num_buckets, int max_distance)
{
    /* Bidirectional: half the buckets for keys after the query. */
    const int half = num_buckets / 2;
    const int base = rel > 0 ? half : 0;
    const int64_t n = rel < 0 ? -rel : rel;
    const int max_exact = half / 2;
    if (n < max_exact)
        return base + (int)n;
    /* PyTorch evaluates log(n.float() / max_exact) / log(max_distance /
     * max_exact) * (half - max_exact) in float32, the divisor a Python
     * double rounded to float32, then truncates toward zero. Doing the same
     * in float keeps the edges (n = 16, 32, 64, ... for the usual 32/128
     * config, where the exact value is an integer) on the same side. */
    const float ratio = (float)n / (float)max_exact;
    const float denom = (float)log((double)max_distance / (double)max_exact);
    const float v = logf(ratio) / denom * (float)(half - max_exact);
    int64_t large = max_exact + (int64_t)v;
    if (large > half - 1)
        large = half - 1;
    return base + (int)large;
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

#define BE(call)                                                                                   \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "t5 encoder forward: %s failed: %s", #call,                \
                              dit_status_str(st));                                                 \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

/* bias (H, S, S) on the host: bias[h][i][j] = rel_bias[bucket(j - i)][h]. */
static void position_bias(const dit_t5_encoder *m, int64_t S, int32_t *buckets, float *bias)
{
    const int64_t H = m->n_heads;
    /* One bucket per relative position -(S-1) .. S-1. */
    for (int64_t r = -(S - 1); r <= S - 1; r++)
        buckets[r + S - 1] = dit_t5_relative_bucket(r, (int)m->n_buckets, (int)m->max_distance);
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < S; i++) {
            float *row = bias + (h * S + i) * S;
            const int32_t *bk = buckets + (S - 1 - i); /* bk[j] = bucket(j - i) */
            for (int64_t j = 0; j < S; j++)
                row[j] = m->rel_bias[(int64_t)bk[j] * H + h];
        }
}

dit_status dit_t5_encoder_forward(dit_t5_encoder *m, dit_arena *arena, const int32_t *ids,
                                  int64_t B, int64_t S, const dit_tensor *out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = m->be;
    const int64_t Dm = m->d_model, H = m->n_heads, Dk = m->d_kv, In = H * Dk, F = m->d_ff;
    float *host_bias = NULL;
    int32_t *buckets = NULL;

    if (!ids || B < 1 || S < 1 || S > (1 << 20))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "t5 encoder forward: need ids of shape (B >= 1, 1 <= S <= 2^20), "
                            "got (%lld, %lld)",
                            (long long)B, (long long)S);
    if (!out || out->dtype != DIT_F32 || out->ndim != 3 || out->ne[0] != B || out->ne[1] != S ||
        out->ne[2] != Dm || !dit_tensor_rows_dense(out)) {
        char got[64] = "NULL";
        if (out)
            dit_tensor_shape_str(out, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "t5 encoder forward: output is %s, expected (%lld, %lld, %lld) f32 "
                            "with dense rows",
                            got, (long long)B, (long long)S, (long long)Dm);
    }
    st = dit_encoder_check_ids(ids, B, S, m->vocab, "t5 encoder forward", diag);
    if (st != DIT_OK)
        return st;

    const dit_arena_mark mark = dit_arena_get_mark(arena);

#define ALLOC(t, nd, ...)                                                                          \
    do {                                                                                           \
        const int64_t shp_[] = {__VA_ARGS__};                                                      \
        st = dit_arena_tensor(arena, DIT_F32, nd, shp_, &(t));                                     \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "t5 encoder forward: activation memory exhausted");        \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

    dit_tensor x, n, qkv, attn, o, h0;
    dit_tensor h1 = {0}, prod = {0}, bias = {0};
    ALLOC(x, 3, B, S, Dm);       /* residual stream */
    ALLOC(n, 3, B, S, Dm);       /* RMSNorm output */
    ALLOC(qkv, 3, B, S, 3 * In); /* [q | k | v] */
    ALLOC(attn, 3, B, S, In);
    ALLOC(o, 3, B, S, Dm); /* a sub-block's output before the residual add */
    ALLOC(h0, 3, B, S, F); /* act(wi_0 x) or act(wi x) */
    if (m->gated) {
        ALLOC(h1, 3, B, S, F);   /* wi_1 x */
        ALLOC(prod, 3, B, S, F); /* act(wi_0 x) * wi_1 x */
    }
    if (m->n_layers > 0)
        ALLOC(bias, 3, H, S, S);
#undef ALLOC

    {
        dit_tensor x2 = dit_tensor_2d(x.data, DIT_F32, B * S, Dm);
        BE(be->ops->embedding(be, &x2, &m->embed, ids, B * S));
    }
    if (m->n_layers > 0) {
        host_bias = malloc(sizeof *host_bias * (size_t)(H * S * S));
        buckets = malloc(sizeof *buckets * (size_t)(2 * S - 1));
        if (!host_bias || !buckets) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "t5 encoder forward: out of memory");
            goto cleanup;
        }
        position_bias(m, S, buckets, host_bias);
        dit_tensor hb = dit_tensor_3d(host_bias, DIT_F32, H, S, S);
        BE(be->ops->upload(be, &bias, &hb));
    }

    dit_tensor q = dit_tensor_narrow(&qkv, 2, 0, In);
    dit_tensor k = dit_tensor_narrow(&qkv, 2, In, In);
    dit_tensor v = dit_tensor_narrow(&qkv, 2, 2 * In, In);
    dit_tensor q4 = dit_tensor_split_last(&q, Dk), k4 = dit_tensor_split_last(&k, Dk);
    dit_tensor v4 = dit_tensor_split_last(&v, Dk), a4 = dit_tensor_split_last(&attn, Dk);
    for (int64_t i = 0; i < m->n_layers; i++) {
        const t5_block *b = &m->blocks[i];
        /* x = x + o(attention(RMS0(x))), scale 1: T5 folds 1/sqrt(d_kv) into
         * its weights' initialisation. */
        BE(be->ops->rms_norm(be, &n, &x, &b->ln0, m->eps));
        BE(be->ops->linear(be, &q, &n, &b->q, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->linear(be, &k, &n, &b->k, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->linear(be, &v, &n, &b->v, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->attention_masked(be, &a4, &q4, &k4, &v4, 1.0f, &bias, false));
        BE(be->ops->linear(be, &o, &attn, &b->o, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->gated_add(be, &x, &o, NULL));
        /* x = x + wo(FFN(RMS1(x))) */
        BE(be->ops->rms_norm(be, &n, &x, &b->ln1, m->eps));
        const dit_tensor *ffn_out = &h0;
        if (m->gated) {
            BE(be->ops->linear(be, &h0, &n, &b->wi0, NULL, m->act, 0.0f));
            if (m->act_relu)
                BE(dit_encoder_relu_on_host(be, &h0));
            BE(be->ops->linear(be, &h1, &n, &b->wi1, NULL, DIT_ACT_NONE, 0.0f));
            /* prod = h0 * h1 elementwise, with the ops at hand: gated_add
             * computes res += gate * x with one gate row per batch entry, so
             * viewing the B*S rows as B*S batch entries of one token makes
             * it elementwise; res starts at 0, and 0 + g*x rounds like g*x. */
            dit_tensor pr = dit_tensor_3d(prod.data, DIT_F32, B * S, 1, F);
            dit_tensor xr = dit_tensor_3d(h1.data, DIT_F32, B * S, 1, F);
            dit_tensor gr = dit_tensor_2d(h0.data, DIT_F32, B * S, F);
            BE(be->ops->fill(be, &prod, 0.0f));
            BE(be->ops->gated_add(be, &pr, &xr, &gr));
            ffn_out = &prod;
        } else {
            BE(be->ops->linear(be, &h0, &n, &b->wi, NULL, m->act, 0.0f));
            if (m->act_relu)
                BE(dit_encoder_relu_on_host(be, &h0));
        }
        BE(be->ops->linear(be, &o, ffn_out, &b->wo, NULL, DIT_ACT_NONE, 0.0f));
        BE(be->ops->gated_add(be, &x, &o, NULL));
    }
    BE(be->ops->rms_norm(be, out, &x, &m->final_w, m->eps));
cleanup:
    dit_arena_release(arena, mark);
    free(host_bias);
    free(buckets);
    return st;
}
