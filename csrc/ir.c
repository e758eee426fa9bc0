/* The IR: an arena-owned graph of values and nodes (see include/aotfuse/ir.h). */
#include "aotfuse/ir.h"

#include "aotfuse/strbuf.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena: bump allocation in chunks, freed all at once ---- */

typedef struct af_chunk {
    struct af_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} af_chunk;

typedef struct {
    af_chunk *head;
} af_arena;

static void *arena_alloc(af_arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 16384 ? n : 16384;
        af_chunk *c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static char *arena_strdup(af_arena *a, const char *s) {
    size_t n = strlen(s) + 1;
    char *p = arena_alloc(a, n);
    if (p) memcpy(p, s, n);
    return p;
}

static void arena_free(af_arena *a) {
    af_chunk *c = a->head;
    while (c) {
        af_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
}

/* ---- growable arrays of fixed-size elements (the graph's tables) ---- */

static int grow(void **items, int32_t *cap, int32_t need, size_t elem) {
    if (need <= *cap) return AF_OK;
    if (need > INT32_MAX / 2) return af_error_set(AF_ERR_INVALID, "graph too large");
    int32_t ncap = *cap ? *cap : 16;
    while (ncap < need) ncap *= 2;
    void *p = realloc(*items, (size_t)ncap * elem);
    if (!p) return af_error_set(AF_ERR_NOMEM, "out of memory growing a graph table");
    *items = p;
    *cap = ncap;
    return AF_OK;
}

struct af_graph {
    af_arena arena;
    af_value *values;
    int32_t n_values, cap_values;
    af_node *nodes;
    int32_t n_nodes, cap_nodes;
    int32_t *inputs;
    int32_t n_inputs, cap_inputs;
    int32_t *outputs;
    int32_t n_outputs;
};

int af_graph_new(af_graph **out) {
    if (!out) return af_error_set(AF_ERR_INVALID, "af_graph_new: out is NULL");
    af_graph *g = calloc(1, sizeof *g);
    if (!g) return af_error_set(AF_ERR_NOMEM, "out of memory allocating a graph");
    *out = g;
    return AF_OK;
}

void af_graph_free(af_graph *g) {
    if (!g) return;
    arena_free(&g->arena);
    free(g->values);
    free(g->nodes);
    free(g->inputs);
    free(g->outputs);
    free(g);
}

/* ---- names of enums ---- */

static const char *const dtype_names[AF_DTYPE_COUNT] = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32",
    "int16", "int8", "uint8", "bool", "complex64", "complex128", "uint64"};
static const int dtype_sizes[AF_DTYPE_COUNT] = {4, 8, 2, 2, 8, 4, 2, 1, 1, 1, 8, 16, 8};
static const char *const device_names[AF_DEVICE_COUNT] = {"cpu", "cuda", "meta"};
static const char *const dtype_short[AF_DTYPE_COUNT] = {
    "f32", "f64", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "b8", "c64", "c128", "u64"};

const char *af_dtype_name(af_dtype d) {
    return ((unsigned)d < AF_DTYPE_COUNT) ? dtype_names[d] : "invalid";
}

int af_dtype_itemsize(af_dtype d) { return ((unsigned)d < AF_DTYPE_COUNT) ? dtype_sizes[d] : 0; }

int af_dtype_parse(const char *name, af_dtype *out) {
    for (int i = 0; name && i < AF_DTYPE_COUNT; i++)
        if (strcmp(name, dtype_names[i]) == 0) {
            *out = (af_dtype)i;
            return AF_OK;
        }
    return af_error_set(AF_ERR_UNSUPPORTED, "unsupported dtype '%s'", name ? name : "(null)");
}

const char *af_device_type_name(af_device_type t) {
    return ((unsigned)t < AF_DEVICE_COUNT) ? device_names[t] : "invalid";
}

int af_device_type_parse(const char *name, af_device_type *out) {
    for (int i = 0; name && i < AF_DEVICE_COUNT; i++)
        if (strcmp(name, device_names[i]) == 0) {
            *out = (af_device_type)i;
            return AF_OK;
        }
    return af_error_set(AF_ERR_UNSUPPORTED, "unsupported device type '%s'", name ? name : "(null)");
}

int64_t af_tensor_meta_nbytes(const af_tensor_meta *m) {
    if (!m || m->type != AF_VALUE_TENSOR || (m->ndim > 0 && !m->sizes)) return 0;
    int64_t n = 1;
    for (int32_t d = 0; d < m->ndim; d++) {
        if (m->sizes[d] > 0 && n > INT64_MAX / 16 / m->sizes[d]) return INT64_MAX; /* saturate */
        n *= m->sizes[d];
    }
    return n * af_dtype_itemsize(m->dtype);
}

int64_t af_tensor_meta_numel(const af_tensor_meta *m) {
    int64_t n = 1;
    for (int32_t d = 0; m && d < m->ndim; d++) n *= m->sizes[d];
    return n;
}

int af_tensor_meta_same_layout(const af_tensor_meta *a, const af_tensor_meta *b, int exact) {
    if (a->dtype != b->dtype || a->ndim != b->ndim || a->storage_offset != b->storage_offset) return 0;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d] || ((exact || a->sizes[d] != 1) && a->strides[d] != b->strides[d])) return 0;
    return 1;
}

