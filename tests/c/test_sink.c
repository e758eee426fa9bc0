/* CMocka tests of csrc/sink.c: copies of views of pointwise values, and kernel members' reads of
 * them, computed from the sources through one as_strided view each (which views, which finer
 * shape, what is dropped), and the copies and reads left alone. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "aotfuse/fuse.h"

static af_tensor_meta meta(int32_t nd, const int64_t *sizes, const int64_t *strides, int64_t offset) {
    af_tensor_meta m = {0};
    m.type = AF_VALUE_TENSOR;
    m.dtype = AF_DTYPE_FLOAT32;
    m.device.index = -1;
    m.ndim = nd;
    m.sizes = sizes;
    m.strides = strides;
    m.storage_offset = offset;
    return m;
}

static int32_t add_node(af_graph *g, const char *op, const af_arg *args, int32_t n, af_tensor_meta m) {
    int32_t out = -1;
    assert_int_equal(af_graph_add_node(g, op, args, n, &m, 1, &out), AF_OK);
    return out;
}

static af_arg val(int32_t v) { return (af_arg){.kind = AF_ARG_VALUE, .u.value = v}; }

/* A new graph with one input a (float32, the given layout); x = neg(a) when x is not NULL. */
static af_graph *start_graph(int32_t nd, const int64_t *sizes, const int64_t *strides, int32_t *a, int32_t *x) {
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m = meta(nd, sizes, strides, 0);
    assert_int_equal(af_graph_add_input(g, "a", &m, a), AF_OK);
    if (x) *x = add_node(g, "aten::neg.default", (af_arg[]){val(*a)}, 1, m);
    return g;
}

static af_arg ints(af_arg *items, const int64_t *v, int32_t n) {
    for (int32_t k = 0; k < n; k++) items[k] = (af_arg){.kind = AF_ARG_INT, .u.i = v[k]};
    return (af_arg){.kind = AF_ARG_LIST, .u.list = {n, items}};
}

static void assert_meta(const af_tensor_meta *m, int32_t nd, const int64_t *sizes, const int64_t *strides, int64_t offset) {
    assert_int_equal(m->ndim, nd);
    for (int32_t d = 0; d < nd; d++) {
        assert_int_equal(m->sizes[d], sizes[d]);
        assert_int_equal(m->strides[d], strides[d]);
    }
    assert_int_equal(m->storage_offset, offset);
}

static const af_node *node_at(const af_graph *g, int32_t i, const char *op) {
    assert_true(i < af_graph_num_nodes(g));
    const af_node *n = af_graph_node(g, i);
    assert_string_equal(n->op, op);
    return n;
}

/* x = a + b over [2, 2, 4]; copy = clone(permute(view(x, [4, 4]))): the copy's dim 1 steps 4
 * elements of x, across x's dims 0 and 1, so the copy is computed over [4, 2, 2] from
 * as_strided views of a and of b (broadcast along the last dim), then viewed back to [4, 4]. */
