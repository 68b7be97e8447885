/* WanTransformer3DModel on the backend interface. See wan.h for the layout
 * of activations; plan_build is the single place that maps checkpoint
 * tensors onto (possibly sliced) device tensors. */
#include "models/wan/wan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/safetensors.h"
#include "loader/weights.h"

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */

typedef struct wan_block {
    dit_linear qkv;              /* attn1 [to_q; to_k; to_v] (3 Cl, C) */
    dit_linear out1;             /* attn1.to_out.0 (C, Cl), row-split */
    dit_tensor norm_q1, norm_k1; /* (C) across heads, whole */
    dit_linear q2, kv2;          /* attn2 to_q (Cl, C), [to_k; to_v] (2 Cl, C) */
    dit_linear out2;             /* attn2.to_out.0 (C, Cl), row-split */
    dit_tensor norm_q2, norm_k2; /* (C) */
    dit_tensor norm2_w, norm2_b; /* (C), when cross_attn_norm */
    dit_linear ff0, ff2;         /* (Fl, C) column-split, (C, Fl) row-split */
    dit_tensor sst;              /* scale_shift_table (6 C) */
} wan_block;

struct dit_wan {
    dit_backend *be;
    dit_wan_config cfg;
    dit_shard shard;
    dit_model_hooks hooks;
    void *weights;
    size_t weight_bytes;
    dit_linear patch;      /* patch_embedding as a linear (C, Cin pt ph pw) */
    dit_linear t1, t2, tp; /* time_embedder linear_1, linear_2, time_proj (6C, C) */
    dit_linear txt1, txt2; /* text_embedder linear_1, linear_2 */
    dit_linear proj_out;   /* (out_dim, C) */
    dit_tensor sst_out;    /* scale_shift_table (2 C) */
    wan_block *blocks;
    /* Host copies of the across-heads norm weights (4 per block, C each),
     * for the tensor-parallel path that normalises on the host. */
    float *norm_host;
    /* The linears LoRA adapters may target (parallel/lora.h). */
    dit_lora_sites *lora;
};

/* Heads (attention) and FFN columns split over the tp group; everything
 * else replicated. diffusers has no tensor-parallel plan for Wan; this one
 * follows FLUX's. The q/k RMSNorm runs across all heads, so under TP its
 * sum of squares is all-reduced (see qk_norm_rope). */
const dit_tp_rule dit_wan_tp_plan[] = {
    {"blocks.*.attn1.to_q", DIT_TP_COLWISE},     {"blocks.*.attn1.to_k", DIT_TP_COLWISE},
    {"blocks.*.attn1.to_v", DIT_TP_COLWISE},     {"blocks.*.attn1.to_out.0", DIT_TP_ROWWISE},
    {"blocks.*.attn2.to_q", DIT_TP_COLWISE},     {"blocks.*.attn2.to_k", DIT_TP_COLWISE},
    {"blocks.*.attn2.to_v", DIT_TP_COLWISE},     {"blocks.*.attn2.to_out.0", DIT_TP_ROWWISE},
    {"blocks.*.ffn.net.0.proj", DIT_TP_COLWISE}, {"blocks.*.ffn.net.2", DIT_TP_ROWWISE},
};
const int dit_wan_tp_plan_len = (int)(sizeof dit_wan_tp_plan / sizeof dit_wan_tp_plan[0]);

