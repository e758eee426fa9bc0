/* Fusion planning (see include/aotfuse/fuse.h). */
#include "aotfuse/fuse.h"

#include <stdlib.h>
#include <string.h>

static int float_like(af_dtype d) {
    return d == AF_DTYPE_FLOAT32 || d == AF_DTYPE_FLOAT16 || d == AF_DTYPE_BFLOAT16 || d == AF_DTYPE_BOOL;
}

/* Keywords that do not change a pointwise op's value (the output meta already says dtype). */
static int harmless_keyword(const char *name) {
    static const char *const ok[] = {"dtype", "layout", "device", "pin_memory", "memory_format", "non_blocking"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (strcmp(name, ok[i]) == 0) return 1;
    return 0;
}

/* Highest $k an expression uses, or -1. */
static int expr_arity(const char *e) {
    int hi = -1;
    for (; *e; e++)
        if (e[0] == '$' && e[1] >= '0' && e[1] <= '9' && e[1] - '0' > hi) hi = e[1] - '0';
    return hi + 1;
}

/* A device the code generators target (CPU: C, CUDA: CUDA C). */
static int device_supported(af_device d) { return d.type == AF_DEVICE_CPU || d.type == AF_DEVICE_CUDA; }

static int same_device(af_device a, af_device b) { return a.type == b.type && a.index == b.index; }

static int float_only(af_dtype d);


/* slice_scatter(base, x, dim=0, start=None, end=None, step=1) with step 1 as a window. */
static int scatter_window(const af_graph *g, const af_node *n, af_window *w) {
    const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
    if (n->n_args < 2 || n->args[0].kind != AF_ARG_VALUE || n->args[1].kind != AF_ARG_VALUE || n->args[0].name ||
        n->args[1].name)
        return 0;
    const af_tensor_meta *base = &af_graph_value(g, n->args[0].u.value)->meta, *in = &af_graph_value(g, n->args[1].u.value)->meta;
    if (base->type != AF_VALUE_TENSOR || in->type != AF_VALUE_TENSOR || base->dtype != out->dtype || in->dtype != out->dtype ||
        !same_device(base->device, out->device) || !same_device(in->device, out->device) || base->ndim != out->ndim ||
        in->ndim != out->ndim || out->ndim < 1)
        return 0;
    for (int32_t d = 0; d < out->ndim; d++)
        if (base->sizes[d] != out->sizes[d]) return 0;
    int64_t dim = 0, start = 0, end = INT64_MAX, step = 1;
    int have_start = 0, have_end = 0;
    for (int32_t a = 2; a < n->n_args; a++) {
        const af_arg *arg = &n->args[a];
        const char *name = arg->name ? arg->name : a == 2 ? "dim" : a == 3 ? "start" : a == 4 ? "end" : a == 5 ? "step" : "";
        if (arg->kind == AF_ARG_NONE && (strcmp(name, "start") == 0 || strcmp(name, "end") == 0)) continue;
        if (arg->kind != AF_ARG_INT) return 0;
        if (strcmp(name, "dim") == 0) dim = arg->u.i;
        else if (strcmp(name, "start") == 0) start = arg->u.i, have_start = 1;
        else if (strcmp(name, "end") == 0) end = arg->u.i, have_end = 1;
        else if (strcmp(name, "step") == 0) step = arg->u.i;
        else return 0;
    }
    if (dim < 0) dim += out->ndim;
    if (dim < 0 || dim >= out->ndim || step != 1) return 0;
    int64_t size = out->sizes[dim];
    if (!have_start) start = 0;
    if (!have_end) end = size;
    if (start < 0) start += size;
    if (end < 0) end += size;
    start = start < 0 ? 0 : start > size ? size : start;
    end = end < start ? start : end > size ? size : end;
    memset(w, 0, sizeof *w);
    for (int32_t d = 0; d < out->ndim; d++) {
        if (in->sizes[d] != (d == dim ? end - start : out->sizes[d])) return 0;
        w->size[d] = in->sizes[d];
    }
    w->left[dim] = start;
    if (start > 0 || end < size) w->guard_mask = 1u << dim;
    w->source = n->args[1].u.value;
    w->source_arg = 1;
    w->base = n->args[0].u.value;
    return 1;
}

/* A box on every dim: box_scatter(base, src, starts), src covering [starts[d], starts[d] +
 * src.size[d]); box_fill(base, starts, sizes, value), the value covering [starts[d], starts[d] +
 * sizes[d]). Base outside. */
static int box_window(const af_graph *g, const af_node *n, af_window *w) {
    int fill = n->op_id == AF_OP_BOX_FILL;
    const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
    if (n->n_args != (fill ? 4 : 3) || n->args[0].kind != AF_ARG_VALUE) return 0;
    for (int32_t a = 0; a < n->n_args; a++)
        if (n->args[a].name) return 0;
    const af_arg *starts = &n->args[fill ? 1 : 2], *sizes = fill ? &n->args[2] : NULL, *value = fill ? &n->args[3] : NULL;
    if (starts->kind != AF_ARG_LIST || (sizes && sizes->kind != AF_ARG_LIST) ||
        (value && value->kind != AF_ARG_FLOAT && value->kind != AF_ARG_INT) || (!fill && n->args[1].kind != AF_ARG_VALUE))
        return 0;
    const af_tensor_meta *base = &af_graph_value(g, n->args[0].u.value)->meta;
    const af_tensor_meta *src = fill ? NULL : &af_graph_value(g, n->args[1].u.value)->meta;
    if (base->type != AF_VALUE_TENSOR || base->dtype != out->dtype || !same_device(base->device, out->device) ||
        base->ndim != out->ndim || out->ndim < 1 || starts->u.list.n != out->ndim || (sizes && sizes->u.list.n != out->ndim))
        return 0;
    if (src && (src->type != AF_VALUE_TENSOR || src->dtype != out->dtype || !same_device(src->device, out->device) ||
                src->ndim != out->ndim))
        return 0;
    memset(w, 0, sizeof *w);
    for (int32_t d = 0; d < out->ndim; d++) {
        const af_arg *s = &starts->u.list.items[d], *z = sizes ? &sizes->u.list.items[d] : NULL;
        if (s->kind != AF_ARG_INT || (z && z->kind != AF_ARG_INT)) return 0;
        int64_t size = z ? z->u.i : src->sizes[d];
        if (s->u.i < 0 || size < 0 || base->sizes[d] != out->sizes[d] || s->u.i + size > out->sizes[d]) return 0;
        w->left[d] = s->u.i;
        w->size[d] = size;
        if (size < out->sizes[d]) w->guard_mask |= 1u << d;
    }
    w->source = fill ? -1 : n->args[1].u.value;
    w->source_arg = fill ? -1 : 1;
    w->base = n->args[0].u.value;
    if (value) w->value = value->kind == AF_ARG_FLOAT ? value->u.f : (double)value->u.i;
    return 1;
}

/* A copy of a view of a window's value: clone(V(w)), V one to eight view nodes, w the output of a
 * padding, slice assignment or box. It is a window that pads nothing (source V(w) at the copy's own
 * index, no guard), so that the window's kernel can compute w itself at the element of w that V's
 * element is (a remapped source, see view_chain) instead of storing w for a copy kernel. */
static int copy_window(const af_graph *g, const af_node *n, af_window *w) {
    if (n->n_args < 1 || n->args[0].kind != AF_ARG_VALUE || n->args[0].name) return 0;
    for (int32_t a = 1; a < n->n_args; a++)
        if (!n->args[a].name || strcmp(n->args[a].name, "memory_format") != 0) return 0;
    const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta, *in = &af_graph_value(g, n->args[0].u.value)->meta;
    if (in->type != AF_VALUE_TENSOR || in->dtype != out->dtype || !same_device(in->device, out->device) ||
        in->ndim != out->ndim || in->ndim < 1)
        return 0;
    for (int32_t d = 0; d < in->ndim; d++)
        if (in->sizes[d] != out->sizes[d]) return 0;
    int32_t v = n->args[0].u.value, links = 0, p;
    for (; (p = af_graph_value(g, v)->producer) >= 0 && links <= 8; links++) {
        const af_node *link = af_graph_node(g, p);
        if (af_op_get(link->op_id)->kind != AF_KIND_VIEW || link->n_outputs != 1 || link->n_args < 1 ||
            link->args[0].kind != AF_ARG_VALUE)
            break;
        v = link->args[0].u.value;
    }
    if (links == 0 || links > 8 || p < 0) return 0;
    int32_t op = af_graph_node(g, p)->op_id;
    if ((op != AF_OP_CONSTANT_PAD_ND && op != AF_OP_SLICE_SCATTER && op != AF_OP_BOX_SCATTER && op != AF_OP_BOX_FILL) ||
        !af_fuse_window(g, p, NULL))
        return 0;
    memset(w, 0, sizeof *w);
    for (int32_t d = 0; d < in->ndim; d++) w->size[d] = in->sizes[d];
    w->source = n->args[0].u.value;
    w->source_arg = 0;
    w->base = -1;
    return 1;
}

int af_fuse_window(const af_graph *g, int32_t index, af_window *w) {
    const af_node *n = af_graph_node(g, index);
    if (!n || n->n_outputs != 1) return 0;
    if (n->op_id == AF_OP_SLICE_SCATTER || n->op_id == AF_OP_BOX_SCATTER || n->op_id == AF_OP_BOX_FILL) {
        const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
        if (out->type != AF_VALUE_TENSOR || !float_only(out->dtype) || !device_supported(out->device)) return 0;
        af_window sw;
        if (!(n->op_id == AF_OP_SLICE_SCATTER ? scatter_window(g, n, &sw) : box_window(g, n, &sw))) return 0;
        if (w) *w = sw;
        return 1;
    }
    if (n->op_id == AF_OP_CLONE) {
        const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
        af_window cw;
        if (out->type != AF_VALUE_TENSOR || !float_only(out->dtype) || !device_supported(out->device) ||
            !copy_window(g, n, &cw))
            return 0;
        if (w) *w = cw;
        return 1;
    }
    if (n->op_id != AF_OP_CONSTANT_PAD_ND || n->n_args < 2 || n->n_args > 3) return 0;
    const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
    if (out->type != AF_VALUE_TENSOR || !float_only(out->dtype) || !device_supported(out->device)) return 0;
    const af_arg *x = &n->args[0], *pad = &n->args[1];
    if (x->kind != AF_ARG_VALUE || x->name || pad->kind != AF_ARG_LIST || pad->name) return 0;
    const af_tensor_meta *in = &af_graph_value(g, x->u.value)->meta;
    if (in->type != AF_VALUE_TENSOR || in->dtype != out->dtype || !same_device(in->device, out->device) ||
        in->ndim != out->ndim || pad->u.list.n % 2 || pad->u.list.n > 2 * in->ndim)
        return 0;
    af_window wv;
    memset(&wv, 0, sizeof wv);
    wv.source = x->u.value;
    wv.base = -1;
    if (n->n_args == 3) {
        const af_arg *v = &n->args[2];
        if ((v->name && strcmp(v->name, "value") != 0) || (v->kind != AF_ARG_FLOAT && v->kind != AF_ARG_INT)) return 0;
        wv.value = v->kind == AF_ARG_FLOAT ? v->u.f : (double)v->u.i;
    }
    for (int32_t d = 0; d < in->ndim; d++) {
        int32_t j = in->ndim - 1 - d; /* pad lists the last dim first: (left, right) pairs */
        int64_t l = 0, r = 0;
        if (2 * j + 1 < pad->u.list.n) {
            const af_arg *a = &pad->u.list.items[2 * j], *b = &pad->u.list.items[2 * j + 1];
            if (a->kind != AF_ARG_INT || b->kind != AF_ARG_INT) return 0;
            l = a->u.i;
            r = b->u.i;
        }
        if (in->sizes[d] + l + r != out->sizes[d]) return 0;
        wv.left[d] = l;
        wv.size[d] = in->sizes[d];
        if (l > 0 || r > 0) wv.guard_mask |= 1u << d; /* a size-1 dim too: its coordinate is 0 */
    }
    if (w) *w = wv;
    return 1;
}

int af_fuse_node_ok(const af_graph *g, int32_t index) {
    const af_node *n = af_graph_node(g, index);
    if (!n) return 0;
    if (n->op_id == AF_OP_CONSTANT_PAD_ND || n->op_id == AF_OP_SLICE_SCATTER || n->op_id == AF_OP_BOX_SCATTER ||
        n->op_id == AF_OP_BOX_FILL)
        return af_fuse_window(g, index, NULL);
    const af_op_info *info = af_op_get(n->op_id);
    if (n->op_id == AF_OP_FULL) { /* full(size, value, dtype=, layout=, device=, pin_memory=): a fill */
        const af_value *out = af_graph_value(g, n->first_output);
        if (n->n_outputs != 1 || n->n_args < 2 || out->meta.type != AF_VALUE_TENSOR || !float_like(out->meta.dtype) ||
            !device_supported(out->meta.device))
            return 0;
        const af_arg *size = &n->args[0], *value = &n->args[1];
        if (size->kind != AF_ARG_LIST || size->name || size->u.list.n != out->meta.ndim || value->name ||
            (value->kind != AF_ARG_FLOAT && value->kind != AF_ARG_INT && value->kind != AF_ARG_BOOL))
            return 0;
        for (int32_t d = 0; d < out->meta.ndim; d++)
            if (size->u.list.items[d].kind != AF_ARG_INT || size->u.list.items[d].u.i != out->meta.sizes[d]) return 0;
        for (int32_t a = 2; a < n->n_args; a++) {
            if (!n->args[a].name || !harmless_keyword(n->args[a].name)) return 0;
            if (n->args[a].kind == AF_ARG_DEVICE && n->args[a].u.device.type != out->meta.device.type) return 0;
        }
        return 1;
    }
    if (info->kind != AF_KIND_POINTWISE || !info->c_expr || n->n_outputs != 1) return 0;
    const af_value *out = af_graph_value(g, n->first_output);
    if (out->meta.type != AF_VALUE_TENSOR || !float_like(out->meta.dtype) || !device_supported(out->meta.device))
        return 0;
    int arity = expr_arity(info->c_expr), tensors = 0;
    for (int32_t a = 0; a < n->n_args; a++) {
        const af_arg *arg = &n->args[a];
        if (arg->name) {
            if (!harmless_keyword(arg->name)) return 0;
            if (arg->kind == AF_ARG_DEVICE && arg->u.device.type != out->meta.device.type) return 0;
            continue;
        }
        if (a >= arity) { /* a positional argument the expression ignores: only a target dtype may be */
            /* rng_uniform's size, and its stream (a small int added to the seed) */
            if (arg->kind != AF_ARG_DTYPE && !(n->op_id == AF_OP_RNG_UNIFORM && (arg->kind == AF_ARG_LIST ||
                                                                                   (a == 2 && arg->kind == AF_ARG_INT &&
                                                                                    arg->u.i >= 0 && arg->u.i < (INT64_C(1) << 31)))))
                return 0;
            continue;
        }
        if (arg->kind == AF_ARG_VALUE && n->op_id == AF_OP_RNG_UNIFORM) { /* the seed: an int64 scalar tensor */
            const af_value *v = af_graph_value(g, arg->u.value);
            if (v->meta.type != AF_VALUE_TENSOR || v->meta.dtype != AF_DTYPE_INT64 || v->meta.ndim != 0 ||
                !same_device(v->meta.device, out->meta.device) || out->meta.dtype != AF_DTYPE_FLOAT32)
                return 0;
            tensors++;
        } else if (arg->kind == AF_ARG_VALUE) {
            const af_value *v = af_graph_value(g, arg->u.value);
            /* one device per node (a CPU scalar tensor beside CUDA tensors stays an extern) */
            if (v->meta.type != AF_VALUE_TENSOR || !float_like(v->meta.dtype) || !same_device(v->meta.device, out->meta.device))
                return 0;
            tensors++;
        } else if (arg->kind != AF_ARG_FLOAT && arg->kind != AF_ARG_INT && arg->kind != AF_ARG_BOOL) {
            return 0;
        }
    }
    int32_t positional = 0;
    while (positional < n->n_args && !n->args[positional].name) positional++;
    return positional >= arity && tensors > 0;
}

static int float_only(af_dtype d) {
    return d == AF_DTYPE_FLOAT32 || d == AF_DTYPE_FLOAT16 || d == AF_DTYPE_BFLOAT16;
}

int af_fuse_reduction_ok(const af_graph *g, int32_t index, uint32_t *mask_out) {
    const af_node *n = af_graph_node(g, index);
    if (!n || n->n_outputs != 1 || n->n_args < 1) return 0;
    if (n->op_id != AF_OP_SUM && n->op_id != AF_OP_MEAN && n->op_id != AF_OP_AMAX && n->op_id != AF_OP_AMIN) return 0;
    const af_value *out = af_graph_value(g, n->first_output);
    if (out->meta.type != AF_VALUE_TENSOR || !float_only(out->meta.dtype) || !device_supported(out->meta.device)) return 0;
    if (n->args[0].kind != AF_ARG_VALUE || n->args[0].name) return 0;
    const af_tensor_meta *in = &af_graph_value(g, n->args[0].u.value)->meta;
    if (in->type != AF_VALUE_TENSOR || !float_only(in->dtype) || !same_device(in->device, out->meta.device) || in->ndim > 30)
        return 0;
    if (af_tensor_meta_numel(in) == 0) return 0;
    uint32_t mask = 0;
    int keepdim = 0, have_dims = 0;
    for (int32_t a = 1; a < n->n_args; a++) {
        const af_arg *arg = &n->args[a];
        const char *name = arg->name;
        if ((!name && a == 1) || (name && strcmp(name, "dim") == 0)) {
            if (arg->kind == AF_ARG_NONE) continue;
            if (arg->kind == AF_ARG_INT) { /* a single dim */
                int64_t d = arg->u.i < 0 ? arg->u.i + in->ndim : arg->u.i;
                if (d < 0 || d >= in->ndim) return 0;
                mask |= 1u << d;
                have_dims = 1;
                continue;
            }
            if (arg->kind != AF_ARG_LIST) return 0;
            for (int32_t k = 0; k < arg->u.list.n; k++) {
                if (arg->u.list.items[k].kind != AF_ARG_INT) return 0;
                int64_t d = arg->u.list.items[k].u.i;
                d = d < 0 ? d + in->ndim : d;
                if (d < 0 || d >= in->ndim) return 0;
                mask |= 1u << d;
                have_dims = 1;
            }
        } else if ((!name && a == 2) || (name && strcmp(name, "keepdim") == 0)) {
            if (arg->kind != AF_ARG_BOOL) return 0;
            keepdim = (int)arg->u.i;
        } else if (!(name && strcmp(name, "dtype") == 0)) {
            return 0;
        }
    }
    if (!have_dims) mask = in->ndim >= 32 ? 0 : (uint32_t)((1ull << in->ndim) - 1); /* no dims or []: all */
    /* the output must be the input with those dims removed (or kept as 1) */
    int32_t od = 0;
    for (int32_t d = 0; d < in->ndim; d++) {
        if (mask & (1u << d)) {
            if (keepdim && (od >= out->meta.ndim || out->meta.sizes[od++] != 1)) return 0;
        } else if (od >= out->meta.ndim || out->meta.sizes[od++] != in->sizes[d]) {
            return 0;
        }
    }
    if (od != out->meta.ndim) return 0;
    if (mask_out) *mask_out = mask;
    return 1;
}

static int same_shape(const af_tensor_meta *a, const af_tensor_meta *b) {
    if (a->ndim != b->ndim) return 0;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d]) return 0;
    return 1;
}

