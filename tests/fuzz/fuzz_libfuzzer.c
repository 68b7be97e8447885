/* libFuzzer's entry points for a fuzz target (-Dfuzz=true, clang):
 * coverage-guided runs of any length, e.g.
 *   build-fuzz/tests/fuzz/fuzz_prompt -max_total_time=600 corpus-dir tests/fuzz/corpus/prompt
 * libFuzzer owns main and calls these two with no context argument, so the
 * target's context lives in the one variable below: set once by
 * LLVMFuzzerInitialize, read by every run, freed by the process's exit. */
#include <stdlib.h>

#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed);
size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);

static void *target_ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *root = getenv("DIT_SOURCE_ROOT");
    target_ctx = dit_fuzz_target_def.setup(root ? root : ".");
    if (!target_ctx)
        exit(1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    return dit_fuzz_target_def.run(target_ctx, data, size);
}

/* The target's own mutator for half the mutations (when it has one),
 * libFuzzer's byte-level ones for the rest. */
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed)
{
    if (dit_fuzz_target_def.mutate && (seed & 1)) {
        size_t n = dit_fuzz_target_def.mutate(target_ctx, data, size, max_size, seed);
        if (n)
            return n;
    }
    return LLVMFuzzerMutate(data, size, max_size);
}
