/* The op table (csrc/ops.def): what the core knows about each ATen op.
 * Pure data; no allocation, no errors. */
#ifndef AOTFUSE_OPS_H
#define AOTFUSE_OPS_H

typedef enum {
    AF_KIND_EXTERN = 0, /* not understood by the core: always an extern ATen call */
    AF_KIND_POINTWISE,  /* elementwise, with broadcasting */
    AF_KIND_REDUCTION,  /* reduces over some dims */
    AF_KIND_VIEW,       /* a view: index arithmetic only */
    AF_KIND_RANDOM,     /* consumes the RNG: never recomputed with fresh randomness */
    AF_KIND_COMPUTE,    /* matmul, convolution, attention: expensive, never recomputed */
    AF_KIND_COUNT
} af_op_kind;

typedef enum {
    AF_OP_UNKNOWN = 0,
#define AF_OP(e, name, kind, expr, scalars) AF_OP_##e,
#include "../../csrc/ops.def"
#undef AF_OP
    AF_OP_COUNT
} af_op_id;

typedef enum {
    AF_SCALAR_OPMATH = 0, /* a scalar argument enters the computation in float, as given */
    AF_SCALAR_AS_TENSOR,  /* a scalar argument is first rounded to the tensor operand's dtype */
    AF_SCALAR_AS_TENSOR_CPU /* rounded so for CPU values, in float for CUDA ones: ATen's CPU add, sub and
                               rsub round a Python scalar to a bf16 or fp16 tensor's dtype first (a bf16
                               `a + 0.1` adds 0.10009765625; torch 2.13, every size), its CUDA kernels
                               are believed to take it in float (unchecked on a device) */
} af_scalar_rule;

typedef struct {
    const char *name; /* "aten::add" */
    af_op_kind kind;
    const char *c_expr; /* one element in float from $0 $1 $2; NULL if not fusible */
    af_scalar_rule scalars;
} af_op_info;

/* Looks up an op by its qualified name with or without overload ("aten::add.Tensor" and
 * "aten::add" both give AF_OP_ADD). Unknown names give AF_OP_UNKNOWN. */
af_op_id af_op_lookup(const char *qualified_name);

/* The table entry of an op id; AF_OP_UNKNOWN (and out-of-range ids) give the extern entry. */
const af_op_info *af_op_get(af_op_id id);

/* Whether an op's C expression is transcendental, or draws random numbers (af_rand: 20 rounds of
 * Threefry): worth a store and a load rather than a second evaluation (codegen's cached phases),
 * and not worth evaluating again per element of a broadcast (sink.c). */
int af_op_expensive(const af_op_info *info);

/* Whether an op's C expression calls a function that costs a CPU kernel far more than loading a
 * saved value: a libm call GCC does not vectorize (exp2f, tanf, atanf, erfcf: the loop runs scalar
 * whole, 3-14 ns an element), or the C prelude's sin and cos (vectorized, but 2 ns an element,
 * 6x af_exp; a value recomputed per element of a broadcast: Llama's rotary cos and sin, 3% of its
 * bf16 step). Not the prelude's af_exp, af_erf, af_tanh, af_log, af_log1p, af_expm1, ..., nor sqrt:
 * those cost about what exp does. Under AOTFUSE_VECTOR_LIBM=0 the prelude's log, log1p, log2, log10
 * and expm1 are libm's calls again, and count. */
int af_op_costly_call(const af_op_info *info);

/* 0 where AOTFUSE_VECTOR_LIBM=0: the C prelude's log, log1p, log2, log10, expm1, sin and cos call
 * libm (an A/B); 1 otherwise. Read when a program is generated or partitioned. */
int af_vector_libm(void);

/* "pointwise", "reduction", ... */
const char *af_op_kind_name(af_op_kind kind);

#endif
