/* The T5-family encoders' shared parts. See t5_common.h; the comments here
 * explain where they follow transformers' exact behaviour. */
#include "encoders/t5_common.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "encoders/encoder_common.h"
#include "encoders/t5_encoder.h"
#include "loader/json_util.h"

/* ------------------------------------------------------------------------ */
/* config.json                                                               */

dit_status dit_t5_config_load(const char *path, const dit_t5_config_kind *kind, dit_t5_config *c,
                              dit_diag *diag)
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
    if (type && strcmp(type, kind->model_type) != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: model_type is \"%s\"; this loader reads a %s (\"%s\"), as %s holds",
                          path, type, kind->model, kind->model_type, kind->holder);
        goto cleanup;
    }
    /* Missing keys take the config class's defaults, as transformers does. */
    DIT_CHECK(dit_json_get_int(root, "vocab_size", path, false, kind->vocab, 1, 1 << 24, &c->vocab,
                               diag));
    DIT_CHECK(dit_json_get_int(root, "d_model", path, false, 512, 1, big, &c->d_model, diag));
    DIT_CHECK(dit_json_get_int(root, "d_kv", path, false, 64, 1, big, &c->d_kv, diag));
    DIT_CHECK(dit_json_get_int(root, "num_heads", path, false, kind->n_heads, 1, 4096, &c->n_heads,
                               diag));
    DIT_CHECK(dit_json_get_int(root, "num_layers", path, false, kind->n_layers, 0, 4096,
                               &c->n_layers, diag));
    DIT_CHECK(dit_json_get_int(root, "d_ff", path, false, kind->d_ff, 1, big, &c->d_ff, diag));
    DIT_CHECK(dit_json_get_int(root, "relative_attention_num_buckets", path, false, 32, 4, 1 << 16,
                               &c->n_buckets, diag));
    DIT_CHECK(dit_json_get_int(root, "relative_attention_max_distance", path, false, 128, 1,
                               1 << 30, &c->max_distance, diag));
    DIT_CHECK(dit_json_get_double(root, "layer_norm_epsilon", path, false, 1e-6, &eps, diag));
    DIT_CHECK(dit_json_get_string(root, "feed_forward_proj", path, false, &ffp, diag));
    if (!(eps >= 0.0 && eps < 1.0)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: layer_norm_epsilon = %g is not in [0, 1)",
                          path, eps);
        goto cleanup;
    }
    c->eps = (float)eps;
    if (c->n_heads * c->d_kv > big) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: num_heads * d_kv is implausibly large", path);
        goto cleanup;
    }
    /* The log-spaced buckets need max_exact = num_buckets / 4 >= 1 and a
     * max_distance beyond it; anything else makes transformers' formula
     * divide by log(1) = 0 or index outside the table. */
    if (c->max_distance <= c->n_buckets / 4) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: relative_attention_max_distance %lld must exceed "
                          "relative_attention_num_buckets / 4 = %lld",
                          path, (long long)c->max_distance, (long long)(c->n_buckets / 4));
        goto cleanup;
    }

    /* T5Config (and UMT5Config, the same way): feed_forward_proj is "ACT" or
     * "gated-ACT"; dense_act_fn is its last part, except that "gated-gelu"
     * means gelu_new. Explicit dense_act_fn / is_gated_act keys in
     * config.json override both (the config sets leftover keys after
     * deriving them). */
    if (!ffp)
        ffp = kind->feed_forward_proj;
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
        c->gated = dash != NULL;
        snprintf(act, sizeof act, "%s", dash ? dash + 1 : ffp);
        if (strcmp(ffp, "gated-gelu") == 0)
            snprintf(act, sizeof act, "gelu_new");
    }
    DIT_CHECK(dit_json_get_string(root, "dense_act_fn", path, false, &act_override, diag));
    if (act_override)
        snprintf(act, sizeof act, "%s", act_override);
    if (cJSON_GetObjectItemCaseSensitive(root, "is_gated_act")) {
        DIT_CHECK(
            dit_json_get_bool(root, "is_gated_act", path, false, c->gated, &gated_override, diag));
        c->gated = gated_override;
    }
    if (!dit_encoder_parse_act(act, &c->act, &c->act_relu)) {
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

dit_status dit_t5_check_backend(const dit_backend *be, bool need_fill, bool need_copy,
                                const char *model, dit_diag *diag)
{
    const dit_backend_ops *o = be->ops;
    const dit_encoder_op need[] = {
        DIT_ENCODER_OP(o, embedding),     DIT_ENCODER_OP(o, rms_norm),
        DIT_ENCODER_OP(o, linear),        DIT_ENCODER_OP(o, attention_masked),
        DIT_ENCODER_OP(o, relative_bias), DIT_ENCODER_OP(o, gated_add),
        {!need_fill || o->fill, "fill"}, /* only where the caller uses them */
        {!need_copy || o->copy, "copy"},  DIT_ENCODER_OP(o, upload),
        DIT_ENCODER_OP(o, download),
    };
    return dit_encoder_check_ops(be, need, sizeof need / sizeof need[0], model, diag);
}

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */

static const char *const EMBED_NAMES[2] = {"shared.weight", "encoder.embed_tokens.weight"};

static void weight_list(const dit_t5_config *c, dit_t5_weights *w, const char *embed_name,
                        dit_weight_list *l)
{
    const int64_t Dm = c->d_model, In = c->n_heads * c->d_kv, F = c->d_ff;
    const int64_t sh_vd[2] = {c->vocab, Dm}, sh_id[2] = {In, Dm}, sh_di[2] = {Dm, In};
    const int64_t sh_fd[2] = {F, Dm}, sh_df[2] = {Dm, F}, sh_d[1] = {Dm};
    dit_weight_list_add(l, &w->embed, false, 2, sh_vd, "%s", embed_name);
    for (int64_t i = 0; i < c->n_layers; i++) {
        dit_t5_block *b = &w->blocks[i];
        char p[96];
        snprintf(p, sizeof p, "encoder.block.%lld.layer", (long long)i);
        dit_weight_list_add(l, &b->q, false, 2, sh_id, "%s.0.SelfAttention.q.weight", p);
        dit_weight_list_add(l, &b->k, false, 2, sh_id, "%s.0.SelfAttention.k.weight", p);
        dit_weight_list_add(l, &b->v, false, 2, sh_id, "%s.0.SelfAttention.v.weight", p);
        dit_weight_list_add(l, &b->o, false, 2, sh_di, "%s.0.SelfAttention.o.weight", p);
        dit_weight_list_add(l, &b->ln0, false, 1, sh_d, "%s.0.layer_norm.weight", p);
        if (c->gated) {
            dit_weight_list_add(l, &b->wi0, false, 2, sh_fd, "%s.1.DenseReluDense.wi_0.weight", p);
            dit_weight_list_add(l, &b->wi1, false, 2, sh_fd, "%s.1.DenseReluDense.wi_1.weight", p);
        } else {
            dit_weight_list_add(l, &b->wi, false, 2, sh_fd, "%s.1.DenseReluDense.wi.weight", p);
        }
        dit_weight_list_add(l, &b->wo, false, 2, sh_df, "%s.1.DenseReluDense.wo.weight", p);
        dit_weight_list_add(l, &b->ln1, false, 1, sh_d, "%s.1.layer_norm.weight", p);
    }
    dit_weight_list_add(l, &w->final_w, false, 1, sh_d, "encoder.final_layer_norm.weight");
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
        char got[64];
        dit_tensor_shape_str(&e->view, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s' has shape %s, but config.json implies (%lld, %lld)",
                            e->file, name, got, (long long)n0, (long long)n1);
    }
    *out = e;
    return DIT_OK;
}

