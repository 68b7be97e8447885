/* transformers' T5EncoderModel (FluxPipeline's `text_encoder_2`, T5 v1.1
 * XXL) on the backend interface, matching transformers in f32.
 *
 * Forward, as transformers computes it:
 *   x = shared[ids]                                    (no scaling)
 *   bias[h, i, j] = relative_attention_bias[bucket(j - i), h]
 *       bucket: bidirectional, relative_attention_num_buckets and
 *       relative_attention_max_distance; from block 0, shared by all blocks
 *   per block:  x += o(attention(RMS0(x), bias))       no 1/sqrt(d) scaling
 *               x += wo(act(wi_0(RMS1(x))) * wi_1(RMS1(x)))   gated FFN
 *            or x += wo(act(wi(RMS1(x))))                       non-gated
 *   last_hidden_state = final_layer_norm(x)
 * RMS is T5's LayerNorm: x / sqrt(mean(x^2) + eps) * weight, no mean, no
 * bias, in f32. The activation comes from feed_forward_proj ("gated-gelu"
 * means gelu_new, the tanh approximation), overridden by dense_act_fn and
 * is_gated_act when config.json carries them, as transformers does. No
 * attention mask: FluxPipeline passes none, so padding tokens attend too.
 *
 * The folder is transformers' `save_pretrained` output: config.json and
 * model.safetensors (or model.safetensors.index.json with shards). The tied
 * input embedding may be stored as shared.weight, encoder.embed_tokens.weight
 * or both; decoder tensors of a full T5 checkpoint are ignored, as
 * T5EncoderModel ignores them.
 *
 * Owner: the thread that owns the backend; not thread-safe. */
#ifndef DIT_ENCODERS_T5_ENCODER_H
#define DIT_ENCODERS_T5_ENCODER_H

#include <stdint.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "core/status.h"
#include "core/tensor.h"

typedef struct dit_t5_encoder dit_t5_encoder;

/* Reads <dir>/config.json and the weights. Errors name the file and, for
 * checkpoint problems, the tensor (missing, unexpected or mis-shaped). */
dit_status dit_t5_encoder_load(dit_backend *be, const char *dir, dit_t5_encoder **out,
                               dit_diag *diag);

/* NULL-safe. */
void dit_t5_encoder_free(dit_t5_encoder *m);

int dit_t5_encoder_d_model(const dit_t5_encoder *m);

/* ids: host (B, S) token ids, each in [0, vocab_size). out: backend
 * (B, S, d_model) f32 receiving last_hidden_state. Scratch comes from
 * `arena` (including the (heads, S, S) position bias) and is released before
 * returning; `out` may itself live in the arena (allocated before the call). */
dit_status dit_t5_encoder_forward(dit_t5_encoder *m, dit_arena *arena, const int32_t *ids,
                                  int64_t B, int64_t S, const dit_tensor *out, dit_diag *diag);

/* T5Attention._relative_position_bucket with bidirectional=True for the
 * relative position rel = key - query, reproducing its float32 logarithm
 * arithmetic so bucket edges land where PyTorch puts them. Needs
 * num_buckets >= 4 and max_distance > num_buckets / 4 (what the loader
 * accepts). */
int dit_t5_relative_bucket(int64_t rel, int num_buckets, int max_distance);

#endif
