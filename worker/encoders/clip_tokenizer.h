/* CLIP's byte-level BPE tokenizer (FluxPipeline's `tokenizer`), producing
 * the ids of transformers' CLIPTokenizer:
 *
 *   tokenizer(text, padding="max_length", max_length=L, truncation=True).input_ids
 *
 * The behaviour reproduced is that of the installed transformers (5.x), whose
 * CLIPTokenizer is backed by the `tokenizers` library: there is no slow
 * Python tokenizer any more and ftfy is never consulted (the fixtures are
 * made without ftfy installed). transformers 4.x's slow tokenizer differed on
 * CJK (it split every ideograph into its own word) and control characters
 * (it dropped them); see clip_tokenizer.c. Per segment of text between
 * special tokens:
 *   NFC -> every run of Unicode whitespace becomes one " " -> lowercase
 *   -> split by CLIP's regex
 *      <|startoftext|>|<|endoftext|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+
 *      (whitespace between matches is dropped), then by GPT-2's regex
 *   -> bytes mapped to printable characters -> BPE with "</w>" glued to the
 *      last symbol of each word.
 * Then <|startoftext|> + ids + <|endoftext|>, truncated so both special
 * tokens stay, and padded with the pad token.
 *
 * The folder is FluxPipeline's tokenizer/: vocab.json, merges.txt,
 * tokenizer_config.json and (read only when tokenizer_config.json has no
 * "added_tokens_decoder", as transformers does) special_tokens_map.json, as
 * in the FLUX.1 repositories; or tokenizer.json + tokenizer_config.json, as
 * transformers 5's save_pretrained writes it (tokenizer.json wins when both
 * are present, as in transformers).
 *
 * Owner: the caller; a loaded tokenizer is immutable, so encode may run from
 * several threads at once. */
#ifndef DIT_ENCODERS_CLIP_TOKENIZER_H
#define DIT_ENCODERS_CLIP_TOKENIZER_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

typedef struct dit_clip_tokenizer dit_clip_tokenizer;

/* Reads the tokenizer folder `dir`. Errors name the file (and the line of
 * merges.txt). */
dit_status dit_clip_tokenizer_load(const char *dir, dit_clip_tokenizer **out, dit_diag *diag);

/* NULL-safe. */
void dit_clip_tokenizer_free(dit_clip_tokenizer *t);

/* tokenizer_config.json "model_max_length" (77 for CLIP); 77 when the
 * config does not give one. */
int dit_clip_tokenizer_max_length(const dit_clip_tokenizer *t);

/* Special token ids, as transformers resolves them. */
int32_t dit_clip_tokenizer_bos_id(const dit_clip_tokenizer *t);
int32_t dit_clip_tokenizer_eos_id(const dit_clip_tokenizer *t);
int32_t dit_clip_tokenizer_pad_id(const dit_clip_tokenizer *t);

/* Writes exactly `max_length` ids (>= 2) to `ids`: BOS, the text's tokens
 * (the first max_length - 2 of them), EOS, then pad ids. *n_tokens receives
 * the count before padding; *truncated whether tokens were dropped (either
 * may be NULL). `utf8` must be valid UTF-8 (DIT_ERR_INVALID_ARG otherwise). */
dit_status dit_clip_tokenizer_encode(const dit_clip_tokenizer *t, const char *utf8, int32_t *ids,
                                     int max_length, int *n_tokens, bool *truncated,
                                     dit_diag *diag);

#endif