void af_fuse_plan_free(af_fusion_plan *plan) {
    if (!plan) return;
    for (int32_t i = 0; plan->groups && i < plan->n_groups; i++) {
        free(plan->groups[i].nodes);
        free(plan->groups[i].inputs);
        free(plan->groups[i].outputs);
        free(plan->groups[i].window_of);
    }
    free(plan->groups);
    free(plan->group_of_node);
    free(plan);
}

/* Appends x to a malloc'd array of *n (grown by doubling at powers of two). */
static int push(int32_t **arr, int32_t *n, int32_t x) {
    if ((*n & (*n - 1)) == 0) {
        int32_t cap = *n ? *n * 2 : 4;
        int32_t *p = realloc(*arr, (size_t)cap * sizeof(int32_t));
        if (!p) return af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
        *arr = p;
    }
    (*arr)[(*n)++] = x;
    return AF_OK;
}

static int contains(const int32_t *arr, int32_t n, int32_t x) {
    for (int32_t i = 0; i < n; i++)
        if (arr[i] == x) return 1;
    return 0;
}

/* A column reduction of a CPU tensor (its innermost dim longer than 1 kept: a bias gradient's sum
 * over rows) gets a kernel even alone: measured alone, the generated kernel takes 0.77-1.01x of
 * ATen's sum's time (benchmarks/results/lone-column-sums-2026-12-01.md) and its step costs less
 * host time than ATen's call. Row and full reductions alone measured no faster than ATen's and stay
 * its calls, as do CUDA's (its two-pass column kernels are not yet timed against ATen's). */
