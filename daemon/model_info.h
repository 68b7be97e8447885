/* What the served pipeline says about itself, in family-neutral terms: its
 * diffusers classes, its task (text to image or text to video), the
 * defaults a request's zeros stand for, the shapes the model and the
 * parallel layout allow, and the config values a client needs to build
 * tensors. ListModels and GetServerInfo report it; Generate checks
 * num_frames and fps against it.
 *
 * Filled once at start-up by ditd from the pipeline probe (today FLUX's,
 * in ditd.c; a pipeline registry will fill it per family), then read-only.
 * Nothing here knows a model family.
 *
 * Owner: main fills it; the loop thread reads it. */
#ifndef DIT_DAEMON_MODEL_INFO_H
#define DIT_DAEMON_MODEL_INFO_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"
#include "parallel/mesh.h"

typedef enum dit_task {
    DIT_TASK_TEXT_TO_IMAGE = 1, /* values as ditserve.v1.Task */
    DIT_TASK_TEXT_TO_VIDEO = 2,
} dit_task;

#define DIT_MODEL_MAX_CONFIG 16

typedef struct dit_model_config_value {
    const char *key; /* diffusers config name, static storage */
    int64_t value;
} dit_model_config_value;

typedef struct dit_model_info {
    const char *pipeline_class;    /* "FluxPipeline" */
    const char *transformer_class; /* "FluxTransformer2DModel" */
    dit_task task;
    bool has_text_encoders;
    int default_width, default_height, default_steps, default_num_frames, default_fps;
    /* Layout rules (ditserve.v1.LayoutRules). */
    int size_multiple;    /* width and height: multiples of this */
    int pixels_per_token; /* per side */
    int token_divisor;    /* image and text token counts: multiples of this */
    int64_t max_pixels;
    int max_steps;
    int max_sequence_length;
    int frame_step; /* num_frames - 1 a multiple of this; 0: images only */
    dit_model_config_value config[DIT_MODEL_MAX_CONFIG];
    int n_config;
} dit_model_info;

/* The layout's rule for token counts: a multiple of the context-parallel
 * size (ring x Ulysses) in the plain modes, any count (1) with one rank, TP
 * alone, or an "anything" mode. */
void dit_model_info_set_layout(dit_model_info *m, const dit_parallel_config *pc);

/* Appends a config value (key in static storage). False when the table is
 * full (DIT_MODEL_MAX_CONFIG). */
bool dit_model_info_add_config(dit_model_info *m, const char *key, int64_t value);

/* The request's frame count and rate against the task: a text-to-image
 * pipeline takes num_frames 0 or 1 and fps 0; a video pipeline takes
 * num_frames 0 (its default) or one its frame_step allows, and fps 0 (its
 * default) to 240. DIT_ERR_INVALID_ARG with a message naming the field. */
dit_status dit_model_info_check_frames(const dit_model_info *m, int num_frames, int fps,
                                       dit_diag *diag);

/* "text-to-image" or "text-to-video". */
const char *dit_task_name(dit_task t);

#endif
