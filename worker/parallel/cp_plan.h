/* A model's context-parallel plan as data, read by generic code: which
 * forward inputs split on which dim, which every rank takes whole, and
 * which dim of the output the ranks gather (diffusers' `_cp_plan`).
 *
 * Split inputs belong to a sequence (`seq`, an index into the model's
 * dit_parallel_req seq_names): inputs of one sequence split alike, by
 * torch.tensor_split over the context-parallel size, so rank i holds chunk
 * i of every sequence. Attention runs over the concatenation of a rank's
 * chunks of all sequences, so a rank's attention length is their sum.
 *
 * A model may split a sequence it forms inside its forward (video tokens
 * after a patch embedding): its input is a TOKENS rule, whole on every
 * rank; the class reports the sequence's length (dit_model_class.seq_lens),
 * the model reads its token range from the layout (dit_model_hooks
 * .cp_layout) and computes only those tokens, and its output gathers on the
 * token dim before the class's cp_finish makes the final output.
 *
 * Inputs travel to the model as backend tensors, or (`host`) as host
 * arrays a model reads on the CPU (timesteps, RoPE position ids); a host
 * input splits on dim 0 only, so its chunk stays contiguous.
 *
 * Inputs whose dim 0 is the forward's batch say so (`batch`): CFG
 * parallelism (runtime/runner.h) gives each CFG rank group half of them;
 * the others (position ids) go whole to both groups. The output's dim 0 is
 * always the batch.
 *
 * Owner: plans are static tables; the functions keep no state. */
#ifndef DIT_PARALLEL_CP_PLAN_H
#define DIT_PARALLEL_CP_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/arena.h"
#include "backend/backend.h"
#include "comm/comm.h"
#include "core/named_tensors.h"
#include "core/status.h"

typedef enum dit_cp_kind {
    DIT_CP_SPLIT,     /* this rank's chunk of dim `dim` */
    DIT_CP_REPLICATE, /* whole on every rank */
    DIT_CP_GATHER,    /* (output) chunks of dim `dim` gathered in rank order */
    DIT_CP_TOKENS,    /* whole on every rank; the model splits sequence `seq`
                       * it forms from it */
} dit_cp_kind;

typedef struct dit_cp_rule {
    const char *input; /* a forward argument's diffusers name; the output's for GATHER */
    dit_cp_kind kind;
    int dim;
    int seq;    /* SPLIT and GATHER: the sequence it belongs to */
    bool host;  /* passed as a host array, not uploaded */
    bool batch; /* dim 0 is the batch */
} dit_cp_rule;

/* How one forward's sequences divide over `cp_size` ranks. */
#define DIT_CP_MAX_RANKS 64
#define DIT_CP_MAX_SEQS 4
typedef struct dit_cp_layout {
    int cp_size, cp_rank, n_seqs;
    int64_t seq_len[DIT_CP_MAX_SEQS];               /* whole lengths */
    int64_t off[DIT_CP_MAX_SEQS][DIT_CP_MAX_RANKS]; /* chunk offsets */
    int64_t len[DIT_CP_MAX_SEQS][DIT_CP_MAX_RANKS]; /* chunk lengths */
    int64_t attn_len[DIT_CP_MAX_RANKS];             /* each rank's attention length */
} dit_cp_layout;

/* Reads each sequence's whole length from the inputs (the first split input
 * of it present in `in`) and splits them. Missing sequences are errors that
 * name the input. */
dit_status dit_cp_plan_layout(const dit_cp_rule *plan, int n_rules, int n_seqs,
                              const dit_named_tensors *in, int cp_size, int cp_rank,
                              dit_cp_layout *out, dit_diag *diag);

/* Splits sequences of the given whole lengths (a class's seq_lens). */
dit_status dit_cp_layout_from_lengths(int n_seqs, const int64_t *seq_len, int cp_size, int cp_rank,
                                      dit_cp_layout *out, dit_diag *diag);

/* This rank's inputs: backend tensors from `arena` holding the rank's chunk
 * (or the whole) of every non-host input, host views for host inputs.
 * Inputs the plan does not name are errors (a model must say how each one
 * travels). `local` is filled in the plan's order. */
dit_status dit_cp_plan_scatter(const dit_cp_rule *plan, int n_rules, const dit_cp_layout *lay,
                               dit_backend *be, dit_arena *arena, const dit_named_tensors *in,
                               dit_named_tensors *local, dit_diag *diag);

/* The output rule of the plan (NULL if none). */
const dit_cp_rule *dit_cp_plan_output(const dit_cp_rule *plan, int n_rules);

/* The shape of this rank's output, given the whole output's shape. */
dit_tensor dit_cp_plan_local_output_shape(const dit_cp_rule *plan, int n_rules,
                                          const dit_cp_layout *lay, const dit_tensor *whole);

/* Gathers every rank's `local` output (backend, contiguous) into `whole`
 * (host) over `cpc` (NULL when alone). `gathered_bytes` (may be NULL) adds
 * this rank's contribution. Scratch from `arena`. */
dit_status dit_cp_plan_gather(const dit_cp_rule *plan, int n_rules, const dit_cp_layout *lay,
                              dit_backend *be, dit_arena *arena, dit_comm *cpc,
                              const dit_tensor *local, const dit_tensor *whole,
                              uint64_t *gathered_bytes, dit_diag *diag);

#endif
