/* FluxTransformer2DModel on the backend interface. See flux.h for the layout
 * of activations; the weight plan below is the single place that knows how
 * checkpoint tensors map onto (possibly sliced, possibly fused) device
 * tensors. */
#include "models/flux/flux.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/graph_cache.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "parallel/lora.h"
#include "parallel/tp_plan.h"

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */

typedef dit_linear flux_linear; /* w (N, K), b (N) as this rank holds them */

typedef struct flux_double {
    flux_linear norm1, norm1_ctx; /* AdaLayerNormZero linears (6C, C) */
    flux_linear qkv, add_qkv;     /* fused [q; k; v] (3 Cl, C) for image / text */
    dit_tensor norm_q, norm_k;    /* (D) */
    dit_tensor norm_added_q, norm_added_k;
    flux_linear to_out, to_add_out; /* (C, Cl), row-split */
    flux_linear ff0, ffc0;          /* (Fl, C), column-split */
    flux_linear ff2, ffc2;          /* (C, Fl), row-split */
} flux_double;

typedef struct flux_single {
    flux_linear norm;    /* AdaLayerNormZeroSingle linear (3C, C) */
    flux_linear qkv_mlp; /* fused [q; k; v; proj_mlp] (3 Cl + Fl, C) */
    dit_tensor norm_q, norm_k;
    flux_linear proj_attn; /* proj_out columns of the attention block (C, Cl) + bias */
    flux_linear proj_mlp;  /* proj_out columns of the MLP block (C, Fl), no bias */
} flux_single;

/* What a captured forward depends on besides the weights: shapes and every
 * device address it reads or writes. Compared bytewise (memset first). */
typedef struct flux_graph_key {
    int64_t B, St, Si;
    int64_t guidance; /* 0 or 1; int64_t so the struct has no padding */
    int64_t fast;     /* the bf16-operand layout (fwd.fast): other kernels */
    dit_tensor hs, ehs, pooled, sample;
    void *arena_first, *arena_x, *arena_last;
} flux_graph_key;

struct dit_flux {
    dit_backend *be;
    /* CUDA-graph replay of the per-step forward (see dit_flux_set_graphs). */
    dit_graph_cache *graphs;
    /* The RoPE tables of the last ids seen: every denoising step of a
     * request has the same ids, and the tables cost ~S D pow/cos/sin. */
    float *rope_ids, *rope_cos, *rope_sin;
    int64_t rope_St, rope_Si;
    dit_flux_config cfg;
    dit_flux_shard shard;
    dit_flux_hooks hooks;
    void *weights;
    size_t weight_bytes;
    flux_linear x_emb, ctx_emb;
    flux_linear t1, t2, g1, g2, p1, p2; /* timestep, guidance, pooled-text MLPs */
    flux_linear norm_out, proj_out;
    flux_double *dbl;
    flux_single *sgl;
    /* The linears LoRA adapters may target (parallel/lora.h). */
    dit_lora_sites *lora;
};

/* diffusers' FluxTransformer2DModel tensor-parallel plan, plus the AdaLN
 * modulation linears split by output rows and all-gathered (a quarter of
 * FLUX's weights, which diffusers replicates: sharding them is what makes
 * per-rank memory fall as 1/T). Everything else (embedders, QK norms,
 * norm_out's LayerNorm, the final proj_out) is replicated. The forward pass
 * is written for exactly this split: heads [r H/T, (r+1) H/T) and MLP
 * columns [r F/T, (r+1) F/T) per rank, one all-reduce after each row-split
 * sub-layer. */
const dit_tp_rule dit_flux_tp_plan[] = {
    {"transformer_blocks.*.norm1.linear", DIT_TP_COLWISE_GATHER},
    {"transformer_blocks.*.norm1_context.linear", DIT_TP_COLWISE_GATHER},
    {"transformer_blocks.*.attn.to_q", DIT_TP_COLWISE},
    {"transformer_blocks.*.attn.to_k", DIT_TP_COLWISE},
    {"transformer_blocks.*.attn.to_v", DIT_TP_COLWISE},
    {"transformer_blocks.*.attn.add_q_proj", DIT_TP_COLWISE},
    {"transformer_blocks.*.attn.add_k_proj", DIT_TP_COLWISE},
    {"transformer_blocks.*.attn.add_v_proj", DIT_TP_COLWISE},
    {"transformer_blocks.*.attn.to_out.0", DIT_TP_ROWWISE},
    {"transformer_blocks.*.attn.to_add_out", DIT_TP_ROWWISE},
    {"transformer_blocks.*.ff.net.0.proj", DIT_TP_COLWISE},
    {"transformer_blocks.*.ff_context.net.0.proj", DIT_TP_COLWISE},
    {"transformer_blocks.*.ff.net.2", DIT_TP_ROWWISE},
    {"transformer_blocks.*.ff_context.net.2", DIT_TP_ROWWISE},
    {"single_transformer_blocks.*.norm.linear", DIT_TP_COLWISE_GATHER},
    {"single_transformer_blocks.*.attn.to_q", DIT_TP_COLWISE},
    {"single_transformer_blocks.*.attn.to_k", DIT_TP_COLWISE},
    {"single_transformer_blocks.*.attn.to_v", DIT_TP_COLWISE},
    {"single_transformer_blocks.*.proj_mlp", DIT_TP_COLWISE},
    {"single_transformer_blocks.*.proj_out", DIT_TP_PACKED_ROWS},
    {"norm_out.linear", DIT_TP_COLWISE_GATHER},
};
const int dit_flux_tp_plan_len = (int)(sizeof dit_flux_tp_plan / sizeof dit_flux_tp_plan[0]);

