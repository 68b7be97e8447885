/* The model registry: one line per model class. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/json_util.h"
#include "models/flux/flux_model.h"
#include "models/model.h"
#include "models/wan/wan_model.h"

static const dit_model_class *const classes[] = {
    &dit_flux_model_class,
    &dit_wan_model_class,
};
#define N_CLASSES (sizeof classes / sizeof classes[0])

const dit_model_class *dit_model_class_find(const char *name)
{
    for (size_t i = 0; name && i < N_CLASSES; i++)
        if (strcmp(classes[i]->diffusers_class, name) == 0)
            return classes[i];
    return NULL;
}

dit_status dit_model_class_for_dir(const char *dir, const dit_model_class **out, dit_diag *diag)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    const char *name = NULL;
    DIT_CHECK(dit_json_get_string(root, "_class_name", path, true, &name, diag));
    const dit_model_class *cls = dit_model_class_find(name);
    if (!cls) {
        char known[256] = "";
        for (size_t i = 0; i < N_CLASSES; i++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
                     classes[i]->diffusers_class);
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: model class \"%s\" is not supported (known: %s)", path, name, known);
        goto cleanup;
    }
    *out = cls;
cleanup:
    cJSON_Delete(root);
    return st;
}

dit_status dit_model_config_load(const char *dir, const dit_model_class **cls, void **cfg,
                                 dit_diag *diag)
{
    const dit_model_class *c = NULL;
    dit_status st = dit_model_class_for_dir(dir, &c, diag);
    if (st != DIT_OK)
        return st;
    void *p = calloc(1, c->config_size);
    if (!p)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    st = c->config_load(dir, p, diag);
    if (st != DIT_OK) {
        free(p);
        return st;
    }
    *cls = c;
    *cfg = p;
    return DIT_OK;
}

dit_status dit_model_wrap(const dit_model_class *cls, void *impl, dit_model **out, dit_diag *diag)
{
    dit_model *m = calloc(1, sizeof *m);
    if (!m) {
        cls->destroy(impl);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    }
    m->cls = cls;
    m->impl = impl;
    *out = m;
    return DIT_OK;
}

dit_status dit_model_load(dit_backend *be, const char *dir, const dit_shard *shard, dit_model **out,
                          dit_diag *diag)
{
    const dit_model_class *cls = NULL;
    dit_status st = dit_model_class_for_dir(dir, &cls, diag);
    if (st != DIT_OK)
        return st;
    void *impl = NULL;
    st = cls->load(be, dir, shard, &impl, diag);
    if (st != DIT_OK)
        return st;
    return dit_model_wrap(cls, impl, out, diag);
}

void dit_model_destroy(dit_model *m)
{
    if (!m)
        return;
    m->cls->destroy(m->impl);
    free(m);
}

const void *dit_model_config(const dit_model *m)
{
    return m->cls->config_of(m->impl);
}

dit_lora_sites *dit_model_lora_sites(dit_model *m)
{
    return m && m->cls->lora_sites ? m->cls->lora_sites(m->impl) : NULL;
}
