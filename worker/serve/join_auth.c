#include "serve/join_auth.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

int dit_join_socket_options(int fd)
{
    const int one = 1, idle = DIT_JOIN_KEEPIDLE_S, intvl = DIT_JOIN_KEEPINTVL_S,
              cnt = DIT_JOIN_KEEPCNT;
    const unsigned user_timeout = DIT_JOIN_USER_TIMEOUT_MS;
    int rc = 0, err = 0;
    const struct {
        int level, name;
        const void *val;
        socklen_t len;
    } opts[] = {
        {IPPROTO_TCP, TCP_NODELAY, &one, sizeof one},
        {SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one},
        {IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle},
        {IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl},
        {IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt},
        {IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout},
    };
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++)
        if (setsockopt(fd, opts[i].level, opts[i].name, opts[i].val, opts[i].len) != 0 && !rc) {
            rc = -1;
            err = errno;
        }
    if (rc)
        errno = err;
    return rc;
}

dit_status dit_join_secret_read(const char *path, dit_join_secret *out, dit_diag *diag)
{
    memset(out, 0, sizeof *out);
    /* read(2) straight into `out`: no stdio buffer keeps a copy. */
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return dit_diag_set(diag, DIT_ERR_IO, "cannot read the join secret %s: %s", path,
                            strerror(errno));
    size_t n = 0;
    unsigned char extra;
    bool more = false;
    for (;;) {
        ssize_t got = n < sizeof out->bytes ? read(fd, out->bytes + n, sizeof out->bytes - n)
                                            : read(fd, &extra, 1);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            const int e = errno;
            close(fd);
            dit_join_secret_wipe(out);
            return dit_diag_set(diag, DIT_ERR_IO, "cannot read the join secret %s: %s", path,
                                strerror(e));
        }
        if (got == 0)
            break;
        if (n == sizeof out->bytes) {
            more = true;
            break;
        }
        n += (size_t)got;
    }
    close(fd);
    if (more) {
        dit_join_secret_wipe(out);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "the join secret %s is longer than %d bytes",
                            path, DIT_JOIN_SECRET_MAX);
    }
    while (n > 0 && (out->bytes[n - 1] == '\n' || out->bytes[n - 1] == '\r' ||
                     out->bytes[n - 1] == ' ' || out->bytes[n - 1] == '\t'))
        out->bytes[--n] = 0;
    out->len = n;
    if (n < DIT_JOIN_SECRET_MIN) {
        dit_join_secret_wipe(out);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "the join secret %s has %zu bytes; use at least %d (e.g. `openssl "
                            "rand -hex 32 > FILE`)",
                            path, n, DIT_JOIN_SECRET_MIN);
    }
    return DIT_OK;
}

void dit_join_secret_wipe(dit_join_secret *s)
{
    OPENSSL_cleanse(s, sizeof *s);
}

dit_status dit_join_nonce(unsigned char out[DIT_JOIN_NONCE_BYTES], dit_diag *diag)
{
    if (RAND_bytes(out, DIT_JOIN_NONCE_BYTES) != 1)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "the random number generator failed");
    return DIT_OK;
}

dit_status dit_join_mac(const dit_join_secret *s, const char *role, const uint8_t *first,
                        size_t first_len, const uint8_t *second, size_t second_len,
                        unsigned char out[DIT_JOIN_MAC_BYTES], dit_diag *diag)
{
    const size_t rl = strlen(role) + 1; /* with its terminating 0 */
    unsigned char msg[64 + 2 * 256];
    if (rl > 64 || first_len > 256 || second_len > 256)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "join handshake field too long");
    memcpy(msg, role, rl);
    memcpy(msg + rl, first, first_len);
    memcpy(msg + rl + first_len, second, second_len);
    size_t out_len = 0;
    unsigned char *r = EVP_Q_mac(NULL, "HMAC", NULL, "SHA256", NULL, s->bytes, s->len, msg,
                                 rl + first_len + second_len, out, DIT_JOIN_MAC_BYTES, &out_len);
    OPENSSL_cleanse(msg, sizeof msg);
    if (!r || out_len != DIT_JOIN_MAC_BYTES)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "HMAC-SHA256 failed");
    return DIT_OK;
}

bool dit_join_mac_equal(const uint8_t *got, size_t got_len,
                        const unsigned char want[DIT_JOIN_MAC_BYTES])
{
    return got && got_len == DIT_JOIN_MAC_BYTES &&
           CRYPTO_memcmp(got, want, DIT_JOIN_MAC_BYTES) == 0;
}

void dit_join_host_id(char *buf, size_t n)
{
    char host[256] = "unknown";
    char boot[64] = "";
    if (gethostname(host, sizeof host - 1) != 0)
        snprintf(host, sizeof host, "unknown");
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f))
            boot[0] = '\0';
        fclose(f);
        boot[strcspn(boot, "\n")] = '\0';
    }
    snprintf(buf, n, "%s/%s", host, boot);
}

void dit_join_escape(const char *in, char *out, size_t cap)
{
    if (cap == 0)
        return;
    const size_t room = cap >= 4 ? cap - 4 : 0; /* for "..." and the NUL */
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)(in ? in : ""); *p; p++) {
        char tmp[8];
        const int t = *p >= 0x20 && *p < 0x7f && *p != '\\'
                          ? snprintf(tmp, sizeof tmp, "%c", *p)
                          : snprintf(tmp, sizeof tmp, "\\x%02x", *p);
        if (o + (size_t)t > room) {
            if (cap >= 4) {
                memcpy(out + o, "...", 3);
                o += 3;
            }
            break;
        }
        memcpy(out + o, tmp, (size_t)t);
        o += (size_t)t;
    }
    out[o] = '\0';
}

dit_status dit_join_split_address(const char *addr, char *host, size_t host_n, int *port,
                                  dit_diag *diag)
{
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "'%s' is not HOST:PORT", addr);
    const char *h = addr;
    size_t hl = (size_t)(colon - addr);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    char *end;
    errno = 0;
    long p = strtol(colon + 1, &end, 10);
    if (errno || colon[1] == '\0' || *end != '\0' || p < 0 || p > 65535)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "'%s' has no valid port (0 to 65535)", addr);
    if (hl == 0 || hl >= host_n)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "'%s' has no valid host", addr);
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (int)p;
    return DIT_OK;
}
