/* Partitioning a joint forward+backward graph into a forward and a backward program.
 *
 * The joint graph's inputs each have a role (primal, tangent, constant, RNG seed); its first
 * num_fwd_outputs outputs are the forward's results, the rest the backward's (gradients).
 *
 * af_partition_min_cut: min-cut rematerialization. Every value v becomes two flow vertices
 * v_in -> v_out whose capacity is what saving v costs (its bytes, biased toward values used
 * close to the backward, doubled when fusion would otherwise never materialize v; nothing for a
 * parameter or buffer, which lives anyway, as torch's treat_parameters_as_free_to_save). Edges to
 * users are infinite; primal inputs and values that must not be recomputed (compute-heavy,
 * random, extern, big reductions, values materialized in the backward anyway, values far from
 * their backward use) hang off the source; what the backward computes from tangents hangs off
 * the sink. The minimum cut is the set of saved values: the cheapest set from which the
 * backward can be computed, recomputing the rest. "Cheap to recompute" comes from the op table.
 *
 * af_partition_default: save every forward value the backward reads, recompute nothing.
 *
 * Both fill an af_partition the caller frees with af_partition_free.
 */
#ifndef AOTFUSE_PARTITION_H
#define AOTFUSE_PARTITION_H

#include <stdint.h>

#include "aotfuse/ir.h"

typedef enum {
    AF_ROLE_PRIMAL = 0,  /* a forward input (parameter, buffer or user input) */
    AF_ROLE_TANGENT,     /* an incoming gradient: available in the backward only */
    AF_ROLE_CONSTANT,    /* a tensor constant: available everywhere, never saved */
    AF_ROLE_FWD_SEED,    /* forward RNG seed/offset: forward only */
    AF_ROLE_BWD_SEED,    /* backward RNG seed/offset: backward only */
    AF_ROLE_PARAM,       /* a primal that outlives the step (parameter, buffer): free to save */
    AF_ROLE_COUNT
} af_input_role;

/* What activation checkpointing asks of a node (torch.utils.checkpoint's regions: the "recompute"
 * tags of the joint graph). A node to recompute is never saved: the backward runs it again from
 * what is saved before it, whatever it costs (a matmul too); a node to save is never recomputed. */
typedef enum {
    AF_POLICY_NONE = 0,      /* the partitioner decides */
    AF_POLICY_RECOMPUTE = 1, /* inside a checkpointed region */
    AF_POLICY_SAVE = 2,      /* a region's output read by a later region, or marked to save */
} af_node_policy;

enum {
    AF_BAN_MATERIALIZED_NONE = 0,
    AF_BAN_MATERIALIZED_ALL = 1,    /* functorch's rule: such a value is saved */
    AF_BAN_MATERIALIZED_RANDOM = 2, /* saved where its recompute would draw random numbers again */
};

typedef struct {
    int64_t max_dist_from_bw;     /* ban recomputing values further than this from the backward (default 1000) */
    int32_t reduction_ratio;      /* ban recomputing ops whose output is this many times smaller than their inputs (4) */
    int32_t ban_materialized_bw;  /* values the backward materializes anyway (a matmul's operand): recomputed
                                     never (AF_BAN_MATERIALIZED_ALL), only where recomputing draws no
                                     random numbers (AF_BAN_MATERIALIZED_RANDOM, the default) or where
                                     the cut prefers (AF_BAN_MATERIALIZED_NONE) */
    int32_t ban_chained_random;   /* ban recomputing values that need two or more random nodes
                                     (aotfuse::rng_uniform) recomputed with them (1) */
    int32_t ban_chained_materialized; /* under AF_BAN_MATERIALIZED_RANDOM, also ban recomputing a
                                     value the backward materializes anyway whose recompute would
                                     make another such value, at least a quarter its size, first
                                     (1: a residual stream of pointwise adds is saved every other
                                     layer, not rebuilt whole at the backward's start) */
    int32_t ban_scalar_calls;     /* ban recomputing a CPU value whose op calls a costly function
                                     (af_op_costly_call: a libm call GCC does not vectorize, tan,
                                     atan, ..., or the prelude's sin and cos; 1): the kernel
                                     recomputing it ran scalar whole, or 6x exp's time, for every
                                     layer that needed it (Llama's rotary cos and sin in each
                                     layer's backward) */
    const uint8_t *node_policy;   /* NULL, or one af_node_policy per node (activation checkpointing) */
    double memory_budget;         /* 1 (default): the cut above. Below 1, compute nodes (matmuls,
                                     convolutions, attention; not ones marked to save) may be
                                     recomputed too, the fewest and cheapest that bring
                                     the saved activations to S_min + budget x (S_max - S_min) bytes:
                                     S_max the cut with the bans, S_min with all of them lifted (0: as
                                     little as anything recomputable allows) */
} af_partition_options;

typedef struct {
    int32_t n_saved;
    int32_t *saved;         /* value ids the forward saves for the backward, in graph order */
    int64_t saved_bytes;    /* their total bytes */
    int64_t cut_value;      /* weighted cut (min-cut only; 0 for the default partition) */
    uint8_t *in_forward;    /* per node: the forward program runs it */
    uint8_t *in_backward;   /* per node: the backward program runs it */
    int32_t n_backward_order;
    int32_t *backward_order; /* backward nodes in run order: recomputation just before first use */
    int32_t n_recomputed;    /* nodes in both programs */
} af_partition;

/* The defaults above. */
af_partition_options af_partition_default_options(void);

/* roles: one per graph input. opts may be NULL (defaults). */
int af_partition_min_cut(const af_graph *joint, const uint8_t *roles, int32_t num_fwd_outputs,
                         const af_partition_options *opts, af_partition **out);
int af_partition_default(const af_graph *joint, const uint8_t *roles, int32_t num_fwd_outputs,
                         af_partition **out);
/* The default partition, except that nodes to recompute (node_policy, NULL allowed) are not saved:
 * the backward runs them again from the values before them, which are saved. */
int af_partition_default_policy(const af_graph *joint, const uint8_t *roles, int32_t num_fwd_outputs,
                                const uint8_t *node_policy, af_partition **out);

void af_partition_free(af_partition *p); /* NULL allowed */

/* Checks that p is a valid split of joint: the backward's nodes read only saved values,
 * tangents, backward seeds, constants and values computed earlier in the backward order; the
 * forward's nodes read only inputs available in the forward and earlier forward values; every
 * forward output is computed by the forward and every backward output by the backward or saved.
 * AF_OK or AF_ERR_INVALID with the first violation. */
int af_partition_check(const af_graph *joint, const uint8_t *roles, int32_t num_fwd_outputs,
                       const af_partition *p);

#endif
