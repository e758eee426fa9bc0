/* Copies of views of pointwise values, recomputed from their sources (see fuse.h, af_sink_copies).
 *
 * clone(V(x)), V a chain of views and x = f(a, b, ...) a pointwise value, reads x at remapped
 * indices, which no kernel computing x can give it: it is a kernel of its own, and x is stored
 * for it. Rewritten as f(A, B, ...), where A, B are single as_strided views of the sources giving,
 * at each index of the copy, the source element x's element there was computed from, the copy is
 * an ordinary pointwise group reading the sources, and x is not stored when nothing else reads it.
 *
 * The map: V's result is a strided view of x's storage (its metadata says how), and x is dense,
 * so each copy index names one storage offset of x, hence one index of x, hence one element of
 * each source (broadcast sources repeat). That index is linear in the copy's index when no dim of
 * the copy carries across a dim of x; a copy dim that does (a merged batch-and-head dim, say) is
 * split where it crosses, and the copy is computed over that finer shape and viewed back.
 *
 * Reads: any kernel member reading V(x) at its own index can take the same nodes instead of the
 * view (plan_read), which pays where x then need not be stored at all (keep_profitable_reads).
 * A read over a finer shape makes its reader run over that shape too (add_split_reader). And a
 * window member's source that is a copy is read where the copy read (plan_bypass). */
#include "aotfuse/fuse.h"

#include <stdlib.h>
#include <string.h>

#define SINK_MAX_CONE 12  /* pointwise nodes recomputed for one copy */
#define SINK_MAX_LEAVES 8 /* sources one copy reads */
#define SINK_MAX_PASSES 8 /* rounds of rewriting (a copy of a rewritten copy is rewritten in the next) */
#define SINK_MAX_READS 8  /* views one kernel member reads that are recomputed for it */

typedef struct {
    int64_t size;
    int32_t dim;  /* x's dim its steps move along, -1: none (a broadcast or size-1 dim) */
    int64_t mult; /* steps of that dim per step of this one */
} sink_piece;

typedef struct {
    int32_t clone;   /* the copy node, or the kernel member reading the view (a read) */
    int32_t operand; /* a read: the view it reads, given the recomputed value instead; -1: a copy */
    int32_t split;   /* a read over a finer shape than the view's: its reader is computed over it too */
    int32_t bypass;  /* a window member's source that is a copy: the value copied, read instead (no cone); else -1 */
    int32_t ndim;    /* the finer shape the copy (or read) is computed over */
    sink_piece pieces[AF_MAX_DIMS];
    int64_t digit[AF_MAX_DIMS]; /* x's index at the copy's first element */
    int32_t x;                  /* the pointwise value viewed */
    int32_t n_cone;
    int32_t cone[SINK_MAX_CONE]; /* node indices, graph order */
    int32_t n_leaves;
    int32_t leaves[SINK_MAX_LEAVES]; /* value ids */
} sink_plan;

static int value_arg(const af_arg *a) { return a->kind == AF_ARG_VALUE; }

static int contiguous(const af_tensor_meta *m) {
    int64_t want = 1;
    for (int32_t d = m->ndim - 1; d >= 0; d--) {
        if (m->sizes[d] != 1 && m->strides[d] != want) return 0;
        want *= m->sizes[d];
    }
    return 1;
}

/* Whether v (a tensor) broadcasts to the shape of x on the same device. */
static int broadcasts_to(const af_tensor_meta *v, const af_tensor_meta *x) {
    if (v->type != AF_VALUE_TENSOR || v->ndim > x->ndim || v->device.type != x->device.type || v->device.index != x->device.index)
        return 0;
    for (int32_t d = 0; d < v->ndim; d++) {
        int64_t s = v->sizes[d], t = x->sizes[d + x->ndim - v->ndim];
        if (s != t && s != 1) return 0;
    }
    return 1;
}

/* An elementwise node recomputed as it is over other indices, and certainly in a kernel there
 * (whose output has the layout its metadata says, which an ATen call on the new views need not
 * give): a kernel member on a device with kernels, no index of its own (the random numbers), no
 * shape argument (fills), one output with dims (a 0-dim value broadcasts, and promotes, unlike
 * one with dims: it stays a source). */
static int sinkable(const af_graph *g, int32_t i, uint32_t devices) {
    const af_node *n = af_graph_node(g, i);
    const af_op_info *info = af_op_get(n->op_id);
    const af_tensor_meta *m = &af_graph_value(g, n->first_output)->meta;
    if (info->kind != AF_KIND_POINTWISE || !info->c_expr || n->op_id == AF_OP_RNG_UNIFORM || n->op_id == AF_OP_FULL ||
        n->n_outputs != 1 || m->type != AF_VALUE_TENSOR || m->ndim == 0 || !(devices & (1u << m->device.type)) ||
        af_fuse_node_ok(g, i) != 1)
        return 0;
    for (int32_t a = 0; a < n->n_args; a++)
        if (n->args[a].kind == AF_ARG_LIST) return 0;
    return 1;
}

/* The dims of m that address anything (size > 1), as (size, stride) pairs; their count. */
static int32_t moving_dims(const af_tensor_meta *m, int64_t *sz, int64_t *st) {
    int32_t n = 0;
    for (int32_t d = 0; d < m->ndim; d++)
        if (m->sizes[d] != 1) sz[n] = m->sizes[d], st[n++] = m->strides[d];
    return n;
}

/* Whether a and b address the same elements the same way (size-1 dims' strides aside). */
static int same_addressing(const af_tensor_meta *a, const af_tensor_meta *b) {
    if (a->ndim != b->ndim || a->storage_offset != b->storage_offset || a->dtype != b->dtype) return 0;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d] || (a->sizes[d] != 1 && a->strides[d] != b->strides[d])) return 0;
    return 1;
}

static int int_arg(const af_node *n, int32_t k, int64_t dflt, int64_t *out) {
    if (k >= n->n_args || n->args[k].kind == AF_ARG_NONE) return *out = dflt, 1;
    if (n->args[k].kind != AF_ARG_INT || n->args[k].name) return 0;
    return *out = n->args[k].u.i, 1;
}

/* The strides ATen's view gives `in` reshaped to out's sizes (into st; size-1 dims get any), or 0
 * where it has none (a new dim would cut across dims of `in` that do not step as one). */
static int view_strides(const af_tensor_meta *in, const af_tensor_meta *out, int64_t *st) {
    int32_t o = in->ndim - 1, k = out->ndim - 1;
    while (k >= 0) {
        if (out->sizes[k] == 1) {
            st[k--] = 1;
            continue;
        }
        while (o >= 0 && in->sizes[o] == 1) o--;
        if (o < 0) return 0;
        int32_t cur = o--;
        int64_t chunk = in->sizes[cur], base = in->strides[cur], prod = 1;
        for (;;) { /* the run of dims stepping as one: each stride the next one's span */
            int32_t q = o;
            while (q >= 0 && in->sizes[q] == 1) q--;
            if (q < 0 || in->strides[q] != in->strides[cur] * in->sizes[cur]) break;
            chunk *= in->sizes[q];
            cur = q;
            o = q - 1;
        }
        while (k >= 0 && prod < chunk) {
            st[k] = base * prod;
            prod *= out->sizes[k--];
        }
        if (prod != chunk) return 0;
    }
    while (o >= 0 && in->sizes[o] == 1) o--;
    return o < 0;
}

