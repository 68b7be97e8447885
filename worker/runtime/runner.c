#include "runtime/runner.h"

#include <stdlib.h>
#include <string.h>

#include "backend/arena.h"
#include "parallel/cp_attention.h"
#include "parallel/cp_plan.h"

struct dit_runner {
    dit_backend *be;
    dit_model *model;
    dit_parallel_req req;
    dit_mesh *mesh;
    dit_cp_attention *cpa;
    dit_arena *arena;
    dit_block_fn block_fn;
    void *block_ctx;
    dit_runner_stats stats;
    dit_cp_layout lay; /* the current forward's */
};

static dit_status hook_attention(void *ctx, dit_arena *arena, const dit_tensor *out,
                                 const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                                 float scale, dit_diag *diag)
{
    dit_runner *r = ctx;
    return dit_cp_attention_run(r->cpa, arena, out, q, k, v, scale, diag);
}

static dit_status hook_all_reduce(void *ctx, const dit_tensor *x, dit_diag *diag)
{
    dit_runner *r = ctx;
    dit_comm *tp = dit_mesh_tp(r->mesh);
    if (!dit_tensor_is_contiguous(x))
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "tensor-parallel all-reduce of a strided view");
    r->stats.tp_bytes_reduced += dit_tensor_nbytes(x);
    return tp->ops->all_reduce_sum(tp, x->data, (size_t)dit_tensor_numel(x), x->dtype, diag);
}

static dit_status hook_all_gather(void *ctx, dit_arena *arena, const dit_tensor *local,
                                  const dit_tensor *full, dit_diag *diag)
{
    dit_runner *r = ctx;
    dit_comm *tp = dit_mesh_tp(r->mesh);
    const int T = dit_comm_size(tp);
    const int64_t B = local->ne[0], n = local->ne[1];
    if (!dit_tensor_is_contiguous(local) || full->ne[0] != B || full->ne[1] != n * T)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "tensor-parallel all-gather: bad shapes");
    dit_arena_mark mark = dit_arena_get_mark(arena);
    dit_tensor gathered;
    const int64_t shape[3] = {T, B, n};
    dit_status st = dit_arena_tensor(arena, DIT_F32, 3, shape, &gathered);
    if (st == DIT_OK)
        st = tp->ops->all_gather(tp, local->data, dit_tensor_nbytes(local), gathered.data, diag);
    r->stats.tp_bytes_gathered += dit_tensor_nbytes(local);
    /* (T, B, n) -> (B, T n): rank r's slice is columns [r n, (r+1) n). */
    for (int i = 0; st == DIT_OK && i < T; i++) {
        dit_tensor src = dit_tensor_narrow(&gathered, 0, i, 1);
        src = dit_tensor_2d((char *)src.data, DIT_F32, B, n);
        dit_tensor dst = dit_tensor_narrow(full, 1, i * n, n);
        st = r->be->ops->copy(r->be, &dst, &src);
    }
    dit_arena_release(arena, mark);
    return st;
}

static dit_status hook_block(void *ctx, int block, dit_diag *diag)
{
    dit_runner *r = ctx;
    return r->block_fn ? r->block_fn(r->block_ctx, block, diag) : DIT_OK;
}

/* Only the hooks in use: a model without hooks may replay graphs. */
static void set_hooks(dit_runner *r)
{
    const dit_mesh *mesh = r->mesh;
    dit_model_hooks hooks = {
        .ctx = r,
        .attention = r->cpa ? hook_attention : NULL,
        .tp_all_reduce = mesh && dit_mesh_tp(mesh) ? hook_all_reduce : NULL,
        .tp_all_gather = mesh && dit_mesh_tp(mesh) ? hook_all_gather : NULL,
        .block_done = r->block_fn ? hook_block : NULL,
        .cp_layout = r->model->cls->seq_lens ? &r->lay : NULL,
    };
    r->model->cls->set_hooks(r->model->impl, &hooks);
}

