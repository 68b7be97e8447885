/* ditd's request queue (daemon/queue.c): the order jobs run in is
 * priority first, then arrival, whatever order they were pushed in. */
#include <check.h>
#include <stdlib.h>

#include "queue.h"

typedef struct rec {
    int id;
    dit_queue_item qi;
} rec;

static int id_of(dit_queue_item *it)
{
    return DIT_QUEUE_ENTRY(it, rec, qi)->id;
}

static void push(dit_queue *q, rec *r, int id, int priority)
{
    r->id = id;
    r->qi.priority = priority;
    dit_queue_push(q, &r->qi);
}

START_TEST(empty_queue_pops_null)
{
    dit_queue q;
    dit_queue_init(&q);
    ck_assert_ptr_null(dit_queue_pop(&q));
    ck_assert_ptr_null(dit_queue_peek(&q));
    ck_assert_int_eq(dit_queue_length(&q), 0);
}
END_TEST

START_TEST(equal_priorities_run_in_arrival_order)
{
    dit_queue q;
    dit_queue_init(&q);
    rec r[5];
    for (int i = 0; i < 5; i++)
        push(&q, &r[i], i, 0);
    ck_assert_int_eq(dit_queue_length(&q), 5);
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(id_of(dit_queue_pop(&q)), i);
    ck_assert_int_eq(dit_queue_length(&q), 0);
}
END_TEST

START_TEST(higher_priority_runs_first_then_arrival)
{
    dit_queue q;
    dit_queue_init(&q);
    rec r[7];
    /* arrival: id, priority */
    push(&q, &r[0], 0, 0);
    push(&q, &r[1], 1, 5);
    push(&q, &r[2], 2, -3);
    push(&q, &r[3], 3, 5);
    push(&q, &r[4], 4, 0);
    push(&q, &r[5], 5, 9);
    push(&q, &r[6], 6, -3);
    const int want[] = {5, 1, 3, 0, 4, 2, 6};
    int i = 0;
    for (dit_queue_item *it = dit_queue_peek(&q); it; it = dit_queue_next(it))
        ck_assert_int_eq(id_of(it), want[i++]);
    ck_assert_int_eq(i, 7);
    for (i = 0; i < 7; i++)
        ck_assert_int_eq(id_of(dit_queue_pop(&q)), want[i]);
}
END_TEST

START_TEST(remove_keeps_the_rest_in_order)
{
    dit_queue q;
    dit_queue_init(&q);
    rec r[4], stranger;
    for (int i = 0; i < 4; i++)
        push(&q, &r[i], i, i % 2);
    /* order: 1, 3, 0, 2 */
    ck_assert(dit_queue_remove(&q, &r[3].qi));
    ck_assert(!dit_queue_remove(&q, &r[3].qi));
    stranger.qi.priority = 0;
    stranger.qi.next = NULL;
    ck_assert(!dit_queue_remove(&q, &stranger.qi));
    ck_assert_int_eq(dit_queue_length(&q), 3);
    ck_assert(dit_queue_remove(&q, &r[1].qi)); /* the head */
    ck_assert_int_eq(id_of(dit_queue_peek(&q)), 0);
    ck_assert(dit_queue_remove(&q, &r[2].qi)); /* the tail */
    ck_assert_int_eq(id_of(dit_queue_pop(&q)), 0);
    ck_assert_ptr_null(dit_queue_pop(&q));
}
END_TEST

START_TEST(extreme_priorities_order)
{
    dit_queue q;
    dit_queue_init(&q);
    rec a, b, c;
    push(&q, &a, 0, -2147483647 - 1);
    push(&q, &b, 1, 2147483647);
    push(&q, &c, 2, 0);
    ck_assert_int_eq(id_of(dit_queue_pop(&q)), 1);
    ck_assert_int_eq(id_of(dit_queue_pop(&q)), 2);
    ck_assert_int_eq(id_of(dit_queue_pop(&q)), 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon_queue");
    TCase *tc = tcase_create("order");
    tcase_add_test(tc, empty_queue_pops_null);
    tcase_add_test(tc, equal_priorities_run_in_arrival_order);
    tcase_add_test(tc, higher_priority_runs_first_then_arrival);
    tcase_add_test(tc, remove_keeps_the_rest_in_order);
    tcase_add_test(tc, extreme_priorities_order);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
