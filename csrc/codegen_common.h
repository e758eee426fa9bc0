/* What the C and CUDA code generators share (internal to csrc/): a kernel's operands and their
 * strides over the iteration dims, dim coalescing, and the text of one element's computation.
 * Both targets define the same helper names in their preludes (af_bf16_load, af_exp, af_max,
 * ...), so the members' expressions are emitted once, here. */
#ifndef AOTFUSE_CODEGEN_COMMON_H
#define AOTFUSE_CODEGEN_COMMON_H

#include <stdint.h>

#include "aotfuse/codegen.h"
#include "aotfuse/fuse.h"
#include "aotfuse/ir.h"
#include "aotfuse/strbuf.h"

/* An operand of a kernel (inputs in plan order, then outputs): its strides over the iteration
 * dims, 0 where broadcast (inputs) or reduced (reduction outputs). */
typedef struct {
    int32_t value;
    af_dtype dtype;
    int64_t strides[AF_MAX_DIMS];
    int narrow_counter; /* a random node's seed whose counters all fit in 32 bits */
    int window_only;    /* an input only window members read (at their own indices): no plain load */
} af_cg_operand;

/* A group's iteration space after coalescing: size-1 dims dropped, neighbours merged where every
 * operand is contiguous across them. A group with window members has one more operand per dim
 * some window guards, or every dim longer than 1 in explicit frames (in dim order, after the outputs; no pointer): its stride is 1 on that dim
 * and 0 elsewhere, so its offset o<k> is the element's coordinate there (and no merge hides it). Reduction groups put kept dims first (cls 0), reduced dims
 * after (cls 1), and never merge across the two. */
typedef struct {
    int32_t nops;
    af_cg_operand *ops;               /* nops entries */
    int32_t nd;                       /* >= 1 */
    int64_t sizes[AF_MAX_DIMS];
    int64_t (*strides)[AF_MAX_DIMS];  /* [operand][dim] */
    int cls[AF_MAX_DIMS];
    int32_t n_kept;                   /* reduction groups: kept dims (the first n_kept) */
    int64_t numel, outer, inner;      /* reductions: outer = kept elements, inner = reduced */
    int column;                       /* a column reduction: one kept dim, the innermost (bias gradients) */
} af_cg_space;

/* Fills *sp for group grp (its operands, coalesced dims); frees with af_cg_space_free. */
int af_cg_space_new(const af_graph *g, const af_fusion_group *grp, af_cg_space *sp);
/* Whether every index the kernel forms (flat element indices, each operand's offsets) fits in 31
 * bits with room for a step: then the kernel's index math is 32-bit. */
int af_cg_narrow_index(const af_cg_space *sp);
void af_cg_space_free(af_cg_space *sp);
/* Whether grp has window members (then its kernels are scalar: no vector variant). */
int af_cg_has_window(const af_graph *g, const af_fusion_group *grp);
/* Whether grp loads a window's source under its guard (any window but box_fill, which has none, and a
 * crop, which guards no dim). */
int af_cg_has_guarded_load(const af_graph *g, const af_fusion_group *grp);
/* Whether grp's windows are evaluated in explicit frames (codegen_common.c): a window among the
 * shifted members (nested windows), or a view (remapped members). Then the kernel has a coordinate
 * operand for every iteration dim longer than 1. */
int af_cg_explicit(const af_graph *g, const af_fusion_group *grp);

const char *af_cg_ctype(af_dtype d);
/* Helpers both preludes include after defining AF_FN (a helper's declaration on the target):
 * af_max/af_min/af_maxd/af_mind (NaN-propagating), af_pow, and af_rand(seed, index), the
 * counter-based generator (Threefry-2x32-20). */
