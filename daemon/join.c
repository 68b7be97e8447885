#include "join.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct dit_joiners {
    dit_joiners_config cfg;
    dit_joiners_io io;
    char host_id[320];
    dit_joiner *peers; /* handshaking and pooled */
    uint64_t seq;
    double evict_logged_s; /* when the last eviction was logged (0: never) */
    int64_t evicted;       /* handshakes closed for room since then */
};

/* Whether two "IP:PORT" (or "[IPv6]:PORT") addresses are of one host. */
static bool same_source(const char *a, const char *b)
{
    const char *ca = strrchr(a, ':'), *cb = strrchr(b, ':');
    const size_t na = ca ? (size_t)(ca - a) : strlen(a), nb = cb ? (size_t)(cb - b) : strlen(b);
    return na == nb && memcmp(a, b, na) == 0;
}

dit_status dit_joiners_create(const dit_joiners_config *cfg, const dit_joiners_io *io,
                              dit_joiners **out, dit_diag *diag)
{
    dit_joiners *j = calloc(1, sizeof *j);
    if (!j)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    j->cfg = *cfg;
    j->io = *io;
    dit_join_host_id(j->host_id, sizeof j->host_id);
    *out = j;
    return DIT_OK;
}

void dit_joiners_destroy(dit_joiners *j)
{
    free(j);
}

bool dit_joiners_joined(const dit_joiner *p)
{
    return p->joined;
}

void dit_joiners_remove(dit_joiners *j, dit_joiner *p)
{
    if (!p->listed)
        return;
    dit_joiner **pp = &j->peers;
    while (*pp && *pp != p)
        pp = &(*pp)->next;
    if (*pp)
        *pp = p->next;
    p->next = NULL;
    p->listed = false;
}

void dit_joiners_refuse(dit_joiners *j, dit_joiner *p, bool permanent, const char *fmt, ...)
{
    char reason[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    DIT_LOG(j->cfg.log, permanent ? DIT_LOG_WARN : DIT_LOG_INFO, "join",
            "refused the worker at %s: %s", p->addr, reason);
    Ditserve__Ipc__JoinRefused r = DITSERVE__IPC__JOIN_REFUSED__INIT;
    r.reason = reason;
    r.permanent = permanent;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_REFUSED;
    env.refused = &r;
    j->io.send(j->io.ctx, p, &env);
    dit_joiners_remove(j, p);
    j->io.close(j->io.ctx, p, true);
}

void dit_joiners_accept(dit_joiners *j, dit_joiner *p, const char *addr, double now_s, bool closing)
{
    memset(p, 0, sizeof *p);
    p->want_rank = -1;
    p->since_s = now_s;
    p->seq = ++j->seq;
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    int pending = 0;
    for (dit_joiner *o = j->peers; o; o = o->next)
        pending += !o->joined;
    if (pending >= DIT_JOINERS_MAX_PENDING) {
        /* The oldest handshake of the source with the most of them: one
         * address that floods the port closes its own handshakes, not
         * those of workers elsewhere. */
        dit_joiner *victim = NULL;
        int most = 0;
        for (dit_joiner *o = j->peers; o; o = o->next) {
            if (o->joined)
                continue;
            int n = 0;
            for (dit_joiner *q = j->peers; q; q = q->next)
                n += !q->joined && same_source(q->addr, o->addr);
            if (n > most || (n == most && o->seq < victim->seq)) {
                most = n;
                victim = o;
            }
        }
        /* Logged once a minute at most: a flood must not flood the log. */
        j->evicted++;
        if (now_s - j->evict_logged_s >= 60.0 || j->evict_logged_s == 0) {
            DIT_LOG(j->cfg.log, DIT_LOG_WARN, "join",
                    "%d handshakes in progress; closed the oldest from %s (%d handshakes from "
                    "there) for one from %s; %lld closed for room since the last such line",
                    pending, victim->addr, most, p->addr, (long long)j->evicted);
            j->evict_logged_s = now_s > 0 ? now_s : 1e-9;
            j->evicted = 0;
        }
        dit_joiners_remove(j, victim);
        j->io.close(j->io.ctx, victim, false);
    }
    p->listed = true;
    p->next = j->peers;
    j->peers = p;
    if (closing) {
        dit_joiners_refuse(j, p, false, "the daemon is shutting down");
        return;
    }
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_join_nonce(p->nonce, &diag) != DIT_OK) {
        dit_joiners_refuse(j, p, false, "%s", dit_diag_msg(&diag));
        return;
    }
    Ditserve__Ipc__JoinChallenge ch = DITSERVE__IPC__JOIN_CHALLENGE__INIT;
    ch.protocol = DIT_JOIN_PROTOCOL;
    ch.nonce.data = p->nonce;
    ch.nonce.len = sizeof p->nonce;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_CHALLENGE;
    env.challenge = &ch;
    if (j->io.send(j->io.ctx, p, &env) != 0) {
        dit_joiners_remove(j, p);
        j->io.close(j->io.ctx, p, false);
    }
}

static void drop_earlier_boots(dit_joiners *j, const dit_joiner *p);