static dit_status plan_build(dit_weight_plan *p, dit_wan *m)
{
    const dit_wan_config *c = &m->cfg;
    const int64_t C = c->inner_dim, F = c->ffn_dim;
    const dit_tp_plan tp = {
        .rules = dit_wan_tp_plan,
        .n_rules = dit_wan_tp_plan_len,
        .tp_degree = m->shard.tp_degree,
        .tp_rank = m->shard.tp_rank,
        .sites = m->lora,
    };
    char pre[64], buf[128], n0[128], n1[128], n2[128];

    dit_tp_add_linear(p, &tp, "patch_embedding", C, c->patch_dim, &m->patch);
    dit_tp_add_linear(p, &tp, "condition_embedder.time_embedder.linear_1", C, c->freq_dim, &m->t1);
    dit_tp_add_linear(p, &tp, "condition_embedder.time_embedder.linear_2", C, C, &m->t2);
    dit_tp_add_linear(p, &tp, "condition_embedder.time_proj", 6 * C, C, &m->tp);
    dit_tp_add_linear(p, &tp, "condition_embedder.text_embedder.linear_1", C, c->text_dim,
                      &m->txt1);
    dit_tp_add_linear(p, &tp, "condition_embedder.text_embedder.linear_2", C, C, &m->txt2);
#define NAME(b, suffix) (snprintf(b, sizeof b, "%s.%s", pre, suffix), b)
    for (int i = 0; i < c->num_layers; i++) {
        wan_block *b = &m->blocks[i];
        snprintf(pre, sizeof pre, "blocks.%d", i);
        const int64_t n3[3] = {C, C, C};
        const char *qkv[3] = {NAME(n0, "attn1.to_q"), NAME(n1, "attn1.to_k"),
                              NAME(n2, "attn1.to_v")};
        dit_tp_add_fused(p, &tp, qkv, n3, 3, C, &b->qkv);
        dit_tp_add_linear(p, &tp, NAME(buf, "attn1.to_out.0"), C, C, &b->out1);
        dit_weight_plan_vector(p, &b->norm_q1, NAME(buf, "attn1.norm_q.weight"), C);
        dit_weight_plan_vector(p, &b->norm_k1, NAME(buf, "attn1.norm_k.weight"), C);
        dit_tp_add_linear(p, &tp, NAME(buf, "attn2.to_q"), C, C, &b->q2);
        const char *kv[2] = {NAME(n0, "attn2.to_k"), NAME(n1, "attn2.to_v")};
        dit_tp_add_fused(p, &tp, kv, n3, 2, C, &b->kv2);
        dit_tp_add_linear(p, &tp, NAME(buf, "attn2.to_out.0"), C, C, &b->out2);
        dit_weight_plan_vector(p, &b->norm_q2, NAME(buf, "attn2.norm_q.weight"), C);
        dit_weight_plan_vector(p, &b->norm_k2, NAME(buf, "attn2.norm_k.weight"), C);
        if (c->cross_attn_norm) {
            dit_weight_plan_vector(p, &b->norm2_w, NAME(buf, "norm2.weight"), C);
            dit_weight_plan_vector(p, &b->norm2_b, NAME(buf, "norm2.bias"), C);
        }
        dit_tp_add_linear(p, &tp, NAME(buf, "ffn.net.0.proj"), F, C, &b->ff0);
        dit_tp_add_linear(p, &tp, NAME(buf, "ffn.net.2"), C, F, &b->ff2);
        dit_weight_plan_vector(p, &b->sst, NAME(buf, "scale_shift_table"), 6 * C);
    }
#undef NAME
    dit_tp_add_linear(p, &tp, "proj_out", c->out_dim, C, &m->proj_out);
    dit_weight_plan_vector(p, &m->sst_out, "scale_shift_table", 2 * C);
    return p->oom ? DIT_ERR_NOMEM : DIT_OK;
}

dit_status dit_wan_load(dit_backend *be, const char *dir, const dit_shard *shard, dit_wan **out,
                        dit_diag *diag)
{
    char path[4096];
    dit_wan_config cfg;
    dit_st_set *set = NULL;
    dit_wan *m = NULL;
    dit_weight_plan plan;
    memset(&plan, 0, sizeof plan);
    dit_status st;
    dit_shard sh = shard ? *shard : (dit_shard){.tp_degree = 1, .tp_rank = 0};

    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(dit_wan_config_load(path, &cfg, diag));
    if (sh.tp_degree < 1 || sh.tp_rank < 0 || sh.tp_rank >= sh.tp_degree) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "tensor parallel rank %d of degree %d",
                          sh.tp_rank, sh.tp_degree);
        goto cleanup;
    }
    if (cfg.num_attention_heads % sh.tp_degree != 0 || cfg.ffn_dim % sh.tp_degree != 0) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                          "tp_degree %d must divide num_attention_heads %d and ffn_dim %d",
                          sh.tp_degree, cfg.num_attention_heads, cfg.ffn_dim);
        goto cleanup;
    }
    DIT_CHECK(dit_st_set_open_dir(dir, "diffusion_pytorch_model", &set, diag));
    DIT_CHECK(dit_weight_check_blocks(set, "blocks", cfg.num_layers, "num_layers", dir, diag));
    m = calloc(1, sizeof *m);
    if (!m) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "wan: out of memory");
        goto cleanup;
    }
    m->be = be;
    m->cfg = cfg;
    m->shard = sh;
    m->blocks = calloc((size_t)cfg.num_layers + 1, sizeof *m->blocks);
    m->norm_host = malloc(((size_t)cfg.num_layers * 4 + 1) * (size_t)cfg.inner_dim * sizeof(float));
    if (!m->blocks || !m->norm_host) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "wan: out of memory");
        goto cleanup;
    }
    dit_weight_plan_init(&plan, be->ops->weight_dtype);
    DIT_CHECK(dit_lora_sites_create(NULL, &m->lora, diag));
    DIT_CHECK(plan_build(&plan, m));
    DIT_CHECK(dit_weight_plan_check(&plan, set, dir, "WanTransformer3DModel", diag));
    st = dit_backend_alloc(be, plan.bytes, &m->weights);
    if (st != DIT_OK) {
        st = dit_diag_set(diag, st, "wan: cannot allocate %.1f MiB of weights",
                          (double)plan.bytes / 1048576.0);
        goto cleanup;
    }
    m->weight_bytes = plan.bytes;
    dit_weight_plan_place(&plan, m->weights);
    DIT_CHECK(dit_weight_plan_load(&plan, be, set, dir, "WanTransformer3DModel", diag));
    for (int i = 0; i < cfg.num_layers; i++) {
        const dit_tensor *w[4] = {&m->blocks[i].norm_q1, &m->blocks[i].norm_k1,
                                  &m->blocks[i].norm_q2, &m->blocks[i].norm_k2};
        for (int j = 0; j < 4; j++) {
            dit_tensor h = dit_tensor_1d(m->norm_host + ((size_t)i * 4 + j) * cfg.inner_dim,
                                         DIT_F32, cfg.inner_dim);
            DIT_CHECK(be->ops->download(be, &h, w[j]));
        }
    }
    *out = m;
    m = NULL;
