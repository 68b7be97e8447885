#include "runtime/inputs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/safetensors.h"

struct dit_input_file {
    int n;
    float *data[DIT_NAMED_TENSORS_MAX];
    char names[DIT_NAMED_TENSORS_MAX][256];
    dit_named_tensors in;
};

dit_status dit_input_file_peek(const char *path, const dit_model_class *cls, const void *cfg,
                               int64_t *seq_lens, dit_diag *diag)
{
    dit_st_set *set = NULL;
    dit_status st;
    const dit_parallel_req req = cls->parallel_req(cfg);
    DIT_CHECK(dit_st_set_open_path(path, &set, diag));
    if (cls->seq_lens) {
        /* The class computes its token counts from the inputs' shapes. */
        dit_named_tensors views = {0};
        for (size_t i = 0; i < dit_st_set_count(set) && i < DIT_NAMED_TENSORS_MAX; i++) {
            const dit_st_entry *e = dit_st_set_at(set, i);
            DIT_CHECK(dit_named_tensors_set(&views, e->name, &e->view));
        }
        st = cls->seq_lens(cfg, &views, seq_lens, diag);
        goto cleanup;
    }
    for (int s = 0; s < req.n_seqs; s++) {
        const dit_st_entry *e = NULL;
        const dit_cp_rule *r = NULL;
        for (int i = 0; i < cls->n_cp && !e; i++) {
            if (cls->cp_plan[i].kind != DIT_CP_SPLIT || cls->cp_plan[i].seq != s)
                continue;
            r = &cls->cp_plan[i];
            e = dit_st_set_find(set, r->input);
        }
        if (!e) {
            st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is missing", path,
                              r ? r->input : "?");
            goto cleanup;
        }
        if (r->dim >= e->view.ndim) {
            char got[64];
            dit_tensor_shape_str(&e->view, got, sizeof got);
            st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is %s; expected more dims",
                              path, r->input, got);
            goto cleanup;
        }
        seq_lens[s] = e->view.ne[r->dim];
    }
cleanup:
    dit_st_set_close(set);
    return st;
}

dit_status dit_input_file_load(const char *path, const dit_model_class *cls, const void *cfg,
                               dit_input_file **out, dit_diag *diag)
{
    dit_st_set *set = NULL;
    dit_input_file *f = NULL;
    dit_status st;
    DIT_CHECK(dit_st_set_open_path(path, &set, diag));
    const size_t count = dit_st_set_count(set);
    if (count > DIT_NAMED_TENSORS_MAX) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: %zu tensors; a forward takes at most %d",
                          path, count, DIT_NAMED_TENSORS_MAX);
        goto cleanup;
    }
    f = calloc(1, sizeof *f);
    if (!f) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    for (size_t i = 0; i < count; i++) {
        const dit_st_entry *e = dit_st_set_at(set, i);
        const size_t n = (size_t)dit_tensor_numel(&e->view);
        f->data[f->n] = malloc((n ? n : 1) * sizeof(float));
        if (!f->data[f->n]) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory reading '%s'", e->name);
            goto cleanup;
        }
        snprintf(f->names[f->n], sizeof f->names[0], "%s", e->name);
        dit_convert_to_f32(f->data[f->n], e->view.data, e->view.dtype, n);
        dit_tensor t = dit_tensor_make(f->data[f->n], DIT_F32, e->view.ndim, e->view.ne);
        DIT_CHECK(dit_named_tensors_set(&f->in, f->names[f->n], &t));
        f->n++;
    }
    DIT_CHECK(cls->check_inputs(cfg, path, &f->in, diag));
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
    for (int w = 0; w < f->n; w++)
        free(f->data[w]);
    free(f);
}

const dit_named_tensors *dit_input_file_inputs(const dit_input_file *f)
{
    return &f->in;
}
