/* The runtime: a flat list of steps (extern calls and fused kernels), intermediates released
 * after the last step that reads them. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include "aotfuse/runtime.h"
#include "codegen_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "aotfuse/codegen.h"
#include "aotfuse/fuse.h"
#include "aotfuse/hugepages.h"
#include "aotfuse/jit.h"
#include "aotfuse/jit_cuda.h"
#include "aotfuse/templates.h"

typedef struct {
    int32_t node;  /* extern step: the node; kernel step: -1 */
    int32_t group; /* kernel step: the fusion group; extern step: -1 */
} af_step;

struct af_program {
    af_graph *graph;
    af_extern **externs;    /* one per node: extern steps, and the fallback of kernel steps */
    af_step *steps;
    int32_t n_steps;
    int32_t *release;       /* value ids released after each step, concatenated */
    int32_t *release_start; /* n_steps + 1 offsets into release */
    int32_t *input_ids;
    const af_tensor_meta **input_metas;
    const char **input_names;
    af_obj **values;        /* scratch: one slot per value, NULL between runs */
    af_fusion_plan *plan;   /* NULL without fusion */
    af_jit_module *module;
    /* C kernels: bodies (af_c_kernels), each compiled into module or called from another program's
     * (templates.h: ext_module[b] retained, NULL for the own module's) */
    af_c_kernels *ck;
    af_body_fn *body_fns;    /* per body */
    af_jit_module **ext_module; /* per body */
    uint8_t **lift;          /* per body: literals read from af_n (NULL: none) */
    char *compile_source;    /* what module is compiled from: the bodies not found elsewhere (NULL: source) */
    int32_t n_reused, n_lifted, n_compiled;
    int use_templates;
    const af_tensor_meta **kernel_metas; /* scratch: operand metas of the widest group */
    af_obj **kernel_objs;   /* scratch */
    af_obj **empty_args;    /* per value: torch.empty_strided's arguments for a kernel output, built once */
    af_obj **view_args;     /* per value: _reinterpret_tensor's arguments for a view step's value, built once */
    void **kernel_ptrs;     /* scratch */
    void **kernel_params;   /* scratch: CUDA launch arguments (pointers into kernel_ptrs) */
    char *source;
    /* CUDA kernels (groups on a CUDA device) */
    af_cuda_module *cuda_module;
    af_cuda_launch *launch;  /* per group */
    void **cuda_fns;         /* per group: main kernel, _v variant, _f finishing pass (3 slots each) */
    char *cuda_source;
    int32_t cuda_device;
    int cuda_sm_count;
    void *stream;            /* torch's current stream, read once per run */
    int have_stream;
    int num_threads;         /* the C kernels' threads: torch.get_num_threads(), read once per run */
    int have_threads;
    /* Views (op-table kind view) cost no ATen dispatch: a view read only by kernels (or by such
     * views) is folded, never made: the kernel reads its root value at a byte offset with the
     * view's strides. Other views are made by torch's _reinterpret_tensor (no dispatcher) once the
     * first run has checked ATen's view against the graph's layout for it. */
    int32_t *fold_root;      /* per value: the non-folded value a folded view reads, or -1 */
    int64_t *fold_delta;     /* per value: its data's byte offset from the root's */
    int8_t *view_state;      /* per node: 0 a view step not yet checked, 1 checked (no dispatch), -1 ATen */
    int8_t *fold_state;      /* per group: 2 no folded inputs; else 0 not yet checked, 1 checked, -1 falls back */
    /* per group: 1 once a run (with checked program inputs) found every operand with the graph's
     * layout; later runs with checked inputs read data pointers only. Layouts are functions of
     * the program inputs' layouts, which those runs check. Never for a group with a 0-dim
     * operand: a 0-dim program input may come on the CPU for a CUDA program. */
    int8_t *operands_checked;
    /* Held views (planned after the first run, when every view step is checked): a checked view
     * step whose value only other checked view steps read, or whose layout is its root's, makes
     * nothing; its slot holds its root's tensor, and the views reading it reinterpret that root. */
    int8_t *held;            /* per node: 1 a held view; NULL until planned */
    int32_t *hold_root;      /* per value: the value whose tensor its slot holds (itself unless held) */
    /* Buffer reuse (planned with the steps): a kernel output may take the tensor of an
     * intermediate whose storage died at an earlier step (it and every view of it read for the
     * last time, none an output), instead of a fresh allocation: the same tensor when the layouts
     * agree, else a reinterpretation of its (dense, equally long) storage. The dead value is kept
     * from its last use to that step only where the program's peak does not grow. */
    int32_t *donor;          /* per value: the dead value whose tensor this kernel output takes, or -1 */
    uint8_t *donated;        /* per value: kept past its last use for the output that takes it */
    uint8_t *in_place;       /* per value: 1 its donor is its extern's own first argument, dying at that step
                              * (an index_add writing into the tensor it adds to); 2 its donor is an input
                              * of its kernel dying there, which the kernel writes it into (a program input
                              * too, where the run finds its data held by nobody else: af_obj_sole_owner) */
    int8_t *reuse_state;     /* per value: 0 donor not yet checked, 1 checked, -1 its layout differs (never reused) */
    int32_t n_reuses;        /* planned */
    int32_t n_sunk;          /* copies and reads af_sink_copies rewrote */
    uint8_t *pin_state;      /* per value: 0, or a base of as_strided or view steps, which must have its
                              * graph layout: 1 unchecked, 2 checked (has it), 3 given it by a copy each run */
    int32_t n_pinned;        /* values in state 1 or 3: 0 after a first run where every base had its layout */
    int64_t reused_bytes;    /* planned: bytes of the results that take a donor's tensor */
    int64_t fresh_bytes;     /* planned: bytes of the intermediates (no outputs) allocated fresh: see af_program_fresh_bytes */
    int64_t reuses_refused;  /* runs in which a donor was found held elsewhere (released, not reused) */
    int64_t reuses_taken;    /* results that took their donor's tensor, over all runs */
    /* Transparent huge pages (hugepages.h): fresh CPU tensors of at least huge_min bytes the
     * program allocates are marked before their first touch. Kernel outputs always; an extern
     * result of that size (huge_state 1, planned by plan_huge) is allocated here and written by
     * the op's out= overload, -1 once the overload refused (then the plain call, always). */
    int64_t huge_min;        /* 0: off */
    int8_t *huge_state;      /* per value */
    int64_t huge_advised;    /* tensors marked, over all runs */
    int64_t *step_ns;        /* per step: host time (profiling on), NULL when off */
    int64_t profiled_runs;
    int64_t fallbacks;
    int cache_hit;
    int jit_pending;        /* generated kernels not yet compiled and loaded (lazy_jit): at the first run */
    int check_inputs;
    int running;            /* a run is in progress (re-entry guard) */
};

static void mark_uses(const af_arg *a, int32_t step, int32_t *last_use) {
    if (a->kind == AF_ARG_VALUE) {
        if (last_use[a->u.value] < step) last_use[a->u.value] = step;
    } else if (a->kind == AF_ARG_LIST) {
        for (int32_t i = 0; i < a->u.list.n; i++) mark_uses(&a->u.list.items[i], step, last_use);
    }
}

/* Which step produces each value (-1: an input, or a value inside a kernel). */
static int32_t producing_step(const af_program *p, const int32_t *step_of_node, int32_t v) {
    int32_t node = af_graph_value(p->graph, v)->producer;
    return node < 0 ? -1 : step_of_node[node];
}

/* For each value: released after the last step reading it; graph outputs never; values nobody
 * reads right after the step that made them; unread inputs after the first step. */
static int plan_releases(af_program *p, const int32_t *step_of_node) {
    const af_graph *g = p->graph;
    int32_t nv = af_graph_num_values(g), ns = p->n_steps;
    int32_t *last_use = malloc(((size_t)nv + 1) * sizeof(int32_t));
    int32_t *fill = malloc(((size_t)ns + 1) * sizeof(int32_t));
    p->release_start = calloc((size_t)ns + 2, sizeof(int32_t));
    p->release = malloc(((size_t)nv + 1) * sizeof(int32_t));
    if (!last_use || !fill || !p->release_start || !p->release) {
        free(last_use);
        free(fill);
        return af_error_set(AF_ERR_NOMEM, "out of memory planning a program");
    }
    for (int32_t v = 0; v < nv; v++) last_use[v] = -1;
    for (int32_t s = 0; s < ns; s++) {
        if (p->steps[s].node >= 0) {
            const af_node *n = af_graph_node(g, p->steps[s].node);
            for (int32_t a = 0; a < n->n_args; a++) mark_uses(&n->args[a], s, last_use);
        } else {
            const af_fusion_group *grp = &p->plan->groups[p->steps[s].group];
            for (int32_t k = 0; k < grp->n_inputs; k++) {
                int32_t v = p->fold_root[grp->inputs[k]] >= 0 ? p->fold_root[grp->inputs[k]] : grp->inputs[k];
                if (last_use[v] < s) last_use[v] = s;
            }
        }
    }
    for (int32_t o = 0; o < af_graph_num_outputs(g); o++) last_use[af_graph_output(g, o)] = ns;
    for (int32_t v = 0; v < nv; v++) {
        if (last_use[v] != -1) continue;
        int32_t s = producing_step(p, step_of_node, v);
        if (af_graph_value(g, v)->producer >= 0 && s < 0) continue; /* inside a kernel: never exists */
        last_use[v] = s >= 0 ? s : (ns > 0 ? 0 : ns);
    }
    int32_t *count = p->release_start;
    for (int32_t v = 0; v < nv; v++)
        if (last_use[v] >= 0 && last_use[v] < ns) count[last_use[v] + 1]++;
    for (int32_t s = 0; s < ns; s++) count[s + 1] += count[s];
    memcpy(fill, count, ((size_t)ns + 1) * sizeof(int32_t));
    for (int32_t v = 0; v < nv; v++)
        if (last_use[v] >= 0 && last_use[v] < ns) p->release[fill[last_use[v]]++] = v;
    free(fill);
    free(last_use);
    return AF_OK;
}