static dit_status plan_build(dit_weight_plan *p, dit_flux *m)
{
    const dit_flux_config *c = &m->cfg;
    const int64_t C = c->inner_dim, D = c->attention_head_dim, F = c->mlp_dim;
    const dit_tp_plan tp = {
        .rules = dit_flux_tp_plan,
        .n_rules = dit_flux_tp_plan_len,
        .tp_degree = m->shard.tp_degree,
        .tp_rank = m->shard.tp_rank,
        .sites = m->lora,
    };
    char pre[96], buf[128], n0[128], n1[128], n2[128], n3[128];

    dit_tp_add_linear(p, &tp, "x_embedder", C, c->in_channels, &m->x_emb);
    dit_tp_add_linear(p, &tp, "context_embedder", C, c->joint_attention_dim, &m->ctx_emb);
    dit_tp_add_linear(p, &tp, "time_text_embed.timestep_embedder.linear_1", C, 256, &m->t1);
    dit_tp_add_linear(p, &tp, "time_text_embed.timestep_embedder.linear_2", C, C, &m->t2);
    if (c->guidance_embeds) {
        dit_tp_add_linear(p, &tp, "time_text_embed.guidance_embedder.linear_1", C, 256, &m->g1);
        dit_tp_add_linear(p, &tp, "time_text_embed.guidance_embedder.linear_2", C, C, &m->g2);
    }
    dit_tp_add_linear(p, &tp, "time_text_embed.text_embedder.linear_1", C, c->pooled_projection_dim,
                      &m->p1);
    dit_tp_add_linear(p, &tp, "time_text_embed.text_embedder.linear_2", C, C, &m->p2);

#define NAME(b, suffix) (snprintf(b, sizeof b, "%s.%s", pre, suffix), b)
    for (int i = 0; i < c->num_layers; i++) {
        flux_double *b = &m->dbl[i];
        snprintf(pre, sizeof pre, "transformer_blocks.%d", i);
        dit_tp_add_linear(p, &tp, NAME(buf, "norm1.linear"), 6 * C, C, &b->norm1);
        dit_tp_add_linear(p, &tp, NAME(buf, "norm1_context.linear"), 6 * C, C, &b->norm1_ctx);
        const int64_t n3c[3] = {C, C, C};
        const char *qkv[3] = {NAME(n0, "attn.to_q"), NAME(n1, "attn.to_k"), NAME(n2, "attn.to_v")};
        dit_tp_add_fused(p, &tp, qkv, n3c, 3, C, &b->qkv);
        const char *add_qkv[3] = {NAME(n0, "attn.add_q_proj"), NAME(n1, "attn.add_k_proj"),
                                  NAME(n2, "attn.add_v_proj")};
        dit_tp_add_fused(p, &tp, add_qkv, n3c, 3, C, &b->add_qkv);
        dit_weight_plan_vector(p, &b->norm_q, NAME(buf, "attn.norm_q.weight"), D);
        dit_weight_plan_vector(p, &b->norm_k, NAME(buf, "attn.norm_k.weight"), D);
        dit_weight_plan_vector(p, &b->norm_added_q, NAME(buf, "attn.norm_added_q.weight"), D);
        dit_weight_plan_vector(p, &b->norm_added_k, NAME(buf, "attn.norm_added_k.weight"), D);
        dit_tp_add_linear(p, &tp, NAME(buf, "attn.to_out.0"), C, C, &b->to_out);
        dit_tp_add_linear(p, &tp, NAME(buf, "attn.to_add_out"), C, C, &b->to_add_out);
        dit_tp_add_linear(p, &tp, NAME(buf, "ff.net.0.proj"), F, C, &b->ff0);
        dit_tp_add_linear(p, &tp, NAME(buf, "ff_context.net.0.proj"), F, C, &b->ffc0);
        dit_tp_add_linear(p, &tp, NAME(buf, "ff.net.2"), C, F, &b->ff2);
        dit_tp_add_linear(p, &tp, NAME(buf, "ff_context.net.2"), C, F, &b->ffc2);
    }
    for (int i = 0; i < c->num_single_layers; i++) {
        flux_single *s = &m->sgl[i];
        snprintf(pre, sizeof pre, "single_transformer_blocks.%d", i);
        dit_tp_add_linear(p, &tp, NAME(buf, "norm.linear"), 3 * C, C, &s->norm);
        /* One GEMM for q, k, v and the MLP input. */
        const int64_t nq[4] = {C, C, C, F};
        const char *qkv_mlp[4] = {NAME(n0, "attn.to_q"), NAME(n1, "attn.to_k"),
                                  NAME(n2, "attn.to_v"), NAME(n3, "proj_mlp")};
        dit_tp_add_fused(p, &tp, qkv_mlp, nq, 4, C, &s->qkv_mlp);
        dit_weight_plan_vector(p, &s->norm_q, NAME(buf, "attn.norm_q.weight"), D);
        dit_weight_plan_vector(p, &s->norm_k, NAME(buf, "attn.norm_k.weight"), D);
        /* proj_out's input is cat([attn (C), mlp (F)]): each block splits on
         * its own, matching how the two halves were column-split. */
        const int64_t widths[2] = {C, F};
        flux_linear *const proj[2] = {&s->proj_attn, &s->proj_mlp};
        dit_tp_add_packed(p, &tp, NAME(buf, "proj_out"), C, widths, 2, proj);
    }
#undef NAME
    dit_tp_add_linear(p, &tp, "norm_out.linear", 2 * C, C, &m->norm_out);
    dit_tp_add_linear(p, &tp, "proj_out", c->out_dim, C, &m->proj_out);
    return p->oom ? DIT_ERR_NOMEM : DIT_OK;
}

/* The model object and its weights' memory, planned from cfg; with a
 * checkpoint (`set`, from `dir`), the plan is checked against it first. */
static dit_status flux_alloc(dit_backend *be, const dit_flux_config *cfg,
                             const dit_flux_shard *shard, const dit_st_set *set, const char *dir,
                             dit_flux **out, dit_weight_plan *plan, dit_diag *diag)
{
    dit_flux_shard sh = shard ? *shard : (dit_flux_shard){.tp_degree = 1, .tp_rank = 0};
    if (sh.tp_degree < 1 || sh.tp_rank < 0 || sh.tp_rank >= sh.tp_degree)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "tensor parallel rank %d of degree %d",
                            sh.tp_rank, sh.tp_degree);
    if (cfg->num_attention_heads % sh.tp_degree != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "tp_degree %d must divide num_attention_heads %d", sh.tp_degree,
                            cfg->num_attention_heads);
    if (cfg->mlp_dim % sh.tp_degree != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "tp_degree %d must divide the FFN width %d",
                            sh.tp_degree, cfg->mlp_dim);
    dit_flux *m = calloc(1, sizeof *m);
    if (!m)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "flux: out of memory");
    m->be = be;
    m->cfg = *cfg;
    m->shard = sh;
    dit_status gst =
        dit_graph_cache_create(be, sizeof(flux_graph_key), "flux forward", &m->graphs, diag);
    if (gst != DIT_OK) {
        free(m);
        return gst;
    }
    m->dbl = calloc((size_t)cfg->num_layers + 1, sizeof *m->dbl);
    m->sgl = calloc((size_t)cfg->num_single_layers + 1, sizeof *m->sgl);
    dit_weight_plan_init(plan, be->ops->weight_dtype);
    dit_status st = (m->dbl && m->sgl) ? dit_lora_sites_create(dit_flux_lora_kohya, &m->lora, diag)
                                       : DIT_ERR_NOMEM;
    if (st == DIT_OK)
        st = plan_build(plan, m);
    if (st == DIT_OK && set) {
        st = dit_weight_plan_check(plan, set, dir, "FluxTransformer2DModel", diag);
        if (st != DIT_OK) {
            dit_flux_destroy(m); /* the plan is the caller's to free */
            return st;
        }
    }
    if (st == DIT_OK)
        st = dit_backend_alloc(be, plan->bytes, &m->weights);
    if (st != DIT_OK) {
        st = dit_diag_set(diag, st, "flux: cannot allocate %.1f MiB of weights",
                          (double)plan->bytes / 1048576.0);
        dit_flux_destroy(m);
        return st;
    }
    m->weight_bytes = plan->bytes;
    dit_weight_plan_place(plan, m->weights);
    *out = m;
    return DIT_OK;
}