dit_status dit_t5_weights_load(dit_backend *be, const dit_st_set *set, const char *dir,
                               const dit_t5_config *c, dit_t5_weights *w, dit_weight_list *list,
                               const char **dup_embed, dit_diag *diag)
{
    *dup_embed = NULL;
    w->blocks = calloc((size_t)c->n_layers + 1, sizeof *w->blocks);
    if (!w->blocks)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
    const bool has[2] = {dit_st_set_find(set, EMBED_NAMES[0]) != NULL,
                         dit_st_set_find(set, EMBED_NAMES[1]) != NULL};
    if (!has[0] && !has[1])
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: the input embedding is missing from the checkpoint (neither '%s' "
                            "nor '%s' is present)",
                            dir, EMBED_NAMES[0], EMBED_NAMES[1]);
    weight_list(c, w, EMBED_NAMES[has[0] ? 0 : 1], list);
    dit_status st = dit_weights_load(be, set, list, false, dir, &w->data, &w->bytes, diag);
    if (st == DIT_OK && has[0] && has[1]) {
        const dit_st_entry *dup;
        st = check_host_tensor(set, dir, EMBED_NAMES[1], c->vocab, c->d_model, &dup, diag);
        *dup_embed = EMBED_NAMES[1];
    }
    return st;
}

