/* The runtime: runs a graph as a flat list of steps.
 *
 * A program owns its graph, its fusion plan and compiled module, and a list of steps: an extern
 * call through the bridge per unfused node, a fused kernel per group (at its last member's place).
 * Views make no ATen call: one read only by kernels is folded into them (they read its root at an
 * offset, with its strides); others are torch reinterpretations, checked against ATen's view on
 * the first run.
 * Each intermediate is released right after the last step that reads it, so peak memory is what
 * the program needs, not what the graph holds; values inside a kernel never exist. A kernel output
 * or an out= extern result may instead take the tensor of an intermediate dead by then (buffer
 * reuse, planned so that the program's peak stays where it was).
 * Before a kernel runs, its inputs' layouts are checked against what it was compiled for; on a
 * mismatch that call runs the group's nodes as extern calls instead (counted, never wrong).
 * CUDA kernels launch on torch's current stream of their device, read once per run; their outputs
 * and workspaces come from torch's allocator like every other tensor.
 * Needs the GIL (the bridge does).
 */
#ifndef AOTFUSE_RUNTIME_H
#define AOTFUSE_RUNTIME_H

#include "aotfuse/bridge.h"
#include "aotfuse/ir.h"

typedef struct af_program af_program;

typedef struct {
    int fuse;               /* plan fused kernels and compile them */
    int32_t min_group;      /* smallest group worth a kernel (default 2) */
    uint32_t device_types;  /* bit per af_device_type whose tensors get kernels (C for CPU, CUDA
                               through NVRTC); 0: both. A graph on two CUDA devices gets no CUDA kernels. */
    int no_reuse;           /* every kernel output a fresh allocation (default: buffer reuse, below) */
    int no_sink;            /* with fuse: keep copies of views of pointwise values as they are
                               (default: computed from their sources, af_sink_copies in fuse.h) */
    int no_shifted;         /* with fuse: every window's source a kernel input (af_fuse_options) */
    int no_sink_reads;      /* with fuse and the copies rewritten: keep kernel members' reads of
                               such views as they are (default: rewritten too, af_sink_copies) */
    int no_sink_broadcasts; /* with fuse and the copies rewritten: keep kernel members' reads of
                               smaller pointwise values broadcast to their shape as they are
                               (default: recomputed by the reader, AF_SINK_BROADCAST_READS) */
    int no_merge;           /* with fuse: independent groups of one loop stay separate kernels
                               (default: merged, af_fuse_options) */
    int lazy_jit;           /* with fuse: generate the kernels now, compile and load them at the
                               first run (af_program_kernels_loaded says which; cache_hit is 0 until then) */
    int no_templates;       /* with fuse: compile every C kernel body here, and offer none to later
                               programs (default: call bodies earlier programs loaded, templates.h) */
    int64_t huge_pages_min; /* CPU tensors of at least this many bytes that the program allocates
                               (kernel outputs, and extern results through their out= overloads)
                               get transparent huge pages before their first touch (hugepages.h);
                               0: none */
} af_program_options;

/* Verifies g, plans it and resolves its steps. opts may be NULL (no fusion). On success the
 * program owns g (freed with it); on failure g is still the caller's. */
int af_program_new(af_graph *g, const af_program_options *opts, af_program **out);

/* Fusion facts: kernels compiled, kernel calls that fell back to externs, whether the module came
 * from the disk cache, the generated source (NULL without kernels). */
int32_t af_program_num_kernels(const af_program *p);
int64_t af_program_kernel_fallbacks(const af_program *p);
int af_program_cache_hit(const af_program *p);
int af_program_kernels_loaded(const af_program *p); /* compiled and loaded (or none to load); 0 before a lazy_jit program's first run */
/* Compiles and loads a lazy_jit program's kernels now (nothing where they are loaded): a caller that
 * can run the graph another way where they cannot be built asks before the first run, which would
 * consume its inputs. */
