#include "queue.h"

void dit_queue_init(dit_queue *q)
{
    q->head = NULL;
    q->length = 0;
}

void dit_queue_push(dit_queue *q, dit_queue_item *it)
{
    dit_queue_item **pp = &q->head;
    while (*pp && (*pp)->priority >= it->priority)
        pp = &(*pp)->next;
    it->next = *pp;
    *pp = it;
    q->length++;
}

dit_queue_item *dit_queue_pop(dit_queue *q)
{
    dit_queue_item *it = q->head;
    if (it) {
        q->head = it->next;
        it->next = NULL;
        q->length--;
    }
    return it;
}

dit_queue_item *dit_queue_peek(const dit_queue *q)
{
    return q->head;
}

bool dit_queue_remove(dit_queue *q, dit_queue_item *it)
{
    dit_queue_item **pp = &q->head;
    while (*pp && *pp != it)
        pp = &(*pp)->next;
    if (!*pp)
        return false;
    *pp = it->next;
    it->next = NULL;
    q->length--;
    return true;
}

int dit_queue_length(const dit_queue *q)
{
    return q->length;
}

dit_queue_item *dit_queue_next(const dit_queue_item *it)
{
    return it->next;
}