dit_status dit_flux_load(dit_backend *be, const char *dir, const dit_flux_shard *shard,
                         dit_flux **out, dit_diag *diag)
{
    char path[4096];
    dit_flux_config cfg;
    dit_st_set *set = NULL;
    dit_flux *m = NULL;
    dit_weight_plan plan;
    memset(&plan, 0, sizeof plan);
    dit_status st;

    snprintf(path, sizeof path, "%s/config.json", dir);
    DIT_CHECK(dit_flux_config_load(path, &cfg, diag));
    DIT_CHECK(dit_st_set_open_dir(dir, "diffusion_pytorch_model", &set, diag));
    DIT_CHECK(dit_weight_check_blocks(set, "transformer_blocks", cfg.num_layers, "num_layers", dir,
                                      diag));
    DIT_CHECK(dit_weight_check_blocks(set, "single_transformer_blocks", cfg.num_single_layers,
                                      "num_single_layers", dir, diag));
    DIT_CHECK(flux_alloc(be, &cfg, shard, set, dir, &m, &plan, diag));
    DIT_CHECK(dit_weight_plan_load(&plan, be, set, dir, "FluxTransformer2DModel", diag));
    *out = m;
    m = NULL;
cleanup:
    dit_weight_plan_free(&plan);
    dit_flux_destroy(m);
    dit_st_set_close(set);
    return st;
}

dit_status dit_flux_create_random(dit_backend *be, const dit_flux_config *cfg_in,
                                  const dit_flux_shard *shard, uint64_t seed, dit_flux **out,
                                  dit_diag *diag)
{
    dit_flux_config cfg = *cfg_in;
    dit_flux *m = NULL;
    dit_weight_plan plan;
    memset(&plan, 0, sizeof plan);
    dit_status st;
    DIT_CHECK(dit_flux_config_finish(&cfg, "random model config", diag));
    DIT_CHECK(flux_alloc(be, &cfg, shard, NULL, NULL, &m, &plan, diag));
    DIT_CHECK(dit_weight_plan_randomize(&plan, be, seed, diag));
    *out = m;
    m = NULL;
cleanup:
    dit_weight_plan_free(&plan);
    dit_flux_destroy(m);
    return st;
}

void dit_flux_destroy(dit_flux *m)
{
    if (!m)
        return;
    dit_lora_sites_destroy(m->lora);
    dit_graph_cache_destroy(m->graphs);
    free(m->rope_ids);
    free(m->rope_cos);
    free(m->rope_sin);
    dit_backend_free(m->be, m->weights);
    free(m->dbl);
    free(m->sgl);
    free(m);
}

const dit_flux_config *dit_flux_config_of(const dit_flux *m)
{
    return &m->cfg;
}

size_t dit_flux_weight_bytes(const dit_flux *m)
{
    return m->weight_bytes;
}

dit_lora_sites *dit_flux_lora_sites(dit_flux *m)
{
    return m->lora;
}

/* kohya (BFL) names of FLUX's linears: "double_blocks_<i>_<part>",
 * "single_blocks_<i>_<part>" and the embedders, as diffusers'
 * _convert_kohya_flux_lora_to_diffusers maps them. */