dit_status dit_runner_create(dit_backend *be, dit_model *model, dit_mesh *mesh, dit_runner **out,
                             dit_diag *diag)
{
    dit_runner *r = calloc(1, sizeof *r);
    if (!r)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    r->be = be;
    r->model = model;
    r->mesh = mesh;
    r->req = model->cls->parallel_req(dit_model_config(model));
    dit_status st = dit_arena_create(be, 0, &r->arena);
    if (st != DIT_OK) {
        free(r);
        return dit_diag_set(diag, st, "runner: cannot create the activation arena");
    }
    if (mesh && dit_mesh_cp_size(mesh) > 1) {
        st = dit_cp_attention_create(be, mesh, &r->cpa, diag);
        if (st != DIT_OK) {
            dit_runner_destroy(r);
            return st;
        }
    }
    set_hooks(r);
    /* Per-step CUDA graphs where the backend has them and nothing runs on the
     * host in the middle of the forward (no comm or block hooks). */
    if (model->cls->set_graphs)
        model->cls->set_graphs(model->impl, true);
    *out = r;
    return DIT_OK;
}

void dit_runner_destroy(dit_runner *r)
{
    if (!r)
        return;
    r->model->cls->set_hooks(r->model->impl, NULL);
    dit_cp_attention_destroy(r->cpa);
    dit_arena_destroy(r->arena);
    free(r);
}

void dit_runner_set_block_callback(dit_runner *r, dit_block_fn fn, void *ctx)
{
    r->block_fn = fn;
    r->block_ctx = ctx;
    set_hooks(r);
}

dit_runner_stats dit_runner_get_stats(const dit_runner *r)
{
    dit_runner_stats s = r->stats;
    if (r->cpa)
        s.attention_bytes_sent = dit_cp_attention_bytes_sent(r->cpa);
    s.activation_bytes = dit_arena_high_water(r->arena);
    return s;
}

/* One forward of this rank's CFG group: the whole of `in` over the group's
 * (ring, ulysses, tp) layout; `out` host f32. */
static dit_status forward_group(dit_runner *r, const dit_named_tensors *in, const dit_tensor *out,
                                dit_diag *diag)
{
    dit_status st = DIT_OK;
    const dit_model_class *cls = r->model->cls;
    const int C = r->mesh ? dit_mesh_cp_size(r->mesh) : 1;
    const int cp = r->mesh ? dit_mesh_cp_rank(r->mesh) : 0;
    dit_cp_layout *lay = &r->lay;
    dit_named_tensors local;
    dit_tensor out_local, whole = *out;
    float *gathered = NULL;

    if (cls->seq_lens) {
        int64_t lens[DIT_CP_MAX_SEQS] = {0};
        if (r->req.n_seqs > DIT_CP_MAX_SEQS)
            return dit_diag_set(diag, DIT_ERR_INTERNAL, "context-parallel plan: bad layout");
        DIT_CHECK(cls->seq_lens(dit_model_config(r->model), in, lens, diag));
        DIT_CHECK(dit_cp_layout_from_lengths(r->req.n_seqs, lens, C, cp, lay, diag));
        /* The output gathers as tokens, on the host, before cp_finish. */
        DIT_CHECK(cls->gathered_shape(dit_model_config(r->model), in, &whole, diag));
        gathered = malloc((size_t)dit_tensor_numel(&whole) * sizeof(float));
        if (!gathered) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "forward: out of host memory");
            goto cleanup;
        }
        whole = dit_tensor_make(gathered, DIT_F32, whole.ndim, whole.ne);
    } else {
        DIT_CHECK(dit_cp_plan_layout(cls->cp_plan, cls->n_cp, r->req.n_seqs, in, C, cp, lay, diag));
    }
    if (r->mesh)
        DIT_CHECK(
            dit_parallel_validate_model(dit_mesh_config(r->mesh), &r->req, lay->seq_len, diag));
    if (r->cpa)
        DIT_CHECK(dit_cp_attention_set_lengths(r->cpa, lay->attn_len, C, diag));
    DIT_CHECK(dit_cp_plan_scatter(cls->cp_plan, cls->n_cp, lay, r->be, r->arena, in, &local, diag));
    {
        dit_tensor shape = dit_cp_plan_local_output_shape(cls->cp_plan, cls->n_cp, lay, &whole);
        st = dit_arena_tensor(r->arena, DIT_F32, shape.ndim, shape.ne, &out_local);
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "forward: out of device memory for inputs");
            goto cleanup;
        }
    }
    DIT_CHECK(cls->forward(r->model->impl, r->arena, &local, &out_local, diag));
    DIT_CHECK(dit_cp_plan_gather(cls->cp_plan, cls->n_cp, lay, r->be, r->arena,
                                 r->mesh ? dit_mesh_cp(r->mesh) : NULL, &out_local, &whole,
                                 &r->stats.gather_bytes, diag));
    if (gathered)
        DIT_CHECK(cls->cp_finish(dit_model_config(r->model), in, &whole, out, diag));
