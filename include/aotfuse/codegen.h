/* Code generation: one C11 translation unit per program, one function per fusion group.
 *
 *   void af_kernel_<i>(char *const *p)
 *
 * p holds the data pointers of the group's inputs (plan order) then its outputs. Shapes and
 * strides are compile-time constants (a program is compiled for one input signature), so the C
 * compiler folds the index arithmetic; dims that are contiguous for every operand are merged,
 * outer loops run under OpenMP, inner loops are plain and vectorizable. fp16/bf16 are loaded and
 * stored as 16-bit and computed in float. The source also defines `af_kernel_count`. Kernels that
 * differ only in node ids and dropout streams (a model's layers) are wrappers around one shared
 * body, af_body_<j>(p, streams) (codegen_common.h, af_cg_share).
 */
#ifndef AOTFUSE_CODEGEN_H
#define AOTFUSE_CODEGEN_H

#include "aotfuse/fuse.h"
#include "aotfuse/ir.h"

typedef void (*af_kernel_fn)(char *const *ptrs);

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