void af_program_free(af_program *p) {
    if (!p) return;
    if (p->externs)
        for (int32_t i = 0; i < af_graph_num_nodes(p->graph); i++) af_extern_free(p->externs[i]);
    free(p->externs);
    free(p->steps);
    free(p->fold_root);
    free(p->fold_delta);
    free(p->view_state);
    free(p->fold_state);
    free(p->operands_checked);
    free(p->held);
    free(p->pin_state);
    free(p->hold_root);
    free(p->donor);
    free(p->donated);
    free(p->in_place);
    free(p->reuse_state);
    free(p->huge_state);
    free(p->release);
    free(p->release_start);
    free(p->input_ids);
    free(p->input_metas);
    free(p->input_names);
    free(p->values);
    if (p->ck)
        for (int32_t b = 0; b < p->ck->n_bodies; b++) {
            if (p->ext_module) af_jit_module_free(p->ext_module[b]);
            if (p->lift) free(p->lift[b]);
        }
    free(p->ext_module);
    free(p->lift);
    free(p->body_fns);
    af_c_kernels_free(p->ck);
    free(p->compile_source);
    free(p->kernel_metas);
    free(p->kernel_objs);
    if (p->empty_args)
        for (int32_t v = 0; v < af_graph_num_values(p->graph); v++) af_obj_release(p->empty_args[v]);
    free(p->empty_args);
    if (p->view_args)
        for (int32_t v = 0; v < af_graph_num_values(p->graph); v++) af_obj_release(p->view_args[v]);
    free(p->view_args);
    free(p->kernel_ptrs);
    free(p->kernel_params);
    free(p->source);
    free(p->cuda_source);
    free(p->launch);
    free(p->cuda_fns);
    free(p->step_ns);
    af_cuda_module_free(p->cuda_module);
    af_fuse_plan_free(p->plan);
    af_jit_module_free(p->module);
    af_graph_free(p->graph);
    free(p);
}

/* The single CUDA device of g's tensors (-1: none; -2: more than one, no CUDA kernels then). */
static int32_t cuda_device_of(const af_graph *g) {
    int32_t found = -1;
    for (int32_t v = 0; v < af_graph_num_values(g); v++) {
        const af_tensor_meta *m = &af_graph_value(g, v)->meta;
        if (m->type != AF_VALUE_TENSOR || m->device.type != AF_DEVICE_CUDA) continue;
        int32_t d = m->device.index < 0 ? 0 : m->device.index;
        if (found >= 0 && d != found) return -2;
        found = d;
    }
    return found;
}

/* Generates the CUDA groups' kernels for p->cuda_device (load_kernels compiles and loads them). */
static int gen_cuda_kernels(af_program *p) {
    int32_t ng = p->plan->n_groups;
    int st = af_cuda_load(1);
    if (st)
        return af_error_set(AF_ERR_UNSUPPORTED, "fused CUDA kernels cannot be built here: %s (AOTFUSE_BACKEND=aten runs "
                            "without them)", af_error_message());
    if ((st = af_cuda_device_info(p->cuda_device, NULL, &p->cuda_sm_count))) return st;
    p->launch = calloc((size_t)ng + 1, sizeof *p->launch);
    p->cuda_fns = calloc(3 * (size_t)ng + 1, sizeof *p->cuda_fns);
    if (!p->launch || !p->cuda_fns) return af_error_set(AF_ERR_NOMEM, "out of memory loading kernels");
    return af_codegen_cuda(p->graph, p->plan, p->cuda_sm_count, &p->cuda_source, p->launch);
}

/* Compiles (or finds in the disk cache) and loads the generated kernels, C and CUDA: when the
 * program is built, or at its first run where it was built with lazy_jit (a backward whose variant
 * without some output gradients is the one that runs never compiles its own). A module is kept only
 * once every kernel in it is found; on a failure the next run tries again. */
static int load_kernels(af_program *p) {
    int st = AF_OK;
    int32_t ng = p->plan->n_groups;
    if (p->ck && !p->module && p->n_compiled) {
        af_jit_module *m = NULL;
        if ((st = af_jit_cpu_load(p->compile_source ? p->compile_source : p->source, &m, &p->cache_hit))) return st;
        for (int32_t b = 0; b < p->ck->n_bodies && !st; b++) {
            if (p->ext_module[b]) continue;
            char name[32];
            snprintf(name, sizeof name, "af_body_%d", (int)p->ck->body_group[b]);
            *(void **)&p->body_fns[b] = af_jit_symbol(m, name);
            if (!p->body_fns[b]) st = af_error_set(AF_ERR_RUNTIME, "kernel %s missing from %s", name, af_jit_path(m));
        }
        /* the bodies it compiled, offered to later programs (an entry dies with the module) */
        for (int32_t b = 0; b < p->ck->n_bodies && !st && p->use_templates; b++)
            if (!p->ext_module[b]) st = af_tmpl_add(&p->ck->bodies[b], p->lift[b], m, p->body_fns[b]);
        if (st) {
            for (int32_t b = 0; b < p->ck->n_bodies; b++)
                if (!p->ext_module[b]) p->body_fns[b] = NULL;
            af_jit_module_free(m); /* its entries with it */
            return st;
        }
        p->module = m;
    }
    if (p->ck && !p->n_compiled) p->cache_hit = 1; /* nothing of its own to compile */
    if (p->cuda_source && !p->cuda_module) {
        int hit = 0;
        af_cuda_module *m = NULL;
        if ((st = af_cuda_module_load(p->cuda_source, p->cuda_device, &m, &hit))) return st;
        for (int32_t i = 0; i < ng && !st; i++) {
            const af_cuda_launch *l = &p->launch[i];
            if (l->kind == AF_CUDA_NONE) continue;
            char name[48]; /* a group sharing an earlier group's code (l->body) launches its kernels */
            snprintf(name, sizeof name, "af_kernel_%d", (int)l->body);
            st = af_cuda_function(m, name, &p->cuda_fns[3 * i]);
            snprintf(name, sizeof name, "af_kernel_%d_v", (int)l->body);
            if (!st && l->vec_blocks > 0) st = af_cuda_function(m, name, &p->cuda_fns[3 * i + 1]);
            snprintf(name, sizeof name, "af_kernel_%d_f", (int)l->body);
            if (!st && l->split > 0) st = af_cuda_function(m, name, &p->cuda_fns[3 * i + 2]);
        }
        if (st) {
            for (int32_t i = 0; i < 3 * ng; i++) p->cuda_fns[i] = NULL;
            af_cuda_module_free(m);
            return st;
        }
        p->cache_hit = p->module ? (p->cache_hit && hit) : hit;
        p->cuda_module = m;
    }
    p->jit_pending = 0;
    return AF_OK;
}

/* Generates the C kernels: the full source (af_program_source), then, with templates, each
 * body either found among earlier programs' (called from their modules) or compiled here, with
 * the literals af_tmpl_find flags read from af_n; compile_source holds only those. */
static int plan_c_kernels(af_program *p) {
    int st = af_c_kernels_new(p->graph, p->plan, &p->ck);
    if (st || (st = af_c_render(p->ck, NULL, NULL, &p->source))) return st;
    size_t nb = (size_t)(p->ck->n_bodies > 0 ? p->ck->n_bodies : 1);
    p->body_fns = calloc(nb, sizeof *p->body_fns);
    p->ext_module = calloc(nb, sizeof *p->ext_module);
    p->lift = calloc(nb, sizeof *p->lift);
    uint8_t *skip = calloc(nb, 1);
    if (!p->body_fns || !p->ext_module || !p->lift || !skip) {
        free(skip);
        return af_error_set(AF_ERR_NOMEM, "out of memory loading kernels");
    }
    for (int32_t b = 0; b < p->ck->n_bodies && !st; b++) {
        const af_cg_shared *body = &p->ck->bodies[b];
        int found = 0, lifted = 0;
        if (!(p->lift[b] = calloc((size_t)body->n_lits + 1, 1))) {
            st = af_error_set(AF_ERR_NOMEM, "out of memory loading kernels");
            break;
        }
        if (p->use_templates && (st = af_tmpl_find(body, &p->body_fns[b], &p->ext_module[b], p->lift[b], &found))) break;
        for (int32_t j = 0; j < body->n_lits && !found; j++) lifted |= p->lift[b][j];
        skip[b] = (uint8_t)found;
        p->n_reused += found;
        p->n_lifted += lifted;
        p->n_compiled += !found;
    }
    if (!st && p->n_compiled && (p->n_reused || p->n_lifted))
        st = af_c_render(p->ck, skip, (const uint8_t *const *)p->lift, &p->compile_source);
    free(skip);
    return st;
}

/* The devices whose tensors get kernels in graph g (options' device_types, 0 = every device; CUDA
 * only where g has a CUDA device). 0 here means none (AOTFUSE_BACKEND=cuda over CPU tensors): the
 * callers build no kernels then, since fuse.c and sink.c read a mask of 0 as every device. */
static uint32_t kernel_device_mask(const af_program_options *opts, const af_graph *g) {
    uint32_t devices = opts->device_types ? opts->device_types : AF_FUSE_ALL_DEVICES;
    if (cuda_device_of(g) < 0) devices &= ~(1u << AF_DEVICE_CUDA);
    return devices;
}

/* Plans fusion groups and generates their kernels (C for CPU groups, CUDA for CUDA groups);
 * compiles and loads them now, or at the first run with opts->lazy_jit. */
static int build_kernels(af_program *p, const af_program_options *opts) {
    uint32_t devices = kernel_device_mask(opts, p->graph);
    p->cuda_device = cuda_device_of(p->graph);
    if (!devices) return AF_OK;
    af_fuse_options fo = {.min_nodes = opts->min_group > 0 ? opts->min_group : 2, .device_types = devices, .no_shifted = opts->no_shifted,
                          .no_merge = opts->no_merge};
    int st = af_fuse_plan_new(p->graph, &fo, &p->plan);
    if (st || p->plan->n_groups == 0) return st;
    int32_t n_cpu = 0, n_cuda = 0;
    for (int32_t i = 0; i < p->plan->n_groups; i++) {
        n_cpu += p->plan->groups[i].device.type == AF_DEVICE_CPU;
        n_cuda += p->plan->groups[i].device.type == AF_DEVICE_CUDA;
    }
    int32_t widest = 0;
    p->use_templates = !opts->no_templates;
    if (n_cpu && (st = plan_c_kernels(p))) return st;
    if (n_cuda && (st = gen_cuda_kernels(p))) return st;
    p->jit_pending = 1;
    if (!opts->lazy_jit && (st = load_kernels(p))) return st;
    for (int32_t i = 0; i < p->plan->n_groups; i++) {
        int32_t w = p->plan->groups[i].n_inputs + p->plan->groups[i].n_outputs;
        if (w > widest) widest = w;
    }
    widest += 1; /* a column reduction's workspace */
    p->kernel_metas = malloc(((size_t)widest + 1) * sizeof *p->kernel_metas);
    p->kernel_objs = malloc(((size_t)widest + 1) * sizeof *p->kernel_objs);
    p->kernel_ptrs = malloc(((size_t)widest + 1) * sizeof *p->kernel_ptrs);
    p->kernel_params = malloc(((size_t)widest + 2 + AF_MAX_KERNEL_STREAMS) * sizeof *p->kernel_params);
    p->empty_args = calloc((size_t)af_graph_num_values(p->graph) + 1, sizeof *p->empty_args);
    if (!p->kernel_metas || !p->kernel_objs || !p->kernel_ptrs || !p->kernel_params || !p->empty_args)
        return af_error_set(AF_ERR_NOMEM, "out of memory loading kernels");
    return AF_OK;
}

