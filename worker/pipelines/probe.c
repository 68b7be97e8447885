/* The pipeline probe registry: one line per pipeline class. */
#include "pipelines/probe.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "loader/json_util.h"
#include "pipelines/flux_probe.h"
#include "pipelines/wan_probe.h"

static const dit_pipeline_probe_class *const classes[] = {
    &dit_probe_flux_pipeline,
    &dit_probe_wan_pipeline,
};
#define N_CLASSES (sizeof classes / sizeof classes[0])

#define PROBE_PATH 4096

void dit_probe_add_config(dit_pipeline_info *info, const char *key, int64_t value)
{
    if (info->n_config < DIT_PIPELINE_MAX_CONFIG) {
        info->config[info->n_config].key = key;
        info->config[info->n_config].value = value;
        info->n_config++;
    }
}

bool dit_probe_is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

bool dit_probe_is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* No model_index.json in dir. The usual slip is to name one component of a
 * pipeline (its transformer/, say) instead of the pipeline itself: say so,
 * and name the folder that would work. */
static dit_status not_a_pipeline(const char *dir, dit_diag *diag)
{
    char path[PROBE_PATH + 64], parent[PROBE_PATH];
    snprintf(parent, sizeof parent, "%s", dir);
    size_t n = strlen(parent);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = '\0';
    char *slash = strrchr(parent, '/');
    if (slash)
        *(slash == parent ? slash + 1 : slash) = '\0';
    else
        snprintf(parent, sizeof parent, ".");
    snprintf(path, sizeof path, "%s/config.json", dir);
    const bool component = dit_probe_is_file(path);
    snprintf(path, sizeof path, "%s/model_index.json", parent);
    const bool parent_is_pipeline = dit_probe_is_file(path);
    if (component && parent_is_pipeline)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s is one component of a pipeline, not the pipeline: point --model at "
                            "the pipeline folder that holds model_index.json, here %s",
                            dir, parent);
    if (component)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s holds a config.json but no model_index.json: it is a model "
                            "folder; point --model at the diffusers pipeline folder (with "
                            "model_index.json, transformer/, vae/, ...)",
                            dir);
    snprintf(path, sizeof path, "%s/model_index.json", dir);
    return dit_diag_set(diag, DIT_ERR_NOT_FOUND,
                        "%s: no such file; --model wants a diffusers pipeline folder (with "
                        "model_index.json, transformer/, vae/, ...)",
                        path);
}

static const dit_pipeline_probe_class *find_class(const char *name)
{
    for (size_t i = 0; name && i < N_CLASSES; i++)
        if (strcmp(classes[i]->diffusers_class, name) == 0)
            return classes[i];
    return NULL;
}

dit_status dit_pipeline_probe(const char *dir, dit_pipeline_info *out, dit_diag *diag)
{
    char path[PROBE_PATH + 64];
    cJSON *index = NULL;
    dit_pipeline_info info;
    memset(&info, 0, sizeof info);
    snprintf(path, sizeof path, "%s/model_index.json", dir);
    if (!dit_probe_is_file(path))
        return not_a_pipeline(dir, diag);
    dit_status st = dit_json_load_file(path, &index, diag);
    if (st != DIT_OK)
        return st;
    const char *cls = NULL;
    DIT_CHECK(dit_json_get_string(index, "_class_name", path, true, &cls, diag));
    const dit_pipeline_probe_class *pc = find_class(cls);
    if (!pc) {
        char known[256] = "";
        for (size_t i = 0; i < N_CLASSES; i++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
                     classes[i]->diffusers_class);
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: pipeline class \"%s\" is not supported (%s is)", path, cls, known);
        goto cleanup;
    }
    snprintf(info.class_name, sizeof info.class_name, "%s", pc->diffusers_class);
    DIT_CHECK(pc->probe(dir, &info, diag));
    *out = info;
cleanup:
    cJSON_Delete(index);
    return st;
}

const dit_pipeline_probe_class *dit_pipeline_probe_class_of(const dit_pipeline_info *info)
{
    return find_class(info->class_name);
}

dit_status dit_gen_check(const dit_pipeline_info *info, const dit_gen_params *gp, dit_diag *diag)
{
    const dit_pipeline_probe_class *pc = dit_pipeline_probe_class_of(info);
    if (!pc)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "no pipeline class \"%s\"", info->class_name);
    if (gp->num_images < 0 || gp->num_images > DIT_GEN_MAX_IMAGES)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_images %d must be between 1 and %d (0 means 1)", gp->num_images,
                            DIT_GEN_MAX_IMAGES);
    return pc->check(info, gp, diag);
}

void dit_gen_seq_lens(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *lens)
{
    const dit_pipeline_probe_class *pc = dit_pipeline_probe_class_of(info);
    for (int i = 0; i < info->parallel.n_seqs; i++)
        lens[i] = 0;
    if (pc)
        pc->seq_lens(info, gp, lens);
}

dit_status dit_gen_check_mesh(const dit_pipeline_info *info, const dit_gen_params *gp,
                              const dit_parallel_config *pc, dit_diag *diag)
{
    int64_t lens[DIT_PARALLEL_MAX_SEQS];
    dit_gen_seq_lens(info, gp, lens);
    return dit_parallel_validate_model(pc, &info->parallel, lens, diag);
}

