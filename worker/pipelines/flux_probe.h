/* FluxPipeline's config-only part (pipelines/probe.h): the transformer's
 * sizes read from transformer/config.json, the VAE's scale, the request
 * rules. Links no compute code (ditd uses it); the workers read the full
 * transformer config with models/flux/flux_config.c when they load it.
 *
 * Owner: a static table. */
#ifndef DIT_PIPELINES_FLUX_PROBE_H
#define DIT_PIPELINES_FLUX_PROBE_H

#include "pipelines/probe.h"

extern const dit_pipeline_probe_class dit_probe_flux_pipeline;

#endif