cleanup:
    dit_weight_plan_free(&plan);
    dit_wan_destroy(m);
    dit_st_set_close(set);
    return st;
}

void dit_wan_destroy(dit_wan *m)
{
    if (!m)
        return;
    dit_lora_sites_destroy(m->lora);
    dit_backend_free(m->be, m->weights);
    free(m->blocks);
    free(m->norm_host);
    free(m);
}

const dit_wan_config *dit_wan_config_of(const dit_wan *m)
{
    return &m->cfg;
}

size_t dit_wan_weight_bytes(const dit_wan *m)
{
    return m->weight_bytes;
}

dit_lora_sites *dit_wan_lora_sites(dit_wan *m)
{
    return m->lora;
}

void dit_wan_set_hooks(dit_wan *m, const dit_model_hooks *hooks)
{
    if (hooks)
        m->hooks = *hooks;
    else
        memset(&m->hooks, 0, sizeof m->hooks);
}

/* ------------------------------------------------------------------------ */
/* Host-side pieces                                                          */

/* diffusers' Timesteps(freq_dim, flip_sin_to_cos=True, shift 0): cos first,
 * with the f32 operations of get_timestep_embedding. */
static void timestep_embedding(const float *t, int64_t B, int dim, float *out)
{
    const int half = dim / 2;
    const float neg_log_period = (float)-9.210340371976184; /* -ln(10000) */
    for (int64_t b = 0; b < B; b++) {
        for (int j = 0; j < half; j++) {
            const float freq = expf(neg_log_period * (float)j / (float)half);
            const float arg = t[b] * freq;
            out[b * dim + j] = cosf(arg);
            out[b * dim + half + j] = sinf(arg);
        }
    }
}

/* WanRotaryPosEmbed: the head dim splits into (t, h, w) widths; pair i of
 * an axis of width d rotates by pos 10000^(-2i/d), in f64 as diffusers'
 * buffers are. cosb, sinb (S, D/2) for tokens in (frame, row, col) order. */
