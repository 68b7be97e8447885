/* The join handshake (daemon/join.c) over a fake transport: the challenge,
 * a right and a wrong answer, the daemon's proof before a refusal, ranks
 * asked for, the pool's order, the handshake limit and the handshake
 * deadline; and the escaping of what a peer sends and the TCP options of a
 * join connection (serve/join_auth.c). */
#include <check.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "join.h"

/* What the module sent and closed, per peer. */
typedef struct fake_peer {
    dit_joiner jp;
    int sent, closed;
    bool flushed;
    Ditserve__Ipc__Envelope__MsgCase last;
    Ditserve__Ipc__Envelope__MsgCase order[4]; /* the first four sent */
    unsigned char challenge[DIT_JOIN_NONCE_BYTES];
    unsigned char proof[DIT_JOIN_MAC_BYTES]; /* the JoinAccept's MAC */
    char refused[600];
} fake_peer;

#define PEER_OF(p) ((fake_peer *)(void *)((char *)(p)-offsetof(fake_peer, jp)))

static int fake_send(void *ctx, dit_joiner *p, const Ditserve__Ipc__Envelope *env)
{
    (void)ctx;
    fake_peer *f = PEER_OF(p);
    if (f->sent < 4)
        f->order[f->sent] = env->msg_case;
    f->sent++;
    f->last = env->msg_case;
    if (env->msg_case == DITSERVE__IPC__ENVELOPE__MSG_ACCEPT &&
        env->accept->mac.len == DIT_JOIN_MAC_BYTES)
        memcpy(f->proof, env->accept->mac.data, DIT_JOIN_MAC_BYTES);
    if (env->msg_case == DITSERVE__IPC__ENVELOPE__MSG_CHALLENGE)
        memcpy(f->challenge, env->challenge->nonce.data, DIT_JOIN_NONCE_BYTES);
    if (env->msg_case == DITSERVE__IPC__ENVELOPE__MSG_REFUSED)
        snprintf(f->refused, sizeof f->refused, "%s", env->refused->reason);
    return 0;
}

static dit_joiners *g_j; /* the module under test, for fake_close */

static void fake_close(void *ctx, dit_joiner *p, bool flush)
{
    (void)ctx;
    fake_peer *f = PEER_OF(p);
    f->closed++;
    f->flushed = flush;
    dit_joiners_remove(g_j, p);
}

static dit_join_secret secret;
static dit_log quiet = {.level = DIT_LOG_ERROR};

static dit_joiners *make(const char *backend)
{
    memset(&secret, 0, sizeof secret);
    memcpy(secret.bytes, "0123456789abcdef-secret", 23);
    secret.len = 23;
    const dit_joiners_config cfg = {
        .secret = &secret, .backend = backend, .world_size = 4, .local_ranks = 2, .log = &quiet};
    const dit_joiners_io io = {.send = fake_send, .close = fake_close};
    dit_diag d;
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_joiners_create(&cfg, &io, &g_j, &d), DIT_OK);
    return g_j;
}

/* A JoinRequest answering f's challenge with key (the right secret or not). */
static Ditserve__Ipc__Envelope *answer(fake_peer *f, const dit_join_secret *key, int rank,
                                       const char *host)
{
    Ditserve__Ipc__Envelope *env = calloc(1, sizeof *env);
    Ditserve__Ipc__JoinRequest *r = calloc(1, sizeof *r);
    ditserve__ipc__envelope__init(env);
    ditserve__ipc__join_request__init(r);
    r->protocol = DIT_JOIN_PROTOCOL;
    r->rank = rank;
    r->pid = 4242;
    char hid[320];
    dit_join_host_id(hid, sizeof hid);
    r->host_id = strdup(host ? host : hid);
    r->nonce.len = DIT_JOIN_NONCE_BYTES;
    r->nonce.data = malloc(DIT_JOIN_NONCE_BYTES);
    memset(r->nonce.data, 7, DIT_JOIN_NONCE_BYTES);
    r->mac.len = DIT_JOIN_MAC_BYTES;
    r->mac.data = malloc(DIT_JOIN_MAC_BYTES);
    dit_diag d;
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_join_mac(key, "worker", f->challenge, DIT_JOIN_NONCE_BYTES, r->nonce.data,
                                  r->nonce.len, r->mac.data, &d),
                     DIT_OK);
    env->msg_case = DITSERVE__IPC__ENVELOPE__MSG_JOIN;
    env->join = r;
    return env;
}