void dit_t5_weights_free(dit_backend *be, dit_t5_weights *w)
{
    dit_backend_free(be, w->data);
    free(w->blocks);
    memset(w, 0, sizeof *w);
}

dit_status dit_t5_rel_bias_load(const dit_st_set *set, const char *dir, const dit_t5_config *c,
                                int64_t layer, float *tab, char *name, dit_diag *diag)
{
    const dit_st_entry *e = NULL;
    snprintf(name, DIT_T5_REL_BIAS_NAME_CAP,
             "encoder.block.%lld.layer.0.SelfAttention.relative_attention_bias.weight",
             (long long)layer);
    dit_status st = check_host_tensor(set, dir, name, c->n_buckets, c->n_heads, &e, diag);
    if (st == DIT_OK)
        dit_convert_to_f32(tab, e->view.data, e->view.dtype, (size_t)(c->n_buckets * c->n_heads));
    return st;
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

dit_status dit_t5_rel_tables_load(dit_backend *be, const dit_st_set *set, const char *dir,
                                  const dit_t5_config *c, int64_t n_tables, dit_tensor *tables,
                                  void **buf, char (*names)[DIT_T5_REL_BIAS_NAME_CAP],
                                  dit_diag *diag)
{
    dit_status st = DIT_OK;
    const size_t per = (size_t)(c->n_buckets * c->n_heads);
    *buf = NULL;
    float *host = malloc(sizeof *host * (per * (size_t)n_tables + 1));
    if (!host)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
    for (int64_t i = 0; i < n_tables; i++)
        DIT_CHECK(dit_t5_rel_bias_load(set, dir, c, i, host + per * (size_t)i, names[i], diag));
    const int64_t shape[2] = {n_tables * c->n_buckets, c->n_heads};
    *tables = dit_tensor_make(NULL, DIT_F32, 2, shape);
    if ((st = dit_backend_alloc(be, dit_tensor_nbytes(tables) + 4, buf)) != DIT_OK) {
        st = dit_diag_set(diag, st, "%s: cannot allocate the position bias tables", dir);
        goto cleanup;
    }
    tables->data = *buf;
    const dit_tensor h = dit_tensor_make(host, DIT_F32, 2, shape);
    if ((st = be->ops->upload(be, tables, &h)) != DIT_OK)
        st = dit_diag_set(diag, st, "%s: uploading the position bias tables failed", dir);
cleanup:
    if (st != DIT_OK) {
        dit_backend_free(be, *buf);
        *buf = NULL;
    }
    free(host);
    return st;
}

dit_tensor dit_t5_rel_table_of(const dit_tensor *tables, const dit_t5_config *c, int64_t layer)
{
    return dit_tensor_narrow(tables, 0, layer * c->n_buckets, c->n_buckets);
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

dit_status dit_t5_op_failed(dit_diag *diag, dit_status st, const char *what, const char *call)
{
    return dit_diag_set(diag, st, "%s: %s failed: %s", what, call, dit_status_str(st));
}

dit_status dit_t5_check_forward_args(const int32_t *ids, int64_t B, int64_t S,
                                     const dit_tensor *out, int64_t d_model, const char *what,
                                     dit_diag *diag)
{
    if (!ids || B < 1 || S < 1 || S > (1 << 20))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s: need ids of shape (B >= 1, 1 <= S <= 2^20), got (%lld, %lld)",
                            what, (long long)B, (long long)S);
    if (!out || out->dtype != DIT_F32 || out->ndim != 3 || out->ne[0] != B || out->ne[1] != S ||
        out->ne[2] != d_model || !dit_tensor_rows_dense(out)) {
        char got[64] = "NULL";
        if (out)
            dit_tensor_shape_str(out, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s: output is %s, expected (%lld, %lld, %lld) f32 with dense rows",
                            what, got, (long long)B, (long long)S, (long long)d_model);
    }
    return DIT_OK;
}

dit_status dit_t5_forward_begin(dit_backend *be, dit_arena *arena, const dit_t5_config *c,
                                const dit_t5_weights *w, const int32_t *ids, int64_t B, int64_t S,
                                const char *what, dit_t5_scratch *s, dit_diag *diag)
{
    dit_status st = DIT_OK;
    const int64_t Dm = c->d_model, H = c->n_heads, Dk = c->d_kv, In = H * Dk, F = c->d_ff;
    memset(s, 0, sizeof *s);
    s->arena = arena;
    s->mark = dit_arena_get_mark(arena);
    s->B = B;
    s->S = S;

#define ALLOC(t, nd, ...)                                                                          \
    do {                                                                                           \
        const int64_t shp_[] = {__VA_ARGS__};                                                      \
        st = dit_arena_tensor(arena, DIT_F32, nd, shp_, &(t));                                     \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "%s: activation memory exhausted", what);                  \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

    ALLOC(s->x, 3, B, S, Dm);
    ALLOC(s->n, 3, B, S, Dm);
    ALLOC(s->qkv, 3, B, S, 3 * In);
    ALLOC(s->attn, 3, B, S, In);
    ALLOC(s->o, 3, B, S, Dm);
    ALLOC(s->h0, 3, B, S, F);
    if (c->gated) {
        ALLOC(s->h1, 3, B, S, F);
        ALLOC(s->prod, 3, B, S, F);
    }
    if (c->n_layers > 0)
        ALLOC(s->bias, 3, H, S, S);
#undef ALLOC
    s->q = dit_tensor_narrow(&s->qkv, 2, 0, In);
    s->k = dit_tensor_narrow(&s->qkv, 2, In, In);
    s->v = dit_tensor_narrow(&s->qkv, 2, 2 * In, In);
    s->q4 = dit_tensor_split_last(&s->q, Dk);
    s->k4 = dit_tensor_split_last(&s->k, Dk);
    s->v4 = dit_tensor_split_last(&s->v, Dk);
    s->a4 = dit_tensor_split_last(&s->attn, Dk);

    {
        dit_tensor x2 = dit_tensor_2d(s->x.data, DIT_F32, B * S, Dm);
        DIT_T5_OP(be->ops->embedding(be, &x2, &w->embed, ids, B * S));
    }
    if (c->n_layers > 0) {
        s->buckets = malloc(sizeof *s->buckets * (size_t)(2 * S - 1));
        if (!s->buckets) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", what);
            goto cleanup;
        }
        /* One bucket per relative position -(S-1) .. S-1. */
        for (int64_t r = -(S - 1); r <= S - 1; r++)
            s->buckets[r + S - 1] =
                dit_t5_relative_bucket(r, (int)c->n_buckets, (int)c->max_distance);
    }
cleanup:
    if (st != DIT_OK)
        dit_t5_forward_end(s);
    return st;
}

