/* What the tokenizers (clip_tokenizer.c: byte-level BPE; t5_tokenizer.c:
 * SentencePiece unigram) share, as the `tokenizers` library defines it:
 *
 *   - UTF-8: iteration over text already validated, validation that names
 *     the first bad byte, Unicode White_Space;
 *   - a growable NUL-terminated byte buffer;
 *   - a string -> id map (FNV-1a, open addressing) that owns its keys, with
 *     the hash exposed so a caller can hash prefixes incrementally;
 *   - span lists (byte ranges of a text, each an added token or plain text);
 *   - the added-token table and tokenizers' AddedVocabulary::find_matches
 *     (leftmost-longest matching with single_word / lstrip / rstrip, tokens
 *     matched in the raw text or, when `normalized`, in the normalized text);
 *   - the encode order around added tokens (raw tokens, normalizer,
 *     normalized tokens, model) and the post-processor's framing and
 *     padding of the ids;
 *   - small tokenizer.json / tokenizer_config.json readers.
 *
 * What differs between the two tokenizers stays with them and is passed in:
 * the definition of a word character for single_word (CLIP's includes the
 * letters newer Unicode added; T5's is utf8proc's categories alone), the
 * normalizer, the pre-tokenizer and model, and the wording of load errors.
 *
 * Allocation failures are reported as `false` (or DIT_ERR_NOMEM); the
 * caller names the file in its message. Text arguments are byte ranges, not
 * NUL-terminated strings, unless said otherwise.
 *
 * Owner: each structure belongs to its tokenizer (or, for scratch buffers
 * and span lists, to one encode call). A built map and added-token table
 * are only read while encoding, so encode may run from several threads. */
#ifndef DIT_ENCODERS_TOKENIZER_BASE_H
#define DIT_ENCODERS_TOKENIZER_BASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/status.h"

/* ---- UTF-8 and Unicode ------------------------------------------------------------ */

/* Decodes the code point at s[*i] (i < len) and advances *i past it. Meant
 * for validated text; an invalid sequence yields U+FFFD and advances by one
 * byte. */
int32_t dit_tok_utf8_next(const char *s, size_t len, size_t *i);

/* The start of the code point that ends just before s[i] (i > 0, i a
 * boundary of valid UTF-8). */
size_t dit_tok_utf8_back(const char *s, size_t i);

/* The code point that ends just before s[i] (i > 0, a boundary). */
int32_t dit_tok_utf8_prev(const char *s, size_t i);

/* Whether s[0..len) is valid UTF-8 (no surrogates, no overlongs, nothing
 * above U+10FFFF). When not, *bad_at receives the offset of the first byte
 * of the first invalid sequence. */
bool dit_tok_utf8_valid(const char *s, size_t len, size_t *bad_at);

/* Unicode White_Space: Oniguruma's \s, Rust's char::is_whitespace. */
bool dit_tok_is_ws(int32_t c);

/* ---- growable byte buffer ----------------------------------------------------------- */

/* p[0..n) is the content, followed by a NUL once anything was reserved;
 * zero-initialise to start empty; free(p) to release. */
typedef struct dit_tok_buf {
    char *p;
    size_t n, cap;
} dit_tok_buf;

/* Room for `extra` more bytes and the NUL. */
bool dit_tok_buf_reserve(dit_tok_buf *b, size_t extra);

/* Appends s[0..n) (n may be 0, s then may be NULL). */
bool dit_tok_buf_put(dit_tok_buf *b, const void *s, size_t n);

/* Appends the UTF-8 encoding of a valid code point. */
bool dit_tok_buf_put_cp(dit_tok_buf *b, int32_t cp);

/* ---- string -> id map --------------------------------------------------------------- */

/* FNV-1a over bytes, with a final mix of the high bits into the low ones
 * (the map indexes by the low bits). hash_bytes(s, n) equals
 * hash_final(step(...step(DIT_TOK_HASH_INIT, s[0])..., s[n-1])). */
#define DIT_TOK_HASH_INIT 0xcbf29ce484222325ull

static inline uint64_t dit_tok_hash_step(uint64_t h, unsigned char c)
{
    return (h ^ c) * 0x100000001b3ull;
}