cleanup:
    free(gathered);
    dit_arena_reset(r->arena);
    return st;
}

/* `half`: this CFG group's half of `in`, cut on dim 0 of every batch input
 * of the plan (of B entries; one of 1 entry broadcasts and goes whole). */
static dit_status cfg_half_inputs(const dit_model_class *cls, const dit_named_tensors *in,
                                  int64_t B, int group, dit_named_tensors *half, dit_diag *diag)
{
    memset(half, 0, sizeof *half);
    for (int i = 0; i < in->n; i++) {
        const dit_named_tensor *e = &in->v[i];
        const dit_cp_rule *rule = NULL;
        for (int k = 0; k < cls->n_cp && !rule; k++)
            if (cls->cp_plan[k].kind != DIT_CP_GATHER &&
                strcmp(cls->cp_plan[k].input, e->name) == 0)
                rule = &cls->cp_plan[k];
        dit_tensor t = e->t;
        if (rule && rule->batch && t.ndim >= 1 && t.ne[0] != 1) {
            if (t.ne[0] != B)
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "CFG parallel: input '%s' has %lld entries on its batch dim, "
                                    "the output %lld",
                                    e->name, (long long)t.ne[0], (long long)B);
            t = dit_tensor_narrow(&t, 0, group * (B / 2), B / 2);
        }
        dit_status st = dit_named_tensors_set(half, e->name, &t);
        if (st != DIT_OK)
            return dit_diag_set(diag, st, "CFG parallel: too many inputs");
    }
    return DIT_OK;
}

dit_status dit_runner_forward(dit_runner *r, const dit_named_tensors *in, const dit_tensor *out,
                              dit_diag *diag)
{
    dit_comm *cfg = r->mesh ? dit_mesh_cfg(r->mesh) : NULL;
    const int64_t B = out->ndim >= 1 ? out->ne[0] : 1;
    /* An odd batch (no CFG) cannot halve: both groups run all of it, with
     * the same result, and nothing is exchanged. */
    if (!cfg || B % 2 != 0)
        return forward_group(r, in, out, diag);
    if (!dit_tensor_is_contiguous(out))
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "CFG parallel: a strided output");
    const int g = dit_mesh_cfg_rank(r->mesh);
    dit_named_tensors half;
    dit_status st = cfg_half_inputs(r->model->cls, in, B, g, &half, diag);
    if (st != DIT_OK)
        return st;
    const dit_tensor mine = dit_tensor_narrow(out, 0, g * (B / 2), B / 2);
    DIT_CHECK(forward_group(r, &half, &mine, diag));
    {
        /* The one exchange: the two halves meet in backend memory (a device
         * comm sends nothing else), in group order, which is batch order. */
        dit_tensor dev_mine, dev_whole;
        st = dit_arena_tensor(r->arena, DIT_F32, mine.ndim, mine.ne, &dev_mine);
        if (st == DIT_OK)
            st = dit_arena_tensor(r->arena, DIT_F32, out->ndim, out->ne, &dev_whole);
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "forward: out of device memory for the CFG exchange");
            goto cleanup;
        }
        DIT_CHECK(r->be->ops->upload(r->be, &dev_mine, &mine));
        DIT_CHECK(cfg->ops->all_gather(cfg, dev_mine.data, dit_tensor_nbytes(&dev_mine),
                                       dev_whole.data, diag));
        r->stats.cfg_bytes_gathered += dit_tensor_nbytes(&dev_mine);
        DIT_CHECK(r->be->ops->download(r->be, out, &dev_whole));
    }
cleanup:
    dit_arena_reset(r->arena);
    return st;
}

static dit_status denoiser_forward(void *ctx, const dit_named_tensors *in, const dit_tensor *out,
                                   dit_diag *diag)
{
    return dit_runner_forward(ctx, in, out, diag);
}

dit_denoiser dit_runner_denoiser(dit_runner *r)
{
    dit_denoiser d = {.ctx = r, .forward = denoiser_forward};
    return d;
}
