#include "parallel/cp_plan.h"

#include <string.h>

#include "parallel/mesh.h"

const dit_cp_rule *dit_cp_plan_output(const dit_cp_rule *plan, int n_rules)
{
    for (int i = 0; i < n_rules; i++)
        if (plan[i].kind == DIT_CP_GATHER)
            return &plan[i];
    return NULL;
}

static const dit_cp_rule *find_rule(const dit_cp_rule *plan, int n_rules, const char *name)
{
    for (int i = 0; i < n_rules; i++)
        if (plan[i].kind != DIT_CP_GATHER && strcmp(plan[i].input, name) == 0)
            return &plan[i];
    return NULL;
}

dit_status dit_cp_layout_from_lengths(int n_seqs, const int64_t *seq_len, int cp_size, int cp_rank,
                                      dit_cp_layout *out, dit_diag *diag)
{
    if (cp_size < 1 || cp_size > DIT_CP_MAX_RANKS || n_seqs > DIT_CP_MAX_SEQS || cp_rank < 0 ||
        cp_rank >= cp_size)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "context-parallel plan: bad layout");
    memset(out, 0, sizeof *out);
    out->cp_size = cp_size;
    out->cp_rank = cp_rank;
    out->n_seqs = n_seqs;
    for (int s = 0; s < n_seqs; s++) {
        out->seq_len[s] = seq_len[s];
        for (int j = 0; j < cp_size; j++) {
            dit_partition(out->seq_len[s], cp_size, j, &out->off[s][j], &out->len[s][j]);
            out->attn_len[j] += out->len[s][j];
        }
    }
    return DIT_OK;
}

dit_status dit_cp_plan_layout(const dit_cp_rule *plan, int n_rules, int n_seqs,
                              const dit_named_tensors *in, int cp_size, int cp_rank,
                              dit_cp_layout *out, dit_diag *diag)
{
    int64_t lens[DIT_CP_MAX_SEQS] = {0};
    if (n_seqs > DIT_CP_MAX_SEQS)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "context-parallel plan: bad layout");
    for (int s = 0; s < n_seqs; s++) {
        const dit_tensor *t = NULL;
        const dit_cp_rule *r = NULL;
        for (int i = 0; i < n_rules && !t; i++) {
            if (plan[i].kind != DIT_CP_SPLIT || plan[i].seq != s)
                continue;
            r = &plan[i];
            t = dit_named_tensors_get(in, r->input);
        }
        if (!t)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "input '%s' is required",
                                r ? r->input : "?");
        if (r->dim >= t->ndim)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "input '%s' has %d dims, fewer than %d",
                                r->input, t->ndim, r->dim + 1);
        lens[s] = t->ne[r->dim];
    }
    return dit_cp_layout_from_lengths(n_seqs, lens, cp_size, cp_rank, out, diag);
}

dit_status dit_cp_plan_scatter(const dit_cp_rule *plan, int n_rules, const dit_cp_layout *lay,
                               dit_backend *be, dit_arena *arena, const dit_named_tensors *in,
                               dit_named_tensors *local, dit_diag *diag)
{
    dit_status st = DIT_OK;
    memset(local, 0, sizeof *local);
    for (int i = 0; i < in->n; i++)
        if (!find_rule(plan, n_rules, in->v[i].name))
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "input '%s' is not one this model takes",
                                in->v[i].name);
    for (int i = 0; i < n_rules; i++) {
        const dit_cp_rule *r = &plan[i];
        if (r->kind == DIT_CP_GATHER)
            continue;
        const dit_tensor *t = dit_named_tensors_get(in, r->input);
        if (!t)
            continue; /* optional inputs: the model checks what it needs */
        dit_tensor mine = *t;
        if (r->kind == DIT_CP_SPLIT) {
            if (r->dim >= t->ndim || t->ne[r->dim] != lay->seq_len[r->seq])
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "input '%s': dim %d does not match the other inputs of its "
                                    "sequence (%lld)",
                                    r->input, r->dim, (long long)lay->seq_len[r->seq]);
            mine = dit_tensor_narrow(t, r->dim, lay->off[r->seq][lay->cp_rank],
                                     lay->len[r->seq][lay->cp_rank]);
        }
        if (r->host) {
            if (r->kind == DIT_CP_SPLIT && r->dim != 0)
                return dit_diag_set(diag, DIT_ERR_INTERNAL,
                                    "context-parallel plan: host input '%s' splits on dim %d",
                                    r->input, r->dim);
        } else {
            dit_tensor dev;
            st = dit_arena_tensor(arena, DIT_F32, mine.ndim, mine.ne, &dev);
            if (st != DIT_OK)
                return dit_diag_set(diag, st, "forward: out of device memory for inputs");
            st = be->ops->upload(be, &dev, &mine);
            if (st != DIT_OK)
                return st;
            mine = dev;
        }
        st = dit_named_tensors_set(local, r->input, &mine);
        if (st != DIT_OK)
            return dit_diag_set(diag, st, "context-parallel plan: too many inputs");
    }
    return DIT_OK;
}

