#include "parallel/cp_attention.h"

#include <stdlib.h>
#include <string.h>

#define CP_MAX 64

struct dit_cp_attention {
    dit_backend *be;
    const dit_mesh *mesh;
    int R, U, r, u;
    dit_comm *ring, *ulysses;
    int64_t lengths[CP_MAX]; /* per cp rank */
    bool have_lengths;
    uint64_t bytes_sent;
};

dit_status dit_cp_attention_create(dit_backend *be, const dit_mesh *mesh, dit_cp_attention **out,
                                   dit_diag *diag)
{
    const dit_parallel_config *pc = dit_mesh_config(mesh);
    if (pc->ring_degree * pc->ulysses_degree > CP_MAX)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "context-parallel size above %d", CP_MAX);
    dit_cp_attention *a = calloc(1, sizeof *a);
    if (!a)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    a->be = be;
    a->mesh = mesh;
    a->R = pc->ring_degree;
    a->U = pc->ulysses_degree;
    a->r = dit_mesh_ring_rank(mesh);
    a->u = dit_mesh_ulysses_rank(mesh);
    a->ring = dit_mesh_ring(mesh);
    a->ulysses = dit_mesh_ulysses(mesh);
    *out = a;
    return DIT_OK;
}

void dit_cp_attention_destroy(dit_cp_attention *a)
{
    free(a);
}

dit_status dit_cp_attention_set_lengths(dit_cp_attention *a, const int64_t *lengths, int n,
                                        dit_diag *diag)
{
    if (n != a->R * a->U)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%d sequence lengths for %d cp ranks", n,
                            a->R * a->U);
    memcpy(a->lengths, lengths, (size_t)n * sizeof *lengths);
    a->have_lengths = true;
    return DIT_OK;
}

uint64_t dit_cp_attention_bytes_sent(const dit_cp_attention *a)
{
    return a->bytes_sent;
}

/* Heads of Ulysses rank j: [h0, h0 + n) with blocks of ceil(H / U). */
static void heads_of(int64_t H, int U, int j, int64_t *h0, int64_t *n)
{
    const int64_t hc = (H + U - 1) / U;
    int64_t lo = (int64_t)j * hc, hi = (int64_t)(j + 1) * hc;
    lo = lo < H ? lo : H;
    hi = hi < H ? hi : H;
    *h0 = lo;
    *n = hi - lo;
}

static dit_status scratch(dit_arena *arena, int64_t n_floats, float **out, dit_diag *diag)
{
    void *p;
    dit_status st =
        dit_arena_bytes(arena, (size_t)(n_floats > 0 ? n_floats : 1) * sizeof(float), &p);
    if (st != DIT_OK)
        return dit_diag_set(diag, st, "context-parallel attention: out of scratch memory");
    *out = p;
    return DIT_OK;
}

#define TRY(call)                                                                                  \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "context-parallel attention: %s failed", #call);           \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

/* Local (B, S, H, D) q/k/v -> (B, S_group, H_mine, D) for the whole ulysses
 * group. qkv_full receives three contiguous tensors. */
static dit_status ulysses_scatter_heads(dit_cp_attention *a, dit_arena *arena,
                                        const dit_tensor *in[3], dit_tensor full[3], dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = a->be;
    const int U = a->U;
    const int64_t B = in[0]->ne[0], S_me = in[0]->ne[1], H = in[0]->ne[2], D = in[0]->ne[3];
    int64_t S[CP_MAX], soff[CP_MAX], S_tot = 0;
    for (int j = 0; j < U; j++) {
        S[j] = a->lengths[a->r * U + j];
        soff[j] = S_tot;
        S_tot += S[j];
    }
    int64_t h0_me, h_me;
    heads_of(H, U, a->u, &h0_me, &h_me);
    size_t send_counts[CP_MAX], recv_counts[CP_MAX];
    int64_t send_total = 0, recv_total = 0;
    for (int j = 0; j < U; j++) {
        int64_t h0, hn;
        heads_of(H, U, j, &h0, &hn);
        send_counts[j] = (size_t)(3 * B * S_me * hn * D) * sizeof(float);
        recv_counts[j] = (size_t)(3 * B * S[j] * h_me * D) * sizeof(float);
        send_total += 3 * B * S_me * hn * D;
        recv_total += 3 * B * S[j] * h_me * D;
    }
    float *send = NULL, *recv = NULL;
    DIT_CHECK(scratch(arena, send_total, &send, diag));
    DIT_CHECK(scratch(arena, recv_total, &recv, diag));
    float *p = send;
    for (int j = 0; j < U; j++) {
        int64_t h0, hn;
        heads_of(H, U, j, &h0, &hn);
        for (int t = 0; t < 3; t++) {
            dit_tensor dst = dit_tensor_4d(p, DIT_F32, B, S_me, hn, D);
            dit_tensor src = dit_tensor_narrow(in[t], 2, h0, hn);
            TRY(be->ops->copy(be, &dst, &src));
            p += B * S_me * hn * D;
        }
    }
    DIT_CHECK(
        a->ulysses->ops->all_to_all_v(a->ulysses, send, send_counts, recv, recv_counts, diag));
    a->bytes_sent += (uint64_t)((send_total - 3 * B * S_me * h_me * D) * (int64_t)sizeof(float));
    for (int t = 0; t < 3; t++) {
        float *f = NULL;
        DIT_CHECK(scratch(arena, B * S_tot * h_me * D, &f, diag));
        full[t] = dit_tensor_4d(f, DIT_F32, B, S_tot, h_me, D);
    }
    p = recv;
    for (int i = 0; i < U; i++) {
        for (int t = 0; t < 3; t++) {
            dit_tensor src = dit_tensor_4d(p, DIT_F32, B, S[i], h_me, D);
            dit_tensor dst = dit_tensor_narrow(&full[t], 1, soff[i], S[i]);
            TRY(be->ops->copy(be, &dst, &src));
            p += B * S[i] * h_me * D;
        }
    }
cleanup:
    return st;
}