void dit_t5_forward_end(dit_t5_scratch *s)
{
    dit_arena_release(s->arena, s->mark);
    free(s->buckets);
    s->buckets = NULL;
}

dit_status dit_t5_block_attn_in(dit_backend *be, const dit_t5_config *c, const dit_t5_block *b,
                                dit_t5_scratch *s, const char *what, dit_diag *diag)
{
    dit_status st = DIT_OK;
    DIT_T5_OP(be->ops->rms_norm(be, &s->n, &s->x, &b->ln0, c->eps));
    DIT_T5_OP(be->ops->linear(be, &s->q, &s->n, &b->q, NULL, DIT_ACT_NONE, 0.0f));
    DIT_T5_OP(be->ops->linear(be, &s->k, &s->n, &b->k, NULL, DIT_ACT_NONE, 0.0f));
    DIT_T5_OP(be->ops->linear(be, &s->v, &s->n, &b->v, NULL, DIT_ACT_NONE, 0.0f));
cleanup:
    return st;
}

dit_status dit_t5_block_attn_out_ffn(dit_backend *be, const dit_t5_config *c, const dit_t5_block *b,
                                     dit_t5_scratch *s, const char *what, dit_diag *diag)
{
    dit_status st = DIT_OK;
    const int64_t rows = s->B * s->S, F = c->d_ff;
    /* x = x + o(attn) */
    DIT_T5_OP(be->ops->linear(be, &s->o, &s->attn, &b->o, NULL, DIT_ACT_NONE, 0.0f));
    DIT_T5_OP(be->ops->gated_add(be, &s->x, &s->o, NULL));
    /* x = x + wo(FFN(RMS1(x))) */
    DIT_T5_OP(be->ops->rms_norm(be, &s->n, &s->x, &b->ln1, c->eps));
    const dit_tensor *ffn_out = &s->h0;
    if (c->gated) {
        DIT_T5_OP(be->ops->linear(be, &s->h0, &s->n, &b->wi0, NULL, c->act, 0.0f));
        if (c->act_relu)
            DIT_T5_OP(dit_encoder_relu_on_host(be, &s->h0));
        DIT_T5_OP(be->ops->linear(be, &s->h1, &s->n, &b->wi1, NULL, DIT_ACT_NONE, 0.0f));
        /* prod = h0 * h1 elementwise, with the ops at hand: gated_add
         * computes res += gate * x with one gate row per batch entry, so
         * viewing the B*S rows as B*S batch entries of one token makes it
         * elementwise; res starts at 0, and 0 + g*x rounds like g*x. */
        dit_tensor pr = dit_tensor_3d(s->prod.data, DIT_F32, rows, 1, F);
        dit_tensor xr = dit_tensor_3d(s->h1.data, DIT_F32, rows, 1, F);
        dit_tensor gr = dit_tensor_2d(s->h0.data, DIT_F32, rows, F);
        DIT_T5_OP(be->ops->fill(be, &s->prod, 0.0f));
        DIT_T5_OP(be->ops->gated_add(be, &pr, &xr, &gr));
        ffn_out = &s->prod;
    } else {
        DIT_T5_OP(be->ops->linear(be, &s->h0, &s->n, &b->wi, NULL, c->act, 0.0f));
        if (c->act_relu)
            DIT_T5_OP(dit_encoder_relu_on_host(be, &s->h0));
    }
    DIT_T5_OP(be->ops->linear(be, &s->o, ffn_out, &b->wo, NULL, DIT_ACT_NONE, 0.0f));
    DIT_T5_OP(be->ops->gated_add(be, &s->x, &s->o, NULL));
cleanup:
    return st;
}

dit_status dit_t5_final_norm(dit_backend *be, const dit_t5_config *c, const dit_t5_weights *w,
                             dit_t5_scratch *s, const dit_tensor *out, const char *what,
                             dit_diag *diag)
{
    dit_status st = DIT_OK;
    DIT_T5_OP(be->ops->rms_norm(be, out, &s->x, &w->final_w, c->eps));
cleanup:
    return st;
}
