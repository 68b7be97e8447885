/* A structure-aware mutator for protobuf-c messages: unpacks an input as
 * message type `desc`, changes one to four fields through the descriptor
 * (scalars to boundary or random values, strings and bytes replaced, cut or
 * grown, repeated fields grown or shrunk, sub-messages created, dropped or
 * changed in turn, oneof members switched) and packs it again. Byte-level
 * mutations seldom keep a message decodable; these reach the readers past
 * the unpack.
 *
 * Owner: stateless; the caller's buffers. */
#ifndef DIT_TESTS_FUZZ_PROTO_H
#define DIT_TESTS_FUZZ_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

/* Mutates the `size` bytes at data (capacity max_size) in place; returns the
 * new size, or 0 when the input does not unpack as desc or the result would
 * not fit (the caller mutates bytes instead). `seed` chooses everything. */
size_t dit_fuzz_proto_mutate(const ProtobufCMessageDescriptor *desc, uint8_t *data, size_t size,
                             size_t max_size, uint64_t seed);

#endif
