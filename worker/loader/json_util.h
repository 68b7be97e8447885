/* Small helpers over cJSON for reading config files: load a file, and typed
 * field getters whose errors name the file and the key. cJSON types stay
 * inside the loader and config modules.
 *
 * Owner: the caller; the cJSON tree is freed with cJSON_Delete. */
#ifndef DIT_LOADER_JSON_UTIL_H
#define DIT_LOADER_JSON_UTIL_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/status.h"

/* Config files are small; anything larger is refused rather than read. */
#define DIT_JSON_MAX_BYTES (64u << 20)

/* Reads and parses `path`; the root must be an object. */
dit_status dit_json_load_file(const char *path, cJSON **out, dit_diag *diag);

/* Integer field. Missing or null -> `def` when !required, else an error.
 * Non-integers and values outside [lo, hi] are errors. */
dit_status dit_json_get_int(const cJSON *obj, const char *key, const char *path, bool required,
                            int64_t def, int64_t lo, int64_t hi, int64_t *out, dit_diag *diag);

dit_status dit_json_get_bool(const cJSON *obj, const char *key, const char *path, bool required,
                             bool def, bool *out, dit_diag *diag);

dit_status dit_json_get_double(const cJSON *obj, const char *key, const char *path, bool required,
                               double def, double *out, dit_diag *diag);

/* Array of integers with at most `cap` elements; *n receives the count. */
dit_status dit_json_get_int_array(const cJSON *obj, const char *key, const char *path, int64_t *out,
                                  int cap, int *n, dit_diag *diag);

/* String field; the returned pointer lives as long as the tree. NULL with
 * DIT_OK when missing and !required. */
dit_status dit_json_get_string(const cJSON *obj, const char *key, const char *path, bool required,
                               const char **out, dit_diag *diag);

#endif
