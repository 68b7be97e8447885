/* What identifies a file's bytes on its filesystem, as stat says it:
 * device, inode, size and modification time. Processes that read "the same
 * file" by its path compare ids to know they read the same bytes: a file
 * replaced by rename has another inode, one rewritten in place another
 * modification time or size. An all-zero id is unknown and equals nothing.
 *
 * Owner: whoever holds the value (plain data, no resources). */
#ifndef DIT_CORE_FILE_ID_H
#define DIT_CORE_FILE_ID_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

typedef struct dit_file_id {
    uint64_t dev, ino;
    int64_t size;
    int64_t mtime_ns; /* since the epoch */
} dit_file_id;

void dit_file_id_from_stat(const struct stat *sb, dit_file_id *out);
/* The id of what `path` names now (stat, links followed); false, and an
 * unknown id, when it cannot be read. */
bool dit_file_id_of(const char *path, dit_file_id *out);
bool dit_file_id_known(const dit_file_id *id);
/* Both known and the same. */
bool dit_file_id_equal(const dit_file_id *a, const dit_file_id *b);

#endif
