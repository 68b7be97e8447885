/* Fuzz targets: the code that reads bytes a client or a network peer
 * chose, fed arbitrary input, each run checking what must hold whatever
 * the input (no crash, no sanitizer report, a refusal for what is invalid,
 * the documented shape for what is accepted).
 *
 * A target is a setup (loads what it needs from the source tree), a run on
 * one input, and a teardown. The same target builds two ways:
 *   fuzz_driver.c     a main that runs a seed corpus and then a fixed
 *                     number of deterministic mutations of it (the unit
 *                     suite runs every target this way, under ASan and
 *                     UBSan in the sanitize build);
 *   fuzz_libfuzzer.c  libFuzzer's entry points, for coverage-guided runs
 *                     of any length (-Dfuzz=true with clang; tests/fuzz/README.md).
 *
 * Owner: the driver holds the context setup returns; runs are sequential. */
#ifndef DIT_TESTS_FUZZ_H
#define DIT_TESTS_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct dit_fuzz_target {
    const char *name;
    /* The source tree's root (for tests/data); the context, or NULL after
     * printing why. */
    void *(*setup)(const char *source_root);
    /* One input. A property that fails calls DIT_FUZZ_FAIL (abort).
     * Returns 0, or -1 for an input the first parser refused, which is not
     * worth mutating further (libFuzzer's meaning: not added to the corpus). */
    int (*run)(void *ctx, const uint8_t *data, size_t size);
    void (*teardown)(void *ctx);
    /* Optional: a mutation that knows the input's structure (a protobuf
     * message, say), used for half the mutations: mutates the size bytes at
     * data (capacity max_size) in place and returns the new size, or 0 to
     * leave this one to the byte-level mutations. `seed` chooses it all. */
    size_t (*mutate)(void *ctx, uint8_t *data, size_t size, size_t max_size, uint64_t seed);
} dit_fuzz_target;

/* Every target source defines this one constant. */
extern const dit_fuzz_target dit_fuzz_target_def;

/* A scratch file (dir false) or folder under $TMPDIR (else /tmp), named
 * fuzz-STEM-XXXXXX, its path written to path (cap bytes, 256 is enough):
 * the file's descriptor (0 for a folder), or -1 after printing why. The
 * target removes it in its teardown. */
int dit_fuzz_scratch(char *path, size_t cap, const char *stem, bool dir);

#define DIT_FUZZ_FAIL(...)                                                                         \
    do {                                                                                           \
        fprintf(stderr, "fuzz property failed at %s:%d: ", __FILE__, __LINE__);                    \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fputc('\n', stderr);                                                                       \
        abort();                                                                                   \
    } while (0)

#define DIT_FUZZ_REQUIRE(cond, ...)                                                                \
    do {                                                                                           \
        if (!(cond))                                                                               \
            DIT_FUZZ_FAIL(__VA_ARGS__);                                                            \
    } while (0)

#endif
