/* Fusion: grouping a program's pointwise nodes, and the reductions they feed, into kernels.
 *
 * A group is a set of nodes with an op-table C expression, computed element by element over one
 * iteration shape (every pointwise member's output shape), plus reductions (sum, mean, amax,
 * amin) of values of that shape over one set of dims, accumulated in the same loop. Its inputs are tensors read by index arithmetic
 * (broadcast dims have stride 0) or scalar constants; its outputs are the members' values read
 * outside the group or returned by the graph. Values between members are never materialized.
 * The group runs where its last member stood; a group is closed to new members as soon as a node
 * outside it reads one of its values, which keeps the step order acyclic.
 *
 * Recomputed members: a reduction under other dims than its input's group (a column sum of a row
 * kernel's member) may list that group's pointwise members it depends on among its own nodes and
 * evaluate them again from their inputs (fuse.c, recompute_cone). Such a node belongs to the other
 * group (group_of_node); a group's inputs are the values no node of its list produces.
 *
 * Window members (af_fuse_window: padding) read their one source at shifted, guarded indices. A
 * source computed by a group of pointwise nodes and windows that nothing else reads (no value of
 * it read outside it but the source, by the window alone) is computed in the window's kernel
 * instead: those nodes become the window's shifted members, evaluated at the source's index inside
 * the window's guard (window_of), their inputs read at shifted offsets; a window among them is a
 * nested window, whose own shifted members keep theirs. A source that views such a group's value
 * x through a chain of views (each read once, laid out as ATen's rules say) takes the views in as
 * well (remapped members: window_of is the window for the views too): x is computed at the element
 * of its storage the source's element views, its coordinates unravelled from that offset. Both
 * generators then evaluate every window at explicit coordinates (codegen_common.c's frames).
 *
 * Every tensor a member touches lives on one device (type and index), CPU or CUDA: a group is
 * compiled by that device's code generator.
 * The plan is owned by the caller (af_fuse_plan_free).
 */
#ifndef AOTFUSE_FUSE_H
#define AOTFUSE_FUSE_H

#include <stdint.h>

#include "aotfuse/ir.h"

typedef struct {
    int32_t n_nodes;
    int32_t *nodes;    /* member node indices, in graph order (recomputed members included) */
    int32_t n_inputs;
    int32_t *inputs;   /* value ids read from outside (tensors) */
    int32_t n_outputs;
    int32_t *outputs;  /* member values that are materialized */
    int32_t last_node; /* where the group runs: after this node (its last member, or the last node of a
                        * group whose values it reads while that group still grew: fuse.c's deps) */
    int32_t iter_value; /* a value whose shape is the iteration shape */
    uint32_t reduce_mask; /* iteration dims the reductions reduce (bit d = dim d); 0 without reductions */
    int32_t n_reductions;
    af_device device;     /* where every member's tensors live (CPU: C kernel, CUDA: CUDA kernel) */
    int32_t *window_of;   /* per member (parallel to nodes): the window member whose source it computes
                           * (a shifted member: evaluated at that window's source index, inside its
                           * guard), or -1; NULL when the group has none */
} af_fusion_group;

typedef struct {
    int32_t n_groups;
    af_fusion_group *groups;
    int32_t *group_of_node; /* per node: its group, or -1 (an extern step) */
} af_fusion_plan;

#define AF_FUSE_ALL_DEVICES ((1u << AF_DEVICE_CPU) | (1u << AF_DEVICE_CUDA))

typedef struct {
    int32_t min_nodes;     /* smallest group worth a kernel (default 2; 1 also fuses lone nodes) */
    uint32_t device_types; /* bit per af_device_type that gets kernels; 0: every supported one */
    int no_shifted;        /* keep every window's source a kernel input (no shifted members) */
    int no_merge;          /* keep independent groups of one loop as kernels of their own */
} af_fuse_options;

/* Whether one node could be a group member: 1 pointwise (its op has an expression, its dtypes
 * and arguments are ones the code generators handle), 2 a supported reduction, 0 neither. A
 * reduction's reduced dims go in *mask (bit d = dim d of its input) when mask is not NULL. */
int af_fuse_node_ok(const af_graph *g, int32_t node);
int af_fuse_reduction_ok(const af_graph *g, int32_t node, uint32_t *mask);

