/* The decoder half of diffusers' AutoencoderKL, as FluxPipeline uses it:
 *
 *   latents = latents / scaling_factor + shift_factor      (the caller)
 *   image   = vae.decode(latents)                          (dit_vae_decode)
 *
 * Structure (diffusers models/autoencoders/vae.py Decoder), with
 * Cr = reversed(block_out_channels), n = layers_per_block:
 *
 *   [post_quant_conv 1x1, latent -> latent]      when use_post_quant_conv
 *   conv_in 3x3, latent -> Cr[0]
 *   mid_block: resnet, [attention], resnet        all at Cr[0]
 *   up_blocks[i], i = 0 .. L-1: n + 1 resnets (the first Cr[i-1] -> Cr[i]),
 *       then nearest 2x upsampling + conv 3x3 on all but the last block
 *   conv_norm_out GroupNorm + SiLU, conv_out 3x3, Cr[L-1] -> out_channels
 *
 * Every GroupNorm has eps 1e-6 and norm_num_groups groups. A resnet is
 *   x + conv2(silu(gn2(conv1(silu(gn1(x))))))   (conv_shortcut(x) when the
 *   channel count changes); the mid-block attention is single-head
 *   (head_dim = channels) over the H*W positions with its own GroupNorm and a
 *   residual connection.
 *
 * Layout: NCHW f32 activations on the backend. Weights come from
 * `<dir>/diffusion_pytorch_model.safetensors` (or a sharded index) and
 * `<dir>/config.json`; tensors under `encoder.` and `quant_conv.` (the
 * encoder half, in the same checkpoint) are ignored without being uploaded,
 * everything else must be exactly the decoder's parameters.
 *
 * Owner: the thread that loaded it (like the backend it runs on). */
#ifndef DIT_VAE_AUTOENCODER_KL_H
#define DIT_VAE_AUTOENCODER_KL_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dit_vae_decoder dit_vae_decoder;

/* Loads `<dir>/config.json` and the decoder's weights. Errors name the file
 * and the key or tensor (missing, mis-shaped, unexpected). */
dit_status dit_vae_decoder_load(dit_backend *be, const char *dir, dit_vae_decoder **out,
                                dit_diag *diag);
void dit_vae_decoder_free(dit_vae_decoder *v);

/* config.json's scaling_factor and shift_factor (null -> 0). */
float dit_vae_scaling_factor(const dit_vae_decoder *v);
float dit_vae_shift_factor(const dit_vae_decoder *v);
int dit_vae_latent_channels(const dit_vae_decoder *v);
/* Channels of the decoded image (config out_channels, 3 for every RGB VAE). */
int dit_vae_out_channels(const dit_vae_decoder *v);
/* Pixels per latent along each axis: 2^(len(block_out_channels) - 1). */
int dit_vae_scale_factor(const dit_vae_decoder *v);
/* Bytes of weights held on the backend. */
size_t dit_vae_weight_bytes(const dit_vae_decoder *v);

/* Arena bytes dit_vae_decode needs for latents of h x w (any batch: images
 * are decoded one at a time). */
size_t dit_vae_decode_workspace(const dit_vae_decoder *v, int64_t h, int64_t w);

/* image = vae.decode(z). z: backend (B, latent_channels, h, w) f32,
 * contiguous, already z = latents / scaling_factor + shift_factor. image:
 * backend (B, out_channels, h * scale, w * scale) f32 contiguous, written
 * as vae.decode returns it (roughly in [-1, 1]). Scratch comes from `arena`
 * and is released before returning. */
dit_status dit_vae_decode(dit_vae_decoder *v, dit_arena *arena, const dit_tensor *z,
                          const dit_tensor *image, dit_diag *diag);

#ifdef __cplusplus
}
#endif

#endif