static inline uint64_t dit_tok_hash_final(uint64_t h)
{
    return h ^ (h >> 29);
}

uint64_t dit_tok_hash_bytes(const void *p, size_t n);

typedef struct dit_tok_map_slot {
    const char *key; /* NULL: empty; else inside the map's pool */
    size_t len;
    int32_t val;
} dit_tok_map_slot;

/* Keys are copied into one pool sized at init; the table is at least twice
 * the entries announced, so it never fills. */
typedef struct dit_tok_map {
    dit_tok_map_slot *slots;
    size_t cap; /* power of two */
    char *pool;
    size_t pool_used, pool_cap;
} dit_tok_map;

/* Room for `entries` keys whose lengths plus one NUL each total at most
 * `key_bytes`. On failure the map may hold allocations: free it. */
bool dit_tok_map_init(dit_tok_map *m, size_t entries, size_t key_bytes);

/* Inserts key[0..len) (copied, NUL-terminated, into the pool) -> val. A
 * later insertion of a key overwrites the earlier value, as a Rust HashMap
 * built from the same sequence does. The pool must have room (an invariant
 * of the sizes given to init). */
void dit_tok_map_put(dit_tok_map *m, const char *key, size_t len, int32_t val);

bool dit_tok_map_get(const dit_tok_map *m, const char *key, size_t len, int32_t *val);

/* The same with h = dit_tok_hash_bytes(key, len) already computed. */
bool dit_tok_map_get_hashed(const dit_tok_map *m, const char *key, size_t len, uint64_t h,
                            int32_t *val);

/* NULL-safe; leaves the map empty. */
void dit_tok_map_free(dit_tok_map *m);

/* ---- spans ------------------------------------------------------------------------------ */

/* A piece of text: bytes [off, off + len) of some buffer, either an added
 * token (id >= 0) or text still to tokenize (id -1). `first`: the piece
 * starts the original text (Metaspace's "first" prepend scheme). */
typedef struct dit_tok_span {
    size_t off, len;
    int32_t id;
    bool first;
} dit_tok_span;

typedef struct dit_tok_span_list {
    dit_tok_span *v;
    size_t n, cap;
} dit_tok_span_list;

bool dit_tok_span_push(dit_tok_span_list *l, size_t off, size_t len, int32_t id, bool first);

/* ---- output ids --------------------------------------------------------------------------- */

/* The text's ids (no special tokens): stores up to `cap`, then only notes
 * that more came. */
typedef struct dit_tok_ids {
    int32_t *ids;
    int n, cap;
    bool overflow;
} dit_tok_ids;

static inline void dit_tok_ids_push(dit_tok_ids *c, int32_t id)
{
    if (c->n < c->cap)
        c->ids[c->n++] = id;
    else
        c->overflow = true;
}

/* The post-processor and padding: with the text's n_text ids already at
 * ids[n_prefix..), writes prefix before them, suffix after them and pad_id
 * up to max_length (which must hold them all). Returns the count before
 * padding. */
int dit_tok_ids_finish(int32_t *ids, int max_length, const int32_t *prefix, int n_prefix,
                       int n_text, const int32_t *suffix, int n_suffix, int32_t pad_id);

/* ---- added tokens ------------------------------------------------------------------------- */

/* AddedToken's flags. */
typedef struct dit_tok_flags {
    bool lstrip, rstrip, single_word, normalized, special;
} dit_tok_flags;

typedef struct dit_tok_added {
    char *content;
    char *match; /* what is searched for: content, or content normalized */
    size_t match_len;
    int32_t id;
    dit_tok_flags flags;
} dit_tok_added;

/* Rust's regex \w as the tokenizer approximates it (for single_word). */
typedef bool (*dit_tok_word_fn)(int32_t c);

typedef struct dit_tok_added_set {
    dit_tok_added *v;
    int n;
    dit_tok_word_fn is_word;
    /* Whether some token of kind [normalized] has a match starting with a
     * byte: lets the scan skip most positions at once. */
    bool first_byte[2][256];
} dit_tok_added_set;

/* The token with this content (NUL-terminated), or NULL. */
dit_tok_added *dit_tok_added_find(const dit_tok_added_set *set, const char *content);