static void rope_tables(const dit_wan_config *c, int64_t pf, int64_t ph, int64_t pw, double *cosb,
                        double *sinb)
{
    const int64_t half = c->attention_head_dim / 2;
    const int widths[3] = {c->rope_t, c->rope_h, c->rope_w};
    for (int64_t f = 0; f < pf; f++)
        for (int64_t h = 0; h < ph; h++)
            for (int64_t w = 0; w < pw; w++) {
                const int64_t s = (f * ph + h) * pw + w;
                const int64_t pos[3] = {f, h, w};
                int64_t off = 0;
                for (int a = 0; a < 3; a++) {
                    const int d = widths[a];
                    for (int i = 0; i < d / 2; i++) {
                        const double freq = 1.0 / pow(10000.0, (double)(2 * i) / (double)d);
                        const double ang = (double)pos[a] * freq;
                        cosb[s * half + off + i] = cos(ang);
                        sinb[s * half + off + i] = sin(ang);
                    }
                    off += d / 2;
                }
            }
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

typedef struct fwd {
    dit_wan *m;
    dit_backend *be;
    dit_arena *arena;
    dit_diag *diag;
    int64_t B, S, L, C, D, Hl, Cl, Fl;
    int64_t tok0; /* this rank's first token (S tokens from it) */
    float scale, eps;
    dit_tensor x;        /* (B, S, C) residual stream */
    dit_tensor n;        /* (B, S, C) normalised (+ modulated) */
    dit_tensor y;        /* (B, S, max(3 Cl, Fl)) projections */
    dit_tensor attn;     /* (B, S, Cl) attention output */
    dit_tensor o;        /* (B, S, C) sub-layer output before its gate */
    dit_tensor ctx;      /* (B, L, C) projected text */
    dit_tensor kv;       /* (B, L, 2 Cl) cross-attention keys and values */
    dit_tensor temb;     /* (B, C) */
    dit_tensor tproj;    /* (B, 6C) time_proj(SiLU(temb)) */
    dit_tensor e;        /* (B, 6C) a block's modulation: tproj + its table */
    double *cosb, *sinb; /* (all tokens, D/2) host RoPE */
    float *host;         /* (B, S, Cl) host scratch for q/k */
    float *ss;           /* (B S) host sums of squares */
    dit_tensor ss_dev;   /* (B rows) device copy for their all-reduce */
} fwd;

#define BE(call)                                                                                   \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(f->diag, st, "wan forward: %s failed: %s", #call,                    \
                              dit_status_str(st));                                                 \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

static dit_status linear(fwd *f, const dit_tensor *y, const dit_tensor *x, const dit_linear *L,
                         dit_act act)
{
    return dit_lora_linear(f->be, f->arena, y, x, L, act, 0.0f);
}

static dit_tensor feat(const dit_tensor *t, int64_t start, int64_t len)
{
    return dit_tensor_narrow(t, t->ndim - 1, start, len);
}

static dit_status tp_reduce(fwd *f, const dit_tensor *t)
{
    if (!f->m->hooks.tp_all_reduce || f->m->shard.tp_degree == 1)
        return DIT_OK;
    return f->m->hooks.tp_all_reduce(f->m->hooks.ctx, t, f->diag);
}

/* WanAttention's norm_q / norm_k: RMSNorm over all heads (the C features),
 * then, when cos is given, RoPE on interleaved pairs. x (B, rows, Cl) is a
 * view of this rank's heads; w_host (C) the whole norm weight. On one rank
 * the norm is the backend's; under tensor parallelism each rank holds Cl of
 * the C features, so the row sums of squares are all-reduced first. RoPE
 * runs on the host: diffusers rotates with f64 tables. */
static dit_status qk_norm_rope(fwd *f, const dit_tensor *x, const dit_tensor *w,
                               const float *w_host, bool rope)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const bool tp = f->m->shard.tp_degree > 1;
    if (!tp) {
        BE(be->ops->rms_norm(be, x, x, w, f->eps));
        if (!rope)
            return DIT_OK;
    }
    const int64_t B = x->ne[0], R = x->ne[1], Cl = f->Cl, half = f->D / 2;
    dit_tensor h = dit_tensor_3d(f->host, DIT_F32, B, R, Cl);
    BE(be->ops->download(be, &h, x));
    if (tp) {
        for (int64_t r = 0; r < B * R; r++) {
            double sq = 0.0;
            const float *v = f->host + r * Cl;
            for (int64_t d = 0; d < Cl; d++)
                sq += (double)v[d] * v[d];
            f->ss[r] = (float)sq;
        }
        dit_tensor hs = dit_tensor_3d(f->ss, DIT_F32, B, R, 1);
        dit_tensor ds = dit_tensor_3d(f->ss_dev.data, DIT_F32, B, R, 1);
        BE(be->ops->upload(be, &ds, &hs));
        BE(tp_reduce(f, &ds));
        BE(be->ops->download(be, &hs, &ds));
        const float *wl = w_host + f->m->shard.tp_rank * Cl;
        for (int64_t r = 0; r < B * R; r++) {
            float *v = f->host + r * Cl;
            const float rinv = 1.0f / sqrtf(f->ss[r] / (float)f->C + f->eps);
            for (int64_t d = 0; d < Cl; d++)
                v[d] = v[d] * rinv * wl[d];
        }
    }
    if (rope) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t s = 0; s < R; s++) {
                float *v = f->host + (b * R + s) * Cl;
                const double *cs = f->cosb + (f->tok0 + s) * half;
                const double *sn = f->sinb + (f->tok0 + s) * half;
                for (int64_t hd = 0; hd < Cl / f->D; hd++)
                    for (int64_t i = 0; i < half; i++) {
                        float *p = v + hd * f->D + 2 * i;
                        const double a = p[0], c = p[1];
                        p[0] = (float)(a * cs[i] - c * sn[i]);
                        p[1] = (float)(a * sn[i] + c * cs[i]);
                    }
            }
    }
    BE(be->ops->upload(be, x, &h));
