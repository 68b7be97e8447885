/* The ditd <-> ditworker framing (proto/ipc_wire.c): frames split across
 * reads and several frames in one read, through both ways of receiving
 * (dit_ipc_reader_feed, and reads landing in place through
 * dit_ipc_reader_room / commit); the room a frame's length asks for and its
 * cap; corrupt lengths; a large buffer given back once empty; the blocking
 * helpers over a socket pair, and the write of a large JobDone in two parts
 * (its image uncopied) read back as the message it is. */
#include <check.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ipc_wire.h"

/* A JobDone frame for job `id` carrying `n` bytes of result. */
static uint8_t *make_frame(uint64_t id, size_t n, size_t *len)
{
    uint8_t *img = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(img);
    for (size_t i = 0; i < n; i++)
        img[i] = (uint8_t)(i * 131 + id);
    Ditserve__Ipc__JobDone d = DITSERVE__IPC__JOB_DONE__INIT;
    d.job_id = id;
    d.image.data = img;
    d.image.len = n;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_DONE;
    env.done = &d;
    uint8_t *frame;
    ck_assert_int_eq(dit_ipc_encode(&env, &frame, len), 0);
    free(img);
    return frame;
}

static void expect_done(Ditserve__Ipc__Envelope *env, uint64_t id, size_t n)
{
    ck_assert_int_eq(env->msg_case, DITSERVE__IPC__ENVELOPE__MSG_DONE);
    ck_assert_uint_eq(env->done->job_id, id);
    ck_assert_uint_eq(env->done->image.len, n);
    for (size_t i = 0; i < n; i++)
        if (env->done->image.data[i] != (uint8_t)(i * 131 + id))
            ck_abort_msg("job %llu: byte %zu differs", (unsigned long long)id, i);
    ditserve__ipc__envelope__free_unpacked(env, NULL);
}

/* Puts `n` bytes into the reader the way a read in place would, in pieces
 * of at most `step`. */
static void put_in_place(dit_ipc_reader *r, const uint8_t *p, size_t n, size_t step, size_t max)
{
    while (n) {
        uint8_t *room;
        size_t cap;
        if (dit_ipc_reader_room(r, 16, max, &room, &cap) != 0 || cap < 16)
            ck_abort_msg("no room");
        size_t k = n < step ? n : step;
        k = k < cap ? k : cap;
        memcpy(room, p, k);
        dit_ipc_reader_commit(r, k);
        p += k;
        n -= k;
    }
}

/* Two frames, the first `big` bytes of result, arrive in reads of `step`. */
static void split_and_joined(size_t big, size_t step, bool in_place)
{
    size_t la, lb;
    uint8_t *a = make_frame(7, big, &la);
    uint8_t *b = make_frame(8, 10, &lb);
    uint8_t *both = malloc(la + lb);
    memcpy(both, a, la);
    memcpy(both + la, b, lb);
    dit_ipc_reader r;
    dit_ipc_reader_init(&r);
    Ditserve__Ipc__Envelope *env = NULL;
    int got = 0;
    size_t off = 0, seen = 0;
    while (off < la + lb) {
        size_t k = la + lb - off < step ? la + lb - off : step;
        if (in_place)
            put_in_place(&r, both + off, k, k, DIT_IPC_MAX_FRAME);
        else if (dit_ipc_reader_feed(&r, both + off, k) != 0)
            ck_abort_msg("feed failed");
        off += k;
        while ((got = dit_ipc_reader_next(&r, &env)) == 1) {
            expect_done(env, seen == 0 ? 7 : 8, seen == 0 ? big : 10);
            seen++;
        }
        /* The first frame is complete exactly when its last byte is in. */
        if (got != 0 || (seen >= 1) != (off >= la))
            ck_abort_msg("step %zu: %zu frames after %zu of %zu bytes (got %d)", step, seen, off,
                         la, got);
    }
    ck_assert_uint_eq(seen, 2);
    ck_assert_uint_eq(r.len, 0);
    dit_ipc_reader_free(&r);
    free(a);
    free(b);
    free(both);
}

START_TEST(frames_split_and_joined)
{
    for (int in_place = 0; in_place < 2; in_place++) {
        split_and_joined(3000, 1, in_place);
        split_and_joined(3000, 3, in_place);
        split_and_joined(300000, 4096, in_place);
        split_and_joined(300000, 65536, in_place);
        split_and_joined(300000, 1 << 20, in_place);
    }
}
END_TEST