int af_program_load_kernels(af_program *p);
const char *af_program_source(const af_program *p);
/* Kernel templates (templates.h): C kernel bodies this program calls from earlier programs'
 * modules (nothing compiled for them), and bodies it compiles with some literals read from af_n
 * (templates for later shapes); the text it compiles (NULL: none; af_program_source when nothing
 * was found or lifted). */
int32_t af_program_bodies_reused(const af_program *p);
int32_t af_program_bodies_lifted(const af_program *p);
const char *af_program_compiled_source(const af_program *p);
const char *af_program_cuda_source(const af_program *p); /* NULL without CUDA kernels */
int32_t af_program_num_steps(const af_program *p);
int32_t af_program_copies_sunk(const af_program *p); /* copies and reads computed from their sources (no_sink) */
/* Buffer reuse: a kernel output may take the tensor of an intermediate whose storage died at an
 * earlier step (it and every view of it read for the last time; no output, input, or argument of
 * an aliasing extern), where keeping it until then leaves the program's peak bytes as they were:
 * no allocation then (on the CPU, no fresh pages). The planned count, and the times a donor was
 * found held elsewhere at run time (released instead: a fresh allocation). */
int32_t af_program_buffer_reuses(const af_program *p);
int64_t af_program_reuses_refused(const af_program *p);
int64_t af_program_reuses_taken(const af_program *p); /* results that took their donor, over all runs */
int64_t af_program_huge_advised(const af_program *p); /* tensors given huge pages (huge_pages_min), over all runs */
/* Planned bytes per run: results taking a donor's tensor; intermediates allocated fresh (kernel
 * outputs and extern results on storages of their own that are not program outputs, nor touched by
 * an aliasing op, and take no donor). */
int64_t af_program_reused_bytes(const af_program *p);
int64_t af_program_fresh_bytes(const af_program *p);
/* The value whose tensor `value` takes, or -1. */
int32_t af_program_donor(const af_program *p, int32_t value);
int32_t af_program_node_group(const af_program *p, int32_t node); /* its fusion group, or -1 */
/* How a node runs: "kernel" (a fused kernel's member), "aten" (an ATen call), "folded" (a view
 * only kernels read: nothing runs, they read its root with its strides), "view" (a view made
 * without ATen's dispatcher, once its first run matched the graph's layout; one that did not
 * becomes "aten") or "alias" (from the second run: a checked view only such views read, or one
 * with its root's layout, t(t(x)); nothing is made, its readers reinterpret the root, a plain
 * output returns the root's tensor). NULL out of range. */
const char *af_program_node_how(const af_program *p, int32_t node);

void af_program_free(af_program *p); /* NULL allowed */

const af_graph *af_program_graph(const af_program *p);

/* Profiling: when on, each step's host time is accumulated over runs, the release of the values
 * it read last included (CUDA steps: launch time only). af_program_profile gives step `step`'s node (extern) or group (kernel) and its total
 * nanoseconds (-1 when off or out of range). Turning it off clears the totals. */
int af_program_set_profiling(af_program *p, int enabled);
int64_t af_program_profile(const af_program *p, int32_t step, int32_t *node, int32_t *group);
int64_t af_program_profiled_runs(const af_program *p);

/* Graph outputs from index `first` on are plain values (activations saved for backward,
 * gradients) whose aliasing nobody tracks: views among them may be made without ATen too.
 * Earlier outputs (by default all) are the caller's, whose views stay ATen's. */
void af_program_set_plain_outputs(af_program *p, int32_t first);

/* Whether af_program_run checks each input against the graph's input metadata (default on). */
void af_program_set_check_inputs(af_program *p, int enabled);

/* Runs the program: `inputs` (borrowed, one per graph input), results into `outputs` (new
 * references, one per graph output). On error every reference taken is released. */
int af_program_run(af_program *p, af_obj *const *inputs, int32_t n_inputs, af_obj **outputs);

/* The same, but the program takes over the n_inputs references (released in every case, each
 * right after its last use), so an input the caller no longer holds (an activation saved for
 * backward) is freed mid-run instead of at the end. */
int af_program_run_owned(af_program *p, af_obj *const *inputs, int32_t n_inputs, af_obj **outputs);

#endif
