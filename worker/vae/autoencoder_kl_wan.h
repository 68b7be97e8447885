/* The decoder half of diffusers' AutoencoderKLWan, as WanPipeline uses it:
 *
 *   z     = latents / (1 / latents_std) + latents_mean   (dit_wan_vae_denormalize)
 *   video = clamp(vae.decode(z), -1, 1)                  (dit_wan_vae_decode)
 *
 * Structure (diffusers autoencoder_kl_wan.py WanDecoder3d, is_residual
 * false), with d = decoder_base_dim (base_dim when null), m = dim_mult,
 * dims = d * [m[-1]] + d * reversed(m), n = num_res_blocks and
 * up = reversed(temperal_downsample):
 *
 *   post_quant_conv 1x1x1, z_dim -> z_dim
 *   conv_in 3x3x3, z_dim -> dims[0]
 *   mid_block: resnet, attention, resnet           all at dims[0]
 *   up_blocks[i], i = 0 .. L-1: n + 1 resnets (the first in -> dims[i+1],
 *       in = dims[i], halved for i > 0), then on all but the last block a
 *       resample at dims[i+1]: "upsample3d" where up[i] (the time_conv
 *       below, then the 2-D part), else "upsample2d" (nearest 2x and a 3x3
 *       conv2d, dims[i+1] -> dims[i+1] / 2, frame by frame)
 *   norm_out (RMS) + SiLU, conv_out 3x3x3, dims[L] -> out_channels
 *
 * Every 3-D convolution is causal in time: its input is padded with two
 * zero frames in front (none behind) and one pixel of zeros around each
 * frame (3x3x3 kernels). A resnet is x' + conv2(silu(rms2(conv1(silu(
 * rms1(x)))))), x' the 1x1x1 conv_shortcut when the channel count changes;
 * the RMS norms are F.normalize over channels * sqrt(C) * gamma. The
 * attention is single-head (head_dim = C) over the H*W positions of each
 * frame, with its own RMS norm and a residual connection.
 *
 * Like diffusers' _decode, this decodes one latent frame at a time with a
 * per-convolution cache of the last two input frames (zeros before the
 * first), so every causal convolution sees the zero-padded sequence and
 * memory holds one chunk's activations plus the caches. upsample3d's
 * time_conv skips the very first frame (diffusers' "Rep" cache): frame 0
 * passes unchanged, every later frame goes through a causal (3, 1, 1) conv
 * to 2C channels whose halves become two frames. T latent frames give
 * 1 + 4 (T - 1) frames with Wan 2.1's two temporal upsamplings.
 *
 * Layout: activations (T, C, H, W) f32 on the backend, each frame a
 * contiguous NCHW image, so a 3x3x3 conv of output frame t is one conv2d
 * over the three input frames t-2 .. t seen as 3C channels, with the
 * weight rearranged at load to (Cout, 3 Cin, 3, 3). Activations are
 * allocated per layer and freed when consumed.
 *
 * Weights come from `<dir>/diffusion_pytorch_model.safetensors` and
 * `<dir>/config.json`; tensors under `encoder.` and `quant_conv.` are
 * ignored, everything else must be exactly the decoder's parameters.
 *
 * Owner: the thread that loaded it (like the backend it runs on). */
#ifndef DIT_VAE_AUTOENCODER_KL_WAN_H
#define DIT_VAE_AUTOENCODER_KL_WAN_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dit_wan_vae dit_wan_vae;

/* Loads `<dir>/config.json` and the decoder's weights. Errors name the file
 * and the key or tensor (missing, mis-shaped, unexpected). */
dit_status dit_wan_vae_load(dit_backend *be, const char *dir, dit_wan_vae **out, dit_diag *diag);
void dit_wan_vae_free(dit_wan_vae *v);

/* config.json's z_dim (latent channels) and out_channels. */
int dit_wan_vae_z_dim(const dit_wan_vae *v);
int dit_wan_vae_out_channels(const dit_wan_vae *v);
/* Pixels per latent along H and W (2^number of upsampling blocks). */
int dit_wan_vae_spatial_scale(const dit_wan_vae *v);
/* Frames decoded from `latent_frames` latent frames (1 + 4 (T - 1) for
 * Wan 2.1's two temporal upsamplings). */
int64_t dit_wan_vae_frames(const dit_wan_vae *v, int64_t latent_frames);

/* WanPipeline's de-normalisation, in place on host latents (z_dim, n) f32
 * (n = T * h * w per channel): x = x / (1 / latents_std[c]) +
 * latents_mean[c], rounded as torch rounds it. */
void dit_wan_vae_denormalize(const dit_wan_vae *v, float *latents, int64_t n);

/* video = clamp(vae.decode(z).sample, -1, 1). z: host (1, z_dim, T, h, w)
 * f32 contiguous, already de-normalised. video: host (1, out_channels,
 * dit_wan_vae_frames(T), h * s, w * s) f32 contiguous, s the spatial
 * scale. */
dit_status dit_wan_vae_decode(dit_wan_vae *v, const dit_tensor *z, const dit_tensor *video,
                              dit_diag *diag);

#ifdef __cplusplus
}
#endif

#endif
