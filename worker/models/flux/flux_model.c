#include "models/flux/flux_model.h"

#include <stdio.h>
#include <string.h>

#include "models/flux/flux.h"

/* diffusers' FluxTransformer2DModel._cp_plan: image and text tokens (and
 * their RoPE ids) split on the sequence, the conditioning replicated, the
 * output (proj_out's) gathered on the sequence. Sequence 0 is the image,
 * 1 the text; a rank's attention runs over its text chunk then its image
 * chunk. */
enum { SEQ_IMG, SEQ_TXT };
static const dit_cp_rule flux_cp_plan[] = {
    {"hidden_states", DIT_CP_SPLIT, 1, SEQ_IMG, false, true},
    {"encoder_hidden_states", DIT_CP_SPLIT, 1, SEQ_TXT, false, true},
    {"pooled_projections", DIT_CP_REPLICATE, 0, 0, false, true},
    {"timestep", DIT_CP_REPLICATE, 0, 0, true, true},
    {"guidance", DIT_CP_REPLICATE, 0, 0, true, true},
    {"img_ids", DIT_CP_SPLIT, 0, SEQ_IMG, true, false},
    {"txt_ids", DIT_CP_SPLIT, 0, SEQ_TXT, true, false},
    {"proj_out", DIT_CP_GATHER, 1, SEQ_IMG, false, true},
};

static dit_status flux_cls_config_load(const char *dir, void *cfg, dit_diag *diag)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    return dit_flux_config_load(path, cfg, diag);
}

static dit_parallel_req flux_parallel_req(const void *cfg)
{
    const dit_flux_config *c = cfg;
    dit_parallel_req r = {
        .num_heads = c->num_attention_heads,
        .n_widths = 1,
        .widths = {c->mlp_dim},
        .width_names = {"the FFN width"},
        .n_seqs = 2,
        .seq_names = {"image tokens", "text tokens"},
    };
    return r;
}

static dit_model_summary flux_summary(const void *cfg)
{
    const dit_flux_config *c = cfg;
    dit_model_summary s = {
        .num_blocks = c->num_layers + c->num_single_layers,
        .num_heads = c->num_attention_heads,
        .head_dim = c->attention_head_dim,
    };
    snprintf(s.blocks, sizeof s.blocks, "%d double + %d single blocks", c->num_layers,
             c->num_single_layers);
    return s;
}

static dit_status flux_cls_load(dit_backend *be, const char *dir, const dit_shard *shard,
                                void **out, dit_diag *diag)
{
    dit_flux *m = NULL;
    dit_status st = dit_flux_load(be, dir, shard, &m, diag);
    if (st == DIT_OK)
        *out = m;
    return st;
}

static dit_lora_sites *flux_cls_lora_sites(void *m)
{
    return dit_flux_lora_sites(m);
}

static void flux_cls_destroy(void *m)
{
    dit_flux_destroy(m);
}

static const void *flux_cls_config_of(const void *m)
{
    return dit_flux_config_of(m);
}

static const float *host_data(const dit_named_tensors *in, const char *name)
{
    const dit_tensor *t = dit_named_tensors_get(in, name);
    return t ? t->data : NULL;
}

static dit_status flux_cls_forward(void *m, dit_arena *arena, const dit_named_tensors *in,
                                   const dit_tensor *out, dit_diag *diag)
{
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    const dit_tensor *ehs = dit_named_tensors_get(in, "encoder_hidden_states");
    const dit_tensor *pooled = dit_named_tensors_get(in, "pooled_projections");
    if (!hs || !ehs || !pooled)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "hidden_states, encoder_hidden_states and pooled_projections are "
                            "required");
    dit_flux_inputs fin = {
        .hidden_states = *hs,
        .encoder_hidden_states = *ehs,
        .pooled_projections = *pooled,
        .timestep = host_data(in, "timestep"),
        .guidance = host_data(in, "guidance"),
        .img_ids = host_data(in, "img_ids"),
        .txt_ids = host_data(in, "txt_ids"),
    };
    return dit_flux_forward(m, arena, &fin, out, diag);
}

