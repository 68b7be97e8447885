#include "runtime/runner.h"

#include <stdlib.h>
#include <string.h>

#include "backend/arena.h"
#include "parallel/cp_attention.h"

struct dit_runner {
    dit_backend *be;
    dit_flux *model;
    dit_mesh *mesh;
    dit_cp_attention *cpa;
    dit_arena *arena;
    dit_block_fn block_fn;
    void *block_ctx;
    dit_runner_stats stats;
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
    dit_flux_hooks hooks = {
        .ctx = r,
        .attention = r->cpa ? hook_attention : NULL,
        .tp_all_reduce = mesh && dit_mesh_tp(mesh) ? hook_all_reduce : NULL,
        .tp_all_gather = mesh && dit_mesh_tp(mesh) ? hook_all_gather : NULL,
        .block_done = r->block_fn ? hook_block : NULL,
    };
    dit_flux_set_hooks(r->model, &hooks);
}

dit_status dit_runner_create(dit_backend *be, dit_flux *model, dit_mesh *mesh, dit_runner **out,
                             dit_diag *diag)
{
    dit_runner *r = calloc(1, sizeof *r);
    if (!r)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    r->be = be;
    r->model = model;
    r->mesh = mesh;
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
    dit_flux_set_graphs(model, true);
    *out = r;
    return DIT_OK;
}

void dit_runner_destroy(dit_runner *r)
{
    if (!r)
        return;
    dit_flux_set_hooks(r->model, NULL);
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

#define ALLOC(t, nd, ...)                                                                   \
    do {                                                                                    \
        const int64_t shp_[] = {__VA_ARGS__};                                               \
        st = dit_arena_tensor(r->arena, DIT_F32, nd, shp_, &(t));                           \
        if (st != DIT_OK) {                                                                 \
            st = dit_diag_set(diag, st, "forward: out of device memory for inputs");        \
            goto cleanup;                                                                   \
        }                                                                                   \
    } while (0)

dit_status dit_runner_forward(dit_runner *r, const dit_forward_inputs *in, float *sample,
                              dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = r->be;
    const dit_flux_config *c = dit_flux_config_of(r->model);
    const int64_t B = in->batch, Si = in->img_tokens, St = in->txt_tokens;
    const int C = r->mesh ? dit_mesh_cp_size(r->mesh) : 1;
    const int cp = r->mesh ? dit_mesh_cp_rank(r->mesh) : 0;
    const int nax = c->n_axes;

    if (r->mesh) {
        DIT_CHECK(dit_parallel_validate_model(dit_mesh_config(r->mesh), c, Si, St, diag));
    }
    /* The context-parallel plan: every rank takes chunk `cp` of the image
     * tokens and of the text tokens (torch.tensor_split sizes). */
    int64_t img_off[64], img_len[64], txt_off[64], txt_len[64], lens[64];
    for (int j = 0; j < C; j++) {
        dit_partition(Si, C, j, &img_off[j], &img_len[j]);
        dit_partition(St, C, j, &txt_off[j], &txt_len[j]);
        lens[j] = img_len[j] + txt_len[j];
    }
    if (r->cpa)
        DIT_CHECK(dit_cp_attention_set_lengths(r->cpa, lens, C, diag));

    dit_tensor hs, ehs, pooled, out_local;
    ALLOC(hs, 3, B, img_len[cp], c->in_channels);
    ALLOC(ehs, 3, B, txt_len[cp], c->joint_attention_dim);
    ALLOC(pooled, 2, B, c->pooled_projection_dim);
    ALLOC(out_local, 3, B, img_len[cp], c->out_dim);
    {
        dit_tensor h_hs = dit_tensor_3d((void *)in->hidden_states, DIT_F32, B, Si, c->in_channels);
        dit_tensor h_ehs = dit_tensor_3d((void *)in->encoder_hidden_states, DIT_F32, B, St,
                                         c->joint_attention_dim);
        dit_tensor h_pool = dit_tensor_2d((void *)in->pooled_projections, DIT_F32, B,
                                          c->pooled_projection_dim);
        dit_tensor my_hs = dit_tensor_narrow(&h_hs, 1, img_off[cp], img_len[cp]);
        dit_tensor my_ehs = dit_tensor_narrow(&h_ehs, 1, txt_off[cp], txt_len[cp]);
        DIT_CHECK(be->ops->upload(be, &hs, &my_hs));
        DIT_CHECK(be->ops->upload(be, &ehs, &my_ehs));
        DIT_CHECK(be->ops->upload(be, &pooled, &h_pool));
    }
    dit_flux_inputs fin = {
        .hidden_states = hs,
        .encoder_hidden_states = ehs,
        .pooled_projections = pooled,
        .timestep = in->timestep,
        .guidance = in->guidance,
        .img_ids = in->img_ids + img_off[cp] * nax,
        .txt_ids = in->txt_ids + txt_off[cp] * nax,
    };
    DIT_CHECK(dit_flux_forward(r->model, r->arena, &fin, &out_local, diag));

    dit_tensor h_out = dit_tensor_3d(sample, DIT_F32, B, Si, c->out_dim);
    if (C == 1) {
        DIT_CHECK(be->ops->download(be, &h_out, &out_local));
    } else {
        /* Gather the image-token chunks of the cp group, then put them back
         * in sequence order per batch entry on the device. */
        dit_comm *cpc = dit_mesh_cp(r->mesh);
        size_t counts[64];
        for (int j = 0; j < C; j++)
            counts[j] = (size_t)(B * img_len[j] * c->out_dim) * sizeof(float);
        dit_tensor packed, whole;
        ALLOC(packed, 1, B * Si * c->out_dim);
        ALLOC(whole, 3, B, Si, c->out_dim);
        DIT_CHECK(cpc->ops->all_gather_v(cpc, out_local.data, packed.data, counts, diag));
        r->stats.gather_bytes += counts[cp];
        float *p = packed.data;
        for (int j = 0; j < C; j++) {
            dit_tensor src = dit_tensor_3d(p, DIT_F32, B, img_len[j], c->out_dim);
            dit_tensor dst = dit_tensor_narrow(&whole, 1, img_off[j], img_len[j]);
            DIT_CHECK(be->ops->copy(be, &dst, &src));
            p += B * img_len[j] * c->out_dim;
        }
        DIT_CHECK(be->ops->download(be, &h_out, &whole));
    }
cleanup:
    dit_arena_reset(r->arena);
    return st;
}