cleanup:
    return st;
}

static dit_status self_attention(fwd *f, const dit_tensor *q, const dit_tensor *k,
                                 const dit_tensor *v, const dit_tensor *out)
{
    if (f->m->hooks.attention)
        return f->m->hooks.attention(f->m->hooks.ctx, f->arena, out, q, k, v, f->scale, f->diag);
    return f->be->ops->attention(f->be, out, NULL, q, k, v, f->scale);
}

static dit_status block(fwd *f, const wan_block *w, const float *norms_host)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const int64_t C = f->C, Cl = f->Cl, D = f->D, Fl = f->Fl;

    /* e = scale_shift_table + time_proj, chunked (shift, scale, gate,
     * c_shift, c_scale, c_gate). */
    BE(be->ops->copy(be, &f->e, &f->tproj));
    for (int64_t b = 0; b < f->B; b++) {
        dit_tensor eb = dit_tensor_narrow(&f->e, 0, b, 1);
        dit_tensor e3 = dit_tensor_split_last(&eb, 6 * C); /* (1, 1, 6C) */
        dit_tensor t3 = dit_tensor_3d(w->sst.data, DIT_F32, 1, 1, 6 * C);
        BE(be->ops->gated_add(be, &e3, &t3, NULL));
    }
    dit_tensor shift = feat(&f->e, 0, C), scale = feat(&f->e, C, C), gate = feat(&f->e, 2 * C, C);
    dit_tensor c_shift = feat(&f->e, 3 * C, C), c_scale = feat(&f->e, 4 * C, C);
    dit_tensor c_gate = feat(&f->e, 5 * C, C);

    /* 1. Self-attention with RoPE. */
    BE(be->ops->layer_norm_mod(be, &f->n, &f->x, &shift, &scale, f->eps));
    dit_tensor qkv = feat(&f->y, 0, 3 * Cl);
    BE(linear(f, &qkv, &f->n, &w->qkv, DIT_ACT_NONE));
    dit_tensor q = feat(&qkv, 0, Cl), k = feat(&qkv, Cl, Cl), v = feat(&qkv, 2 * Cl, Cl);
    BE(qk_norm_rope(f, &q, &w->norm_q1, norms_host, true));
    BE(qk_norm_rope(f, &k, &w->norm_k1, norms_host + C, true));
    dit_tensor q4 = dit_tensor_split_last(&q, D), k4 = dit_tensor_split_last(&k, D);
    dit_tensor v4 = dit_tensor_split_last(&v, D), a4 = dit_tensor_split_last(&f->attn, D);
    BE(self_attention(f, &q4, &k4, &v4, &a4));
    BE(linear(f, &f->o, &f->attn, &w->out1, DIT_ACT_NONE));
    BE(tp_reduce(f, &f->o));
    BE(be->ops->gated_add(be, &f->x, &f->o, &gate));

    /* 2. Cross-attention to the text (local to the rank: no hook). */
    if (f->m->cfg.cross_attn_norm)
        BE(be->ops->layer_norm(be, &f->n, &f->x, &w->norm2_w, &w->norm2_b, f->eps));
    else
        BE(be->ops->copy(be, &f->n, &f->x));
    dit_tensor q2 = feat(&f->y, 0, Cl);
    BE(linear(f, &q2, &f->n, &w->q2, DIT_ACT_NONE));
    BE(linear(f, &f->kv, &f->ctx, &w->kv2, DIT_ACT_NONE));
    dit_tensor k2 = feat(&f->kv, 0, Cl), v2 = feat(&f->kv, Cl, Cl);
    BE(qk_norm_rope(f, &q2, &w->norm_q2, norms_host + 2 * C, false));
    BE(qk_norm_rope(f, &k2, &w->norm_k2, norms_host + 3 * C, false));
    q4 = dit_tensor_split_last(&q2, D);
    k4 = dit_tensor_split_last(&k2, D);
    v4 = dit_tensor_split_last(&v2, D);
    BE(be->ops->attention(be, &a4, NULL, &q4, &k4, &v4, f->scale));
    BE(linear(f, &f->o, &f->attn, &w->out2, DIT_ACT_NONE));
    BE(tp_reduce(f, &f->o));
    BE(be->ops->gated_add(be, &f->x, &f->o, NULL));

    /* 3. Feed-forward, GELU(tanh). */
    BE(be->ops->layer_norm_mod(be, &f->n, &f->x, &c_shift, &c_scale, f->eps));
    dit_tensor hid = feat(&f->y, 0, Fl);
    BE(linear(f, &hid, &f->n, &w->ff0, DIT_ACT_GELU_TANH));
    BE(linear(f, &f->o, &hid, &w->ff2, DIT_ACT_NONE));
    BE(tp_reduce(f, &f->o));
    BE(be->ops->gated_add(be, &f->x, &f->o, &c_gate));
