#include "schedulers/flow_match_euler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "loader/json_util.h"

dit_flow_scheduler dit_flow_scheduler_flux_default(void)
{
    dit_flow_scheduler s;
    memset(&s, 0, sizeof s);
    s.num_train_timesteps = 1000;
    s.shift = 3.0;
    s.use_dynamic_shifting = true;
    s.base_shift = 0.5;
    s.max_shift = 1.15;
    s.base_image_seq_len = 256;
    s.max_image_seq_len = 4096;
    return s;
}

dit_status dit_flow_scheduler_load(const char *path, dit_flow_scheduler *out, dit_diag *diag)
{
    cJSON *root = NULL;
    dit_status st = dit_json_load_file(path, &root, diag);
    if (st != DIT_OK)
        return st;
    dit_flow_scheduler s;
    memset(&s, 0, sizeof s);
    int64_t v;
    const char *cls = NULL, *shift_type = NULL;
    bool flag;
    DIT_CHECK(dit_json_get_string(root, "_class_name", path, false, &cls, diag));
    if (cls && strcmp(cls, "FlowMatchEulerDiscreteScheduler") != 0) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                          "%s: scheduler \"%s\" is not supported (FlowMatchEulerDiscreteScheduler "
                          "is)",
                          path, cls);
        goto cleanup;
    }
    DIT_CHECK(
        dit_json_get_int(root, "num_train_timesteps", path, false, 1000, 1, 1000000, &v, diag));
    s.num_train_timesteps = (int)v;
    DIT_CHECK(dit_json_get_double(root, "shift", path, false, 1.0, &s.shift, diag));
    DIT_CHECK(dit_json_get_bool(root, "use_dynamic_shifting", path, false, false,
                                &s.use_dynamic_shifting, diag));
    DIT_CHECK(dit_json_get_double(root, "base_shift", path, false, 0.5, &s.base_shift, diag));
    DIT_CHECK(dit_json_get_double(root, "max_shift", path, false, 1.15, &s.max_shift, diag));
    DIT_CHECK(dit_json_get_int(root, "base_image_seq_len", path, false, 256, 1, INT32_MAX,
                               &s.base_image_seq_len, diag));
    DIT_CHECK(dit_json_get_int(root, "max_image_seq_len", path, false, 4096, 1, INT32_MAX,
                               &s.max_image_seq_len, diag));
    DIT_CHECK(dit_json_get_bool(root, "invert_sigmas", path, false, false, &s.invert_sigmas, diag));
    DIT_CHECK(
        dit_json_get_double(root, "shift_terminal", path, false, 0.0, &s.shift_terminal, diag));
    DIT_CHECK(dit_json_get_string(root, "time_shift_type", path, false, &shift_type, diag));
    if (shift_type && strcmp(shift_type, "linear") != 0 && strcmp(shift_type, "exponential") != 0) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: unknown time_shift_type \"%s\"", path,
                          shift_type);
        goto cleanup;
    }
    s.linear_time_shift = shift_type && strcmp(shift_type, "linear") == 0;
    static const char *const unsupported[] = {"use_karras_sigmas", "use_exponential_sigmas",
                                              "use_beta_sigmas", "stochastic_sampling"};
    for (size_t i = 0; i < sizeof unsupported / sizeof *unsupported; i++) {
        DIT_CHECK(dit_json_get_bool(root, unsupported[i], path, false, false, &flag, diag));
        if (flag) {
            st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "%s: %s is not supported", path,
                              unsupported[i]);
            goto cleanup;
        }
    }
    if (s.base_image_seq_len == s.max_image_seq_len) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: base_image_seq_len equals max_image_seq_len",
                          path);
        goto cleanup;
    }
    *out = s;
cleanup:
    cJSON_Delete(root);
    return st;
}