/* A view node the runtime may make without ATen: one tensor output (not a graph output, whose
 * aliasing AOTAutograd tracks) of a tensor it views, same dtype and device. */
static int plain_view(const af_graph *g, int32_t i, const uint8_t *is_output) {
    const af_node *n = af_graph_node(g, i);
    if (af_op_get(n->op_id)->kind != AF_KIND_VIEW || n->n_outputs != 1 || n->n_args < 1) return 0;
    if (n->args[0].kind != AF_ARG_VALUE || n->args[0].name || (is_output && is_output[n->first_output])) return 0;
    const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta, *in = &af_graph_value(g, n->args[0].u.value)->meta;
    return out->type == AF_VALUE_TENSOR && in->type == AF_VALUE_TENSOR && out->dtype == in->dtype &&
           out->device.type == in->device.type && out->device.index == in->device.index;
}

static int plan_pins(af_program *p);

/* Which views fold into the kernels reading them (fold_root, fold_delta) and which run as checked
 * reinterpretations (view_state 0); in reverse order, since a view folds when every reader is a
 * kernel or a view that folds. */
static int plan_views(af_program *p) {
    const af_graph *g = p->graph;
    int32_t nn = af_graph_num_nodes(g), nv = af_graph_num_values(g);
    p->fold_root = malloc(((size_t)nv + 1) * sizeof(int32_t));
    p->fold_delta = calloc((size_t)nv + 1, sizeof(int64_t));
    p->view_state = malloc((size_t)nn + 1);
    uint8_t *is_output = calloc((size_t)nv + 1, 1), *foldable = calloc((size_t)nn + 1, 1);
    int32_t *readers_ok = calloc((size_t)nv + 1, sizeof(int32_t)), *readers = calloc((size_t)nv + 1, sizeof(int32_t));
    if (!p->fold_root || !p->fold_delta || !p->view_state || !is_output || !foldable || !readers_ok || !readers) {
        free(is_output);
        free(foldable);
        free(readers_ok);
        free(readers);
        return af_error_set(AF_ERR_NOMEM, "out of memory planning a program");
    }
    for (int32_t v = 0; v < nv; v++) p->fold_root[v] = -1;
    for (int32_t o = 0; o < af_graph_num_outputs(g); o++) is_output[af_graph_output(g, o)] = 1;
    int reinterpret = af_bridge_can_reinterpret();
    for (int32_t i = nn - 1; i >= 0; i--) {
        const af_node *n = af_graph_node(g, i);
        /* a view in a kernel (a remapped window member) is index arithmetic there */
        int view = plain_view(g, i, is_output) && !(p->plan && p->plan->group_of_node[i] >= 0);
        int32_t v = n->first_output;
        foldable[i] = view && p->plan && readers[v] > 0 && readers_ok[v] == readers[v];
        p->view_state[i] = view && reinterpret && !foldable[i] ? 0 : -1;
        /* count this node's reads: ok when it is a kernel member or a view that folds */
        int ok = (p->plan && p->plan->group_of_node[i] >= 0) || foldable[i];
        for (int32_t a = 0; a < n->n_args; a++) {
            const af_arg *arg = &n->args[a];
            if (arg->kind == AF_ARG_VALUE) {
                readers[arg->u.value]++;
                readers_ok[arg->u.value] += ok;
            } else if (arg->kind == AF_ARG_LIST) {
                for (int32_t j = 0; j < arg->u.list.n; j++)
                    if (arg->u.list.items[j].kind == AF_ARG_VALUE) readers[arg->u.list.items[j].u.value]++; /* never ok */
            }
        }
    }
    p->fold_state = calloc((size_t)(p->plan ? p->plan->n_groups : 0) + 1, 1);
    p->operands_checked = calloc((size_t)(p->plan ? p->plan->n_groups : 0) + 1, 1);
    if (!p->fold_state || !p->operands_checked) {
        free(is_output);
        free(foldable);
        free(readers_ok);
        free(readers);
        return af_error_set(AF_ERR_NOMEM, "out of memory planning a program");
    }
    for (int32_t i = 0; i < nn; i++) {
        if (!foldable[i]) continue;
        const af_node *n = af_graph_node(g, i);
        int32_t v = n->first_output, b = n->args[0].u.value;
        int32_t root = p->fold_root[b] >= 0 ? p->fold_root[b] : b;
        p->fold_root[v] = root;
        p->fold_delta[v] = (af_graph_value(g, v)->meta.storage_offset - af_graph_value(g, root)->meta.storage_offset) *
                           af_dtype_itemsize(af_graph_value(g, v)->meta.dtype);
    }
    for (int32_t gi = 0; p->plan && gi < p->plan->n_groups; gi++) {
        const af_fusion_group *grp = &p->plan->groups[gi];
        p->fold_state[gi] = 2;
        for (int32_t k = 0; k < grp->n_inputs; k++)
            if (p->fold_root[grp->inputs[k]] >= 0) p->fold_state[gi] = 0;
    }
    free(is_output);
    free(foldable);
    free(readers_ok);
    free(readers);
    return AF_OK;
}

/* Bytes of a dense tensor (af_tensor_meta_dense), or -1 when meta is not one, or has no elements. */
static int64_t dense_bytes(const af_tensor_meta *m) {
    return af_tensor_meta_dense(m) ? af_tensor_meta_numel(m) * af_dtype_itemsize(m->dtype) : -1;
}

static void taint_args(const af_arg *a, const int32_t *root, uint8_t *bad) {
    if (a->kind == AF_ARG_VALUE) {
        bad[root[a->u.value]] = 1;
    } else if (a->kind == AF_ARG_LIST) {
        for (int32_t j = 0; j < a->u.list.n; j++) taint_args(&a->u.list.items[j], root, bad);
    }
}

typedef struct {
    int32_t free_step, value;
} af_donor;

static int later_freed_first(const void *a, const void *b) {
    const af_donor *x = a, *y = b;
    if (x->free_step != y->free_step) return x->free_step > y->free_step ? -1 : 1;
    return x->value < y->value ? -1 : x->value > y->value;
}

/* Externs whose out= overload may be handed their first argument's own tensor: ATen's structured
 * index_add copies self into out only when they differ, then adds into out. */
static int writes_into_first_arg(const af_node *n) { return strcmp(n->op, "aten::index_add.default") == 0; }

/* Plans buffer reuse (see af_program's donor). Storages: a view shares its input's; an extern
 * whose schema annotates an alias may share its arguments' (those storages are never reused); a
 * storage is free after the last release of a value on it. Each kernel output, and each result
 * of an extern with an out= overload, in step order, takes the latest-freed matching storage
 * whose keeping until then leaves the program's peak (the bytes of the storages alive at each
 * step) where it was; at most REUSE_TRIES matching storages are weighed per result. */
#define REUSE_TRIES 16

/* v written into donor d's tensor at the step making it (in_place 1: an extern's own first
 * argument; 2: an input of v's kernel); the storage `root` is then no other result's. */
static void plan_in_place(af_program *p, uint8_t *kept, int32_t v, int32_t d, int32_t root, uint8_t kind) {
    kept[root] = 1;
    p->donor[v] = d;
    p->in_place[v] = kind;
    p->n_reuses++;
    p->reused_bytes += af_tensor_meta_nbytes(&af_graph_value(p->graph, v)->meta);
}