int dit_flux_lora_kohya(const char *name, dit_lora_kohya_target *out, int max)
{
    static const struct {
        const char *part;
        const char *modules[4];
    } dbl[] =
        {
            {"img_attn_proj", {"attn.to_out.0"}},
            {"img_attn_qkv", {"attn.to_q", "attn.to_k", "attn.to_v"}},
            {"img_mlp_0", {"ff.net.0.proj"}},
            {"img_mlp_2", {"ff.net.2"}},
            {"img_mod_lin", {"norm1.linear"}},
            {"txt_attn_proj", {"attn.to_add_out"}},
            {"txt_attn_qkv", {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}},
            {"txt_mlp_0", {"ff_context.net.0.proj"}},
            {"txt_mlp_2", {"ff_context.net.2"}},
            {"txt_mod_lin", {"norm1_context.linear"}},
        },
      sgl[] =
          {
              {"linear1", {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"}},
              {"linear2", {"proj_out"}},
              {"modulation_lin", {"norm.linear"}},
          },
      top[] = {
          {"img_in", {"x_embedder"}},
          {"txt_in", {"context_embedder"}},
          {"time_in_in_layer", {"time_text_embed.timestep_embedder.linear_1"}},
          {"time_in_out_layer", {"time_text_embed.timestep_embedder.linear_2"}},
          {"vector_in_in_layer", {"time_text_embed.text_embedder.linear_1"}},
          {"vector_in_out_layer", {"time_text_embed.text_embedder.linear_2"}},
          {"guidance_in_in_layer", {"time_text_embed.guidance_embedder.linear_1"}},
          {"guidance_in_out_layer", {"time_text_embed.guidance_embedder.linear_2"}},
          {"final_layer_linear", {"proj_out"}},
          {"final_layer_adaLN_modulation_1", {"norm_out.linear"}},
      };
    int idx = -1, used = 0, n = 0;
    const char *pre = NULL;
    if (sscanf(name, "double_blocks_%d_%n", &idx, &used) == 1 && used > 0)
        pre = "transformer_blocks";
    else if (sscanf(name, "single_blocks_%d_%n", &idx, &used) == 1 && used > 0)
        pre = "single_transformer_blocks";
    const char *part = pre ? name + used : name;
    const size_t nd = sizeof dbl / sizeof dbl[0], ns = sizeof sgl / sizeof sgl[0];
    const size_t nt = sizeof top / sizeof top[0];
    const size_t cnt = !pre ? nt : pre[0] == 't' ? nd : ns;
    for (size_t i = 0; i < cnt; i++) {
        const char *p = !pre ? top[i].part : pre[0] == 't' ? dbl[i].part : sgl[i].part;
        const char *const *mods = !pre            ? top[i].modules
                                  : pre[0] == 't' ? dbl[i].modules
                                                  : sgl[i].modules;
        if (strcmp(p, part) != 0)
            continue;
        for (int k = 0; k < 4 && mods[k] && n < max; k++, n++) {
            memset(&out[n], 0, sizeof out[n]);
            if (pre)
                snprintf(out[n].module, sizeof out[n].module, "%s.%d.%s", pre, idx, mods[k]);
            else
                snprintf(out[n].module, sizeof out[n].module, "%s", mods[k]);
            /* diffusers converts the final layer without its alpha and swaps
             * BFL's (shift, scale) into (scale, shift). */
            out[n].no_alpha = !pre && strncmp(p, "final_layer", 11) == 0;
            out[n].swap_halves = !pre && strcmp(p, "final_layer_adaLN_modulation_1") == 0;
        }
        return n;
    }
    return 0;
}

void dit_flux_set_hooks(dit_flux *m, const dit_flux_hooks *hooks)
{
    if (hooks)
        m->hooks = *hooks;
    else
        memset(&m->hooks, 0, sizeof m->hooks);
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

/* Sinusoidal timestep embedding of width 256 with cos first, computed with
 * the same f32 operations as diffusers' get_timestep_embedding so that the
 * (large) arguments of sin/cos round identically. */
static void timestep_embedding(const float *t, int64_t B, float *out)
{
    const int half = 128;
    const float neg_log_period = (float)-9.210340371976184; /* -ln(10000) */
    for (int64_t b = 0; b < B; b++) {
        const float tb = t[b] * 1000.0f;
        for (int j = 0; j < half; j++) {
            const float freq = expf(neg_log_period * (float)j / (float)half);
            const float arg = tb * freq;
            out[b * 256 + j] = cosf(arg);
            out[b * 256 + half + j] = sinf(arg);
        }
    }
}

/* RoPE tables (S, D) for ids (S, n_axes): per axis a of width d_a, pair i
 * rotates by pos * 10000^(-2i/d_a), computed in f64 and stored in f32, with
 * each value repeated for the two elements of its pair. */
static void rope_tables(const dit_flux_config *c, const float *txt_ids, int64_t St,
                        const float *img_ids, int64_t Si, float *cosb, float *sinb)
{
    const int64_t D = c->attention_head_dim;
    for (int64_t s = 0; s < St + Si; s++) {
        const float *ids = s < St ? txt_ids + s * c->n_axes : img_ids + (s - St) * c->n_axes;
        int64_t off = 0;
        for (int a = 0; a < c->n_axes; a++) {
            const int da = c->axes_dims_rope[a];
            const double pos = (double)ids[a];
            for (int i = 0; i < da / 2; i++) {
                const double freq = 1.0 / pow(10000.0, (double)(2 * i) / (double)da);
                const double ang = pos * freq;
                const float cv = (float)cos(ang), sv = (float)sin(ang);
                cosb[s * D + off + 2 * i] = cv;
                cosb[s * D + off + 2 * i + 1] = cv;
                sinb[s * D + off + 2 * i] = sv;
                sinb[s * D + off + 2 * i + 1] = sv;
            }
            off += da;
        }
    }
}

/* rope_tables through a one-entry cache keyed on the ids' bits; a cache
 * that cannot be allocated is simply not kept. */
static void rope_tables_cached(dit_flux *m, const float *txt_ids, int64_t St, const float *img_ids,
                               int64_t Si, float *cosb, float *sinb)
{
    const dit_flux_config *c = &m->cfg;
    const size_t nt = (size_t)St * (size_t)c->n_axes, ni = (size_t)Si * (size_t)c->n_axes;
    const size_t tab = (size_t)(St + Si) * (size_t)c->attention_head_dim;
    if (m->rope_ids && m->rope_St == St && m->rope_Si == Si &&
        memcmp(m->rope_ids, txt_ids, nt * sizeof(float)) == 0 &&
        memcmp(m->rope_ids + nt, img_ids, ni * sizeof(float)) == 0) {
        memcpy(cosb, m->rope_cos, tab * sizeof(float));
        memcpy(sinb, m->rope_sin, tab * sizeof(float));
        return;
    }
    rope_tables(c, txt_ids, St, img_ids, Si, cosb, sinb);
    free(m->rope_ids);
    free(m->rope_cos);
    free(m->rope_sin);
    m->rope_ids = malloc((nt + ni ? nt + ni : 1) * sizeof(float));
    m->rope_cos = malloc((tab ? tab : 1) * sizeof(float));
    m->rope_sin = malloc((tab ? tab : 1) * sizeof(float));
    if (!m->rope_ids || !m->rope_cos || !m->rope_sin) {
        free(m->rope_ids);
        free(m->rope_cos);
        free(m->rope_sin);
        m->rope_ids = m->rope_cos = m->rope_sin = NULL;
        return;
    }
    memcpy(m->rope_ids, txt_ids, nt * sizeof(float));
    memcpy(m->rope_ids + nt, img_ids, ni * sizeof(float));
    memcpy(m->rope_cos, cosb, tab * sizeof(float));
    memcpy(m->rope_sin, sinb, tab * sizeof(float));
    m->rope_St = St;
    m->rope_Si = Si;
}

/* Views used throughout the forward pass. */
static dit_tensor seq(const dit_tensor *t, int64_t start, int64_t len)
{
    return dit_tensor_narrow(t, 1, start, len);
}

static dit_tensor feat(const dit_tensor *t, int64_t start, int64_t len)
{
    return dit_tensor_narrow(t, t->ndim - 1, start, len);
}

static dit_tensor heads(const dit_tensor *t, int64_t start, int64_t len, int64_t D)
{
    dit_tensor f = feat(t, start, len);
    return dit_tensor_split_last(&f, D);
}

typedef struct fwd {
    dit_flux *m;
    dit_backend *be;
    dit_arena *arena;
    dit_diag *diag;
    int64_t B, St, Si, S, C, D, Hl, Cl, Fl;
    float scale;
    dit_tensor x;         /* (B, S, C) residual stream, text rows first */
    dit_tensor n;         /* (B, S, C) normalised + modulated */
    dit_tensor y;         /* (B, S, 3 Cl + Fl) projections */
    dit_tensor attn;      /* (B, S, Cl) attention output */
    dit_tensor o;         /* (B, S, C) block output before its gate */
    dit_tensor emb;       /* (B, 6C) modulation of one stream */
    dit_tensor emb_ctx;   /* (B, 6C) modulation of the other */
    dit_tensor emb_local; /* (B, 6C / T) this rank's slice before the gather */
    dit_tensor silu_t;    /* (B, C) SiLU(temb) */
    dit_tensor cos, sin;  /* (S, D) */
    dit_tensor tp, gp;    /* (B, 256) timestep / guidance sinusoids */
    dit_tensor h1, temb;  /* (B, C) conditioning MLP */
    /* The backend's fast path (operand_dtype bf16, no attention hook): GEMM
     * inputs and attention operands in bf16, written once by the op that
     * produces them. y is then (B, S, 2 Cl) f32, q and k before their norm;
     * n is unused. */
    bool fast;
    dit_tensor nb;    /* (B, S, C) bf16 normalised + modulated (GEMM input) */
    dit_tensor qkvb;  /* (B, S, 3 Cl) bf16 q, k after RMSNorm + RoPE; v */
    dit_tensor attnb; /* (B, S, Cl) bf16 attention output */
    dit_tensor hb;    /* (B, S, Fl) bf16 GELU(MLP input projection) */
    const dit_flux_inputs *in;
    const dit_tensor *sample;
} fwd;

#define BE(call)                                                                                   \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(f->diag, st, "flux forward: %s failed: %s", #call,                   \
                              dit_status_str(st));                                                 \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

static dit_status linear(fwd *f, const dit_tensor *y, const dit_tensor *x, const flux_linear *L,
                         dit_act act, float beta)
{
    return dit_lora_linear(f->be, f->arena, y, x, L, act, beta);
}

static dit_status tp_reduce(fwd *f, const dit_tensor *t)
{
    if (!f->m->hooks.tp_all_reduce || f->m->shard.tp_degree == 1)
        return DIT_OK;
    return f->m->hooks.tp_all_reduce(f->m->hooks.ctx, t, f->diag);
}

static dit_status attention(fwd *f, const dit_tensor *out, const dit_tensor *q, const dit_tensor *k,
                            const dit_tensor *v)
{
    if (f->m->hooks.attention)
        return f->m->hooks.attention(f->m->hooks.ctx, f->arena, out, q, k, v, f->scale, f->diag);
    return f->be->ops->attention(f->be, out, NULL, q, k, v, f->scale);
}

/* emb (B, N) = Linear(SiLU(temb)) for an AdaLN linear that may hold only
 * this rank's N/T output rows; the slices are all-gathered. */
static dit_status adaln(fwd *f, const dit_tensor *emb, const flux_linear *L)
{
    if (f->m->shard.tp_degree == 1 || !f->m->hooks.tp_all_gather)
        return linear(f, emb, &f->silu_t, L, DIT_ACT_NONE, 0.0f);
    /* A contiguous (B, N/T) view over the scratch: gathers want dense rows. */
    dit_tensor local = dit_tensor_2d(f->emb_local.data, DIT_F32, f->B, L->w.ne[0]);
    dit_status st = linear(f, &local, &f->silu_t, L, DIT_ACT_NONE, 0.0f);
    if (st != DIT_OK)
        return st;
    return f->m->hooks.tp_all_gather(f->m->hooks.ctx, f->arena, &local, emb, f->diag);
}

/* Modulation chunk k of width C from an emb (B, nC) tensor. */
static dit_tensor chunk(const dit_tensor *emb, int k, int64_t C)
{
    return feat(emb, k * C, C);
}

/* Output rows [r0, r0 + n) of a linear: a contiguous slice of w and b, so
 * that one fused projection can run as several GEMMs with different
 * output dtypes. */
static flux_linear rows_of(const flux_linear *L, int64_t r0, int64_t n)
{
    flux_linear s = *L;
    s.w = dit_tensor_narrow(&L->w, 0, r0, n);
    if (L->has_b)
        s.b = dit_tensor_narrow(&L->b, 0, r0, n);
    return s;
}

/* The fast path's q/k/v for rows [r0, r0 + len) from their normalised
 * input nbs (bf16): q, k through an f32 GEMM into y and then RMSNorm +
 * RoPE written once in bf16 into qkvb; v by a GEMM writing bf16 into qkvb
 * straight away. */
static dit_status qkv_fast(fwd *f, int64_t r0, int64_t len, const dit_tensor *nbs,
                           const flux_linear *qkv, const dit_tensor *nq, const dit_tensor *nk)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const int64_t Cl = f->Cl, D = f->D;
    dit_tensor qk = seq(&f->y, r0, len);
    dit_tensor qkvb = seq(&f->qkvb, r0, len);
    dit_tensor vb = feat(&qkvb, 2 * Cl, Cl);
    const flux_linear Lqk = rows_of(qkv, 0, 2 * Cl), Lv = rows_of(qkv, 2 * Cl, Cl);
    BE(linear(f, &qk, nbs, &Lqk, DIT_ACT_NONE, 0.0f));
    BE(linear(f, &vb, nbs, &Lv, DIT_ACT_NONE, 0.0f));
    dit_tensor q = heads(&qk, 0, Cl, D), k = heads(&qk, Cl, Cl, D);
    dit_tensor qo = heads(&qkvb, 0, Cl, D), ko = heads(&qkvb, Cl, Cl, D);
    dit_tensor cs = dit_tensor_narrow(&f->cos, 0, r0, len);
    dit_tensor sn = dit_tensor_narrow(&f->sin, 0, r0, len);
    BE(be->ops->rms_norm_rope_to(be, &qo, &q, nq, 1e-6f, &cs, &sn));
    BE(be->ops->rms_norm_rope_to(be, &ko, &k, nk, 1e-6f, &cs, &sn));
cleanup:
    return st;
}

/* double_block on the fast path: the same math, bf16 where a GEMM or
 * attention is the only reader. */
static dit_status double_block_fast(fwd *f, const flux_double *w)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const int64_t St = f->St, Si = f->Si, C = f->C, D = f->D, Cl = f->Cl;
    const int64_t r0[2] = {0, St}, len[2] = {St, Si};
    const flux_linear *ada[2] = {&w->norm1_ctx, &w->norm1};
    const flux_linear *qkv[2] = {&w->add_qkv, &w->qkv};
    const dit_tensor *nq[2] = {&w->norm_added_q, &w->norm_q};
    const dit_tensor *nk[2] = {&w->norm_added_k, &w->norm_k};
    const flux_linear *outp[2] = {&w->to_add_out, &w->to_out};
    const flux_linear *ff0[2] = {&w->ffc0, &w->ff0};
    const flux_linear *ff2[2] = {&w->ffc2, &w->ff2};
    const dit_tensor *embs[2] = {&f->emb_ctx, &f->emb};

    for (int s = 0; s < 2; s++) {
        BE(adaln(f, embs[s], ada[s]));
        if (len[s] == 0)
            continue;
        dit_tensor xs = seq(&f->x, r0[s], len[s]), nbs = seq(&f->nb, r0[s], len[s]);
        dit_tensor shift = chunk(embs[s], 0, C), scale = chunk(embs[s], 1, C);
        BE(be->ops->layer_norm_mod(be, &nbs, &xs, &shift, &scale, 1e-6f));
        BE(qkv_fast(f, r0[s], len[s], &nbs, qkv[s], nq[s], nk[s]));
    }
    dit_tensor q = heads(&f->qkvb, 0, Cl, D), k = heads(&f->qkvb, Cl, Cl, D);
    dit_tensor v = heads(&f->qkvb, 2 * Cl, Cl, D);
    dit_tensor a4 = dit_tensor_split_last(&f->attnb, D);
    BE(be->ops->attention(be, &a4, NULL, &q, &k, &v, f->scale));

    for (int s = 0; s < 2; s++) {
        if (len[s] == 0)
            continue;
        dit_tensor as = seq(&f->attnb, r0[s], len[s]), os = seq(&f->o, r0[s], len[s]);
        BE(linear(f, &os, &as, outp[s], DIT_ACT_NONE, 0.0f));
    }
    BE(tp_reduce(f, &f->o));
    for (int s = 0; s < 2; s++) {
        if (len[s] == 0)
            continue;
        dit_tensor xs = seq(&f->x, r0[s], len[s]), os = seq(&f->o, r0[s], len[s]);
        dit_tensor gate = chunk(embs[s], 2, C);
        BE(be->ops->gated_add(be, &xs, &os, &gate));
        dit_tensor nbs = seq(&f->nb, r0[s], len[s]);
        dit_tensor shift = chunk(embs[s], 3, C), scale = chunk(embs[s], 4, C);
        BE(be->ops->layer_norm_mod(be, &nbs, &xs, &shift, &scale, 1e-6f));
        /* GELU fused into the GEMM that writes the bf16 hidden state. */
        dit_tensor hs = seq(&f->hb, r0[s], len[s]);
        BE(linear(f, &hs, &nbs, ff0[s], DIT_ACT_GELU_TANH, 0.0f));
        BE(linear(f, &os, &hs, ff2[s], DIT_ACT_NONE, 0.0f));
    }
    BE(tp_reduce(f, &f->o));
    for (int s = 0; s < 2; s++) {
        if (len[s] == 0)
            continue;
        dit_tensor xs = seq(&f->x, r0[s], len[s]), os = seq(&f->o, r0[s], len[s]);
        dit_tensor gate = chunk(embs[s], 5, C);
        BE(be->ops->gated_add(be, &xs, &os, &gate));
    }
cleanup:
    return st;
}

