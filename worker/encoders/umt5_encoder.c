/* UMT5EncoderModel on the backend interface. See umt5_encoder.h for the
 * forward pass; where it equals T5's (config, weights, the layer code
 * around attention, the bucket arithmetic), t5_common.c has it. What is
 * UMT5's own is here: a relative_attention_bias per block, the attention
 * mask, and WanPipeline's prompt -> prompt_embeds path. */
#include "encoders/umt5_encoder.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "encoders/encoder_common.h"
#include "encoders/prompt_clean.h"
#include "encoders/t5_common.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

struct dit_umt5_encoder {
    dit_backend *be;
    dit_t5_config c;
    dit_t5_weights w; /* all inside one backend allocation */
    /* Every block's own relative_attention_bias (n_buckets, H): n_layers
     * tables in one backend allocation (rel_buf), f32 at full checkpoint
     * precision; each layer's bias is built from its table there. */
    dit_tensor rel_tables;
    void *rel_buf;
};

static const dit_t5_config_kind UMT5_CONFIG = {
    .model_type = "umt5",
    .model = "UMT5EncoderModel",
    .holder = "WanPipeline's text_encoder/",
    /* UMT5Config's defaults */
    .vocab = 250112,
    .n_heads = 6,
    .n_layers = 8,
    .d_ff = 1024,
    .feed_forward_proj = "gated-gelu",
};

dit_status dit_umt5_encoder_load(dit_backend *be, const char *dir, dit_umt5_encoder **out,
                                 dit_diag *diag)
{
    char path[4096];
    dit_status st;
    dit_st_set *set = NULL;
    dit_weight_list list;
    const char **extra = NULL;
    char(*names)[DIT_T5_REL_BIAS_NAME_CAP] = NULL;
    memset(&list, 0, sizeof list);
    *out = NULL;
    dit_umt5_encoder *m = calloc(1, sizeof *m);
    if (!m)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
    m->be = be;

    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(dit_t5_config_load(path, &UMT5_CONFIG, &m->c, diag));
    DIT_CHECK(dit_t5_check_backend(be, true, true, UMT5_CONFIG.model, diag));
    const int64_t L = m->c.n_layers;
    /* extra: each layer's bias table name, then a second embedding copy. */
    extra = calloc((size_t)L + 1, sizeof *extra);
    names = calloc((size_t)L + 1, sizeof *names);
    if (!extra || !names) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
        goto cleanup;
    }
    DIT_CHECK(dit_st_set_open_dir(dir, "model", &set, diag));

    DIT_CHECK(dit_t5_weights_load(be, set, dir, &m->c, &m->w, &list, &extra[L], diag));
    /* Every layer's own relative_attention_bias (UMT5Attention is built
     * with has_relative_attention_bias=True in every block). */
    if (L > 0)
        DIT_CHECK(dit_t5_rel_tables_load(be, set, dir, &m->c, L, &m->rel_tables, &m->rel_buf, names,
                                         diag));
    for (int64_t i = 0; i < L; i++)
        extra[i] = names[i];
    /* Strict: unlike T5EncoderModel's loader, decoder tensors are errors
     * too (a text_encoder/ folder holds the encoder only). */
    DIT_CHECK(dit_encoder_check_unexpected(set, &list, NULL, extra, (size_t)L + 1,
                                           UMT5_CONFIG.model, diag));
    *out = m;
    m = NULL;
cleanup:
    free(names);
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
    dit_t5_weights_free(m->be, &m->w);
    dit_backend_free(m->be, m->rel_buf);
    free(m);
}

int dit_umt5_encoder_d_model(const dit_umt5_encoder *m)
{
    return (int)m->c.d_model;
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

dit_status dit_umt5_encoder_forward(dit_umt5_encoder *m, dit_arena *arena, const int32_t *ids,
                                    const int32_t *lengths, int64_t B, int64_t S,
                                    const dit_tensor *out, dit_diag *diag)
{
    static const char what[] = "umt5 encoder forward";
    dit_backend *be = m->be;
    const dit_t5_config *c = &m->c;
    const int64_t H = c->n_heads;
    dit_t5_scratch s;

    dit_status st = dit_t5_check_forward_args(ids, B, S, out, c->d_model, what, diag);
    if (st != DIT_OK)
        return st;
    for (int64_t b = 0; lengths && b < B; b++)
        if (lengths[b] < 1 || lengths[b] > S)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s: lengths[%lld] = %d is not in [1, %lld] (every row needs an "
                                "unmasked token)",
                                what, (long long)b, (int)lengths[b], (long long)S);
    st = dit_encoder_check_ids(ids, B, S, c->vocab, what, diag);
    if (st == DIT_OK)
        st = dit_t5_forward_begin(be, arena, c, &m->w, ids, B, S, what, &s, diag);
    if (st != DIT_OK)
        return st;
    for (int64_t i = 0; i < c->n_layers; i++) {
        const dit_t5_block *blk = &m->w.blocks[i];
        const dit_tensor tab = dit_t5_rel_table_of(&m->rel_tables, c, i); /* this layer's own */
        DIT_CHECK(dit_t5_block_attn_in(be, c, blk, &s, what, diag));
        /* One attention call per run of batch entries with the same number
         * of unmasked keys nk: keys narrowed to [0, nk), this layer's bias
         * built for (H, S, nk) in s.bias viewed as such. Scale 1, as T5. */
        for (int64_t b0 = 0; b0 < B;) {
            const int64_t nk = lengths ? lengths[b0] : S;
            int64_t b1 = b0 + 1;
            while (b1 < B && (lengths ? lengths[b1] : S) == nk)
                b1++;
            dit_tensor bv = dit_tensor_3d(s.bias.data, DIT_F32, H, S, nk);
            DIT_T5_OP(be->ops->relative_bias(be, &bv, &tab, s.buckets));
            dit_tensor qb = dit_tensor_narrow(&s.q4, 0, b0, b1 - b0);
            dit_tensor kb = dit_tensor_narrow(&s.k4, 0, b0, b1 - b0);
            dit_tensor vb = dit_tensor_narrow(&s.v4, 0, b0, b1 - b0);
            dit_tensor ab = dit_tensor_narrow(&s.a4, 0, b0, b1 - b0);
            kb = dit_tensor_narrow(&kb, 1, 0, nk);
            vb = dit_tensor_narrow(&vb, 1, 0, nk);
            DIT_T5_OP(be->ops->attention_masked(be, &ab, &qb, &kb, &vb, 1.0f, &bv, false));
            b0 = b1;
        }
        DIT_CHECK(dit_t5_block_attn_out_ffn(be, c, blk, &s, what, diag));
    }
    DIT_CHECK(dit_t5_final_norm(be, c, &m->w, &s, out, what, diag));
cleanup:
    dit_t5_forward_end(&s);
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
    const int64_t L = max_sequence_length, Dm = m->c.d_model;
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
            truncated[b] = true;
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