/* Whether the view node n, given an input laid out as `in`, makes what its metadata `out` says
 * (ATen's rule for that view), so that a source's declared layout can be trusted link by link. */
static int view_link_ok(const af_node *n, const af_tensor_meta *in, const af_tensor_meta *out) {
    int64_t sz[AF_MAX_DIMS], st[AF_MAX_DIMS], sz2[AF_MAX_DIMS], st2[AF_MAX_DIMS];
    af_tensor_meta want = *in;
    want.sizes = sz, want.strides = st;
    if (in->ndim > AF_MAX_DIMS || out->ndim > AF_MAX_DIMS || in->dtype != out->dtype) return 0;
    memcpy(sz, in->sizes, (size_t)in->ndim * sizeof(int64_t));
    memcpy(st, in->strides, (size_t)in->ndim * sizeof(int64_t));
    switch (n->op_id) {
    case AF_OP_ALIAS: return same_addressing(in, out);
    case AF_OP_VIEW:
    case AF_OP_UNSAFE_VIEW: /* runs of in's dims that step as one, cut into out's dims */
        if (out->ndim > AF_MAX_DIMS || af_tensor_meta_numel(in) != af_tensor_meta_numel(out) || af_tensor_meta_numel(in) == 0 || !view_strides(in, out, st)) return 0;
        want.ndim = out->ndim;
        memcpy(sz, out->sizes, (size_t)out->ndim * sizeof(int64_t));
        return same_addressing(&want, out);
    case AF_OP_SQUEEZE:
    case AF_OP_UNSQUEEZE: { /* size-1 dims come or go, the others stay as they were */
        int32_t a = moving_dims(in, sz, st), b = moving_dims(out, sz2, st2);
        if (a != b || in->storage_offset != out->storage_offset) return 0;
        for (int32_t d = 0; d < a; d++)
            if (sz[d] != sz2[d] || st[d] != st2[d]) return 0;
        return 1;
    }
    case AF_OP_T:
    case AF_OP_TRANSPOSE:
    case AF_OP_PERMUTE: {
        int32_t perm[AF_MAX_DIMS];
        for (int32_t d = 0; d < in->ndim; d++) perm[d] = d;
        if (n->op_id == AF_OP_T && in->ndim == 2) perm[0] = 1, perm[1] = 0;
        if (n->op_id == AF_OP_TRANSPOSE) {
            int64_t d0, d1;
            if (!int_arg(n, 1, 0, &d0) || !int_arg(n, 2, 0, &d1) || n->n_args != 3) return 0;
            d0 += d0 < 0 ? in->ndim : 0, d1 += d1 < 0 ? in->ndim : 0;
            if (d0 < 0 || d1 < 0 || d0 >= in->ndim || d1 >= in->ndim) return 0;
            perm[d0] = (int32_t)d1, perm[d1] = (int32_t)d0;
        }
        if (n->op_id == AF_OP_PERMUTE) {
            if (n->n_args != 2 || n->args[1].kind != AF_ARG_LIST || n->args[1].u.list.n != in->ndim) return 0;
            for (int32_t d = 0; d < in->ndim; d++) {
                const af_arg *a = &n->args[1].u.list.items[d];
                if (a->kind != AF_ARG_INT || a->u.i < -in->ndim || a->u.i >= in->ndim) return 0;
                perm[d] = (int32_t)(a->u.i < 0 ? a->u.i + in->ndim : a->u.i);
            }
        }
        for (int32_t d = 0; d < in->ndim; d++) sz[d] = in->sizes[perm[d]], st[d] = in->strides[perm[d]];
        return same_addressing(&want, out);
    }
    case AF_OP_SLICE: {
        int64_t dim, start, end, step;
        if (n->n_args > 5 || !int_arg(n, 1, 0, &dim) || !int_arg(n, 2, 0, &start) || !int_arg(n, 3, INT64_MAX, &end) ||
            !int_arg(n, 4, 1, &step) || step < 1)
            return 0;
        dim += dim < 0 ? in->ndim : 0;
        if (dim < 0 || dim >= in->ndim) return 0;
        int64_t size = in->sizes[dim];
        start += start < 0 ? size : 0, end += end < 0 ? size : 0;
        start = start < 0 ? 0 : start > size ? size : start;
        end = end < start ? start : end > size ? size : end;
        sz[dim] = (end - start + step - 1) / step, st[dim] = in->strides[dim] * step;
        want.storage_offset = in->storage_offset + start * in->strides[dim];
        return same_addressing(&want, out);
    }
    case AF_OP_SELECT: {
        int64_t dim, index;
        if (n->n_args != 3 || !int_arg(n, 1, 0, &dim) || !int_arg(n, 2, 0, &index)) return 0;
        dim += dim < 0 ? in->ndim : 0;
        if (dim < 0 || dim >= in->ndim) return 0;
        index += index < 0 ? in->sizes[dim] : 0;
        if (index < 0 || index >= in->sizes[dim]) return 0;
        want.storage_offset = in->storage_offset + index * in->strides[dim];
        for (int32_t d = (int32_t)dim; d + 1 < in->ndim; d++) sz[d] = sz[d + 1], st[d] = st[d + 1];
        want.ndim = in->ndim - 1;
        return same_addressing(&want, out);
    }
    case AF_OP_EXPAND: { /* new or size-1 dims step 0 */
        if (out->ndim < in->ndim) return 0;
        for (int32_t d = 0; d < out->ndim; d++) {
            int32_t di = d - (out->ndim - in->ndim);
            int64_t s = di >= 0 ? in->sizes[di] : 1;
            if (out->sizes[d] != 1 && out->strides[d] != (s == 1 ? 0 : in->strides[di])) return 0;
            if (s != 1 && s != out->sizes[d]) return 0;
        }
        return in->storage_offset == out->storage_offset;
    }
    case AF_OP_AS_STRIDED: { /* the arguments, over the same storage */
        if (n->n_args < 3 || n->args[1].kind != AF_ARG_LIST || n->args[2].kind != AF_ARG_LIST || n->args[1].u.list.n != out->ndim ||
            n->args[2].u.list.n != out->ndim)
            return 0;
        int64_t offset = in->storage_offset; /* the sink's own pass it by name (add_source_view) */
        if (n->n_args > 3 && n->args[3].kind != AF_ARG_NONE) {
            if (n->args[3].kind != AF_ARG_INT || (n->args[3].name && strcmp(n->args[3].name, "storage_offset") != 0)) return 0;
            offset = n->args[3].u.i;
        }
        if (offset != out->storage_offset) return 0;
        for (int32_t d = 0; d < out->ndim; d++) {
            const af_arg *a = &n->args[1].u.list.items[d], *b = &n->args[2].u.list.items[d];
            if (a->kind != AF_ARG_INT || b->kind != AF_ARG_INT || a->u.i != out->sizes[d] ||
                (out->sizes[d] != 1 && b->u.i != out->strides[d]))
                return 0;
        }
        return 1;
    }
    default: return 0;
    }
}

int af_views_as_declared(const af_graph *g, int32_t v, int32_t root) {
    for (int32_t w = v; w != root;) {
        const af_node *n = af_graph_node(g, af_graph_value(g, w)->producer);
        int32_t b = n->args[0].u.value;
        if (!view_link_ok(n, &af_graph_value(g, b)->meta, &af_graph_value(g, w)->meta)) return 0;
        w = b;
    }
    return 1;
}