START_TEST(room_follows_the_frame_up_to_the_cap)
{
    size_t la;
    uint8_t *a = make_frame(3, 1000000, &la);
    dit_ipc_reader r;
    dit_ipc_reader_init(&r);
    uint8_t *room;
    size_t cap;
    /* No length known yet: the minimum. */
    ck_assert_int_eq(dit_ipc_reader_room(&r, 100, DIT_IPC_MAX_FRAME, &room, &cap), 0);
    ck_assert_uint_ge(cap, 100);
    ck_assert_uint_lt(cap, 1 << 20);
    memcpy(room, a, 10);
    dit_ipc_reader_commit(&r, 10);
    /* The length is in: room for the rest of the frame in one read. */
    ck_assert_int_eq(dit_ipc_reader_room(&r, 100, DIT_IPC_MAX_FRAME, &room, &cap), 0);
    ck_assert_uint_ge(cap, la - 10);
    /* ... unless the caller caps it (a peer not yet trusted). */
    dit_ipc_reader s;
    dit_ipc_reader_init(&s);
    ck_assert_int_eq(dit_ipc_reader_feed(&s, a, 10), 0);
    ck_assert_int_eq(dit_ipc_reader_room(&s, 50, 200, &room, &cap), 0);
    ck_assert_uint_ge(cap, 200);
    ck_assert_uint_lt(cap, 8192);
    dit_ipc_reader_free(&s);
    /* The whole frame read in place in one piece. */
    memcpy(room = r.buf + r.len, a + 10, la - 10);
    dit_ipc_reader_commit(&r, la - 10);
    Ditserve__Ipc__Envelope *env;
    ck_assert_int_eq(dit_ipc_reader_next(&r, &env), 1);
    expect_done(env, 3, 1000000);
    dit_ipc_reader_free(&r);
    free(a);
}
END_TEST

START_TEST(corrupt_lengths_and_large_buffers)
{
    /* A length past the largest frame: corrupt, and no room is reserved for it. */
    dit_ipc_reader r;
    dit_ipc_reader_init(&r);
    const uint8_t huge[4] = {0xff, 0xff, 0xff, 0x7f};
    ck_assert_int_eq(dit_ipc_reader_feed(&r, huge, 4), 0);
    uint8_t *room;
    size_t cap;
    ck_assert_int_eq(dit_ipc_reader_room(&r, 64, DIT_IPC_MAX_FRAME, &room, &cap), 0);
    ck_assert_uint_lt(r.cap, 1 << 20);
    Ditserve__Ipc__Envelope *env;
    ck_assert_int_eq(dit_ipc_reader_next(&r, &env), -1);
    dit_ipc_reader_free(&r);
    /* Bytes that are not an envelope. */
    dit_ipc_reader_init(&r);
    const uint8_t junk[8] = {4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff};
    ck_assert_int_eq(dit_ipc_reader_feed(&r, junk, 8), 0);
    ck_assert_int_eq(dit_ipc_reader_next(&r, &env), -1);
    dit_ipc_reader_free(&r);
    /* A 20 MB result: its buffer is given back once the frame is taken. */
    size_t la;
    uint8_t *a = make_frame(9, 20 << 20, &la);
    dit_ipc_reader_init(&r);
    put_in_place(&r, a, la, 1 << 20, DIT_IPC_MAX_FRAME);
    ck_assert_uint_ge(r.cap, la);
    ck_assert_int_eq(dit_ipc_reader_next(&r, &env), 1);
    expect_done(env, 9, 20 << 20);
    ck_assert_ptr_null(r.buf);
    ck_assert_uint_eq(r.cap, 0);
    dit_ipc_reader_free(&r);
    free(a);
}
END_TEST

START_TEST(blocking_helpers_over_a_socket)
{
    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(sv[0]);
        for (uint64_t id = 1; id <= 3; id++) {
            size_t len;
            uint8_t *f = make_frame(id, id * 250000, &len);
            size_t off = 0;
            while (off < len) {
                ssize_t w = write(sv[1], f + off, len - off);
                if (w <= 0)
                    _exit(1);
                off += (size_t)w;
            }
            free(f);
        }
        close(sv[1]);
        _exit(0);
    }
    close(sv[1]);
    dit_ipc_reader r;
    dit_ipc_reader_init(&r);
    Ditserve__Ipc__Envelope *env;
    for (uint64_t id = 1; id <= 3; id++) {
        ck_assert_int_eq(dit_ipc_read_fd(sv[0], &r, &env), 0);
        expect_done(env, id, id * 250000);
    }
    ck_assert_int_eq(dit_ipc_read_fd(sv[0], &r, &env), -1); /* end of stream */
    dit_ipc_reader_free(&r);
    close(sv[0]);
}
END_TEST

/* dit_ipc_write_fd tells a message it cannot encode (-2, nothing written:
 * the worker reports the job's failure instead) from a broken socket (-1). */