static int lone_column_ok(const af_graph *g, int32_t i) {
    uint32_t mask = 0;
    if (!af_fuse_reduction_ok(g, i, &mask)) return 0;
    const af_node *n = af_graph_node(g, i);
    const af_tensor_meta *in = &af_graph_value(g, n->args[0].u.value)->meta;
    if (in->device.type != AF_DEVICE_CPU || in->ndim < 1) return 0;
    int32_t inner = in->ndim - 1;
    while (inner > 0 && in->sizes[inner] == 1) inner--;
    return in->sizes[inner] > 1 && !((mask >> inner) & 1u);
}

static int32_t find_root(int32_t *parent, int32_t x) {
    while (parent[x] != x) {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    return x;
}

/* May a pointwise member iterating over `iter` read reduction result r (of its own group, reducing
 * `mask` of iter) in the same kernel, as an epilogue? The C backend runs such a group in phases (a
 * pass over each row per phase, later phases reading the finished reductions of earlier ones); r
 * must broadcast back over iter as the row's value: right-aligned, kept dims equal, reduced dims 1
 * or absent in front. Both backends have phased kernels (a CUDA row is a warp's or a block's). */
static int epilogue_ok(const af_tensor_meta *r, const af_tensor_meta *iter, uint32_t mask) {
    if (!mask || r->ndim > iter->ndim) return 0;
    /* rows only: the innermost dim reduced (softmax, norms); a kept innermost dim (bias gradients)
     * runs column-wise, which has no phases */
    int32_t inner = iter->ndim - 1;
    while (inner > 0 && iter->sizes[inner] == 1) inner--;
    if (inner < 0 || !((mask >> inner) & 1u)) return 0;
    int32_t shift = iter->ndim - r->ndim;
    for (int32_t d = 0; d < iter->ndim; d++) {
        int reduced = (mask >> d) & 1u, rd = d - shift;
        if (rd < 0) {
            if (!reduced && iter->sizes[d] != 1) return 0;
        } else if (r->sizes[rd] != (reduced ? 1 : iter->sizes[d])) {
            return 0;
        }
    }
    return 1;
}

/* Does node n (of `kind`, iterating over `shape`) read a reduction result of group `root` that it
 * cannot read as an epilogue? (It would need the finished reduction inside the loop computing it.) */
static int reads_reduction_of(const af_graph *g, const af_node *n, int kind, const af_tensor_meta *shape,
                              const int32_t *value_group, const uint8_t *is_reduced, int32_t *parent, int32_t root,
                              uint32_t mask) {
    for (int32_t a = 0; a < n->n_args; a++) {
        if (n->args[a].kind != AF_ARG_VALUE) continue;
        int32_t v = n->args[a].u.value;
        if (is_reduced[v] && value_group[v] >= 0 && find_root(parent, value_group[v]) == root &&
            !(kind == 1 && epilogue_ok(&af_graph_value(g, v)->meta, shape, mask)))
            return 1;
    }
    return 0;
}

static void close_group(uint8_t *closed, const int32_t *dep, int32_t *parent, int32_t q);
static int depends_on(const int32_t *dep, int32_t *parent, int32_t q, int32_t r);

/* Adds one to n_reads[v] for every read of v in a (lists included). */
static void count_arg_reads(const af_arg *a, int32_t *n_reads) {
    if (a->kind == AF_ARG_VALUE) n_reads[a->u.value]++;
    else if (a->kind == AF_ARG_LIST)
        for (int32_t i = 0; i < a->u.list.n; i++) count_arg_reads(&a->u.list.items[i], n_reads);
}

/* 1: node i is a pointwise kernel member, 2: a reduction (*mask: its reduced dims), 0: neither, or
 * on a device without kernels here. */
static int fuse_kind(const af_graph *g, int32_t i, uint32_t devices, uint32_t *mask) {
    int kind = af_fuse_node_ok(g, i) ? 1 : af_fuse_reduction_ok(g, i, mask) ? 2 : 0;
    if (kind && !((devices >> af_graph_value(g, af_graph_node(g, i)->first_output)->meta.device.type) & 1u)) kind = 0;
    return kind;
}

static void mark_arg_values(const af_arg *a, uint8_t *mark) {
    if (a->kind == AF_ARG_VALUE) mark[a->u.value] = 1;
    else if (a->kind == AF_ARG_LIST)
        for (int32_t i = 0; i < a->u.list.n; i++) mark_arg_values(&a->u.list.items[i], mark);
}

/* Whether window member i (w) can compute its source in its kernel: x, the value of provisional
 * group gs (w's source itself, or with `remap` the value w's source views: see view_chain), whose
 * group is open (with `remap` closed only by the views, which absorbable's read count below
 * shows), pointwise or windows (no reduction, random node, recompute or dependence), and no value
 * of gs is returned or read by any node outside gs but x, once: by i as its source, or by the
 * chain's first view. gs's nodes (before i, in graph order) go into members[] (*n_members): its
 * pointwise nodes and windows, and the views of its own remapped windows. */
static int absorbable(const af_graph *g, int32_t i, const af_window *w, int32_t x, int remap, int32_t gs, int32_t *parent,
                      const int32_t *prov_of_node, const uint8_t *closed, const uint32_t *gmask, const int32_t *dep,
                      const int32_t *n_clones, const int32_t *n_reads, const uint8_t *is_output, const int32_t *window_of_node,
                      int32_t *members, int32_t *n_members) {
    const af_node *win = af_graph_node(g, i);
    *n_members = 0;
    if ((closed[gs] && !remap) || gmask[gs] || dep[gs] >= 0 || n_clones[gs]) return 0;
    for (int32_t a = 0; a < win->n_args && !remap; a++) /* the window reads the source as its source only */
        if (a != w->source_arg && win->args[a].kind == AF_ARG_VALUE && win->args[a].u.value == w->source) return 0;
    for (int32_t j = 0; j < i; j++)
        if (prov_of_node[j] >= 0 && find_root(parent, prov_of_node[j]) == gs) members[(*n_members)++] = j;
    for (int32_t k = 0; k < *n_members; k++) {
        const af_node *n = af_graph_node(g, members[k]);
        int32_t u = n->first_output, inside = u == x;
        int view = window_of_node[members[k]] >= 0 && af_op_get(n->op_id)->kind == AF_KIND_VIEW;
        if (n->n_outputs != 1 || n->op_id == AF_OP_RNG_UNIFORM || (!view && af_fuse_node_ok(g, members[k]) != 1) || is_output[u])
            return 0;
        for (int32_t m = 0; m < *n_members; m++) {
            const af_node *r = af_graph_node(g, members[m]);
            for (int32_t a = 0; a < r->n_args; a++) inside += r->args[a].kind == AF_ARG_VALUE && r->args[a].u.value == u;
        }
        if (inside != n_reads[u]) return 0;
    }
    return *n_members > 0;
}

/* The longest chain of views a window reads its source through (view_chain). */
#define AF_REMAP_MAX 8

/* A window's source v read through views: v made from x by a chain of view nodes (each one
 * tensor in and out, same dtype and device), every value of it and x itself read once (by the
 * next link, the window at the end) and not returned, x dense and made by a node, and every link
 * laid out as ATen's rule for it says (af_views_as_declared: the kernel computes the view's element
 * from the metadata, and nothing checks it at run time). Returns x (the
 * chain's nodes in chain[], the last view first) or -1. The window's kernel may then compute x
 * itself, at the element of x's storage v's element views (remapped members). */
static int32_t view_chain(const af_graph *g, int32_t v, const int32_t *n_reads, const uint8_t *is_output, int32_t *chain,
                          int32_t *n_chain) {
    const af_tensor_meta *vm = &af_graph_value(g, v)->meta;
    const int32_t v0 = v;
    *n_chain = 0;
    for (;;) {
        int32_t p = af_graph_value(g, v)->producer;
        if (p < 0 || is_output[v] || n_reads[v] != 1) return -1;
        const af_node *n = af_graph_node(g, p);
        if (af_op_get(n->op_id)->kind != AF_KIND_VIEW) break;
        if (*n_chain == AF_REMAP_MAX || n->n_outputs != 1 || n->n_args < 1 || n->args[0].kind != AF_ARG_VALUE || n->args[0].name)
            return -1;
        for (int32_t a = 1; a < n->n_args; a++)
            if (n->args[a].kind == AF_ARG_VALUE) return -1;
        const af_tensor_meta *in = &af_graph_value(g, n->args[0].u.value)->meta;
        if (in->type != AF_VALUE_TENSOR || in->dtype != vm->dtype || !same_device(in->device, vm->device)) return -1;
        chain[(*n_chain)++] = p;
        v = n->args[0].u.value;
    }
    const af_tensor_meta *xm = &af_graph_value(g, v)->meta;
    int64_t last = vm->storage_offset; /* the view's elements all lie in x's */
    for (int32_t d = 0; d < vm->ndim; d++) {
        if (vm->sizes[d] == 0 || vm->strides[d] < 0) return -1;
        last += (vm->sizes[d] - 1) * vm->strides[d];
    }
    if (*n_chain == 0 || !af_tensor_meta_dense(xm) || vm->storage_offset < xm->storage_offset ||
        last - xm->storage_offset >= af_tensor_meta_numel(xm) || !af_views_as_declared(g, v0, v))
        return -1;
    /* x a copy (of a permuted tensor, say) and the view's last dim (the kernel's row) running
     * across rows of x: each element's coordinates in x a division and a remainder, and its load
     * from the copy's source a gather (GPT2's q, k, v gradients, each a copy of its heads viewed as
     * [b, t, h * d], joined by a cat: 6x the time of copying them first). Pads and other windows
     * viewed so (Longformer's chunking) stay remapped: measured faster so. */
    int32_t inner = vm->ndim - 1;
    while (inner > 0 && vm->sizes[inner] == 1) inner--;
    if (vm->ndim > 0 && xm->ndim > 0 && vm->strides[inner] == 1 && vm->sizes[inner] > xm->sizes[xm->ndim - 1] &&
        af_graph_node(g, af_graph_value(g, v)->producer)->op_id == AF_OP_CLONE)
        return -1;
    return v;
}

/* A read from another group closes it (and what it runs after), except a read by a group that runs
 * after it anyway (its dep). */
static void mark_reads(const af_arg *a, const int32_t *value_group, int32_t *parent, int32_t reader_group, uint8_t *closed,
                       const int32_t *dep) {
    if (a->kind == AF_ARG_VALUE) {
        int32_t gidx = value_group[a->u.value], r = gidx >= 0 ? find_root(parent, gidx) : -1;
        if (r >= 0 && r != reader_group && !(reader_group >= 0 && depends_on(dep, parent, reader_group, r)))
            close_group(closed, dep, parent, r);
    } else if (a->kind == AF_ARG_LIST) {
        for (int32_t i = 0; i < a->u.list.n; i++) mark_reads(&a->u.list.items[i], value_group, parent, reader_group, closed, dep);
    }
}

/* Any read from outside a value's group (lists included) makes the value a group output. */
static int materialize_reads(af_fusion_plan *plan, const af_arg *a, const int32_t *value_group, int32_t reader) {
    if (a->kind == AF_ARG_LIST) {
        for (int32_t j = 0; j < a->u.list.n; j++) {
            int st = materialize_reads(plan, &a->u.list.items[j], value_group, reader);
            if (st) return st;
        }
        return AF_OK;
    }
    if (a->kind != AF_ARG_VALUE) return AF_OK;
    int32_t gi = value_group[a->u.value];
    if (gi < 0 || gi == reader) return AF_OK;
    af_fusion_group *grp = &plan->groups[gi];
    return contains(grp->outputs, grp->n_outputs, a->u.value) ? AF_OK : push(&grp->outputs, &grp->n_outputs, a->u.value);
}

/* Recomputed producers. A reduction under another mask than its input's group (a layer norm's
 * weight gradient, a column sum of `g * xhat`, where xhat and the product sit in the norm's row
 * kernel) would otherwise run alone on a materialized input. Instead its group recomputes the
 * input from what that group reads: the pointwise members of group `root` that x depends on (the
 * cone) are evaluated again in the reduction's kernel, which reads the cone's leaves. Allowed where
 * the cone is small, every member plain (no reduction results, windows or random numbers) and it
 * reads at most AF_CLONE_FULL_LEAVES tensors of x's size (each read replacing x's write and read).
 * Where recomputing all of it is not allowed, a member whose own cone is too big (a gradient summed
 * from four matmuls, or masked by dropout) may be read instead, materialized by `root` (then the
 * reduction's kernel runs after root's: see `dep` in af_fuse_plan_new). */
#define AF_CLONE_MAX 8
#define AF_CLONE_LEAVES 8
#define AF_CLONE_FULL_LEAVES 2
typedef struct {
    const af_graph *g;
    int32_t root;
    const int32_t *value_group;
    int32_t *parent;
    const uint8_t *is_reduced;
    int64_t numel;
    int reads_ok; /* members of root may be leaves (read materialized) */
    const uint8_t *outside; /* per value: read by a node outside its group so far (stored anyway) */
    int x_stored;           /* x is stored anyway: read no other member (it would be one more tensor) */
    int32_t cone[AF_CLONE_MAX], n_cone;
    int32_t leaves[AF_CLONE_LEAVES], n_leaves, full, n_reads;
} af_cone;

/* Whether one of the n nodes in cone computes value v. */
static int cone_has_value(const af_graph *g, const int32_t *cone, int32_t n, int32_t v) {
    for (int32_t k = 0; k < n; k++)
        if (af_graph_node(g, cone[k])->first_output == v) return 1;
    return 0;
}

static int cone_computes(const af_cone *c, int32_t v) { return cone_has_value(c->g, c->cone, c->n_cone, v); }

/* The elements a tensor's loads touch: a broadcast dim (stride 0) adds none (a norm's weight
 * viewed over the rows, sink.c's broadcast reads, is a vector's worth of loads). */
static int64_t loaded_elements(const af_tensor_meta *m) {
    int64_t n = 1;
    for (int32_t d = 0; d < m->ndim; d++)
        if (m->strides[d] != 0) n *= m->sizes[d];
    return af_tensor_meta_numel(m) == 0 ? 0 : n;
}

static int cone_leaf(af_cone *c, int32_t u, int member) {
    if (contains(c->leaves, c->n_leaves, u)) return 1;
    if (c->n_leaves >= AF_CLONE_LEAVES) return 0;
    if (loaded_elements(&af_graph_value(c->g, u)->meta) >= c->numel && ++c->full > AF_CLONE_FULL_LEAVES) return 0;
    c->leaves[c->n_leaves++] = u;
    c->n_reads += member;
    return 1;
}

/* Recomputes member value v in the cone (its producer and, recursively, the members it reads; a
 * member that does not fit is read instead where c->reads_ok). Returns 0 where v cannot be. */
static int cone_add(af_cone *c, int32_t v) {
    if (cone_computes(c, v)) return 1;
    const af_graph *g = c->g;
    int32_t prod = af_graph_value(g, v)->producer;
    if (prod < 0 || c->is_reduced[v] || !af_fuse_node_ok(g, prod) || af_fuse_window(g, prod, NULL) ||
        af_graph_node(g, prod)->op_id == AF_OP_RNG_UNIFORM || c->n_cone >= AF_CLONE_MAX)
        return 0;
    c->cone[c->n_cone++] = prod;
    const af_node *n = af_graph_node(g, prod);
    for (int32_t a = 0; a < n->n_args; a++) {
        if (n->args[a].kind != AF_ARG_VALUE) continue;
        int32_t u = n->args[a].u.value, gu = c->value_group[u] >= 0 ? find_root(c->parent, c->value_group[u]) : -1;
        if (gu != c->root) {
            if (!cone_leaf(c, u, 0)) return 0;
            continue;
        }
        if (contains(c->leaves, c->n_leaves, u)) continue;
        af_cone before = *c;
        int recomputed = cone_add(c, u);
        if (!c->reads_ok) {
            if (!recomputed) return 0;
            continue;
        }
        /* recompute u, or read it: whichever reads fewer tensors of x's size (recompute on a tie:
         * reading costs root a write) */
        af_cone rec = *c;
        *c = before;
        int read = !c->is_reduced[u] && (c->outside[u] || !c->x_stored) && cone_leaf(c, u, 1);
        if (recomputed && (!read || rec.full <= c->full)) *c = rec;
        else if (!read) return 0;
    }
    return 1;
}

/* Fills cone (graph order not required) and returns its size, or 0; *n_reads: how many of its
 * leaves are members of root, read materialized (0 where recomputing everything fits). A member is
 * read only where that stores no tensor more than before: it is stored anyway (`outside`), or x is
 * not (then the member's store replaces x's). */
static int32_t recompute_cone(const af_graph *g, int32_t x, int32_t root, const int32_t *value_group, int32_t *parent,
                              const uint8_t *is_reduced, const uint8_t *outside, int32_t *cone, int32_t *n_reads) {
    for (int reads_ok = 0; reads_ok < 2; reads_ok++) {
        af_cone c = {.g = g, .root = root, .value_group = value_group, .parent = parent, .is_reduced = is_reduced,
                     .numel = af_tensor_meta_numel(&af_graph_value(g, x)->meta), .reads_ok = reads_ok, .outside = outside,
                     .x_stored = outside[x]};
        if (cone_add(&c, x)) {
            memcpy(cone, c.cone, (size_t)c.n_cone * sizeof(int32_t));
            *n_reads = c.n_reads;
            return c.n_cone;
        }
    }
    return 0;
}

/* Dep chains are acyclic (a dep is older than its group, and no node reading a group joins its
 * dep); walks over them stop after this many steps regardless. */
#define AF_DEP_WALK_MAX 64

/* Group q (a root) runs after group d's kernel where d is its dep (it reads values d materializes
 * while d may still grow): closing q closes its deps, so that nothing reads q before they end. */
static void close_group(uint8_t *closed, const int32_t *dep, int32_t *parent, int32_t q) {
    for (int32_t k = 0; q >= 0 && k < AF_DEP_WALK_MAX; k++) {
        closed[q] = 1;
        q = dep[q] >= 0 ? find_root(parent, dep[q]) : -1;
    }
}

/* Whether group q (a root) runs after group r's kernel through deps: then r may not take a node
 * reading q (a cycle). */
static int depends_on(const int32_t *dep, int32_t *parent, int32_t q, int32_t r) {
    for (int32_t k = 0; q >= 0 && k < AF_DEP_WALK_MAX; k++) {
        q = dep[q] >= 0 ? find_root(parent, dep[q]) : -1;
        if (q == r) return 1;
    }
    return 0;
}

/* Whether node n reads a value of a group that depends on group r. */
static int reads_dependent_of(const af_node *n, const int32_t *value_group, const int32_t *dep, int32_t *parent, int32_t r) {
    for (int32_t a = 0; a < n->n_args; a++) {
        if (n->args[a].kind != AF_ARG_VALUE || value_group[n->args[a].u.value] < 0) continue;
        if (depends_on(dep, parent, find_root(parent, value_group[n->args[a].u.value]), r)) return 1;
    }
    return 0;
}

/* ---- Merging independent groups (fewer kernel steps) ----
 *
 * The greedy pass above joins a node to a group it reads from or shares an input with; groups of
 * one loop that neither reads (the column sums of q's and v's gradients, a residual add beside an
 * unrelated copy) stay kernels of their own. Such a pair becomes one kernel when their loops are
 * the same (iteration sizes and layout; the same reduced dims, or one group without reductions)
 * and it can run at one of their two steps:
 *   - the later one's, when nothing outside the earlier group reads its values before that step;
 *   - the earlier one's, when every input of the later group is made before that step.
 * Either way neither group depends on the other through any path. Groups with windows or
 * recomputed members stay as they are; a group with epilogue members (a phased kernel) takes only a
 * group reducing over the same dims, whose members join its first pass, and never another phased one.
 *
 * A merge saves one kernel step's host time (a launch on a GPU); it must not cost memory or
 * threads: the moved kernel keeps its inputs alive longer (moved later) or makes its outputs
 * earlier (moved earlier), so the bytes that may be live longer are bounded (AF_MERGE_GROWTH), and
 * a pointwise group joins a reduction group (whose kernel parallelizes over the reduction's kept
 * dims only: one row, or few columns, run on one thread) only over a small loop (AF_MERGE_MIXED). */

/* Most nodes a group takes by joining (windows' absorbed sources and a reduction's row members
 * aside): the code generators' per-kernel passes grow with its size squared, and a chain with
 * nothing in between (a residual stream recomputed for the backward from its saved matmul outputs,
 * 100 layers of it) made one kernel of 1700 nodes whose program took 100 s to plan. The seed
 * models' largest kernels hold 28. */
#define AF_GROUP_NODES_MAX 256
#define AF_MERGE_LOOKBACK 16 /* earlier groups a group may join */
#define AF_MERGE_OPERANDS 32 /* most inputs + outputs of a merged kernel (CUDA parameter space) */
#define AF_MERGE_SPAN 48     /* most nodes a kernel moves: values stay where they were just written */
#define AF_MERGE_GROWTH (INT64_C(256) << 10) /* most bytes a merge may keep live longer */
#define AF_MERGE_MIXED (INT64_C(1) << 16)    /* largest loop in which a pointwise group joins reductions */

/* 1 when group gi may merge: every member its own (no recomputed members), no window or shifted
 * member; 2 when it also has members reading a reduction of the group (an epilogue: a phased
 * kernel), 0 when it may not merge. */
static int mergeable(const af_graph *g, const af_fusion_plan *plan, int32_t gi) {
    const af_fusion_group *grp = &plan->groups[gi];
    if (grp->window_of || grp->iter_value < 0) return 0;
    int phased = 0;
    for (int32_t k = 0; k < grp->n_nodes; k++) {
        int32_t i = grp->nodes[k];
        af_window w;
        if (plan->group_of_node[i] != gi || af_fuse_window(g, i, &w)) return 0;
        const af_node *n = af_graph_node(g, i);
        for (int32_t a = 0; a < n->n_args; a++) {
            if (n->args[a].kind != AF_ARG_VALUE) continue;
            int32_t prod = af_graph_value(g, n->args[a].u.value)->producer;
            if (prod >= 0 && plan->group_of_node[prod] == gi && af_fuse_reduction_ok(g, prod, NULL)) phased = 1;
        }
    }
    return phased ? 2 : 1;
}

static int same_loop(const af_tensor_meta *a, const af_tensor_meta *b) {
    if (!same_shape(a, b)) return 0;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] > 1 && a->strides[d] != b->strides[d]) return 0;
    return 1;
}

