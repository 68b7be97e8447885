#include "runtime/inputs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/safetensors.h"

enum { IN_HS, IN_EHS, IN_POOL, IN_T, IN_IMG, IN_TXT, IN_G, IN_COUNT };

static const char *const input_names[IN_COUNT] = {
    "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
    "img_ids",       "txt_ids",               "guidance",
};

struct dit_input_file {
    float *data[IN_COUNT];
    dit_forward_inputs in;
};

static dit_status check_names(const dit_st_set *set, const char *path, dit_diag *diag)
{
    for (size_t i = 0; i < dit_st_set_count(set); i++) {
        const char *name = dit_st_set_at(set, i)->name;
        bool known = false;
        for (int k = 0; k < IN_COUNT; k++)
            known = known || strcmp(name, input_names[k]) == 0;
        if (!known)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s: unknown input '%s' (expected hidden_states, "
                                "encoder_hidden_states, pooled_projections, timestep, img_ids, "
                                "txt_ids, guidance)",
                                path, name);
    }
    return DIT_OK;
}

static dit_status need(const dit_st_set *set, const char *path, int which, int ndim_a,
                       int ndim_b, const dit_st_entry **out, dit_diag *diag)
{
    const dit_st_entry *e = dit_st_set_find(set, input_names[which]);
    *out = e;
    if (!e)
        return which == IN_G ? DIT_OK
                             : dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is missing",
                                            path, input_names[which]);
    if (e->view.ndim != ndim_a && e->view.ndim != ndim_b) {
        char got[64];
        dit_tensor_shape_str(&e->view, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is %s; expected %d dims",
                            path, input_names[which], got, ndim_a);
    }
    return DIT_OK;
}

dit_status dit_input_file_peek(const char *path, int64_t *batch, int64_t *img_tokens,
                               int64_t *txt_tokens, dit_diag *diag)
{
    dit_st_set *set = NULL;
    const dit_st_entry *hs, *ehs;
    dit_status st;
    DIT_CHECK(dit_st_set_open_path(path, &set, diag));
    DIT_CHECK(need(set, path, IN_HS, 3, 3, &hs, diag));
    DIT_CHECK(need(set, path, IN_EHS, 3, 3, &ehs, diag));
    *batch = hs->view.ne[0];
    *img_tokens = hs->view.ne[1];
    *txt_tokens = ehs->view.ne[1];
cleanup:
    dit_st_set_close(set);
    return st;
}

static dit_status shape_error(const char *path, const dit_st_entry *e, const char *want,
                              dit_diag *diag)
{
    char got[64];
    dit_tensor_shape_str(&e->view, got, sizeof got);
    return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is %s; expected %s", path,
                        e->name, got, want);
}