START_TEST(write_tells_encoding_from_socket_failures)
{
    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
    static uint8_t small[16];
    Ditserve__Ipc__JobDone done = DITSERVE__IPC__JOB_DONE__INIT;
    done.job_id = 1;
    /* Sized over a frame; never read, since the size is checked first. */
    done.image.data = small;
    done.image.len = DIT_IPC_MAX_FRAME + 1;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_DONE;
    env.done = &done;
    ck_assert_int_eq(dit_ipc_write_fd(sv[0], &env), -2);
    uint8_t b;
    ck_assert_int_eq((int)read(sv[1], &b, 1), -1); /* nothing was written */
    done.image.len = sizeof small;
    ck_assert_int_eq(dit_ipc_write_fd(sv[0], &env), 0);
    close(sv[1]);
    ck_assert_int_eq(dit_ipc_write_fd(sv[0], &env), -1);
    close(sv[0]);
}
END_TEST

/* A JobDone with every kind of field, its image of `n` bytes, written by
 * dit_ipc_write_fd (in two parts from DIT_IPC_SPLIT_MIN bytes on) and read
 * back, against the same message packed whole by dit_ipc_encode: the same
 * message either way, field by field, as protobuf-c's own packing of each
 * unpacked message shows. */
static void split_round_trip(size_t n)
{
    uint8_t *img = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(img);
    for (size_t i = 0; i < n; i++)
        img[i] = (uint8_t)(i * 131 + 5);
    int64_t sizes[2] = {(int64_t)(n / 3), (int64_t)(n - n / 3)};
    int32_t ranks[2] = {0, 1};
    Ditserve__V1__Timings tm = DITSERVE__V1__TIMINGS__INIT;
    tm.denoise_ms = 12.5;
    tm.encode_ms = 3.25;
    Ditserve__Ipc__JobDone d = DITSERVE__IPC__JOB_DONE__INIT;
    d.job_id = 41;
    d.status = 0;
    d.message = "fine";
    d.seed = 1234567890123ull;
    d.width = 320;
    d.height = 192;
    d.image.data = img;
    d.image.len = n;
    d.n_image_bytes = 2;
    d.image_bytes = sizes;
    d.n_image_ranks = 2;
    d.image_ranks = ranks;
    d.timings = &tm;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_DONE;
    env.done = &d;

    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(sv[0]);
        _exit(dit_ipc_write_fd(sv[1], &env) == 0 ? 0 : 1);
    }
    close(sv[1]);
    dit_ipc_reader r;
    dit_ipc_reader_init(&r);
    Ditserve__Ipc__Envelope *got = NULL;
    ck_assert_int_eq(dit_ipc_read_fd(sv[0], &r, &got), 0);
    int wst = 0;
    ck_assert_int_eq(waitpid(pid, &wst, 0), pid);
    ck_assert(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    ck_assert_int_eq(got->msg_case, DITSERVE__IPC__ENVELOPE__MSG_DONE);
    ck_assert_uint_eq(got->done->image.len, n);
    ck_assert(n == 0 || memcmp(got->done->image.data, img, n) == 0);

    uint8_t *whole;
    size_t wlen;
    ck_assert_int_eq(dit_ipc_encode(&env, &whole, &wlen), 0);
    Ditserve__Ipc__Envelope *ref = ditserve__ipc__envelope__unpack(NULL, wlen - 4, whole + 4);
    ck_assert_ptr_nonnull(ref);
    const size_t a = ditserve__ipc__envelope__get_packed_size(got);
    ck_assert_uint_eq(a, wlen - 4);
    uint8_t *again = malloc(a);
    ck_assert_ptr_nonnull(again);
    ditserve__ipc__envelope__pack(got, again);
    ck_assert_int_eq(memcmp(again, whole + 4, a), 0);
    ck_assert_str_eq(got->done->message, "fine");
    ck_assert_uint_eq(got->done->n_image_ranks, 2);
    ck_assert_double_eq(got->done->timings->encode_ms, 3.25);
    free(again);
    free(whole);
    ditserve__ipc__envelope__free_unpacked(ref, NULL);
    ditserve__ipc__envelope__free_unpacked(got, NULL);
    dit_ipc_reader_free(&r);
    close(sv[0]);
    free(img);
}

START_TEST(large_done_written_in_two_parts)
{
    split_round_trip(0);
    split_round_trip(1000);
    split_round_trip(DIT_IPC_SPLIT_MIN - 1);
    split_round_trip(DIT_IPC_SPLIT_MIN);
    split_round_trip(3 * 1000 * 1000 +
                     7); /* a length of several varint bytes, more than a socket buffer */
}
END_TEST

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    Suite *s = suite_create("ipc_wire");
    TCase *tc = tcase_create("reader");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, frames_split_and_joined);
    tcase_add_test(tc, room_follows_the_frame_up_to_the_cap);
    tcase_add_test(tc, corrupt_lengths_and_large_buffers);
    tcase_add_test(tc, blocking_helpers_over_a_socket);
    tcase_add_test(tc, write_tells_encoding_from_socket_failures);
    tcase_add_test(tc, large_done_written_in_two_parts);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
