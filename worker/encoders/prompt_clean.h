/* Prompt text cleaning before tokenizing, as diffusers' WanPipeline does it
 * (pipelines/wan/pipeline_wan.py, prompt_clean):
 *
 *   text = html.unescape(html.unescape(text)).strip()
 *   text = re.sub(r"\s+", " ", text).strip()
 *
 * (diffusers also runs ftfy.fix_text first when ftfy is installed; we treat
 * it as absent, as a default install is.)
 *
 * dit_html_unescape is Python's html.unescape in full: decimal and hex
 * character references with or without ';' (0 and 0x80..0x9f mapped as
 * HTML says, surrogates and values past U+10FFFF to U+FFFD, noncharacters
 * and most controls dropped), every HTML5 named reference (html_entities.h,
 * generated from Python's html.entities.html5), the legacy names without
 * ';' and their longest-prefix rule ("&notit;" -> "\u00acit;"). Whitespace
 * is Python's str.isspace set, which `\s` matches in a str pattern.
 *
 * Owner: stateless; safe from any thread. */
#ifndef DIT_ENCODERS_PROMPT_CLEAN_H
#define DIT_ENCODERS_PROMPT_CLEAN_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

/* html.unescape(utf8), once. *out is malloc'd (the caller frees) and set
 * only on success. DIT_ERR_INVALID_ARG when utf8 is not valid UTF-8. */
dit_status dit_html_unescape(const char *utf8, char **out, dit_diag *diag);

/* WanPipeline's prompt_clean (without ftfy). *out is malloc'd, set only on
 * success. DIT_ERR_INVALID_ARG when utf8 is not valid UTF-8. */
dit_status dit_wan_prompt_clean(const char *utf8, char **out, dit_diag *diag);

/* Python's str.isspace for one code point. */
bool dit_unicode_is_space(uint32_t cp);

#endif