static void test_a_permuted_copy_is_computed_from_the_sources(void **state) {
    (void)state;
    static const int64_t s3[3] = {2, 2, 4}, t3[3] = {8, 4, 1}, s1[1] = {4}, t1[1] = {1};
    static const int64_t s44[2] = {4, 4}, t44[2] = {4, 1}, t44p[2] = {1, 4}, perm[2] = {1, 0};
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t a, b;
    af_tensor_meta ma = meta(3, s3, t3, 0), mb = meta(1, s1, t1, 0);
    assert_int_equal(af_graph_add_input(g, "a", &ma, &a), AF_OK);
    assert_int_equal(af_graph_add_input(g, "b", &mb, &b), AF_OK);
    af_arg items[2][4];
    int32_t x = add_node(g, "aten::add.Tensor", (af_arg[]){val(a), val(b)}, 2, meta(3, s3, t3, 0));
    int32_t v = add_node(g, "aten::view.default", (af_arg[]){val(x), ints(items[0], s44, 2)}, 2, meta(2, s44, t44, 0));
    int32_t w = add_node(g, "aten::permute.default", (af_arg[]){val(v), ints(items[1], perm, 2)}, 2, meta(2, s44, t44p, 0));
    int32_t c = add_node(g, "aten::clone.default", (af_arg[]){val(w)}, 1, meta(2, s44, t44, 0));
    int32_t y = add_node(g, "aten::mul.Tensor", (af_arg[]){val(c), {.kind = AF_ARG_FLOAT, .u.f = 0.5}}, 2, meta(2, s44, t44, 0));
    assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);

    af_graph *out = NULL;
    int32_t n = -1;
    assert_int_equal(af_sink_copies(g, 1u << AF_DEVICE_CUDA, 1, &out, &n, NULL), AF_OK); /* no CPU kernels: as it is */
    assert_null(out);
    int32_t *origin = NULL;
    assert_int_equal(af_sink_copies(g, 0, 1, &out, &n, &origin), AF_OK);
    assert_non_null(out);
    assert_non_null(origin);
    assert_int_equal(n, 1);
    /* x, its views and the copy are gone: two views, the add over [4, 2, 2], the view back, mul */
    assert_int_equal(af_graph_num_nodes(out), 5);
    static const int64_t r[3] = {4, 2, 2}, ra[3] = {1, 8, 4}, rb[3] = {1, 0, 0}, dense[3] = {4, 2, 1};
    const af_node *va = node_at(out, 0, "aten::as_strided.default"), *vb = node_at(out, 1, "aten::as_strided.default");
    assert_int_equal(va->args[0].u.value, af_graph_input(out, 0));
    assert_int_equal(vb->args[0].u.value, af_graph_input(out, 1));
    assert_meta(&af_graph_value(out, va->first_output)->meta, 3, r, ra, 0);
    assert_meta(&af_graph_value(out, vb->first_output)->meta, 3, r, rb, 0);
    assert_int_equal(va->args[2].u.list.items[1].u.i, 8); /* the arguments say what the metadata says */
    const af_node *sum = node_at(out, 2, "aten::add.Tensor");
    assert_int_equal(sum->args[0].u.value, va->first_output);
    assert_int_equal(sum->args[1].u.value, vb->first_output);
    assert_meta(&af_graph_value(out, sum->first_output)->meta, 3, r, dense, 0);
    const af_node *back = node_at(out, 3, "aten::view.default");
    assert_meta(&af_graph_value(out, back->first_output)->meta, 2, s44, t44, 0);
    assert_int_equal(node_at(out, 4, "aten::mul.Tensor")->args[0].u.value, back->first_output);
    assert_int_equal(af_graph_output(out, 0), af_graph_node(out, 4)->first_output);
    /* what each new value stands for: a and b for their views, the copy for the add and its view */
    assert_int_equal(origin[va->first_output], a);
    assert_int_equal(origin[vb->first_output], b);
    assert_int_equal(origin[sum->first_output], c);
    assert_int_equal(origin[back->first_output], c);
    assert_int_equal(origin[af_graph_output(out, 0)], y);
    assert_int_equal(origin[af_graph_input(out, 1)], b);
    free(origin);

    /* the rewritten graph fuses: the add is one kernel with its two views folded */
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(out, &(af_fuse_options){.min_nodes = 1}, &plan), AF_OK);
    assert_true(plan->group_of_node[2] >= 0);
    assert_int_equal(plan->groups[plan->group_of_node[2]].n_inputs, 2);
    af_fuse_plan_free(plan);
    af_graph_free(out);
    af_graph_free(g);
}

/* Overlapping windows (as_strided(x, [3, 8], [4, 1], 4)) of x = exp(a) * 2 over [20]: no dim carries, the
 * copy keeps its shape (no view back) and reads a through the same windows. */
static void test_overlapping_windows_keep_their_shape(void **state) {
    (void)state;
    static const int64_t s16[1] = {20}, t16[1] = {1}, s38[2] = {3, 8}, tw[2] = {4, 1}, t38[2] = {8, 1};
    int32_t a;
    af_graph *g = start_graph(1, s16, t16, &a, NULL);
    af_arg items[2][2];
    int32_t e = add_node(g, "aten::exp.default", (af_arg[]){val(a)}, 1, meta(1, s16, t16, 0));
    int32_t x = add_node(g, "aten::mul.Tensor", (af_arg[]){val(e), {.kind = AF_ARG_INT, .u.i = 2}}, 2, meta(1, s16, t16, 0));
    int32_t w = add_node(g, "aten::as_strided.default",
                         (af_arg[]){val(x), ints(items[0], s38, 2), ints(items[1], tw, 2), {.kind = AF_ARG_INT, .u.i = 4}}, 4,
                         meta(2, s38, tw, 4));
    int32_t c = add_node(g, "aten::clone.default", (af_arg[]){val(w)}, 1, meta(2, s38, t38, 0));
    int32_t y = add_node(g, "aten::neg.default", (af_arg[]){val(c)}, 1, meta(2, s38, t38, 0));
    int32_t outs[2] = {y, x}; /* x is returned too: its nodes stay, and are recomputed for the copy */
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);

    af_graph *out = NULL;
    assert_int_equal(af_sink_copies(g, 0, 1, &out, NULL, NULL), AF_OK);
    assert_non_null(out);
    const char *ops[] = {"aten::exp.default", "aten::mul.Tensor", "aten::as_strided.default", "aten::exp.default",
                         "aten::mul.Tensor", "aten::neg.default"};
    assert_int_equal(af_graph_num_nodes(out), 6);
    for (int32_t i = 0; i < 6; i++) node_at(out, i, ops[i]);
    assert_meta(&af_graph_value(out, af_graph_node(out, 2)->first_output)->meta, 2, s38, tw, 4);
    assert_int_equal(af_graph_node(out, 2)->args[0].u.value, af_graph_input(out, 0));
    assert_meta(&af_graph_value(out, af_graph_node(out, 4)->first_output)->meta, 2, s38, t38, 0);
    assert_int_equal(af_graph_node(out, 5)->args[0].u.value, af_graph_node(out, 4)->first_output);
    af_graph_free(out);
    af_graph_free(g);
}

