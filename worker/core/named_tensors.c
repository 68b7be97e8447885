#include "core/named_tensors.h"

#include <string.h>

dit_status dit_named_tensors_set(dit_named_tensors *s, const char *name, const dit_tensor *t)
{
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->v[i].name, name) == 0) {
            s->v[i].t = *t;
            return DIT_OK;
        }
    if (s->n >= DIT_NAMED_TENSORS_MAX)
        return DIT_ERR_INTERNAL;
    s->v[s->n].name = name;
    s->v[s->n].t = *t;
    s->n++;
    return DIT_OK;
}

const dit_tensor *dit_named_tensors_get(const dit_named_tensors *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->v[i].name, name) == 0)
            return &s->v[i].t;
    return NULL;
}
