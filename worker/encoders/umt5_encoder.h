/* transformers' UMT5EncoderModel (WanPipeline's `text_encoder`, google's
 * umt5-xxl) on the backend interface, matching transformers in f32, and
 * WanPipeline's whole prompt -> prompt_embeds path.
 *
 * Forward, as transformers computes it (T5's, see t5_encoder.h, except):
 *   - every layer has its own relative_attention_bias (num_buckets, H);
 *     bias_l[h, i, j] = table_l[bucket(j - i), h], bidirectional buckets
 *   - an attention mask: key j of batch entry b is hidden when j >=
 *     lengths[b] (attention_mask[b, j] = 0; the tokenizer pads on the right
 *     so the mask is a prefix of ones). transformers adds finfo.min to
 *     those scores, which makes their softmax weight exactly 0; leaving the
 *     keys out gives the same sums. Query rows past the length are still
 *     computed (they attend to the unmasked keys), as transformers does.
 * Config keys and activations as T5Config's (model_type "umt5").
 *
 * The folder is transformers' `save_pretrained` output: config.json and
 * model.safetensors (or model.safetensors.index.json with shards); the tied
 * input embedding as shared.weight, encoder.embed_tokens.weight or both.
 * Loading is strict: any other tensor is an error (decoder tensors too).
 *
 * Owner: the thread that owns the backend; not thread-safe. */
#ifndef DIT_ENCODERS_UMT5_ENCODER_H
#define DIT_ENCODERS_UMT5_ENCODER_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "core/status.h"
#include "core/tensor.h"
#include "encoders/t5_tokenizer.h"

typedef struct dit_umt5_encoder dit_umt5_encoder;

/* Reads <dir>/config.json and the weights. Errors name the file and, for
 * checkpoint problems, the tensor (missing, unexpected or mis-shaped). */
dit_status dit_umt5_encoder_load(dit_backend *be, const char *dir, dit_umt5_encoder **out,
                                 dit_diag *diag);

/* NULL-safe. */
void dit_umt5_encoder_free(dit_umt5_encoder *m);

int dit_umt5_encoder_d_model(const dit_umt5_encoder *m);

/* ids: host (B, S) token ids in [0, vocab_size). lengths: host (B), each in
 * [1, S] (attention_mask[b] = 1 for the first lengths[b] tokens, 0 after),
 * or NULL for no mask. out: backend (B, S, d_model) f32 receiving
 * last_hidden_state. Scratch comes from `arena` (including one (H, S, S)
 * bias) and is released before returning; `out` may itself live in the
 * arena (allocated before the call). */
dit_status dit_umt5_encoder_forward(dit_umt5_encoder *m, dit_arena *arena, const int32_t *ids,
                                    const int32_t *lengths, int64_t B, int64_t S,
                                    const dit_tensor *out, dit_diag *diag);

/* WanPipeline._get_t5_prompt_embeds for B prompts (UTF-8), one video each:
 * prompt_clean (prompt_clean.h), tokenize with padding and truncation to
 * L = max_sequence_length (</s> kept), the masked forward, then rows at and
 * after each prompt's token count (</s> included in the count) set to 0.
 * out: backend (B, L, d_model) f32. n_tokens: host (B) receiving each
 * prompt's token count, or NULL. truncated: host (B), or NULL; entry b is
 * set to true when prompt b had more than L tokens (cut as transformers
 * cuts it) and left as it was otherwise.
 *
 * The forward runs over S = the largest token count rather than L: with the
 * mask, rows before a prompt's count depend neither on the padding tokens
 * nor on L (the bias depends on j - i only), and the later rows are zeroed,
 * so the result is the same as transformers' over L, for less work. */
dit_status dit_umt5_prompt_embeds(dit_umt5_encoder *m, const dit_t5_tokenizer *tok,
                                  dit_arena *arena, const char *const *prompts, int64_t B,
                                  int max_sequence_length, const dit_tensor *out, int32_t *n_tokens,
                                  bool *truncated, dit_diag *diag);

#endif
