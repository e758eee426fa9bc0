/* Code generation: one C11 translation unit per program, one function per fusion group.
 *
 *   void af_kernel_<i>(char *const *p)
 *
 * p holds the data pointers of the group's inputs (plan order) then its outputs. Shapes and
 * strides are constants in the text (a program is compiled for one input signature), so the C
 * compiler folds the index arithmetic; dims that are contiguous for every operand are merged,
 * outer loops run under OpenMP, inner loops are plain and vectorizable. fp16/bf16 are loaded and
 * stored as 16-bit and computed in float. The source also defines `af_kernel_count`. Each kernel
 * is a wrapper around a body,
 *
 *   void af_body_<j>(char *const *p, const uint64_t *af_s, const int64_t *af_n, int af_num_threads)
 *
 * which kernels that differ only in node ids and dropout streams (a model's layers) share
 * (af_cg_share). A body may also take some of its integer literals (sizes, strides, counts) from
 * af_n instead of its text (af_c_render): then programs for other shapes whose kernels differ from
 * it only in those values call the body already compiled (templates.h).
 */
#ifndef AOTFUSE_CODEGEN_H
#define AOTFUSE_CODEGEN_H

#include "aotfuse/fuse.h"
#include "aotfuse/ir.h"

typedef void (*af_kernel_fn)(char *const *ptrs);
typedef void (*af_body_fn)(char *const *ptrs, const uint64_t *streams, const int64_t *sizes, int num_threads);

/* Writes the C source for every group of plan into *source (malloc'd; the caller frees it). */
int af_codegen_c(const af_graph *g, const af_fusion_plan *plan, char **source);

/* CUDA C for the plan's CUDA groups: one NVRTC translation unit, extern "C" __global__ kernels.
 *
 *   af_kernel_<i>(const T0 *q0, ..., T *qn)   inputs then outputs, as for C
 *   af_kernel_<i>_v                           pointwise, VEC elements per thread with 16-byte
 *                                             (or narrower) vector loads; launched when every
 *                                             pointer is 16-byte aligned
 *   af_kernel_<i>_f(ws, q...)                 column and split-row reductions: the second,
 *                                             finishing pass
 *
 * Pointwise kernels are grid-stride loops; row reductions give each row (kept index) one warp, or
 * one block for long rows, with warp-shuffle and shared-memory combining in double; column
 * reductions (innermost dim kept: bias gradients) write per-chunk partials to a workspace that a
 * second kernel sums in a fixed order, so results never depend on scheduling (no atomics). Too few
 * long rows to fill the device (a full reduction is one row) split each row into chunks the same
 * way: a block per (row, chunk), then the finishing pass. A group whose kernels would be an earlier
 * group's but for node ids and dropout streams emits none: launch[i].body names the group whose
 * kernels it launches, with launch[i].streams as unsigned long long parameters after the operands. */
/* A kernel's dropout streams passed as arguments (codegen_common.h, af_cg_share): at most this many. */
#define AF_MAX_KERNEL_STREAMS 8

/* A kernel's text (as an emitter wrote it for group `index`) rewritten so that kernels can share
 * it (af_cg_share, codegen_common.c): its dropouts' streams are arguments (C: af_s[j], the kernel
 * becoming af_body_<index>; CUDA: by-value parameters af_s0, af_s1, ... appended to every
 * signature). The key is the text with every local named by node id (v<id>, acc<id>, s<id>_<dim>,
 * sh<id>, ...) renamed by its order of first appearance, comments left out, and every liftable
 * integer literal (plain decimal, outside preprocessor lines, array lengths and case labels) a
 * '#', its value in lits and its offset in text in lit_at: two kernels with one key and the same
 * lits compute the same function of their operands and streams; with one key and other lits,
 * the same function of their operands, streams and those values. More than AF_MAX_KERNEL_STREAMS
 * distinct streams stay constants (then only kernels with the same ones share). */
typedef struct {
    char *key, *text;
    uint64_t hash;
    int32_t n_streams;
    uint64_t streams[AF_MAX_KERNEL_STREAMS];
    int32_t n_lits;
    int64_t *lits;
    size_t *lit_at;
} af_cg_shared;
int af_cg_share(const char *text, int32_t index, int cuda, af_cg_shared *out);
int af_cg_same_key(const af_cg_shared *a, const af_cg_shared *b);
/* Whether a and b are one kernel but for the values of their liftable literals. */
int af_cg_same_skeleton(const af_cg_shared *a, const af_cg_shared *b);
void af_cg_shared_free(af_cg_shared *s);

/* A plan's C kernels before they are written out: distinct bodies, and per group the body it
 * calls (af_c_kernels_new). af_c_render writes a translation unit: the prelude, the bodies not
 * skipped (skip[b]), each with the literals flagged in lift[b] (when not NULL) read from af_n,
 * and a wrapper af_kernel_<i> for every group whose body it holds (passing the group's streams
 * and, where its body lifts literals, their values). */
typedef struct {
    int32_t n_groups, n_bodies;
    af_cg_shared *bodies;
    int32_t *body_group; /* per body: the group whose text it is (symbol af_body_<group>) */
    int32_t *body_of;    /* per group: its body, -1 where it is not a C kernel */
    int32_t *n_streams;  /* per group: its dropout streams (af_s) */
    uint64_t (*streams)[AF_MAX_KERNEL_STREAMS];
} af_c_kernels;
int af_c_kernels_new(const af_graph *g, const af_fusion_plan *plan, af_c_kernels **out);
void af_c_kernels_free(af_c_kernels *k);
int af_c_render(const af_c_kernels *k, const uint8_t *skip, const uint8_t *const *lift, char **source);

typedef enum { AF_CUDA_NONE = 0, AF_CUDA_POINTWISE, AF_CUDA_ROWS, AF_CUDA_COLUMNS, AF_CUDA_SPLIT_ROWS } af_cuda_kind;

typedef struct {
    af_cuda_kind kind;     /* AF_CUDA_NONE: not a CUDA group, or nothing to do (0 elements) */
    int32_t threads;       /* per block */
    int64_t blocks;        /* enough to cover the work once; the runtime may cap it (grid-stride loops) */
    int64_t vec_blocks;    /* > 0: af_kernel_<i>_v exists and needs this many blocks */
    int32_t split;         /* two passes (columns, split rows): chunks (grid.y of the first pass) */
    int64_t finish_blocks; /* two passes: blocks of the finishing pass (256 threads) */
    int64_t workspace;     /* two passes: bytes of double partials the passes share */
    int32_t body;          /* the group whose kernels these are: an earlier one with the same code, or this one */
    int32_t n_streams;     /* dropout streams, passed after the operands as unsigned long long parameters */
    uint64_t streams[AF_MAX_KERNEL_STREAMS];
} af_cuda_launch;

/* Writes CUDA C for the plan's CUDA groups (others are skipped) into *source and fills launch[i]
 * for every group (caller-allocated, plan->n_groups entries). sm_count sizes the column split. */
int af_codegen_cuda(const af_graph *g, const af_fusion_plan *plan, int sm_count, char **source, af_cuda_launch *launch);

#endif