START_TEST(right_secret_joins_wrong_one_is_refused)
{
    dit_joiners *j = make("cuda");
    fake_peer a = {0}, b = {0};
    dit_joiners_accept(j, &a.jp, "10.0.0.1:5000", 0.0, false);
    ck_assert_int_eq(a.last, DITSERVE__IPC__ENVELOPE__MSG_CHALLENGE);
    ck_assert(!dit_joiners_joined(&a.jp));
    ck_assert(dit_joiners_handle(j, &a.jp, answer(&a, &secret, -1, NULL)));
    ck_assert(dit_joiners_joined(&a.jp));
    ck_assert_int_eq(a.last, DITSERVE__IPC__ENVELOPE__MSG_ACCEPT);
    ck_assert_int_eq(a.jp.pid, 4242);
    ck_assert_int_eq(a.closed, 0);

    dit_join_secret other = secret;
    other.bytes[0] ^= 1;
    dit_joiners_accept(j, &b.jp, "10.0.0.2:5000", 0.0, false);
    ck_assert(!dit_joiners_handle(j, &b.jp, answer(&b, &other, -1, NULL)));
    ck_assert_int_eq(b.last, DITSERVE__IPC__ENVELOPE__MSG_REFUSED);
    ck_assert_msg(strstr(b.refused, "wrong secret"), "%s", b.refused);
    ck_assert_int_eq(b.closed, 1);
    ck_assert(b.flushed); /* the reason goes out before the close */
    dit_joiners_destroy(j);
}
END_TEST

START_TEST(anything_but_a_join_request_is_refused)
{
    dit_joiners *j = make("cuda");
    fake_peer a = {0};
    dit_joiners_accept(j, &a.jp, "10.0.0.1:5000", 0.0, false);
    Ditserve__Ipc__Envelope *env = calloc(1, sizeof *env);
    ditserve__ipc__envelope__init(env);
    Ditserve__Ipc__Hello *h = calloc(1, sizeof *h);
    ditserve__ipc__hello__init(h);
    env->msg_case = DITSERVE__IPC__ENVELOPE__MSG_HELLO;
    env->hello = h;
    ck_assert(!dit_joiners_handle(j, &a.jp, env));
    ck_assert_msg(strstr(a.refused, "expected a join request"), "%s", a.refused);
    ck_assert_int_eq(a.closed, 1);
    dit_joiners_destroy(j);
}
END_TEST

START_TEST(ranks_asked_for_and_pool_order)
{
    dit_joiners *j = make("cuda");
    fake_peer p[4] = {0};
    const int want[4] = {-1, 3, -1, 1};
    for (int i = 0; i < 4; i++) {
        char addr[32];
        snprintf(addr, sizeof addr, "10.0.0.%d:1", i);
        dit_joiners_accept(j, &p[i].jp, addr, 0.0, false);
        const bool joined = dit_joiners_handle(j, &p[i].jp, answer(&p[i], &secret, want[i], NULL));
        ck_assert_int_eq(joined, i != 3);
    }
    /* rank 1 is local (ranks 2 and 3 are remote): refused. */
    ck_assert_msg(strstr(p[3].refused, "rank 1 is not a remote rank"), "%s", p[3].refused);
    ck_assert_ptr_null(dit_joiners_take(j, 2, false)); /* nobody asked for 2 */
    ck_assert_ptr_eq(dit_joiners_take(j, 3, false), &p[1].jp);
    ck_assert_ptr_eq(dit_joiners_take(j, 2, true), &p[0].jp); /* the oldest of the rest */
    ck_assert_ptr_eq(dit_joiners_take(j, 2, true), &p[2].jp);
    ck_assert_ptr_null(dit_joiners_take(j, 2, true));
    dit_joiners_destroy(j);
}
END_TEST