/* Does group `reader` take a value of group `maker` as an input? */
static int reads_group(const af_graph *g, const af_fusion_plan *plan, const af_fusion_group *reader, int32_t maker) {
    for (int32_t k = 0; k < reader->n_inputs; k++) {
        int32_t prod = af_graph_value(g, reader->inputs[k])->producer;
        if (prod >= 0 && plan->group_of_node[prod] == maker) return 1;
    }
    return 0;
}

static int64_t values_nbytes(const af_graph *g, const int32_t *vals, int32_t n) {
    int64_t total = 0;
    for (int32_t k = 0; k < n; k++) total += af_tensor_meta_nbytes(&af_graph_value(g, vals[k])->meta);
    return total;
}

/* Sorted union of two sorted node lists into *out (malloc'd). */
static int merge_sorted(const int32_t *a, int32_t na, const int32_t *b, int32_t nb, int32_t **out) {
    int32_t *m = malloc(((size_t)na + (size_t)nb + 1) * sizeof(int32_t)), i = 0, j = 0, k = 0;
    if (!m) return af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
    while (i < na || j < nb) m[k++] = j >= nb || (i < na && a[i] < b[j]) ? a[i++] : b[j++];
    *out = m;
    return AF_OK;
}

static int union_into(int32_t **arr, int32_t *n, const int32_t *add, int32_t n_add) {
    for (int32_t k = 0; k < n_add; k++)
        if (!contains(*arr, *n, add[k])) {
            int st = push(arr, n, add[k]);
            if (st) return st;
        }
    return AF_OK;
}

