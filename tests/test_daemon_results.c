/* daemon/results.c: a job's results put together from its ranks' JobDone
 * messages, on messages built here and passed through the wire format
 * (packed and unpacked, as the supervisor gets them): images split over
 * ranks joined in image order with their sizes and the longest VAE and
 * encoding times; a member wholly on another rank moved over; a failed
 * holder's entry winning; a warm-up's empty entries left alone; and every
 * malformed message (a rank out of range, a missing entry, a count or
 * sizes that do not match) refused with a reason. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "results.h"

enum { RANKS = 3, MEMBERS = 2 };

/* One member's entry on one rank: its images (bytes of `fill`, sizes[i]
 * each), status, vae/encode times; the owners only in rank 0's. */
typedef struct entry_spec {
    int status;
    int n_images;
    int64_t sizes[4];
    double vae_ms, encode_ms;
} entry_spec;

typedef struct member_spec {
    int rank;     /* JobDone.rank of rank 0's entry */
    int n_owners; /* image_ranks, rank 0's entry */
    int32_t owners[4];
    entry_spec on[RANKS]; /* per rank */
} member_spec;

/* Rank r's JobDone for the members, through pack and unpack. Image i of
 * a member on rank r holds bytes of value 16 * r + i + 1 (image index
 * within that rank's entry) to tell them apart. */
static Ditserve__Ipc__JobDone *make_done(int r, const member_spec *m, int n)
{
    Ditserve__Ipc__JobDone done = DITSERVE__IPC__JOB_DONE__INIT;
    Ditserve__Ipc__JobDone e[MEMBERS], *ep[MEMBERS];
    Ditserve__V1__Timings tm[MEMBERS];
    uint8_t *bufs[MEMBERS] = {NULL};
    done.job_id = 10;
    done.rank = r;
    for (int k = 0; k < n; k++) {
        const entry_spec *s = &m[k].on[r];
        ditserve__ipc__job_done__init(&e[k]);
        ditserve__v1__timings__init(&tm[k]);
        e[k].job_id = 10 + (uint64_t)k;
        e[k].status = s->status;
        e[k].rank = m[k].rank;
        if (r == 0) {
            e[k].n_image_ranks = (size_t)m[k].n_owners;
            e[k].image_ranks = (int32_t *)m[k].owners;
        }
        size_t len = 0;
        for (int i = 0; i < s->n_images; i++)
            len += (size_t)s->sizes[i];
        bufs[k] = malloc(len ? len : 1);
        for (int i = 0, off = 0; i < s->n_images; off += (int)s->sizes[i], i++)
            memset(bufs[k] + off, 16 * r + i + 1, (size_t)s->sizes[i]);
        e[k].image.data = bufs[k];
        e[k].image.len = len;
        e[k].n_image_bytes = (size_t)s->n_images;
        e[k].image_bytes = (int64_t *)s->sizes;
        tm[k].vae_ms = s->vae_ms;
        tm[k].encode_ms = s->encode_ms;
        e[k].timings = &tm[k];
        ep[k] = &e[k];
    }
    done.n_batch = (size_t)n;
    done.batch = ep;
    const size_t sz = ditserve__ipc__job_done__get_packed_size(&done);
    uint8_t *wire = malloc(sz ? sz : 1);
    ditserve__ipc__job_done__pack(&done, wire);
    Ditserve__Ipc__JobDone *out = ditserve__ipc__job_done__unpack(NULL, sz, wire);
    ck_assert_ptr_nonnull(out);
    free(wire);
    for (int k = 0; k < n; k++)
        free(bufs[k]);
    return out;
}

typedef struct mesh {
    Ditserve__Ipc__JobDone *done[RANKS];
    double ms[RANKS];
    char why[200];
} mesh;

static bool merge(mesh *x, const member_spec *m, int n, const bool *sent)
{
    for (int r = 0; r < RANKS; r++) {
        x->done[r] = sent[r] ? make_done(r, m, n) : NULL;
        x->ms[r] = 100.0 + 10.0 * r; /* rank 2's message comes last */
    }
    x->why[0] = '\0';
    return dit_results_merge(x->done, RANKS, x->ms, x->why, sizeof x->why);
}

static void mesh_free(mesh *x)
{
    for (int r = 0; r < RANKS; r++)
        if (x->done[r])
            ditserve__ipc__job_done__free_unpacked(x->done[r], NULL);
}

static const bool all_sent[RANKS] = {true, true, true};