START_TEST(cpu_backend_wants_the_same_host)
{
    dit_joiners *j = make("cpu");
    fake_peer a = {0};
    dit_joiners_accept(j, &a.jp, "10.0.0.1:5000", 0.0, false);
    ck_assert(!dit_joiners_handle(j, &a.jp, answer(&a, &secret, -1, "elsewhere")));
    ck_assert_msg(strstr(a.refused, "shared-memory mesh needs every rank"), "%s", a.refused);
    dit_joiners_destroy(j);
}
END_TEST

/* Whether f got the daemon's proof that checks (answer()'s worker nonce). */
static bool proved(const fake_peer *f)
{
    unsigned char nonce[DIT_JOIN_NONCE_BYTES], want[DIT_JOIN_MAC_BYTES];
    memset(nonce, 7, sizeof nonce);
    dit_diag d;
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_join_mac(&secret, "daemon", nonce, sizeof nonce, f->challenge,
                                  DIT_JOIN_NONCE_BYTES, want, &d),
                     DIT_OK);
    return memcmp(f->proof, want, sizeof want) == 0;
}

START_TEST(a_refusal_after_the_workers_proof_follows_the_daemons)
{
    /* A rank the mesh lacks, another host on the cpu backend: the worker
     * proved the secret, so the daemon proves it back first, and the worker
     * can take the refusal as final. */
    const Ditserve__Ipc__Envelope__MsgCase C = DITSERVE__IPC__ENVELOPE__MSG_CHALLENGE,
                                           A = DITSERVE__IPC__ENVELOPE__MSG_ACCEPT,
                                           R = DITSERVE__IPC__ENVELOPE__MSG_REFUSED;
    dit_joiners *j = make("cuda");
    fake_peer a = {0}, b = {0};
    dit_joiners_accept(j, &a.jp, "10.0.0.1:5000", 0.0, false);
    ck_assert(!dit_joiners_handle(j, &a.jp, answer(&a, &secret, 9, NULL)));
    ck_assert_int_eq(a.sent, 3);
    ck_assert(a.order[0] == C && a.order[1] == A && a.order[2] == R);
    ck_assert(proved(&a));
    ck_assert_msg(strstr(a.refused, "rank 9 is not a remote rank"), "%s", a.refused);
    ck_assert_int_eq(a.closed, 1);
    ck_assert(a.flushed);
    /* A wrong secret: no proof for a worker that gave none. */
    dit_join_secret other = secret;
    other.bytes[3] ^= 1;
    dit_joiners_accept(j, &b.jp, "10.0.0.2:5000", 0.0, false);
    ck_assert(!dit_joiners_handle(j, &b.jp, answer(&b, &other, -1, NULL)));
    ck_assert_int_eq(b.sent, 2);
    ck_assert(b.order[0] == C && b.order[1] == R);
    dit_joiners_destroy(j);

    j = make("cpu");
    fake_peer c = {0};
    dit_joiners_accept(j, &c.jp, "10.0.0.3:5000", 0.0, false);
    ck_assert(!dit_joiners_handle(j, &c.jp, answer(&c, &secret, -1, "elsewhere")));
    ck_assert(c.order[0] == C && c.order[1] == A && c.order[2] == R);
    ck_assert(proved(&c));
    dit_joiners_destroy(j);
}
END_TEST

START_TEST(a_peers_text_is_escaped)
{
    char out[64];
    dit_join_escape("wrong secret\x1b[2J\nFAKE: ok\\ \x7f\xc3\xa9", out, sizeof out);
    ck_assert_str_eq(out, "wrong secret\\x1b[2J\\x0aFAKE: ok\\x5c \\x7f\\xc3\\xa9");
    dit_join_escape(NULL, out, sizeof out);
    ck_assert_str_eq(out, "");
    char small[12];
    dit_join_escape("\n\n\n\n", small, sizeof small);
    ck_assert_str_eq(small, "\\x0a\\x0a...");
    dit_join_escape("abc", small, 3); /* no room for "...": nothing */
    ck_assert_str_eq(small, "");
}
END_TEST