/* Copies left alone: one the graph returns, one whose source is a view whose metadata is not
 * the layout ATen makes (a transpose declared contiguous), one whose dim carries across x's dims where it cannot be
 * split, and a copy of x itself (no view: it fuses with x already). */
static void test_copies_left_alone(void **state) {
    (void)state;
    static const int64_t s35[2] = {3, 5}, t35[2] = {5, 1}, s53[2] = {5, 3}, t53[2] = {1, 5}, c53[2] = {3, 1};
    static const int64_t s27[2] = {2, 7}, t27[2] = {7, 1}, perm[2] = {1, 0};
    for (int which = 0; which < 4; which++) {
        int32_t a;
        af_graph *g = start_graph(2, s35, t35, &a, NULL);
        af_arg items[2][2];
        int32_t src = a;
        if (which == 1) { /* the source: t(t(a)), the inner one declared contiguous, which ATen's is not */
            src = add_node(g, "aten::t.default", (af_arg[]){val(a)}, 1, meta(2, s53, c53, 0));
            src = add_node(g, "aten::t.default", (af_arg[]){val(src)}, 1, meta(2, s35, t35, 0));
        }
        int32_t x = add_node(g, "aten::exp.default", (af_arg[]){val(src)}, 1, meta(2, s35, t35, 0)), c, y;
        if (which == 2) {
            int32_t w = add_node(g, "aten::as_strided.default",
                                 (af_arg[]){val(x), ints(items[0], s27, 2), ints(items[1], t27, 2), {.kind = AF_ARG_INT}}, 4,
                                 meta(2, s27, t27, 0));
            c = add_node(g, "aten::clone.default", (af_arg[]){val(w)}, 1, meta(2, s27, t27, 0));
            y = add_node(g, "aten::neg.default", (af_arg[]){val(c)}, 1, meta(2, s27, t27, 0));
        } else if (which == 3) {
            c = add_node(g, "aten::clone.default", (af_arg[]){val(x)}, 1, meta(2, s35, t35, 0));
            y = add_node(g, "aten::neg.default", (af_arg[]){val(c)}, 1, meta(2, s35, t35, 0));
        } else {
            int32_t w = add_node(g, "aten::permute.default", (af_arg[]){val(x), ints(items[0], perm, 2)}, 2, meta(2, s53, t53, 0));
            c = add_node(g, "aten::clone.default", (af_arg[]){val(w)}, 1, meta(2, s53, c53, 0));
            y = which == 0 ? c : add_node(g, "aten::neg.default", (af_arg[]){val(c)}, 1, meta(2, s53, c53, 0));
        }
        assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);
        af_graph *out = g; /* overwritten with NULL */
        int32_t n = -1;
        assert_int_equal(af_sink_copies(g, 0, 1, &out, &n, NULL), AF_OK);
        assert_null(out);
        assert_int_equal(n, 0);
        af_graph_free(g);
    }
}

/* Copies of copies: clone(t(clone(t(-a)))) is -a computed from a. The first pass rewrites both
 * copies (the outer one recomputing the inner one over a view of -a), the second the outer one
 * again (a copy of a view of -a now): -a over a view of a that is a itself, so over a. */