/* single_block on the fast path: the fused [q; k; v; mlp] projection runs as
 * three GEMMs (q, k in f32 for their norm; v in bf16; the MLP input in bf16
 * with GELU as the GEMM's epilogue instead of a pass of its own). */
static dit_status single_block_fast(fwd *f, const flux_single *w)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const int64_t C = f->C, D = f->D, Cl = f->Cl, Fl = f->Fl;
    dit_tensor emb3 = feat(&f->emb, 0, 3 * C);
    BE(adaln(f, &emb3, &w->norm));
    dit_tensor shift = chunk(&emb3, 0, C), scale = chunk(&emb3, 1, C);
    dit_tensor gate = chunk(&emb3, 2, C);
    BE(be->ops->layer_norm_mod(be, &f->nb, &f->x, &shift, &scale, 1e-6f));
    BE(qkv_fast(f, 0, f->S, &f->nb, &w->qkv_mlp, &w->norm_q, &w->norm_k));
    const flux_linear Lmlp = rows_of(&w->qkv_mlp, 3 * Cl, Fl);
    BE(linear(f, &f->hb, &f->nb, &Lmlp, DIT_ACT_GELU_TANH, 0.0f));
    dit_tensor q = heads(&f->qkvb, 0, Cl, D), k = heads(&f->qkvb, Cl, Cl, D);
    dit_tensor v = heads(&f->qkvb, 2 * Cl, Cl, D);
    dit_tensor a4 = dit_tensor_split_last(&f->attnb, D);
    BE(be->ops->attention(be, &a4, NULL, &q, &k, &v, f->scale));
    BE(linear(f, &f->o, &f->attnb, &w->proj_attn, DIT_ACT_NONE, 0.0f));
    BE(linear(f, &f->o, &f->hb, &w->proj_mlp, DIT_ACT_NONE, 1.0f));
    BE(tp_reduce(f, &f->o));
    BE(be->ops->gated_add(be, &f->x, &f->o, &gate));
