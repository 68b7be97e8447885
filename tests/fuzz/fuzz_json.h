/* A structure-aware mutator for JSON documents (tokenizer files, model
 * configs): parses the bytes with cJSON, changes one to three nodes (drops
 * one, repeats an array element, or replaces a value by another of its
 * kind or of another kind: boundary numbers, the names and strings these
 * files use, null, booleans, empty containers), and prints it again. An
 * object member keeps its key.
 *
 * Owner: stateless; the caller's buffer. */
#ifndef DIT_TESTS_FUZZ_JSON_H
#define DIT_TESTS_FUZZ_JSON_H

#include <stddef.h>
#include <stdint.h>

/* Mutates the size bytes at data (capacity max_size) in place; the new
 * size, or 0 when they are not JSON or the result would not fit. */
size_t dit_fuzz_json_mutate(uint8_t *data, size_t size, size_t max_size, uint64_t seed);

#endif
