/* The OpenAI-compatible API's request bodies read into GenerateRequests:
 * POST /v1/images/generations (a JSON object) and POST /v1/videos (a JSON
 * object, or a form's fields as a JSON object of strings), with OpenAI's
 * error shape (status, param, code, message) for what is refused. Every
 * byte is the client's: lengths and ranges are bounded here, a refusal's
 * message quotes only field names fit to echo (letters, digits, '_') and
 * adapter names that passed their check, and the server's own validation
 * (dit_server_submit) still follows.
 *
 * No I/O, no threads, no randomness: the caller passes the random value a
 * request without a seed gets, so the same body always reads the same way
 * (the fuzz target `openai` relies on it).
 *
 * Owner: the caller owns what a parse returns (dit_openai_*_clear). */
#ifndef DIT_DAEMON_OPENAI_H
#define DIT_DAEMON_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "ditserve_v1_generation.pb-c.h"
#include "serve/request.h" /* DIT_GEN_MAX_IMAGES, the request limits */

/* Images one images request may ask for: `n` is GenerateRequest.num_images,
 * one batched generation (diffusers' num_images_per_prompt), so the
 * pipelines' limit applies (OpenAI's own is 10). */
#define DIT_OPENAI_MAX_N DIT_GEN_MAX_IMAGES
/* Seeds a video request takes: 0 to DIT_OPENAI_MAX_SEED - 1, the integers
 * a JSON number (a double, in JavaScript too) holds with both neighbours
 * distinct (2^53 + 1 reads as 2^53). */
#define DIT_OPENAI_MAX_SEED ((uint64_t)1 << 53)
/* Seeds an images request takes: 0 to DIT_OPENAI_MAX_SEED - 11 (room once
 * left for seed + k of n = 10 one-image jobs; kept so that the accepted
 * range stays the same). */
#define DIT_OPENAI_IMAGES_SEED_SPAN (DIT_OPENAI_MAX_SEED - 10)
/* Longest clip `seconds` may ask for (the server's limits apply too). */
#define DIT_OPENAI_MAX_SECONDS 600
/* Most frames a video request asks for, as num_frames or as seconds at its
 * rate (the server's limits apply too). */
#define DIT_OPENAI_MAX_FRAMES 100000

/* A refusal in OpenAI's error shape. param and code are static strings
 * (param NULL when no one field is to blame). The parsers' own messages
 * are printable ASCII; http.c also fills one with the server's. */
typedef struct dit_openai_error {
    unsigned status; /* HTTP status; 0 while nothing failed */
    const char *param;
    const char *code;
    char msg[512];
} dit_openai_error;

/* Fills e and returns false (so that `return dit_openai_fail(...)` refuses).
 * A message longer than e->msg is cut at a UTF-8 character boundary, so
 * that well-formed text stays well-formed (a JSON string must be). */
bool dit_openai_fail(dit_openai_error *e, unsigned status, const char *param, const char *code,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Copies the string src into dst (cap > 0 bytes, NUL included), cut where
 * it must be at a UTF-8 character boundary, as dit_openai_fail does: for
 * the server's messages, which an error or a Video object quotes. */
void dit_openai_copy_text(char *dst, size_t cap, const char *src);

/* s when it is fit to quote in a refusal (1 to 64 letters, digits and
 * '_'), else a description of it. */
const char *dit_openai_echo_name(const char *s);

/* What the served model fills in for fields a request leaves out. */
typedef struct dit_openai_defaults {
    const char *model_name; /* the Video object's model when none is named */
    int width, height;      /* "size": "auto", and a video's size when none is given */
    /* A video model's frames and rate, and the step num_frames - 1 is a
     * multiple of (for `seconds`). */
    int num_frames, fps, frame_step;
} dit_openai_defaults;

/* An images request: one job of num_images = n. */
typedef struct dit_openai_images {
    Ditserve__V1__GenerateRequest *req;
    int n;
    bool stream;
} dit_openai_images;

/* The JSON body of POST /v1/images/generations. The body must be UTF-8
 * with no NUL byte and no \u0000 escape. A request without "seed" gets
 * random_seed % DIT_OPENAI_IMAGES_SEED_SPAN. True with out filled, or
 * false with e filled and out empty. */
bool dit_openai_parse_images(const dit_openai_defaults *d, const char *body, size_t len,
                             uint64_t random_seed, dit_openai_images *out, dit_openai_error *e);

void dit_openai_images_clear(dit_openai_images *im);

/* A /v1/videos job: its request and what its Video object describes. */
typedef struct dit_openai_video {
    Ditserve__V1__GenerateRequest *req;
    char *model, *prompt; /* model: the one named, else d->model_name */
    int width, height, num_frames, fps;
    uint64_t seed;
} dit_openai_video;

/* A POST /v1/videos body already read into root: a JSON body's object, or
 * with form true a form's fields as an object of strings (numbers are then
 * read from their text; "loras" holds its array as JSON text). A string
 * read as text must be UTF-8 (checked here too). A request
 * without "seed" gets random_seed % DIT_OPENAI_MAX_SEED. True with out
 * filled, or false with e filled and out empty. */
bool dit_openai_parse_video(const dit_openai_defaults *d, const cJSON *root, bool form,
                            uint64_t random_seed, dit_openai_video *out, dit_openai_error *e);

/* The same for a JSON body's bytes (UTF-8, no NUL, no \u0000). */
bool dit_openai_parse_video_json(const dit_openai_defaults *d, const char *body, size_t len,
                                 uint64_t random_seed, dit_openai_video *out, dit_openai_error *e);

void dit_openai_video_clear(dit_openai_video *v);

#endif
