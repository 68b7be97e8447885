/* FlowMatchEulerDiscreteScheduler, as diffusers' FluxPipeline drives it:
 * sigmas = linspace(1, 1/N, N), shifted by the image sequence length
 * (dynamic shifting) or by a fixed shift, timesteps = sigmas * T, a final
 * sigma of 0, and Euler steps x <- x + (sigma_next - sigma) * v in f32.
 *
 * Every constant comes from scheduler_config.json, and every value is
 * computed with the same f32/f64 operations as numpy and torch do there, so
 * the timesteps and sigmas are bit-identical to diffusers'.
 *
 * Owner: plain values. */
#ifndef DIT_SCHEDULERS_FLOW_MATCH_EULER_H
#define DIT_SCHEDULERS_FLOW_MATCH_EULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "schedulers/scheduler.h"

typedef struct dit_flow_scheduler {
    int num_train_timesteps;
    double shift;
    bool use_dynamic_shifting;
    double base_shift, max_shift;
    int64_t base_image_seq_len, max_image_seq_len;
    bool invert_sigmas;
    double shift_terminal;  /* 0: off */
    bool linear_time_shift; /* time_shift_type "linear" instead of "exponential" */
} dit_flow_scheduler;

/* diffusers' defaults with FLUX.1's dynamic shifting. */
dit_flow_scheduler dit_flow_scheduler_flux_default(void);

/* Reads scheduler/scheduler_config.json; options this scheduler does not
 * implement (karras, exponential or beta sigmas, stochastic sampling) are
 * errors that name them. */
dit_status dit_flow_scheduler_load(const char *path, dit_flow_scheduler *out, dit_diag *diag);

/* FluxPipeline's mu for an image of `image_seq_len` packed tokens. */
double dit_flow_scheduler_mu(const dit_flow_scheduler *s, int64_t image_seq_len);

/* sigmas (steps + 1 values, the last 0 or 1) and timesteps (steps values)
 * for `steps` steps at `image_seq_len` tokens. */
dit_status dit_flow_scheduler_schedule(const dit_flow_scheduler *s, int steps,
                                       int64_t image_seq_len, float *sigmas, float *timesteps,
                                       dit_diag *diag);

/* x <- x + (sigma_next - sigma) * v, element-wise, unfused f32. */
void dit_flow_scheduler_step(float *x, const float *v, size_t n, float sigma, float sigma_next);

/* This scheduler as a dit_scheduler_class. */
extern const dit_scheduler_class dit_flow_match_euler_class;

#endif