static int plan_reuse(af_program *p, const int32_t *step_of_node, int reuse) {
    const af_graph *g = p->graph;
    int32_t nv = af_graph_num_values(g), nn = af_graph_num_nodes(g), ns = p->n_steps, n_donors = 0;
    if (ns == 0) return AF_OK;
    int32_t *root = malloc(((size_t)nv + 1) * sizeof(int32_t)), *free_at = malloc(((size_t)nv + 1) * sizeof(int32_t));
    af_donor *donors = malloc(((size_t)nv + 1) * sizeof *donors);
    int64_t *live = calloc((size_t)ns + 1, sizeof(int64_t));
    uint8_t *bad = calloc((size_t)nv + 1, 1), *kept = calloc((size_t)nv + 1, 1);
    p->donor = malloc(((size_t)nv + 1) * sizeof(int32_t));
    p->donated = calloc((size_t)nv + 1, 1);
    p->in_place = calloc((size_t)nv + 1, 1);
    p->reuse_state = calloc((size_t)nv + 1, 1);
    int st = AF_OK;
    if (!root || !free_at || !donors || !live || !bad || !kept || !p->donor || !p->donated || !p->in_place || !p->reuse_state) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory planning buffer reuse");
        goto done;
    }
    for (int32_t v = 0; v < nv; v++) {
        root[v] = v;
        free_at[v] = -1;
        p->donor[v] = -1;
    }
    /* 2: a program input (never a donor planned ahead; a kernel may still write its output into one
     * that dies at its step and that the run finds nobody else holds); 1: held past the program or
     * shared with an alias */
    for (int32_t k = 0; k < af_graph_num_inputs(g); k++) bad[af_graph_input(g, k)] = 2;
    for (int32_t i = 0; i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        if (p->plan && p->plan->group_of_node[i] >= 0) continue; /* a kernel member: its outputs are new tensors */
        if (plain_view(g, i, NULL)) { /* on its input's storage */
            root[n->first_output] = root[n->args[0].u.value];
        } else if (af_extern_may_alias(p->externs[i])) {
            int32_t first = -1;
            for (int32_t a = 0; a < n->n_args; a++) {
                if (first < 0 && n->args[a].kind == AF_ARG_VALUE) first = root[n->args[a].u.value];
                taint_args(&n->args[a], root, bad);
            }
            for (int32_t o = 0; o < n->n_outputs; o++) {
                if (first >= 0) root[n->first_output + o] = first;
                bad[n->first_output + o] = 1;
            }
        }
    }
    for (int32_t s = 0; s < ns; s++)
        for (int32_t r = p->release_start[s]; r < p->release_start[s + 1]; r++) {
            int32_t v = root[p->release[r]];
            if (s > free_at[v]) free_at[v] = s;
        }
    for (int32_t o = 0; o < af_graph_num_outputs(g); o++) { /* alive to the end */
        bad[root[af_graph_output(g, o)]] = 1;
        free_at[root[af_graph_output(g, o)]] = ns - 1;
    }
    int64_t peak = 0;
    for (int32_t v = 0; v < nv; v++) {
        const af_value *val = af_graph_value(g, v);
        int32_t s0 = root[v] == v && val->producer >= 0 ? step_of_node[val->producer] : -1;
        int64_t b = af_tensor_meta_nbytes(&val->meta);
        if (s0 < 0 || b <= 0) continue;
        int32_t s1 = free_at[v] < s0 ? s0 : free_at[v];
        for (int32_t s = s0; s <= s1; s++) live[s] += b;
        if (!bad[v] && free_at[v] >= s0 && free_at[v] < ns - 1 && dense_bytes(&val->meta) > 0)
            donors[n_donors++] = (af_donor){.free_step = free_at[v], .value = v};
    }
    for (int32_t s = 0; s < ns; s++)
        if (live[s] > peak) peak = live[s];
    qsort(donors, (size_t)n_donors, sizeof *donors, later_freed_first);
    for (int32_t t = 0; t < ns && reuse; t++) {
        const af_fusion_group *grp = p->steps[t].group >= 0 ? &p->plan->groups[p->steps[t].group] : NULL;
        const af_node *n = grp ? NULL : af_graph_node(g, p->steps[t].node);
        if (n && (n->n_outputs != 1 || af_op_get(n->op_id)->kind == AF_KIND_VIEW || /* _unsafe_view has an out= copy */
                  !af_extern_can_write_into(p->externs[p->steps[t].node])))
            continue;
        if (n && writes_into_first_arg(n) && n->n_args > 0 && n->args[0].kind == AF_ARG_VALUE) {
            /* in place: the first argument's storage dies here (read by no later step through any
             * view), is no input's, output's or alias', the argument spans all of it with the
             * result's layout (a view such as t(t(mm)) may), and no other argument shares it */
            int32_t v = n->first_output, d = n->args[0].u.value, r = root[d];
            const af_tensor_meta *m = &af_graph_value(g, v)->meta, *dm = &af_graph_value(g, d)->meta;
            int ok = !bad[r] && !kept[r] && free_at[r] == t && m->type == AF_VALUE_TENSOR && dm->type == AF_VALUE_TENSOR &&
                     m->storage_offset == 0 && dm->storage_offset == 0 && dm->dtype == m->dtype &&
                     dm->device.type == m->device.type && dm->device.index == m->device.index &&
                     af_tensor_meta_same_layout(dm, m, 1) && dense_bytes(m) > 0 &&
                     af_tensor_meta_nbytes(dm) == af_tensor_meta_nbytes(&af_graph_value(g, r)->meta);
            for (int32_t a = 1; a < n->n_args && ok; a++)
                if (n->args[a].kind == AF_ARG_VALUE && root[n->args[a].u.value] == r) ok = 0;
            if (ok) {
                plan_in_place(p, kept, v, d, r, 1);
                continue;
            }
        }
        for (int32_t k = 0; k < (grp ? grp->n_outputs : 1); k++) {
            int32_t v = grp ? grp->outputs[k] : n->first_output;
            const af_tensor_meta *m = &af_graph_value(g, v)->meta;
            if (m->type != AF_VALUE_TENSOR || m->storage_offset != 0) continue;
            int32_t j = grp ? af_cg_in_place_input(g, grp, k) : -1;
            if (j >= 0) {
                /* in place: the kernel writes output k into its input j's tensor (af_cg_in_place_input:
                 * same layout, each element read before it is written), which dies at this step: no
                 * view of it, no other operand of the kernel on its storage (a folded view included),
                 * not an output or an alias' */
                int32_t x = grp->inputs[j], d = p->fold_root[x] >= 0 ? p->fold_root[x] : x;
                const af_tensor_meta *dm = &af_graph_value(g, d)->meta;
                /* a folded view of d (the cross entropy's [tokens, vocab] view of the logits) spanning
                 * all of it: the kernel reads d's tensor, and the output is d's storage in its layout */
                int ok = root[d] == d && (bad[d] == 0 || bad[d] == 2) && !kept[d] && free_at[d] == t &&
                         (d == x || (p->fold_delta[x] == 0 && dm->type == AF_VALUE_TENSOR && dm->dtype == m->dtype &&
                                     dm->storage_offset == 0 && af_tensor_meta_dense(dm) &&
                                     af_tensor_meta_nbytes(dm) == af_tensor_meta_nbytes(m)));
                for (int32_t q = 0; q < grp->n_inputs && ok; q++) {
                    int32_t y = grp->inputs[q], fy = p->fold_root[y] >= 0 ? p->fold_root[y] : y;
                    if (q != j && root[fy] == d) ok = 0;
                }
                if (ok) {
                    plan_in_place(p, kept, v, d, d, 2);
                    continue;
                }
            }
            int64_t want = dense_bytes(m);
            for (int32_t j = 0, tries = 0; j < n_donors && tries < REUSE_TRIES; j++) {
                int32_t f = donors[j].free_step, d = donors[j].value;
                if (f >= t || kept[d]) continue;
                const af_tensor_meta *dm = &af_graph_value(g, d)->meta;
                if (dm->dtype != m->dtype || dm->device.type != m->device.type || dm->device.index != m->device.index ||
                    dm->storage_offset != 0 || (!af_tensor_meta_same_layout(dm, m, 1) && (want < 0 || dense_bytes(dm) != want)))
                    continue;
                int64_t b = af_tensor_meta_nbytes(dm), high = 0;
                tries++;
                for (int32_t s = f + 1; s < t; s++)
                    if (live[s] > high) high = live[s];
                if (high + b > peak) continue;
                for (int32_t s = f + 1; s < t; s++) live[s] += b;
                kept[d] = p->donated[d] = 1;
                p->donor[v] = d;
                p->n_reuses++;
                p->reused_bytes += b;
                break;
            }
        }
    }
    for (int32_t v = 0; v < nv; v++) {
        const af_value *val = af_graph_value(g, v);
        if (root[v] == v && !bad[v] && val->producer >= 0 && step_of_node[val->producer] >= 0 && p->donor[v] < 0)
            p->fresh_bytes += af_tensor_meta_nbytes(&val->meta);
    }
done:
    free(root);
    free(free_at);
    free(donors);
    free(live);
    free(bad);
    free(kept);
    return st;
}

static int plan_huge(af_program *p, int64_t min);

int af_program_new(af_graph *g, const af_program_options *opts, af_program **out) {
    if (!g || !out) return af_error_set(AF_ERR_INVALID, "af_program_new: NULL argument");
    af_program_options o = {0};
    if (opts) o = *opts;
    int st = af_graph_verify(g);
    if (st) return st;
    if ((st = af_bridge_init())) return st;
    af_graph *given = g, *sunk = NULL;
    int32_t n_sunk = 0;
    uint32_t kernel_devices = kernel_device_mask(&o, g);
    int sink_reads = (o.no_sink_reads ? 0 : AF_SINK_VIEW_READS) | (o.no_sink_broadcasts ? 0 : AF_SINK_BROADCAST_READS);
    if (o.fuse && !o.no_sink && kernel_devices &&
        (st = af_sink_copies(g, kernel_devices, sink_reads, &sunk, &n_sunk, NULL)))
        return st;
    if (sunk) g = sunk;
    af_program *p = calloc(1, sizeof *p);
    if (!p) {
        af_graph_free(sunk);
        return af_error_set(AF_ERR_NOMEM, "out of memory allocating a program");
    }
    p->graph = g;
    p->n_sunk = n_sunk;
    p->check_inputs = 1;
    int32_t nn = af_graph_num_nodes(g), nv = af_graph_num_values(g), ni = af_graph_num_inputs(g);
    int32_t *step_of_node = malloc(((size_t)nn + 1) * sizeof(int32_t));
    p->externs = calloc((size_t)nn + 1, sizeof *p->externs);
    p->steps = calloc((size_t)nn + 1, sizeof *p->steps);
    p->values = calloc((size_t)nv + 1, sizeof *p->values);
    p->view_args = calloc((size_t)nv + 1, sizeof *p->view_args);
    p->input_ids = malloc(((size_t)ni + 1) * sizeof *p->input_ids);
    p->input_metas = malloc(((size_t)ni + 1) * sizeof *p->input_metas);
    p->input_names = malloc(((size_t)ni + 1) * sizeof *p->input_names);
    if (!step_of_node || !p->externs || !p->steps || !p->values || !p->view_args || !p->input_ids || !p->input_metas ||
        !p->input_names) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory allocating a program");
        goto error;
    }
    for (int32_t i = 0; i < ni; i++) {
        const af_value *v = af_graph_value(g, af_graph_input(g, i));
        p->input_ids[i] = af_graph_input(g, i);
        p->input_metas[i] = &v->meta;
        p->input_names[i] = v->name;
    }
    if (o.fuse && (st = build_kernels(p, &o))) goto error;
    if ((st = plan_views(p))) goto error;
    /* groups that run after a node not their own (fuse.c's deps), listed at that node */
    int32_t ngr = p->plan ? p->plan->n_groups : 0;
    int32_t *late_head = malloc(((size_t)nn + 1) * sizeof(int32_t)), *late_next = malloc(((size_t)ngr + 1) * sizeof(int32_t));
    if (!late_head || !late_next) {
        free(late_head);
        free(late_next);
        st = af_error_set(AF_ERR_NOMEM, "out of memory allocating a program");
        goto error;
    }
    for (int32_t i = 0; i < nn; i++) late_head[i] = -1;
    for (int32_t gi = ngr - 1; gi >= 0; gi--) {
        int32_t at = p->plan->groups[gi].last_node;
        late_next[gi] = -1;
        if (at >= 0 && at < nn && p->plan->group_of_node[at] != gi) {
            late_next[gi] = late_head[at];
            late_head[at] = gi;
        }
    }
    for (int32_t i = 0; i < nn; i++) {
        int32_t gi = p->plan ? p->plan->group_of_node[i] : -1;
        step_of_node[i] = -1;
        const af_node *n = af_graph_node(g, i);
        if (n->n_outputs == 1 && p->fold_root[n->first_output] >= 0) {
            /* folded into its kernels: no step */
        } else if (gi < 0) {
            step_of_node[i] = p->n_steps;
            p->steps[p->n_steps++] = (af_step){.node = i, .group = -1};
        } else if (p->plan->groups[gi].last_node == i) {
            p->steps[p->n_steps++] = (af_step){.node = -1, .group = gi};
        }
        for (int32_t late = late_head[i]; late >= 0; late = late_next[late])
            p->steps[p->n_steps++] = (af_step){.node = -1, .group = late};
    }
    free(late_head);
    free(late_next);
    if (p->plan) /* a kernel's outputs come from its step */
        for (int32_t s = 0; s < p->n_steps; s++)
            if (p->steps[s].group >= 0) {
                const af_fusion_group *grp = &p->plan->groups[p->steps[s].group];
                for (int32_t k = 0; k < grp->n_outputs; k++)
                    step_of_node[af_graph_value(g, grp->outputs[k])->producer] = s;
            }
    if ((st = plan_releases(p, step_of_node))) goto error;
    for (int32_t i = 0; i < nn; i++)
        if ((st = af_extern_new(g, i, &p->externs[i]))) goto error;
    if ((st = plan_pins(p))) goto error; /* reads the externs' alias flags */
    if ((st = plan_reuse(p, step_of_node, !o.no_reuse))) goto error;
    if ((st = plan_huge(p, o.huge_pages_min))) goto error;
    free(step_of_node);
    if (sunk) af_graph_free(given); /* the program runs (and owns) the rewritten graph */
    *out = p;
    return AF_OK;