static void test_copies_of_copies_collapse(void **state) {
    (void)state;
    static const int64_t s46[2] = {4, 6}, t46[2] = {6, 1}, s64[2] = {6, 4}, t64p[2] = {1, 6}, t64[2] = {4, 1}, t46p[2] = {1, 4};
    static const int64_t perm[2] = {1, 0};
    int32_t a, x;
    af_graph *g = start_graph(2, s46, t46, &a, &x);
    af_arg items[2][2];
    int32_t p1 = add_node(g, "aten::permute.default", (af_arg[]){val(x), ints(items[0], perm, 2)}, 2, meta(2, s64, t64p, 0));
    int32_t c1 = add_node(g, "aten::clone.default", (af_arg[]){val(p1)}, 1, meta(2, s64, t64, 0));
    int32_t p2 = add_node(g, "aten::permute.default", (af_arg[]){val(c1), ints(items[1], perm, 2)}, 2, meta(2, s46, t46p, 0));
    int32_t c2 = add_node(g, "aten::clone.default", (af_arg[]){val(p2)}, 1, meta(2, s46, t46, 0));
    int32_t y = add_node(g, "aten::mul.Tensor", (af_arg[]){val(c2), {.kind = AF_ARG_INT, .u.i = 2}}, 2, meta(2, s46, t46, 0));
    assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);
    af_graph *out = NULL;
    int32_t n = 0, *origin = NULL;
    assert_int_equal(af_sink_copies(g, 0, 1, &out, &n, &origin), AF_OK);
    assert_non_null(out);
    assert_int_equal(n, 3);
    assert_int_equal(af_graph_num_nodes(out), 2);
    assert_int_equal(node_at(out, 0, "aten::neg.default")->args[0].u.value, af_graph_input(out, 0));
    node_at(out, 1, "aten::mul.Tensor");
    /* over three passes: the recomputed neg stands for the outer copy */
    assert_int_equal(origin[af_graph_input(out, 0)], a);
    assert_int_equal(origin[af_graph_node(out, 0)->first_output], c2);
    assert_int_equal(origin[af_graph_node(out, 1)->first_output], y);
    free(origin);
    af_graph_free(out);
    af_graph_free(g);
}

/* A view of a permuted value (dims that step as one merged, as ATen's view allows) is re-derived
 * link by link and taken; the same view declared with another layout (what the graph says is not
 * what ATen makes) leaves the copy alone. */
static void test_views_of_permuted_values_are_re_derived(void **state) {
    (void)state;
    static const int64_t s3[3] = {2, 2, 4}, t3[3] = {8, 4, 1}, sp[3] = {4, 2, 2}, tp[3] = {1, 8, 4}, perm[3] = {2, 0, 1};
    static const int64_t s44[2] = {4, 4}, t44v[2] = {1, 4}, t44[2] = {4, 1}, r[3] = {4, 2, 2}, ra[3] = {1, 8, 4};
    for (int lie = 0; lie < 2; lie++) {
        int32_t a, x;
        af_graph *g = start_graph(3, s3, t3, &a, &x);
        af_arg items[2][3];
        int32_t p = add_node(g, "aten::permute.default", (af_arg[]){val(x), ints(items[0], perm, 3)}, 2, meta(3, sp, tp, 0));
        int32_t v = add_node(g, "aten::view.default", (af_arg[]){val(p), ints(items[1], s44, 2)}, 2, meta(2, s44, lie ? t44 : t44v, 0));
        int32_t c = add_node(g, "aten::clone.default", (af_arg[]){val(v)}, 1, meta(2, s44, t44, 0));
        int32_t y = add_node(g, "aten::mul.Tensor", (af_arg[]){val(c), {.kind = AF_ARG_INT, .u.i = 3}}, 2, meta(2, s44, t44, 0));
        assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);
        af_graph *out = NULL;
        assert_int_equal(af_sink_copies(g, 0, 1, &out, NULL, NULL), AF_OK);
        if (lie) {
            assert_null(out);
        } else {
            assert_non_null(out);
            const af_node *va = node_at(out, 0, "aten::as_strided.default");
            assert_meta(&af_graph_value(out, va->first_output)->meta, 3, r, ra, 0);
            node_at(out, 1, "aten::neg.default");
            node_at(out, 2, "aten::view.default");
            af_graph_free(out);
        }
        af_graph_free(g);
    }
}

/* y = add(t(x), b), x = neg(a) over [4, 4], nothing else reading x: y's kernel computes neg over
 * a transposed view of a, x is not made (a read); with x read as it is too, or with reads off, or
 * by a reduction, the graph stays as it is. */