cleanup:
    return st;
}

static dit_status double_block(fwd *f, const flux_double *w)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const int64_t St = f->St, Si = f->Si, C = f->C, D = f->D, Cl = f->Cl, Fl = f->Fl;
    /* Stream 0 is text (rows [0, St)), stream 1 is image (rows [St, S)). */
    const int64_t r0[2] = {0, St}, len[2] = {St, Si};
    const flux_linear *ada[2] = {&w->norm1_ctx, &w->norm1};
    const flux_linear *qkv[2] = {&w->add_qkv, &w->qkv};
    const dit_tensor *nq[2] = {&w->norm_added_q, &w->norm_q};
    const dit_tensor *nk[2] = {&w->norm_added_k, &w->norm_k};
    const flux_linear *outp[2] = {&w->to_add_out, &w->to_out};
    const flux_linear *ff0[2] = {&w->ffc0, &w->ff0};
    const flux_linear *ff2[2] = {&w->ffc2, &w->ff2};
    const dit_tensor *embs[2] = {&f->emb_ctx, &f->emb};

    dit_tensor qkv_all = feat(&f->y, 0, 3 * Cl);
    for (int s = 0; s < 2; s++) {
        BE(adaln(f, embs[s], ada[s]));
        if (len[s] == 0)
            continue;
        dit_tensor xs = seq(&f->x, r0[s], len[s]), ns = seq(&f->n, r0[s], len[s]);
        dit_tensor shift = chunk(embs[s], 0, C), scale = chunk(embs[s], 1, C);
        BE(be->ops->layer_norm_mod(be, &ns, &xs, &shift, &scale, 1e-6f));
        dit_tensor ys = seq(&qkv_all, r0[s], len[s]);
        BE(linear(f, &ys, &ns, qkv[s], DIT_ACT_NONE, 0.0f));
        dit_tensor q = heads(&ys, 0, Cl, D), k = heads(&ys, Cl, Cl, D);
        dit_tensor cs = dit_tensor_narrow(&f->cos, 0, r0[s], len[s]);
        dit_tensor sn = dit_tensor_narrow(&f->sin, 0, r0[s], len[s]);
        BE(be->ops->rms_norm_rope(be, &q, nq[s], 1e-6f, &cs, &sn));
        BE(be->ops->rms_norm_rope(be, &k, nk[s], 1e-6f, &cs, &sn));
    }
    dit_tensor q = heads(&qkv_all, 0, Cl, D), k = heads(&qkv_all, Cl, Cl, D);
    dit_tensor v = heads(&qkv_all, 2 * Cl, Cl, D);
    dit_tensor a4 = dit_tensor_split_last(&f->attn, D);
    BE(attention(f, &a4, &q, &k, &v));

    /* Attention output projections, one all-reduce for both streams. */
    for (int s = 0; s < 2; s++) {
        if (len[s] == 0)
            continue;
        dit_tensor as = seq(&f->attn, r0[s], len[s]), os = seq(&f->o, r0[s], len[s]);
        BE(linear(f, &os, &as, outp[s], DIT_ACT_NONE, 0.0f));
    }
    BE(tp_reduce(f, &f->o));
    for (int s = 0; s < 2; s++) {
        if (len[s] == 0)
            continue;
        dit_tensor xs = seq(&f->x, r0[s], len[s]), os = seq(&f->o, r0[s], len[s]);
        dit_tensor gate = chunk(embs[s], 2, C);
        BE(be->ops->gated_add(be, &xs, &os, &gate));
        /* MLP: LN + modulation, Linear-GELU(tanh), Linear. */
        dit_tensor ns = seq(&f->n, r0[s], len[s]);
        dit_tensor shift = chunk(embs[s], 3, C), scale = chunk(embs[s], 4, C);
        BE(be->ops->layer_norm_mod(be, &ns, &xs, &shift, &scale, 1e-6f));
        dit_tensor hs = seq(&f->y, r0[s], len[s]);
        hs = feat(&hs, 0, Fl);
        BE(linear(f, &hs, &ns, ff0[s], DIT_ACT_GELU_TANH, 0.0f));
        BE(linear(f, &os, &hs, ff2[s], DIT_ACT_NONE, 0.0f));
    }
    BE(tp_reduce(f, &f->o));
    for (int s = 0; s < 2; s++) {
        if (len[s] == 0)
            continue;
        dit_tensor xs = seq(&f->x, r0[s], len[s]), os = seq(&f->o, r0[s], len[s]);
        dit_tensor gate = chunk(embs[s], 5, C);
        BE(be->ops->gated_add(be, &xs, &os, &gate));
    }
cleanup:
    return st;
}

static dit_status single_block(fwd *f, const flux_single *w)
{
    dit_status st = DIT_OK;
    dit_backend *be = f->be;
    const int64_t C = f->C, D = f->D, Cl = f->Cl, Fl = f->Fl;
    dit_tensor emb3 = feat(&f->emb, 0, 3 * C);
    BE(adaln(f, &emb3, &w->norm));
    dit_tensor shift = chunk(&emb3, 0, C), scale = chunk(&emb3, 1, C);
    dit_tensor gate = chunk(&emb3, 2, C);
    BE(be->ops->layer_norm_mod(be, &f->n, &f->x, &shift, &scale, 1e-6f));
    /* One GEMM for q, k, v and the MLP input; GELU on the MLP columns. */
    BE(linear(f, &f->y, &f->n, &w->qkv_mlp, DIT_ACT_NONE, 0.0f));
    dit_tensor mlp = feat(&f->y, 3 * Cl, Fl);
    BE(be->ops->activate(be, &mlp, &mlp, DIT_ACT_GELU_TANH));
    dit_tensor q = heads(&f->y, 0, Cl, D), k = heads(&f->y, Cl, Cl, D);
    dit_tensor v = heads(&f->y, 2 * Cl, Cl, D);
    BE(be->ops->rms_norm_rope(be, &q, &w->norm_q, 1e-6f, &f->cos, &f->sin));
    BE(be->ops->rms_norm_rope(be, &k, &w->norm_k, 1e-6f, &f->cos, &f->sin));
    dit_tensor a4 = dit_tensor_split_last(&f->attn, D);
    BE(attention(f, &a4, &q, &k, &v));
    /* proj_out(cat([attn, mlp])) as two GEMMs into the same output. */
    BE(linear(f, &f->o, &f->attn, &w->proj_attn, DIT_ACT_NONE, 0.0f));
    BE(linear(f, &f->o, &mlp, &w->proj_mlp, DIT_ACT_NONE, 1.0f));
    BE(tp_reduce(f, &f->o));
    BE(be->ops->gated_add(be, &f->x, &f->o, &gate));
cleanup:
    return st;
}

