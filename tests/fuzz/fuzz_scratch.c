/* Scratch files and folders for the targets that must hand the code under
 * test a path (fuzz.h). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz.h"

int dit_fuzz_scratch(char *path, size_t cap, const char *stem, bool dir)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(path, cap, "%.200s/fuzz-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", stem);
    int fd = dir ? (mkdtemp(path) ? 0 : -1) : mkstemp(path);
    if (fd < 0)
        perror(path);
    return fd;
}