int af_tensor_meta_dense(const af_tensor_meta *m) {
    if (!m || m->type != AF_VALUE_TENSOR) return 0;
    int64_t numel = 1, block = 1;
    for (int32_t d = 0; d < m->ndim; d++) {
        if (m->sizes[d] <= 0 || (m->sizes[d] > 1 && m->strides[d] <= 0)) return 0;
        numel *= m->sizes[d];
    }
    for (int32_t k = 0; k < m->ndim; k++) { /* the dims longer than 1, smallest stride first */
        int32_t found = -1;
        for (int32_t d = 0; d < m->ndim && found < 0; d++)
            if (m->sizes[d] > 1 && m->strides[d] == block) found = d;
        if (found < 0) break;
        block *= m->sizes[found];
    }
    return block == numel;
}

int32_t af_graph_view_root(const af_graph *g, int32_t v) {
    for (;;) {
        const af_value *val = af_graph_value(g, v);
        const af_node *n = val && val->producer >= 0 ? af_graph_node(g, val->producer) : NULL;
        if (!n || af_op_get(n->op_id)->kind != AF_KIND_VIEW || n->n_args < 1 || n->args[0].kind != AF_ARG_VALUE) return v;
        v = n->args[0].u.value;
    }
}

/* ---- building ---- */

static int meta_check(const af_tensor_meta *m, const char *what) {
    if (!m) return af_error_set(AF_ERR_INVALID, "%s: metadata is NULL", what);
    if (m->type == AF_VALUE_OTHER) return AF_OK;
    if (m->type != AF_VALUE_TENSOR) return af_error_set(AF_ERR_INVALID, "%s: bad value type %d", what, (int)m->type);
    if ((unsigned)m->dtype >= AF_DTYPE_COUNT) return af_error_set(AF_ERR_INVALID, "%s: bad dtype %d", what, (int)m->dtype);
    if ((unsigned)m->device.type >= AF_DEVICE_COUNT)
        return af_error_set(AF_ERR_INVALID, "%s: bad device type %d", what, (int)m->device.type);
    if (m->ndim < 0 || m->ndim > AF_MAX_DIMS)
        return af_error_set(AF_ERR_INVALID, "%s: rank %d outside [0, %d]", what, (int)m->ndim, AF_MAX_DIMS);
    if (m->ndim > 0 && (!m->sizes || !m->strides))
        return af_error_set(AF_ERR_INVALID, "%s: rank %d without sizes or strides", what, (int)m->ndim);
    if (m->storage_offset < 0) return af_error_set(AF_ERR_INVALID, "%s: negative storage offset", what);
    for (int32_t d = 0; d < m->ndim; d++)
        if (m->sizes[d] < 0)
            return af_error_set(AF_ERR_INVALID, "%s: size %" PRId64 " of dim %d is negative", what, m->sizes[d], (int)d);
    return AF_OK;
}

/* Copies meta's arrays into the arena. */
static int meta_copy(af_arena *a, const af_tensor_meta *src, af_tensor_meta *dst) {
    *dst = *src;
    if (src->type != AF_VALUE_TENSOR || src->ndim == 0) {
        dst->sizes = dst->strides = NULL;
        if (src->type != AF_VALUE_TENSOR) dst->ndim = 0;
        return AF_OK;
    }
    int64_t *buf = arena_alloc(a, 2 * (size_t)src->ndim * sizeof(int64_t));
    if (!buf) return af_error_set(AF_ERR_NOMEM, "out of memory copying tensor metadata");
    memcpy(buf, src->sizes, (size_t)src->ndim * sizeof(int64_t));
    memcpy(buf + src->ndim, src->strides, (size_t)src->ndim * sizeof(int64_t));
    dst->sizes = buf;
    dst->strides = buf + src->ndim;
    return AF_OK;
}