extern const char af_cg_helpers_text[];
void af_cg_emit_load(af_strbuf *sb, af_dtype d, const char *ptr, const char *off);
void af_cg_emit_store_value(af_strbuf *sb, af_dtype d, const char *v);
/* The members' element computation; with phases (from af_cg_phases), only phase `phase`'s
 * reductions and the pointwise members of phases up to it (earlier ones are recomputed). `modes`
 * is a set of flags: with AF_CG_NAN_FLAGS, amax/amin are a plain float comparison (the caller
 * declares float accumulators for them) plus an int nan<id> flag the caller declares and folds in
 * (so the loop can be an OpenMP max/min reduction); with AF_CG_FLOAT_SUMS, sums and means add into
 * float partials accf<id><acc_at> that the caller declares and flushes into the double acc<id>;
 * with AF_CG_FLOAT_ACC, every reduction accumulates into a float acc<id> (CUDA's threads: each
 * adds inner / threads terms before the warp combines them). */
#define AF_CG_NAN_FLAGS 1
#define AF_CG_FLOAT_SUMS 2
#define AF_CG_FLOAT_ACC 4
void af_cg_emit_members(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *indent, const char *acc_at,
                        const int32_t *phases, int32_t phase, int modes);
/* af_cg_emit_members for a phased kernel whose members flagged in `cached` (af_cg_phase_cache)
 * are kept in arrays c<id>[<at>]: stored in their own phase's pass, read back in later ones. `at`
 * indexes them by the element i: "i" for the C backend's per-row arrays, "i / 32" for a CUDA warp's
 * lane, whose elements are i = lane + 32 j. */
void af_cg_emit_members_cached(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *indent,
                               const char *acc_at, const int32_t *phases, int32_t phase, int modes, const uint8_t *cached,
                               const char *at);
/* Which pointwise members of a phased group to keep per row rather than evaluate again in a later
 * phase: transcendental ones (exp, log, erf, tanh, pow; with random_only, only the random numbers,
 * Threefry's 20 rounds) that a later pass needs, up to max_bytes of float arrays of `inner`
 * elements; not one that its own phase does not need (no reader there, not an output) and that one
 * later phase alone reads: that phase computes it. malloc'd, one flag per member (NULL when out of
 * memory). */
uint8_t *af_cg_phase_cache(const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int64_t inner, int64_t max_bytes,
                           int random_only);
/* Per member: its phase. A reduction is in its input's phase; a pointwise member one after the
 * row values of its group it reads (an epilogue, fuse.c) and in its members' phases otherwise. A
 * row member (pointwise over the group's reductions only, of their shape) is flagged AF_CG_ROW and
 * computed once per row after its phase's pass. malloc'd (NULL when out of memory); *max_phase is
 * the last phase. */
#define AF_CG_ROW (1 << 24)
int32_t *af_cg_phases(const af_graph *g, const af_fusion_group *grp, int32_t *max_phase);
int af_cg_is_reduction_value(const af_graph *g, int32_t v);
/* Whether a group needs phases (a later phase, or a row member): a kernel with epilogues. */
int af_cg_is_phased(const int32_t *phases, int32_t n_nodes, int32_t last_phase);
int af_cg_phase_has_reductions(const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int32_t ph);
/* Inside phase ph's pass, at offsets o<k>: stores the elementwise outputs computed in phase ph. */
void af_cg_emit_phase_stores(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                             const int32_t *phases, int32_t ph, const char *indent);
/* After phase ph's pass, accumulators combined: each of its reductions becomes a float v<id> (a
 * mean divided by `inner`; rounded as if stored; with nan_flags, NaN when its flag nan<id> is set)
 * that later phases read, stored at b<k> when an output; then the phase's row members, computed
 * once per row and stored at b<k> when outputs. With a guard, the stores run only `if (guard)`
 * (one thread of a row's several). */
void af_cg_emit_phase_end(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                          const int32_t *phases, int32_t ph, int64_t inner, int nan_flags, const char *indent, const char *guard);
/* Whether some member of grp divides by row value v (then its phase end emits `rc<v>`, v's
 * reciprocal, which the member multiplies by). */
