/* Command-line helpers shared by ditctl, ditrun, ditd and ditworker: "did
 * you mean" for mistyped options (their parsers all keep their long options
 * in getopt_long tables), the check that an output file can be written
 * before the work that produces it starts, and the allocator settings a
 * long-running process starts with. Self-contained (no other part of
 * the core), so that ditctl can link it without the compute core.
 *
 * Owner: none; pure functions. */
#ifndef DIT_CORE_CLI_UTIL_H
#define DIT_CORE_CLI_UTIL_H

#include <getopt.h>
#include <stddef.h>

/* Edit distance between a and b: insertions, deletions, substitutions and
 * swaps of two neighbouring characters each cost 1 (optimal string
 * alignment). Strings longer than 63 bytes compare as far apart. */
int dit_suggest_distance(const char *a, const char *b);

/* The long option of `opts` (terminated by a zero entry) nearest to the
 * option the user wrote (`arg`, with or without leading dashes and with any
 * "=value" ignored), or NULL when none is close enough to be a likely typo
 * (distance at most 2, and less than half the name's length). */
const char *dit_suggest_option(const char *arg, const struct option *opts);

/* Like dit_suggest_option over a NULL-terminated list of words (command
 * names). */
const char *dit_suggest_word(const char *arg, const char *const *words);

/* Checks that a file can be written at path: its folder exists and is
 * writable (writers make a temporary file beside the target and rename it),
 * and path is not a folder. Returns 0, or -1 with a message in err
 * ("cannot write PATH: the folder DIR does not exist", ...). */
int dit_check_output_path(const char *path, char *err, size_t errcap);

/* Sets the C library's allocator up for processes that pass results of
 * up to tens of MiB through freshly allocated buffers on every request (ditd,
 * ditworker, ditctl): such buffers stay in the heap (below 32 MiB) and up to
 * 64 MiB of free heap top is kept, so a result's bytes do not cost a page
 * fault per page each time they are written. Call it first thing in main;
 * it does nothing outside glibc. */
void dit_tune_malloc(void);

#endif