static void test_a_kernel_members_read_of_a_view_is_computed_from_the_sources(void **state) {
    (void)state;
    static const int64_t s44[2] = {4, 4}, t44[2] = {4, 1}, tt[2] = {1, 4};
    for (int kind = 0; kind < 4; kind++) { /* 0: the read; 1: x read as it is too; 2: reads off; 3: a sum reads the view */
        int32_t a, x, b;
        af_graph *g = start_graph(2, s44, t44, &a, &x);
        af_tensor_meta mb = meta(2, s44, t44, 0);
        assert_int_equal(af_graph_add_input(g, "b", &mb, &b), AF_OK);
        int32_t v = add_node(g, "aten::t.default", (af_arg[]){val(x)}, 1, meta(2, s44, tt, 0));
        int32_t outs[2], n_outs = 1;
        if (kind == 3) {
            af_arg dims[1] = {{.kind = AF_ARG_INT, .u.i = 0}};
            static const int64_t s4[1] = {4}, t4[1] = {1};
            outs[0] = add_node(g, "aten::sum.dim_IntList", (af_arg[]){val(v), {.kind = AF_ARG_LIST, .u.list = {1, dims}}}, 2,
                               meta(1, s4, t4, 0));
        } else {
            outs[0] = add_node(g, "aten::add.Tensor", (af_arg[]){val(v), val(b)}, 2, meta(2, s44, t44, 0));
        }
        if (kind == 1) outs[n_outs++] = add_node(g, "aten::mul.Tensor", (af_arg[]){val(x), val(b)}, 2, meta(2, s44, t44, 0));
        assert_int_equal(af_graph_set_outputs(g, outs, n_outs), AF_OK);
        af_graph *out = NULL;
        int32_t n = -1, *origin = NULL;
        assert_int_equal(af_sink_copies(g, 0, kind != 2, &out, &n, &origin), AF_OK);
        if (kind) {
            assert_null(out);
            assert_int_equal(n, 0);
            af_graph_free(g);
            continue;
        }
        assert_non_null(out);
        assert_int_equal(n, 1);
        assert_int_equal(af_graph_num_nodes(out), 3); /* as_strided(a), neg, add */
        const af_node *va = node_at(out, 0, "aten::as_strided.default"), *neg = node_at(out, 1, "aten::neg.default");
        const af_node *add = node_at(out, 2, "aten::add.Tensor");
        assert_int_equal(va->args[0].u.value, af_graph_input(out, 0));
        assert_meta(&af_graph_value(out, va->first_output)->meta, 2, s44, tt, 0);
        assert_int_equal(neg->args[0].u.value, va->first_output);
        assert_meta(&af_graph_value(out, neg->first_output)->meta, 2, s44, t44, 0);
        assert_int_equal(add->args[0].u.value, neg->first_output);
        assert_int_equal(add->args[1].u.value, af_graph_input(out, 1));
        assert_int_equal(origin[va->first_output], a);
        assert_int_equal(origin[neg->first_output], v); /* the recomputed value stands for the view */
        assert_int_equal(origin[add->first_output], outs[0]);
        af_fusion_plan *plan; /* one kernel reading a and b */
        assert_int_equal(af_fuse_plan_new(out, NULL, &plan), AF_OK);
        assert_int_equal(plan->n_groups, 1);
        assert_int_equal(plan->groups[0].n_inputs, 2);
        af_fuse_plan_free(plan);
        free(origin);
        af_graph_free(out);
        af_graph_free(g);
    }
}

/* g through af_sink_copies with reads on (origins into *origin where not NULL): where nothing is to
 * be rewritten, no new graph (g freed, NULL returned); else the new graph, one rewrite made. */
static af_graph *sink_expecting(af_graph *g, int rewritten, int32_t **origin) {
    af_graph *out = NULL;
    int32_t n = -1;
    assert_int_equal(af_sink_copies(g, 0, 1, &out, &n, origin), AF_OK);
    if (!rewritten) {
        assert_null(out);
        assert_int_equal(n, 0);
        af_graph_free(g);
        return NULL;
    }
    assert_non_null(out);
    assert_int_equal(n, 1);
    return out;
}

/* x = neg(a) over [4, 4], read by add(as_strided(x, [4, 4], [4, 1], 0), b): the read is
 * recomputed from a, and a view of a that is a itself is no view: neg reads a (its kernel may be
 * the kernel computing a, a window's, say, which a view would keep apart). */
static void test_a_source_read_as_it_is_takes_no_view(void **state) {
    (void)state;
    static const int64_t s44[2] = {4, 4}, t44[2] = {4, 1};
    int32_t a, x, b;
    af_graph *g = start_graph(2, s44, t44, &a, &x);
    af_tensor_meta mb = meta(2, s44, t44, 0);
    assert_int_equal(af_graph_add_input(g, "b", &mb, &b), AF_OK);
    af_arg items[2][2];
    int32_t v = add_node(g, "aten::as_strided.default",
                         (af_arg[]){val(x), ints(items[0], s44, 2), ints(items[1], t44, 2), {.kind = AF_ARG_INT, .u.i = 0}}, 4,
                         meta(2, s44, t44, 0));
    int32_t y = add_node(g, "aten::add.Tensor", (af_arg[]){val(v), val(b)}, 2, meta(2, s44, t44, 0));
    assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);
    int32_t *origin = NULL;
    af_graph *out = sink_expecting(g, 1, &origin);
    assert_int_equal(af_graph_num_nodes(out), 2); /* neg, add: no as_strided */
    const af_node *neg = node_at(out, 0, "aten::neg.default"), *add = node_at(out, 1, "aten::add.Tensor");
    assert_int_equal(neg->args[0].u.value, af_graph_input(out, 0));
    assert_int_equal(add->args[0].u.value, neg->first_output);
    assert_int_equal(origin[neg->first_output], v);
    free(origin);
    af_graph_free(out);
    af_graph_free(g);
}