int af_cg_has_row_reciprocal(const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int32_t v);
/* `T *restrict q<k> = (T *)p[k];` for every operand (not restrict: an in-place pair's two). */
void af_cg_emit_pointers(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops);
/* The input whose tensor output k may be written into (the runtime decides: the input dies at this
 * kernel and nobody else holds it; runtime.c's plan_reuse), or -1: one with output k's dtype and
 * layout, which is dense and spans the iteration shape, in a kernel without windows whose output k
 * is stored in its last pass (each element then read before it is written, by the same thread,
 * and never again). */
int32_t af_cg_in_place_input(const af_graph *g, const af_fusion_group *grp, int32_t k);
/* Whether operand k (an input or an output) is one of such an in-place pair: their pointers are not
 * restrict (they may address the same elements). */
int af_cg_may_alias(const af_graph *g, const af_fusion_group *grp, int32_t k);
/* `const float v<value> = q<k>[o<k>]` for every input k. */
void af_cg_emit_loads(af_strbuf *sb, const af_fusion_group *grp, const af_cg_operand *ops);
/* `q<k>[<off_prefix><k>] = v<v>` converted to the operand's dtype (a bf16 member's rounded value: its upper half). */
void af_cg_emit_store_at(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *indent, int32_t k,
                         af_dtype dtype, const char *off_prefix, int32_t v);
/* Loads inputs at o<k>, computes the members (af_cg_emit_members with `modes`), stores elementwise outputs at o<k>. */
void af_cg_emit_body(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops, const char *acc_at,
                     int modes);

/* A part of a pointwise kernel's inner loop, which runs over iteration dim `dim` (its coordinate is
 * the loop index; -1: over no guarded dim, the one part of the whole loop): coordinates lo <= i < hi;
 * or, with `row`, the rows whose coordinate of outer dim `dim` lies in [lo, hi). Its body (af_cg_emit_body_part) writes each window
 * guard's bound on a coordinate whose range over the part it decides as a constant (nothing where
 * it holds throughout, ` && 0` where it never does), so the parts between the guards' bounds have
 * no branch and vectorize. A bound it leaves as a comparison on `dim` adds its edges to cuts,
 * where the caller splits the loop further. */
#define AF_CG_MAX_CUTS 8
typedef struct {
    int32_t dim;
    int64_t lo, hi;
    int row;                      /* dim is one the row loop runs over, fixed along the inner loop (codegen_c.c, row parts) */
    int64_t cuts[AF_CG_MAX_CUTS]; /* out: coordinates of dim in (lo, hi) where a guard changes */
    int32_t n_cuts;
    int overflow;                 /* out: more cuts than fit */
    int32_t guarded_loads;        /* out: window sources left behind a comparison */
} af_cg_part;
void af_cg_emit_body_part(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops, af_cg_part *part);
/* Splits the flat index `var` over dims hi..lo (innermost first) and adds each coordinate times
 * each operand's stride to the offsets <prefix><k>. */
void af_cg_emit_unflatten(af_strbuf *sb, const char *indent, const char *itype, const char *var, const char *prefix, int32_t lo,
                          int32_t hi, const int64_t *sizes, int64_t (*strides)[AF_MAX_DIMS], int32_t nops);
/* Stores each finished reduction: row mode at base offsets b<k>; column mode (strides given) at
 * column c, accumulator acc<v>[c - c0]. */
void af_cg_emit_reduction_stores(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                                 int64_t count, int64_t (*column_strides)[AF_MAX_DIMS], const char *indent);
/* Accumulator initial value for reduction node n ("0.0", "-INFINITY", "INFINITY"). */
const char *af_cg_acc_init(const af_node *n);
/* `<ctype> acc<v> = <init>;` for every reduction of the group (ctype "double" or "float"). */
void af_cg_emit_acc_decls(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *ctype, const char *indent);


void af_cg_shared_free(af_cg_shared *s);

#endif
