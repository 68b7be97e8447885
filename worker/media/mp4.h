/* Turning decoded video frames into an H.264 MP4 file, the way diffusers'
 * WanPipeline(output_type="np") followed by export_to_video quantises them:
 *
 *   x = (video / 2 + 0.5).clamp(0, 1)             torch, float32
 *   u8 = (x * 255).astype(np.uint8)                numpy, float32
 *
 * The cast truncates (1.0 -> 255, 0.5 -> 127, 0.999 -> 254); the product
 * x * 255 is itself rounded to float32 first. NaN (which numpy casts to an
 * unspecified byte) becomes 0 here; infinities clamp like any other value.
 *
 * The RGB frames then go through libswscale to yuv420p (BT.601 matrix,
 * limited range, as ffmpeg converts by default; the stream is tagged so),
 * are encoded as H.264 by libx264 (CRF 18, preset medium; FFmpeg's default
 * H.264 encoder where libx264 is absent) and muxed by libavformat into an
 * MP4 with the moov box first ("faststart"), so that browsers start playing
 * before the whole file has arrived. Everything happens in memory.
 *
 * Owner: the caller owns every buffer these functions return (free()). */
#ifndef DIT_MEDIA_MP4_H
#define DIT_MEDIA_MP4_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What dit_mp4_encode accepts. Sides must be even (yuv420p halves both). */
#define DIT_MP4_MAX_FRAMES 10000
#define DIT_MP4_MAX_SIDE 8192
#define DIT_MP4_MAX_FPS 240

/* The export quantisation of one value (see above). */
uint8_t dit_mp4_quantize(float x);

/* One frame of host f32 planes -> interleaved RGB bytes (H, W, 3) in rgb
 * (3 * H * W bytes, caller-allocated). The R plane (H, W) starts at
 * frame, G at frame + channel_stride, B at frame + 2 channel_stride:
 * H * W for an image (3, H, W), F * H * W for frame f of a video
 * (3, F, H, W) at frame = video + f * H * W. */
void dit_mp4_to_rgb8(const float *frame, int64_t channel_stride, int64_t H, int64_t W,
                     uint8_t *rgb);

/* Encodes frames (3, n_frames, height, width) f32, as the VAE decodes a
 * video (dit_gen_result.image), at fps frames per second into a complete MP4 file in a
 * malloc'ed buffer (*out, *out_len). n_frames in 1..DIT_MP4_MAX_FRAMES,
 * width and height even in 2..DIT_MP4_MAX_SIDE, fps in 1..DIT_MP4_MAX_FPS;
 * anything else is DIT_ERR_INVALID_ARG with a message saying which. */
dit_status dit_mp4_encode(const float *frames, int n_frames, int height, int width, int fps,
                          uint8_t **out, size_t *out_len, dit_diag *diag);

/* dit_mp4_encode, then the bytes written to `path` atomically (a temporary
 * file in the same folder, fsync'ed and renamed over `path`). */
dit_status dit_mp4_write_file(const char *path, const float *frames, int n_frames, int height,
                              int width, int fps, dit_diag *diag);

#ifdef __cplusplus
}
#endif

#endif
