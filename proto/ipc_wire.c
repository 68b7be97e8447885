#include "ipc_wire.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The least room a read is offered. */
#define READ_MIN ((size_t)64 << 10)
/* An empty buffer larger than this is given back. */
#define KEEP_MAX ((size_t)16 << 20)

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

/* Grows the buffer to hold at least `need` bytes. */
static int reserve(dit_ipc_reader *r, size_t need)
{
    if (need <= r->cap)
        return 0;
    size_t cap = r->cap ? r->cap : 4096;
    while (cap < need)
        cap *= 2;
    uint8_t *nb = realloc(r->buf, cap);
    if (!nb)
        return -1;
    r->buf = nb;
    r->cap = cap;
    return 0;
}

int dit_ipc_reader_feed(dit_ipc_reader *r, const void *data, size_t n)
{
    if (reserve(r, r->len + n) != 0)
        return -1;
    memcpy(r->buf + r->len, data, n);
    r->len += n;
    return 0;
}

/* The length of the frame at the start of the buffer, prefix included, or
 * 0 while the prefix is incomplete. */
static size_t frame_len(const dit_ipc_reader *r)
{
    if (r->len < 4)
        return 0;
    return 4 + ((size_t)r->buf[0] | (size_t)r->buf[1] << 8 | (size_t)r->buf[2] << 16 |
                (size_t)r->buf[3] << 24);
}

int dit_ipc_reader_room(dit_ipc_reader *r, size_t min, size_t max, uint8_t **room, size_t *n)
{
    size_t want = min;
    const size_t frame = frame_len(r);
    if (frame > r->len && frame - r->len > want && frame <= DIT_IPC_MAX_FRAME + 4)
        want = frame - r->len < max ? frame - r->len : max;
    if (want < min)
        want = min;
    /* A buffer grown for an earlier large frame keeps serving as room. */
    if (reserve(r, r->len + want) != 0)
        return -1;
    *room = r->buf + r->len;
    *n = r->cap - r->len;
    return 0;
}

void dit_ipc_reader_commit(dit_ipc_reader *r, size_t n)
{
    r->len += n;
}

int dit_ipc_reader_next(dit_ipc_reader *r, Ditserve__Ipc__Envelope **out)
{
    const size_t frame = frame_len(r);
    if (frame == 0)
        return 0;
    const size_t n = frame - 4;
    if (n > DIT_IPC_MAX_FRAME)
        return -1;
    if (r->len < n + 4)
        return 0;
    Ditserve__Ipc__Envelope *env = ditserve__ipc__envelope__unpack(NULL, n, r->buf + 4);
    if (!env)
        return -1;
    memmove(r->buf, r->buf + 4 + n, r->len - 4 - n);
    r->len -= 4 + n;
    if (r->len == 0 && r->cap > KEEP_MAX) { /* do not hold a video's worth for good */
        free(r->buf);
        r->buf = NULL;
        r->cap = 0;
    }
    *out = env;
    return 1;
}

int dit_ipc_write_fd(int fd, const Ditserve__Ipc__Envelope *env)
{
    uint8_t *frame;
    size_t len;
    if (dit_ipc_encode(env, &frame, &len) != 0)
        return -2;
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
        uint8_t *room;
        size_t cap;
        if (dit_ipc_reader_room(r, READ_MIN, DIT_IPC_MAX_FRAME, &room, &cap) != 0)
            return -1;
        ssize_t n = read(fd, room, cap);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        dit_ipc_reader_commit(r, (size_t)n);
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
        uint8_t *room;
        size_t cap;
        if (dit_ipc_reader_room(r, READ_MIN, DIT_IPC_MAX_FRAME, &room, &cap) != 0)
            return -1;
        ssize_t n = read(fd, room, cap);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n <= 0)
            return -1;
        dit_ipc_reader_commit(r, (size_t)n);
    }
}
