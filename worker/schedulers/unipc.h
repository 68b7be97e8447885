/* UniPCMultistepScheduler, as diffusers' WanPipeline drives it: flow
 * prediction on flow sigmas, a multistep UniP predictor of order up to
 * solver_order (B(h) = bh1 or bh2) with the UniC corrector, and lower orders
 * on the first steps (warm-up) and, with lower_order_final, the last ones.
 *
 * Sigmas and timesteps are computed with the same f64 operations as numpy in
 * diffusers' set_timesteps (linspace(1, 1/T, N + 1)[:-1], shifted by
 * s·σ / (1 + (s - 1)·σ), the first one moved to 1 - 1e-6 when it is 1, a
 * final sigma 0 or sigma_min appended, then cast to f32); the timesteps are
 * int64(σ·T) of the f64 sigmas. A step works in f32 as diffusers does when the
 * model output and the sample are f32 (scalars as 0-dim f32 tensors); log and
 * expm1 round the f64 result, which may differ by an ulp from torch's.
 *
 * Owner: the pipeline that loaded it; it keeps the history of one generation
 * (the model outputs of the last solver_order steps and the last sample). */
#ifndef DIT_SCHEDULERS_UNIPC_H
#define DIT_SCHEDULERS_UNIPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "schedulers/scheduler.h"

#define DIT_UNIPC_MAX_ORDER 3
#define DIT_UNIPC_MAX_DISABLED 64

typedef struct dit_unipc_config {
    int num_train_timesteps;
    int solver_order; /* 1 to DIT_UNIPC_MAX_ORDER */
    bool bh1;         /* solver_type "bh1" (B(h) = h) instead of "bh2" (e^h - 1) */
    bool lower_order_final;
    double flow_shift;
    bool final_sigma_min; /* final_sigmas_type "sigma_min" instead of "zero" */
    int n_disable_corrector;
    int64_t disable_corrector[DIT_UNIPC_MAX_DISABLED]; /* steps whose next step skips UniC */
} dit_unipc_config;

/* Reads scheduler_config.json with diffusers' keys and defaults. Configs this
 * scheduler does not implement (another prediction_type, use_flow_sigmas
 * false, thresholding, solver_p, karras/exponential/beta sigmas, dynamic
 * shifting, shift_terminal, solver_order above DIT_UNIPC_MAX_ORDER, bh1 with a
 * final sigma of zero, whose last step is NaN in diffusers) are errors naming
 * the key. */
dit_status dit_unipc_config_load(const char *path, dit_unipc_config *out, dit_diag *diag);

/* steps + 1 sigmas (f32, as diffusers stores them) and steps timesteps
 * (int64 values, exact in f32). */
dit_status dit_unipc_schedule(const dit_unipc_config *c, int steps, float *sigmas,
                              int64_t *timesteps, dit_diag *diag);

/* This scheduler as a dit_scheduler_class. */
extern const dit_scheduler_class dit_unipc_class;

#endif
