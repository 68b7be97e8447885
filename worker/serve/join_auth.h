/* The shared-secret handshake of workers joining a daemon over TCP
 * (`ditworker --join`), used by both sides.
 *
 * The daemon sends a fresh 32-byte nonce; the worker answers with its own
 * nonce and HMAC-SHA256(secret, "worker" 0 daemon_nonce worker_nonce); the
 * daemon checks it and answers HMAC-SHA256(secret, "daemon" 0 worker_nonce
 * daemon_nonce), so each side knows the other held the secret when the
 * connection was made, and an answer from one handshake is worth nothing in
 * another. The secret never crosses the wire. Nothing after the handshake
 * is encrypted or authenticated: a peer that can redirect a worker's
 * connection can relay a live handshake and then own the stream, and NCCL's
 * traffic is unauthenticated too, so the mesh belongs on a private network
 * (a cluster network, a VPN or WireGuard tunnel).
 *
 * A peer trusts nothing the other sends before its proof: a worker takes a
 * refusal as final only when the daemon sent it after its JoinAccept (the
 * daemon proves itself to a worker that proved the secret before it
 * refuses one, daemon/join.h); before that anyone on the path could have
 * sent it.
 *
 * Owner: the caller; no state of its own. */
#ifndef DIT_SERVE_JOIN_AUTH_H
#define DIT_SERVE_JOIN_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#define DIT_JOIN_PROTOCOL 1
#define DIT_JOIN_NONCE_BYTES 32
#define DIT_JOIN_MAC_BYTES 32
#define DIT_JOIN_SECRET_MIN 16
#define DIT_JOIN_SECRET_MAX 4096
/* Either side reads at most this much in one frame from a peer that has not
 * proved the secret (the handshake's messages take a few hundred bytes):
 * a length prefix from anyone must not make it reserve more. */
#define DIT_JOIN_PREAUTH_BYTES 4096
/* A worker's handshake, from connected to the daemon's proof, in seconds
 * at most: a peer that answers byte by byte cannot hold it longer. */
#define DIT_JOIN_HANDSHAKE_S 10

typedef struct dit_join_secret {
    unsigned char bytes[DIT_JOIN_SECRET_MAX];
    size_t len;
} dit_join_secret;

/* A join connection's TCP timing, the same on both ends: keepalive probes
 * after 15 s idle, 9 s apart, and a user timeout (TCP_USER_TIMEOUT) of
 * 60 s, so that a peer that vanished without closing is noticed within
 * about a minute. Keepalive alone probes only an idle connection: with data
 * in flight a write to a vanished peer would wait out the kernel's
 * retransmissions (about 15 minutes). The kernel applies the user timeout
 * to a closed receive window too (a peer that reads nothing for a minute
 * while more waits to go than its buffers hold); neither side leaves the
 * other so: the daemon reads at all times, and sends a worker in a job no
 * more than small cancels. */
#define DIT_JOIN_KEEPIDLE_S 15
#define DIT_JOIN_KEEPINTVL_S 9
#define DIT_JOIN_KEEPCNT 5
#define DIT_JOIN_USER_TIMEOUT_MS 60000

/* Sets the TCP options of a join connection (either end): no Nagle delay,
 * and the keepalive and user timeout above. 0, or -1 with errno when one
 * cannot be set (the others are set still). */
int dit_join_socket_options(int fd);

/* Reads the secret from a file (trailing newlines and spaces dropped). It
 * must hold at least DIT_JOIN_SECRET_MIN bytes. */
dit_status dit_join_secret_read(const char *path, dit_join_secret *out, dit_diag *diag);

/* Overwrites the secret in memory. */
void dit_join_secret_wipe(dit_join_secret *s);

/* DIT_JOIN_NONCE_BYTES from the system's CSPRNG. */
dit_status dit_join_nonce(unsigned char out[DIT_JOIN_NONCE_BYTES], dit_diag *diag);

/* HMAC-SHA256(secret, role 0 first second). */
dit_status dit_join_mac(const dit_join_secret *s, const char *role, const uint8_t *first,
                        size_t first_len, const uint8_t *second, size_t second_len,
                        unsigned char out[DIT_JOIN_MAC_BYTES], dit_diag *diag);

/* Constant-time check of a received MAC against the expected one. */
bool dit_join_mac_equal(const uint8_t *got, size_t got_len,
                        const unsigned char want[DIT_JOIN_MAC_BYTES]);

/* "hostname/boot-id": equal on two processes that share a kernel and a
 * host name (and so, in practice, /dev/shm). */
void dit_join_host_id(char *buf, size_t n);

/* Copies a string a peer sent (a refusal's reason) into out (cap bytes,
 * NUL-terminated) so that printing it cannot drive a terminal or start a
 * line of its own: bytes outside printable ASCII, and backslashes, become
 * \xNN. What does not fit ends in "...". */
void dit_join_escape(const char *in, char *out, size_t cap);

/* Splits "HOST:PORT" ("[v6]:PORT" too); PORT 0..65535. */
dit_status dit_join_split_address(const char *addr, char *host, size_t host_n, int *port,
                                  dit_diag *diag);

#endif