cleanup:
    return st;
}

static dit_status scratch(fwd *f, dit_tensor *t, int ndim, int64_t n0, int64_t n1, int64_t n2)
{
    const int64_t shape[3] = {n0, n1, n2};
    dit_status st = dit_arena_tensor(f->arena, DIT_F32, ndim, shape, t);
    if (st != DIT_OK)
        return dit_diag_set(f->diag, st, "wan forward: out of device memory for activations");
    return DIT_OK;
}

/* Unpatchify: features (i, j, k, c) of token (f, h, w) go to
 * [c, f pt + i, h ph + j, w pw + k]. */
void dit_wan_unpatchify(const dit_wan_config *c, const float *tok, int64_t B, int64_t NF,
                        int64_t NH, int64_t NW, float *out)
{
    const int pt = c->patch_size[0], ph = c->patch_size[1], pw = c->patch_size[2];
    const int64_t phh = NH / ph, pww = NW / pw, S = NF / pt * phh * pww, O = c->out_dim;
    const int64_t Co = c->out_channels;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++) {
            const int64_t fi = s / (phh * pww), hi = (s / pww) % phh, wi = s % pww;
            const float *v = tok + (b * S + s) * O;
            for (int i = 0; i < pt; i++)
                for (int j = 0; j < ph; j++)
                    for (int k = 0; k < pw; k++)
                        for (int64_t ch = 0; ch < Co; ch++)
                            out[(((b * Co + ch) * NF + fi * pt + i) * NH + hi * ph + j) * NW +
                                wi * pw + k] = *v++;
        }
}