static int value_append(af_graph *g, const char *name, const af_tensor_meta *meta, int32_t producer,
                        int32_t out_index, int32_t *id) {
    int st = grow((void **)&g->values, &g->cap_values, g->n_values + 1, sizeof(af_value));
    if (st) return st;
    af_value *v = &g->values[g->n_values];
    char auto_name[32];
    if (!name || !*name) {
        snprintf(auto_name, sizeof auto_name, "v%d", (int)g->n_values);
        name = auto_name;
    }
    v->name = arena_strdup(&g->arena, name);
    if (!v->name) return af_error_set(AF_ERR_NOMEM, "out of memory copying a value name");
    if ((st = meta_copy(&g->arena, meta, &v->meta))) return st;
    v->producer = producer;
    v->out_index = out_index;
    *id = g->n_values++;
    return AF_OK;
}

int af_graph_add_input(af_graph *g, const char *name, const af_tensor_meta *meta, int32_t *value_id) {
    if (!g || !value_id) return af_error_set(AF_ERR_INVALID, "af_graph_add_input: NULL argument");
    int st = meta_check(meta, "graph input");
    if (st) return st;
    if ((st = grow((void **)&g->inputs, &g->cap_inputs, g->n_inputs + 1, sizeof(int32_t)))) return st;
    int32_t id;
    if ((st = value_append(g, name, meta, -1, 0, &id))) return st;
    g->inputs[g->n_inputs++] = id;
    *value_id = id;
    return AF_OK;
}

/* Checks an argument tree against the graph's current values (depth bounds recursion). */
static int arg_check(const af_graph *g, const af_arg *arg, int depth, int32_t limit) {
    if (depth > 8) return af_error_set(AF_ERR_INVALID, "argument lists nested deeper than 8");
    switch (arg->kind) {
    case AF_ARG_VALUE:
        if (arg->u.value < 0 || arg->u.value >= limit)
            return af_error_set(AF_ERR_INVALID, "argument refers to value %d, but only %d are defined before it",
                                (int)arg->u.value, (int)limit);
        return AF_OK;
    case AF_ARG_NONE: case AF_ARG_BOOL: case AF_ARG_INT: case AF_ARG_FLOAT: case AF_ARG_COMPLEX:
        return AF_OK;
    case AF_ARG_STR: case AF_ARG_LAYOUT: case AF_ARG_MEMORY_FORMAT:
        return arg->u.s ? AF_OK : af_error_set(AF_ERR_INVALID, "string argument is NULL");
    case AF_ARG_DTYPE:
        return (unsigned)arg->u.dtype < AF_DTYPE_COUNT ? AF_OK
                                                        : af_error_set(AF_ERR_INVALID, "bad dtype argument %d", (int)arg->u.dtype);
    case AF_ARG_DEVICE:
        return (unsigned)arg->u.device.type < AF_DEVICE_COUNT ? AF_OK
                                                               : af_error_set(AF_ERR_INVALID, "bad device argument");
    case AF_ARG_LIST:
        if (arg->u.list.n < 0 || (arg->u.list.n > 0 && !arg->u.list.items))
            return af_error_set(AF_ERR_INVALID, "list argument with %d items and no storage", (int)arg->u.list.n);
        for (int32_t i = 0; i < arg->u.list.n; i++) {
            if (arg->u.list.items[i].name) return af_error_set(AF_ERR_INVALID, "a list item cannot have a keyword name");
            int st = arg_check(g, &arg->u.list.items[i], depth + 1, limit);
            if (st) return st;
        }
        return AF_OK;
    default:
        return af_error_set(AF_ERR_INVALID, "bad argument kind %d", (int)arg->kind);
    }
}