static dit_status check_input(const dit_tensor *t, int ndim, const int64_t *want, const char *name,
                              dit_diag *diag)
{
    bool ok = t->dtype == DIT_F32 && t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = want[i] < 0 || t->ne[i] == want[i];
    if (ok)
        return DIT_OK;
    char got[64];
    dit_tensor_shape_str(t, got, sizeof got);
    char exp[96] = "(";
    size_t used = 1;
    for (int i = 0; i < ndim; i++) {
        int n = want[i] < 0 ? snprintf(exp + used, sizeof exp - used, "%s*", i ? ", " : "")
                            : snprintf(exp + used, sizeof exp - used, "%s%lld", i ? ", " : "",
                                       (long long)want[i]);
        used += n > 0 ? (size_t)n : 0;
        if (used >= sizeof exp)
            break;
    }
    return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "input '%s' is %s, expected %s) f32", name, got,
                        used < sizeof exp ? exp : "?");
}

/* Everything of the forward pass after the host-to-device uploads: only
 * backend ops on device memory, so it can be captured as a graph. */
static dit_status forward_compute(fwd *f)
{
    dit_status st = DIT_OK;
    dit_flux *m = f->m;
    dit_backend *be = f->be;
    const dit_flux_config *c = &m->cfg;
    const dit_flux_inputs *in = f->in;
    const dit_tensor *sample = f->sample;
    dit_diag *diag = f->diag;
    const int64_t St = f->St, Si = f->Si, C = f->C;
    /* temb = MLP(t) [+ MLP(guidance)] + MLP(pooled text). */
    BE(linear(f, &f->h1, &f->tp, &m->t1, DIT_ACT_SILU, 0.0f));
    BE(linear(f, &f->temb, &f->h1, &m->t2, DIT_ACT_NONE, 0.0f));
    if (in->guidance) {
        BE(linear(f, &f->h1, &f->gp, &m->g1, DIT_ACT_SILU, 0.0f));
        BE(linear(f, &f->temb, &f->h1, &m->g2, DIT_ACT_NONE, 1.0f));
    }
    BE(linear(f, &f->h1, &in->pooled_projections, &m->p1, DIT_ACT_SILU, 0.0f));
    BE(linear(f, &f->temb, &f->h1, &m->p2, DIT_ACT_NONE, 1.0f));
    BE(be->ops->activate(be, &f->silu_t, &f->temb, DIT_ACT_SILU));

    /* Embed both streams into the shared residual buffer. */
    if (St > 0) {
        dit_tensor xt = seq(&f->x, 0, St);
        BE(linear(f, &xt, &in->encoder_hidden_states, &m->ctx_emb, DIT_ACT_NONE, 0.0f));
    }
    if (Si > 0) {
        dit_tensor xi = seq(&f->x, St, Si);
        BE(linear(f, &xi, &in->hidden_states, &m->x_emb, DIT_ACT_NONE, 0.0f));
    }

    for (int i = 0; i < c->num_layers; i++) {
        st = f->fast ? double_block_fast(f, &m->dbl[i]) : double_block(f, &m->dbl[i]);
        if (st != DIT_OK) {
            dit_diag_prefix(diag, "double block %d: ", i);
            goto cleanup;
        }
        if (m->hooks.block_done)
            DIT_CHECK(m->hooks.block_done(m->hooks.ctx, i, diag));
    }
    for (int i = 0; i < c->num_single_layers; i++) {
        st = f->fast ? single_block_fast(f, &m->sgl[i]) : single_block(f, &m->sgl[i]);
        if (st != DIT_OK) {
            dit_diag_prefix(diag, "single block %d: ", i);
            goto cleanup;
        }
        if (m->hooks.block_done)
            DIT_CHECK(m->hooks.block_done(m->hooks.ctx, c->num_layers + i, diag));
    }

    /* norm_out: (scale, shift) in that order, then proj_out on image rows. */
    {
        dit_tensor emb2 = feat(&f->emb, 0, 2 * C);
        BE(adaln(f, &emb2, &m->norm_out));
        if (Si > 0) {
            dit_tensor scale = chunk(&emb2, 0, C), shift = chunk(&emb2, 1, C);
            dit_tensor xi = seq(&f->x, St, Si);
            dit_tensor ni = seq(f->fast ? &f->nb : &f->n, St, Si);
            BE(be->ops->layer_norm_mod(be, &ni, &xi, &shift, &scale, 1e-6f));
            BE(linear(f, sample, &ni, &m->proj_out, DIT_ACT_NONE, 0.0f));
        }
    }
cleanup:
    return st;
}

static bool flux_has_hooks(const dit_flux *m)
{
    return m->hooks.attention || m->hooks.tp_all_gather || m->hooks.tp_all_reduce ||
           m->hooks.block_done;
}

static dit_status forward_body(void *ctx, dit_diag *diag)
{
    fwd *f = ctx;
    dit_diag *user_diag = f->diag;
    f->diag = diag;
    dit_status st = forward_compute(f);
    f->diag = user_diag;
    return st;
}

/* Runs forward_compute through the graph cache (backend/graph_cache.h),
 * keyed by shapes and every device address the pass touches; eagerly while
 * any hook is set (comm and per-block callbacks run on the host). */
static dit_status forward_run(fwd *f)
{
    dit_flux *m = f->m;
    flux_graph_key k;
    memset(&k, 0, sizeof k);
    k.B = f->B;
    k.St = f->St;
    k.Si = f->Si;
    k.guidance = f->in->guidance != NULL ? 1 : 0;
    k.fast = f->fast ? 1 : 0;
    k.hs = f->in->hidden_states;
    k.ehs = f->in->encoder_hidden_states;
    k.pooled = f->in->pooled_projections;
    k.sample = *f->sample;
    k.arena_first = f->tp.data;
    k.arena_x = f->x.data;
    k.arena_last = f->emb_local.data;
    const bool eager = flux_has_hooks(m) || dit_lora_sites_active(m->lora);
    return dit_graph_cache_run(m->graphs, &k, eager, forward_body, f, f->diag);
}

void dit_flux_set_graphs(dit_flux *m, bool on)
{
    dit_graph_cache_set_enabled(m->graphs, on);
}

bool dit_flux_graph_captured(const dit_flux *m)
{
    return dit_graph_cache_captured(m->graphs);
}

