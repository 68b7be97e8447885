#include "ipc_wire.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
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

/* Writes the iovecs whole, through partial writes; 0, or -1. */
static int write_all(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t w = writev(fd, iov, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        size_t done = (size_t)w;
        while (n > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return 0;
}

static size_t put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

static size_t varint_size(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

size_t dit_pb_field_head(uint8_t *out, uint32_t field, uint64_t len)
{
    const size_t n = put_varint(out, (uint64_t)field << 3 | 2);
    return n + put_varint(out + n, len);
}

size_t dit_pb_field_head_size(uint32_t field, uint64_t len)
{
    return varint_size((uint64_t)field << 3 | 2) + varint_size(len);
}

/* The frame of a JobDone whose own image is large goes out in two parts:
 * everything but the image, packed, then the image's bytes where they lie,
 * never copied into a frame buffer. A protobuf field may follow the others,
 * so the image is written as JobDone's last field (Envelope.done = 7,
 * JobDone.image = 5, both length-delimited: wire type 2); any protobuf
 * reader sees the same message. -2 when it does not fit a frame or there
 * is no memory for its head (nothing written), -1 when the write fails. */
static int write_done_split(int fd, const Ditserve__Ipc__JobDone *done)
{
    Ditserve__Ipc__JobDone rest = *done;
    rest.image.data = NULL;
    rest.image.len = 0;
    const size_t img = done->image.len;
    const size_t rest_len = ditserve__ipc__job_done__get_packed_size(&rest);
    if (img > DIT_IPC_MAX_FRAME || rest_len > DIT_IPC_MAX_FRAME)
        return -2;
    const size_t body = rest_len + dit_pb_field_head_size(5, img) + img;
    const size_t frame = dit_pb_field_head_size(7, body) + body;
    if (frame > DIT_IPC_MAX_FRAME)
        return -2;
    uint8_t *head = malloc(4 + DIT_PB_FIELD_HEAD_MAX + rest_len + DIT_PB_FIELD_HEAD_MAX);
    if (!head)
        return -2;
    size_t h = 0;
    head[h++] = (uint8_t)(frame & 0xff);
    head[h++] = (uint8_t)((frame >> 8) & 0xff);
    head[h++] = (uint8_t)((frame >> 16) & 0xff);
    head[h++] = (uint8_t)((frame >> 24) & 0xff);
    h += dit_pb_field_head(head + h, 7, body);
    h += ditserve__ipc__job_done__pack(&rest, head + h);
    h += dit_pb_field_head(head + h, 5, img);
    struct iovec iov[2] = {{head, h}, {done->image.data, img}};
    const int rc = write_all(fd, iov, 2);
    free(head);
    return rc;
}

int dit_ipc_write_fd(int fd, const Ditserve__Ipc__Envelope *env)
{
    if (env->msg_case == DITSERVE__IPC__ENVELOPE__MSG_DONE && env->done &&
        env->done->image.len >= DIT_IPC_SPLIT_MIN)
        return write_done_split(fd, env->done);
    uint8_t *frame;
    size_t len;
    if (dit_ipc_encode(env, &frame, &len) != 0)
        return -2;
    struct iovec iov = {frame, len};
    const int rc = write_all(fd, &iov, 1);
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