/* z = mm(y, b), y = add(view(x, [4, 4]), b), x = neg(a) over [2, 2, 4]: the view's dim 0 steps
 * across x's dims 0 and 1, so y is computed over [2, 2, 4] (b viewed so too) and viewed back
 * (a split read); where a member reads y as it is (it would share y's kernel), y stays. */
static void test_a_split_read_computes_its_reader_over_the_finer_shape(void **state) {
    (void)state;
    static const int64_t s3[3] = {2, 2, 4}, t3[3] = {8, 4, 1}, s44[2] = {4, 4}, t44[2] = {4, 1};
    for (int fused = 0; fused < 2; fused++) {
        int32_t a, x, b;
        af_graph *g = start_graph(3, s3, t3, &a, &x);
        af_tensor_meta mb = meta(2, s44, t44, 0);
        assert_int_equal(af_graph_add_input(g, "b", &mb, &b), AF_OK);
        af_arg items[4];
        int32_t v = add_node(g, "aten::view.default", (af_arg[]){val(x), ints(items, s44, 2)}, 2, meta(2, s44, t44, 0));
        int32_t y = add_node(g, "aten::add.Tensor", (af_arg[]){val(v), val(b)}, 2, meta(2, s44, t44, 0));
        int32_t z = fused ? add_node(g, "aten::mul.Tensor", (af_arg[]){val(y), val(b)}, 2, meta(2, s44, t44, 0))
                          : add_node(g, "aten::mm.default", (af_arg[]){val(y), val(b)}, 2, meta(2, s44, t44, 0));
        assert_int_equal(af_graph_set_outputs(g, &z, 1), AF_OK);
        int32_t *origin = NULL;
        af_graph *out = sink_expecting(g, !fused, &origin);
        if (!out) continue;
        /* neg (of a itself: a has the finer shape), as_strided(b), add over [2, 2, 4], view back, mm */
        assert_int_equal(af_graph_num_nodes(out), 5);
        static const int64_t tb[3] = {8, 4, 1};
        const af_node *neg = node_at(out, 0, "aten::neg.default");
        const af_node *vb = node_at(out, 1, "aten::as_strided.default"), *add = node_at(out, 2, "aten::add.Tensor");
        const af_node *back = node_at(out, 3, "aten::view.default"), *mm = node_at(out, 4, "aten::mm.default");
        assert_int_equal(neg->args[0].u.value, af_graph_input(out, 0));
        assert_int_equal(vb->args[0].u.value, af_graph_input(out, 1));
        assert_meta(&af_graph_value(out, vb->first_output)->meta, 3, s3, tb, 0);
        assert_int_equal(add->args[0].u.value, neg->first_output);
        assert_int_equal(add->args[1].u.value, vb->first_output);
        assert_meta(&af_graph_value(out, add->first_output)->meta, 3, s3, t3, 0);
        assert_int_equal(back->args[0].u.value, add->first_output);
        assert_meta(&af_graph_value(out, back->first_output)->meta, 2, s44, t44, 0);
        assert_int_equal(mm->args[0].u.value, back->first_output);
        assert_int_equal(origin[vb->first_output], b);
        assert_int_equal(origin[add->first_output], y);
        assert_int_equal(origin[back->first_output], y);
        free(origin);
        af_graph_free(out);
        af_graph_free(g);
    }
}

/* z = mm(c, b), c = box_fill(view(x, [4, 4]), starts, sizes, 0) laid out {1, 4}, x = neg(a) over
 * [2, 2, 4]: the split read takes c over [2, 2, 4] with its box cut onto the pieces (row 1 of
 * dim 0 = piece 0 at 0, piece 1 at 1) and c's strides cut ({2, 1, 4}: the view back makes {1, 4});
 * a box straddling a piece's steps (rows 1-2) cuts into none, and the read stays as it is. */
