/* The scheduler interface: a pipeline asks for the timesteps of a
 * generation and steps its latents, without knowing the scheduler class.
 * Classes are found by scheduler_config.json's `_class_name` (registry in
 * schedulers/scheduler.c).
 *
 * Adding a scheduler: a dit_scheduler_class in its own file and one line in
 * scheduler.c.
 *
 * Owner: the pipeline that loaded it; one generation at a time. */
#ifndef DIT_SCHEDULERS_SCHEDULER_H
#define DIT_SCHEDULERS_SCHEDULER_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

typedef struct dit_scheduler_class {
    const char *diffusers_class; /* "FlowMatchEulerDiscreteScheduler" */
    dit_status (*load)(const char *path, void **out, dit_diag *diag);
    void (*free)(void *s);
    /* steps + 1 sigmas and steps timesteps (as the transformer gets them,
     * before any /1000) for `seq_len` latent tokens (dynamic shifting). */
    dit_status (*schedule)(const void *s, int steps, int64_t seq_len, float *sigmas,
                           float *timesteps, dit_diag *diag);
    /* One step i: x <- step(x, model output v), n elements. Called once per
     * step in order; multistep schedulers keep their history in s (and may
     * fail for want of memory for it at step 0). */
    dit_status (*step)(void *s, int i, const float *sigmas, float *x, const float *v, size_t n,
                       dit_diag *diag);
    /* Optional (NULL: nothing to do): called by dit_scheduler_set_timesteps
     * after schedule, with the step count; multistep schedulers drop the
     * history of an earlier generation here. */
    dit_status (*start)(void *s, int steps, dit_diag *diag);
} dit_scheduler_class;

typedef struct dit_scheduler dit_scheduler;

/* Reads path (scheduler_config.json); without `_class_name` the file is read
 * as `default_class`. Unknown classes are errors naming the known ones. */
dit_status dit_scheduler_load(const char *path, const char *default_class, dit_scheduler **out,
                              dit_diag *diag);
void dit_scheduler_free(dit_scheduler *s);

/* Plans a generation of `steps` steps at `seq_len` latent tokens. */
dit_status dit_scheduler_set_timesteps(dit_scheduler *s, int steps, int64_t seq_len,
                                       dit_diag *diag);

/* The transformer's timestep of step i (after set_timesteps). */
float dit_scheduler_timestep(const dit_scheduler *s, int i);

/* Step i on n latents with the model output v. */
dit_status dit_scheduler_step(dit_scheduler *s, int i, float *x, const float *v, size_t n,
                              dit_diag *diag);

#endif