dit_status dit_flux_forward(dit_flux *m, dit_arena *arena, const dit_flux_inputs *in,
                            const dit_tensor *sample, dit_diag *diag)
{
    dit_status st = DIT_OK;
    const dit_flux_config *c = &m->cfg;
    fwd fs;
    fwd *f = &fs;
    memset(f, 0, sizeof *f);
    float *host = NULL;
    f->m = m;
    f->be = m->be;
    f->arena = arena;
    f->diag = diag;
    dit_backend *be = m->be;

    const int64_t B = in->hidden_states.ne[0];
    const int64_t Si = in->hidden_states.ndim == 3 ? in->hidden_states.ne[1] : -1;
    const int64_t St = in->encoder_hidden_states.ndim == 3 ? in->encoder_hidden_states.ne[1] : -1;
    {
        const int64_t sh_h[3] = {-1, -1, c->in_channels};
        const int64_t sh_e[3] = {B, -1, c->joint_attention_dim};
        const int64_t sh_p[2] = {B, c->pooled_projection_dim};
        const int64_t sh_o[3] = {B, Si, c->out_dim};
        DIT_CHECK(check_input(&in->hidden_states, 3, sh_h, "hidden_states", diag));
        DIT_CHECK(check_input(&in->encoder_hidden_states, 3, sh_e, "encoder_hidden_states", diag));
        DIT_CHECK(check_input(&in->pooled_projections, 2, sh_p, "pooled_projections", diag));
        DIT_CHECK(check_input(sample, 3, sh_o, "sample (output)", diag));
    }
    if (B < 1) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "batch size must be at least 1");
        goto cleanup;
    }
    if (!in->timestep || !in->txt_ids || !in->img_ids) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "timestep, txt_ids and img_ids are required");
        goto cleanup;
    }
    if (c->guidance_embeds != (in->guidance != NULL)) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                          c->guidance_embeds
                              ? "this model has guidance embeddings: input 'guidance' is required"
                              : "this model has no guidance embeddings: drop input 'guidance'");
        goto cleanup;
    }

    const int64_t C = c->inner_dim, D = c->attention_head_dim, T = m->shard.tp_degree;
    const int64_t S = St + Si;
    f->B = B;
    f->St = St;
    f->Si = Si;
    f->S = S;
    f->C = C;
    f->D = D;
    f->Hl = c->num_attention_heads / T;
    f->Cl = f->Hl * D;
    f->Fl = c->mlp_dim / T;
    f->scale = (float)(1.0 / sqrt((double)D));

    /* Host-side tables: timestep/guidance sinusoids and RoPE. */
    size_t host_n = (size_t)(2 * B * 256 + 2 * S * D);
    host = malloc(host_n * sizeof *host);
    if (!host) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "flux forward: out of memory");
        goto cleanup;
    }
    float *tproj = host, *gproj = host + B * 256, *cosh_ = host + 2 * B * 256;
    float *sinh_ = cosh_ + S * D;
    timestep_embedding(in->timestep, B, tproj);
    if (in->guidance)
        timestep_embedding(in->guidance, B, gproj);
    rope_tables_cached(m, in->txt_ids, St, in->img_ids, Si, cosh_, sinh_);

    /* The fast path needs the backend's bf16 operands and the out-of-place
     * RMSNorm + RoPE; a context-parallel attention hook takes f32 q/k/v. */
    f->fast = be->ops->operand_dtype && be->ops->operand_dtype(be) == DIT_BF16 &&
              be->ops->rms_norm_rope_to && !m->hooks.attention && !dit_lora_sites_active(m->lora);

#define ALLOC_T(t, dt, nd, ...)                                                                    \
    do {                                                                                           \
        const int64_t shp_[] = {__VA_ARGS__};                                                      \
        st = dit_arena_tensor(arena, dt, nd, shp_, &(t));                                          \
        if (st != DIT_OK) {                                                                        \
            st = dit_diag_set(diag, st, "flux forward: activation memory exhausted");              \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)
#define ALLOC(t, nd, ...) ALLOC_T(t, DIT_F32, nd, __VA_ARGS__)

    ALLOC(f->tp, 2, B, 256);
    ALLOC(f->gp, 2, B, 256);
    ALLOC(f->h1, 2, B, C);
    ALLOC(f->temb, 2, B, C);
    ALLOC(f->silu_t, 2, B, C);
    ALLOC(f->cos, 2, S, D);
    ALLOC(f->sin, 2, S, D);
    ALLOC(f->x, 3, B, S, C);
    if (f->fast) {
        ALLOC_T(f->nb, DIT_BF16, 3, B, S, C);
        ALLOC(f->y, 3, B, S, 2 * f->Cl);
        ALLOC_T(f->qkvb, DIT_BF16, 3, B, S, 3 * f->Cl);
        ALLOC_T(f->attnb, DIT_BF16, 3, B, S, f->Cl);
        ALLOC_T(f->hb, DIT_BF16, 3, B, S, f->Fl);
    } else {
        ALLOC(f->n, 3, B, S, C);
        ALLOC(f->y, 3, B, S, 3 * f->Cl + f->Fl);
        ALLOC(f->attn, 3, B, S, f->Cl);
    }
    ALLOC(f->o, 3, B, S, C);
    ALLOC(f->emb, 2, B, 6 * C);
    ALLOC(f->emb_ctx, 2, B, 6 * C);
    ALLOC(f->emb_local, 2, B, 6 * C / T);
#undef ALLOC
#undef ALLOC_T

    {
        dit_tensor h_tp = dit_tensor_2d(tproj, DIT_F32, B, 256);
        dit_tensor h_gp = dit_tensor_2d(gproj, DIT_F32, B, 256);
        dit_tensor h_cos = dit_tensor_2d(cosh_, DIT_F32, S, D);
        dit_tensor h_sin = dit_tensor_2d(sinh_, DIT_F32, S, D);
        BE(be->ops->upload(be, &f->tp, &h_tp));
        if (in->guidance)
            BE(be->ops->upload(be, &f->gp, &h_gp));
        BE(be->ops->upload(be, &f->cos, &h_cos));
        BE(be->ops->upload(be, &f->sin, &h_sin));
    }

    f->in = in;
    f->sample = sample;
    DIT_CHECK(forward_run(f));
cleanup:
    free(host);
    return st;
}

double dit_flux_forward_flops(const dit_flux_config *c, int64_t B, int64_t St, int64_t Si)
{
    const double C = c->inner_dim, F = c->mlp_dim, S = (double)(St + Si);
    const double b = (double)B;
    double fl = 0.0;
    /* Embedders and the conditioning MLPs. */
    fl += 2.0 * b * Si * c->in_channels * C + 2.0 * b * St * c->joint_attention_dim * C;
    fl += 2.0 * b * (256.0 * C + C * C) * (c->guidance_embeds ? 2 : 1);
    fl += 2.0 * b * (c->pooled_projection_dim * C + C * C);
    /* Double blocks: 2 AdaLN (6C), qkv (3C), out (C), FFN (F + F) per token. */
    double dbl = 2.0 * b * 2.0 * 6.0 * C * C;
    dbl += 2.0 * b * S * (3.0 * C * C + C * C + 2.0 * C * F);
    dbl += 4.0 * b * S * S * C;
    /* Single blocks: AdaLN (3C), qkv + mlp (3C + F), proj_out (C + F -> C). */
    double sgl = 2.0 * b * 3.0 * C * C;
    sgl += 2.0 * b * S * ((3.0 * C + F) * C + (C + F) * C);
    sgl += 4.0 * b * S * S * C;
    fl += c->num_layers * dbl + c->num_single_layers * sgl;
    /* norm_out and proj_out. */
    fl += 2.0 * b * 2.0 * C * C + 2.0 * b * Si * C * c->out_dim;
    return fl;
}
