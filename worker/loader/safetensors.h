/* safetensors files: read through mmap, with every header field checked
 * before anything is dereferenced, and written for outputs.
 *
 * Format: 8-byte little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
 *    ..., "__metadata__": {"k": "v"}}
 * then the data buffer; offsets are relative to the buffer start.
 *
 * A dit_st_set is what a diffusers model folder holds: one file
 * (`<base>.safetensors`) or a sharded checkpoint (`<base>.safetensors.index.json`
 * with a weight_map naming the shard of each tensor).
 *
 * Every error names the file, and the tensor where there is one.
 *
 * Owner: the thread that opened it; read-only afterwards, so views into the
 * mapping may be shared with other threads while the file stays open. */
#ifndef DIT_LOADER_SAFETENSORS_H
#define DIT_LOADER_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/file_id.h"
#include "core/status.h"
#include "core/tensor.h"

typedef struct dit_st_file dit_st_file;
typedef struct dit_st_set dit_st_set;

/* `view` points into the read-only mapping: never write through it. A scalar
 * (shape []) has ndim 0 and one element. The data may be misaligned for its
 * dtype (odd offsets are legal), so read it with memcpy, not typed loads. */
typedef struct dit_st_entry {
    const char *name;
    const char *file; /* path of the file holding it */
    dit_tensor view;  /* host view into the mapping, contiguous */
} dit_st_entry;

/* Opens and validates one file, mapped: a file truncated while open makes
 * reads of its mapping fault (SIGBUS), so only for files the operator
 * controls (checkpoints). */
dit_status dit_st_file_open(const char *path, dit_st_file **out, dit_diag *diag);
/* The same, but the file is read into memory (at most max_bytes when
 * nonzero, else DIT_ERR_UNSUPPORTED) and closed: whatever happens to the
 * file afterwards, the entries stay valid. A FIFO or device in its place is
 * refused without blocking. */
dit_status dit_st_file_read(const char *path, uint64_t max_bytes, dit_st_file **out,
                            dit_diag *diag);
void dit_st_file_close(dit_st_file *f);
/* The file as the descriptor it was read or mapped from said, at open. */
dit_file_id dit_st_file_id(const dit_st_file *f);
size_t dit_st_file_count(const dit_st_file *f);
/* Entries are sorted by name. */
const dit_st_entry *dit_st_file_at(const dit_st_file *f, size_t i);
const dit_st_entry *dit_st_file_find(const dit_st_file *f, const char *name);
/* Value of a "__metadata__" key, or NULL. */
const char *dit_st_file_metadata(const dit_st_file *f, const char *key);

/* Opens `<dir>/<base>.safetensors`, or else `<dir>/<base>.safetensors.index.json`
 * and every shard it names. */
dit_status dit_st_set_open_dir(const char *dir, const char *base, dit_st_set **out, dit_diag *diag);
/* Opens a single .safetensors file or an .index.json by path. */
dit_status dit_st_set_open_path(const char *path, dit_st_set **out, dit_diag *diag);
void dit_st_set_close(dit_st_set *s);
size_t dit_st_set_count(const dit_st_set *s);
/* Entries across all shards, sorted by name. */
const dit_st_entry *dit_st_set_at(const dit_st_set *s, size_t i);
const dit_st_entry *dit_st_set_find(const dit_st_set *s, const char *name);

/* FP8 checkpoints store a weight as F8_E4M3 next to a scale tensor (often
 * "<module>.weight_scale", f32, shape [] or [1]); the weight means
 * f32(fp8) * scale. These read any dtype, FP8 or not. */

/* The value of a one-element tensor (shape [], [1], [1, 1], ...) as f32;
 * DIT_ERR_FORMAT naming the file and tensor for any other shape. */
dit_status dit_st_entry_scalar(const dit_st_entry *e, float *out, dit_diag *diag);

/* Converts every element of `e` into `dst`, dense row-major dtype `dt`, of
 * `dst_bytes` (at least numel * dit_dtype_size(dt)): dst = dt(f32(e) * s),
 * the product in f32 and rounded once. `scale` is NULL (s = 1: the plain,
 * exact-where-representable conversion), a one-element tensor (per-tensor
 * scale) or one with ne[0] elements of `e`, e.g. (N) or (N, 1) for an (N, K)
 * weight (one scale per output channel). Bad scale shapes and non-finite
 * scales are DIT_ERR_FORMAT, naming the file. */
dit_status dit_st_entry_convert(const dit_st_entry *e, const dit_st_entry *scale, dit_dtype dt,
                                void *dst, size_t dst_bytes, dit_diag *diag);

/* Writes tensors (host views, any strides; written contiguous in their own
 * dtype) to `path`, replacing it atomically (write to a temp name, rename). */
typedef struct dit_st_write_item {
    const char *name;
    const dit_tensor *tensor;
} dit_st_write_item;

dit_status dit_st_write(const char *path, const dit_st_write_item *items, size_t n, dit_diag *diag);

#endif
