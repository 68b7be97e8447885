/* A job's results put together from its ranks' JobDone messages.
 *
 * A mesh decodes and encodes a job's images on several ranks
 * (Setup.decode_on_every_rank): rank 0's JobDone lists the job's members
 * (JobDone.batch), each entry naming the rank that holds each of the
 * member's images (image_ranks; none: `rank` holds them all), and each of
 * those ranks' messages has an entry for the member with its own images of
 * it, in image order. This module turns rank 0's entries into the members'
 * whole results, so that what the server reads is one entry per member as
 * if one rank had made it.
 *
 * Also the wire form of a result's chunk events (dit_chunk_event_head).
 *
 * No I/O and no loop: plain messages in, the same messages out.
 * Owner: the supervisor, on the loop thread. */
#ifndef DIT_DAEMON_RESULTS_H
#define DIT_DAEMON_RESULTS_H

#include <stdbool.h>
#include <stddef.h>

#include "ditserve_ipc_ipc.pb-c.h"
#include "ditserve_v1_generation.pb-c.h"

/* The most images one entry may name (a request's num_images is at most
 * 8; anything past this is a malformed message). */
#define DIT_RESULTS_MAX_IMAGES 64

/* Puts each member's result into rank 0's entries. done[r]: rank r's
 * JobDone, NULL where none was kept (a rank that decoded nothing need not
 * have sent entries); done[0] must have entries. done_ms[r]: when each
 * rank's message came (any clock, ms).
 *
 * Afterwards done[0]->batch[k] is member k's result: a failed image's
 * entry when any rank holding one of its images failed it (the first such
 * image's); else the entry of the rank holding image 0, with every image
 * in image order in `image` and their sizes in `image_bytes`, and the
 * longest of its ranks' vae_ms and encode_ms (they ran at once). Entries
 * move between the messages, so each message still frees what it holds
 * (protobuf-c's free_unpacked with the default allocator: the joined
 * buffers are malloc'ed). Each result's timings->batch_others_ms grows by
 * the wait from its last rank's message to the last message of all. A job
 * whose entries hold no images at all (a warm-up) is left as it is.
 *
 * Returns false, with why (a line for the log), when a rank named is out
 * of range or its message is missing or does not match; the messages are
 * then left in a state only fit to be freed. */
bool dit_results_merge(Ditserve__Ipc__JobDone *const *done, int n_ranks, const double *done_ms,
                       char *why, size_t cap);

/* A result's bytes go to gRPC from where the worker's message holds them,
 * not packed into a copy: the head of a GenerateEvent carrying one
 * ResultChunk (`request_id`; `offset` within image `image_index`) whose
 * `data`, len bytes, follows the head on the wire as the chunk's last field.
 * Head and data make the same message, to any protobuf reader, as the event
 * packed whole. Writes at most dit_chunk_event_head_max(request_id) bytes
 * into out; returns how many. */
size_t dit_chunk_event_head_max(const char *request_id);
size_t dit_chunk_event_head(const char *request_id, int64_t offset, int32_t image_index, size_t len,
                            uint8_t *out);

#endif