error:
    free(step_of_node);
    p->graph = NULL; /* the given graph is still the caller's */
    af_program_free(p);
    af_graph_free(sunk);
    return st;
}

const af_graph *af_program_graph(const af_program *p) { return p ? p->graph : NULL; }
int32_t af_program_num_kernels(const af_program *p) { return p && p->plan && (p->source || p->cuda_source) ? p->plan->n_groups : 0; }
const char *af_program_cuda_source(const af_program *p) { return p ? p->cuda_source : NULL; }
int64_t af_program_kernel_fallbacks(const af_program *p) { return p ? p->fallbacks : 0; }
int32_t af_program_buffer_reuses(const af_program *p) { return p ? p->n_reuses : 0; }
int32_t af_program_copies_sunk(const af_program *p) { return p ? p->n_sunk : 0; }
int64_t af_program_reuses_refused(const af_program *p) { return p ? p->reuses_refused : 0; }
int64_t af_program_reuses_taken(const af_program *p) { return p ? p->reuses_taken : 0; }
int64_t af_program_huge_advised(const af_program *p) { return p ? p->huge_advised : 0; }
int64_t af_program_reused_bytes(const af_program *p) { return p ? p->reused_bytes : 0; }
int64_t af_program_fresh_bytes(const af_program *p) { return p ? p->fresh_bytes : 0; }
int32_t af_program_donor(const af_program *p, int32_t value) {
    return p && p->donor && value >= 0 && value < af_graph_num_values(p->graph) ? p->donor[value] : -1;
}
int af_program_cache_hit(const af_program *p) { return p ? p->cache_hit : 0; }
int af_program_kernels_loaded(const af_program *p) { return p && !p->jit_pending; }

int af_program_load_kernels(af_program *p) {
    if (!p) return af_error_set(AF_ERR_INVALID, "af_program_load_kernels: NULL program");
    if (p->running) return af_error_set(AF_ERR_RUNTIME, "program is running");
    return p->jit_pending ? load_kernels(p) : AF_OK;
}
const char *af_program_source(const af_program *p) { return p ? p->source : NULL; }
int32_t af_program_bodies_reused(const af_program *p) { return p ? p->n_reused : 0; }
int32_t af_program_bodies_lifted(const af_program *p) { return p ? p->n_lifted : 0; }
const char *af_program_compiled_source(const af_program *p) {
    return !p || !p->n_compiled ? NULL : p->compile_source ? p->compile_source : p->source;
}
int32_t af_program_num_steps(const af_program *p) { return p ? p->n_steps : 0; }
void af_program_set_plain_outputs(af_program *p, int32_t first) {
    if (!p || !af_bridge_can_reinterpret()) return;
    const af_graph *g = p->graph;
    int32_t no = af_graph_num_outputs(g);
    for (int32_t o = first < 0 ? 0 : first; o < no; o++) {
        int32_t v = af_graph_output(g, o), node = af_graph_value(g, v)->producer, aliased = 0;
        for (int32_t e = 0; e < first && e < no; e++) aliased |= af_graph_output(g, e) == v;
        if (node >= 0 && !aliased && p->view_state[node] < 0 && p->fold_root[v] < 0 && plain_view(g, node, NULL))
            p->view_state[node] = 0;
    }
    free(p->held); /* planned again after a run has checked the new view steps */
    free(p->hold_root);
    p->held = NULL;
    p->hold_root = NULL;
}

const char *af_program_node_how(const af_program *p, int32_t node) {
    if (!p || node < 0 || node >= af_graph_num_nodes(p->graph)) return NULL;
    if (af_program_node_group(p, node) >= 0) return "kernel";
    const af_node *n = af_graph_node(p->graph, node);
    if (n->n_outputs == 1 && p->fold_root[n->first_output] >= 0) return "folded";
    if (p->held && p->held[node]) return "alias";
    return p->view_state[node] >= 0 ? "view" : "aten";
}

int32_t af_program_node_group(const af_program *p, int32_t node) {
    if (!p || !p->plan || node < 0 || node >= af_graph_num_nodes(p->graph)) return -1;
    return p->plan->group_of_node[node];
}

int af_program_set_profiling(af_program *p, int enabled) {
    if (!p) return af_error_set(AF_ERR_INVALID, "af_program_set_profiling: NULL program");
    if (!enabled) {
        free(p->step_ns);
        p->step_ns = NULL;
        p->profiled_runs = 0;
        return AF_OK;
    }
    if (!p->step_ns && !(p->step_ns = calloc((size_t)p->n_steps + 1, sizeof *p->step_ns)))
        return af_error_set(AF_ERR_NOMEM, "out of memory for profiling");
    return AF_OK;
}

int64_t af_program_profile(const af_program *p, int32_t step, int32_t *node, int32_t *group) {
    if (!p || step < 0 || step >= p->n_steps) return -1;
    if (node) *node = p->steps[step].node;
    if (group) *group = p->steps[step].group;
    return p->step_ns ? p->step_ns[step] : -1;
}

int64_t af_program_profiled_runs(const af_program *p) { return p ? p->profiled_runs : 0; }

void af_program_set_check_inputs(af_program *p, int enabled) {
    if (p) p->check_inputs = enabled != 0;
}

static void release_all(af_program *p) {
    int32_t nv = af_graph_num_values(p->graph);
    for (int32_t v = 0; v < nv; v++) {
        af_obj_release(p->values[v]);
        p->values[v] = NULL;
    }
}

static unsigned grid_for(const af_program *p, int64_t blocks, int32_t threads) {
    int64_t cap = (int64_t)(p->cuda_sm_count > 0 ? p->cuda_sm_count : 1) * (2048 / threads); /* one full wave */
    if (blocks > cap) blocks = cap;
    return (unsigned)(blocks < 1 ? 1 : blocks);
}

/* Launches a CUDA group's kernel(s) on torch's current stream; p->kernel_ptrs holds its operands. */
static int launch_cuda(af_program *p, int32_t gi) {
    const af_fusion_group *grp = &p->plan->groups[gi];
    const af_cuda_launch *l = &p->launch[gi];
    if (l->kind == AF_CUDA_NONE) return AF_OK; /* no elements */
    int32_t nops = grp->n_inputs + grp->n_outputs;
    int st;
    if (!p->have_stream) {
        if ((st = af_bridge_cuda_stream(p->cuda_device, &p->stream))) return st;
        p->have_stream = 1;
    }
    void **par = p->kernel_params;
    if (l->split == 0) { /* one kernel */
        int aligned = l->vec_blocks > 0;
        for (int32_t k = 0; k < nops && aligned; k++) aligned = ((uintptr_t)p->kernel_ptrs[k] & 15u) == 0;
        for (int32_t k = 0; k < nops; k++) par[k] = &p->kernel_ptrs[k];
        for (int32_t j = 0; j < l->n_streams; j++) par[nops + j] = (void *)&l->streams[j]; /* by value, after the operands */
        void *fn = p->cuda_fns[3 * gi + (aligned ? 1 : 0)];
        int64_t blocks = aligned ? l->vec_blocks : l->blocks;
        return af_cuda_launch_kernel(p->cuda_module, fn, grid_for(p, blocks, l->threads), 1, (unsigned)l->threads, p->stream, par);
    }
    /* two passes (columns, split rows): partials into a workspace from torch's allocator, then the finishing pass */
    int64_t n = l->workspace / (int64_t)sizeof(double), one = 1;
    af_tensor_meta wm = {.type = AF_VALUE_TENSOR, .dtype = AF_DTYPE_FLOAT64, .device = grp->device, .ndim = 1, .sizes = &n,
                         .strides = &one};
    const af_tensor_meta *wmp = &wm;
    af_obj *ws = NULL;
    void *ws_ptr = NULL;
    if ((st = af_bridge_empty(&wm, &ws)) == AF_OK) st = af_bridge_tensor_data(&ws, &wmp, 1, &ws_ptr);
    if (st == AF_OK) {
        par[0] = &ws_ptr;
        for (int32_t k = 0; k < nops; k++) par[k + 1] = &p->kernel_ptrs[k];
        for (int32_t j = 0; j < l->n_streams; j++) par[nops + 1 + j] = (void *)&l->streams[j];
        st = af_cuda_launch_kernel(p->cuda_module, p->cuda_fns[3 * gi], grid_for(p, l->blocks, l->threads), (unsigned)l->split,
                            (unsigned)l->threads, p->stream, par);
        if (st == AF_OK)
            st = af_cuda_launch_kernel(p->cuda_module, p->cuda_fns[3 * gi + 2], grid_for(p, l->finish_blocks, 256), 1, 256, p->stream, par);
    }
    af_obj_release(ws); /* torch's allocator orders the reuse after the kernels on this stream */
    if (st == AF_BRIDGE_LAYOUT_MISMATCH) st = af_error_set(AF_ERR_RUNTIME, "a kernel workspace was allocated with another layout");
    return st;
}

