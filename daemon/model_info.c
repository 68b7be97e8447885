#include "model_info.h"

bool dit_model_info_add_config(dit_model_info *m, const char *key, int64_t value)
{
    if (m->n_config >= DIT_MODEL_MAX_CONFIG)
        return false;
    m->config[m->n_config++] = (dit_model_config_value){key, value};
    return true;
}

void dit_model_info_set_layout(dit_model_info *m, const dit_parallel_config *pc)
{
    const int cp = pc->ring_degree * pc->ulysses_degree;
    m->token_divisor = cp > 1 && !dit_parallel_uneven(pc) ? cp : 1;
}

dit_status dit_model_info_check_frames(const dit_model_info *m, int num_frames, int fps,
                                       dit_diag *diag)
{
    if (m->task != DIT_TASK_TEXT_TO_VIDEO) {
        if (num_frames != 0 && num_frames != 1)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "num_frames %d: %s makes images (num_frames 0 or 1)", num_frames,
                                m->pipeline_class);
        if (fps != 0)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "fps %d: %s makes images, which have no frame rate (leave fps 0)",
                                fps, m->pipeline_class);
        return DIT_OK;
    }
    if (num_frames < 0 || (num_frames > 0 && m->frame_step > 0 && (num_frames - 1) % m->frame_step))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_frames %d: %s wants 0 (its default, %d) or %d x k + 1 frames",
                            num_frames, m->pipeline_class, m->default_num_frames, m->frame_step);
    if (fps < 0 || fps > 240)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "fps %d: use 0 (the default, %d) or 1 to 240", fps, m->default_fps);
    return DIT_OK;
}

const char *dit_task_name(dit_task t)
{
    switch (t) {
    case DIT_TASK_TEXT_TO_IMAGE:
        return "text-to-image";
    case DIT_TASK_TEXT_TO_VIDEO:
        return "text-to-video";
    }
    return "unknown";
}
