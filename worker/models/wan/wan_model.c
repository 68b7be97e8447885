#include "models/wan/wan_model.h"

#include <stdio.h>
#include <string.h>

#include "models/wan/wan.h"

/* Inputs as WanTransformer3DModel.forward names them. The latent video and
 * the timesteps are read on the host (patchify, sinusoids); the text is a
 * backend tensor. As diffusers' _cp_plan: the video tokens split after the
 * patch embedding (every rank patchifies its chunk of the whole latent, with
 * the matching RoPE rows), the text is whole on every rank (cross-attention
 * stays local), and proj_out's tokens gather before unpatchify. */
static const dit_cp_rule wan_cp_plan[] = {
    {"hidden_states", DIT_CP_TOKENS, 0, 0, true, true},
    {"timestep", DIT_CP_REPLICATE, 0, 0, true, true},
    {"encoder_hidden_states", DIT_CP_REPLICATE, 0, 0, false, true},
    {"proj_out", DIT_CP_GATHER, 1, 0, false, true},
};

static dit_status wan_cls_config_load(const char *dir, void *cfg, dit_diag *diag)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    return dit_wan_config_load(path, cfg, diag);
}

static dit_parallel_req wan_parallel_req(const void *cfg)
{
    const dit_wan_config *c = cfg;
    dit_parallel_req r = {
        .num_heads = c->num_attention_heads,
        .n_widths = 1,
        .widths = {c->ffn_dim},
        .width_names = {"ffn_dim"},
        .n_seqs = 1,
        .seq_names = {"video tokens"},
    };
    return r;
}

static dit_status wan_seq_lens(const void *cfg, const dit_named_tensors *in, int64_t *lens,
                               dit_diag *diag)
{
    const dit_wan_config *c = cfg;
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    if (!hs || hs->ndim != 5)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "input 'hidden_states' (B, C, F, H, W) is required");
    lens[0] = hs->ne[2] / c->patch_size[0] * (hs->ne[3] / c->patch_size[1]) *
              (hs->ne[4] / c->patch_size[2]);
    return DIT_OK;
}

static dit_status wan_gathered_shape(const void *cfg, const dit_named_tensors *in, dit_tensor *out,
                                     dit_diag *diag)
{
    const dit_wan_config *c = cfg;
    int64_t S = 0;
    dit_status st = wan_seq_lens(cfg, in, &S, diag);
    if (st != DIT_OK)
        return st;
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    const int64_t shape[3] = {hs->ne[0], S, c->out_dim};
    *out = dit_tensor_make(NULL, DIT_F32, 3, shape);
    return DIT_OK;
}

static dit_status wan_cp_finish(const void *cfg, const dit_named_tensors *in,
                                const dit_tensor *gathered, const dit_tensor *out, dit_diag *diag)
{
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    if (!hs || hs->ndim != 5 || out->ndim != 5 || !dit_tensor_is_contiguous(out) ||
        !dit_tensor_is_contiguous(gathered))
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "wan: bad shapes to unpatchify");
    dit_wan_unpatchify(cfg, gathered->data, hs->ne[0], hs->ne[2], hs->ne[3], hs->ne[4], out->data);
    return DIT_OK;
}

static dit_model_summary wan_summary(const void *cfg)
{
    const dit_wan_config *c = cfg;
    dit_model_summary s = {
        .num_blocks = c->num_layers,
        .num_heads = c->num_attention_heads,
        .head_dim = c->attention_head_dim,
    };
    snprintf(s.blocks, sizeof s.blocks, "%d blocks", c->num_layers);
    return s;
}

static dit_status wan_cls_load(dit_backend *be, const char *dir, const dit_shard *shard, void **out,
                               dit_diag *diag)
{
    dit_wan *m = NULL;
    dit_status st = dit_wan_load(be, dir, shard, &m, diag);
    if (st == DIT_OK)
        *out = m;
    return st;
}

static void wan_cls_destroy(void *m)
{
    dit_wan_destroy(m);
}

static const void *wan_cls_config_of(const void *m)
{
    return dit_wan_config_of(m);
}

static dit_status wan_cls_forward(void *m, dit_arena *arena, const dit_named_tensors *in,
                                  const dit_tensor *out, dit_diag *diag)
{
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    const dit_tensor *t = dit_named_tensors_get(in, "timestep");
    const dit_tensor *ehs = dit_named_tensors_get(in, "encoder_hidden_states");
    if (!hs || !t || !ehs)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "hidden_states, timestep and encoder_hidden_states are required");
    dit_wan_inputs win = {
        .hidden_states = hs,
        .timestep = t->data,
        .encoder_hidden_states = *ehs,
    };
    return dit_wan_forward(m, arena, &win, out, diag);
}

static dit_status wan_output_shape(const void *cfg, const dit_named_tensors *in, dit_tensor *out,
                                   dit_diag *diag)
{
    const dit_wan_config *c = cfg;
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    if (!hs || hs->ndim != 5)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "input 'hidden_states' (B, C, F, H, W) is required");
    const int64_t shape[5] = {hs->ne[0], c->out_channels, hs->ne[2], hs->ne[3], hs->ne[4]};
    *out = dit_tensor_make(NULL, DIT_F32, 5, shape);
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