START_TEST(images_joined_in_order)
{
    /* Member 0: images on ranks 1, 0, 2, 0; member 1: all on rank 1, named
     * the old way (rank alone). */
    member_spec m[2] = {
        {.rank = 1,
         .n_owners = 4,
         .owners = {1, 0, 2, 0},
         .on = {{.n_images = 2, .sizes = {3, 5}, .vae_ms = 7, .encode_ms = 2},
                {.n_images = 1, .sizes = {4}, .vae_ms = 9, .encode_ms = 1},
                {.n_images = 1, .sizes = {2}, .vae_ms = 4, .encode_ms = 6}}},
        {.rank = 1, .on = {{0}, {.n_images = 1, .sizes = {6}, .vae_ms = 3}, {0}}},
    };
    mesh x;
    ck_assert_msg(merge(&x, m, 2, all_sent), "%s", x.why);
    const Ditserve__Ipc__JobDone *r0 = x.done[0]->batch[0];
    ck_assert_int_eq(r0->status, 0);
    ck_assert_uint_eq(r0->job_id, 10);
    ck_assert_int_eq(r0->n_image_bytes, 4);
    const int64_t want_sizes[4] = {4, 3, 2, 5};
    /* rank 1's image 0, rank 0's 0, rank 2's 0, rank 0's 1 */
    const uint8_t want_byte[4] = {17, 1, 33, 2};
    ck_assert_uint_eq(r0->image.len, 14);
    for (int i = 0, off = 0; i < 4; off += (int)want_sizes[i], i++) {
        ck_assert_int_eq(r0->image_bytes[i], want_sizes[i]);
        for (int b = 0; b < want_sizes[i]; b++)
            ck_assert_int_eq(r0->image.data[off + b], want_byte[i]);
    }
    ck_assert(r0->timings->vae_ms == 9.0);
    ck_assert(r0->timings->encode_ms == 6.0);
    /* Its last holder's message (rank 2's) was the last: no wait. */
    ck_assert(r0->timings->batch_others_ms == 0.0);
    /* Member 1 came over from rank 1 and waited 10 ms for rank 2's. */
    const Ditserve__Ipc__JobDone *r1 = x.done[0]->batch[1];
    ck_assert_uint_eq(r1->job_id, 11);
    ck_assert_uint_eq(r1->image.len, 6);
    ck_assert_int_eq(r1->image.data[0], 17);
    ck_assert(r1->timings->batch_others_ms == 10.0);
    mesh_free(&x);
}
END_TEST

START_TEST(failed_holder_wins)
{
    /* Image 1's holder (rank 2) failed it: the member's result is rank 2's
     * entry, not a join. */
    member_spec m[1] = {
        {.rank = 0,
         .n_owners = 2,
         .owners = {0, 2},
         .on = {{.n_images = 1, .sizes = {3}}, {0}, {.status = 3 /* any failure */}}}};
    mesh x;
    ck_assert_msg(merge(&x, m, 1, all_sent), "%s", x.why);
    ck_assert_int_eq(x.done[0]->batch[0]->status, 3);
    ck_assert_uint_eq(x.done[0]->batch[0]->image.len, 0);
    mesh_free(&x);
}
END_TEST

START_TEST(warmup_left_alone)
{
    member_spec m[1] = {{.rank = 0, .n_owners = 2, .owners = {0, 1}}};
    mesh x;
    ck_assert_msg(merge(&x, m, 1, all_sent), "%s", x.why);
    ck_assert_int_eq(x.done[0]->batch[0]->status, 0);
    ck_assert_uint_eq(x.done[0]->batch[0]->image.len, 0);
    mesh_free(&x);
}
END_TEST

START_TEST(malformed_refused)
{
    mesh x;
    /* A rank past the mesh. */
    member_spec bad_rank[1] = {
        {.n_owners = 2, .owners = {0, 3}, .on = {{.n_images = 1, .sizes = {1}}}}};
    ck_assert(!merge(&x, bad_rank, 1, all_sent));
    ck_assert_msg(strstr(x.why, "named rank 3"), "%s", x.why);
    mesh_free(&x);
    /* A holder that sent no message kept. */
    member_spec two[1] = {{.n_owners = 2,
                           .owners = {0, 1},
                           .on = {{.n_images = 1, .sizes = {1}}, {.n_images = 1, .sizes = {1}}}}};
    const bool no_rank1[RANKS] = {true, false, true};
    ck_assert(!merge(&x, two, 1, no_rank1));
    ck_assert_msg(strstr(x.why, "worker rank 1 did not send the result of batch member 0"), "%s",
                  x.why);
    mesh_free(&x);
    /* A holder with more images than it was given. */
    member_spec extra[1] = {
        {.n_owners = 2,
         .owners = {0, 1},
         .on = {{.n_images = 1, .sizes = {1}}, {.n_images = 2, .sizes = {1, 1}}}}};
    ck_assert(!merge(&x, extra, 1, all_sent));
    ck_assert_msg(strstr(x.why, "sent 2 images of batch member 0, not 1"), "%s", x.why);
    mesh_free(&x);
    /* Sizes past the bytes sent: rank 1's entry rewritten after the wire. */
    ck_assert(merge(&x, two, 1, all_sent)); /* well formed: joins */
    mesh_free(&x);
    for (int r = 0; r < RANKS; r++)
        x.done[r] = make_done(r, two, 1);
    x.done[1]->batch[0]->image_bytes[0] = 1000;
    ck_assert(!dit_results_merge(x.done, RANKS, x.ms, x.why, sizeof x.why));
    ck_assert_msg(strstr(x.why, "do not add up"), "%s", x.why);
    mesh_free(&x);
    for (int r = 0; r < RANKS; r++)
        x.done[r] = make_done(r, two, 1);
    x.done[1]->batch[0]->image_bytes[0] = -1;
    ck_assert(!dit_results_merge(x.done, RANKS, x.ms, x.why, sizeof x.why));
    mesh_free(&x);
    /* A different member in the holder's entry. */
    for (int r = 0; r < RANKS; r++)
        x.done[r] = make_done(r, two, 1);
    x.done[1]->batch[0]->job_id = 99;
    ck_assert(!dit_results_merge(x.done, RANKS, x.ms, x.why, sizeof x.why));
    ck_assert_msg(strstr(x.why, "did not send"), "%s", x.why);
    mesh_free(&x);
    /* Too many images named. */
    for (int r = 0; r < RANKS; r++)
        x.done[r] = make_done(r, two, 1);
    x.done[0]->batch[0]->n_image_ranks = DIT_RESULTS_MAX_IMAGES + 1;
    ck_assert(!dit_results_merge(x.done, RANKS, x.ms, x.why, sizeof x.why));
    ck_assert_msg(strstr(x.why, "named 65 images"), "%s", x.why);
    x.done[0]->batch[0]->n_image_ranks = 2; /* as unpacked, for the free */
    mesh_free(&x);
}
END_TEST

