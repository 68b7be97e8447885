/* Forward-pass inputs read from a safetensors file whose tensors are named
 * as the model's forward arguments in diffusers (FluxTransformer2DModel:
 * hidden_states, encoder_hidden_states, pooled_projections, timestep,
 * img_ids, txt_ids and, with guidance embeds, guidance). Every tensor is
 * converted to f32 and checked by the model class (check_inputs), with
 * messages that name the file and the tensor.
 *
 * Owner: the caller. */
#ifndef DIT_RUNTIME_INPUTS_H
#define DIT_RUNTIME_INPUTS_H

#include "core/named_tensors.h"
#include "models/model.h"

typedef struct dit_input_file dit_input_file;

dit_status dit_input_file_load(const char *path, const dit_model_class *cls, const void *cfg,
                               dit_input_file **out, dit_diag *diag);
void dit_input_file_free(dit_input_file *f);

/* Host f32 views into the loaded arrays, valid while the file object lives. */
const dit_named_tensors *dit_input_file_inputs(const dit_input_file *f);

/* Reads only the lengths of the sequences the class's context-parallel plan
 * splits (seq_lens: parallel_req's n_seqs values) from the header, without
 * converting anything. */
dit_status dit_input_file_peek(const char *path, const dit_model_class *cls, const void *cfg,
                               int64_t *seq_lens, dit_diag *diag);

#endif
