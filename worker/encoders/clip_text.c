/* CLIPTextModel on the backend interface. See clip_text.h for the forward
 * pass; the comments here explain where it has to follow transformers'
 * exact behaviour. */
#include "encoders/clip_text.h"

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

typedef struct clip_layer {
    dit_tensor q_w, k_w, v_w, o_w;         /* (C, C) */
    dit_tensor q_b, k_b, v_b, o_b;         /* (C) */
    dit_tensor ln1_w, ln1_b, ln2_w, ln2_b; /* (C) */
    dit_tensor fc1_w, fc1_b;               /* (I, C), (I) */
    dit_tensor fc2_w, fc2_b;               /* (C, I), (C) */
} clip_layer;

struct dit_clip_text {
    dit_backend *be;
    /* config.json */
    int64_t vocab, hidden, inter, n_layers, n_heads, max_pos, eos_id;
    float eps;
    dit_act act;   /* hidden_act, when the backend has it */
    bool act_relu; /* hidden_act "relu": applied on the host (no backend op) */
    /* weights, all inside one backend allocation */
    void *weights;
    size_t weight_bytes;
    dit_tensor tok_emb; /* (V, C) */
    dit_tensor pos_emb; /* (P, C) */
    dit_tensor final_w, final_b;
    clip_layer *layers;
};

static dit_status clip_config_load(const char *path, dit_clip_text *m, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    const char *type = NULL, *act = NULL;
    double eps = 0;
    const int64_t big = 1 << 20;

    DIT_CHECK(dit_json_get_string(root, "model_type", path, false, &type, diag));
    if (type && strcmp(type, "clip_text_model") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: model_type is \"%s\"; this loader reads a CLIPTextModel "
                          "(\"clip_text_model\"), as FluxPipeline's text_encoder/ holds",
                          path, type);
        goto cleanup;
    }
    /* Missing keys take CLIPTextConfig's defaults, as transformers does. */
    DIT_CHECK(
        dit_json_get_int(root, "vocab_size", path, false, 49408, 1, 1 << 24, &m->vocab, diag));
    DIT_CHECK(dit_json_get_int(root, "hidden_size", path, false, 512, 1, big, &m->hidden, diag));
    DIT_CHECK(
        dit_json_get_int(root, "intermediate_size", path, false, 2048, 1, big, &m->inter, diag));
    DIT_CHECK(
        dit_json_get_int(root, "num_hidden_layers", path, false, 12, 0, 4096, &m->n_layers, diag));
    DIT_CHECK(
        dit_json_get_int(root, "num_attention_heads", path, false, 8, 1, big, &m->n_heads, diag));
    DIT_CHECK(dit_json_get_int(root, "max_position_embeddings", path, false, 77, 1, big,
                               &m->max_pos, diag));
    DIT_CHECK(dit_json_get_int(root, "eos_token_id", path, false, 49407, INT32_MIN, INT32_MAX,
                               &m->eos_id, diag));
    DIT_CHECK(dit_json_get_double(root, "layer_norm_eps", path, false, 1e-5, &eps, diag));
    DIT_CHECK(dit_json_get_string(root, "hidden_act", path, false, &act, diag));
    if (!(eps >= 0.0 && eps < 1.0)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: layer_norm_eps = %g is not in [0, 1)", path,
                          eps);
        goto cleanup;
    }
    m->eps = (float)eps;
    if (m->hidden % m->n_heads != 0) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: hidden_size %lld is not divisible by num_attention_heads %lld", path,
                          (long long)m->hidden, (long long)m->n_heads);
        goto cleanup;
    }
    if (!act)
        act = "quick_gelu";
    if (!dit_encoder_parse_act(act, &m->act, &m->act_relu)) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: hidden_act \"%s\" is not supported (quick_gelu, gelu, gelu_new, "
                          "gelu_pytorch_tanh, silu, relu are)",
                          path, act);
        goto cleanup;
    }
cleanup:
    cJSON_Delete(root);
    return st;
}