static dit_status flux_output_shape(const void *cfg, const dit_named_tensors *in, dit_tensor *out,
                                    dit_diag *diag)
{
    const dit_flux_config *c = cfg;
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    if (!hs || hs->ndim != 3)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "input 'hidden_states' (B, S, C) is required");
    const int64_t shape[3] = {hs->ne[0], hs->ne[1], c->out_dim};
    *out = dit_tensor_make(NULL, DIT_F32, 3, shape);
    return DIT_OK;
}

/* ------------------------------------------------------------------------ */
/* Inputs read from a file (ditrun forward)                                  */

enum { IN_HS, IN_EHS, IN_POOL, IN_T, IN_IMG, IN_TXT, IN_G, IN_COUNT };

static const char *const input_names[IN_COUNT] = {
    "hidden_states",
    "encoder_hidden_states",
    "pooled_projections",
    "timestep",
    "img_ids",
    "txt_ids",
    "guidance",
};

static dit_status need(const dit_named_tensors *in, const char *path, int which, int ndim_a,
                       int ndim_b, const dit_tensor **out, dit_diag *diag)
{
    const dit_tensor *t = dit_named_tensors_get(in, input_names[which]);
    *out = t;
    if (!t)
        return which == IN_G ? DIT_OK
                             : dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is missing",
                                            path, input_names[which]);
    if (t->ndim != ndim_a && t->ndim != ndim_b) {
        char got[64];
        dit_tensor_shape_str(t, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is %s; expected %d dims",
                            path, input_names[which], got, ndim_a);
    }
    return DIT_OK;
}

static dit_status shape_error(const char *path, const char *name, const dit_tensor *t,
                              const char *want, dit_diag *diag)
{
    char got[64];
    dit_tensor_shape_str(t, got, sizeof got);
    return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is %s; expected %s", path, name,
                        got, want);
}

static dit_status flux_check_inputs(const void *cfgp, const char *path, dit_named_tensors *in,
                                    dit_diag *diag)
{
    const dit_flux_config *cfg = cfgp;
    const dit_tensor *e[IN_COUNT];
    char want[128];
    dit_status st = DIT_OK;
    for (int i = 0; i < in->n; i++) {
        bool known = false;
        for (int k = 0; k < IN_COUNT; k++)
            known = known || strcmp(in->v[i].name, input_names[k]) == 0;
        if (!known)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s: unknown input '%s' (expected hidden_states, "
                                "encoder_hidden_states, pooled_projections, timestep, img_ids, "
                                "txt_ids, guidance)",
                                path, in->v[i].name);
    }
    DIT_CHECK(need(in, path, IN_HS, 3, 3, &e[IN_HS], diag));
    DIT_CHECK(need(in, path, IN_EHS, 3, 3, &e[IN_EHS], diag));
    DIT_CHECK(need(in, path, IN_POOL, 2, 2, &e[IN_POOL], diag));
    DIT_CHECK(need(in, path, IN_T, 1, 1, &e[IN_T], diag));
    /* diffusers still accepts (B, S, n_axes) ids and uses batch 0 of them. */
    DIT_CHECK(need(in, path, IN_IMG, 2, 3, &e[IN_IMG], diag));
    DIT_CHECK(need(in, path, IN_TXT, 2, 3, &e[IN_TXT], diag));
    DIT_CHECK(need(in, path, IN_G, 1, 1, &e[IN_G], diag));

    const int64_t B = e[IN_HS]->ne[0], Si = e[IN_HS]->ne[1];
    const int64_t St = e[IN_EHS]->ne[1], nax = cfg->n_axes;
    if (e[IN_HS]->ne[2] != cfg->in_channels) {
        snprintf(want, sizeof want, "(B, image tokens, %d) for in_channels %d", cfg->in_channels,
                 cfg->in_channels);
        return shape_error(path, input_names[IN_HS], e[IN_HS], want, diag);
    }
    if (e[IN_EHS]->ne[0] != B || e[IN_EHS]->ne[2] != cfg->joint_attention_dim) {
        snprintf(want, sizeof want, "(%lld, text tokens, %d) for joint_attention_dim %d",
                 (long long)B, cfg->joint_attention_dim, cfg->joint_attention_dim);
        return shape_error(path, input_names[IN_EHS], e[IN_EHS], want, diag);
    }
    if (e[IN_POOL]->ne[0] != B || e[IN_POOL]->ne[1] != cfg->pooled_projection_dim) {
        snprintf(want, sizeof want, "(%lld, %d) for pooled_projection_dim", (long long)B,
                 cfg->pooled_projection_dim);
        return shape_error(path, input_names[IN_POOL], e[IN_POOL], want, diag);
    }
    for (int w = IN_T; w <= IN_G; w += IN_G - IN_T) {
        if (e[w] && e[w]->ne[0] != B) {
            snprintf(want, sizeof want, "(%lld): one value per batch entry", (long long)B);
            return shape_error(path, input_names[w], e[w], want, diag);
        }
    }
    const int64_t id_len[2] = {Si, St};
    for (int w = IN_IMG; w <= IN_TXT; w++) {
        const dit_tensor *v = e[w];
        if (v->ne[v->ndim - 2] != id_len[w - IN_IMG] || v->ne[v->ndim - 1] != nax) {
            snprintf(want, sizeof want, "(%lld, %lld) to match the %s tokens and %lld rope axes",
                     (long long)id_len[w - IN_IMG], (long long)nax, w == IN_IMG ? "image" : "text",
                     (long long)nax);
            return shape_error(path, input_names[w], v, want, diag);
        }
    }
    if (cfg->guidance_embeds != (e[IN_G] != NULL))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            cfg->guidance_embeds
                                ? "%s: this model has guidance embeddings: input 'guidance' is "
                                  "required"
                                : "%s: this model has no guidance embeddings: drop input "
                                  "'guidance'",
                            path);
    /* ids given per batch entry: keep batch 0, as diffusers does. */
    for (int w = IN_IMG; w <= IN_TXT; w++) {
        if (e[w]->ndim != 3)
            continue;
        const int64_t shape[2] = {id_len[w - IN_IMG], nax};
        dit_tensor b0 = dit_tensor_make(e[w]->data, DIT_F32, 2, shape);
        DIT_CHECK(dit_named_tensors_set(in, input_names[w], &b0));
    }