static int sockopt(int fd, int level, int name)
{
    int v = -1;
    socklen_t len = sizeof v;
    ck_assert_int_eq(getsockopt(fd, level, name, &v, &len), 0);
    return v;
}

START_TEST(join_sockets_time_out_with_data_in_flight)
{
    /* Keepalive probes only an idle connection: TCP_USER_TIMEOUT bounds a
     * write to a vanished peer, at the keepalive's minute. */
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(dit_join_socket_options(fd), 0);
    ck_assert_int_eq(sockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT), 60000);
    ck_assert_int_eq(sockopt(fd, SOL_SOCKET, SO_KEEPALIVE), 1);
    ck_assert_int_eq(sockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE), 15);
    ck_assert_int_eq(sockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL), 9);
    ck_assert_int_eq(sockopt(fd, IPPROTO_TCP, TCP_KEEPCNT), 5);
    ck_assert_int_eq(sockopt(fd, IPPROTO_TCP, TCP_NODELAY), 1);
    ck_assert_int_le(DIT_JOIN_KEEPIDLE_S + DIT_JOIN_KEEPINTVL_S * DIT_JOIN_KEEPCNT,
                     DIT_JOIN_USER_TIMEOUT_MS / 1000);
    close(fd);
    ck_assert_int_eq(dit_join_socket_options(-1), -1); /* not a socket: said so */
}
END_TEST

START_TEST(handshake_limit_closes_the_oldest)
{
    dit_joiners *j = make("cuda");
    static fake_peer p[DIT_JOINERS_MAX_PENDING + 1];
    memset(p, 0, sizeof p);
    for (int i = 0; i < DIT_JOINERS_MAX_PENDING; i++)
        dit_joiners_accept(j, &p[i].jp, "10.0.0.1:1", (double)i, false);
    for (int i = 0; i < DIT_JOINERS_MAX_PENDING; i++)
        ck_assert_int_eq(p[i].closed, 0);
    dit_joiners_accept(j, &p[DIT_JOINERS_MAX_PENDING].jp, "10.0.0.2:1", 99.0, false);
    ck_assert_int_eq(p[0].closed, 1);
    ck_assert(!p[0].flushed);
    ck_assert_int_eq(p[1].closed, 0);
    ck_assert_int_eq(p[DIT_JOINERS_MAX_PENDING].last, DITSERVE__IPC__ENVELOPE__MSG_CHALLENGE);
    dit_joiners_destroy(j);
}
END_TEST

/* One address that floods the port closes its own handshakes: a worker's
 * from elsewhere, older than all of them, stays. */
START_TEST(a_flood_closes_its_own_handshakes)
{
    dit_joiners *j = make("cuda");
    static fake_peer honest, flood[3 * DIT_JOINERS_MAX_PENDING];
    memset(&honest, 0, sizeof honest);
    memset(flood, 0, sizeof flood);
    dit_joiners_accept(j, &honest.jp, "10.0.0.2:7000", 0.0, false);
    for (int i = 0; i < 3 * DIT_JOINERS_MAX_PENDING; i++)
        dit_joiners_accept(j, &flood[i].jp, "10.0.0.66:1000", 1.0 + i, false);
    ck_assert_int_eq(honest.closed, 0);
    /* The flood's oldest went first, its newest stay. */
    ck_assert_int_eq(flood[0].closed, 1);
    ck_assert_int_eq(flood[3 * DIT_JOINERS_MAX_PENDING - 1].closed, 0);
    int open = 0;
    for (int i = 0; i < 3 * DIT_JOINERS_MAX_PENDING; i++)
        open += !flood[i].closed;
    ck_assert_int_eq(open, DIT_JOINERS_MAX_PENDING - 1);
    /* IPv6 addresses are told apart by host too. */
    static fake_peer v6[2];
    memset(v6, 0, sizeof v6);
    dit_joiners_accept(j, &v6[0].jp, "[fd00::1]:5000", 200.0, false);
    dit_joiners_accept(j, &v6[1].jp, "[fd00::2]:5000", 201.0, false);
    ck_assert_int_eq(v6[0].closed + v6[1].closed + honest.closed, 0);
    dit_joiners_destroy(j);
}
END_TEST

