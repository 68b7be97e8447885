/* The text encoders' shared parts. See encoder_common.h. */
#include "encoders/encoder_common.h"

#include <stdlib.h>
#include <string.h>

bool dit_encoder_parse_act(const char *name, dit_act *act, bool *relu)
{
    static const struct {
        const char *name;
        dit_act act;
    } map[] = {
        {"quick_gelu", DIT_ACT_QUICK_GELU},
        {"gelu", DIT_ACT_GELU_ERF},
        {"gelu_python", DIT_ACT_GELU_ERF},
        {"gelu_new", DIT_ACT_GELU_TANH},
        {"gelu_pytorch_tanh", DIT_ACT_GELU_TANH},
        {"gelu_python_tanh", DIT_ACT_GELU_TANH},
        {"gelu_fast", DIT_ACT_GELU_TANH},
        {"gelu_accurate", DIT_ACT_GELU_TANH},
        {"silu", DIT_ACT_SILU},
        {"swish", DIT_ACT_SILU},
    };
    *relu = false;
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        if (strcmp(name, map[i].name) == 0) {
            *act = map[i].act;
            return true;
        }
    }
    if (strcmp(name, "relu") == 0) {
        *act = DIT_ACT_NONE;
        *relu = true;
        return true;
    }
    return false;
}

dit_status dit_encoder_relu_on_host(dit_backend *be, const dit_tensor *t)
{
    const size_t n = (size_t)dit_tensor_numel(t);
    float *h = malloc(n * sizeof *h + 1);
    if (!h)
        return DIT_ERR_NOMEM;
    dit_tensor ht = dit_tensor_make(h, DIT_F32, t->ndim, t->ne);
    dit_status st = be->ops->download(be, &ht, t);
    if (st == DIT_OK) {
        for (size_t i = 0; i < n; i++)
            h[i] = h[i] < 0.0f ? 0.0f : h[i]; /* NaN stays NaN, as in torch.relu */
        st = be->ops->upload(be, t, &ht);
    }
    free(h);
    return st;
}

dit_status dit_encoder_check_unexpected(const dit_st_set *set, const dit_weight_list *l,
                                        const char *skip_prefix, const char *const *extra,
                                        size_t n_extra, const char *model, dit_diag *diag)
{
    const size_t n = dit_st_set_count(set);
    const size_t skip_len = skip_prefix ? strlen(skip_prefix) : 0;
    for (size_t i = 0; i < n; i++) {
        const dit_st_entry *e = dit_st_set_at(set, i);
        bool known = skip_prefix && strncmp(e->name, skip_prefix, skip_len) == 0;
        for (size_t k = 0; !known && k < n_extra; k++)
            known = extra[k] && strcmp(e->name, extra[k]) == 0;
        for (size_t k = 0; !known && k < l->n; k++)
            known = strcmp(e->name, l->items[k].name) == 0;
        if (!known)
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: unexpected tensor '%s' (not a parameter of %s with this "
                                "config.json)",
                                e->file, e->name, model);
    }
    return DIT_OK;
}

dit_status dit_encoder_check_ops(const dit_backend *be, const dit_encoder_op *need, size_t n,
                                 const char *model, dit_diag *diag)
{
    for (size_t i = 0; i < n; i++)
        if (!need[i].present)
            return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                                "backend '%s' has no %s op, which %s needs", be->ops->name,
                                need[i].name, model);
    return DIT_OK;
}

dit_status dit_encoder_check_ids(const int32_t *ids, int64_t B, int64_t S, int64_t vocab,
                                 const char *what, dit_diag *diag)
{
    for (int64_t i = 0; i < B * S; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s: token id %d at [%lld, %lld] is outside the vocabulary "
                                "[0, %lld)",
                                what, ids[i], (long long)(i / S), (long long)(i % S),
                                (long long)vocab);
    return DIT_OK;
}