/* A window member (`aten.constant_pad_nd(x, pad, value)`, what the lowering also makes of
 * `slice_backward`; `aten.slice_scatter(base, x, dim, start, end)` with step 1;
 * `aotfuse.box_scatter(base, x, starts)`, a slice on every dim; `aotfuse.box_fill(base, starts,
 * sizes, value)`, which has no source: the value inside the box, base[i] outside): element i of its
 * output is x[i - left] where that lies inside x, else the fill value (pad) or base[i] (scatter).
 * Its source x is a group input, or the value of its shifted members (never an ordinary member:
 * it iterates over its own, other shape); a base is an ordinary operand. A group with a window member has no reductions. guard_mask: the
 * dims whose coordinate must be tested (padded on either side); dims only cropped need none. */
typedef struct {
    int32_t source;               /* value id of x (-1: box_fill) */
    int32_t source_arg;           /* x's argument index (-1: box_fill) */
    int32_t base;                 /* value id of base, or -1 (a fill value) */
    int64_t left[AF_MAX_DIMS];    /* per output dim: left pad (negative: cropped) */
    int64_t size[AF_MAX_DIMS];    /* per output dim: x's size */
    uint32_t guard_mask;
    double value;                 /* the fill value (pad: outside x; box_fill: inside the box) */
} af_window;
/* 1 and *w filled when node is a window member the code generators take (af_fuse_node_ok is 1 for
 * it too), else 0. */
int af_fuse_window(const af_graph *g, int32_t node, af_window *w);

/* Plans the groups of g (verified). opts may be NULL. */
int af_fuse_plan_new(const af_graph *g, const af_fuse_options *opts, af_fusion_plan **out);
void af_fuse_plan_free(af_fusion_plan *plan); /* NULL allowed */

/* Whether every view node from root to v (a chain of views, each reading the one before) makes
 * the layout v's metadata says, by ATen's rule for that view given its input's metadata (sink.c);
 * a graph whose metadata was not traced from fake tensors may say otherwise (make_fx's real mode
 * drops a slice's storage offset). */
int af_views_as_declared(const af_graph *g, int32_t v, int32_t root);

/* Copies of views of pointwise values, computed from their sources (csrc/sink.c). A copy
 * clone(V(x)), V views and x a pointwise value of a few pointwise nodes over sources, reads x at
 * indices no kernel computing x can give it, so it runs alone and x is stored for it. The
 * rewritten graph computes it as those nodes over one as_strided view of each source (the element
 * x's element at that index came from; over a finer shape where a dim of the copy crosses dims of
 * x, then viewed back), which fuses like any pointwise chain, and drops the pointwise and view
 * nodes nothing reads any more. Sources are values whose every view link from their root makes
 * the layout the graph says (the runtime gives each root of an as_strided view its graph layout).
 * Passes repeat until none rewrites a copy (chains of copies collapse). A copy returned by the
 * graph is left alone, as is one whose nodes would not all be kernel members on device_types (a
 * bit per af_device_type, as af_fuse_options; 0: every supported one). *out is a new graph (the
 * caller's), or NULL when no copy qualifies; *n_sunk (may be NULL) counts the copies rewritten;
 * *origin (may be NULL; the caller frees it) gets, per value of *out, the value of g it stands for:
 * itself for what was copied, the source for a source's view, the copy for the recomputed copy
 * (over the finer shape, or viewed back), -1 for a recomputed intermediate.
 * With reads, a kernel member reading V(x) as a plain operand gets x's nodes over the sources'
 * views too, for itself alone, where x is then stored for no one and the kernels read no more
 * than storing and loading x did; a reader of a view crossing x's dims is computed over the finer
 * shape itself (its other operands viewed so) and viewed back, where that splits no kernel; and a
 * window member whose source is clone(u) reads u. The recomputed value stands for the view (a
 * reader over the finer shape, and its view back, for the reader's value).
 * reads is a mask: AF_SINK_VIEW_READS the reads above; AF_SINK_BROADCAST_READS a kernel member's
 * read of a pointwise value of fewer elements that broadcasts to its shape (a norm's weight
 * upcast to float), computed of cheap nodes from sources no kernel computes: the nodes are
 * recomputed over broadcast views of the sources for that reader, where the value is then
 * stored for no one (the value would otherwise be a kernel of its own). */
#define AF_SINK_VIEW_READS 1
#define AF_SINK_BROADCAST_READS 2
int af_sink_copies(const af_graph *g, uint32_t device_types, int reads, af_graph **out, int32_t *n_sunk, int32_t **origin);

#endif
