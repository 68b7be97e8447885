/* T5's SentencePiece unigram tokenizer (FluxPipeline's `tokenizer_2`),
 * producing the ids of transformers' T5TokenizerFast:
 *
 *   tokenizer_2(text, padding="max_length", max_length=L, truncation=True).input_ids
 *
 * Reads the `tokenizers` serialization <dir>/tokenizer.json (what
 * T5TokenizerFast loads) and <dir>/tokenizer_config.json (pad token,
 * model_max_length, added tokens); spiece.model is not needed. Per segment
 * of text between added (special) tokens the pipeline of tokenizer.json runs:
 *   normalizer     Precompiled (SentencePiece's compiled rules, e.g.
 *                  nmt_nfkc), Replace, Strip, or a Sequence of them
 *   pre_tokenizer  WhitespaceSplit, Metaspace, or a Sequence of them
 *   model          Unigram: Viterbi segmentation by piece scores; characters
 *                  no piece covers become <unk>, consecutive ones fused
 *   post_processor TemplateProcessing ("$A </s>" for T5)
 * Any other component type is refused at load with an error naming it.
 * Truncation keeps the template's special tokens; padding uses pad_token.
 *
 * Owner: the caller; a loaded tokenizer is immutable, so encode may run from
 * several threads at once. */
#ifndef DIT_ENCODERS_T5_TOKENIZER_H
#define DIT_ENCODERS_T5_TOKENIZER_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

typedef struct dit_t5_tokenizer dit_t5_tokenizer;

/* Reads the tokenizer folder `dir`. Errors name the file and the component. */
dit_status dit_t5_tokenizer_load(const char *dir, dit_t5_tokenizer **out, dit_diag *diag);

/* NULL-safe. */
void dit_t5_tokenizer_free(dit_t5_tokenizer *t);

/* tokenizer_config.json "model_max_length" (512 when absent or unbounded). */
int dit_t5_tokenizer_max_length(const dit_t5_tokenizer *t);

int32_t dit_t5_tokenizer_pad_id(const dit_t5_tokenizer *t);

/* Writes exactly `max_length` ids to `ids`: the text's tokens (as many as
 * fit before the template's special tokens), the special tokens (</s>),
 * then pad ids. max_length must leave room for the special tokens.
 * *n_tokens receives the count before padding; *truncated whether tokens
 * were dropped (either may be NULL). `utf8` must be valid UTF-8
 * (DIT_ERR_INVALID_ARG otherwise). */
dit_status dit_t5_tokenizer_encode(const dit_t5_tokenizer *t, const char *utf8, int32_t *ids,
                                   int max_length, int *n_tokens, bool *truncated, dit_diag *diag);

#endif
