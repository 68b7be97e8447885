#include "ipc_wire.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int dit_ipc_encode(const Ditserve__Ipc__Envelope *env, uint8_t **frame, size_t *len)
{
    size_t n = ditserve__ipc__envelope__get_packed_size(env);
    if (n > DIT_IPC_MAX_FRAME)
        return -1;
    uint8_t *buf = malloc(n + 4);
    if (!buf)
        return -1;
    buf[0] = (uint8_t)(n & 0xff);
    buf[1] = (uint8_t)((n >> 8) & 0xff);
    buf[2] = (uint8_t)((n >> 16) & 0xff);
    buf[3] = (uint8_t)((n >> 24) & 0xff);
    ditserve__ipc__envelope__pack(env, buf + 4);
    *frame = buf;
    *len = n + 4;
    return 0;
}

void dit_ipc_reader_init(dit_ipc_reader *r)
{
    memset(r, 0, sizeof *r);
}

void dit_ipc_reader_free(dit_ipc_reader *r)
{
    free(r->buf);
    memset(r, 0, sizeof *r);
}

int dit_ipc_reader_feed(dit_ipc_reader *r, const void *data, size_t n)
{
    if (r->len + n > r->cap) {
        size_t cap = r->cap ? r->cap : 4096;
        while (cap < r->len + n)
            cap *= 2;
        uint8_t *nb = realloc(r->buf, cap);
        if (!nb)
            return -1;
        r->buf = nb;
        r->cap = cap;
    }
    memcpy(r->buf + r->len, data, n);
    r->len += n;
    return 0;
}

int dit_ipc_reader_next(dit_ipc_reader *r, Ditserve__Ipc__Envelope **out)
{
    if (r->len < 4)
        return 0;
    const size_t n = (size_t)r->buf[0] | (size_t)r->buf[1] << 8 | (size_t)r->buf[2] << 16 |
                     (size_t)r->buf[3] << 24;
    if (n > DIT_IPC_MAX_FRAME)
        return -1;
    if (r->len < n + 4)
        return 0;
    Ditserve__Ipc__Envelope *env = ditserve__ipc__envelope__unpack(NULL, n, r->buf + 4);
    if (!env)
        return -1;
    memmove(r->buf, r->buf + 4 + n, r->len - 4 - n);
    r->len -= 4 + n;
    *out = env;
    return 1;
}

int dit_ipc_write_fd(int fd, const Ditserve__Ipc__Envelope *env)
{
    uint8_t *frame;
    size_t len;
    if (dit_ipc_encode(env, &frame, &len) != 0)
        return -1;
    size_t off = 0;
    int rc = 0;
    while (off < len) {
        ssize_t w = write(fd, frame + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            rc = -1;
            break;
        }
        off += (size_t)w;
    }
    free(frame);
    return rc;
}

int dit_ipc_read_fd(int fd, dit_ipc_reader *r, Ditserve__Ipc__Envelope **out)
{
    for (;;) {
        int got = dit_ipc_reader_next(r, out);
        if (got != 0)
            return got > 0 ? 0 : -1;
        uint8_t buf[65536];
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        if (dit_ipc_reader_feed(r, buf, (size_t)n) != 0)
            return -1;
    }
}

int dit_ipc_poll_fd(int fd, dit_ipc_reader *r, Ditserve__Ipc__Envelope **out)
{
    for (;;) {
        int got = dit_ipc_reader_next(r, out);
        if (got != 0)
            return got;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int pr = poll(&p, 1, 0);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr <= 0)
            return pr < 0 ? -1 : 0;
        uint8_t buf[65536];
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n <= 0)
            return -1;
        if (dit_ipc_reader_feed(r, buf, (size_t)n) != 0)
            return -1;
    }
}
