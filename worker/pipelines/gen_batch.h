/* Bookkeeping of a batched generation (dit_pipeline_generate_batch), shared
 * by the pipeline classes; internal to pipelines/.
 *
 * A batch has n members, member m with ni[m] images (num_images). Images
 * are numbered over the whole batch, member 0's first: member m's are
 * off[m] .. off[m] + ni[m] - 1 of `total`. The scheduler-level arrays
 * (latents, combined model output) keep every member at full size in that
 * order for the whole generation; the transformer only sees the images of
 * the members still active, gathered in member order (gather), and its
 * output goes back to their slots (scatter). A member that left keeps its
 * slot, whose model output is zero from then on: the schedulers step
 * elementwise, so the slot evolves on its own and is discarded.
 *
 * Owner: the generating call, on its thread. */
#ifndef DIT_PIPELINES_GEN_BATCH_H
#define DIT_PIPELINES_GEN_BATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "pipelines/pipeline.h"

typedef struct dit_gen_batch {
    int n;
    int64_t total;  /* images over all members */
    int64_t *off;   /* n: member m's first image */
    int64_t *ni;    /* n: member m's image count */
    bool *active;   /* n: still in the batch */
    bool *mask;     /* n: the callback's copy */
    int n_active;   /* members active */
    int64_t images; /* images of the active members */
} dit_gen_batch;

/* Checks the members (each with dit_gen_check, all pairwise batchable with
 * member 0 by dit_gen_batch_compatible), clears res and sets every status
 * to DIT_OK, and lays the batch out. On failure nothing is allocated. */
dit_status dit_gen_batch_init(dit_gen_batch *b, const dit_pipeline_info *info, int n,
                              const dit_gen_params *gps, dit_gen_result *res, dit_status *member_st,
                              dit_diag *diag);
void dit_gen_batch_free(dit_gen_batch *b);

/* Copies the active members' images, `per` floats each, from src (total
 * images) to dst (b->images images, packed); returns b->images. */
int64_t dit_gen_batch_gather(const dit_gen_batch *b, const float *src, int64_t per, float *dst);

/* The inverse: src (b->images images, packed) to the active members' slots
 * in dst (total images). */
void dit_gen_batch_scatter(const dit_gen_batch *b, const float *src, int64_t per, float *dst);

/* Calls the progress callback (if any) with a copy of the active mask and
 * drops the members it cleared: their result is freed, their status is
 * DIT_ERR_CANCELLED and their slot of `v` (total images of `per` floats) is
 * zeroed. Returns the callback's status, or DIT_ERR_CANCELLED (diag set)
 * when no member is left. *changed: whether any member left. */
dit_status dit_gen_batch_progress(dit_gen_batch *b, dit_gen_batch_progress_fn progress, void *ctx,
                                  int step, int total, double elapsed_ms, dit_gen_result *res,
                                  dit_status *member_st, float *v, int64_t per, bool *changed,
                                  dit_diag *diag);

/* Which request field scales a pipeline's classifier-free guidance. */
typedef enum dit_gen_cfg_scale {
    DIT_GEN_CFG_TRUE,     /* true_cfg_scale (FLUX's true CFG) */
    DIT_GEN_CFG_GUIDANCE, /* guidance_scale (Wan's classic CFG) */
} dit_gen_cfg_scale;

/* Classifier-free guidance over a forward's output: `out` holds the
 * active members' conditional images (b->images of `per` floats, member
 * order), then their unconditional ones in the same order; each
 * conditional image becomes uncond + scale * (cond - uncond), rounded in
 * diffusers' order, with its member's scale (gps[m]'s `which` field). */
void dit_gen_batch_cfg(const dit_gen_batch *b, float *out, int64_t per, const dit_gen_params *gps,
                       dit_gen_cfg_scale which);

/* Takes one step's time into the running *min and *max (start them at
 * INFINITY and 0) and writes both into every member's result. */
void dit_gen_batch_step_time(dit_gen_result *res, int n, double step_ms, double *min, double *max);

/* After the last step: each member still in the batch gets the denoising
 * time and its final latents (its ni images of `per` floats from `lat`,
 * total images). */
void dit_gen_batch_finish(const dit_gen_batch *b, dit_gen_result *res, const float *lat,
                          int64_t per, double denoise_ms);

/* Whether image i of member m (still active) is to be decoded by this
 * call: decode (dit_pipeline_generate_batch's masks, NULL: none) names it. */
bool dit_gen_batch_decodes_image(const dit_gen_batch *b, const dit_gen_decode *decode, int m,
                                 int64_t i);

/* Whether any image of member m (still active) is to be decoded. */
bool dit_gen_batch_decodes(const dit_gen_batch *b, const dit_gen_decode *decode, int m);

/* Whether any image of any active member is to be decoded by this call. */
bool dit_gen_batch_decodes_any(const dit_gen_batch *b, const dit_gen_decode *decode);

/* After a failure: frees every result and sets every member's status. */
void dit_gen_batch_fail(const dit_gen_batch *b, dit_status st, dit_gen_result *res,
                        dit_status *member_st);

#endif