bool dit_gen_mesh_advice(const dit_pipeline_info *info, const dit_gen_params *gp,
                         const dit_parallel_config *pc, char *buf, size_t cap)
{
    const dit_pipeline_probe_class *c = dit_pipeline_probe_class_of(info);
    return c && c->mesh_advice && c->mesh_advice(info, gp, pc, buf, cap);
}

void dit_gen_apply_defaults(const dit_pipeline_info *info, dit_gen_params *gp)
{
    if (!gp->width)
        gp->width = info->default_width;
    if (!gp->height)
        gp->height = info->default_height;
    if (!gp->frames)
        gp->frames = info->default_frames;
    if (!gp->fps)
        gp->fps = info->default_fps;
    if (!gp->steps)
        gp->steps = info->default_steps;
    if (!gp->max_sequence_length && !gp->prompt_embeds)
        gp->max_sequence_length = info->default_max_sequence_length;
    if (isnan(gp->guidance_scale))
        gp->guidance_scale = info->default_guidance;
}

int dit_gen_latents_shape(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *shape)
{
    const dit_pipeline_probe_class *c = dit_pipeline_probe_class_of(info);
    return c ? c->latents_shape(info, gp, shape) : 0;
}

bool dit_gen_warning(const dit_pipeline_info *info, const dit_gen_params *gp,
                     const dit_gen_field_names *names, char *buf, size_t cap)
{
    const dit_pipeline_probe_class *c = dit_pipeline_probe_class_of(info);
    return c && c->warning && c->warning(info, gp, names, buf, cap);
}

bool dit_gen_cfg(const dit_pipeline_info *info, const dit_gen_params *gp)
{
    const dit_pipeline_probe_class *c = dit_pipeline_probe_class_of(info);
    return c && c->cfg && c->cfg(info, gp);
}

/* The text length a request's conditional (neg false) or unconditional
 * entries have: the embeddings' own, else max_sequence_length. */
static int64_t text_len(const dit_gen_params *gp, bool neg)
{
    if (neg ? gp->negative_prompt_embeds : gp->prompt_embeds)
        return neg ? gp->negative_prompt_embeds_len : gp->prompt_embeds_len;
    return gp->max_sequence_length;
}

bool dit_gen_batch_compatible(const dit_pipeline_info *info, const dit_gen_params *a,
                              const dit_gen_params *b)
{
    dit_gen_params x = *a, y = *b;
    dit_gen_apply_defaults(info, &x);
    dit_gen_apply_defaults(info, &y);
    const bool cfg = dit_gen_cfg(info, &x);
    if (x.width != y.width || x.height != y.height || x.frames != y.frames || x.steps != y.steps ||
        cfg != dit_gen_cfg(info, &y) || x.cfg_two_pass != y.cfg_two_pass)
        return false;
    if (text_len(&x, false) != text_len(&y, false))
        return false;
    return !cfg || text_len(&x, true) == text_len(&y, true);
}

/* Adds "WxH" to a list of at most 4 sizes. */
static void add_size(char *list, size_t cap, int *n, int64_t w, int64_t h)
{
    if (*n >= 4)
        return;
    const size_t used = strlen(list);
    snprintf(list + used, cap - used, "%s%lldx%lld", *n ? ", " : "", (long long)w, (long long)h);
    (*n)++;
}

void dit_gen_nearest_sizes(int64_t w, int64_t h, int mult, int max_side, int64_t frames, int C,
                           char *list, size_t cap)
{
    int n = 0;
    list[0] = '\0';
    for (int side = 0; side < 2; side++) {
        /* Within C steps one of the candidates divides (w/mult + k runs
         * through every residue mod C), unless the bounds cut it off. */
        for (int k = 1; k <= C; k++) {
            bool found = false;
            for (int sign = -1; sign <= 1; sign += 2) {
                const int64_t nw = side == 0 ? w + sign * k * mult : w;
                const int64_t nh = side == 1 ? h + sign * k * mult : h;
                if (nw < mult || nh < mult || nw > max_side || nh > max_side ||
                    (frames * (nw / mult) * (nh / mult)) % C != 0)
                    continue;
                add_size(list, cap, &n, nw, nh);
                found = true;
            }
            if (found)
                break;
        }
    }
}

bool dit_gen_true_cfg(const dit_gen_params *gp)
{
    return gp->true_cfg_scale > 1.0f && (gp->negative_prompt || gp->negative_prompt_embeds);
}

bool dit_gen_true_cfg_warning(const dit_gen_params *gp, const char *neg_name, const char *cfg_name,
                              char *buf, size_t cap)
{
    const bool neg = gp->negative_prompt || gp->negative_prompt_embeds;
    if (neg && !(gp->true_cfg_scale > 1.0f)) {
        snprintf(buf, cap,
                 "%s has no effect: true classifier-free guidance needs %s above 1 "
                 "(it is %g)",
                 neg_name, cfg_name, (double)gp->true_cfg_scale);
        return true;
    }
    if (!neg && gp->true_cfg_scale > 1.0f) {
        snprintf(buf, cap, "%s %g has no effect: true classifier-free guidance needs a %s",
                 cfg_name, (double)gp->true_cfg_scale, neg_name);
        return true;
    }
    return false;
}
