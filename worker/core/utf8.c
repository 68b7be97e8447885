#include "core/utf8.h"

size_t dit_utf8_len(const char *p, size_t n)
{
    if (n == 0)
        return 0;
    const unsigned char *u = (const unsigned char *)p;
    unsigned c = u[0], min;
    size_t len;
    if (c < 0x80)
        return 1;
    if ((c & 0xe0) == 0xc0) {
        len = 2, min = 0x80, c &= 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
        len = 3, min = 0x800, c &= 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
        len = 4, min = 0x10000, c &= 0x07;
    } else {
        return 0; /* a continuation byte, or 0xf8..0xff */
    }
    if (len > n)
        return 0;
    for (size_t k = 1; k < len; k++) {
        if ((u[k] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (u[k] & 0x3f);
    }
    return c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff) ? 0 : len;
}

bool dit_utf8_valid(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        const size_t l = dit_utf8_len(s + i, n - i);
        if (!l)
            return false;
        i += l;
    }
    return true;
}
