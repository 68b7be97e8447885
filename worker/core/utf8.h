/* UTF-8 well-formedness, strict as RFC 3629 has it: no overlong forms, no
 * surrogates (U+D800..U+DFFF), nothing past U+10FFFF, no sequence cut short
 * by the end of the buffer, no lone continuation bytes, no 0xF8..0xFF lead
 * bytes. The one check behind every place that takes strings from clients:
 * the HTTP front end (daemon/http.c, request bodies), the daemon's log
 * escaping (daemon/log.c) and the request reader (serve/request.c).
 *
 * It sits in core, the lowest layer, because that is the one library all of
 * those already link (serve sits on it, and ditd links serve); it needs
 * nothing but the C library. ditctl does not check UTF-8 and does not link it.
 *
 * NUL is well-formed UTF-8 (U+0000) and counts as a one-byte sequence here;
 * callers that hand the text on as a C string refuse NUL themselves.
 *
 * Owner: none; pure functions over the caller's bytes. */
#ifndef DIT_CORE_UTF8_H
#define DIT_CORE_UTF8_H

#include <stdbool.h>
#include <stddef.h>

/* Length in bytes (1 to 4) of the well-formed UTF-8 sequence that starts at
 * p, of which n bytes may be read; 0 when the bytes there are not one (or
 * n is 0). */
size_t dit_utf8_len(const char *p, size_t n);

/* Whether the n bytes at s are well-formed UTF-8 throughout (n = 0: yes). */
bool dit_utf8_valid(const char *s, size_t n);

#endif
