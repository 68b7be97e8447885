/* The join handshake for workers on other hosts (`ditworker --join`): the
 * challenge-response that proves a TCP peer holds the shared secret, the
 * limits on peers that have not proved it yet, and the pool of joined
 * workers waiting for a remote rank.
 *
 * The transport is not this module's: the supervisor owns the listener and
 * every connection (their libuv handles), embeds a dit_joiner in each TCP
 * connection, feeds it the frames that arrive before the peer has joined,
 * and sends and closes through the dit_joiners_io it gives here. So the
 * handshake is plain state over messages, and the supervisor asks only
 * "has it joined?" and "who plays remote rank r?".
 *
 * Rules: a peer that has not joined may send one frame (a JoinRequest) of
 * at most DIT_JOINERS_PREAUTH_BYTES within DIT_JOINERS_AUTH_S; at most
 * DIT_JOINERS_MAX_PENDING handshakes run at once, a new one closing the
 * oldest. A worker that proved the secret gets the daemon's proof (the
 * JoinAccept) first, even when a refusal follows (a rank the mesh lacks,
 * another host on the cpu backend): a worker trusts only a refusal sent
 * after that proof. A joined worker waits in the pool (in arrival order) until
 * dit_joiners_take gives it a rank; from then on it is the mesh's.
 *
 * Owner: the loop thread (the supervisor's). */
#ifndef DIT_DAEMON_JOIN_H
#define DIT_DAEMON_JOIN_H

#include <stdbool.h>
#include <stdint.h>

#include "ditserve_ipc_ipc.pb-c.h"
#include "log.h"
#include "serve/join_auth.h"

#define DIT_JOINERS_AUTH_S 5.0
#define DIT_JOINERS_PREAUTH_BYTES DIT_JOIN_PREAUTH_BYTES
/* An honest handshake takes one round trip, so closing the oldest past this
 * many lets a real worker in past any number of idle connections; a flood
 * of new ones (this many within a worker's round trip, again and again)
 * still closes real handshakes, and the workers retry. */
#define DIT_JOINERS_MAX_PENDING 32

/* One TCP peer, embedded in the transport owner's connection. The fields
 * are the module's; the owner reads addr and pid (for its log lines). */
typedef struct dit_joiner {
    struct dit_joiner *next;
    bool listed;  /* handshaking or in the pool */
    bool joined;  /* proved the secret */
    uint64_t seq; /* arrival order */
    double since_s;
    int want_rank; /* -1: any */
    unsigned char nonce[DIT_JOIN_NONCE_BYTES];
    char addr[80];  /* "IP:PORT" of the peer */
    char host[320]; /* its host id ("hostname/boot id"), once joined */
    int pid;        /* the worker's, once joined */
} dit_joiner;

typedef struct dit_joiners_io {
    void *ctx;
    /* Sends one frame on p's connection; 0, or -1 when it cannot. */
    int (*send)(void *ctx, dit_joiner *p, const Ditserve__Ipc__Envelope *env);
    /* Closes p's connection, after what was sent has gone out when flush.
     * The owner calls dit_joiners_remove (at once or later). */
    void (*close)(void *ctx, dit_joiner *p, bool flush);
} dit_joiners_io;

typedef struct dit_joiners_config {
    const dit_join_secret *secret; /* kept by the caller for the module's lifetime */
    const char *backend;           /* "cpu": every rank must be on this host */
    int world_size, local_ranks;   /* remote ranks: local_ranks .. world_size-1 */
    const dit_log *log;
} dit_joiners_config;

typedef struct dit_joiners dit_joiners;

dit_status dit_joiners_create(const dit_joiners_config *cfg, const dit_joiners_io *io,
                              dit_joiners **out, dit_diag *diag);
/* NULL-safe. The peers it knows are the owner's to close. */
void dit_joiners_destroy(dit_joiners *j);

/* A new connection from addr at now_s: closes the oldest handshake past
 * the limit, then sends the challenge (or, when closing, refuses). */
void dit_joiners_accept(dit_joiners *j, dit_joiner *p, const char *addr, double now_s,
                        bool closing);

/* A frame from p before it joined (consumed). True when p has just joined
 * the pool: the owner may now hand out remote ranks. On anything else p is
 * refused (told why, closed). */
bool dit_joiners_handle(dit_joiners *j, dit_joiner *p, Ditserve__Ipc__Envelope *env);

/* p proved the secret (it is in the pool, or was taken into the mesh). */
bool dit_joiners_joined(const dit_joiner *p);

/* Tells p why, then closes it. */
void dit_joiners_refuse(dit_joiners *j, dit_joiner *p, bool permanent, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Refuses handshakes that have run past DIT_JOINERS_AUTH_S. */
void dit_joiners_expire(dit_joiners *j, double now_s);

/* Takes a pooled worker for remote rank `rank` out of the pool: with
 * any false, the oldest that asked for that rank; with any true, the
 * oldest that asked for none. NULL when there is none. */
dit_joiner *dit_joiners_take(dit_joiners *j, int rank, bool any);

/* p's connection is gone: forget it (no-op when taken or unknown). */
void dit_joiners_remove(dit_joiners *j, dit_joiner *p);

#endif