/* A host that restarted within the keepalive's minute: its worker from
 * the earlier boot, still pooled, is closed when the new one joins, so no
 * rank goes to it; another host's worker stays. */
START_TEST(a_new_boot_drops_the_old_boots_worker)
{
    dit_joiners *j = make("cuda");
    fake_peer old = {0}, other = {0}, fresh = {0};
    dit_joiners_accept(j, &old.jp, "10.0.0.7:5000", 0.0, false);
    ck_assert(dit_joiners_handle(j, &old.jp, answer(&old, &secret, -1, "node7/boot-1")));
    dit_joiners_accept(j, &other.jp, "10.0.0.8:5000", 1.0, false);
    ck_assert(dit_joiners_handle(j, &other.jp, answer(&other, &secret, -1, "node70/boot-9")));
    dit_joiners_accept(j, &fresh.jp, "10.0.0.7:5001", 2.0, false);
    ck_assert(dit_joiners_handle(j, &fresh.jp, answer(&fresh, &secret, -1, "node7/boot-2")));
    ck_assert_int_eq(old.closed, 1);
    ck_assert_int_eq(other.closed + fresh.closed, 0);
    /* The pool hands out the live ones, oldest first. */
    ck_assert_ptr_eq(dit_joiners_take(j, 2, true), &other.jp);
    ck_assert_ptr_eq(dit_joiners_take(j, 3, true), &fresh.jp);
    ck_assert_ptr_null(dit_joiners_take(j, 2, true));
    dit_joiners_destroy(j);
}
END_TEST

START_TEST(handshakes_expire_joined_workers_stay)
{
    dit_joiners *j = make("cuda");
    fake_peer slow = {0}, quick = {0};
    dit_joiners_accept(j, &slow.jp, "10.0.0.1:1", 10.0, false);
    dit_joiners_accept(j, &quick.jp, "10.0.0.2:1", 10.0, false);
    ck_assert(dit_joiners_handle(j, &quick.jp, answer(&quick, &secret, -1, NULL)));
    dit_joiners_expire(j, 10.0 + DIT_JOINERS_AUTH_S - 0.5);
    ck_assert_int_eq(slow.closed, 0);
    dit_joiners_expire(j, 10.0 + DIT_JOINERS_AUTH_S + 0.5);
    ck_assert_int_eq(slow.closed, 1);
    ck_assert_msg(strstr(slow.refused, "no join request within"), "%s", slow.refused);
    ck_assert_int_eq(quick.closed, 0);
    ck_assert_ptr_eq(dit_joiners_take(j, 2, true), &quick.jp);
    dit_joiners_destroy(j);
}
END_TEST

START_TEST(closing_refuses_new_peers)
{
    dit_joiners *j = make("cuda");
    fake_peer a = {0};
    dit_joiners_accept(j, &a.jp, "10.0.0.1:1", 0.0, true);
    ck_assert_msg(strstr(a.refused, "shutting down"), "%s", a.refused);
    ck_assert_int_eq(a.closed, 1);
    dit_joiners_destroy(j);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon_join");
    TCase *tc = tcase_create("handshake");
    tcase_add_test(tc, right_secret_joins_wrong_one_is_refused);
    tcase_add_test(tc, anything_but_a_join_request_is_refused);
    tcase_add_test(tc, ranks_asked_for_and_pool_order);
    tcase_add_test(tc, cpu_backend_wants_the_same_host);
    tcase_add_test(tc, a_refusal_after_the_workers_proof_follows_the_daemons);
    tcase_add_test(tc, a_peers_text_is_escaped);
    tcase_add_test(tc, join_sockets_time_out_with_data_in_flight);
    tcase_add_test(tc, handshake_limit_closes_the_oldest);
    tcase_add_test(tc, a_flood_closes_its_own_handshakes);
    tcase_add_test(tc, a_new_boot_drops_the_old_boots_worker);
    tcase_add_test(tc, handshakes_expire_joined_workers_stay);
    tcase_add_test(tc, closing_refuses_new_peers);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
