/* Output files of ditctl generate. */
#include "ditctl_output.h"

#include "core/cli_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Writes parts in order to a temporary file beside path, then renames it. */
static int write_parts(const char *path, const uint8_t *const *parts, const size_t *sizes,
                       int nparts, char *err, size_t errcap)
{
    size_t n = strlen(path);
    char *tmp = malloc(n + sizeof ".XXXXXX");
    if (!tmp) {
        snprintf(err, errcap, "out of memory writing %s", path);
        return -1;
    }
    memcpy(tmp, path, n);
    memcpy(tmp + n, ".XXXXXX", sizeof ".XXXXXX");
    int fd = mkstemp(tmp);
    if (fd < 0) {
        snprintf(err, errcap, "cannot write %s: %s", path, strerror(errno));
        free(tmp);
        return -1;
    }
    for (int i = 0; i < nparts; i++) {
        const uint8_t *p = parts[i];
        size_t left = sizes[i];
        while (left > 0) {
            ssize_t w = write(fd, p, left);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                snprintf(err, errcap, "cannot write %s: %s", path,
                         w < 0 ? strerror(errno) : "short write");
                goto fail;
            }
            p += w;
            left -= (size_t)w;
        }
    }
    /* mkstemp creates 0600; an image is no secret, so use the usual mode. */
    mode_t mask = umask(0);
    umask(mask);
    if (fchmod(fd, 0666 & ~mask) != 0 || close(fd) != 0) {
        fd = -1;
        snprintf(err, errcap, "cannot write %s: %s", path, strerror(errno));
        goto fail;
    }
    fd = -1;
    if (rename(tmp, path) != 0) {
        snprintf(err, errcap, "cannot write %s: %s", path, strerror(errno));
        goto fail;
    }
    free(tmp);
    return 0;
fail:
    if (fd >= 0)
        close(fd);
    unlink(tmp);
    free(tmp);
    return -1;
}

int ctl_check_output(const char *path, char *err, size_t errcap)
{
    return dit_check_output_path(path, err, errcap);
}

int ctl_write_file(const char *path, const uint8_t *data, size_t size, char *err, size_t errcap)
{
    const uint8_t *parts[] = {data};
    return write_parts(path, parts, &size, 1, err, errcap);
}

/* Appends s to a JSON string body with the escapes JSON requires. */
static size_t json_escape(char *dst, size_t cap, const char *s)
{
    size_t n = 0;
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        char buf[8];
        const char *piece = buf;
        if (ch == '"' || ch == '\\')
            snprintf(buf, sizeof buf, "\\%c", ch);
        else if (ch < 0x20)
            snprintf(buf, sizeof buf, "\\u%04x", ch);
        else
            buf[0] = (char)ch, buf[1] = '\0';
        size_t k = strlen(piece);
        if (n + k >= cap) /* whole pieces only: the text stays JSON */
            break;
        memcpy(dst + n, piece, k);
        n += k;
    }
    if (cap)
        dst[n] = '\0';
    return n;
}

int ctl_write_raw(const char *path, const Ditserve__V1__Result *res, const char *request_id,
                  const uint8_t *data, size_t size, size_t *written, char *err, size_t errcap)
{
    const char *dtype;
    size_t elem;
    switch (res->dtype) {
    case DITSERVE__V1__DTYPE__DTYPE_UNSPECIFIED: /* the API's raw output is f32 */
    case DITSERVE__V1__DTYPE__DTYPE_F32:
        dtype = "F32", elem = 4;
        break;
    case DITSERVE__V1__DTYPE__DTYPE_BF16:
        dtype = "BF16", elem = 2;
        break;
    case DITSERVE__V1__DTYPE__DTYPE_F16:
        dtype = "F16", elem = 2;
        break;
    default:
        snprintf(err, errcap, "the daemon sent a tensor of unknown dtype %d", (int)res->dtype);
        return -1;
    }
    int64_t dflt[3] = {3, res->height, res->width};
    const int64_t *shape = res->n_shape ? res->shape : dflt;
    size_t ndim = res->n_shape ? res->n_shape : 3;
    if (ndim > 8) {
        snprintf(err, errcap, "the daemon sent a tensor of %zu dimensions", ndim);
        return -1;
    }

    char shape_txt[256] = "";
    size_t off = 0;
    uint64_t numel = 1;
    for (size_t i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            snprintf(err, errcap, "the daemon sent a negative dimension %lld", (long long)shape[i]);
            return -1;
        }
        if (shape[i] && numel > UINT64_MAX / 8 / (uint64_t)shape[i]) {
            snprintf(err, errcap, "%s", "the daemon sent an impossibly large shape");
            return -1;
        }
        numel *= (uint64_t)shape[i];
        off += (size_t)snprintf(shape_txt + off, sizeof shape_txt - off, "%s%lld", i ? "," : "",
                                (long long)shape[i]);
    }
    if (numel * elem != size) {
        snprintf(err, errcap, "the raw tensor holds %zu bytes; shape [%s] of %s needs %llu", size,
                 shape_txt, dtype, (unsigned long long)(numel * elem));
        return -1;
    }

    char rid[512];
    json_escape(rid, sizeof rid, request_id ? request_id : "");
    /* (3, H, W): an image; (3, F, H, W): a video. */
    const char *name = ndim == 4 ? "video" : "image";
    char header[1024];
    int hn = snprintf(header, sizeof header,
                      "{\"%s\":{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[0,%zu]},"
                      "\"__metadata__\":{\"format\":\"pt\",\"seed\":\"%llu\",\"request_id\":"
                      "\"%s\",\"fps\":\"%d\"}}",
                      name, dtype, shape_txt, size, (unsigned long long)res->seed, rid, res->fps);
    if (hn < 0 || (size_t)hn + 8 > sizeof header) {
        snprintf(err, errcap, "%s", "safetensors header too long");
        return -1;
    }
    /* Pad with spaces so that the data starts 8-byte aligned, as the
     * reference writer does. */
    while (hn % 8)
        header[hn++] = ' ';
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++)
        len_le[i] = (uint8_t)((uint64_t)hn >> (8 * i));
    const uint8_t *parts[] = {len_le, (const uint8_t *)header, data};
    size_t sizes[] = {8, (size_t)hn, size};
    if (write_parts(path, parts, sizes, 3, err, errcap) != 0)
        return -1;
    *written = 8 + (size_t)hn + size;
    return 0;
}