/* The parameter table. `pre` is "" or "text_model.". */
static void clip_weight_list(dit_clip_text *m, const char *pre, dit_weight_list *l)
{
    const int64_t C = m->hidden, I = m->inter;
    const int64_t sh_vc[2] = {m->vocab, C}, sh_pc[2] = {m->max_pos, C};
    const int64_t sh_cc[2] = {C, C}, sh_ic[2] = {I, C}, sh_ci[2] = {C, I};
    const int64_t sh_c[1] = {C}, sh_i[1] = {I};
    dit_weight_list_add(l, &m->tok_emb, false, 2, sh_vc, "%sembeddings.token_embedding.weight",
                        pre);
    dit_weight_list_add(l, &m->pos_emb, false, 2, sh_pc, "%sembeddings.position_embedding.weight",
                        pre);
    for (int64_t i = 0; i < m->n_layers; i++) {
        clip_layer *L = &m->layers[i];
        char p[96];
        snprintf(p, sizeof p, "%sencoder.layers.%lld", pre, (long long)i);
        struct {
            dit_tensor *w, *b;
            const char *name;
            const int64_t *shw, *shb;
        } lin[] = {
            {&L->q_w, &L->q_b, "self_attn.q_proj", sh_cc, sh_c},
            {&L->k_w, &L->k_b, "self_attn.k_proj", sh_cc, sh_c},
            {&L->v_w, &L->v_b, "self_attn.v_proj", sh_cc, sh_c},
            {&L->o_w, &L->o_b, "self_attn.out_proj", sh_cc, sh_c},
            {&L->ln1_w, &L->ln1_b, "layer_norm1", NULL, sh_c},
            {&L->fc1_w, &L->fc1_b, "mlp.fc1", sh_ic, sh_i},
            {&L->fc2_w, &L->fc2_b, "mlp.fc2", sh_ci, sh_c},
            {&L->ln2_w, &L->ln2_b, "layer_norm2", NULL, sh_c},
        };
        for (size_t k = 0; k < sizeof lin / sizeof lin[0]; k++) {
            if (lin[k].shw)
                dit_weight_list_add(l, lin[k].w, false, 2, lin[k].shw, "%s.%s.weight", p,
                                    lin[k].name);
            else /* LayerNorm: weight (C) */
                dit_weight_list_add(l, lin[k].w, false, 1, sh_c, "%s.%s.weight", p, lin[k].name);
            dit_weight_list_add(l, lin[k].b, false, 1, lin[k].shb, "%s.%s.bias", p, lin[k].name);
        }
    }
    dit_weight_list_add(l, &m->final_w, false, 1, sh_c, "%sfinal_layer_norm.weight", pre);
    dit_weight_list_add(l, &m->final_b, false, 1, sh_c, "%sfinal_layer_norm.bias", pre);
}

static dit_status check_backend(const dit_backend *be, dit_diag *diag)
{
    const dit_backend_ops *o = be->ops;
    const dit_encoder_op need[] = {
        DIT_ENCODER_OP(o, embedding), DIT_ENCODER_OP(o, layer_norm),
        DIT_ENCODER_OP(o, linear),    DIT_ENCODER_OP(o, attention_masked),
        DIT_ENCODER_OP(o, gated_add), DIT_ENCODER_OP(o, copy),
        DIT_ENCODER_OP(o, upload),    DIT_ENCODER_OP(o, download),
    };
    return dit_encoder_check_ops(be, need, sizeof need / sizeof need[0], "CLIPTextModel", diag);
}

dit_status dit_clip_text_load(dit_backend *be, const char *dir, dit_clip_text **out, dit_diag *diag)
{
    char path[4096];
    dit_status st;
    dit_st_set *set = NULL;
    dit_weight_list list;
    memset(&list, 0, sizeof list);
    *out = NULL;
    dit_clip_text *m = calloc(1, sizeof *m);
    if (!m)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
    m->be = be;

    DIT_CHECK(check_backend(be, diag));
    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(clip_config_load(path, m, diag));
    m->layers = calloc((size_t)m->n_layers + 1, sizeof *m->layers);
    if (!m->layers) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
        goto cleanup;
    }
    DIT_CHECK(dit_st_set_open_dir(dir, "model", &set, diag));
    /* transformers 4.x (and FLUX.1's checkpoint) nest the model under
     * "text_model."; transformers 5 saves it flat. */
    const char *pre =
        dit_st_set_find(set, "text_model.embeddings.token_embedding.weight") ? "text_model." : "";
    clip_weight_list(m, pre, &list);
    DIT_CHECK(dit_weights_load(be, set, &list, false, dir, &m->weights, &m->weight_bytes, diag));
    {
        /* The position_ids buffer older transformers versions saved is not
         * a parameter. */
        char ignored[64];
        snprintf(ignored, sizeof ignored, "%sembeddings.position_ids", pre);
        const char *const extra[1] = {ignored};
        DIT_CHECK(dit_encoder_check_unexpected(set, &list, NULL, extra, 1, "CLIPTextModel", diag));
    }
    *out = m;
    m = NULL;