/* Moves group b's members into group a, which runs after node `at` (b's arrays are freed; the
 * caller drops b). */
static int merge_into(af_fusion_plan *plan, int32_t a, int32_t b, int32_t at) {
    af_fusion_group *ga = &plan->groups[a], *gb = &plan->groups[b];
    int32_t *nodes = NULL;
    int st = merge_sorted(ga->nodes, ga->n_nodes, gb->nodes, gb->n_nodes, &nodes);
    if (st) return st;
    /* push grows at powers of two: give the merged lists room by rebuilding them */
    int32_t *inputs = NULL, *outputs = NULL, n_in = 0, n_out = 0;
    if ((st = union_into(&inputs, &n_in, ga->inputs, ga->n_inputs)) || (st = union_into(&inputs, &n_in, gb->inputs, gb->n_inputs)) ||
        (st = union_into(&outputs, &n_out, ga->outputs, ga->n_outputs)) ||
        (st = union_into(&outputs, &n_out, gb->outputs, gb->n_outputs))) {
        free(nodes);
        free(inputs);
        free(outputs);
        return st;
    }
    for (int32_t k = 0; k < gb->n_nodes; k++) plan->group_of_node[gb->nodes[k]] = a;
    free(ga->nodes);
    free(ga->inputs);
    free(ga->outputs);
    ga->nodes = nodes;
    ga->n_nodes += gb->n_nodes;
    ga->inputs = inputs;
    ga->n_inputs = n_in;
    ga->outputs = outputs;
    ga->n_outputs = n_out;
    ga->last_node = at;
    if (gb->reduce_mask) { /* the loop is the reduction's: its input is the iteration value */
        if (!ga->reduce_mask) ga->iter_value = gb->iter_value;
        ga->reduce_mask = gb->reduce_mask;
    }
    ga->n_reductions += gb->n_reductions;
    free(gb->nodes);
    free(gb->inputs);
    free(gb->outputs);
    free(gb->window_of);
    memset(gb, 0, sizeof *gb);
    return AF_OK;
}

/* Where things happen while groups merge: a group's kernel runs at its last_node, which a merge
 * moves, so reads and writes are placed by the steps as they stand. */
typedef struct {
    const af_graph *g;
    af_fusion_plan *plan;
    int32_t *ext_first; /* per value: the first node of no group reading it, or INT32_MAX */
    int32_t *head, *edge, *next; /* per group: a list of the groups reading its values (edge: the reader) */
    int32_t *chain;     /* per group: the next group merged into the same one, or -1 */
    int32_t *merged_to; /* per group: the group it was merged into (itself while it stands) */
} merge_state;

/* The first step reading one of gi's values outside it: an extern node, or another kernel's step
 * (INT32_MAX: only returned). */
static int32_t first_read(const merge_state *s, int32_t gi) {
    const af_fusion_group *grp = &s->plan->groups[gi];
    int32_t at = INT32_MAX;
    for (int32_t k = 0; k < grp->n_outputs; k++)
        if (s->ext_first[grp->outputs[k]] < at) at = s->ext_first[grp->outputs[k]];
    for (int32_t o = gi; o >= 0; o = s->chain[o])
        for (int32_t e = s->head[o]; e >= 0; e = s->next[e]) {
            int32_t r = s->merged_to[s->edge[e]];
            if (r != gi && s->plan->groups[r].last_node < at) at = s->plan->groups[r].last_node;
        }
    return at;
}

