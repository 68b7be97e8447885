/* A small cache of captured backend graphs (CUDA graphs) of one repeated
 * computation, keyed by what the captured work depends on besides the
 * weights: shapes and every device address it reads or writes. A model's
 * per-step forward is the use: diffusion runs the same forward at the same
 * shapes and addresses for every step of a request.
 *
 * With the cache on, the first run at a key is eager (it picks GEMM
 * algorithms and sizes scratch), the second is captured and replayed,
 * later ones replay. The last DIT_GRAPH_CACHE_SLOTS keys are kept (least
 * recently used goes first: a server alternates between a handful of
 * request sizes). A failed capture falls back to eager runs for good, with
 * one line on stderr. Backends without graph ops always run eagerly.
 *
 * Keys are compared bytewise: callers memset them before filling, and use
 * types without padding.
 *
 * Owner: the model that holds it; one run at a time. */
#ifndef DIT_BACKEND_GRAPH_CACHE_H
#define DIT_BACKEND_GRAPH_CACHE_H

#include <stdbool.h>
#include <stddef.h>

#include "backend/backend.h"
#include "core/status.h"

#define DIT_GRAPH_CACHE_SLOTS 4
#define DIT_GRAPH_CACHE_KEY_MAX 512

typedef struct dit_graph_cache dit_graph_cache;

/* `what` names the computation in messages ("flux forward"). */
dit_status dit_graph_cache_create(dit_backend *be, size_t key_size, const char *what,
                                  dit_graph_cache **out, dit_diag *diag);
void dit_graph_cache_destroy(dit_graph_cache *c);

/* On or off (off: the default; off drops every graph). Either way clears
 * the broken state of an earlier failed capture. */
void dit_graph_cache_set_enabled(dit_graph_cache *c, bool on);

/* Whether a captured graph is held (for tests and benchmarks). */
bool dit_graph_cache_captured(const dit_graph_cache *c);

/* The computation: backend ops only, on device memory. */
typedef dit_status (*dit_graph_body_fn)(void *ctx, dit_diag *diag);

/* Runs body(ctx) for `key` (key_size bytes): eagerly, captured or
 * replayed as above. `eager` forces an eager run (host work in the middle
 * of the computation, such as comm hooks). */
dit_status dit_graph_cache_run(dit_graph_cache *c, const void *key, bool eager,
                               dit_graph_body_fn body, void *ctx, dit_diag *diag);

#endif