static int arg_copy(af_arena *a, const af_arg *src, af_arg *dst) {
    *dst = *src;
    if (src->name && !(dst->name = arena_strdup(a, src->name)))
        return af_error_set(AF_ERR_NOMEM, "out of memory copying an argument");
    if (src->kind == AF_ARG_LIST) dst->u.list.items = NULL; /* never keep the caller's pointer */
    if ((src->kind == AF_ARG_STR || src->kind == AF_ARG_LAYOUT || src->kind == AF_ARG_MEMORY_FORMAT) &&
        !(dst->u.s = arena_strdup(a, src->u.s)))
        return af_error_set(AF_ERR_NOMEM, "out of memory copying an argument");
    if (src->kind == AF_ARG_LIST && src->u.list.n > 0) {
        af_arg *items = arena_alloc(a, (size_t)src->u.list.n * sizeof(af_arg));
        if (!items) return af_error_set(AF_ERR_NOMEM, "out of memory copying a list argument");
        for (int32_t i = 0; i < src->u.list.n; i++) {
            int st = arg_copy(a, &src->u.list.items[i], &items[i]);
            if (st) return st;
        }
        dst->u.list.items = items;
    }
    return AF_OK;
}

int af_graph_add_node(af_graph *g, const char *op, const af_arg *args, int32_t n_args,
                      const af_tensor_meta *metas, int32_t n_outputs, int32_t *first_output) {
    if (!g || !first_output) return af_error_set(AF_ERR_INVALID, "af_graph_add_node: NULL argument");
    if (!op || !*op) return af_error_set(AF_ERR_INVALID, "node without an op name");
    if (n_args < 0 || (n_args > 0 && !args)) return af_error_set(AF_ERR_INVALID, "node %s: bad argument count %d", op, (int)n_args);
    if (n_outputs < 1 || !metas) return af_error_set(AF_ERR_INVALID, "node %s: needs at least one output", op);
    int st, keyword_seen = 0;
    for (int32_t i = 0; i < n_args; i++) {
        if ((st = arg_check(g, &args[i], 0, g->n_values)))
            return af_error_set(st, "node %s, argument %d: %s", op, (int)i, af_error_message());
        if (args[i].name) keyword_seen = 1;
        else if (keyword_seen)
            return af_error_set(AF_ERR_INVALID, "node %s: positional argument %d after a keyword", op, (int)i);
    }
    for (int32_t i = 0; i < n_outputs; i++)
        if ((st = meta_check(&metas[i], "node output")))
            return af_error_set(st, "node %s, output %d: %s", op, (int)i, af_error_message());
    if ((st = grow((void **)&g->nodes, &g->cap_nodes, g->n_nodes + 1, sizeof(af_node)))) return st;
    if ((st = grow((void **)&g->values, &g->cap_values, g->n_values + n_outputs, sizeof(af_value)))) return st;

    /* Arena memory taken below is not given back on a later failure; it is freed with the
     * graph, and the graph's tables are only changed once everything has succeeded. */
    af_node node = {0};
    node.op = arena_strdup(&g->arena, op);
    node.args = n_args ? arena_alloc(&g->arena, (size_t)n_args * sizeof(af_arg)) : NULL;
    if (!node.op || (n_args && !node.args)) return af_error_set(AF_ERR_NOMEM, "out of memory adding node %s", op);
    for (int32_t i = 0; i < n_args; i++)
        if ((st = arg_copy(&g->arena, &args[i], &node.args[i]))) return st;
    node.op_id = af_op_lookup(op);
    node.n_args = n_args;
    node.n_outputs = n_outputs;
    node.first_output = g->n_values;
    int32_t saved_n_values = g->n_values;
    for (int32_t i = 0; i < n_outputs; i++) {
        int32_t id;
        if ((st = value_append(g, NULL, &metas[i], g->n_nodes, i, &id))) {
            g->n_values = saved_n_values;
            return st;
        }
    }
    g->nodes[g->n_nodes++] = node;
    *first_output = node.first_output;
    return AF_OK;
}

int af_graph_set_outputs(af_graph *g, const int32_t *ids, int32_t n) {
    if (!g || n < 0 || (n > 0 && !ids)) return af_error_set(AF_ERR_INVALID, "af_graph_set_outputs: bad arguments");
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= g->n_values)
            return af_error_set(AF_ERR_INVALID, "graph output %d refers to value %d of %d", (int)i, (int)ids[i], (int)g->n_values);
    int32_t *copy = NULL;
    if (n > 0) {
        copy = malloc((size_t)n * sizeof(int32_t));
        if (!copy) return af_error_set(AF_ERR_NOMEM, "out of memory setting graph outputs");
        memcpy(copy, ids, (size_t)n * sizeof(int32_t));
    }
    free(g->outputs);
    g->outputs = copy;
    g->n_outputs = n;
    return AF_OK;
}

/* ---- reading ---- */

