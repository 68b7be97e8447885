/* Prometheus metrics: counters, gauges and histograms the loop thread
 * updates, served as Prometheus text on their own HTTP port by
 * libmicrohttpd's thread. A mutex guards the values; rendering copies
 * nothing the loop owns.
 *
 * Owner: main creates and frees it; the server module updates it. */
#ifndef DIT_DAEMON_METRICS_H
#define DIT_DAEMON_METRICS_H

#include <stdint.h>

#include "core/status.h"

typedef struct dit_metrics dit_metrics;

/* Listens on 127.0.0.1 when `loopback_only`, else every address (IPv6 and
 * IPv4 where the host has IPv6); port 0 picks a free one, written to
 * *bound_port. `model` is the label value of every series (escaped here);
 * n_meshes: the meshes ditd starts (--replicas), each with its series from
 * the first scrape. */
dit_status dit_metrics_start(int port, int loopback_only, const char *model, int n_meshes,
                             dit_metrics **out, int *bound_port, dit_diag *diag);
void dit_metrics_stop(dit_metrics *m);

/* A request ended with this gRPC status name (OK, INVALID_ARGUMENT, ...);
 * queue_s and total_s < 0 when it never ran. */
void dit_metrics_request(dit_metrics *m, const char *status, double queue_s, double total_s);
void dit_metrics_step(dit_metrics *m, double step_s);
void dit_metrics_gauges(dit_metrics *m, int queued, int running);
/* Mesh `mesh` (0 .. 15; ditd --replicas) changed state. */
void dit_metrics_mesh(dit_metrics *m, int mesh, const char *state, int64_t restarts);
/* Mesh `mesh` finished a generation that ran `seconds`. */
void dit_metrics_mesh_busy(dit_metrics *m, int mesh, double seconds);
/* A batched generation of `requests` requests started. */
void dit_metrics_batch(dit_metrics *m, int requests);
/* A worker's memory report (gpu_total 0: no GPU, its GPU gauges are left
 * out). */
void dit_metrics_worker_memory(dit_metrics *m, int mesh, int rank, int64_t rss, int64_t gpu_used,
                               int64_t gpu_total, int64_t gpu_peak);

/* LoRA adapters on the mesh (rank 0's report): files loaded, uses served
 * from the cache and evictions since the last call (added to counters),
 * and what the cache holds now. */
void dit_metrics_lora(dit_metrics *m, int64_t loads, int64_t hits, int64_t evictions,
                      int64_t cached, int64_t cached_bytes);

/* The text a scrape returns (malloc'ed); for tests and the HTTP handler. */
char *dit_metrics_render(dit_metrics *m);

#endif