/* Records node i as a reader of every value in a (lists included, nested or not). */
static void note_ext_reads(const af_arg *a, int32_t i, int32_t *ext_first) {
    if (a->kind == AF_ARG_VALUE) ext_first[a->u.value] = i;
    else if (a->kind == AF_ARG_LIST)
        for (int32_t j = 0; j < a->u.list.n; j++) note_ext_reads(&a->u.list.items[j], i, ext_first);
}

/* The step making gi's last input: an extern node, or another kernel's step (-1: inputs only). */
static int32_t inputs_ready(const merge_state *s, int32_t gi) {
    const af_fusion_group *grp = &s->plan->groups[gi];
    int32_t at = -1;
    for (int32_t k = 0; k < grp->n_inputs; k++) {
        int32_t prod = af_graph_value(s->g, grp->inputs[k])->producer, pg = prod >= 0 ? s->plan->group_of_node[prod] : -1;
        int32_t step = pg >= 0 ? s->plan->groups[pg].last_node : prod;
        if (step > at) at = step;
    }
    return at;
}

static int merge_independent_groups(const af_graph *g, af_fusion_plan *plan) {
    int32_t ng = plan->n_groups, nn = af_graph_num_nodes(g), nv = af_graph_num_values(g), n_edges = 0;
    if (ng < 2) return AF_OK;
    for (int32_t gi = 0; gi < ng; gi++) n_edges += plan->groups[gi].n_inputs;
    merge_state s = {.g = g, .plan = plan};
    s.ext_first = malloc(((size_t)nv + 1) * sizeof(int32_t));
    s.head = malloc(((size_t)ng + 1) * sizeof(int32_t));
    s.chain = malloc(((size_t)ng + 1) * sizeof(int32_t));
    s.merged_to = malloc(((size_t)ng + 1) * sizeof(int32_t));
    s.edge = malloc(((size_t)n_edges + 1) * sizeof(int32_t));
    s.next = malloc(((size_t)n_edges + 1) * sizeof(int32_t));
    uint8_t *ok = calloc((size_t)ng + 1, 1);
    int st = AF_OK;
    if (!s.ext_first || !s.head || !s.chain || !s.merged_to || !s.edge || !s.next || !ok) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
        goto done;
    }
    for (int32_t v = 0; v < nv; v++) s.ext_first[v] = INT32_MAX; /* a returned value is read after every step */
    for (int32_t i = nn - 1; i >= 0; i--) {
        if (plan->group_of_node[i] >= 0) continue; /* a kernel member's reads are its group's inputs */
        const af_node *n = af_graph_node(g, i);
        for (int32_t a = 0; a < n->n_args; a++) note_ext_reads(&n->args[a], i, s.ext_first);
    }
    n_edges = 0;
    for (int32_t gi = 0; gi < ng; gi++) s.head[gi] = -1;
    for (int32_t gi = 0; gi < ng; gi++) {
        const af_fusion_group *grp = &plan->groups[gi];
        s.chain[gi] = -1;
        s.merged_to[gi] = gi;
        ok[gi] = (uint8_t)mergeable(g, plan, gi);
        for (int32_t k = 0; k < grp->n_inputs; k++) {
            int32_t prod = af_graph_value(g, grp->inputs[k])->producer, pg = prod >= 0 ? plan->group_of_node[prod] : -1;
            if (pg < 0) continue;
            s.edge[n_edges] = gi;
            s.next[n_edges] = s.head[pg];
            s.head[pg] = n_edges++;
        }
    }
    for (int32_t b = 1; b < ng; b++) {
        if (!ok[b]) continue;
        const af_fusion_group *gb = &plan->groups[b];
        const af_tensor_meta *ib = &af_graph_value(g, gb->iter_value)->meta;
        int32_t seen = 0;
        for (int32_t a = b - 1; a >= 0 && seen < AF_MERGE_LOOKBACK; a--) {
            if (s.merged_to[a] != a || !ok[a]) continue;
            seen++;
            const af_fusion_group *ga = &plan->groups[a];
            if (ga->device.type != gb->device.type || ga->device.index != gb->device.index) continue;
            if (ga->reduce_mask && gb->reduce_mask && ga->reduce_mask != gb->reduce_mask) continue;
            /* a phased kernel takes another group's members into its first pass: reductions over
             * the same dims only (a one-hot pick's row sum beside cross entropy's max), never
             * another phased kernel's phases */
            if ((ok[a] == 2 || ok[b] == 2) && (ok[a] == ok[b] || !ga->reduce_mask || ga->reduce_mask != gb->reduce_mask)) continue;
            if (ga->n_inputs + gb->n_inputs + ga->n_outputs + gb->n_outputs > AF_MERGE_OPERANDS) continue;
            if (!same_loop(&af_graph_value(g, ga->iter_value)->meta, ib)) continue;
            if (!ga->reduce_mask != !gb->reduce_mask && af_tensor_meta_numel(ib) > AF_MERGE_MIXED) continue;
            if (reads_group(g, plan, gb, a) || reads_group(g, plan, ga, b)) continue;
            /* e runs first, l later; two kernels at one node keep apart (their order there is the steps') */
            int32_t e = ga->last_node <= gb->last_node ? a : b, l = e == a ? b : a;
            int32_t lo = plan->groups[e].last_node, hi = plan->groups[l].last_node, at;
            if (lo == hi || hi - lo > AF_MERGE_SPAN) continue;
            const af_fusion_group *ge = &plan->groups[e], *gl = &plan->groups[l];
            /* e's kernel may wait for l's step (its inputs then live until there, its outputs
             * are made later), or l's inputs are all made by e's step (its outputs made earlier) */
            if (first_read(&s, e) > hi &&
                values_nbytes(g, ge->inputs, ge->n_inputs) - values_nbytes(g, ge->outputs, ge->n_outputs) <= AF_MERGE_GROWTH)
                at = hi;
            else if (inputs_ready(&s, l) < lo && values_nbytes(g, gl->outputs, gl->n_outputs) <= AF_MERGE_GROWTH)
                at = lo;
            else continue;
            if ((st = merge_into(plan, a, b, at))) goto done;
            s.merged_to[b] = a;
            if (ok[b] > ok[a]) ok[a] = ok[b];
            int32_t tail = a;
            while (s.chain[tail] >= 0) tail = s.chain[tail];
            s.chain[tail] = b;
            break;
        }
    }
    /* drop the merged groups; number the rest densely, in order */
    int32_t kept = 0;
    for (int32_t gi = 0; gi < ng; gi++) {
        if (s.merged_to[gi] != gi) continue;
        s.merged_to[gi] = kept;
        if (kept != gi) plan->groups[kept] = plan->groups[gi];
        kept++;
    }
    for (int32_t i = 0; i < nn; i++)
        if (plan->group_of_node[i] >= 0) plan->group_of_node[i] = s.merged_to[plan->group_of_node[i]];
    plan->n_groups = kept;
done:
    free(s.ext_first);
    free(s.head);
    free(s.chain);
    free(s.merged_to);
    free(s.edge);
    free(s.next);
    free(ok);
    return st;
}