/* The sink's as_strided views of a source (sink.c, add_source_view, the offset passed by name):
 * their offset is the one from the source as traced, where ATen's as_strided takes the storage's,
 * and a program input may come at another storage offset than traced (the entry check holds sizes
 * and strides): AOTAutograd gives the gradient of an output traced at offset 1 (an imaginary part)
 * at offset 0, and ATen's view of it overran the storage. Such a view is made by reinterpreting its
 * base from its first run (run_view), also for a kernel's fallback (materialize_view). The graph's
 * own as_strided calls keep ATen's meaning: as_strided_scatter's backward takes its gradient's
 * storage from offset 0 where the gradient was traced at offset 1 (made relative, it read the
 * element before the storage). */
static int relative_view(const af_node *n) {
    return n->op_id == AF_OP_AS_STRIDED && n->n_args == 4 && n->args[3].name && !strcmp(n->args[3].name, "storage_offset");
}

/* Makes folded view v (and the folded views it reads) with ATen, for a kernel's fallback; a
 * relative_view by reinterpreting its base, as its step does. */
static int materialize_view(af_program *p, int32_t v) {
    if (p->values[v]) return AF_OK;
    int32_t i = af_graph_value(p->graph, v)->producer;
    const af_node *n = af_graph_node(p->graph, i);
    int32_t b = n->args[0].u.value;
    int st = p->fold_root[b] >= 0 ? materialize_view(p, b) : AF_OK;
    if (st) return st;
    if (relative_view(n) && af_bridge_can_reinterpret()) {
        const af_tensor_meta *m = &af_graph_value(p->graph, v)->meta;
        return af_bridge_reinterpret(p->values[b], m, m->storage_offset - af_graph_value(p->graph, b)->meta.storage_offset,
                                     &p->values[v]);
    }
    return af_extern_call(p->externs[i], p->values, &p->values[v]);
}

static void drop_folded_views(af_program *p, const af_fusion_group *grp) {
    for (int32_t k = 0; k < grp->n_inputs; k++) {
        int32_t v = grp->inputs[k];
        while (v >= 0 && p->fold_root[v] >= 0) { /* the chain back to the root */
            af_obj_release(p->values[v]);
            p->values[v] = NULL;
            v = af_graph_node(p->graph, af_graph_value(p->graph, v)->producer)->args[0].u.value;
        }
    }
}

/* The first run of a kernel reading folded views makes them with ATen once: do they have the
 * layouts (and offsets from their roots) the graph says, which the kernel will assume? If not,
 * the kernel always falls back (never a wrong answer). */
static int check_folded_views(af_program *p, int32_t gi) {
    const af_fusion_group *grp = &p->plan->groups[gi];
    int st = AF_OK, ok = 1;
    for (int32_t k = 0; k < grp->n_inputs && !st && ok; k++) {
        int32_t v = grp->inputs[k], root = p->fold_root[v];
        /* an empty view (Phi3's rotary backward slices [..., 8:8]) is read nowhere: any layout will do,
         * and ATen's may differ from the traced one (its layout check failed the kernel each call) */
        if (root < 0 || af_tensor_meta_numel(&af_graph_value(p->graph, v)->meta) == 0) continue;
        if ((st = materialize_view(p, v))) break;
        af_obj *objs[2] = {p->values[root], p->values[v]};
        const af_tensor_meta *metas[2] = {&af_graph_value(p->graph, root)->meta, &af_graph_value(p->graph, v)->meta};
        st = af_bridge_same_view(objs, metas);
        if (st == AF_BRIDGE_LAYOUT_MISMATCH) ok = 0, st = AF_OK;
    }
    drop_folded_views(p, grp);
    if (!st) p->fold_state[gi] = ok ? 1 : -1;
    return st;
}

/* Which extern results get huge pages (p->huge_state 1): a single CPU tensor result of at
 * least min bytes, dense from offset 0, of an op with an out= overload that is no view, taking
 * no donor. Kernel outputs need no plan (their outputs are always allocated here). */
static int plan_huge(af_program *p, int64_t min) {
    const af_graph *g = p->graph;
    int32_t nv = af_graph_num_values(g);
    p->huge_min = min > 0 ? min : 0;
    if (!p->huge_min) return AF_OK;
    if (!(p->huge_state = calloc((size_t)nv + 1, 1))) return af_error_set(AF_ERR_NOMEM, "out of memory planning huge pages");
    /* the allocation arguments per value (a program without kernels has none yet) */
    if (!p->empty_args && !(p->empty_args = calloc((size_t)nv + 1, sizeof *p->empty_args)))
        return af_error_set(AF_ERR_NOMEM, "out of memory planning huge pages");
    for (int32_t s = 0; s < p->n_steps; s++) {
        if (p->steps[s].node < 0) continue;
        const af_node *n = af_graph_node(g, p->steps[s].node);
        if (n->n_outputs != 1 || af_op_get(n->op_id)->kind == AF_KIND_VIEW || !af_extern_can_write_into(p->externs[p->steps[s].node]))
            continue;
        int32_t v = n->first_output;
        const af_tensor_meta *m = &af_graph_value(g, v)->meta;
        if (m->type == AF_VALUE_TENSOR && m->device.type == AF_DEVICE_CPU && m->storage_offset == 0 &&
            (!p->donor || p->donor[v] < 0) && dense_bytes(m) >= p->huge_min)
            p->huge_state[v] = 1;
    }
    return AF_OK;
}

/* A fresh CPU tensor t of huge_min bytes or more, not yet written: its whole 2 MiB pages marked.
 * Only a dense one from offset 0, whose data spans exactly its bytes (no range outside it is marked). */
static int advise_fresh(af_program *p, af_obj *t, const af_tensor_meta *m) {
    if (!p->huge_min || m->type != AF_VALUE_TENSOR || m->device.type != AF_DEVICE_CPU || m->storage_offset != 0)
        return AF_OK;
    int64_t b = dense_bytes(m);
    if (b < p->huge_min) return AF_OK;
    void *ptr = NULL;
    int st = af_bridge_data_ptrs(&t, 1, &ptr);
    if (st == AF_OK && af_advise_huge_pages(ptr, b) > 0) p->huge_advised++;
    return st;
}

/* An extern step with huge pages for its result (huge_state 1): the result allocated and marked
 * here, written by the out= overload; the plain call where the overload refuses (then always). */
static int run_extern_huge(af_program *p, int32_t i) {
    int32_t v = af_graph_node(p->graph, i)->first_output;
    const af_tensor_meta *m = &af_graph_value(p->graph, v)->meta;
    af_obj *into = NULL;
    int st = af_bridge_empty_cached(m, &p->empty_args[v], &into);
    if (!st) st = advise_fresh(p, into, m);
    if (!st) st = af_extern_call_into(p->externs[i], p->values, into, &p->values[v]);
    af_obj_release(into);
    if (st != AF_BRIDGE_NOT_INTO) return st;
    p->huge_state[v] = -1;
    return af_extern_call(p->externs[i], p->values, &p->values[v]);
}

/* Kernel output v takes its donor's tensor (planned by plan_reuse), if the donor is still held
 * here only: the tensor itself when the layouts agree, else a reinterpretation of its storage.
 * The first run checks the donor's layout against its metadata; one that differs is never used. */
/* The first run checks the donor's tensor t against its planned layout dm: reuse_state 1 when it
 * has it, -1 (never reused) when not. */
static int check_donor_layout(af_program *p, int32_t v, af_obj *t, const af_tensor_meta *dm) {
    if (p->reuse_state[v] != 0) return AF_OK;
    void *ptr = NULL;
    int st = af_bridge_tensor_data(&t, &dm, 1, &ptr);
    /* its storage offset too: the taker's views count from its storage's start as its metadata says
     * (an as_strided of it at offset 1). ATen's functional copy keeps its argument's offset where
     * the trace says 0 (copy(v, v) of a view at offset 4): a kernel output that took it was read
     * back 4 elements off */
    int64_t offset = 0;
    if (st == AF_OK && (st = af_bridge_storage_offset(t, &offset)) == AF_OK && offset != dm->storage_offset)
        st = AF_BRIDGE_LAYOUT_MISMATCH;
    if (st == AF_BRIDGE_LAYOUT_MISMATCH) p->reuse_state[v] = -1, st = AF_OK;
    else if (st == AF_OK) p->reuse_state[v] = 1;
    return st;
}

static int take_donor(af_program *p, int32_t v, const af_tensor_meta *m) {
    int32_t d = p->donor[v];
    af_obj *t = p->values[d];
    if (!t) return AF_OK;
    p->values[d] = NULL;
    const af_tensor_meta *dm = &af_graph_value(p->graph, d)->meta;
    int st = check_donor_layout(p, v, t, dm);
    if (st == AF_OK && p->reuse_state[v] > 0 && p->check_inputs) {
        if (!af_obj_sole_ref(t)) {
            p->reuses_refused++;
        } else if (af_tensor_meta_same_layout(dm, m, 1)) {
            p->values[v] = t; /* the slot's reference moves */
            p->reuses_taken++;
            return AF_OK;
        } else if ((st = af_bridge_reinterpret(t, m, 0, &p->values[v])) == AF_OK) {
            p->reuses_taken++;
        }
    }
    af_obj_release(t);
    return st;
}

/* An extern step whose result takes its own first argument's tensor (in_place): that argument
 * stays in its slot for the call and is released after the step as planned; the plain call where
 * someone else holds the tensor, its layout is not the planned one, or the overload refuses. */
static int run_extern_in_place(af_program *p, int32_t i, int32_t v) {
    int32_t d = p->donor[v];
    af_obj *t = p->values[d];
    int st = t && p->check_inputs ? check_donor_layout(p, v, t, &af_graph_value(p->graph, d)->meta) : AF_OK;
    if (st) return st;
    if (t && p->check_inputs && p->reuse_state[v] > 0) {
        if (!af_obj_sole_ref(t)) {
            p->reuses_refused++;
        } else {
            af_obj_retain(t);
            st = af_extern_call_into(p->externs[i], p->values, t, &p->values[v]);
            af_obj_release(t);
            if (st != AF_BRIDGE_NOT_INTO) {
                p->reuses_taken += st == AF_OK;
                return st;
            }
            p->reuse_state[v] = -1;
        }
    }
    return af_extern_call(p->externs[i], p->values, &p->values[v]);
}

