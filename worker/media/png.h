/* Turning a decoded image into PNG bytes, exactly the way diffusers'
 * VaeImageProcessor.postprocess(image, output_type="pil") quantises it:
 *
 *   x = (image * 0.5 + 0.5).clamp(0, 1)          torch, float32
 *   u8 = (x * 255).round().astype("uint8")        numpy, float32
 *
 * numpy's round() is round-half-to-even, so 127.5 -> 128 but 0.5 -> 0 and
 * 2.5 -> 2; the product x * 255 is itself rounded to float32 first. NaN
 * (which numpy casts to an unspecified byte) becomes 0 here.
 *
 * Encoding and decoding use libpng from memory (no temporary files); its
 * longjmp errors become dit_status values.
 *
 * Owner: the caller owns every buffer these functions return (free()). */
#ifndef DIT_MEDIA_PNG_H
#define DIT_MEDIA_PNG_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The postprocess quantisation of one value (see above). */
uint8_t dit_png_quantize(float x);

/* chw (3, H, W) host f32, as the VAE outputs it -> interleaved RGB bytes
 * (H, W, 3) in rgb (3 * H * W bytes, caller-allocated). */
void dit_png_to_rgb8(const float *chw, int64_t H, int64_t W, uint8_t *rgb);

/* Encodes interleaved 8-bit RGB (H, W, 3) as a PNG into a malloc'ed buffer. */
dit_status dit_png_encode_rgb8(const uint8_t *rgb, int64_t H, int64_t W, uint8_t **png, size_t *len,
                               dit_diag *diag);

/* dit_png_to_rgb8 followed by dit_png_encode_rgb8. */
dit_status dit_png_encode_rgb(const float *chw, int64_t H, int64_t W, uint8_t **png, size_t *len,
                              dit_diag *diag);

/* Writes already encoded bytes (from dit_png_encode_rgb) to `path`
 * atomically: they go to a temporary file in the same folder, which is
 * fsync'ed and renamed over `path`, so readers never see a partial image. */
dit_status dit_png_write_file(const char *path, const uint8_t *png, size_t len, dit_diag *diag);

/* Decodes a PNG (any colour type or bit depth libpng can expand) to 8-bit
 * RGB (H, W, 3) in a malloc'ed buffer; alpha is dropped, grey expanded,
 * 16-bit reduced. For tests and tools. */
dit_status dit_png_decode_rgb8(const uint8_t *png, size_t len, uint8_t **rgb, int64_t *H,
                               int64_t *W, dit_diag *diag);

#ifdef __cplusplus
}
#endif

#endif