dit_status dit_input_file_load(const char *path, const dit_flux_config *cfg, dit_input_file **out,
                               dit_diag *diag)
{
    dit_st_set *set = NULL;
    dit_input_file *f = NULL;
    const dit_st_entry *e[IN_COUNT];
    char want[128];
    dit_status st;
    DIT_CHECK(dit_st_set_open_path(path, &set, diag));
    DIT_CHECK(check_names(set, path, diag));
    DIT_CHECK(need(set, path, IN_HS, 3, 3, &e[IN_HS], diag));
    DIT_CHECK(need(set, path, IN_EHS, 3, 3, &e[IN_EHS], diag));
    DIT_CHECK(need(set, path, IN_POOL, 2, 2, &e[IN_POOL], diag));
    DIT_CHECK(need(set, path, IN_T, 1, 1, &e[IN_T], diag));
    /* diffusers still accepts (B, S, n_axes) ids and uses batch 0 of them. */
    DIT_CHECK(need(set, path, IN_IMG, 2, 3, &e[IN_IMG], diag));
    DIT_CHECK(need(set, path, IN_TXT, 2, 3, &e[IN_TXT], diag));
    DIT_CHECK(need(set, path, IN_G, 1, 1, &e[IN_G], diag));

    const int64_t B = e[IN_HS]->view.ne[0], Si = e[IN_HS]->view.ne[1];
    const int64_t St = e[IN_EHS]->view.ne[1], nax = cfg->n_axes;
    if (e[IN_HS]->view.ne[2] != cfg->in_channels) {
        snprintf(want, sizeof want, "(B, image tokens, %d) for in_channels %d", cfg->in_channels,
                 cfg->in_channels);
        st = shape_error(path, e[IN_HS], want, diag);
        goto cleanup;
    }
    if (e[IN_EHS]->view.ne[0] != B || e[IN_EHS]->view.ne[2] != cfg->joint_attention_dim) {
        snprintf(want, sizeof want, "(%lld, text tokens, %d) for joint_attention_dim %d",
                 (long long)B, cfg->joint_attention_dim, cfg->joint_attention_dim);
        st = shape_error(path, e[IN_EHS], want, diag);
        goto cleanup;
    }
    if (e[IN_POOL]->view.ne[0] != B || e[IN_POOL]->view.ne[1] != cfg->pooled_projection_dim) {
        snprintf(want, sizeof want, "(%lld, %d) for pooled_projection_dim", (long long)B,
                 cfg->pooled_projection_dim);
        st = shape_error(path, e[IN_POOL], want, diag);
        goto cleanup;
    }
    for (int w = IN_T; w <= IN_G; w += IN_G - IN_T) {
        if (e[w] && e[w]->view.ne[0] != B) {
            snprintf(want, sizeof want, "(%lld): one value per batch entry", (long long)B);
            st = shape_error(path, e[w], want, diag);
            goto cleanup;
        }
    }
    const int64_t id_len[2] = {Si, St};
    for (int w = IN_IMG; w <= IN_TXT; w++) {
        const dit_tensor *v = &e[w]->view;
        if (v->ne[v->ndim - 2] != id_len[w - IN_IMG] || v->ne[v->ndim - 1] != nax) {
            snprintf(want, sizeof want, "(%lld, %lld) to match the %s tokens and %lld rope axes",
                     (long long)id_len[w - IN_IMG], (long long)nax,
                     w == IN_IMG ? "image" : "text", (long long)nax);
            st = shape_error(path, e[w], want, diag);
            goto cleanup;
        }
    }
    if (cfg->guidance_embeds != (e[IN_G] != NULL)) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                          cfg->guidance_embeds
                              ? "%s: this model has guidance embeddings: input 'guidance' is required"
                              : "%s: this model has no guidance embeddings: drop input 'guidance'",
                          path);
        goto cleanup;
    }

    f = calloc(1, sizeof *f);
    if (!f) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    for (int w = 0; w < IN_COUNT; w++) {
        if (!e[w])
            continue;
        /* ids given per batch entry: keep batch 0, as diffusers does */
        size_t n = (size_t)dit_tensor_numel(&e[w]->view);
        if ((w == IN_IMG || w == IN_TXT) && e[w]->view.ndim == 3)
            n /= (size_t)e[w]->view.ne[0];
        f->data[w] = malloc((n ? n : 1) * sizeof(float));
        if (!f->data[w]) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory reading '%s'", input_names[w]);
            goto cleanup;
        }
        dit_convert_to_f32(f->data[w], e[w]->view.data, e[w]->view.dtype, n);
    }
    f->in = (dit_forward_inputs){
        .batch = B,
        .img_tokens = Si,
        .txt_tokens = St,
        .hidden_states = f->data[IN_HS],
        .encoder_hidden_states = f->data[IN_EHS],
        .pooled_projections = f->data[IN_POOL],
        .timestep = f->data[IN_T],
        .guidance = f->data[IN_G],
        .img_ids = f->data[IN_IMG],
        .txt_ids = f->data[IN_TXT],
    };
    *out = f;
    f = NULL;
cleanup:
    dit_input_file_free(f);
    dit_st_set_close(set);
    return st;
}

void dit_input_file_free(dit_input_file *f)
{
    if (!f)
        return;
    for (int w = 0; w < IN_COUNT; w++)
        free(f->data[w]);
    free(f);
}

const dit_forward_inputs *dit_input_file_inputs(const dit_input_file *f)
{
    return &f->in;
}