cleanup:
    dit_weight_list_free(&list);
    dit_st_set_close(set);
    dit_clip_text_free(m);
    return st;
}

void dit_clip_text_free(dit_clip_text *m)
{
    if (!m)
        return;
    dit_backend_free(m->be, m->weights);
    free(m->layers);
    free(m);
}

int dit_clip_text_hidden_size(const dit_clip_text *m)
{
    return (int)m->hidden;
}

int dit_clip_text_max_length(const dit_clip_text *m)
{
    return (int)m->max_pos;
}

void dit_clip_text_eos_positions(const dit_clip_text *m, const int32_t *ids, int64_t B, int64_t S,
                                 int64_t *pos)
{
    for (int64_t b = 0; b < B; b++) {
        const int32_t *row = ids + b * S;
        int64_t best = 0;
        if (m->eos_id == 2) {
            /* Legacy rule (configs from before transformers PR #24773, such
             * as FLUX.1's): argmax of the ids, i.e. the first occurrence of
             * the largest id; CLIP's EOS is the largest id of its vocabulary. */
            for (int64_t s = 1; s < S; s++)
                if (row[s] > row[best])
                    best = s;
        } else {
            /* The first position holding eos_token_id. With no EOS in the
             * row, transformers' argmax over an all-zero mask gives 0. */
            for (int64_t s = 0; s < S; s++) {
                if (row[s] == m->eos_id) {
                    best = s;
                    break;
                }
            }
        }
        pos[b] = best;
    }
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

#define BE(call)                                                                                   \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "clip text forward: %s failed: %s", #call,                 \
                              dit_status_str(st));                                                 \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

static dit_status check_out(const dit_tensor *t, int ndim, const int64_t *want, const char *name,
                            dit_diag *diag)
{
    bool ok = t->dtype == DIT_F32 && t->ndim == ndim && dit_tensor_rows_dense(t);
    for (int i = 0; ok && i < ndim; i++)
        ok = t->ne[i] == want[i];
    if (ok)
        return DIT_OK;
    char got[64];
    dit_tensor_shape_str(t, got, sizeof got);
    if (ndim == 2)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "clip text forward: output '%s' is %s, expected (%lld, %lld) f32 with "
                            "dense rows",
                            name, got, (long long)want[0], (long long)want[1]);
    return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                        "clip text forward: output '%s' is %s, expected (%lld, %lld, %lld) f32 "
                        "with dense rows",
                        name, got, (long long)want[0], (long long)want[1], (long long)want[2]);
}

dit_status dit_clip_text_forward(dit_clip_text *m, dit_arena *arena, const int32_t *ids, int64_t B,
                                 int64_t S, const dit_tensor *pooled, const dit_tensor *hidden,
                                 dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = m->be;
    const int64_t C = m->hidden, I = m->inter, H = m->n_heads, D = C / H;
    int32_t *pos_ids = NULL;
    int64_t *eos = NULL;

    if (!ids || B < 1 || S < 1 || S > m->max_pos)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "clip text forward: need ids of shape (B >= 1, 1 <= S <= %lld), got "
                            "(%lld, %lld)",
                            (long long)m->max_pos, (long long)B, (long long)S);
    {
        const int64_t sh_p[2] = {B, C}, sh_h[3] = {B, S, C};
        if (!pooled)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "clip text forward: pooled is NULL");
        st = check_out(pooled, 2, sh_p, "pooled", diag);
        if (st == DIT_OK && hidden)
            st = check_out(hidden, 3, sh_h, "hidden", diag);
        if (st != DIT_OK)
            return st;
    }
    st = dit_encoder_check_ids(ids, B, S, m->vocab, "clip text forward", diag);
    if (st != DIT_OK)
        return st;

    const dit_arena_mark mark = dit_arena_get_mark(arena);
    pos_ids = malloc(sizeof *pos_ids * (size_t)(B * S));
    eos = malloc(sizeof *eos * (size_t)B);
    if (!pos_ids || !eos) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "clip text forward: out of memory");
        goto cleanup;
    }
    for (int64_t i = 0; i < B * S; i++)
        pos_ids[i] = (int32_t)(i % S);
    dit_clip_text_eos_positions(m, ids, B, S, eos);