/* Inverse: (B, S_group, H_mine, D) -> this rank's (B, S_me, H, D). */
static dit_status ulysses_gather_heads(dit_cp_attention *a, dit_arena *arena,
                                       const dit_tensor *full, const dit_tensor *out,
                                       dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = a->be;
    const int U = a->U;
    const int64_t B = out->ne[0], S_me = out->ne[1], H = out->ne[2], D = out->ne[3];
    const int64_t h_me = full->ne[2];
    int64_t S[CP_MAX], soff[CP_MAX], S_tot = 0;
    for (int j = 0; j < U; j++) {
        S[j] = a->lengths[a->r * U + j];
        soff[j] = S_tot;
        S_tot += S[j];
    }
    size_t send_counts[CP_MAX], recv_counts[CP_MAX];
    int64_t send_total = 0, recv_total = 0;
    for (int j = 0; j < U; j++) {
        int64_t h0, hn;
        heads_of(H, U, j, &h0, &hn);
        send_counts[j] = (size_t)(B * S[j] * h_me * D) * sizeof(float);
        recv_counts[j] = (size_t)(B * S_me * hn * D) * sizeof(float);
        send_total += B * S[j] * h_me * D;
        recv_total += B * S_me * hn * D;
    }
    float *send = NULL, *recv = NULL;
    DIT_CHECK(scratch(arena, send_total, &send, diag));
    DIT_CHECK(scratch(arena, recv_total, &recv, diag));
    float *p = send;
    for (int i = 0; i < U; i++) {
        dit_tensor dst = dit_tensor_4d(p, DIT_F32, B, S[i], h_me, D);
        dit_tensor src = dit_tensor_narrow(full, 1, soff[i], S[i]);
        TRY(be->ops->copy(be, &dst, &src));
        p += B * S[i] * h_me * D;
    }
    DIT_CHECK(
        a->ulysses->ops->all_to_all_v(a->ulysses, send, send_counts, recv, recv_counts, diag));
    a->bytes_sent += (uint64_t)((send_total - B * S[a->u] * h_me * D) * (int64_t)sizeof(float));
    p = recv;
    for (int j = 0; j < U; j++) {
        int64_t h0, hn;
        heads_of(H, U, j, &h0, &hn);
        dit_tensor src = dit_tensor_4d(p, DIT_F32, B, S_me, hn, D);
        dit_tensor dst = dit_tensor_narrow(out, 2, h0, hn);
        TRY(be->ops->copy(be, &dst, &src));
        p += B * S_me * hn * D;
    }
cleanup:
    return st;
}

/* A (B, L, H, D) view of the k (part 0) or v (part 1) half of a ring buffer
 * laid out (2, B, Lmax, H, D). */
static dit_tensor kv_view(float *buf, int part, int64_t B, int64_t Lmax, int64_t L, int64_t H,
                          int64_t D)
{
    dit_tensor t =
        dit_tensor_4d(buf + (size_t)part * (size_t)(B * Lmax * H * D), DIT_F32, B, Lmax, H, D);
    t.ne[1] = L;
    return t;
}

/* Ring attention over the ring group. q (B, Sq, H, D); k, v (B, L_mine, H,
 * D); L[i] is ring rank i's chunk length. */