int af_fuse_plan_new(const af_graph *g, const af_fuse_options *opts, af_fusion_plan **out) {
    if (!g || !out) return af_error_set(AF_ERR_INVALID, "af_fuse_plan_new: NULL argument");
    int32_t min_nodes = opts && opts->min_nodes > 0 ? opts->min_nodes : 2;
    uint32_t devices = opts && opts->device_types ? opts->device_types : AF_FUSE_ALL_DEVICES;
    int shifting = !(opts && opts->no_shifted);
    int32_t nn = af_graph_num_nodes(g), nv = af_graph_num_values(g);
    af_fusion_plan *plan = calloc(1, sizeof *plan);
    int32_t *value_group = malloc(((size_t)nv + 1) * sizeof(int32_t));
    uint8_t *closed = calloc((size_t)nn + 1, 1); /* per provisional group (at most one per node) */
    int32_t *prov_of_node = malloc(((size_t)nn + 1) * sizeof(int32_t));
    int32_t *prov_size = calloc((size_t)nn + 1, sizeof(int32_t));
    uint8_t *is_output = calloc((size_t)nv + 1, 1);
    int32_t *parent = malloc(((size_t)nn + 1) * sizeof(int32_t));
    int32_t *last_reader = malloc(((size_t)nv + 1) * sizeof(int32_t));
    const af_tensor_meta **gshape = malloc(((size_t)nn + 1) * sizeof *gshape);
    uint32_t *gmask = calloc((size_t)nn + 1, sizeof(uint32_t));
    uint8_t *is_reduced = calloc((size_t)nv + 1, 1);
    uint8_t *gwin = calloc((size_t)nn + 1, 1); /* per provisional group: has a window member (then no reductions) */
    /* per provisional group: recomputed members (nodes of another group, see recompute_cone) */
    int32_t **clones = calloc((size_t)nn + 1, sizeof(int32_t *)), *n_clones = calloc((size_t)nn + 1, sizeof(int32_t));
    int32_t *stamp = malloc(((size_t)nn + 1) * sizeof(int32_t));
    /* per provisional group: the group whose materialized values it reads while that one may still
     * grow (recompute_cone's reads), or -1; it then runs after that group's kernel */
    int32_t *dep = malloc(((size_t)nn + 1) * sizeof(int32_t));
    uint8_t *outside = calloc((size_t)nv + 1, 1); /* per value: stored anyway (read outside its group so far, or see below) */
    int32_t *n_reads = calloc((size_t)nv + 1, sizeof(int32_t)); /* per value: reads by any node */
    int32_t *window_of_node = malloc(((size_t)nn + 1) * sizeof(int32_t)); /* per node: the window it is a shifted member of */
    int32_t *absorbed = malloc(((size_t)nn + 1) * sizeof(int32_t));
    int st = AF_OK;
    if (!plan || !value_group || !closed || !prov_of_node || !prov_size || !is_output || !parent || !last_reader || !gshape ||
        !gmask || !is_reduced || !gwin || !clones || !n_clones || !stamp || !dep || !outside || !n_reads || !window_of_node ||
        !absorbed) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
        goto done;
    }
    for (int32_t v = 0; v < nv; v++) value_group[v] = last_reader[v] = -1;
    for (int32_t i = 0; i < nn; i++) dep[i] = window_of_node[i] = -1;
    for (int32_t o = 0; o < af_graph_num_outputs(g); o++) is_output[af_graph_output(g, o)] = 1;
    for (int32_t i = 0; i < nn; i++)
        for (int32_t a = 0; a < af_graph_node(g, i)->n_args; a++) count_arg_reads(&af_graph_node(g, i)->args[a], n_reads);
    /* stored anyway, whatever the groups: a returned value, and one a node outside every kernel reads
     * (an extern call, or a view, which no kernel member reads through); known before planning, so
     * that a recomputed reduction reads such a value rather than have its group store another
     * (cross entropy's column sum of the logits' gradient, which the matmuls read too) */
    for (int32_t v = 0; v < nv; v++) outside[v] = is_output[v];
    for (int32_t i = 0; i < nn; i++) {
        uint32_t unused = 0;
        if (fuse_kind(g, i, devices, &unused)) continue;
        for (int32_t a = 0; a < af_graph_node(g, i)->n_args; a++) mark_arg_values(&af_graph_node(g, i)->args[a], outside);
    }

    /* Provisional groups, greedily in graph order, as a union-find forest. A fusible node joins
     * every open group of its shape that produces one of its inputs (merging them), or else an
     * open group of its shape that reads one of the same inputs (a sibling: x*0.5 beside
     * erf(x*0.7071)); otherwise it starts a group. */
    int32_t n_prov = 0;
    for (int32_t i = 0; i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        prov_of_node[i] = -1;
        uint32_t mask = 0;
        int kind = fuse_kind(g, i, devices, &mask);
        af_window win;
        int window = kind == 1 && af_fuse_window(g, i, &win);
        /* the value a window's source is, or views (a remap) */
        int32_t chain[AF_REMAP_MAX], n_chain = 0, src_value = window ? win.source : -1;
        if (shifting && window && win.source >= 0 && value_group[win.source] < 0) {
            int32_t x = view_chain(g, win.source, n_reads, is_output, chain, &n_chain);
            if (x >= 0 && value_group[x] >= 0) src_value = x;
            else n_chain = 0;
        }
        /* a window's source is read at other indices than the window's own: never in its group */
        int32_t src_group = src_value >= 0 && value_group[src_value] >= 0 ? find_root(parent, value_group[src_value]) : -1;
        if (kind) {
            /* a reduction iterates over its input's shape; a pointwise node over its output's */
            const af_tensor_meta *shape = kind == 1 ? &af_graph_value(g, n->first_output)->meta
                                                    : &af_graph_value(g, n->args[0].u.value)->meta;
            int32_t join = -1;
            /* a row member: pointwise over finished reductions of one group only (log(sum),
             * rsqrt(var + eps)), computed once per row after them */
            if (kind == 1 && !window) {
                int32_t cand = -1, ok = 0;
                for (int32_t a = 0; a < n->n_args; a++) {
                    if (n->args[a].kind != AF_ARG_VALUE) continue;
                    int32_t v = n->args[a].u.value, gv = value_group[v] >= 0 ? find_root(parent, value_group[v]) : -1;
                    ok = is_reduced[v] && gv >= 0 && !closed[gv] && (cand < 0 || cand == gv);
                    cand = gv;
                    if (!ok) break;
                }
                if (ok && epilogue_ok(shape, gshape[cand], gmask[cand])) {
                    join = cand;
                    is_reduced[n->first_output] = 1;
                }
            }
            for (int pass = 0; pass < 2 && join < 0; pass++) {
                for (int32_t a = 0; a < n->n_args; a++) {
                    if (n->args[a].kind != AF_ARG_VALUE) continue;
                    int32_t v = n->args[a].u.value;
                    int32_t cand = pass == 0 ? value_group[v] : last_reader[v];
                    if (cand < 0) continue;
                    cand = find_root(parent, cand);
                    if (closed[cand] || !same_shape(gshape[cand], shape) || prov_size[cand] >= AF_GROUP_NODES_MAX) continue;
                    if (window && (cand == src_group || gmask[cand] || (pass == 0 && a == win.source_arg))) continue;
                    if (kind == 2 && gwin[cand]) continue; /* a group with a window has no reductions */
                    /* a random node starts its own group: its seed's index space is its own shape */
                    if (pass == 1 && n->op_id == AF_OP_RNG_UNIFORM) continue;
                    const af_tensor_meta *vm = &af_graph_value(g, v)->meta;
                    if (pass == 0 && (is_reduced[v] ? !(kind == 1 && epilogue_ok(vm, shape, gmask[cand]))
                                                    : !same_shape(vm, shape)))
                        continue;
                    if (pass == 1 && join >= 0) continue;
                    if (kind == 2 && gmask[cand] && gmask[cand] != mask) continue;
                    if (reads_reduction_of(g, n, kind, shape, value_group, is_reduced, parent, cand, gmask[cand])) continue;
                    if (reads_dependent_of(n, value_group, dep, parent, cand)) continue;
                    /* a merge must not bring an epilogue's reduction under another mask */
                    if (join >= 0 && cand != join && gmask[cand] && gmask[join] && gmask[cand] != gmask[join]) continue;
                    if (join < 0) join = cand;
                    else if (cand != join) { /* merge: both open, so no outsider read either yet */
                        if (gmask[cand] && gmask[join] && gmask[cand] != gmask[join]) continue;
                        if (prov_size[cand] + prov_size[join] >= AF_GROUP_NODES_MAX) continue;
                        if ((gwin[cand] || gwin[join]) && (gmask[cand] || gmask[join] || kind == 2)) continue;
                        if (dep[cand] >= 0 || dep[join] >= 0) continue; /* a group running after another stays apart */
                        gwin[join] |= gwin[cand];
                        parent[cand] = join;
                        prov_size[join] += prov_size[cand];
                        if (gmask[cand]) gmask[join] = gmask[cand];
                    }
                }
                if (join >= 0) break;
            }
            if (join < 0 && kind == 2 && !is_output[n->args[0].u.value]) {
                int32_t x = n->args[0].u.value, gx = value_group[x] >= 0 ? find_root(parent, value_group[x]) : -1;
                int32_t cone[AF_CLONE_MAX], n_reads = 0;
                int32_t nc = gx >= 0 && gmask[gx] && gmask[gx] != mask && !gwin[gx] && !is_reduced[x]
                                 ? recompute_cone(g, x, gx, value_group, parent, is_reduced, outside, cone, &n_reads)
                                 : 0;
                if (nc > 0) {
                    join = n_prov++;
                    parent[join] = join;
                    gshape[join] = shape;
                    gmask[join] = 0;
                    dep[join] = n_reads ? gx : -1;
                    if (!(clones[join] = malloc((size_t)nc * sizeof(int32_t)))) {
                        st = af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
                        goto done;
                    }
                    memcpy(clones[join], cone, (size_t)nc * sizeof(int32_t));
                    n_clones[join] = nc;
                    prov_size[join] += nc;
                    /* the cone's leaves: read by this group now (closing their groups); they and
                     * the cone's values are its siblings' way in (a bias sum of the same gradient) */
                    for (int32_t k = 0; k < nc; k++) {
                        const af_node *c = af_graph_node(g, cone[k]);
                        last_reader[c->first_output] = join; /* its own values too: a sum of one joins */
                        for (int32_t a = 0; a < c->n_args; a++) {
                            if (c->args[a].kind != AF_ARG_VALUE) continue;
                            int32_t u = c->args[a].u.value, gu = value_group[u] >= 0 ? find_root(parent, value_group[u]) : -1;
                            if (cone_has_value(g, cone, nc, u)) continue;
                            if (gu >= 0 && gu != gx) close_group(closed, dep, parent, gu);
                            last_reader[u] = join; /* a read member of gx too: a sum of it joins */
                        }
                    }
                }
            }
            if (join < 0) {
                join = n_prov++;
                parent[join] = join;
                gshape[join] = shape;
                gmask[join] = 0;
            }
            if (kind == 2) {
                gmask[join] = mask;
                is_reduced[n->first_output] = 1;
            }
            /* a source only this window reads, computed by a group of pointwise nodes and windows
             * of its own: its nodes become the window's shifted members (computed at the source's
             * index, in its guard); where the source views that group's value, the views join too
             * (remapped members: computed at the element of the value the source's element views) */
            int32_t n_absorbed = 0;
            if (shifting && window && src_group >= 0 && src_group != join && !gmask[join] &&
                absorbable(g, i, &win, src_value, n_chain > 0, src_group, parent, prov_of_node, closed, gmask, dep, n_clones,
                           n_reads, is_output, window_of_node, absorbed, &n_absorbed)) {
                for (int32_t k = 0; k < n_absorbed; k++)
                    if (window_of_node[absorbed[k]] < 0) window_of_node[absorbed[k]] = i; /* nested ones keep theirs */
                for (int32_t k = 0; k < n_chain; k++) {
                    window_of_node[chain[k]] = i;
                    prov_of_node[chain[k]] = join;
                }
                parent[src_group] = join;
                prov_size[join] += prov_size[src_group] + n_chain;
            }
            gwin[join] |= (uint8_t)window;
            prov_of_node[i] = join;
            prov_size[join]++;
            value_group[n->first_output] = join;
        }
        /* reads by this node close every other group it reads from (not one whose members its
         * group recomputes: those values are its own) */
        int32_t reader = prov_of_node[i] >= 0 ? find_root(parent, prov_of_node[i]) : -1;
        for (int32_t a = 0; a < n->n_args; a++) {
            int32_t prod = n->args[a].kind == AF_ARG_VALUE ? af_graph_value(g, n->args[a].u.value)->producer : -1;
            if (reader >= 0 && n_clones[reader] && prod >= 0 && contains(clones[reader], n_clones[reader], prod)) continue;
            mark_reads(&n->args[a], value_group, parent, reader, closed, dep);
            if (n->args[a].kind == AF_ARG_VALUE && value_group[n->args[a].u.value] >= 0 &&
                find_root(parent, value_group[n->args[a].u.value]) != reader)
                outside[n->args[a].u.value] = 1;
        }
        if (prov_of_node[i] >= 0)
            for (int32_t a = 0; a < n->n_args; a++)
                if (n->args[a].kind == AF_ARG_VALUE) last_reader[n->args[a].u.value] = prov_of_node[i];
    }
    for (int32_t i = 0; i < nn; i++)
        if (prov_of_node[i] >= 0) prov_of_node[i] = find_root(parent, prov_of_node[i]);

    /* keep groups big enough; number them densely */
    int32_t *dense = malloc(((size_t)n_prov + 1) * sizeof(int32_t));
    plan->group_of_node = malloc(((size_t)nn + 1) * sizeof(int32_t));
    if (!dense || !plan->group_of_node) {
        free(dense);
        st = af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
        goto done;
    }
    /* a pointwise node gets a kernel alone too: random nodes because their numbers are defined by
     * the generated code, the others because a kernel step costs less host time than ATen's call
     * (the scalar wrapping and type promotion of `mul(x, 0.125)`) and moves the same bytes; so does
     * a column reduction on the CPU (lone_column_ok); other lone reductions stay ATen's */
    uint8_t *keep_alone = calloc((size_t)n_prov + 1, 1);
    if (!keep_alone) {
        free(dense);
        st = af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
        goto done;
    }
    for (int32_t i = 0; i < nn; i++)
        if (prov_of_node[i] >= 0 && (af_fuse_node_ok(g, i) || lone_column_ok(g, i))) keep_alone[prov_of_node[i]] = 1;
    for (int32_t p = 0; p < n_prov; p++)
        dense[p] = (parent[p] == p && (prov_size[p] >= min_nodes || keep_alone[p])) ? plan->n_groups++ : -1;
    free(keep_alone);
    plan->groups = calloc((size_t)plan->n_groups + 1, sizeof(af_fusion_group));
    if (!plan->groups) {
        free(dense);
        st = af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
        goto done;
    }
    for (int32_t i = 0; i < nn; i++) {
        int32_t gi = prov_of_node[i] >= 0 ? dense[prov_of_node[i]] : -1;
        plan->group_of_node[i] = gi;
        if (gi < 0) continue;
        af_fusion_group *grp = &plan->groups[gi];
        if (grp->n_nodes == 0) {
            grp->iter_value = -1;
            grp->device = af_graph_value(g, af_graph_node(g, i)->first_output)->meta.device;
        }
        if ((st = push(&grp->nodes, &grp->n_nodes, i))) break;
        grp->last_node = i;
        const af_node *n = af_graph_node(g, i);
        uint32_t mask = 0;
        if (window_of_node[i] >= 0 || grp->window_of) { /* shifted members: their window's, by member */
            if (!grp->window_of) {
                grp->window_of = malloc(((size_t)nn + 1) * sizeof(int32_t));
                if (!grp->window_of) {
                    st = af_error_set(AF_ERR_NOMEM, "out of memory planning fusion");
                    break;
                }
                for (int32_t m = 0; m + 1 < grp->n_nodes; m++) grp->window_of[m] = -1;
            }
            grp->window_of[grp->n_nodes - 1] = window_of_node[i];
        }
        if (window_of_node[i] >= 0) continue; /* it iterates over its window's source, not the kernel's shape */
        if (af_fuse_node_ok(g, i)) {
            if (grp->iter_value < 0 && !is_reduced[n->first_output]) grp->iter_value = n->first_output;
        } else if (af_fuse_reduction_ok(g, i, &mask)) {
            grp->reduce_mask = mask;
            grp->n_reductions++;
            if (grp->iter_value < 0) grp->iter_value = n->args[0].u.value;
        }
    }
    /* recomputed members join their group's node list, kept in graph order */
    for (int32_t q = 0; q < n_prov && !st; q++) {
        int32_t gi = n_clones[q] ? dense[find_root(parent, q)] : -1;
        if (gi < 0) continue;
        af_fusion_group *grp = &plan->groups[gi];
        for (int32_t k = 0; k < n_clones[q] && !st; k++) {
            int32_t c = clones[q][k];
            if (plan->group_of_node[c] == gi || contains(grp->nodes, grp->n_nodes, c)) continue;
            if ((st = push(&grp->nodes, &grp->n_nodes, c))) break;
            for (int32_t m = grp->n_nodes - 1; m > 0 && grp->nodes[m - 1] > grp->nodes[m]; m--) {
                int32_t t = grp->nodes[m];
                grp->nodes[m] = grp->nodes[m - 1];
                grp->nodes[m - 1] = t;
            }
        }
    }
    free(dense);
    if (st) goto done;
    for (int32_t v = 0; v < nv; v++) {
        int32_t p = af_graph_value(g, v)->producer;
        value_group[v] = p >= 0 ? plan->group_of_node[p] : -1;
    }
    /* inputs: tensor args from outside (produced by no node of the group's list); outputs: values
     * of a group's own members read by a node outside that list, or returned */
    for (int32_t i = 0; i < nn; i++) stamp[i] = -1;
    for (int32_t gi = 0; gi < plan->n_groups && !st; gi++) {
        af_fusion_group *grp = &plan->groups[gi];
        for (int32_t k = 0; k < grp->n_nodes; k++) stamp[grp->nodes[k]] = gi;
        for (int32_t k = 0; k < grp->n_nodes && !st; k++) {
            const af_node *n = af_graph_node(g, grp->nodes[k]);
            for (int32_t a = 0; a < n->n_args && !st; a++) {
                if (n->args[a].kind != AF_ARG_VALUE) continue;
                int32_t v = n->args[a].u.value, prod = af_graph_value(g, v)->producer;
                if ((prod < 0 || stamp[prod] != gi) && !contains(grp->inputs, grp->n_inputs, v))
                    st = push(&grp->inputs, &grp->n_inputs, v);
            }
        }
    }
    for (int32_t v = 0; v < nv && !st; v++)
        if (is_output[v] && value_group[v] >= 0) {
            af_fusion_group *grp = &plan->groups[value_group[v]];
            if (!contains(grp->outputs, grp->n_outputs, v)) st = push(&grp->outputs, &grp->n_outputs, v);
        }
    for (int32_t i = 0; i < nn && !st; i++) {
        const af_node *n = af_graph_node(g, i);
        int32_t gi = plan->group_of_node[i];
        const af_fusion_group *reader = gi >= 0 ? &plan->groups[gi] : NULL;
        for (int32_t a = 0; a < n->n_args && !st; a++) {
            const af_arg *arg = &n->args[a];
            int32_t prod = arg->kind == AF_ARG_VALUE ? af_graph_value(g, arg->u.value)->producer : -1;
            /* a value its own group recomputes is no read from outside */
            if (reader && prod >= 0 && plan->group_of_node[prod] != gi && contains(reader->nodes, reader->n_nodes, prod))
                continue;
            st = materialize_reads(plan, arg, value_group, gi);
        }
    }
    /* a group reading another group's member (a recompute's read: nothing else reads it) gets it
     * as that group's output; and runs after whatever makes its inputs (deps run late) */
    for (int32_t gi = 0; gi < plan->n_groups && !st; gi++) {
        const af_fusion_group *grp = &plan->groups[gi];
        for (int32_t k = 0; k < grp->n_inputs && !st; k++) {
            int32_t v = grp->inputs[k], pg = value_group[v];
            if (pg >= 0 && pg != gi && !contains(plan->groups[pg].outputs, plan->groups[pg].n_outputs, v))
                st = push(&plan->groups[pg].outputs, &plan->groups[pg].n_outputs, v);
        }
    }
    for (int changed = 1, round = 0; changed && !st && round <= plan->n_groups; round++) {
        changed = 0;
        for (int32_t gi = 0; gi < plan->n_groups; gi++) {
            af_fusion_group *grp = &plan->groups[gi];
            for (int32_t k = 0; k < grp->n_inputs; k++) {
                int32_t prod = af_graph_value(g, grp->inputs[k])->producer;
                int32_t at = prod < 0 ? -1 : value_group[grp->inputs[k]] >= 0 ? plan->groups[value_group[grp->inputs[k]]].last_node : prod;
                if (at > grp->last_node) {
                    grp->last_node = at;
                    changed = 1;
                }
            }
        }
    }
    if (!st && !(opts && opts->no_merge)) st = merge_independent_groups(g, plan);
done:
    free(value_group);
    free(closed);
    free(prov_of_node);
    free(prov_size);
    free(is_output);
    free(parent);
    free(last_reader);
    free(gshape);
    free(gmask);
    free(is_reduced);
    free(gwin);
    for (int32_t q = 0; clones && q < nn; q++) free(clones[q]);
    free(clones);
    free(n_clones);
    free(stamp);
    free(dep);
    free(outside);
    free(n_reads);
    free(window_of_node);
    free(absorbed);
    if (st) {
        af_fuse_plan_free(plan);
        return st;
    }
    *out = plan;
    return AF_OK;
}