cleanup:
    return st;
}

static double flux_cls_flops(const void *cfg, const dit_named_tensors *in)
{
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    const dit_tensor *ehs = dit_named_tensors_get(in, "encoder_hidden_states");
    if (!hs || !ehs)
        return 0.0;
    return dit_flux_forward_flops(cfg, hs->ne[0], ehs->ne[1], hs->ne[1]);
}

static size_t flux_cls_weight_bytes(const void *m)
{
    return dit_flux_weight_bytes(m);
}

static void flux_cls_set_hooks(void *m, const dit_model_hooks *hooks)
{
    dit_flux_set_hooks(m, hooks);
}

static void flux_cls_set_graphs(void *m, bool on)
{
    dit_flux_set_graphs(m, on);
}

static bool flux_cls_graph_captured(const void *m)
{
    return dit_flux_graph_captured(m);
}

const dit_model_class dit_flux_model_class = {
    .diffusers_class = "FluxTransformer2DModel",
    .config_size = sizeof(dit_flux_config),
    .config_load = flux_cls_config_load,
    .parallel_req = flux_parallel_req,
    .summary = flux_summary,
    .cp_plan = flux_cp_plan,
    .n_cp = (int)(sizeof flux_cp_plan / sizeof flux_cp_plan[0]),
    .tp_plan = dit_flux_tp_plan,
    .n_tp = &dit_flux_tp_plan_len,
    .load = flux_cls_load,
    .destroy = flux_cls_destroy,
    .config_of = flux_cls_config_of,
    .forward = flux_cls_forward,
    .output_shape = flux_output_shape,
    .check_inputs = flux_check_inputs,
    .forward_flops = flux_cls_flops,
    .weight_bytes = flux_cls_weight_bytes,
    .set_hooks = flux_cls_set_hooks,
    .set_graphs = flux_cls_set_graphs,
    .graph_captured = flux_cls_graph_captured,
    .lora_sites = flux_cls_lora_sites,
};
