/* transformers' CLIPTextModel (FluxPipeline's `text_encoder`, CLIP ViT-L/14's
 * text tower) on the backend interface, matching transformers in f32.
 *
 * Forward, as transformers computes it:
 *   x = token_embedding[ids] + position_embedding[0..S)
 *   per layer:  x += out_proj(causal_attention(LN1(x)))      scale head_dim^-0.5
 *               x += fc2(act(fc1(LN2(x))))                   act = config hidden_act
 *   last_hidden_state = final_layer_norm(x)
 *   pooler_output[b] = last_hidden_state[b, eos_pos(b)]
 * where eos_pos follows transformers' two rules: with eos_token_id == 2 in
 * config.json (the legacy rule, which FLUX.1's CLIP-L config uses) it is the
 * argmax of the ids (the first occurrence of the largest id, which is EOS
 * for CLIP's tokenizer); otherwise it is the first position holding
 * eos_token_id, or 0 when the row has none. No attention mask is taken:
 * FluxPipeline passes none, so every token attends causally.
 *
 * The folder is transformers' `save_pretrained` output: config.json and
 * model.safetensors (or a sharded model.safetensors.index.json). Tensor names
 * may carry the "text_model." prefix (transformers 4.x, FLUX.1 checkpoints)
 * or not (transformers 5); both load.
 *
 * Owner: the thread that owns the backend; not thread-safe. */
#ifndef DIT_ENCODERS_CLIP_TEXT_H
#define DIT_ENCODERS_CLIP_TEXT_H

#include <stdint.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "core/status.h"
#include "core/tensor.h"

typedef struct dit_clip_text dit_clip_text;

/* Reads <dir>/config.json and the weights. Errors name the file and, for
 * checkpoint problems, the tensor (missing, unexpected or mis-shaped). */
dit_status dit_clip_text_load(dit_backend *be, const char *dir, dit_clip_text **out,
                              dit_diag *diag);

/* NULL-safe. */
void dit_clip_text_free(dit_clip_text *m);

int dit_clip_text_hidden_size(const dit_clip_text *m);

/* Largest sequence length (config max_position_embeddings). */
int dit_clip_text_max_length(const dit_clip_text *m);

/* ids: host (B, S) token ids, 1 <= S <= max length, each in [0, vocab_size).
 * pooled: backend (B, hidden) f32, receives pooler_output.
 * hidden: backend (B, S, hidden) f32 receiving last_hidden_state, or NULL.
 * Scratch comes from `arena` and is released before returning; the outputs
 * may themselves live in the arena (allocated before the call). */
dit_status dit_clip_text_forward(dit_clip_text *m, dit_arena *arena, const int32_t *ids, int64_t B,
                                 int64_t S, const dit_tensor *pooled, const dit_tensor *hidden,
                                 dit_diag *diag);

/* The row of each sequence that pooler_output takes, by the rule above
 * (exposed for tests and for callers that want the index). ids (B, S) host;
 * writes B positions. */
void dit_clip_text_eos_positions(const dit_clip_text *m, const int32_t *ids, int64_t B, int64_t S,
                                 int64_t *pos);

#endif