/* An extern step whose result takes a donor: the op's out= overload writes into the donor's
 * tensor; the plain call where there is none left, or the overload refuses (then always). */
static int run_extern_into(af_program *p, int32_t i) {
    int32_t v = af_graph_node(p->graph, i)->first_output;
    if (p->in_place[v]) return run_extern_in_place(p, i, v);
    int st = take_donor(p, v, &af_graph_value(p->graph, v)->meta);
    if (st) return st;
    af_obj *into = p->values[v];
    if (into) {
        p->values[v] = NULL;
        st = af_extern_call_into(p->externs[i], p->values, into, &p->values[v]);
        af_obj_release(into);
        if (st != AF_BRIDGE_NOT_INTO) return st;
        p->reuse_state[v] = -1;
    }
    return af_extern_call(p->externs[i], p->values, &p->values[v]);
}

/* Kernel output v written into its dying input's tensor (in_place 2), where this run finds the
 * input's data held by its slot alone and laid out as planned: v's slot then holds a new tensor on
 * its storage, the input's slot the input until its release after the step. Otherwise v is
 * allocated as usual. */
static int take_input_in_place(af_program *p, int32_t v) {
    int32_t d = p->donor[v];
    af_obj *t = p->values[d];
    if (!t || !p->check_inputs) return AF_OK;
    int st = check_donor_layout(p, v, t, &af_graph_value(p->graph, d)->meta);
    if (st || p->reuse_state[v] <= 0) return st;
    if (!af_obj_sole_owner(t)) {
        p->reuses_refused++;
        return AF_OK;
    }
    /* a tensor object of its own on d's storage, in v's layout: the output is never the input's
     * object (whose Python attributes and hooks are not the output's) */
    if ((st = af_bridge_reinterpret(t, &af_graph_value(p->graph, v)->meta, 0, &p->values[v]))) return st;
    p->reuses_taken++;
    return AF_OK;
}

/* Releases the donors a group's outputs would have taken (its nodes ran as extern calls); an
 * input written in place stays: the nodes read it. */
static void drop_donors(af_program *p, const af_fusion_group *grp) {
    for (int32_t k = 0; p->donor && k < grp->n_outputs; k++) {
        int32_t d = p->donor[grp->outputs[k]];
        if (d < 0 || p->in_place[grp->outputs[k]]) continue;
        af_obj_release(p->values[d]);
        p->values[d] = NULL;
    }
}

/* A kernel step; on a layout mismatch its nodes run as extern calls instead. */
static int run_kernel(af_program *p, int32_t gi) {
    const af_fusion_group *grp = &p->plan->groups[gi];
    int32_t ni = grp->n_inputs, no = grp->n_outputs;
    int st = AF_OK, folded = p->fold_state[gi] != 2;
    if (p->fold_state[gi] == 0 && (st = check_folded_views(p, gi))) return st;
    for (int32_t k = 0; k < ni; k++) { /* a folded view: its root, checked against the root's layout */
        int32_t v = p->fold_root[grp->inputs[k]] >= 0 ? p->fold_root[grp->inputs[k]] : grp->inputs[k];
        p->kernel_objs[k] = p->values[v];
        p->kernel_metas[k] = &af_graph_value(p->graph, v)->meta;
    }
    if (p->fold_state[gi] < 0) {
        st = AF_BRIDGE_LAYOUT_MISMATCH;
    } else { /* outputs first, so that one visit of the shim reads every operand's data pointer */
        for (int32_t k = 0; k < no; k++) {
            int32_t v = grp->outputs[k];
            const af_tensor_meta *m = &af_graph_value(p->graph, v)->meta;
            if (p->donor && p->donor[v] >= 0 && (st = p->in_place[v] ? take_input_in_place(p, v) : take_donor(p, v, m)))
                return st;
            if (!p->values[v] && ((st = af_bridge_empty_cached(m, &p->empty_args[v], &p->values[v])) ||
                                  (st = advise_fresh(p, p->values[v], m))))
                return st;
            p->kernel_objs[ni + k] = p->values[v];
            p->kernel_metas[ni + k] = m;
        }
        if (p->operands_checked[gi] && p->check_inputs) {
            st = af_bridge_data_ptrs(p->kernel_objs, ni + no, p->kernel_ptrs);
        } else {
            st = af_bridge_tensor_data(p->kernel_objs, p->kernel_metas, ni + no, p->kernel_ptrs);
            int scalar = 0;
            for (int32_t k = 0; k < ni + no; k++) scalar |= p->kernel_metas[k]->type != AF_VALUE_TENSOR || p->kernel_metas[k]->ndim == 0;
            if (st == AF_OK && p->check_inputs && !scalar) p->operands_checked[gi] = 1;
        }
        if (st == AF_BRIDGE_LAYOUT_MISMATCH)
            for (int32_t k = 0; k < no; k++) { /* the members run as ATen calls and make their own */
                af_obj_release(p->values[grp->outputs[k]]);
                p->values[grp->outputs[k]] = NULL;
            }
    }
    if (!st && folded)
        for (int32_t k = 0; k < ni; k++)
            if (p->fold_root[grp->inputs[k]] >= 0) p->kernel_ptrs[k] = (char *)p->kernel_ptrs[k] + p->fold_delta[grp->inputs[k]];
    if (st == AF_BRIDGE_LAYOUT_MISMATCH) {
        /* run the members one by one; values only the kernel would have held are dropped after */
        p->fallbacks++;
        drop_donors(p, grp);
        for (int32_t k = 0; k < ni; k++)
            if (p->fold_root[grp->inputs[k]] >= 0 && (st = materialize_view(p, grp->inputs[k]))) {
                drop_folded_views(p, grp);
                return st;
            }
        /* a recomputed member (another group's node) whose value exists is read as it is, and
         * left as it was; one computed here is dropped after, like the kernel's own temporaries */
        uint8_t *existed = calloc((size_t)grp->n_nodes + 1, 1);
        if (!existed) {
            drop_folded_views(p, grp);
            return af_error_set(AF_ERR_NOMEM, "out of memory running a kernel's nodes");
        }
        for (int32_t m = 0; m < grp->n_nodes; m++) {
            const af_node *n = af_graph_node(p->graph, grp->nodes[m]);
            if (p->plan->group_of_node[grp->nodes[m]] != gi && p->values[n->first_output]) {
                existed[m] = 1;
                continue;
            }
            if ((st = af_extern_call(p->externs[grp->nodes[m]], p->values, &p->values[n->first_output]))) {
                free(existed);
                drop_folded_views(p, grp);
                return st;
            }
        }
        drop_folded_views(p, grp);
        for (int32_t m = 0; m < grp->n_nodes; m++) {
            int32_t v = af_graph_node(p->graph, grp->nodes[m])->first_output;
            int keep = existed[m];
            for (int32_t k = 0; k < no && !keep; k++) keep = grp->outputs[k] == v;
            if (!keep) {
                af_obj_release(p->values[v]);
                p->values[v] = NULL;
            }
        }
        free(existed);
        return AF_OK;
    }
    if (st) return st;
    if (grp->device.type == AF_DEVICE_CUDA) return launch_cuda(p, gi);
    if (!p->have_threads) { /* the kernels use as many threads as torch's own ops */
        if ((st = af_bridge_num_threads(&p->num_threads))) return st;
        p->have_threads = 1;
    }
    int32_t b = p->ck->body_of[gi];
    af_bridge_run_kernel(p->body_fns[b], (char *const *)p->kernel_ptrs, p->ck->n_streams[gi] ? p->ck->streams[gi] : NULL,
                         p->ck->bodies[b].lits, p->num_threads);
    return AF_OK;
}

/* A checked view step: torch's reinterpretation of its input with the graph's layout, no dispatch
 * (a relative_view's from its first run). */
static int run_view(af_program *p, int32_t i) {
    const af_node *n = af_graph_node(p->graph, i);
    int32_t b = n->args[0].u.value, v = n->first_output, root = p->hold_root ? p->hold_root[b] : b;
    const af_tensor_meta *m = &af_graph_value(p->graph, v)->meta;
    return af_bridge_reinterpret_cached(p->values[b], m, m->storage_offset - af_graph_value(p->graph, root)->meta.storage_offset,
                                        &p->view_args[v], &p->values[v]);
}

static void count_reads(const af_arg *a, int ok, int32_t *readers, int32_t *readers_ok) {
    if (a->kind == AF_ARG_VALUE) {
        readers[a->u.value]++;
        readers_ok[a->u.value] += ok;
    } else if (a->kind == AF_ARG_LIST) {
        for (int32_t j = 0; j < a->u.list.n; j++) count_reads(&a->u.list.items[j], 0, readers, readers_ok);
    }
}

/* Which checked view steps are held (see af_program's held), once every view step is checked. A
 * held graph output (a plain one, whose layout is its root's) returns its root's tensor: only
 * where the root is neither a graph input nor another output, so no two outputs are one tensor. */
static int plan_holds(af_program *p) {
    const af_graph *g = p->graph;
    int32_t nn = af_graph_num_nodes(g), nv = af_graph_num_values(g), no = af_graph_num_outputs(g);
    for (int32_t i = 0; i < nn; i++)
        if (p->view_state[i] == 0) return AF_OK; /* not yet checked: plan after a run that checks it */
    int8_t *held = calloc((size_t)nn + 1, 1);
    int32_t *root = malloc(((size_t)nv + 1) * sizeof(int32_t));
    int32_t *readers = calloc((size_t)nv + 1, sizeof(int32_t)), *readers_ok = calloc((size_t)nv + 1, sizeof(int32_t));
    uint8_t *taken = calloc((size_t)nv + 1, 1); /* 1: a graph input or output, or an output's root */
    uint8_t *is_output = calloc((size_t)nv + 1, 1);
    if (!held || !root || !readers || !readers_ok || !taken || !is_output) {
        free(held);
        free(root);
        free(readers);
        free(readers_ok);
        free(taken);
        free(is_output);
        return af_error_set(AF_ERR_NOMEM, "out of memory planning a program");
    }
    for (int32_t v = 0; v < nv; v++) root[v] = v;
    for (int32_t k = 0; k < af_graph_num_inputs(g); k++) taken[af_graph_input(g, k)] = 1;
    for (int32_t o = 0; o < no; o++) {
        taken[af_graph_output(g, o)] = is_output[af_graph_output(g, o)] = 1;
        readers[af_graph_output(g, o)]++; /* an output is read by the caller: never ok */
    }
    for (int32_t i = 0; i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        for (int32_t a = 0; a < n->n_args; a++) count_reads(&n->args[a], p->view_state[i] > 0, readers, readers_ok);
    }
    for (int32_t i = 0; i < nn; i++) {
        if (p->view_state[i] <= 0) continue;
        const af_node *n = af_graph_node(g, i);
        int32_t b = n->args[0].u.value, v = n->first_output, r = root[b];
        int same = af_tensor_meta_same_layout(&af_graph_value(g, v)->meta, &af_graph_value(g, r)->meta, 0);
        if (is_output[v]) {
            if (!same || taken[r]) continue;
            taken[r] = 1;
        } else if (!same && (readers[v] == 0 || readers_ok[v] != readers[v])) {
            continue;
        }
        held[i] = 1;
        root[v] = r;
    }
    free(readers);
    free(readers_ok);
    free(taken);
    free(is_output);
    p->held = held;
    p->hold_root = root;
    return AF_OK;
}

