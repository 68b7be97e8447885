/* T5EncoderModel on the backend interface. See t5_encoder.h for the forward
 * pass; what it shares with UMT5EncoderModel (config, weights, the layer
 * code around attention) is in t5_common.c. What is T5's own is here: one
 * relative_attention_bias, block 0's, applied in every block, and no
 * attention mask. */
#include "encoders/t5_encoder.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "encoders/encoder_common.h"
#include "encoders/t5_common.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

struct dit_t5_encoder {
    dit_backend *be;
    dit_t5_config c;
    dit_t5_weights w; /* all inside one backend allocation */
    /* Block 0's relative_attention_bias (n_buckets, H) on the backend, f32
     * at full checkpoint precision (its own allocation, rel_buf): each
     * forward's (H, S, S) bias is built from it there. */
    dit_tensor rel_table;
    void *rel_buf;
};

static const dit_t5_config_kind T5_CONFIG = {
    .model_type = "t5",
    .model = "T5EncoderModel",
    .holder = "FluxPipeline's text_encoder_2/",
    /* T5Config's defaults */
    .vocab = 32128,
    .n_heads = 8,
    .n_layers = 6,
    .d_ff = 2048,
    .feed_forward_proj = "relu",
};

dit_status dit_t5_encoder_load(dit_backend *be, const char *dir, dit_t5_encoder **out,
                               dit_diag *diag)
{
    char path[4096], rel_name[1][DIT_T5_REL_BIAS_NAME_CAP];
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
    DIT_CHECK(dit_t5_config_load(path, &T5_CONFIG, &m->c, diag));
    DIT_CHECK(dit_t5_check_backend(be, m->c.gated, false, T5_CONFIG.model, diag));
    DIT_CHECK(dit_st_set_open_dir(dir, "model", &set, diag));

    const char *extra[2] = {NULL, NULL};
    DIT_CHECK(dit_t5_weights_load(be, set, dir, &m->c, &m->w, &list, &extra[0], diag));
    if (m->c.n_layers > 0) {
        DIT_CHECK(dit_t5_rel_tables_load(be, set, dir, &m->c, 1, &m->rel_table, &m->rel_buf,
                                         rel_name, diag));
        extra[1] = rel_name[0];
    }
    /* The decoder of a full T5 checkpoint is ignored, as T5EncoderModel
     * ignores it. */
    DIT_CHECK(
        dit_encoder_check_unexpected(set, &list, "decoder.", extra, 2, T5_CONFIG.model, diag));
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
    dit_t5_weights_free(m->be, &m->w);
    dit_backend_free(m->be, m->rel_buf);
    free(m);
}

int dit_t5_encoder_d_model(const dit_t5_encoder *m)
{
    return (int)m->c.d_model;
}

/* dit_t5_relative_bucket is in t5_common.c, with the bias it indexes. */

dit_status dit_t5_encoder_forward(dit_t5_encoder *m, dit_arena *arena, const int32_t *ids,
                                  int64_t B, int64_t S, const dit_tensor *out, dit_diag *diag)
{
    static const char what[] = "t5 encoder forward";
    dit_backend *be = m->be;
    const dit_t5_config *c = &m->c;
    dit_t5_scratch s;

    dit_status st = dit_t5_check_forward_args(ids, B, S, out, c->d_model, what, diag);
    if (st == DIT_OK)
        st = dit_encoder_check_ids(ids, B, S, c->vocab, what, diag);
    if (st == DIT_OK)
        st = dit_t5_forward_begin(be, arena, c, &m->w, ids, B, S, what, &s, diag);
    if (st != DIT_OK)
        return st;
    if (c->n_layers > 0) {
        /* Block 0's table serves every block: one (H, S, S) bias, built
         * once per forward. */
        DIT_T5_OP(be->ops->relative_bias(be, &s.bias, &m->rel_table, s.buckets));
    }
    for (int64_t i = 0; i < c->n_layers; i++) {
        const dit_t5_block *b = &m->w.blocks[i];
        DIT_CHECK(dit_t5_block_attn_in(be, c, b, &s, what, diag));
        /* Scale 1: T5 folds 1/sqrt(d_kv) into its weights' initialisation.
         * No mask: FluxPipeline passes none, so padding tokens attend too. */
        DIT_T5_OP(be->ops->attention_masked(be, &s.a4, &s.q4, &s.k4, &s.v4, 1.0f, &s.bias, false));
        DIT_CHECK(dit_t5_block_attn_out_ffn(be, c, b, &s, what, diag));
    }
    DIT_CHECK(dit_t5_final_norm(be, c, &m->w, &s, out, what, diag));
cleanup:
    dit_t5_forward_end(&s);
    return st;
}