int32_t af_graph_num_inputs(const af_graph *g) { return g ? g->n_inputs : 0; }
int32_t af_graph_num_values(const af_graph *g) { return g ? g->n_values : 0; }
int32_t af_graph_num_nodes(const af_graph *g) { return g ? g->n_nodes : 0; }
int32_t af_graph_num_outputs(const af_graph *g) { return g ? g->n_outputs : 0; }

const af_value *af_graph_value(const af_graph *g, int32_t id) {
    return (g && id >= 0 && id < g->n_values) ? &g->values[id] : NULL;
}
const af_node *af_graph_node(const af_graph *g, int32_t i) {
    return (g && i >= 0 && i < g->n_nodes) ? &g->nodes[i] : NULL;
}
int32_t af_graph_input(const af_graph *g, int32_t i) { return (g && i >= 0 && i < g->n_inputs) ? g->inputs[i] : -1; }
int32_t af_graph_output(const af_graph *g, int32_t i) { return (g && i >= 0 && i < g->n_outputs) ? g->outputs[i] : -1; }

/* ---- verifying: everything a builder checks, re-checked over the whole graph ---- */

int af_graph_verify(const af_graph *g) {
    if (!g) return af_error_set(AF_ERR_INVALID, "graph is NULL");
    int st;
    int32_t seen_inputs = 0;
    for (int32_t id = 0; id < g->n_values; id++) {
        const af_value *v = &g->values[id];
        if ((st = meta_check(&v->meta, v->name))) return st;
        if (v->producer == -1) {
            if (seen_inputs >= g->n_inputs || g->inputs[seen_inputs] != id)
                return af_error_set(AF_ERR_INVALID, "value %s has no producer but is not an input", v->name);
            seen_inputs++;
            continue;
        }
        if (v->producer < 0 || v->producer >= g->n_nodes)
            return af_error_set(AF_ERR_INVALID, "value %s: producer %d is not a node", v->name, (int)v->producer);
        const af_node *p = &g->nodes[v->producer];
        if (v->out_index < 0 || v->out_index >= p->n_outputs || p->first_output + v->out_index != id)
            return af_error_set(AF_ERR_INVALID, "value %s: not output %d of its producer", v->name, (int)v->out_index);
    }
    if (seen_inputs != g->n_inputs) return af_error_set(AF_ERR_INVALID, "input list does not match input values");
    for (int32_t i = 0; i < g->n_nodes; i++) {
        const af_node *n = &g->nodes[i];
        if (!n->op || !*n->op) return af_error_set(AF_ERR_INVALID, "node %d has no op", (int)i);
        if (n->n_outputs < 1 || n->first_output < 0 || n->first_output + n->n_outputs > g->n_values)
            return af_error_set(AF_ERR_INVALID, "node %d (%s): bad outputs", (int)i, n->op);
        int keyword_seen = 0;
        for (int32_t a = 0; a < n->n_args; a++) {
            /* arguments may only use values defined before this node's own outputs */
            if ((st = arg_check(g, &n->args[a], 0, n->first_output)))
                return af_error_set(st, "node %d (%s), argument %d: %s", (int)i, n->op, (int)a, af_error_message());
            if (n->args[a].name) keyword_seen = 1;
            else if (keyword_seen)
                return af_error_set(AF_ERR_INVALID, "node %d (%s): positional argument %d after a keyword", (int)i, n->op, (int)a);
        }
    }
    for (int32_t i = 0; i < g->n_outputs; i++)
        if (g->outputs[i] < 0 || g->outputs[i] >= g->n_values)
            return af_error_set(AF_ERR_INVALID, "graph output %d refers to undefined value %d", (int)i, (int)g->outputs[i]);
    return AF_OK;
}

/* ---- printing ---- */

static void print_meta(af_strbuf *sb, const af_tensor_meta *m) {
    if (m->type != AF_VALUE_TENSOR) {
        af_strbuf_printf(sb, "other");
        return;
    }
    af_strbuf_printf(sb, "%s[", dtype_short[m->dtype]);
    for (int32_t d = 0; d < m->ndim; d++) af_strbuf_printf(sb, "%s%" PRId64, d ? ", " : "", m->sizes[d]);
    af_strbuf_printf(sb, "]");
    /* strides only when not contiguous, to keep listings short */
    int64_t expect = 1;
    int contiguous = 1;
    for (int32_t d = m->ndim - 1; d >= 0; d--) {
        if (m->sizes[d] != 1 && m->strides[d] != expect) contiguous = 0;
        expect *= m->sizes[d];
    }
    if (!contiguous) {
        af_strbuf_printf(sb, "{");
        for (int32_t d = 0; d < m->ndim; d++) af_strbuf_printf(sb, "%s%" PRId64, d ? ", " : "", m->strides[d]);
        af_strbuf_printf(sb, "}");
    }
    if (m->device.type != AF_DEVICE_CPU) {
        af_strbuf_printf(sb, "@%s", device_names[m->device.type]);
        if (m->device.index >= 0) af_strbuf_printf(sb, ":%d", (int)m->device.index);
    }
}