dit_status dit_wan_forward(dit_wan *m, dit_arena *arena, const dit_wan_inputs *in,
                           const dit_tensor *sample, dit_diag *diag)
{
    const dit_wan_config *c = &m->cfg;
    dit_backend *be = m->be;
    const dit_tensor *hs = in->hidden_states;
    const dit_tensor *ehs = &in->encoder_hidden_states;
    const int pt = c->patch_size[0], ph = c->patch_size[1], pw = c->patch_size[2];
    if (!hs || hs->ndim != 5 || hs->dtype != DIT_F32 || !dit_tensor_is_contiguous(hs) ||
        hs->ne[1] != c->in_channels || hs->ne[2] % pt || hs->ne[3] % ph || hs->ne[4] % pw ||
        ehs->ndim != 3 || ehs->ne[0] != hs->ne[0] || ehs->ne[2] != c->text_dim || !in->timestep)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "wan forward: inputs do not match the config");
    const int64_t B = hs->ne[0], Cin = c->in_channels;
    const int64_t NF = hs->ne[2], NH = hs->ne[3], NW = hs->ne[4];
    const int64_t pf = NF / pt, phh = NH / ph, pww = NW / pw;
    if (pf > c->rope_max_seq_len || phh > c->rope_max_seq_len || pww > c->rope_max_seq_len)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "wan forward: %lld x %lld x %lld patches exceed rope_max_seq_len %d",
                            (long long)pf, (long long)phh, (long long)pww, c->rope_max_seq_len);
    const int64_t out_shape[5] = {B, c->out_channels, NF, NH, NW};
    const int64_t S_all = pf * phh * pww;
    /* A 3-D sample takes this rank's tokens, not unpatchified: all of them,
     * or the context-parallel layout's chunk. */
    const bool tokens_out = sample->ndim == 3;
    int64_t tok0 = 0, S_mine = S_all;
    if (tokens_out && m->hooks.cp_layout) {
        const dit_cp_layout *lay = m->hooks.cp_layout;
        if (lay->n_seqs != 1 || lay->seq_len[0] != S_all)
            return dit_diag_set(diag, DIT_ERR_INTERNAL,
                                "wan forward: the layout does not match the video tokens");
        tok0 = lay->off[0][lay->cp_rank];
        S_mine = lay->len[0][lay->cp_rank];
    }
    if (tokens_out) {
        if (sample->ne[0] != B || sample->ne[1] != S_mine || sample->ne[2] != c->out_dim)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "wan forward: sample must be (B, tokens, out_dim)");
    } else {
        for (int i = 0; i < 5; i++)
            if (sample->ndim != 5 || sample->ne[i] != out_shape[i])
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "wan forward: sample must be (B, out_channels, F, H, W)");
    }

    dit_status st = DIT_OK;
    fwd fw, *f = &fw;
    memset(f, 0, sizeof *f);
    f->m = m;
    f->be = be;
    f->arena = arena;
    f->diag = diag;
    f->B = B;
    f->S = S_mine;
    f->tok0 = tok0;
    f->L = ehs->ne[1];
    f->C = c->inner_dim;
    f->D = c->attention_head_dim;
    f->Hl = c->num_attention_heads / m->shard.tp_degree;
    f->Cl = f->Hl * f->D;
    f->Fl = c->ffn_dim / m->shard.tp_degree;
    f->scale = 1.0f / sqrtf((float)f->D);
    f->eps = c->eps;
    const int64_t S = f->S, C = f->C, P = c->patch_dim, O = c->out_dim;
    const int64_t ywidth = 3 * f->Cl > f->Fl ? 3 * f->Cl : f->Fl;
    const int64_t rows = S > f->L ? S : f->L;
    float *tok = NULL;
    const size_t tok_n = (size_t)(B * S) * (size_t)(P > O ? P : O);
    tok = malloc(tok_n * sizeof(float));
    f->cosb = malloc((size_t)S_all * (size_t)(f->D / 2) * sizeof(double));
    f->sinb = malloc((size_t)S_all * (size_t)(f->D / 2) * sizeof(double));
    f->host = malloc((size_t)(B * rows * f->Cl) * sizeof(float));
    f->ss = malloc((size_t)(B * rows) * sizeof(float));
    float *tfreq = malloc((size_t)(B * c->freq_dim) * sizeof(float));
    if (!tok || !f->cosb || !f->sinb || !f->host || !f->ss || !tfreq) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "wan forward: out of host memory");
        goto cleanup;
    }
    DIT_CHECK(scratch(f, &f->x, 3, B, S, C));
    DIT_CHECK(scratch(f, &f->n, 3, B, S, C));
    DIT_CHECK(scratch(f, &f->y, 3, B, S, ywidth));
    DIT_CHECK(scratch(f, &f->attn, 3, B, S, f->Cl));
    DIT_CHECK(scratch(f, &f->o, 3, B, S, C));
    DIT_CHECK(scratch(f, &f->ctx, 3, B, f->L, C));
    DIT_CHECK(scratch(f, &f->kv, 3, B, f->L, 2 * f->Cl));
    DIT_CHECK(scratch(f, &f->temb, 2, B, C, 0));
    DIT_CHECK(scratch(f, &f->tproj, 2, B, 6 * C, 0));
    DIT_CHECK(scratch(f, &f->e, 2, B, 6 * C, 0));
    DIT_CHECK(scratch(f, &f->ss_dev, 1, B * rows, 0, 0));
    dit_tensor tin, th, tlin, yo;
    DIT_CHECK(scratch(f, &tin, 3, B, S, P));
    DIT_CHECK(scratch(f, &th, 2, B, c->freq_dim, 0));
    DIT_CHECK(scratch(f, &tlin, 3, B, f->L, C));
    DIT_CHECK(scratch(f, &yo, 3, B, S, O));

    /* Patchify: token (f, h, w) gets features (c, i, j, k), Conv3d's weight
     * order. */
    const float *src = hs->data;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++) {
            const int64_t g = tok0 + s;
            const int64_t fi = g / (phh * pww), hi = (g / pww) % phh, wi = g % pww;
            float *dst = tok + (b * S + s) * P;
            for (int64_t ch = 0; ch < Cin; ch++)
                for (int i = 0; i < pt; i++)
                    for (int j = 0; j < ph; j++)
                        for (int k = 0; k < pw; k++)
                            *dst++ =
                                src[(((b * Cin + ch) * NF + fi * pt + i) * NH + hi * ph + j) * NW +
                                    wi * pw + k];
        }
    dit_tensor htok = dit_tensor_3d(tok, DIT_F32, B, S, P);
    BE(be->ops->upload(be, &tin, &htok));
    BE(linear(f, &f->x, &tin, &m->patch, DIT_ACT_NONE));
    rope_tables(c, pf, phh, pww, f->cosb, f->sinb);

    /* Condition embeddings: temb = MLP(sinusoids), tproj = time_proj(SiLU
     * (temb)), text = Linear-GELU(tanh)-Linear. */
    timestep_embedding(in->timestep, B, c->freq_dim, tfreq);
    dit_tensor htf = dit_tensor_2d(tfreq, DIT_F32, B, c->freq_dim);
    BE(be->ops->upload(be, &th, &htf));
    dit_tensor h1 = feat(&f->e, 0, C);
    BE(linear(f, &h1, &th, &m->t1, DIT_ACT_SILU));
    BE(linear(f, &f->temb, &h1, &m->t2, DIT_ACT_NONE));
    BE(be->ops->activate(be, &h1, &f->temb, DIT_ACT_SILU));
    BE(linear(f, &f->tproj, &h1, &m->tp, DIT_ACT_NONE));
    BE(linear(f, &tlin, ehs, &m->txt1, DIT_ACT_GELU_TANH));
    BE(linear(f, &f->ctx, &tlin, &m->txt2, DIT_ACT_NONE));

    for (int i = 0; i < c->num_layers; i++) {
        BE(block(f, &m->blocks[i], m->norm_host + (size_t)i * 4 * (size_t)C));
        if (m->hooks.block_done)
            DIT_CHECK(m->hooks.block_done(m->hooks.ctx, i, diag));
    }

    /* Output: (shift, scale) = table + temb; LayerNorm, modulate, project. */
    dit_tensor mod = feat(&f->e, 0, 2 * C);
    for (int64_t b = 0; b < B; b++)
        for (int half = 0; half < 2; half++) {
            dit_tensor dst = dit_tensor_narrow(&mod, 0, b, 1);
            dst = feat(&dst, half * C, C);
            dit_tensor tb = dit_tensor_narrow(&f->temb, 0, b, 1);
            BE(be->ops->copy(be, &dst, &tb));
            dit_tensor d3 = dit_tensor_split_last(&dst, C);
            dit_tensor t3 = dit_tensor_3d((float *)m->sst_out.data + half * C, DIT_F32, 1, 1, C);
            BE(be->ops->gated_add(be, &d3, &t3, NULL));
        }
    dit_tensor oshift = feat(&mod, 0, C), oscale = feat(&mod, C, C);
    BE(be->ops->layer_norm_mod(be, &f->n, &f->x, &oshift, &oscale, f->eps));
    BE(linear(f, &yo, &f->n, &m->proj_out, DIT_ACT_NONE));

    if (tokens_out) {
        BE(be->ops->copy(be, sample, &yo));
        BE(be->ops->sync(be));
        goto cleanup;
    }
    dit_tensor hy = dit_tensor_3d(tok, DIT_F32, B, S, O);
    BE(be->ops->download(be, &hy, &yo));
    float *outh = malloc((size_t)(B * S * O) * sizeof(float));
    if (!outh) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "wan forward: out of host memory");
        goto cleanup;
    }
    dit_wan_unpatchify(c, tok, B, NF, NH, NW, outh);
    dit_tensor hout = dit_tensor_make(outh, DIT_F32, 5, out_shape);
    st = be->ops->upload(be, sample, &hout);
    if (st == DIT_OK)
        st = be->ops->sync(be);
    free(outh);
    if (st != DIT_OK)
        st = dit_diag_set(diag, st, "wan forward: writing the sample failed");
cleanup:
    free(tok);
    free(f->cosb);
    free(f->sinb);
    free(f->host);
    free(f->ss);
    free(tfreq);
    return st;
}

double dit_wan_forward_flops(const dit_wan_config *c, int64_t B, int64_t S, int64_t L)
{
    const double C = c->inner_dim, F = c->ffn_dim;
    const double per_block = 2.0 * B * S * C * (3 * C + C + C + C + 2 * F) +
                             2.0 * B * L * C * 2 * C + 4.0 * B * S * S * C + 4.0 * B * S * L * C;
    return c->num_layers * per_block + 2.0 * B * S * C * (c->patch_dim + c->out_dim) +
           2.0 * B * L * C * (c->text_dim + C);
}