double dit_flow_scheduler_mu(const dit_flow_scheduler *s, int64_t image_seq_len)
{
    const double m =
        (s->max_shift - s->base_shift) / (double)(s->max_image_seq_len - s->base_image_seq_len);
    const double b = s->base_shift - m * (double)s->base_image_seq_len;
    return (double)image_seq_len * m + b;
}

dit_status dit_flow_scheduler_schedule(const dit_flow_scheduler *s, int steps,
                                       int64_t image_seq_len, float *sigmas, float *timesteps,
                                       dit_diag *diag)
{
    if (steps < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "steps must be at least 1, not %d", steps);
    /* np.linspace(1.0, 1/N, N) in f64 (i * step + start, last = stop),
     * then .astype(np.float32). */
    const double start = 1.0, stop = 1.0 / steps;
    const double step = steps > 1 ? (stop - start) / (double)(steps - 1) : 0.0;
    for (int i = 0; i < steps; i++)
        sigmas[i] = (float)(i == steps - 1 && steps > 1 ? stop : (double)i * step + start);
    if (s->use_dynamic_shifting) {
        /* numpy with f32 arrays and Python-float scalars computes in f32. */
        const double mu = dit_flow_scheduler_mu(s, image_seq_len);
        const float e = s->linear_time_shift ? (float)mu : (float)exp(mu);
        for (int i = 0; i < steps; i++) {
            const float r = 1.0f / sigmas[i] - 1.0f;
            sigmas[i] = e / (e + r);
        }
    } else {
        const float sh = (float)s->shift, shm1 = (float)(s->shift - 1.0);
        for (int i = 0; i < steps; i++) {
            const float num = sh * sigmas[i];
            const float den = 1.0f + shm1 * sigmas[i];
            sigmas[i] = num / den;
        }
    }
    if (s->shift_terminal > 0.0) {
        const float scale = (1.0f - sigmas[steps - 1]) / (float)(1.0 - s->shift_terminal);
        for (int i = 0; i < steps; i++)
            sigmas[i] = 1.0f - (1.0f - sigmas[i]) / scale;
    }
    const float T = (float)s->num_train_timesteps;
    if (s->invert_sigmas) {
        for (int i = 0; i < steps; i++)
            sigmas[i] = 1.0f - sigmas[i];
        sigmas[steps] = 1.0f;
    } else {
        sigmas[steps] = 0.0f;
    }
    for (int i = 0; i < steps; i++)
        timesteps[i] = sigmas[i] * T;
    return DIT_OK;
}

void dit_flow_scheduler_step(float *x, const float *v, size_t n, float sigma, float sigma_next)
{
    const float dt = sigma_next - sigma;
    for (size_t i = 0; i < n; i++) {
        const float d = dt * v[i];
        x[i] = x[i] + d;
    }
}

/* The scheduler interface (schedulers/scheduler.h). */

static dit_status fme_load(const char *path, void **out, dit_diag *diag)
{
    dit_flow_scheduler *s = malloc(sizeof *s);
    if (!s)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    dit_status st = dit_flow_scheduler_load(path, s, diag);
    if (st != DIT_OK) {
        free(s);
        return st;
    }
    *out = s;
    return DIT_OK;
}

static dit_status fme_schedule(const void *s, int steps, int64_t seq_len, float *sigmas,
                               float *timesteps, dit_diag *diag)
{
    return dit_flow_scheduler_schedule(s, steps, seq_len, sigmas, timesteps, diag);
}

static dit_status fme_step(void *s, int i, const float *sigmas, float *x, const float *v, size_t n,
                           dit_diag *diag)
{
    (void)s;
    (void)diag;
    dit_flow_scheduler_step(x, v, n, sigmas[i], sigmas[i + 1]);
    return DIT_OK;
}

const dit_scheduler_class dit_flow_match_euler_class = {
    .diffusers_class = "FlowMatchEulerDiscreteScheduler",
    .load = fme_load,
    .free = free,
    .schedule = fme_schedule,
    .step = fme_step,
};
