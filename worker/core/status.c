#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const status_text[] = {
#define DIT_X_TEXT(name, text) text,
    DIT_STATUS_LIST(DIT_X_TEXT)
#undef DIT_X_TEXT
};

static const char *const status_names[] = {
#define DIT_X_NAME(name, text) #name,
    DIT_STATUS_LIST(DIT_X_NAME)
#undef DIT_X_NAME
};

const char *dit_status_str(dit_status st)
{
    if ((unsigned)st >= DIT_STATUS_COUNT)
        return "unknown status";
    return status_text[st];
}

const char *dit_status_name(dit_status st)
{
    if ((unsigned)st >= DIT_STATUS_COUNT)
        return "DIT_ERR_UNKNOWN";
    return status_names[st];
}

void dit_diag_clear(dit_diag *d)
{
    if (!d)
        return;
    d->status = DIT_OK;
    d->msg[0] = '\0';
}

dit_status dit_diag_set(dit_diag *d, dit_status st, const char *fmt, ...)
{
    if (!d || st == DIT_OK)
        return st;
    /* Keep the innermost explanation: it names the actual cause. */
    if (d->status != DIT_OK && d->msg[0] != '\0')
        return st;
    d->status = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->msg, sizeof d->msg, fmt, ap);
    va_end(ap);
    return st;
}

void dit_diag_prefix(dit_diag *d, const char *fmt, ...)
{
    if (!d)
        return;
    char prefix[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    if (n <= 0)
        return;
    size_t plen = strlen(prefix);
    size_t mlen = strlen(d->msg);
    if (plen + mlen + 1 > sizeof d->msg)
        mlen = sizeof d->msg - plen - 1;
    memmove(d->msg + plen, d->msg, mlen);
    memcpy(d->msg, prefix, plen);
    d->msg[plen + mlen] = '\0';
}

const char *dit_diag_msg(const dit_diag *d)
{
    if (!d)
        return "";
    if (d->msg[0] != '\0')
        return d->msg;
    return dit_status_str(d->status);
}
