/* Forward-pass inputs read from a safetensors file whose tensors are named
 * as diffusers' FluxTransformer2DModel.forward arguments: hidden_states,
 * encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids and
 * (with guidance embeds) guidance. Converted to f32 and checked against the
 * model config, with messages that name the file and the tensor.
 *
 * Owner: the caller. */
#ifndef DIT_RUNTIME_INPUTS_H
#define DIT_RUNTIME_INPUTS_H

#include "models/flux/flux_config.h"
#include "runtime/runner.h"

typedef struct dit_input_file dit_input_file;

dit_status dit_input_file_load(const char *path, const dit_flux_config *cfg, dit_input_file **out,
                               dit_diag *diag);
void dit_input_file_free(dit_input_file *f);

/* Views into the loaded arrays, valid while the file object lives. */
const dit_forward_inputs *dit_input_file_inputs(const dit_input_file *f);

/* Reads only the token counts (B, image tokens, text tokens) from the
 * header, without converting anything. */
dit_status dit_input_file_peek(const char *path, int64_t *batch, int64_t *img_tokens,
                               int64_t *txt_tokens, dit_diag *diag);

#endif