static dit_status wan_check_inputs(const void *cfgp, const char *path, dit_named_tensors *in,
                                   dit_diag *diag)
{
    const dit_wan_config *c = cfgp;
    static const char *const names[3] = {"hidden_states", "timestep", "encoder_hidden_states"};
    const dit_tensor *e[3];
    char want[160];
    for (int i = 0; i < in->n; i++) {
        bool known = false;
        for (int k = 0; k < 3; k++)
            known = known || strcmp(in->v[i].name, names[k]) == 0;
        if (!known && strcmp(in->v[i].name, "encoder_hidden_states_image") == 0)
            return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                                "%s: input 'encoder_hidden_states_image': the image-conditioned "
                                "(i2v) path is not supported",
                                path);
        if (!known)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s: unknown input '%s' (expected hidden_states, timestep, "
                                "encoder_hidden_states)",
                                path, in->v[i].name);
    }
    for (int k = 0; k < 3; k++) {
        e[k] = dit_named_tensors_get(in, names[k]);
        if (!e[k])
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is missing", path,
                                names[k]);
    }
    const dit_tensor *hs = e[0], *t = e[1], *ehs = e[2];
    const int pt = c->patch_size[0], ph = c->patch_size[1], pw = c->patch_size[2];
    if (hs->ndim != 5 || hs->ne[1] != c->in_channels || hs->ne[2] % pt || hs->ne[3] % ph ||
        hs->ne[4] % pw || hs->ne[2] < 1 || hs->ne[3] < 1 || hs->ne[4] < 1) {
        snprintf(want, sizeof want,
                 "(B, %d, F, H, W) with F, H, W positive multiples of the patch (%d, %d, %d)",
                 c->in_channels, pt, ph, pw);
        return shape_error(path, names[0], hs, want, diag);
    }
    const int64_t B = hs->ne[0];
    for (int a = 0; a < 3; a++)
        if (hs->ne[2 + a] / c->patch_size[a] > c->rope_max_seq_len) {
            snprintf(want, sizeof want, "at most rope_max_seq_len %d patches per axis",
                     c->rope_max_seq_len);
            return shape_error(path, names[0], hs, want, diag);
        }
    if (t->ndim != 1 || t->ne[0] != B) {
        snprintf(want, sizeof want, "(%lld): one timestep per batch entry", (long long)B);
        return shape_error(path, names[1], t, want, diag);
    }
    if (ehs->ndim != 3 || ehs->ne[0] != B || ehs->ne[2] != c->text_dim || ehs->ne[1] < 1) {
        snprintf(want, sizeof want, "(%lld, text tokens, %d) for text_dim %d", (long long)B,
                 c->text_dim, c->text_dim);
        return shape_error(path, names[2], ehs, want, diag);
    }
    return DIT_OK;
}

static double wan_cls_flops(const void *cfg, const dit_named_tensors *in)
{
    const dit_wan_config *c = cfg;
    const dit_tensor *hs = dit_named_tensors_get(in, "hidden_states");
    const dit_tensor *ehs = dit_named_tensors_get(in, "encoder_hidden_states");
    if (!hs || !ehs || hs->ndim != 5 || ehs->ndim != 3)
        return 0.0;
    const int64_t S = hs->ne[2] / c->patch_size[0] * (hs->ne[3] / c->patch_size[1]) *
                      (hs->ne[4] / c->patch_size[2]);
    return dit_wan_forward_flops(c, hs->ne[0], S, ehs->ne[1]);
}

static size_t wan_cls_weight_bytes(const void *m)
{
    return dit_wan_weight_bytes(m);
}

static void wan_cls_set_hooks(void *m, const dit_model_hooks *hooks)
{
    dit_wan_set_hooks(m, hooks);
}

static dit_lora_sites *wan_cls_lora_sites(void *m)
{
    return dit_wan_lora_sites(m);
}

const dit_model_class dit_wan_model_class = {
    .diffusers_class = "WanTransformer3DModel",
    .config_size = sizeof(dit_wan_config),
    .config_load = wan_cls_config_load,
    .parallel_req = wan_parallel_req,
    .summary = wan_summary,
    .cp_plan = wan_cp_plan,
    .n_cp = (int)(sizeof wan_cp_plan / sizeof wan_cp_plan[0]),
    .seq_lens = wan_seq_lens,
    .gathered_shape = wan_gathered_shape,
    .cp_finish = wan_cp_finish,
    .tp_plan = dit_wan_tp_plan,
    .n_tp = &dit_wan_tp_plan_len,
    .load = wan_cls_load,
    .destroy = wan_cls_destroy,
    .config_of = wan_cls_config_of,
    .forward = wan_cls_forward,
    .output_shape = wan_output_shape,
    .check_inputs = wan_check_inputs,
    .forward_flops = wan_cls_flops,
    .weight_bytes = wan_cls_weight_bytes,
    .set_hooks = wan_cls_set_hooks,
    .lora_sites = wan_cls_lora_sites,
    /* No CUDA graphs: the forward runs host steps between backend ops. */
};