/* After a view step's first ATen run: does ATen's view (and its input) have the graph's layout?
 * Then later runs reinterpret (layouts depend only on the checked inputs' layouts); else they
 * keep ATen's view. */
static int check_view(af_program *p, int32_t i) {
    const af_node *n = af_graph_node(p->graph, i);
    int32_t b = n->args[0].u.value, v = n->first_output;
    af_obj *objs[2] = {p->values[b], p->values[v]};
    const af_tensor_meta *metas[2] = {&af_graph_value(p->graph, b)->meta, &af_graph_value(p->graph, v)->meta};
    int st = af_bridge_same_view(objs, metas);
    if (st == AF_BRIDGE_LAYOUT_MISMATCH) {
        p->view_state[i] = -1;
        return AF_OK;
    }
    if (st) return st;
    p->view_state[i] = 1;
    return AF_OK;
}

/* as_strided reads its base's storage as the graph lays it out, and view/_unsafe_view need a
 * layout they can view: the bases made by the program (a kernel's output, or an ATen call's where
 * the kernel fell back or there is none) are checked against their metadata after the step making
 * them (the first run only, where they agree), and given that layout by a copy where ATen made
 * another. Seen: CPU batch norm over a transposed input returns a contiguous tensor where its meta
 * function keeps the input's strides, so the view after it failed. Not a base an ATen call may
 * return aliased to its input (a copy would break the alias); inputs are checked on entry. */
/* Marks value r for pin_layout (checked after the step making it); AF_ERR_NOMEM, set, on failure. */
static int pin_root(af_program *p, int32_t r) {
    if (!p->pin_state && !(p->pin_state = calloc((size_t)af_graph_num_values(p->graph) + 1, 1)))
        return af_error_set(AF_ERR_NOMEM, "out of memory planning a program");
    p->n_pinned += p->pin_state[r] == 0;
    p->pin_state[r] = 1;
    return AF_OK;
}

static int plan_pins(af_program *p) {
    const af_graph *g = p->graph;
    int32_t nn = af_graph_num_nodes(g);
    for (int32_t i = 0; i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        int viewing = n->op_id == AF_OP_VIEW || n->op_id == AF_OP_UNSAFE_VIEW;
        if ((n->op_id != AF_OP_AS_STRIDED && !viewing) || n->n_args < 1 || n->args[0].kind != AF_ARG_VALUE) continue;
        int32_t r = af_graph_view_root(g, n->args[0].u.value), prod = af_graph_value(g, r)->producer;
        if (prod < 0 || af_graph_value(g, r)->meta.type != AF_VALUE_TENSOR) continue; /* inputs: checked */
        if (viewing && af_extern_may_alias(p->externs[prod])) continue;
        int st = pin_root(p, r);
        if (st) return st;
    }
    /* The program's outputs too: a forward's saved tensors reach the backward's program, whose input
     * check holds them to their metadata. Seen: log_sigmoid_forward's buffer over a transposed input
     * is contiguous where its meta function keeps the input's strides (the backward failed). */
    for (int32_t k = 0; k < af_graph_num_outputs(g); k++) {
        int32_t o = af_graph_output(g, k);
        if (o < 0 || af_graph_value(g, o)->meta.type != AF_VALUE_TENSOR) continue;
        int32_t r = af_graph_view_root(g, o), prod = af_graph_value(g, r)->producer;
        if (prod < 0 || af_graph_value(g, r)->meta.type != AF_VALUE_TENSOR) continue;
        if (p->externs[prod] && af_extern_may_alias(p->externs[prod])) continue;
        int st = pin_root(p, r);
        if (st) return st;
    }
    return AF_OK;
}

static int pin_layout(af_program *p, int32_t v) {
    af_obj *t = p->values[v];
    if (!t || p->pin_state[v] == 0 || p->pin_state[v] == 2) return AF_OK;
    const af_tensor_meta *m = &af_graph_value(p->graph, v)->meta;
    void *ptr = NULL;
    int st = af_bridge_tensor_data(&t, &m, 1, &ptr);
    if (st != AF_BRIDGE_LAYOUT_MISMATCH) {
        if (!st && p->pin_state[v] == 1) p->pin_state[v] = 2, p->n_pinned--; /* checked: never again */
        return st;
    }
    af_obj *fresh = NULL;
    if ((st = af_bridge_empty(m, &fresh)) || (st = af_bridge_copy_into(fresh, t))) {
        af_obj_release(fresh);
        return st;
    }
    af_obj_release(t);
    p->values[v] = fresh;
    p->pin_state[v] = 3;
    return AF_OK;
}

/* After step s: its pinned results in their graph layout. */
static int pin_step(af_program *p, int32_t s) {
    if (p->steps[s].node >= 0) {
        const af_node *n = af_graph_node(p->graph, p->steps[s].node);
        for (int32_t k = 0; k < n->n_outputs; k++) {
            int st = pin_layout(p, n->first_output + k);
            if (st) return st;
        }
        return AF_OK;
    }
    const af_fusion_group *grp = &p->plan->groups[p->steps[s].group];
    for (int32_t k = 0; k < grp->n_outputs; k++) {
        int st = pin_layout(p, grp->outputs[k]);
        if (st) return st;
    }
    return AF_OK;
}

static void release_owned(af_obj *const *inputs, int32_t n, int owned) {
    for (int32_t i = 0; owned && inputs && i < n; i++) af_obj_release(inputs[i]);
}

static int run_program(af_program *p, af_obj *const *inputs, int32_t n_inputs, af_obj **outputs, int owned) {
    if (!p || (n_inputs > 0 && !inputs) || !outputs) {
        release_owned(inputs, n_inputs, owned);
        return af_error_set(AF_ERR_INVALID, "af_program_run: NULL argument");
    }
    const af_graph *g = p->graph;
    int32_t ni = af_graph_num_inputs(g), no = af_graph_num_outputs(g);
    int st = AF_OK;
    if (n_inputs != ni)
        st = af_error_set(AF_ERR_INVALID, "program takes %d inputs, got %d", (int)ni, (int)n_inputs);
    else if (p->running)
        st = af_error_set(AF_ERR_RUNTIME, "program is already running (re-entered from an extern call)");
    else if (p->check_inputs)
        st = af_bridge_check_tensors(inputs, p->input_metas, p->input_names, ni);
    if (!st && p->jit_pending) st = load_kernels(p);
    if (st) {
        release_owned(inputs, n_inputs, owned);
        return st;
    }
    p->running = 1;
    p->have_stream = 0;
    p->have_threads = 0;
    for (int32_t i = 0; i < ni; i++) {
        if (!owned) af_obj_retain(inputs[i]); /* owned: the program holds the caller's reference */
        p->values[p->input_ids[i]] = inputs[i];
    }
    struct timespec t0, t1;
    if (p->step_ns) {
        p->profiled_runs++;
        clock_gettime(CLOCK_MONOTONIC, &t0);
    }
    for (int32_t s = 0; s < p->n_steps; s++) {
        if (p->steps[s].node >= 0) {
            int32_t i = p->steps[s].node;
            const af_node *n = af_graph_node(g, i);
            if (p->held && p->held[i] && p->check_inputs) { /* the slot holds its root's tensor */
                p->values[n->first_output] = p->values[n->args[0].u.value];
                af_obj_retain(p->values[n->first_output]);
            } else if (p->donor && n->n_outputs == 1 && p->donor[n->first_output] >= 0) {
                st = run_extern_into(p, i);
            } else if (p->huge_state && n->n_outputs == 1 && p->huge_state[n->first_output] > 0) {
                st = run_extern_huge(p, i);
            } else {
                int relative = p->check_inputs && (p->view_state[i] > 0 || (p->view_state[i] == 0 && relative_view(n)));
                st = relative ? run_view(p, i) : af_extern_call(p->externs[i], p->values, &p->values[n->first_output]);
                if (!st && p->view_state[i] == 0) st = check_view(p, i);
            }
        } else {
            st = run_kernel(p, p->steps[s].group);
        }
        if (!st && p->n_pinned) st = pin_step(p, s);
        if (st) {
            release_all(p);
            p->running = 0;
            return st;
        }
        for (int32_t r = p->release_start[s]; r < p->release_start[s + 1]; r++) {
            if (p->donated && p->donated[p->release[r]]) continue; /* kept for the output taking it */
            af_obj_release(p->values[p->release[r]]);
            p->values[p->release[r]] = NULL;
        }
        /* host time, the releases after the step included (freeing a large tensor unmaps it on the
         * CPU: counted with the step that read it last, not the next one); a CUDA step's is its launch */
        if (p->step_ns) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            p->step_ns[s] += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
            t0 = t1;
        }
    }
    for (int32_t o = 0; o < no; o++) {
        outputs[o] = p->values[af_graph_output(g, o)];
        af_obj_retain(outputs[o]);
    }
    release_all(p);
    p->running = 0;
    if (!p->held && p->check_inputs && (st = plan_holds(p))) {
        for (int32_t o = 0; o < no; o++) {
            af_obj_release(outputs[o]);
            outputs[o] = NULL;
        }
        return st;
    }
    return AF_OK;
}

int af_program_run(af_program *p, af_obj *const *inputs, int32_t n_inputs, af_obj **outputs) {
    return run_program(p, inputs, n_inputs, outputs, 0);
}

int af_program_run_owned(af_program *p, af_obj *const *inputs, int32_t n_inputs, af_obj **outputs) {
    return run_program(p, inputs, n_inputs, outputs, 1);
}