static dit_status ring_attention(dit_cp_attention *a, dit_arena *arena, const dit_tensor *out,
                                 const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                                 const int64_t *L, float scale, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_backend *be = a->be;
    const int R = a->R, r = a->r;
    const int64_t B = q->ne[0], Sq = q->ne[1], H = q->ne[2], D = q->ne[3];
    int64_t Lmax = 0;
    for (int i = 0; i < R; i++)
        Lmax = L[i] > Lmax ? L[i] : Lmax;
    const int64_t chunk = 2 * B * Lmax * H * D;
    float *cur = NULL, *nxt = NULL, *lse = NULL, *tmp_out = NULL, *tmp_lse = NULL;
    DIT_CHECK(scratch(arena, chunk, &cur, diag));
    DIT_CHECK(scratch(arena, chunk, &nxt, diag));
    DIT_CHECK(scratch(arena, B * H * Sq, &lse, diag));
    DIT_CHECK(scratch(arena, B * Sq * H * D, &tmp_out, diag));
    DIT_CHECK(scratch(arena, B * H * Sq, &tmp_lse, diag));
    {
        dit_tensor kd = kv_view(cur, 0, B, Lmax, L[r], H, D);
        dit_tensor vd = kv_view(cur, 1, B, Lmax, L[r], H, D);
        TRY(be->ops->copy(be, &kd, k));
        TRY(be->ops->copy(be, &vd, v));
    }
    dit_tensor t_lse = dit_tensor_3d(lse, DIT_F32, B, H, Sq);
    dit_tensor t_tmp = dit_tensor_4d(tmp_out, DIT_F32, B, Sq, H, D);
    dit_tensor t_tmp_lse = dit_tensor_3d(tmp_lse, DIT_F32, B, H, Sq);
    for (int s = 0; s < R; s++) {
        const int src = ((r - s) % R + R) % R;
        dit_comm_request req;
        /* Send the chunk in hand onward while attending to it. */
        if (s < R - 1) {
            DIT_CHECK(a->ring->ops->sendrecv_start(a->ring, cur, (size_t)chunk * sizeof(float),
                                                   (r + 1) % R, nxt, (size_t)chunk * sizeof(float),
                                                   (r - 1 + R) % R, &req, diag));
            a->bytes_sent += (uint64_t)chunk * sizeof(float);
        }
        dit_tensor kc = kv_view(cur, 0, B, Lmax, L[src], H, D);
        dit_tensor vc = kv_view(cur, 1, B, Lmax, L[src], H, D);
        if (s == 0) {
            TRY(be->ops->attention(be, out, &t_lse, q, &kc, &vc, scale));
        } else {
            TRY(be->ops->attention(be, &t_tmp, &t_tmp_lse, q, &kc, &vc, scale));
            TRY(be->ops->lse_merge(be, out, &t_lse, &t_tmp, &t_tmp_lse));
        }
        if (s < R - 1) {
            DIT_CHECK(a->ring->ops->sendrecv_wait(a->ring, &req, diag));
            float *t = cur;
            cur = nxt;
            nxt = t;
        }
    }
cleanup:
    return st;
}

dit_status dit_cp_attention_run(dit_cp_attention *a, dit_arena *arena, const dit_tensor *out,
                                const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                                float scale, dit_diag *diag)
{
    dit_status st = DIT_OK;
    if (!a->have_lengths)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "context-parallel attention without lengths");
    const int64_t my_len = a->lengths[a->r * a->U + a->u];
    if (q->ne[1] != my_len)
        return dit_diag_set(diag, DIT_ERR_INTERNAL,
                            "context-parallel attention: %lld local tokens, %lld announced",
                            (long long)q->ne[1], (long long)my_len);
    dit_arena_mark mark = dit_arena_get_mark(arena);
    if (a->U == 1 && a->R == 1) {
        st = a->be->ops->attention(a->be, out, NULL, q, k, v, scale);
    } else if (a->U == 1) {
        st = ring_attention(a, arena, out, q, k, v, a->lengths, scale, diag);
    } else {
        const dit_tensor *in[3] = {q, k, v};
        dit_tensor full[3];
        DIT_CHECK(ulysses_scatter_heads(a, arena, in, full, diag));
        float *o = NULL;
        DIT_CHECK(scratch(arena, dit_tensor_numel(&full[0]), &o, diag));
        dit_tensor of = dit_tensor_make(o, DIT_F32, 4, full[0].ne);
        if (a->R == 1) {
            st = a->be->ops->attention(a->be, &of, NULL, &full[0], &full[1], &full[2], scale);
        } else {
            /* Ring member i holds the sequence of ulysses group i. */
            int64_t L[CP_MAX];
            for (int i = 0; i < a->R; i++) {
                L[i] = 0;
                for (int j = 0; j < a->U; j++)
                    L[i] += a->lengths[i * a->U + j];
            }
            st = ring_attention(a, arena, &of, &full[0], &full[1], &full[2], L, scale, diag);
        }
        if (st != DIT_OK)
            goto cleanup;
        st = ulysses_gather_heads(a, arena, &of, out, diag);
    }
cleanup:
    dit_arena_release(arena, mark);
    return st;
}