static void print_arg(af_strbuf *sb, const af_graph *g, const af_arg *a) {
    if (a->name) af_strbuf_printf(sb, "%s=", a->name);
    switch (a->kind) {
    case AF_ARG_VALUE: af_strbuf_printf(sb, "%%%s", g->values[a->u.value].name); break;
    case AF_ARG_NONE: af_strbuf_printf(sb, "None"); break;
    case AF_ARG_BOOL: af_strbuf_printf(sb, "%s", a->u.i ? "True" : "False"); break;
    case AF_ARG_INT: af_strbuf_printf(sb, "%" PRId64, a->u.i); break;
    case AF_ARG_FLOAT: af_strbuf_printf(sb, "%.9g", a->u.f); break;
    case AF_ARG_COMPLEX: af_strbuf_printf(sb, "(%.9g%+.9gj)", a->u.c.re, a->u.c.im); break;
    case AF_ARG_STR: af_strbuf_printf(sb, "'%s'", a->u.s); break;
    case AF_ARG_DTYPE: af_strbuf_printf(sb, "torch.%s", af_dtype_name(a->u.dtype)); break;
    case AF_ARG_DEVICE:
        af_strbuf_printf(sb, "device(%s", af_device_type_name(a->u.device.type));
        if (a->u.device.index >= 0) af_strbuf_printf(sb, ":%d", (int)a->u.device.index);
        af_strbuf_printf(sb, ")");
        break;
    case AF_ARG_LAYOUT: case AF_ARG_MEMORY_FORMAT: af_strbuf_printf(sb, "torch.%s", a->u.s); break;
    case AF_ARG_LIST:
        af_strbuf_printf(sb, "[");
        for (int32_t i = 0; i < a->u.list.n; i++) {
            if (i) af_strbuf_printf(sb, ", ");
            print_arg(sb, g, &a->u.list.items[i]);
        }
        af_strbuf_printf(sb, "]");
        break;
    default: af_strbuf_printf(sb, "<bad arg>"); break;
    }
}

int af_graph_print(const af_graph *g, char **text) {
    if (!g || !text) return af_error_set(AF_ERR_INVALID, "af_graph_print: NULL argument");
    af_strbuf sb = {0};
    af_strbuf_printf(&sb, "graph(");
    for (int32_t i = 0; i < g->n_inputs; i++) {
        const af_value *v = &g->values[g->inputs[i]];
        af_strbuf_printf(&sb, "%s%%%s: ", i ? ", " : "", v->name);
        print_meta(&sb, &v->meta);
    }
    af_strbuf_printf(&sb, "):\n");
    for (int32_t i = 0; i < g->n_nodes; i++) {
        const af_node *n = &g->nodes[i];
        af_strbuf_printf(&sb, "  ");
        for (int32_t o = 0; o < n->n_outputs; o++) {
            const af_value *v = &g->values[n->first_output + o];
            af_strbuf_printf(&sb, "%s%%%s: ", o ? ", " : "", v->name);
            print_meta(&sb, &v->meta);
        }
        af_strbuf_printf(&sb, " = %s(", n->op);
        for (int32_t a = 0; a < n->n_args; a++) {
            if (a) af_strbuf_printf(&sb, ", ");
            print_arg(&sb, g, &n->args[a]);
        }
        af_strbuf_printf(&sb, ")");
        if (n->op_id != AF_OP_UNKNOWN) af_strbuf_printf(&sb, "  # %s", af_op_kind_name(af_op_get(n->op_id)->kind));
        af_strbuf_printf(&sb, "\n");
    }
    af_strbuf_printf(&sb, "  return (");
    for (int32_t i = 0; i < g->n_outputs; i++)
        af_strbuf_printf(&sb, "%s%%%s", i ? ", " : "", g->values[g->outputs[i]].name);
    af_strbuf_printf(&sb, ")\n");
    return af_strbuf_finish(&sb, text);
}
