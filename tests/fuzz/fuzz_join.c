/* The join port (ditworker --join): bytes from a TCP peer that has not
 * proved the secret, read as ditd's supervisor reads them: through the IPC
 * frame reader with the supervisor's pre-authentication room (at most
 * DIT_JOINERS_PREAUTH_BYTES + 1 buffered), each complete envelope handed to
 * the handshake (daemon/join.c). The input is the stream; it arrives in
 * reads of 1 to 97 bytes, sizes taken from the stream's own bytes.
 *
 * Properties: the peer is challenged once on connecting; it never joins
 * (it cannot know the nonce's MAC); its first complete frame, a corrupt
 * stream or more than the pre-authentication bytes ends it with one
 * refusal at most, flushed, and one that stays silent is refused at the
 * handshake deadline; what the daemon tells it is valid UTF-8 with
 * no control bytes (nothing the peer sent is echoed back before it has
 * joined); the reader never holds more than the room it was given. */
#include <stdbool.h>
#include <string.h>

#include "core/utf8.h"
#include "fuzz.h"
#include "fuzz_proto.h"
#include "ipc_wire.h"
#include "join.h"

typedef struct fake_peer {
    dit_joiner jp;
    int challenges, refusals, other_sends, closes;
    bool flushed;
} fake_peer;

typedef struct join_ctx {
    dit_join_secret secret;
    dit_log log;
    dit_joiners *j;
} join_ctx;

#define PEER_OF(p) ((fake_peer *)(void *)((char *)(p)-offsetof(fake_peer, jp)))

static int fake_send(void *ctx, dit_joiner *p, const Ditserve__Ipc__Envelope *env)
{
    (void)ctx;
    fake_peer *f = PEER_OF(p);
    if (env->msg_case == DITSERVE__IPC__ENVELOPE__MSG_CHALLENGE) {
        f->challenges++;
    } else if (env->msg_case == DITSERVE__IPC__ENVELOPE__MSG_REFUSED) {
        f->refusals++;
        const char *why = env->refused->reason;
        DIT_FUZZ_REQUIRE(why && *why && dit_utf8_valid(why, strlen(why)),
                         "a refusal without a readable reason");
        for (const char *c = why; *c; c++)
            DIT_FUZZ_REQUIRE((unsigned char)*c >= 0x20 && *c != 0x7f,
                             "a control byte in the refusal \"%s\"", why);
    } else {
        f->other_sends++;
    }
    return 0;
}

static void fake_close(void *ctx, dit_joiner *p, bool flush)
{
    fake_peer *f = PEER_OF(p);
    f->closes++;
    f->flushed = flush;
    dit_joiners_remove(((join_ctx *)ctx)->j, p);
}

static void teardown(void *p)
{
    join_ctx *c = p;
    dit_joiners_destroy(c->j);
    free(c);
}

static void *setup(const char *root)
{
    (void)root;
    join_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    memcpy(c->secret.bytes, "fuzz-join-secret-0123456789", 27);
    c->secret.len = 27;
    c->log.level = DIT_LOG_ERROR; /* refusals are logged at warn and info */
    const dit_joiners_config cfg = {
        .secret = &c->secret, .backend = "cuda", .world_size = 4, .local_ranks = 2, .log = &c->log};
    const dit_joiners_io io = {.ctx = c, .send = fake_send, .close = fake_close};
    dit_diag d;
    dit_diag_clear(&d);
    if (dit_joiners_create(&cfg, &io, &c->j, &d) != DIT_OK) {
        fprintf(stderr, "fuzz_join: %s\n", dit_diag_msg(&d));
        free(c);
        return NULL;
    }
    return c;
}