static void test_a_box_fill_reader_is_cut_onto_the_finer_shape(void **state) {
    (void)state;
    static const int64_t s3[3] = {2, 2, 4}, t3[3] = {8, 4, 1}, s44[2] = {4, 4}, t44[2] = {4, 1}, tc[2] = {1, 4};
    for (int straddles = 0; straddles < 2; straddles++) {
        int32_t a, x, b;
        af_graph *g = start_graph(3, s3, t3, &a, &x);
        af_tensor_meta mb = meta(2, s44, t44, 0);
        assert_int_equal(af_graph_add_input(g, "b", &mb, &b), AF_OK);
        af_arg items[3][4];
        int64_t starts[2] = {1, 0}, sizes[2] = {straddles ? 2 : 1, 4};
        int32_t v = add_node(g, "aten::view.default", (af_arg[]){val(x), ints(items[0], s44, 2)}, 2, meta(2, s44, t44, 0));
        int32_t c = add_node(g, "aotfuse::box_fill.default",
                             (af_arg[]){val(v), ints(items[1], starts, 2), ints(items[2], sizes, 2), {.kind = AF_ARG_FLOAT, .u.f = 0.0}}, 4,
                             meta(2, s44, tc, 0));
        int32_t z = add_node(g, "aten::mm.default", (af_arg[]){val(c), val(b)}, 2, meta(2, s44, t44, 0));
        assert_int_equal(af_graph_set_outputs(g, &z, 1), AF_OK);
        af_graph *out = sink_expecting(g, !straddles, NULL);
        if (!out) continue;
        assert_int_equal(af_graph_num_nodes(out), 4); /* neg (of a itself), box_fill over [2, 2, 4], view back, mm */
        const af_node *neg = node_at(out, 0, "aten::neg.default"), *box = node_at(out, 1, "aotfuse::box_fill.default");
        const af_node *back = node_at(out, 2, "aten::view.default");
        node_at(out, 3, "aten::mm.default");
        assert_int_equal(neg->args[0].u.value, af_graph_input(out, 0));
        static const int64_t cut[3] = {2, 1, 4}, want_starts[3] = {0, 1, 0}, want_sizes[3] = {1, 1, 4};
        assert_int_equal(box->args[0].u.value, neg->first_output);
        assert_int_equal(box->args[1].u.list.n, 3);
        for (int32_t d = 0; d < 3; d++) {
            assert_int_equal(box->args[1].u.list.items[d].u.i, want_starts[d]);
            assert_int_equal(box->args[2].u.list.items[d].u.i, want_sizes[d]);
        }
        assert_meta(&af_graph_value(out, box->first_output)->meta, 3, s3, cut, 0);
        assert_meta(&af_graph_value(out, back->first_output)->meta, 2, s44, tc, 0);
        af_graph_free(out);
        af_graph_free(g);
    }
}

/* A broadcast read: x = neg(w) over [8], read by y = mul(a, x) and z = add(y, x) over [4, 3, 8].
 * Each reader recomputes x over its own shape from one as_strided view of w (stride 0 on the
 * broadcast dims, made once for both), x is gone, and the rewritten graph is one kernel. Left as
 * it is: with view reads only; where x is an exp (evaluated per element of the loop, it costs);
 * where an extern reads x too (it is stored anyway); and where x's source is a kernel's value (a
 * row's sum: its readers' kernel computes it). */
