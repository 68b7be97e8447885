/* ditrun's shared pieces: the parsed command line, the per-rank entry points
 * of its commands, and the launcher that starts a mesh of rank processes.
 *
 * Owner: ditrun's main thread. */
#ifndef DIT_TOOLS_DITRUN_H
#define DIT_TOOLS_DITRUN_H

#include <stdbool.h>

#include "backend/backend.h"
#include "comm/comm.h"
#include "parallel/lora.h"
#include "parallel/mesh.h"
#include "pipelines/probe.h"

#define DITRUN_EXIT_USAGE 2
#define DITRUN_MAX_LORA 8
#define DITRUN_MAX_MEMBERS 16

/* One --member of a batched generate: the command line's request with
 * these fields changed (NULL, NaN, 0: unchanged). Strings point into text. */
typedef struct ditrun_member {
    char text[2048];
    const char *prompt, *prompt_2, *negative_prompt, *negative_prompt_2;
    bool has_seed;
    uint64_t seed;
    float guidance, true_cfg;
    int num_images;
    int leave; /* > 0: the member leaves the batch after this step (a test aid) */
} ditrun_member;

typedef enum ditrun_cmd {
    DITRUN_FORWARD,
    DITRUN_GENERATE,
} ditrun_cmd;

typedef struct ditrun_args {
    ditrun_cmd cmd;
    const char *model;
    const char *output;
    /* forward */
    const char *inputs;
    const char *compare;
    /* generate */
    dit_gen_params gen;
    const char *latents_path;
    const char *output_latents;
    /* --member: a batch of these requests in the same forwards (0: none). */
    ditrun_member members[DITRUN_MAX_MEMBERS];
    int n_members;
    /* both */
    dit_backend_kind backend;
    int threads, repeat;
    bool quiet;
    dit_parallel_config pc;
    /* LoRA adapters (--lora PATH[:SCALE]) attached to the transformer. */
    char lora_path[DITRUN_MAX_LORA][1024];
    float lora_scale[DITRUN_MAX_LORA];
    int n_lora;
    bool fuse_lora; /* merge them into the weights at load instead */
    double comm_timeout;
    int mesh_rank;        /* >= 0 in a rank process started by the launcher */
    const char *mesh_shm; /* the mesh's shared-memory name, in rank processes */
} ditrun_args;

/* One rank's work (or the whole run when the world size is 1). Exit codes
 * as ditrun's. */
int ditrun_forward_rank(const ditrun_args *a, int rank);
int ditrun_generate_rank(const ditrun_args *a, int rank);

/* generate, before any rank starts: probes the pipeline, fills the
 * request's defaults from it, prints its warnings (unless quiet) and checks
 * that the output's extension suits the result. 0, or the exit code. */
int ditrun_generate_prepare(ditrun_args *a);

/* Parses one --member spec, 'key=value;key=value' with keys prompt,
 * prompt_2, negative_prompt, negative_prompt_2, seed, guidance, true_cfg,
 * num_images and leave; 0, or -1 with the reason in err. */
int ditrun_member_parse(const char *spec, ditrun_member *m, char *err, size_t cap);

/* Checks what can be checked before any rank starts (layout against model
 * and request): 0, or the exit code to return. */
int ditrun_validate(const ditrun_args *a);

/* Creates the mesh, starts world_size rank processes of this program with
 * `argv` (which begins at the command name) plus the internal rank flags,
 * supervises them and reports the first failing rank. */
int ditrun_launch(const ditrun_args *a, int argc, char **argv);

/* In a rank process: joins the launcher's mesh and builds the groups. */
dit_status ditrun_join_mesh(const ditrun_args *a, int rank, dit_comm **world, dit_mesh **mesh,
                            dit_diag *diag);

/* Test aid read from the environment: DIT_FAULT_KILL_RANK=r and
 * DIT_FAULT_KILL_BLOCK=k make rank r kill itself with SIGKILL after
 * transformer block k (of its first forward pass). */
typedef struct ditrun_fault {
    int block;
} ditrun_fault;

bool ditrun_fault_for_rank(int rank, ditrun_fault *out);
dit_status ditrun_fault_block(void *ctx, int block, dit_diag *diag);

double ditrun_now_ms(void);

/* Loads a->lora_path[] against the model's LoRA sites and attaches them
 * with their scales (or, with a->fuse_lora, merges them into the weights
 * instead); *loras receives the adapters (a->n_lora of them) to
 * destroy after the model's last forward (after dit_lora_detach). */
dit_status ditrun_attach_loras(const ditrun_args *a, dit_backend *be, dit_lora_sites *sites,
                               dit_lora **loras, dit_diag *diag);

#endif
