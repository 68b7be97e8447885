/* Framing of ditd <-> ditworker messages: a 4-byte little-endian length,
 * then one packed ditserve.ipc.Envelope. Shared by the daemon (non-blocking,
 * fed from libuv reads) and the worker (blocking socket I/O).
 *
 * Owner: whoever holds the reader; not thread-safe. */
#ifndef DIT_PROTO_IPC_WIRE_H
#define DIT_PROTO_IPC_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ditserve_ipc_ipc.pb-c.h"

/* Frames above this are refused (a corrupt length, not a real message). */
#define DIT_IPC_MAX_FRAME ((size_t)512 << 20)
/* The largest result (JobDone.image) a worker sends: the frame less room for
 * the rest of the message. */
#define DIT_IPC_MAX_RESULT (DIT_IPC_MAX_FRAME - ((size_t)1 << 20))
/* The requests of one job (a batch's members together) at most, leaving
 * the rest of a frame to the job's other fields. */
#define DIT_IPC_MAX_REQUESTS (DIT_IPC_MAX_FRAME - ((size_t)1 << 20))
/* The members of one job (the request and Job.batch) a worker runs at most;
 * ditd's --max-batch stays within it. */
#define DIT_IPC_MAX_MEMBERS 64

/* Packs `env` into a malloc'ed frame (length prefix included). */
int dit_ipc_encode(const Ditserve__Ipc__Envelope *env, uint8_t **frame, size_t *len);

/* Incremental decoder over a byte stream. */
typedef struct dit_ipc_reader {
    uint8_t *buf;
    size_t len, cap;
} dit_ipc_reader;

void dit_ipc_reader_init(dit_ipc_reader *r);
void dit_ipc_reader_free(dit_ipc_reader *r);

/* Appends received bytes; 0 or -1 when out of memory. */
int dit_ipc_reader_feed(dit_ipc_reader *r, const void *data, size_t n);

/* Room for the next read to land in place, instead of in a buffer of its
 * own that dit_ipc_reader_feed would copy: at least `min` free bytes at the
 * end of the buffer, or, when the frame being received is longer, its
 * remaining bytes up to `max` more (the cap keeps a length prefix from an
 * unauthenticated peer from reserving memory it never sends). Sets *room
 * and *n; 0, or -1 when out of memory. Then dit_ipc_reader_commit with
 * what the read stored. */
int dit_ipc_reader_room(dit_ipc_reader *r, size_t min, size_t max, uint8_t **room, size_t *n);
void dit_ipc_reader_commit(dit_ipc_reader *r, size_t n);

/* Takes the next complete envelope: 1 with *out set (free it with
 * ditserve__ipc__envelope__free_unpacked(*out, NULL)), 0 when more bytes are
 * needed, -1 on a corrupt stream. */
int dit_ipc_reader_next(dit_ipc_reader *r, Ditserve__Ipc__Envelope **out);

/* Blocking helpers for the worker: write a whole frame, or read until one
 * envelope is complete. 0 on success, -1 on error or end of stream; the
 * write returns -2, having written nothing, when the envelope cannot be
 * encoded (over DIT_IPC_MAX_FRAME, or no memory for the frame). A JobDone
 * whose image is at least DIT_IPC_SPLIT_MIN bytes is written without
 * copying the image: the rest packed, the image after it as the message's
 * last field (the same message to any reader). */
#define DIT_IPC_SPLIT_MIN ((size_t)64 << 10)

/* Protobuf wire helpers for a length-delimited field (wire type 2) written
 * after the rest of its message, its bytes sent from where they lie: the
 * field's tag and length, at most DIT_PB_FIELD_HEAD_MAX bytes, into out;
 * returns how many (dit_pb_field_head_size: the same count alone). */
#define DIT_PB_FIELD_HEAD_MAX 15
size_t dit_pb_field_head(uint8_t *out, uint32_t field, uint64_t len);
size_t dit_pb_field_head_size(uint32_t field, uint64_t len);
int dit_ipc_write_fd(int fd, const Ditserve__Ipc__Envelope *env);
int dit_ipc_read_fd(int fd, dit_ipc_reader *r, Ditserve__Ipc__Envelope **out);

/* Non-blocking: reads what is available now and returns 1 with an envelope,
 * 0 when none is complete yet, -1 on error or end of stream. */
int dit_ipc_poll_fd(int fd, dit_ipc_reader *r, Ditserve__Ipc__Envelope **out);

#endif
