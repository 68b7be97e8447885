/* WanPipeline's config-only part (pipelines/probe.h): the transformer's
 * sizes from transformer/config.json (models/wan/wan_config.c, JSON only),
 * the VAE's spatial and temporal factors from vae/config.json, Wan 2.1's
 * defaults and the request rules. Links no compute code (ditd uses it).
 *
 * Owner: a static table. */
#ifndef DIT_PIPELINES_WAN_PROBE_H
#define DIT_PIPELINES_WAN_PROBE_H

#include "pipelines/probe.h"

extern const dit_pipeline_probe_class dit_probe_wan_pipeline;

/* The latent video's frames, rows and columns for a checked request:
 * (num_frames - 1) / temporal + 1, height / spatial, width / spatial. */
void dit_wan_latent_dims(const dit_pipeline_info *info, const dit_gen_params *gp, int64_t *f,
                         int64_t *h, int64_t *w);

#endif
