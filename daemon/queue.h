/* The waiting requests, in the order they run: highest priority first, and
 * first come first served within a priority. An intrusive singly linked
 * list: the caller embeds a dit_queue_item in its own record (a job), so
 * the queue never allocates and never fails. The item is a public struct,
 * not an opaque one, for that reason alone; only these functions touch its
 * fields.
 *
 * Pushing is O(length) (the queue is short: --max-queue bounds it); popping
 * and peeking are O(1).
 *
 * Owner: the loop thread (dit_server holds the queue). */
#ifndef DIT_DAEMON_QUEUE_H
#define DIT_DAEMON_QUEUE_H

#include <stdbool.h>
#include <stddef.h>

typedef struct dit_queue_item {
    struct dit_queue_item *next;
    int priority; /* set by the caller before dit_queue_push; higher runs first */
} dit_queue_item;

typedef struct dit_queue {
    dit_queue_item *head;
    int length;
} dit_queue;

/* The record that embeds an item: DIT_QUEUE_ENTRY(it, job, qi). */
#define DIT_QUEUE_ENTRY(item, type, member)                                                        \
    ((type *)(void *)((char *)(item)-offsetof(type, member)))

void dit_queue_init(dit_queue *q);

/* Inserts it behind every item of the same or a higher priority (so equal
 * priorities keep their arrival order) and ahead of every lower one. */
void dit_queue_push(dit_queue *q, dit_queue_item *it);

/* The first item, removed; NULL when the queue is empty. */
dit_queue_item *dit_queue_pop(dit_queue *q);

/* The first item, left in place; NULL when empty. */
dit_queue_item *dit_queue_peek(const dit_queue *q);

/* Removes it from wherever it waits. False when it is not in q. */
bool dit_queue_remove(dit_queue *q, dit_queue_item *it);

/* Items waiting. */
int dit_queue_length(const dit_queue *q);

/* In-order walk: for (it = dit_queue_peek(q); it; it = dit_queue_next(it)). */
dit_queue_item *dit_queue_next(const dit_queue_item *it);

#endif