/* tokenizers' add_tokens for one token: returns (in *out) the token with
 * this content if there is one, else appends it with the vocabulary's id
 * for the content when `vocab` has it, otherwise `id_hint`. The caller sets
 * the flags. DIT_ERR_NOT_FOUND: a new token with neither a vocabulary id nor
 * a hint in [0, 2^31); DIT_ERR_NOMEM. */
dit_status dit_tok_added_add(dit_tok_added_set *set, const dit_tok_map *vocab, const char *content,
                             int64_t id_hint, dit_tok_added **out);

/* Sets token k's match string to match[0..len) (copied). */
bool dit_tok_added_set_match(dit_tok_added_set *set, int k, const char *match, size_t len);

/* tokenizers' AddedVocabulary::find_matches over s[0..len) for the tokens
 * of kind `normalized`: leftmost-longest matches (the scan resumes after a
 * match even when single_word discards it), lstrip / rstrip widening a
 * token over neighbouring whitespace. Appends to `out` the text between
 * matches (id -1; `first` set on a piece at offset 0 when `first`) and the
 * matches, offsets relative to s. Nothing is appended for empty text. */
bool dit_tok_added_split(const dit_tok_added_set *set, bool normalized, const char *s, size_t len,
                         bool first, dit_tok_span_list *out);

/* NULL-safe; leaves the set empty (is_word kept). */
void dit_tok_added_free(dit_tok_added_set *set);

/* ---- the encoding pipeline ----------------------------------------------------------------- */

/* The normalizer: s[0..len) -> *out[0..*out_len), a buffer of the caller's
 * that stays valid until the next call. */
typedef dit_status (*dit_tok_normalize_fn)(void *ctx, const char *s, size_t len, const char **out,
                                           size_t *out_len);

/* The pre-tokenizer and model over one piece of normalized text; `first`:
 * the piece starts the original text. Appends ids to `out`. */
typedef dit_status (*dit_tok_model_fn)(void *ctx, const char *s, size_t len, bool first,
                                       dit_tok_ids *out);

/* tokenizers' encode of one text around its added tokens: the
 * non-normalized tokens are cut out of the raw text; each piece between them
 * is normalized; the normalized tokens are cut out of that; each remaining
 * piece goes to `model`. Stops once `out` overflows. `outer` and `inner`
 * are scratch lists (reused across calls; free their v). DIT_ERR_NOMEM or
 * the callbacks' status. */
dit_status dit_tok_encode_text(const dit_tok_added_set *set, const char *s, size_t len,
                               dit_tok_normalize_fn normalize, dit_tok_model_fn model, void *ctx,
                               dit_tok_span_list *outer, dit_tok_span_list *inner,
                               dit_tok_ids *out);

/* ---- configuration files -------------------------------------------------------------- */

/* dir + "/" + name, malloc'ed; NULL when out of memory. */
char *dit_tok_path_join(const char *dir, const char *name);

/* Loads a JSON object file that may be absent: DIT_OK with *out NULL when
 * there is no such file; other errors as dit_json_load_file reports them. */
dit_status dit_tok_json_load_optional(const char *path, cJSON **out, dit_diag *diag);

/* A token id in JSON: an integer-valued number in [0, 2^31). */
bool dit_tok_json_id(const cJSON *v, int64_t *id);

/* A token id written as a JSON object key (added_tokens_decoder): the
 * whole key read by strtoll as a decimal number in [0, 2^31). */
bool dit_tok_key_id(const char *s, int64_t *id);

/* A boolean member of an added-token object: absent or null -> def.
 * false when present and not a boolean. */
bool dit_tok_json_flag(const cJSON *obj, const char *key, bool def, bool *out);

/* tokenizer_config.json "model_max_length": absent or null -> def; an
 * integer in [min_len, 2^20] -> that; a larger or fractional number ->
 * def (transformers writes 1e30 for "no limit"); a non-number or a value
 * under min_len -> DIT_ERR_FORMAT naming `path`. */
dit_status dit_tok_config_max_length(const cJSON *cfg, const char *path, int min_len, int def,
                                     int *out, dit_diag *diag);

#endif