bool dit_joiners_handle(dit_joiners *j, dit_joiner *p, Ditserve__Ipc__Envelope *env)
{
    const int N = j->cfg.world_size, L = j->cfg.local_ranks;
    bool joined = false;
    dit_diag diag;
    dit_diag_clear(&diag);
    unsigned char want[DIT_JOIN_MAC_BYTES];
    if (env->msg_case != DITSERVE__IPC__ENVELOPE__MSG_JOIN) {
        dit_joiners_refuse(j, p, true, "expected a join request (message %d)", (int)env->msg_case);
        goto done;
    }
    const Ditserve__Ipc__JoinRequest *r = env->join;
    if (r->protocol != DIT_JOIN_PROTOCOL) {
        dit_joiners_refuse(j, p, true,
                           "join protocol %d; this daemon speaks %d (use matching versions)",
                           r->protocol, DIT_JOIN_PROTOCOL);
        goto done;
    }
    if (r->nonce.len != DIT_JOIN_NONCE_BYTES) {
        dit_joiners_refuse(j, p, true, "malformed join request");
        goto done;
    }
    if (dit_join_mac(j->cfg.secret, "worker", p->nonce, sizeof p->nonce, r->nonce.data,
                     r->nonce.len, want, &diag) != DIT_OK) {
        dit_joiners_refuse(j, p, false, "%s", dit_diag_msg(&diag));
        goto done;
    }
    if (!dit_join_mac_equal(r->mac.data, r->mac.len, want)) {
        dit_joiners_refuse(
            j, p, true, "wrong secret (the worker's secret file differs from --join-secret-file)");
        goto done;
    }
    /* The worker proved the secret: the daemon proves it back before
     * anything else, a refusal included. A worker takes only a refusal that
     * follows this proof as final; one before it could come from anyone on
     * the path (serve/join_auth.h). */
    Ditserve__Ipc__JoinAccept acc = DITSERVE__IPC__JOIN_ACCEPT__INIT;
    if (dit_join_mac(j->cfg.secret, "daemon", r->nonce.data, r->nonce.len, p->nonce,
                     sizeof p->nonce, want, &diag) != DIT_OK) {
        dit_joiners_refuse(j, p, false, "%s", dit_diag_msg(&diag));
        goto done;
    }
    acc.mac.data = want;
    acc.mac.len = sizeof want;
    Ditserve__Ipc__Envelope out = DITSERVE__IPC__ENVELOPE__INIT;
    out.msg_case = DITSERVE__IPC__ENVELOPE__MSG_ACCEPT;
    out.accept = &acc;
    if (j->io.send(j->io.ctx, p, &out) != 0) {
        dit_joiners_remove(j, p);
        j->io.close(j->io.ctx, p, false);
        goto done;
    }
    if (strcmp(j->cfg.backend, "cpu") == 0 && N > 1 && strcmp(r->host_id, j->host_id) != 0) {
        dit_joiners_refuse(j, p, true,
                           "the cpu backend's shared-memory mesh needs every rank on the daemon's "
                           "host (%s), and this worker is on %s; across hosts, use the cuda "
                           "backend (NCCL)",
                           j->host_id, r->host_id);
        goto done;
    }
    if (r->rank != -1 && (r->rank < L || r->rank >= N)) {
        dit_joiners_refuse(j, p, true,
                           "rank %d is not a remote rank of this mesh (remote ranks: %d to %d)",
                           r->rank, L, N - 1);
        goto done;
    }
    p->joined = true;
    p->want_rank = r->rank;
    p->pid = r->pid;
    snprintf(p->host, sizeof p->host, "%s", r->host_id);
    drop_earlier_boots(j, p);
    char asks[48] = "";
    if (r->rank >= 0)
        snprintf(asks, sizeof asks, ", asks for rank %d", r->rank);
    DIT_LOG(j->cfg.log, DIT_LOG_INFO, "join", "worker pid %d at %s joined (host %s%s)", p->pid,
            p->addr, r->host_id, asks);
    joined = true;
done:
    ditserve__ipc__envelope__free_unpacked(env, NULL);
    return joined;
}

/* Pooled workers of p's host from an earlier boot of it are gone (the host
 * restarted within the keepalive's minute): closed, so that a rank never
 * goes to one of them ahead of the live worker. */
static void drop_earlier_boots(dit_joiners *j, const dit_joiner *p)
{
    const char *slash = strchr(p->host, '/');
    const size_t name = slash ? (size_t)(slash - p->host) : strlen(p->host);
    dit_joiner *next;
    for (dit_joiner *q = j->peers; q; q = next) {
        next = q->next;
        if (q == p || !q->joined || strncmp(q->host, p->host, name) != 0 ||
            (q->host[name] != '/' && q->host[name] != '\0') || strcmp(q->host, p->host) == 0)
            continue;
        DIT_LOG(j->cfg.log, DIT_LOG_INFO, "join",
                "the waiting worker pid %d at %s is from an earlier boot of its host; closed",
                q->pid, q->addr);
        dit_joiners_remove(j, q);
        j->io.close(j->io.ctx, q, false);
    }
}

void dit_joiners_expire(dit_joiners *j, double now_s)
{
    dit_joiner *next;
    for (dit_joiner *p = j->peers; p; p = next) {
        next = p->next;
        if (!p->joined && now_s - p->since_s > DIT_JOINERS_AUTH_S)
            dit_joiners_refuse(j, p, false, "no join request within %.0f s", DIT_JOINERS_AUTH_S);
    }
}

dit_joiner *dit_joiners_take(dit_joiners *j, int rank, bool any)
{
    dit_joiner *best = NULL;
    for (dit_joiner *p = j->peers; p; p = p->next) {
        if (!p->joined)
            continue;
        if (any ? p->want_rank >= 0 : p->want_rank != rank)
            continue;
        if (!best || p->seq < best->seq)
            best = p;
    }
    if (best)
        dit_joiners_remove(j, best);
    return best;
}
