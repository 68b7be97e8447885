/* The scheduler registry: one line per scheduler class. */
#include "schedulers/scheduler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/json_util.h"
#include "schedulers/flow_match_euler.h"
#include "schedulers/unipc.h"

static const dit_scheduler_class *const classes[] = {
    &dit_flow_match_euler_class,
    &dit_unipc_class,
};
#define N_CLASSES (sizeof classes / sizeof classes[0])

struct dit_scheduler {
    const dit_scheduler_class *cls;
    void *impl;
    int steps;
    float *sigmas;    /* steps + 1 */
    float *timesteps; /* steps */
};

dit_status dit_scheduler_load(const char *path, const char *default_class, dit_scheduler **out,
                              dit_diag *diag)
{
    cJSON *root = NULL;
    dit_scheduler *s = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    const char *name = NULL;
    DIT_CHECK(dit_json_get_string(root, "_class_name", path, false, &name, diag));
    if (!name)
        name = default_class;
    const dit_scheduler_class *cls = NULL;
    for (size_t i = 0; i < N_CLASSES && !cls; i++)
        if (strcmp(classes[i]->diffusers_class, name) == 0)
            cls = classes[i];
    if (!cls) {
        char known[256] = "";
        for (size_t i = 0; i < N_CLASSES; i++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
                     classes[i]->diffusers_class);
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: scheduler \"%s\" is not supported (%s is)", path, name, known);
        goto cleanup;
    }
    s = calloc(1, sizeof *s);
    if (!s) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    s->cls = cls;
    DIT_CHECK(cls->load(path, &s->impl, diag));
    *out = s;
    s = NULL;
cleanup:
    dit_scheduler_free(s);
    cJSON_Delete(root);
    return st;
}

void dit_scheduler_free(dit_scheduler *s)
{
    if (!s)
        return;
    if (s->impl)
        s->cls->free(s->impl);
    free(s->sigmas);
    free(s->timesteps);
    free(s);
}

dit_status dit_scheduler_set_timesteps(dit_scheduler *s, int steps, int64_t seq_len, dit_diag *diag)
{
    if (steps < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "steps must be at least 1");
    float *sg = malloc(sizeof(float) * (size_t)(steps + 1));
    float *ts = malloc(sizeof(float) * (size_t)steps);
    if (!sg || !ts) {
        free(sg);
        free(ts);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    }
    dit_status st = s->cls->schedule(s->impl, steps, seq_len, sg, ts, diag);
    if (st == DIT_OK && s->cls->start)
        st = s->cls->start(s->impl, steps, diag);
    if (st != DIT_OK) {
        free(sg);
        free(ts);
        return st;
    }
    free(s->sigmas);
    free(s->timesteps);
    s->sigmas = sg;
    s->timesteps = ts;
    s->steps = steps;
    return DIT_OK;
}

float dit_scheduler_timestep(const dit_scheduler *s, int i)
{
    return s->timesteps[i];
}

dit_status dit_scheduler_step(dit_scheduler *s, int i, float *x, const float *v, size_t n,
                              dit_diag *diag)
{
    return s->cls->step(s->impl, i, s->sigmas, x, v, n, diag);
}