static int run(void *p, const uint8_t *data, size_t size)
{
    join_ctx *c = p;
    fake_peer f;
    memset(&f, 0, sizeof f);
    dit_joiners_accept(c->j, &f.jp, "192.0.2.7:40000", 0.0, false);
    DIT_FUZZ_REQUIRE(f.challenges == 1 && f.closes == 0, "no challenge on connecting");

    dit_ipc_reader reader;
    dit_ipc_reader_init(&reader);
    size_t pos = 0, frames = 0;
    bool corrupt = false;
    while (pos < size && f.closes == 0) {
        /* The supervisor's room for a peer that has not joined. */
        size_t min = reader.len <= DIT_JOINERS_PREAUTH_BYTES
                         ? DIT_JOINERS_PREAUTH_BYTES + 1 - reader.len
                         : 1;
        uint8_t *room;
        size_t n;
        if (dit_ipc_reader_room(&reader, min, min, &room, &n) != 0)
            break;
        DIT_FUZZ_REQUIRE(n >= min, "room of %zu for %zu", n, min);
        if (n > min) /* the supervisor's cap on a read */
            n = min;
        size_t chunk = 1 + data[pos] % 97;
        if (chunk > size - pos)
            chunk = size - pos;
        if (chunk > n)
            chunk = n;
        memcpy(room, data + pos, chunk);
        dit_ipc_reader_commit(&reader, chunk);
        pos += chunk;
        DIT_FUZZ_REQUIRE(reader.len <= DIT_JOINERS_PREAUTH_BYTES + 1, "%zu bytes held", reader.len);
        if (reader.len > DIT_JOINERS_PREAUTH_BYTES) {
            dit_joiners_refuse(c->j, &f.jp, true, "join request too large");
            break;
        }
        Ditserve__Ipc__Envelope *env;
        int got;
        while (f.closes == 0 && (got = dit_ipc_reader_next(&reader, &env)) == 1) {
            frames++;
            DIT_FUZZ_REQUIRE(!dit_joiners_handle(c->j, &f.jp, env), "joined without the secret");
        }
        if (f.closes == 0 && got < 0) { /* the supervisor closes a corrupt stream */
            corrupt = true;
            dit_joiners_remove(c->j, &f.jp);
            break;
        }
    }
    DIT_FUZZ_REQUIRE(!dit_joiners_joined(&f.jp), "joined without the secret");
    DIT_FUZZ_REQUIRE(f.other_sends == 0, "sent a peer that has not joined something else");
    DIT_FUZZ_REQUIRE(f.refusals <= 1 && f.closes <= 1, "%d refusals, %d closes", f.refusals,
                     f.closes);
    DIT_FUZZ_REQUIRE(frames == 0 || f.closes == 1, "a peer's frame did not end its handshake");
    DIT_FUZZ_REQUIRE(frames <= 1, "%zu frames handled from one peer", frames);
    DIT_FUZZ_REQUIRE(f.closes == 0 || (f.refusals == 1 && f.flushed),
                     "closed without a flushed refusal");
    if (f.closes == 0 && !corrupt) { /* still waiting: the deadline ends it */
        dit_joiners_expire(c->j, DIT_JOINERS_AUTH_S + 1.0);
        DIT_FUZZ_REQUIRE(f.closes == 1 && f.refusals == 1, "a silent peer outlived the deadline");
    }
    /* The peer's connection ends here either way. */
    dit_joiners_remove(c->j, &f.jp);
    DIT_FUZZ_REQUIRE(dit_joiners_take(c->j, 2, true) == NULL &&
                         dit_joiners_take(c->j, 3, false) == NULL,
                     "a peer in the pool");
    dit_ipc_reader_free(&reader);
    return frames || corrupt || f.closes ? 0 : -1;
}

/* The stream's first frame, if the input is exactly one frame, mutated as
 * an Envelope with its length prefix rewritten. */
static size_t mutate(void *ctx, uint8_t *data, size_t size, size_t max_size, uint64_t seed)
{
    (void)ctx;
    if (size < 4 || max_size < 4)
        return 0;
    const size_t len =
        (size_t)data[0] | (size_t)data[1] << 8 | (size_t)data[2] << 16 | (size_t)data[3] << 24;
    if (len != size - 4)
        return 0;
    size_t n = dit_fuzz_proto_mutate(&ditserve__ipc__envelope__descriptor, data + 4, len,
                                     max_size - 4, seed);
    if (!n)
        return 0;
    for (int i = 0; i < 4; i++)
        data[i] = (uint8_t)(n >> (8 * i));
    return n + 4;
}

const dit_fuzz_target dit_fuzz_target_def = {
    .name = "join", .setup = setup, .run = run, .teardown = teardown, .mutate = mutate};