/* A chunk event sent as head + data, the data where it lies, is the event
 * packed whole: it unpacks to the same fields, and protobuf-c packs what it
 * unpacked to the whole event's bytes, over lengths of one to several varint
 * bytes, offsets and image indexes of several bytes too, and ids with or
 * without text. */
static void chunk_head_case(const char *rid, int64_t offset, int32_t index, size_t len)
{
    uint8_t *data = malloc(len ? len : 1);
    ck_assert_ptr_nonnull(data);
    for (size_t i = 0; i < len; i++)
        data[i] = (uint8_t)(i * 7 + 3);
    const size_t max = dit_chunk_event_head_max(rid);
    uint8_t *wire = malloc(max + len);
    ck_assert_ptr_nonnull(wire);
    const size_t h = dit_chunk_event_head(rid, offset, index, len, wire);
    ck_assert_uint_le(h, max);
    memcpy(wire + h, data, len);

    Ditserve__V1__ResultChunk rc = DITSERVE__V1__RESULT_CHUNK__INIT;
    rc.offset = offset;
    rc.image_index = index;
    rc.data.data = data;
    rc.data.len = len;
    Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
    ev.request_id = (char *)rid;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_CHUNK;
    ev.chunk = &rc;
    const size_t whole_len = ditserve__v1__generate_event__get_packed_size(&ev);
    ck_assert_uint_eq(h + len, whole_len);
    uint8_t *whole = malloc(whole_len);
    ck_assert_ptr_nonnull(whole);
    ditserve__v1__generate_event__pack(&ev, whole);

    Ditserve__V1__GenerateEvent *got = ditserve__v1__generate_event__unpack(NULL, h + len, wire);
    ck_assert_ptr_nonnull(got);
    ck_assert_int_eq(got->event_case, DITSERVE__V1__GENERATE_EVENT__EVENT_CHUNK);
    ck_assert_str_eq(got->request_id, rid);
    ck_assert_int_eq(got->chunk->offset, offset);
    ck_assert_int_eq(got->chunk->image_index, index);
    ck_assert_uint_eq(got->chunk->data.len, len);
    ck_assert(len == 0 || memcmp(got->chunk->data.data, data, len) == 0);
    uint8_t *again = malloc(whole_len);
    ck_assert_ptr_nonnull(again);
    ck_assert_uint_eq(ditserve__v1__generate_event__get_packed_size(got), whole_len);
    ditserve__v1__generate_event__pack(got, again);
    ck_assert_int_eq(memcmp(again, whole, whole_len), 0);
    ditserve__v1__generate_event__free_unpacked(got, NULL);
    free(again);
    free(whole);
    free(wire);
    free(data);
}

START_TEST(chunk_event_head_and_data_are_the_event)
{
    chunk_head_case("req-1", 0, 0, 100);
    chunk_head_case("", 0, 0, 1);
    chunk_head_case("a-longer-request-id-of-some-length", 1 << 20, 3, 150000);
    chunk_head_case("x", (int64_t)5 << 32, 7, (size_t)3 << 20);
    chunk_head_case("y", 127, 0, 127);
    chunk_head_case("z", 128, 1, 128);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon_results");
    TCase *tc = tcase_create("merge");
    tcase_add_test(tc, images_joined_in_order);
    tcase_add_test(tc, failed_holder_wins);
    tcase_add_test(tc, warmup_left_alone);
    tcase_add_test(tc, malformed_refused);
    tcase_add_test(tc, chunk_event_head_and_data_are_the_event);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
