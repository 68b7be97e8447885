/* WanPipeline (Wan 2.1 text to video): prompt in, video out, equal to
 * diffusers' WanPipeline on the same weights, as a pipeline class
 * (pipelines/pipeline.h).
 *
 * A pipeline folder as diffusers saves it (model_index.json, transformer/,
 * vae/ (AutoencoderKLWan), text_encoder/ (UMT5), tokenizer/, scheduler/
 * (UniPCMultistepScheduler)). Generation, in WanPipeline.__call__'s order:
 *   - prompt_embeds from UMT5 (cleaned prompt, trimmed to its tokens and
 *     zero-padded to max_sequence_length), and with guidance_scale > 1 the
 *     negative prompt's (default "");
 *   - noise torch.randn((1, C, (F - 1) / 4 + 1, H / 8, W / 8)) from the
 *     seed, f32, as a CPU torch.Generator draws it (or the caller's
 *     latents in that shape);
 *   - per UniPC timestep t (int64, as the transformer gets it): the
 *     transformer on the prompt, with CFG also on the negative prompt and
 *     noise = uncond + g (cond - uncond); then the scheduler's step;
 *   - latents / (1 / latents_std) + latents_mean, the VAE decode, clamped
 *     to [-1, 1]: (3, F, H, W).
 * Its config-only part (probe, request rules) is pipelines/wan_probe.h.
 *
 * Owner: a static table. */
#ifndef DIT_PIPELINES_WAN_PIPELINE_H
#define DIT_PIPELINES_WAN_PIPELINE_H

#include "pipelines/pipeline.h"

extern const dit_pipeline_class dit_wan_pipeline_class;

#endif
