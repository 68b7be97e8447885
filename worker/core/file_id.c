#include "core/file_id.h"

#include <string.h>

void dit_file_id_from_stat(const struct stat *sb, dit_file_id *out)
{
    out->dev = (uint64_t)sb->st_dev;
    out->ino = (uint64_t)sb->st_ino;
    out->size = (int64_t)sb->st_size;
    out->mtime_ns = (int64_t)sb->st_mtim.tv_sec * 1000000000 + (int64_t)sb->st_mtim.tv_nsec;
}

bool dit_file_id_of(const char *path, dit_file_id *out)
{
    memset(out, 0, sizeof *out);
    struct stat sb;
    if (!path || stat(path, &sb) != 0)
        return false;
    dit_file_id_from_stat(&sb, out);
    return true;
}

bool dit_file_id_known(const dit_file_id *id)
{
    return id->dev || id->ino || id->size || id->mtime_ns;
}

bool dit_file_id_equal(const dit_file_id *a, const dit_file_id *b)
{
    return dit_file_id_known(a) && a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime_ns == b->mtime_ns;
}
