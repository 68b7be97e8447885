/* Writing what Generate returned: files replaced atomically, and the raw
 * tensor as a safetensors file written by hand (so that ditctl does not link
 * the compute core for one small writer). */
#ifndef DIT_CLIENT_DITCTL_OUTPUT_H
#define DIT_CLIENT_DITCTL_OUTPUT_H

#include <stddef.h>
#include <stdint.h>

#include "ditserve_v1_generation.pb-c.h"

/* Checks, before any work is asked for, that a file can be written at path:
 * its folder exists and is writable, and path is not a folder. Returns 0,
 * or -1 with a message in err. */
int ctl_check_output(const char *path, char *err, size_t errcap);

/* Writes data to path through a temporary file in the same folder and a
 * rename, so that readers never see half a file. Returns 0, or -1 with a
 * message in err. */
int ctl_write_file(const char *path, const uint8_t *data, size_t size, char *err, size_t errcap);

/* Writes the raw tensor of `res` (dtype and shape from the Result; shape
 * (3, height, width) when the daemon sent none) as tensor "image", or
 * "video" for a (3, frames, height, width) one, with the seed, request id
 * and frame rate as metadata. Checks that the bytes match the shape.
 * *written gets the file size. Returns 0, or -1 with a message in err. */
int ctl_write_raw(const char *path, const Ditserve__V1__Result *res, const char *request_id,
                  const uint8_t *data, size_t size, size_t *written, char *err, size_t errcap);

#endif