#define ALLOC(t, nd, ...)                                                                          \
    do {                                                                                           \
        const int64_t shp_[] = {__VA_ARGS__};                                                      \
        st = dit_arena_tensor(arena, DIT_F32, nd, shp_, &(t));                                     \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "clip text forward: activation memory exhausted");         \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

    dit_tensor x, n, qkv, attn, o, h, last;
    ALLOC(x, 3, B, S, C);       /* residual stream */
    ALLOC(n, 3, B, S, C);       /* LayerNorm output */
    ALLOC(qkv, 3, B, S, 3 * C); /* [q | k | v] */
    ALLOC(attn, 3, B, S, C);
    ALLOC(o, 3, B, S, C); /* a sub-block's output before the residual add */
    ALLOC(h, 3, B, S, I); /* MLP hidden */
    if (hidden)
        last = *hidden;
    else
        ALLOC(last, 3, B, S, C);
#undef ALLOC

    /* Embeddings: token rows plus position rows 0..S-1 (the position table is
     * gathered too, since weights may be stored in a narrower dtype). */
    {
        dit_tensor x2 = dit_tensor_2d(x.data, DIT_F32, B * S, C);
        dit_tensor o2 = dit_tensor_2d(o.data, DIT_F32, B * S, C);
        BE(be->ops->embedding(be, &x2, &m->tok_emb, ids, B * S));
        BE(be->ops->embedding(be, &o2, &m->pos_emb, pos_ids, B * S));
        BE(be->ops->gated_add(be, &x, &o, NULL));
    }

    const float scale = (float)(1.0 / sqrt((double)D));
    dit_tensor q = dit_tensor_narrow(&qkv, 2, 0, C);
    dit_tensor k = dit_tensor_narrow(&qkv, 2, C, C);
    dit_tensor v = dit_tensor_narrow(&qkv, 2, 2 * C, C);
    dit_tensor q4 = dit_tensor_split_last(&q, D), k4 = dit_tensor_split_last(&k, D);
    dit_tensor v4 = dit_tensor_split_last(&v, D), a4 = dit_tensor_split_last(&attn, D);
    for (int64_t i = 0; i < m->n_layers; i++) {
        const clip_layer *L = &m->layers[i];
        /* x = x + out_proj(attn(LN1(x))): the sub-block output goes to its own
         * buffer and is then added, the order transformers rounds in. */
        BE(be->ops->layer_norm(be, &n, &x, &L->ln1_w, &L->ln1_b, m->eps));
        BE(be->ops->linear(be, &q, &n, &L->q_w, &L->q_b, DIT_ACT_NONE, 0.0f));
        BE(be->ops->linear(be, &k, &n, &L->k_w, &L->k_b, DIT_ACT_NONE, 0.0f));
        BE(be->ops->linear(be, &v, &n, &L->v_w, &L->v_b, DIT_ACT_NONE, 0.0f));
        /* The causal mask always leaves key 0 visible, so transformers'
         * finite "min float" mask and a -inf mask give the same softmax. */
        BE(be->ops->attention_masked(be, &a4, &q4, &k4, &v4, scale, NULL, true));
        BE(be->ops->linear(be, &o, &attn, &L->o_w, &L->o_b, DIT_ACT_NONE, 0.0f));
        BE(be->ops->gated_add(be, &x, &o, NULL));
        /* x = x + fc2(act(fc1(LN2(x)))) */
        BE(be->ops->layer_norm(be, &n, &x, &L->ln2_w, &L->ln2_b, m->eps));
        BE(be->ops->linear(be, &h, &n, &L->fc1_w, &L->fc1_b, m->act, 0.0f));
        if (m->act_relu)
            BE(dit_encoder_relu_on_host(be, &h));
        BE(be->ops->linear(be, &o, &h, &L->fc2_w, &L->fc2_b, DIT_ACT_NONE, 0.0f));
        BE(be->ops->gated_add(be, &x, &o, NULL));
    }
    BE(be->ops->layer_norm(be, &last, &x, &m->final_w, &m->final_b, m->eps));

    /* pooler_output[b] = last_hidden_state[b, eos[b]] */
    for (int64_t b = 0; b < B; b++) {
        dit_tensor src =
            dit_tensor_2d((char *)last.data + b * last.nb[0] + eos[b] * last.nb[1], DIT_F32, 1, C);
        dit_tensor dst = dit_tensor_narrow(pooled, 0, b, 1);
        BE(be->ops->copy(be, &dst, &src));
    }
cleanup:
    dit_arena_release(arena, mark);
    free(pos_ids);
    free(eos);
    return st;
}