dit_tensor dit_cp_plan_local_output_shape(const dit_cp_rule *plan, int n_rules,
                                          const dit_cp_layout *lay, const dit_tensor *whole)
{
    dit_tensor t = *whole;
    const dit_cp_rule *o = dit_cp_plan_output(plan, n_rules);
    if (o && o->dim < t.ndim)
        t.ne[o->dim] = lay->len[o->seq][lay->cp_rank];
    return dit_tensor_make(NULL, t.dtype, t.ndim, t.ne);
}

dit_status dit_cp_plan_gather(const dit_cp_rule *plan, int n_rules, const dit_cp_layout *lay,
                              dit_backend *be, dit_arena *arena, dit_comm *cpc,
                              const dit_tensor *local, const dit_tensor *whole,
                              uint64_t *gathered_bytes, dit_diag *diag)
{
    const dit_cp_rule *o = dit_cp_plan_output(plan, n_rules);
    const int C = lay->cp_size;
    if (C == 1 || !o)
        return be->ops->download(be, whole, local);
    if (!cpc)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "context-parallel gather without a group");
    /* Gather the chunks of the cp group, then put them back in sequence
     * order on the device. */
    dit_status st = DIT_OK;
    const int nd = whole->ndim, dim = o->dim;
    const int64_t rest = dit_tensor_numel(whole) / whole->ne[dim];
    size_t counts[DIT_CP_MAX_RANKS];
    for (int j = 0; j < C; j++)
        counts[j] = (size_t)(rest * lay->len[o->seq][j]) * sizeof(float);
    dit_tensor packed, dev_whole;
    const int64_t n_all = dit_tensor_numel(whole);
    st = dit_arena_tensor(arena, DIT_F32, 1, &n_all, &packed);
    if (st == DIT_OK)
        st = dit_arena_tensor(arena, DIT_F32, nd, whole->ne, &dev_whole);
    if (st != DIT_OK)
        return dit_diag_set(diag, st, "forward: out of device memory for inputs");
    DIT_CHECK(cpc->ops->all_gather_v(cpc, local->data, packed.data, counts, diag));
    if (gathered_bytes)
        *gathered_bytes += counts[lay->cp_rank];
    float *p = packed.data;
    for (int j = 0; j < C; j++) {
        int64_t shape[DIT_MAX_DIMS];
        memcpy(shape, whole->ne, sizeof shape);
        shape[dim] = lay->len[o->seq][j];
        dit_tensor src = dit_tensor_make(p, DIT_F32, nd, shape);
        dit_tensor dst = dit_tensor_narrow(&dev_whole, dim, lay->off[o->seq][j], shape[dim]);
        DIT_CHECK(be->ops->copy(be, &dst, &src));
        p += rest * shape[dim];
    }
    DIT_CHECK(be->ops->download(be, whole, &dev_whole));
cleanup:
    return st;
}