static void test_a_smaller_value_read_by_broadcast_is_recomputed_by_its_readers(void **state) {
    (void)state;
    static const int64_t s3[3] = {4, 3, 8}, t3[3] = {24, 8, 1}, s1[1] = {8}, t1[1] = {1}, bw[3] = {0, 0, 1};
    static const int64_t s31[3] = {4, 3, 1}, t31[3] = {3, 1, 1}, s88[2] = {8, 8}, t88[2] = {8, 1};
    enum { PLAIN, VIEW_READS_ONLY, EXPENSIVE, EXTERN_READER, KERNEL_SOURCE, CASES };
    for (int c = 0; c < CASES; c++) {
        af_graph *g;
        assert_int_equal(af_graph_new(&g), AF_OK);
        int32_t a, w;
        af_tensor_meta ma = meta(3, s3, t3, 0), mw = meta(1, s1, t1, 0);
        assert_int_equal(af_graph_add_input(g, "a", &ma, &a), AF_OK);
        assert_int_equal(af_graph_add_input(g, "w", &mw, &w), AF_OK);
        int32_t x;
        if (c == KERNEL_SOURCE) { /* x = neg(sum(a, [2], keepdim)) over [4, 3, 1] */
            af_arg items[1], dims = ints(items, (const int64_t[]){2}, 1);
            int32_t r = add_node(g, "aten::sum.dim_IntList", (af_arg[]){val(a), dims, {.kind = AF_ARG_BOOL, .u.i = 1}}, 3,
                                 meta(3, s31, t31, 0));
            x = add_node(g, "aten::neg.default", (af_arg[]){val(r)}, 1, meta(3, s31, t31, 0));
        } else {
            x = add_node(g, c == EXPENSIVE ? "aten::exp.default" : "aten::neg.default", (af_arg[]){val(w)}, 1, meta(1, s1, t1, 0));
        }
        int32_t y = add_node(g, "aten::mul.Tensor", (af_arg[]){val(a), val(x)}, 2, meta(3, s3, t3, 0));
        int32_t z = add_node(g, "aten::add.Tensor", (af_arg[]){val(y), val(x)}, 2, meta(3, s3, t3, 0));
        int32_t outs[2] = {z, -1}, n_outs = 1;
        if (c == EXTERN_READER) {
            af_arg items[2];
            int32_t v = add_node(g, "aten::view.default", (af_arg[]){val(x), ints(items, (const int64_t[]){8, 1}, 2)}, 2,
                                 meta(2, (const int64_t[]){8, 1}, (const int64_t[]){1, 1}, 0));
            outs[n_outs++] = add_node(g, "aten::mm.default", (af_arg[]){val(v), val(v)}, 2, meta(2, s88, t88, 0));
        }
        assert_int_equal(af_graph_set_outputs(g, outs, n_outs), AF_OK);
        af_graph *out = NULL;
        int32_t n = -1, *origin = NULL;
        int mask = c == VIEW_READS_ONLY ? AF_SINK_VIEW_READS : AF_SINK_VIEW_READS | AF_SINK_BROADCAST_READS;
        assert_int_equal(af_sink_copies(g, 0, mask, &out, &n, &origin), AF_OK);
        if (c != PLAIN) {
            assert_null(out);
            assert_int_equal(n, 0);
            af_graph_free(g);
            continue;
        }
        assert_non_null(out);
        assert_int_equal(n, 2);
        /* as_strided(w), neg, mul, neg, add */
        assert_int_equal(af_graph_num_nodes(out), 5);
        const af_node *vw = node_at(out, 0, "aten::as_strided.default"), *n1 = node_at(out, 1, "aten::neg.default");
        const af_node *mul = node_at(out, 2, "aten::mul.Tensor"), *n2 = node_at(out, 3, "aten::neg.default");
        const af_node *add = node_at(out, 4, "aten::add.Tensor");
        assert_int_equal(vw->args[0].u.value, af_graph_input(out, 1));
        assert_meta(&af_graph_value(out, vw->first_output)->meta, 3, s3, bw, 0);
        assert_int_equal(n1->args[0].u.value, vw->first_output);
        assert_int_equal(n2->args[0].u.value, vw->first_output); /* the one view, for both readers */
        assert_meta(&af_graph_value(out, n1->first_output)->meta, 3, s3, t3, 0);
        assert_meta(&af_graph_value(out, n2->first_output)->meta, 3, s3, t3, 0);
        assert_int_equal(mul->args[1].u.value, n1->first_output);
        assert_int_equal(add->args[0].u.value, mul->first_output);
        assert_int_equal(add->args[1].u.value, n2->first_output);
        assert_int_equal(origin[vw->first_output], w);
        assert_int_equal(origin[n1->first_output], x); /* each recomputed value stands for x */
        assert_int_equal(origin[n2->first_output], x);
        free(origin);
        af_fusion_plan *plan; /* one kernel reading a and the view of w */
        assert_int_equal(af_fuse_plan_new(out, NULL, &plan), AF_OK);
        assert_int_equal(plan->n_groups, 1);
        assert_int_equal(plan->groups[0].n_inputs, 2);
        assert_int_equal(plan->groups[0].n_outputs, 1);
        af_fuse_plan_free(plan);
        af_graph_free(out);
        af_graph_free(g);
    }
}

static void test_bad_arguments(void **state) {
    (void)state;
    af_graph *out;
    assert_int_equal(af_sink_copies(NULL, 0, 1, &out, NULL, NULL), AF_ERR_INVALID);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    assert_int_equal(af_sink_copies(g, 0, 1, NULL, NULL, NULL), AF_ERR_INVALID);
    assert_int_equal(af_sink_copies(g, 0, 1, &out, NULL, NULL), AF_OK); /* nothing to rewrite */
    assert_null(out);
    af_graph_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_permuted_copy_is_computed_from_the_sources),
        cmocka_unit_test(test_overlapping_windows_keep_their_shape),
        cmocka_unit_test(test_copies_left_alone),
        cmocka_unit_test(test_copies_of_copies_collapse),
        cmocka_unit_test(test_views_of_permuted_values_are_re_derived),
        cmocka_unit_test(test_a_kernel_members_read_of_a_view_is_computed_from_the_sources),
        cmocka_unit_test(test_a_source_read_as_it_is_takes_no_view),
        cmocka_unit_test(test_a_split_read_computes_its_reader_over_the_finer_shape),
        cmocka_unit_test(test_a_box_fill_reader_is_cut_onto_the_finer_shape),
        cmocka_unit_test(test_a_smaller_value_read_by_broadcast_is_recomputed_by_its_readers),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