/* A source read through a new view (as_strided, which reads its storage as the graph says it is
 * laid out): its tensor must have the layout of its metadata, also where a kernel falls back and
 * ATen makes that view. Its root has it: a graph input is checked on entry, and the runtime gives
 * every other base of an as_strided view its graph layout (runtime.c, plan_pins). So has the
 * source, when every view link from the root makes the layout its metadata says (view_link_ok),
 * and a one-element tensor. */
static int plain_source(const af_graph *g, int32_t v, const af_tensor_meta *x) {
    const af_tensor_meta *m = &af_graph_value(g, v)->meta;
    if (!broadcasts_to(m, x)) return 0;
    return af_tensor_meta_numel(m) == 1 || af_views_as_declared(g, v, af_graph_view_root(g, v));
}

static int add_unique(int32_t *set, int32_t *n, int32_t cap, int32_t x) {
    for (int32_t k = 0; k < *n; k++)
        if (set[k] == x) return 1;
    if (*n == cap) return 0;
    set[(*n)++] = x;
    return 1;
}

static int by_index(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The pointwise nodes x is computed by and the sources they read (plan->cone, plan->leaves). */
static int collect_cone(const af_graph *g, uint32_t devices, sink_plan *plan) {
    const af_tensor_meta *x = &af_graph_value(g, plan->x)->meta;
    plan->n_cone = plan->n_leaves = 0;
    plan->cone[plan->n_cone++] = af_graph_value(g, plan->x)->producer;
    for (int32_t k = 0; k < plan->n_cone; k++) {
        const af_node *n = af_graph_node(g, plan->cone[k]);
        for (int32_t a = 0; a < n->n_args; a++) {
            if (!value_arg(&n->args[a])) continue;
            int32_t v = n->args[a].u.value, p = af_graph_value(g, v)->producer;
            if (af_graph_value(g, v)->meta.type != AF_VALUE_TENSOR || !broadcasts_to(&af_graph_value(g, v)->meta, x)) return 0;
            if (p >= 0 && sinkable(g, p, devices)) {
                if (!add_unique(plan->cone, &plan->n_cone, SINK_MAX_CONE, p)) return 0;
            } else if (!plain_source(g, v, x) || !add_unique(plan->leaves, &plan->n_leaves, SINK_MAX_LEAVES, v)) {
                return 0;
            }
        }
    }
    qsort(plan->cone, (size_t)plan->n_cone, sizeof(int32_t), by_index);
    return 1;
}

/* The copy's dims as steps along x's dims (plan->pieces, plan->digit), or 0 when some dim
 * would carry across one of x's and cannot be split where it does. */
static int map_dims(const af_tensor_meta *x, const af_tensor_meta *in, sink_plan *plan) {
    int32_t order[AF_MAX_DIMS], n_order = 0;
    for (int32_t d = 0; d < x->ndim; d++)
        if (x->sizes[d] > 1) order[n_order++] = d;
    for (int32_t a = 1; a < n_order; a++) /* by stride, largest first */
        for (int32_t b = a; b > 0 && x->strides[order[b]] > x->strides[order[b - 1]]; b--) {
            int32_t t = order[b];
            order[b] = order[b - 1];
            order[b - 1] = t;
        }
    int64_t span = 1, numel = 1;
    for (int32_t k = n_order - 1; k >= 0; k--) { /* dense: each stride the product of the later sizes */
        if (x->strides[order[k]] != span) return 0;
        span *= x->sizes[order[k]];
    }
    for (int32_t d = 0; d < x->ndim; d++) numel *= x->sizes[d];
    int64_t flat = in->storage_offset - x->storage_offset;
    if (n_order == 0 || flat < 0 || flat >= numel) return 0;
    int64_t used[AF_MAX_DIMS] = {0};
    for (int32_t d = 0; d < x->ndim; d++)
        plan->digit[d] = x->sizes[d] > 1 ? flat / x->strides[d] % x->sizes[d] : 0, used[d] = plan->digit[d];
    plan->ndim = 0;
    for (int32_t k = 0; k < in->ndim; k++) {
        sink_piece inner[AF_MAX_DIMS];
        int32_t ni = 0;
        int64_t n = in->sizes[k], st = in->strides[k];
        if (n == 1 || st == 0) inner[ni++] = (sink_piece){n, -1, 0};
        while (n > 1 && st != 0) {
            if (st < 0 || ni == AF_MAX_DIMS) return 0;
            int32_t d = -1;
            for (int32_t j = 0; j < n_order && d < 0; j++)
                if (st % x->strides[order[j]] == 0) d = order[j];
            int64_t m = st / x->strides[d], size = x->sizes[d];
            if (m >= size) return 0;
            if (used[d] + (n - 1) * m < size) {
                inner[ni++] = (sink_piece){n, d, m};
                used[d] += (n - 1) * m;
                break;
            }
            if (size % m || n % (size / m)) return 0;
            inner[ni++] = (sink_piece){size / m, d, m};
            used[d] += size - m;
            n /= size / m;
            st *= size / m;
        }
        if (plan->ndim + ni > AF_MAX_DIMS) return 0;
        while (ni > 0) plan->pieces[plan->ndim++] = inner[--ni]; /* outer first */
    }
    for (int32_t d = 0; d < x->ndim; d++)
        if (used[d] >= (x->sizes[d] > 1 ? x->sizes[d] : 1)) return 0; /* some dim would carry */
    return 1;
}

/* Whether node c is clone(V(x)) with x pointwise, and how to compute it from x's sources. */
static int plan_copy(const af_graph *g, int32_t c, const uint8_t *is_output, uint32_t devices, sink_plan *plan) {
    const af_node *n = af_graph_node(g, c);
    if (n->op_id != AF_OP_CLONE || is_output[n->first_output] || n->n_outputs != 1 || n->n_args < 1 || !value_arg(&n->args[0])) return 0;
    const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
    int32_t in = n->args[0].u.value, x = af_graph_view_root(g, in);
    const af_tensor_meta *inm = &af_graph_value(g, in)->meta, *xm = &af_graph_value(g, x)->meta;
    int32_t p = af_graph_value(g, x)->producer;
    /* the copy's index map is its input's metadata: it must be what ATen's views make of x (whose
     * layout, a kernel's output, is its metadata's), else the copy stays a kernel that checks it;
     * and a copy with dims (a 0-dim one would make its sources 0-dim, which promote otherwise) */
    /* nor an empty one: no element to compute, and the view's index map has none to map (a copy of
     * `x[3:3]` of a [4, 3] x became a [3] read of x's last row, its [0, 3] reshape then failing) */
    if (x == in || p < 0 || !sinkable(g, p, devices) || out->type != AF_VALUE_TENSOR || !contiguous(out) || out->dtype != inm->dtype ||
        out->ndim != inm->ndim || inm->ndim == 0 || af_tensor_meta_numel(inm) == 0 || !af_views_as_declared(g, in, x))
        return 0;
    memset(plan, 0, sizeof *plan);
    plan->clone = c;
    plan->operand = -1;
    plan->bypass = -1;
    plan->x = x;
    return map_dims(xm, inm, plan) && collect_cone(g, devices, plan);
}

/* Whether node c is a kernel member that reads views like any pointwise operand (at its own
 * index); a window member's source (read at shifted indices) is not one of them (*skip_arg). */
static int reads_views_pointwise(const af_graph *g, int32_t c, uint32_t devices, int32_t *skip_arg) {
    const af_node *n = af_graph_node(g, c);
    const af_tensor_meta *m = &af_graph_value(g, n->first_output)->meta;
    af_window w;
    *skip_arg = -1;
    if (af_op_get(n->op_id)->kind != AF_KIND_POINTWISE || n->op_id == AF_OP_CLONE || n->op_id == AF_OP_RNG_UNIFORM ||
        n->op_id == AF_OP_FULL || n->n_outputs != 1 || m->type != AF_VALUE_TENSOR || m->ndim == 0 ||
        !(devices & (1u << m->device.type)) || af_fuse_node_ok(g, c) != 1)
        return 0;
    if (af_fuse_window(g, c, &w)) *skip_arg = w.source_arg;
    return 1;
}

/* Whether kernel member c's operand `in` = V(x), x pointwise and `in` of c's shape, can be x's
 * nodes over views of x's sources, computed in c's kernel for c alone (a read). Where a dim of
 * `in` crosses dims of x, the nodes run over the finer shape (plan->split) and so must c
 * (split_reader_ok). A window's source (`source`, of its own shape) has no finer shape: its nodes
 * are then the window's shifted members (fuse.h), computed at the source's index. */
static int plan_read(const af_graph *g, int32_t c, int32_t in, int source, uint32_t devices, sink_plan *plan) {
    const af_tensor_meta *out = &af_graph_value(g, af_graph_node(g, c)->first_output)->meta;
    const af_tensor_meta *inm = &af_graph_value(g, in)->meta;
    int32_t x = af_graph_view_root(g, in), p = af_graph_value(g, x)->producer;
    if (x == in || p < 0 || !sinkable(g, p, devices) || inm->type != AF_VALUE_TENSOR || inm->ndim == 0 ||
        af_tensor_meta_numel(inm) == 0 || (!source && inm->ndim != out->ndim) || !af_views_as_declared(g, in, x))
        return 0;
    for (int32_t d = 0; !source && d < inm->ndim; d++)
        if (inm->sizes[d] != out->sizes[d]) return 0;
    memset(plan, 0, sizeof *plan);
    plan->clone = c;
    plan->operand = in;
    plan->bypass = -1;
    plan->x = x;
    if (!map_dims(&af_graph_value(g, x)->meta, inm, plan)) return 0;
    plan->split = plan->ndim != inm->ndim;
    for (int32_t d = 0; !plan->split && d < inm->ndim; d++) plan->split = plan->pieces[d].size != inm->sizes[d];
    return !(source && plan->split) && collect_cone(g, devices, plan);
}

/* Whether kernel member c's operand x, a pointwise value of fewer elements broadcast to c's shape
 * (a norm's weight upcast to float, a saved statistic's), can be x's nodes over broadcast views
 * of x's sources, computed in c's kernel for c alone (a broadcast read). The planner groups a
 * loop's members by their shape, so such a value is otherwise a kernel of its own, and stored.
 * Its nodes are then evaluated per element of c's loop: they must be cheap (no transcendental
 * expression, af_op_expensive), and their sources stored anyway: a graph input, or what no kernel
 * computes (an extern's result), never a kernel's value, which c's kernel may itself compute (a
 * row's statistic is a row member of its readers' kernel already). */
static int plan_broadcast_read(const af_graph *g, int32_t c, int32_t x, uint32_t devices, sink_plan *plan) {
    const af_tensor_meta *out = &af_graph_value(g, af_graph_node(g, c)->first_output)->meta;
    const af_tensor_meta *xm = &af_graph_value(g, x)->meta;
    int32_t p = af_graph_value(g, x)->producer;
    if (p < 0 || !sinkable(g, p, devices) || xm->ndim == 0 || !broadcasts_to(xm, out) ||
        af_tensor_meta_numel(xm) >= af_tensor_meta_numel(out))
        return 0;
    memset(plan, 0, sizeof *plan);
    plan->clone = c;
    plan->operand = x;
    plan->bypass = -1;
    plan->x = x;
    plan->ndim = out->ndim;
    for (int32_t d = 0; d < out->ndim; d++) {
        int32_t dx = d - (out->ndim - xm->ndim);
        plan->pieces[d] = dx >= 0 && xm->sizes[dx] != 1 ? (sink_piece){out->sizes[d], dx, 1} : (sink_piece){out->sizes[d], -1, 0};
    }
    if (!collect_cone(g, devices, plan)) return 0;
    for (int32_t k = 0; k < plan->n_cone; k++)
        if (af_op_expensive(af_op_get(af_graph_node(g, plan->cone[k])->op_id))) return 0;
    for (int32_t l = 0; l < plan->n_leaves; l++) {
        int32_t q = af_graph_value(g, af_graph_view_root(g, plan->leaves[l]))->producer;
        if (q >= 0 && (af_fuse_node_ok(g, q) || af_fuse_reduction_ok(g, q, NULL))) return 0;
    }
    return 1;
}

/* Per value: 1 when a kernel member that is no copy reads it as it is (it would share that
 * member's kernel, which a view between them splits). */
static uint8_t *fused_readers(const af_graph *g) {
    int32_t nn = af_graph_num_nodes(g);
    uint8_t *r = calloc((size_t)af_graph_num_values(g) + 1, 1);
    for (int32_t i = 0; r && i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        if (n->op_id == AF_OP_CLONE || af_op_get(n->op_id)->kind == AF_KIND_VIEW || !af_fuse_node_ok(g, i)) continue;
        for (int32_t a = 0; a < n->n_args; a++)
            if (value_arg(&n->args[a])) r[n->args[a].u.value] = 1;
    }
    return r;
}

/* The box [start, start + size) of one dim, cut onto the pieces that dim splits into (sizes,
 * outer first; inner: elements of the dim one step of each spans), as a box per piece (starts[],
 * lens[]); 0 where it is no box there (it straddles a piece's steps partly). */
static int cut_box(int64_t start, int64_t size, int32_t n_pieces, const int64_t *sizes, const int64_t *inner, int64_t *starts,
                   int64_t *lens) {
    for (int32_t k = 0; k < n_pieces; k++) {
        if (start == 0 && size == sizes[k] * inner[k]) { /* the rest whole */
            for (; k < n_pieces; k++) starts[k] = 0, lens[k] = sizes[k];
            return 1;
        }
        if (start % inner[k] == 0 && size % inner[k] == 0) { /* whole steps of this piece, the rest whole */
            starts[k] = start / inner[k], lens[k] = size / inner[k];
            for (k++; k < n_pieces; k++) starts[k] = 0, lens[k] = sizes[k];
            return 1;
        }
        if (size == 0 || start / inner[k] != (start + size - 1) / inner[k]) return 0;
        starts[k] = start / inner[k], lens[k] = 1; /* within one step of this piece: the box is inside it */
        start %= inner[k];
    }
    return 0;
}

/* The pieces of a split read, per piece: the reader's dim it cuts (dim_of) and how many elements of
 * that dim one of its steps spans (inner); the pieces of one dim are consecutive, outer first
 * (map_dims). */
static void piece_dims(const sink_plan *plan, const af_tensor_meta *cm, int32_t *dim_of, int64_t *inner) {
    for (int32_t k = 0, d = 0, left = 1; k < plan->ndim; k++) {
        int64_t rest = left ? cm->sizes[d] : inner[k - 1];
        dim_of[k] = d;
        inner[k] = rest / plan->pieces[k].size;
        left = inner[k] == 1;
        d += left;
    }
}

/* A box_fill reader's box over the finer shape (starts, sizes), or 0 where it is no box there. */
static int box_over_pieces(const af_node *n, const sink_plan *plan, const int32_t *dim_of, const int64_t *inner, int64_t *starts,
                           int64_t *lens) {
    int64_t sizes[AF_MAX_DIMS];
    for (int32_t k = 0; k < plan->ndim; k++) sizes[k] = plan->pieces[k].size;
    for (int32_t k = 0; k < plan->ndim;) {
        int32_t d = dim_of[k], e = k;
        while (e < plan->ndim && dim_of[e] == d) e++;
        if (!cut_box(n->args[1].u.list.items[d].u.i, n->args[2].u.list.items[d].u.i, e - k, sizes + k, inner + k, starts + k, lens + k))
            return 0;
        k = e;
    }
    return 1;
}

/* Whether c, reading plan's view over a finer shape, can be computed over that shape too and
 * viewed back without splitting a kernel: no list argument (nothing tied to c's shape) but a
 * box_fill's box where it cuts onto the pieces, no other window member; a value no member shares
 * c's kernel by (fused: fused_readers) and the graph does not return (its layout is kept: the
 * finer value has c's strides cut, so the view back makes c's); every other tensor operand a
 * source the new view of it can trust (plain_source) that is a kernel input anyway (a view, a
 * graph input, what no kernel computes) or 0-dim. */
static int split_reader_ok(const af_graph *g, int32_t c, const sink_plan *plan, const uint8_t *is_output, const uint8_t *fused) {
    const af_node *n = af_graph_node(g, c);
    const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
    int32_t in = plan->operand, dim_of[AF_MAX_DIMS];
    int64_t inner[AF_MAX_DIMS], starts[AF_MAX_DIMS], lens[AF_MAX_DIMS];
    af_window w;
    int box = n->op_id == AF_OP_BOX_FILL && af_fuse_window(g, c, &w) && w.base == in;
    if (is_output[n->first_output] || fused[n->first_output] || (!box && af_fuse_window(g, c, NULL))) return 0;
    if (box) {
        piece_dims(plan, out, dim_of, inner);
        if (!box_over_pieces(n, plan, dim_of, inner, starts, lens)) return 0;
    }
    for (int32_t a = 0; a < n->n_args; a++) {
        if (n->args[a].kind == AF_ARG_LIST && !box) return 0;
        if (!value_arg(&n->args[a]) || n->args[a].u.value == in) continue;
        int32_t v = n->args[a].u.value, p = af_graph_value(g, v)->producer;
        const af_tensor_meta *m = &af_graph_value(g, v)->meta;
        if (m->type != AF_VALUE_TENSOR) return 0;
        if (m->ndim == 0) continue;
        if (!plain_source(g, v, out) || (p >= 0 && af_op_get(af_graph_node(g, p)->op_id)->kind != AF_KIND_VIEW && af_fuse_node_ok(g, p)))
            return 0;
    }
    return 1;
}

/* Whether window member c's source (argument a, read at shifted indices, so never a member of
 * c's kernel) is a copy, clone(u), that c can read as u: the copy is then a kernel of its own for
 * nothing (a pad of a crop's copy, say). */
static int plan_bypass(const af_graph *g, int32_t c, int32_t a, const uint8_t *is_output, sink_plan *plan) {
    const af_node *n = af_graph_node(g, c);
    if (a < 0 || a >= n->n_args || !value_arg(&n->args[a])) return 0;
    int32_t s = n->args[a].u.value, p = af_graph_value(g, s)->producer;
    const af_node *copy = p >= 0 ? af_graph_node(g, p) : NULL;
    if (!copy || copy->op_id != AF_OP_CLONE || is_output[s] || copy->n_args < 1 || !value_arg(&copy->args[0])) return 0;
    int32_t u = copy->args[0].u.value;
    const af_tensor_meta *sm = &af_graph_value(g, s)->meta, *um = &af_graph_value(g, u)->meta;
    if (um->type != AF_VALUE_TENSOR || um->dtype != sm->dtype || um->ndim != sm->ndim || um->ndim == 0 ||
        um->device.type != sm->device.type || um->device.index != sm->device.index)
        return 0;
    for (int32_t d = 0; d < um->ndim; d++)
        if (um->sizes[d] != sm->sizes[d]) return 0;
    memset(plan, 0, sizeof *plan);
    plan->clone = c;
    plan->operand = s;
    plan->bypass = u;
    plan->x = s;
    plan->n_leaves = 1;
    plan->leaves[0] = u;
    return 1;
}

/* ---- the rewritten graph ---- */

static void free_args(af_arg *a, int32_t n);

static int copy_args(const af_arg *src, int32_t n, const int32_t *map, af_arg **out) {
    *out = NULL;
    if (n == 0) return AF_OK;
    af_arg *a = calloc((size_t)n, sizeof *a);
    if (!a) return af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    for (int32_t k = 0; k < n; k++) {
        a[k] = src[k];
        if (src[k].kind == AF_ARG_VALUE) a[k].u.value = map[src[k].u.value];
        if (src[k].kind == AF_ARG_LIST) {
            af_arg *items = NULL;
            int st = copy_args(src[k].u.list.items, src[k].u.list.n, map, &items);
            if (st) {
                free_args(a, k);
                return st;
            }
            a[k].u.list.items = items;
        }
    }
    *out = a;
    return AF_OK;
}

static void free_args(af_arg *a, int32_t n) {
    for (int32_t k = 0; a && k < n; k++)
        if (a[k].kind == AF_ARG_LIST) free_args(a[k].u.list.items, a[k].u.list.n);
    free(a);
}

static int add_copy_of(af_graph *out, const af_graph *g, int32_t i, int32_t *map) {
    const af_node *n = af_graph_node(g, i);
    af_tensor_meta metas[64];
    if (n->n_outputs > 64) return af_error_set(AF_ERR_UNSUPPORTED, "node %s: more than 64 outputs", n->op);
    for (int32_t k = 0; k < n->n_outputs; k++) metas[k] = af_graph_value(g, n->first_output + k)->meta;
    af_arg *args = NULL;
    int32_t first = -1;
    int st = copy_args(n->args, n->n_args, map, &args);
    if (!st) st = af_graph_add_node(out, n->op, args, n->n_args, metas, n->n_outputs, &first);
    free_args(args, n->n_args);
    for (int32_t k = 0; !st && k < n->n_outputs; k++) map[n->first_output + k] = first + k;
    return st;
}

static int add_node1(af_graph *out, const char *op, const af_arg *args, int32_t n_args, const af_tensor_meta *m, int32_t *v) {
    return af_graph_add_node(out, op, args, n_args, m, 1, v);
}

static af_arg int_list(af_arg *items, const int64_t *v, int32_t n) {
    for (int32_t k = 0; k < n; k++) items[k] = (af_arg){.kind = AF_ARG_INT, .u.i = v[k]};
    return (af_arg){.kind = AF_ARG_LIST, .u.list = {n, items}};
}

/* New values that stand for an old one with another layout: (new, old) pairs. */
typedef struct {
    int32_t *pairs;
    int32_t n, cap;
} sink_origins;

static int add_origin(sink_origins *o, int32_t new_value, int32_t old_value) {
    if (o->n == o->cap) {
        int32_t cap = o->cap ? 2 * o->cap : 64, *grown = realloc(o->pairs, (size_t)cap * 2 * sizeof(int32_t));
        if (!grown) return af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
        o->pairs = grown, o->cap = cap;
    }
    o->pairs[2 * o->n] = new_value, o->pairs[2 * o->n + 1] = old_value;
    o->n++;
    return AF_OK;
}

/* as_strided(v, sizes, strides, offset) over v's storage, standing for v (origins): *view; the
 * one made earlier where there is one (a saved statistic broadcast for two readers). */
static int add_source_view(af_graph *out, const af_graph *g, int32_t v, const int32_t *map, int32_t nd, const int64_t *sizes,
                           const int64_t *strides, int64_t offset, sink_origins *origins, int32_t *view) {
    af_tensor_meta vm = af_graph_value(g, v)->meta;
    vm.ndim = nd, vm.sizes = sizes, vm.strides = strides, vm.storage_offset = offset;
    for (int32_t k = 0; k < origins->n; k++) {
        int32_t w = origins->pairs[2 * k];
        const af_value *made = af_graph_value(out, w);
        if (origins->pairs[2 * k + 1] != v || made->producer < 0 || af_graph_node(out, made->producer)->op_id != AF_OP_AS_STRIDED ||
            !af_tensor_meta_same_layout(&made->meta, &vm, 1))
            continue;
        *view = w;
        return AF_OK;
    }
    af_arg items[2][AF_MAX_DIMS];
    /* the offset by name: the runtime makes such a view relative to its base as traced (runtime.c,
     * relative_view), where ATen's as_strided takes the storage's */
    af_arg args[4] = {{.kind = AF_ARG_VALUE, .u.value = map[v]}, int_list(items[0], sizes, nd), int_list(items[1], strides, nd),
                      {.kind = AF_ARG_INT, .name = "storage_offset", .u.i = offset}};
    int st = add_node1(out, "aten::as_strided.default", args, 4, &vm, view);
    return st ? st : add_origin(origins, *view, v);
}

/* The copy's nodes: one as_strided view per source, the cone over the finer shape, a view back.
 * The views stand for their sources, the cone's last value for the copy (origins). A read's: the
 * same without a view back; its last value (*read_value) stands for the view it replaces. */
static int add_rewritten(af_graph *out, const af_graph *g, const sink_plan *plan, int32_t *map, sink_origins *origins,
                         int32_t *read_value) {
    const af_tensor_meta *x = &af_graph_value(g, plan->x)->meta;
    const af_tensor_meta *copy = &af_graph_value(g, af_graph_node(g, plan->clone)->first_output)->meta;
    int64_t sizes[AF_MAX_DIMS], strides[AF_MAX_DIMS], dense[AF_MAX_DIMS];
    int32_t nd = plan->ndim;
    for (int32_t k = 0; k < nd; k++) sizes[k] = plan->pieces[k].size;
    for (int32_t k = nd - 1; k >= 0; k--) dense[k] = k == nd - 1 ? 1 : dense[k + 1] * sizes[k + 1];
    int32_t *local = malloc((size_t)af_graph_num_values(g) * sizeof(int32_t));
    if (!local) return af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    memcpy(local, map, (size_t)af_graph_num_values(g) * sizeof(int32_t));
    int st = AF_OK;
    for (int32_t l = 0; l < plan->n_leaves && !st; l++) {
        int32_t v = plan->leaves[l];
        const af_tensor_meta *m = &af_graph_value(g, v)->meta;
        if (m->ndim == 0) continue; /* read as it is: a 0-dim tensor broadcasts (and promotes) as before */
        int64_t offset = m->storage_offset;
        for (int32_t k = 0; k < nd; k++) {
            int32_t d = plan->pieces[k].dim, dl = d < 0 ? -1 : d - (x->ndim - m->ndim);
            strides[k] = dl >= 0 && m->sizes[dl] != 1 ? plan->pieces[k].mult * m->strides[dl] : 0;
        }
        for (int32_t d = 0; d < x->ndim; d++) {
            int32_t dl = d - (x->ndim - m->ndim);
            if (dl >= 0 && m->sizes[dl] != 1) offset += plan->digit[d] * m->strides[dl];
        }
        af_tensor_meta view = *m;
        view.ndim = nd, view.sizes = sizes, view.strides = strides, view.storage_offset = offset;
        /* a view that is the source itself is none: its readers read the source, which a kernel
         * computing it (a window's value, say) may then give them directly */
        if (!af_tensor_meta_same_layout(m, &view, 0))
            st = add_source_view(out, g, v, map, nd, sizes, strides, offset, origins, &local[v]);
    }
    int32_t last = -1;
    for (int32_t c = 0; c < plan->n_cone && !st; c++) {
        const af_node *n = af_graph_node(g, plan->cone[c]);
        af_tensor_meta vm = af_graph_value(g, n->first_output)->meta;
        vm.ndim = nd, vm.sizes = sizes, vm.strides = dense, vm.storage_offset = 0;
        af_arg *args = NULL;
        if (!(st = copy_args(n->args, n->n_args, local, &args))) st = add_node1(out, n->op, args, n->n_args, &vm, &last);
        free_args(args, n->n_args);
        local[n->first_output] = last;
    }
    int32_t result = last;
    free(local);
    if (plan->operand >= 0) { /* a read: the value stands for the view, given to its reader alone */
        if (!st) st = add_origin(origins, last, plan->operand);
        if (!st) *read_value = last;
        return st;
    }
    if (!st) st = add_origin(origins, last, af_graph_node(g, plan->clone)->first_output);
    int same = nd == copy->ndim;
    for (int32_t k = 0; same && k < nd; k++) same = sizes[k] == copy->sizes[k];
    if (!st && !same) {
        af_arg items[AF_MAX_DIMS];
        af_arg args[2] = {{.kind = AF_ARG_VALUE, .u.value = last}, int_list(items, copy->sizes, copy->ndim)};
        st = add_node1(out, "aten::view.default", args, 2, copy, &result);
    }
    if (!st) map[af_graph_node(g, plan->clone)->first_output] = result;
    return st;
}

/* A reader whose read is split: the read's nodes over the finer shape, every other operand an
 * as_strided view over it (its own strides, cut as the reader's dims are), the reader over it,
 * and a view back to the reader's shape, which stands for the reader's value. */
static int add_split_reader(af_graph *out, const af_graph *g, const sink_plan *plan, int32_t *map, sink_origins *origins) {
    const af_node *n = af_graph_node(g, plan->clone);
    const af_tensor_meta *cm = &af_graph_value(g, n->first_output)->meta;
    int64_t sizes[AF_MAX_DIMS], strides[AF_MAX_DIMS], cut[AF_MAX_DIMS], inner[AF_MAX_DIMS], starts[AF_MAX_DIMS], lens[AF_MAX_DIMS];
    int32_t nd = plan->ndim, dim_of[AF_MAX_DIMS], r = -1, result = -1;
    piece_dims(plan, cm, dim_of, inner);
    for (int32_t k = 0; k < nd; k++) sizes[k] = plan->pieces[k].size, cut[k] = cm->strides[dim_of[k]] * inner[k];
    int32_t *local = malloc((size_t)af_graph_num_values(g) * sizeof(int32_t));
    if (!local) return af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    memcpy(local, map, (size_t)af_graph_num_values(g) * sizeof(int32_t));
    int st = add_rewritten(out, g, plan, map, origins, &r);
    if (!st) local[plan->operand] = r;
    for (int32_t a = 0; !st && a < n->n_args; a++) {
        if (!value_arg(&n->args[a]) || n->args[a].u.value == plan->operand) continue;
        int32_t v = n->args[a].u.value;
        const af_tensor_meta *m = &af_graph_value(g, v)->meta;
        if (m->ndim == 0 || local[v] != map[v]) continue; /* 0-dim: as it is; or already viewed */
        for (int32_t k = 0; k < nd; k++) {
            int32_t dl = dim_of[k] - (cm->ndim - m->ndim);
            strides[k] = dl >= 0 && m->sizes[dl] != 1 ? m->strides[dl] * inner[k] : 0;
        }
        st = add_source_view(out, g, v, map, nd, sizes, strides, m->storage_offset, origins, &local[v]);
    }
    af_arg *args = NULL, box_items[2][AF_MAX_DIMS];
    int box = n->op_id == AF_OP_BOX_FILL;
    if (!st) st = copy_args(n->args, n->n_args, local, &args);
    if (!st && box) { /* its box, cut onto the pieces (split_reader_ok checked that it cuts) */
        box_over_pieces(n, plan, dim_of, inner, starts, lens);
        free(args[1].u.list.items);
        free(args[2].u.list.items);
        args[1] = int_list(box_items[0], starts, nd), args[2] = int_list(box_items[1], lens, nd);
    }
    if (!st) { /* c's layout, its dims cut: the view back makes c's strides */
        af_tensor_meta vm = *cm;
        vm.ndim = nd, vm.sizes = sizes, vm.strides = cut;
        st = add_node1(out, n->op, args, n->n_args, &vm, &r);
    }
    if (args && box) args[1].kind = args[2].kind = AF_ARG_NONE; /* the cut lists are local arrays, not to free */
    free_args(args, n->n_args);
    free(local);
    if (!st) st = add_origin(origins, r, n->first_output);
    if (!st) {
        af_arg items[AF_MAX_DIMS];
        af_arg vargs[2] = {{.kind = AF_ARG_VALUE, .u.value = r}, int_list(items, cm->sizes, cm->ndim)};
        st = add_node1(out, "aten::view.default", vargs, 2, cm, &result);
    }
    if (!st) map[n->first_output] = result;
    return st;
}

static void mark_read(const af_graph *g, const af_arg *a, uint8_t *live, const sink_plan *reads, int32_t n_reads) {
    if (a->kind == AF_ARG_VALUE) {
        for (int32_t k = 0; k < n_reads; k++)
            if (reads[k].operand == a->u.value) { /* read through its recomputed value: its sources instead */
                for (int32_t l = 0; l < reads[k].n_leaves; l++)
                    mark_read(g, &(af_arg){.kind = AF_ARG_VALUE, .u.value = reads[k].leaves[l]}, live, NULL, 0);
                return;
            }
        if (af_graph_value(g, a->u.value)->producer >= 0) live[af_graph_value(g, a->u.value)->producer] = 1;
    }
    if (a->kind == AF_ARG_LIST)
        for (int32_t k = 0; k < a->u.list.n; k++) mark_read(g, &a->u.list.items[k], live, reads, n_reads);
}

/* Per value: how often a node that is no view reads it or a view of it (counted at its view
 * root), and how many of those reads a plan rewrites (a copy of it, or a read planned). */
static void count_reads(const af_graph *g, const af_arg *a, int32_t node, const sink_plan *mine, int32_t n_mine, int32_t *total,
                        int32_t *covered) {
    if (a->kind == AF_ARG_LIST)
        for (int32_t k = 0; k < a->u.list.n; k++) count_reads(g, &a->u.list.items[k], node, mine, n_mine, total, covered);
    if (a->kind != AF_ARG_VALUE) return;
    int32_t r = af_graph_view_root(g, a->u.value);
    total[r]++;
    for (int32_t k = 0; k < n_mine; k++)
        if (mine[k].operand == a->u.value || (mine[k].operand < 0 && mine[k].clone == node && r != a->u.value)) {
            covered[r]++;
            break;
        }
}

/* Keeps the reads planned for x only where x is then no longer stored (every read of x or of a
 * view of it is rewritten, and no graph output is either) and the kernels recomputing it read no
 * more than storing and loading it did: n readers of L sources each against x's L, its store and
 * its n loads. */
static int32_t keep_profitable_reads(const af_graph *g, sink_plan *plans, int32_t n_plans, const int32_t *first, const int32_t *count) {
    int32_t nv = af_graph_num_values(g), nn = af_graph_num_nodes(g), kept = 0;
    int32_t *total = calloc((size_t)nv + 1, sizeof(int32_t)), *covered = calloc((size_t)nv + 1, sizeof(int32_t));
    if (!total || !covered) {
        free(total);
        free(covered);
        return -1;
    }
    for (int32_t i = 0; i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        if (af_op_get(n->op_id)->kind == AF_KIND_VIEW) continue;
        for (int32_t a = 0; a < n->n_args; a++) count_reads(g, &n->args[a], i, plans + first[i], count[i], total, covered);
    }
    for (int32_t o = 0; o < af_graph_num_outputs(g); o++) total[af_graph_view_root(g, af_graph_output(g, o))] += 1 << 20;
    for (int32_t k = 0; k < n_plans; k++) {
        if (plans[k].operand < 0 || plans[k].bypass >= 0) continue; /* a bypass reads what it read, less a kernel */
        int32_t x = plans[k].x, n = covered[x], leaves = plans[k].n_leaves;
        if (total[x] == covered[x] && (int64_t)n * leaves <= leaves + 1 + n) {
            kept++;
            continue;
        }
        plans[k].operand = -2; /* dropped */
    }
    free(total);
    free(covered);
    return kept;
}

static int push_plan(sink_plan **plans, int32_t *n, int32_t *cap, const sink_plan *p) {
    if (*n == *cap) {
        int32_t c = *cap ? 2 * *cap : 64;
        sink_plan *grown = realloc(*plans, (size_t)c * sizeof **plans);
        if (!grown) return af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
        *plans = grown, *cap = c;
    }
    (*plans)[(*n)++] = *p;
    return AF_OK;
}

/* One pass over g: every copy that qualifies now, and every kernel member's read of a view of
 * a pointwise value that then need not be stored, rewritten (*out NULL when none); *origin: per
 * value of *out, the value of g it stands for (-1: a recomputed intermediate). */
static int sink_pass(const af_graph *g, uint32_t devices, int reads, af_graph **out, int32_t *n_sunk, int32_t **origin) {
    *out = NULL;
    *n_sunk = 0;
    *origin = NULL;
    int32_t nn = af_graph_num_nodes(g), nv = af_graph_num_values(g), n_plans = 0, cap = 0, found = 0;
    int32_t *first = calloc((size_t)nn + 1, sizeof(int32_t)), *count = calloc((size_t)nn + 1, sizeof(int32_t));
    uint8_t *is_output = calloc((size_t)nv + 1, 1); /* a copy returned stays a fresh tensor */
    uint8_t *fused = fused_readers(g);
    sink_plan *plans = NULL, tmp;
    int st = first && count && is_output && fused ? AF_OK : af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    for (int32_t o = 0; !st && o < af_graph_num_outputs(g); o++) is_output[af_graph_output(g, o)] = 1;
    for (int32_t i = 0; !st && i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        int32_t skip = -1;
        first[i] = n_plans;
        if (plan_copy(g, i, is_output, devices, &tmp)) { /* a copy is rewritten whole */
            st = push_plan(&plans, &n_plans, &cap, &tmp);
            count[i] = 1;
            continue;
        }
        if (!reads || !reads_views_pointwise(g, i, devices, &skip)) continue;
        if ((reads & AF_SINK_VIEW_READS) && plan_bypass(g, i, skip, is_output, &tmp)) {
            st = push_plan(&plans, &n_plans, &cap, &tmp);
            count[i]++;
        }
        for (int32_t a = 0; !st && a < n->n_args && count[i] < SINK_MAX_READS; a++) {
            if (!value_arg(&n->args[a])) continue;
            if (!((reads & AF_SINK_VIEW_READS) && plan_read(g, i, n->args[a].u.value, a == skip, devices, &tmp)) &&
                !((reads & AF_SINK_BROADCAST_READS) && a != skip && plan_broadcast_read(g, i, n->args[a].u.value, devices, &tmp)))
                continue;
            int dup = 0; /* one plan per view read, however often; a split read is its reader's only one */
            for (int32_t k = first[i]; k < n_plans; k++) dup |= plans[k].operand == tmp.operand;
            if (dup || (tmp.split && (count[i] > 0 || !split_reader_ok(g, i, &tmp, is_output, fused)))) continue;
            st = push_plan(&plans, &n_plans, &cap, &tmp);
            count[i]++;
            if (tmp.split) break;
        }
    }
    free(fused);
    free(is_output);
    int32_t kept = st || n_plans == 0 ? 0 : keep_profitable_reads(g, plans, n_plans, first, count);
    if (!st && kept < 0) st = af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    for (int32_t k = 0; !st && k < n_plans; k++) found += plans[k].operand != -2;
    if (st || found == 0) {
        free(first);
        free(count);
        free(plans);
        return st;
    }
    for (int32_t i = 0, w = 0; i < nn; i++) { /* drop the reads not kept */
        int32_t f = first[i], c = count[i];
        first[i] = w;
        count[i] = 0;
        for (int32_t k = f; k < f + c; k++)
            if (plans[k].operand != -2) plans[w++] = plans[k], count[i]++;
    }
    /* what the rewritten graph still computes: outputs, what is not pointwise or a view, and what
     * those read (a rewritten copy reads its sources, a rewritten read its own) */
    uint8_t *live = calloc((size_t)nn + 1, 1);
    int32_t *map = malloc(((size_t)nv + 1) * sizeof(int32_t)), saved[SINK_MAX_READS];
    af_graph *ng = NULL;
    st = live && map ? af_graph_new(&ng) : af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    for (int32_t o = 0; !st && o < af_graph_num_outputs(g); o++) {
        int32_t p = af_graph_value(g, af_graph_output(g, o))->producer;
        if (p >= 0) live[p] = 1;
    }
    for (int32_t i = nn - 1; !st && i >= 0; i--) {
        const af_node *n = af_graph_node(g, i);
        af_op_kind kind = af_op_get(n->op_id)->kind;
        if (kind != AF_KIND_POINTWISE && kind != AF_KIND_VIEW) live[i] = 1;
        if (!live[i]) continue;
        const sink_plan *mine = plans + first[i];
        if (count[i] == 1 && mine->operand < 0) {
            for (int32_t l = 0; l < mine->n_leaves; l++) mark_read(g, &(af_arg){.kind = AF_ARG_VALUE, .u.value = mine->leaves[l]}, live, NULL, 0);
        } else {
            for (int32_t a = 0; a < n->n_args; a++) mark_read(g, &n->args[a], live, mine, count[i]);
        }
    }
    for (int32_t v = 0; !st && v < nv; v++) map[v] = -1;
    for (int32_t k = 0; !st && k < af_graph_num_inputs(g); k++) {
        const af_value *in = af_graph_value(g, af_graph_input(g, k));
        st = af_graph_add_input(ng, in->name, &in->meta, &map[af_graph_input(g, k)]);
    }
    sink_origins origins = {0};
    for (int32_t i = 0; !st && i < nn; i++) {
        if (!live[i]) continue;
        const sink_plan *mine = plans + first[i];
        if (count[i] == 1 && mine->operand < 0) {
            st = add_rewritten(ng, g, mine, map, &origins, NULL);
            continue;
        }
        if (count[i] == 1 && mine->split) {
            st = add_split_reader(ng, g, mine, map, &origins);
            continue;
        }
        int32_t done = 0; /* the reader gets the recomputed values in place of its views, for itself only */
        for (; !st && done < count[i]; done++) {
            int32_t r = mine[done].bypass >= 0 ? map[mine[done].bypass] : -1;
            if (mine[done].bypass < 0) st = add_rewritten(ng, g, &mine[done], map, &origins, &r);
            saved[done] = map[mine[done].operand];
            if (!st) map[mine[done].operand] = r;
        }
        if (!st) st = add_copy_of(ng, g, i, map);
        while (done-- > 0) map[mine[done].operand] = saved[done];
    }
    int32_t nv_new = st ? 0 : af_graph_num_values(ng);
    int32_t *org = st ? NULL : malloc(((size_t)nv_new + 1) * sizeof(int32_t));
    if (!st && !org) st = af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    for (int32_t v = 0; !st && v < nv_new; v++) org[v] = -1;
    for (int32_t v = 0; !st && v < nv; v++)
        if (map[v] >= 0) org[map[v]] = v;
    for (int32_t k = 0; !st && k < origins.n; k++) org[origins.pairs[2 * k]] = origins.pairs[2 * k + 1];
    free(origins.pairs);
    int32_t no = af_graph_num_outputs(g), *outs = malloc(((size_t)no + 1) * sizeof(int32_t));
    if (!st && !outs) st = af_error_set(AF_ERR_NOMEM, "out of memory rewriting copies");
    for (int32_t o = 0; !st && o < no; o++) outs[o] = map[af_graph_output(g, o)];
    if (!st) st = af_graph_set_outputs(ng, outs, no);
    if (!st) st = af_graph_verify(ng);
    free(outs);
    free(live);
    free(map);
    free(first);
    free(count);
    free(plans);
    if (st) {
        af_graph_free(ng);
        free(org);
        return st;
    }
    *out = ng;
    *n_sunk = found;
    *origin = org;
    return AF_OK;
}

/* Passes until none rewrites a copy: a copy of a view of a rewritten copy qualifies in the next
 * pass (its cone then ends at as_strided views of sources), so chains of copies collapse. */
int af_sink_copies(const af_graph *g, uint32_t device_types, int reads, af_graph **out, int32_t *n_sunk, int32_t **origin) {
    if (!g || !out) return af_error_set(AF_ERR_INVALID, "af_sink_copies: NULL argument");
    *out = NULL;
    if (n_sunk) *n_sunk = 0;
    if (origin) *origin = NULL;
    af_graph *owned = NULL;
    int32_t total = 0, *org = NULL; /* per value of owned: g's value it stands for */
    for (int pass = 0; pass < SINK_MAX_PASSES; pass++) {
        af_graph *next = NULL;
        int32_t n = 0, *step = NULL;
        int st = sink_pass(owned ? owned : g, device_types ? device_types : AF_FUSE_ALL_DEVICES, reads, &next, &n, &step);
        if (st) {
            af_graph_free(owned);
            free(org);
            return st;
        }
        if (!next) break;
        for (int32_t v = 0; org && v < af_graph_num_values(next); v++) step[v] = step[v] < 0 ? -1 : org[step[v]];
        af_graph_free(owned);
        free(org);
        owned = next, org = step;
        total += n;
    }
    *out = owned;
    if (n_sunk) *n_sunk = total;
    if (origin) *origin = org;
    else free(org);
    return AF_OK;
}
