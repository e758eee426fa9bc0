/* Code generation: one C11 translation unit per program, one function per fusion group.
 *
 *   void af_kernel_<i>(char *const *p)
 *
 * p holds the data pointers of the group's inputs (plan order) then its outputs. Shapes and
 * strides are compile-time constants (a program is compiled for one input signature), so the C
 * compiler folds the index arithmetic; dims that are contiguous for every operand are merged,
 * outer loops run under OpenMP, inner loops are plain and vectorizable. fp16/bf16 are loaded and
 * stored as 16-bit and computed in float. The source also defines `af_kernel_count`.
 */
#ifndef AOTFUSE_CODEGEN_H
#define AOTFUSE_CODEGEN_H

#include "aotfuse/fuse.h"
#include "aotfuse/ir.h"

typedef void (*af_kernel_fn)(char *const *ptrs);

/* Writes the C source for every group of plan into *source (malloc'd; the caller frees it). */
int af_codegen_c(const af_graph *g, const af_fusion_plan *plan, char **source);

#endif
