/* CMocka tests of csrc/fuse.c and csrc/codegen_c.c: which nodes group together, which values
 * are materialized, and that the generated source names every kernel. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_util.h"

#include "aotfuse/codegen.h"
#include "aotfuse/fuse.h"

static int64_t S2[2] = {4, 8}, T2[2] = {8, 1}, S1[1] = {8}, T1[1] = {1};

static af_tensor_meta f32(int nd) {
    af_tensor_meta m = {0};
    m.type = AF_VALUE_TENSOR;
    m.dtype = AF_DTYPE_FLOAT32;
    m.device.index = -1;
    m.ndim = nd;
    m.sizes = nd == 2 ? S2 : S1;
    m.strides = nd == 2 ? T2 : T1;
    return m;
}

static int32_t node(af_graph *g, const char *op, int32_t a, int32_t b, int nd) {
    af_tensor_meta m = f32(nd);
    af_arg args[2] = {{.kind = AF_ARG_VALUE, .u.value = a}, {.kind = AF_ARG_VALUE, .u.value = b}};
    if (b < 0) args[1] = (af_arg){.kind = AF_ARG_FLOAT, .u.f = 0.5};
    int32_t out;
    int n_args = strstr(op, "exp") || strstr(op, "mm") ? 1 : 2;
    if (strstr(op, "mm")) args[1] = args[0], n_args = 2;
    assert_int_equal(af_graph_add_node(g, op, args, n_args, &m, 1, &out), AF_OK);
    return out;
}

/* The generated C holds `text`; frees the plan and the graph. */
static void assert_source_has_then_free(af_graph *g, af_fusion_plan *plan, const char *text) {
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    assert_non_null(strstr(src, text));
    free(src);
    af_fuse_plan_free(plan);
    af_graph_free(g);
}

static void test_chain_siblings_and_closing(void **state) {
    (void)state;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = f32(2), m1 = f32(1);
    int32_t x, bias;
    assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "bias", &m1, &bias), AF_OK);
    int32_t a = node(g, "aten::mul.Tensor", x, -1, 2);      /* n0: x * 0.5          group A */
    int32_t b = node(g, "aten::exp.default", x, -1, 2);     /* n1: exp(x), sibling   group A */
    int32_t c = node(g, "aten::add.Tensor", a, b, 2);       /* n2                    group A */
    int32_t d = node(g, "aten::add.Tensor", c, bias, 2);    /* n3: broadcast input   group A */
    int32_t e = node(g, "aten::mm.default", d, -1, 2);      /* n4: extern reads d: A closed */
    int32_t f = node(g, "aten::mul.Tensor", d, -1, 2);      /* n5: A is closed: new group B */
    int32_t h = node(g, "aten::add.Tensor", f, e, 2);       /* n6                    group B */
    int32_t outs[1] = {h};
    assert_int_equal(af_graph_set_outputs(g, outs, 1), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 2);
    int32_t ga = plan->group_of_node[0], gb = plan->group_of_node[5];
    assert_true(ga >= 0 && gb >= 0 && ga != gb);
    for (int32_t i = 0; i < 4; i++) assert_int_equal(plan->group_of_node[i], ga);
    assert_int_equal(plan->group_of_node[4], -1);
    assert_int_equal(plan->group_of_node[6], gb);
    /* A: reads x and bias; materializes only d (read by mm and by group B) */
    assert_int_equal(plan->groups[ga].n_inputs, 2);
    assert_int_equal(plan->groups[ga].n_outputs, 1);
    assert_int_equal(plan->groups[ga].outputs[0], d);
    assert_int_equal(plan->groups[ga].last_node, 3);
    /* B: its result is a graph output */
    assert_int_equal(plan->groups[gb].n_outputs, 1);
    assert_int_equal(plan->groups[gb].outputs[0], h);
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    assert_non_null(strstr(src, "void af_kernel_0("));
    assert_non_null(strstr(src, "void af_kernel_1("));
    assert_non_null(strstr(src, "af_exp("));
    assert_non_null(strstr(src, "af_kernel_count = 2"));
    free(src);
    af_fuse_plan_free(plan);
    (void)c;
    af_graph_free(g);
}

/* Kernels that differ only in their nodes' ids (a model's repeated layers) share one body, which
 * each kernel's wrapper calls; a kernel computing something else (an add, not a mul) has its own. */
static void test_identical_kernels_share_a_body(void **state) {
    (void)state;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = f32(2);
    int32_t x;
    assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
    int32_t a = node(g, "aten::mul.Tensor", x, -1, 2);  /* group 0: exp(x * 0.5) */
    int32_t b = node(g, "aten::exp.default", a, -1, 2);
    int32_t e = node(g, "aten::mm.default", b, -1, 2);
    int32_t f = node(g, "aten::mul.Tensor", e, -1, 2);  /* group 1: the same on other nodes */
    int32_t h = node(g, "aten::exp.default", f, -1, 2);
    int32_t e2 = node(g, "aten::mm.default", h, -1, 2);
    int32_t k = node(g, "aten::add.Tensor", e2, -1, 2); /* group 2: exp(x + 0.5) */
    int32_t l = node(g, "aten::exp.default", k, -1, 2);
    int32_t outs[1] = {l};
    assert_int_equal(af_graph_set_outputs(g, outs, 1), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 3);
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    assert_int_equal(count_of(src, "AF_BODY void af_body_"), 2);
    assert_non_null(strstr(src, "AF_BODY void af_body_0(char *const *p, const uint64_t *af_s, const int64_t *af_n, int af_num_threads)"));
    assert_non_null(strstr(src, "AF_BODY void af_body_2(char *const *p, const uint64_t *af_s, const int64_t *af_n, int af_num_threads)"));
    assert_non_null(strstr(src, "void af_kernel_0(char *const *p) { af_body_0(p, NULL, NULL, af_num_threads); }"));
    assert_non_null(strstr(src, "void af_kernel_1(char *const *p) { af_body_0(p, NULL, NULL, af_num_threads); }"));
    assert_non_null(strstr(src, "void af_kernel_2(char *const *p) { af_body_2(p, NULL, NULL, af_num_threads); }"));
    assert_non_null(strstr(src, "af_kernel_count = 3"));
    free(src);
    af_fuse_plan_free(plan);
    af_graph_free(g);
}

/* A kernel with more distinct dropout streams than AF_MAX_KERNEL_STREAMS keeps them as constants
 * (so only a kernel with the very same streams could share its body); with fewer they are af_s[j]. */
static void test_many_streams_stay_constants(void **state) {
    (void)state;
    for (int n_streams = AF_MAX_KERNEL_STREAMS; n_streams <= AF_MAX_KERNEL_STREAMS + 1; n_streams++) {
        af_graph *g;
        assert_int_equal(af_graph_new(&g), AF_OK);
        af_tensor_meta seed_m = {.type = AF_VALUE_TENSOR, .dtype = AF_DTYPE_INT64, .device = {.index = -1}, .ndim = 0};
        af_tensor_meta m2 = f32(2);
        int32_t seed, x;
        assert_int_equal(af_graph_add_input(g, "seed", &seed_m, &seed), AF_OK);
        assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
        af_arg items[2] = {{.kind = AF_ARG_INT, .u.i = 4}, {.kind = AF_ARG_INT, .u.i = 8}};
        int32_t h = x;
        for (int k = 0; k < n_streams; k++) {
            af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = seed}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = items}},
                              {.kind = AF_ARG_INT, .u.i = 10 + k}};
            int32_t r;
            assert_int_equal(af_graph_add_node(g, "aotfuse::rng_uniform.default", args, 3, &m2, 1, &r), AF_OK);
            h = node(g, "aten::mul.Tensor", h, r, 2);
        }
        assert_int_equal(af_graph_set_outputs(g, &h, 1), AF_OK);
        af_fusion_plan *plan;
        assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
        assert_int_equal(plan->n_groups, 1);
        char *src = NULL;
        assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
        assert_int_equal(count_of(src, "af_rand(sv"), n_streams);
        if (n_streams <= AF_MAX_KERNEL_STREAMS) {
            assert_non_null(strstr(src, " + af_s[7], iv"));
            assert_non_null(strstr(src, "static const uint64_t s[8] = {10ull, 11ull, 12ull, 13ull, 14ull, 15ull, 16ull, 17ull}"));
        } else {
            assert_null(strstr(src, "af_s["));
            assert_non_null(strstr(src, " + 18ull, iv"));
            assert_non_null(strstr(src, "void af_kernel_0(char *const *p) { af_body_0(p, NULL, NULL, af_num_threads); }"));
        }
        free(src);
        af_fuse_plan_free(plan);
        af_graph_free(g);
    }
}

/* Independent groups of one loop merge into one kernel, at the earlier step when the later one's
 * inputs are made by then (b beside a, whose value an extern reads at once), at the later step when
 * nothing reads the earlier one's values before it (c's kernel waits for the two column sums, a
 * pointwise group joining reductions); a group depending on another through an extern (c on a)
 * never joins it. no_merge keeps every group. */
static void test_independent_groups_merge(void **state) {
    (void)state;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = f32(2), m1 = f32(1);
    int32_t x, y, z, w;
    assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", &m2, &y), AF_OK);
    assert_int_equal(af_graph_add_input(g, "z", &m2, &z), AF_OK);
    assert_int_equal(af_graph_add_input(g, "w", &m2, &w), AF_OK);
    int32_t a = node(g, "aten::exp.default", x, -1, 2); /* n0: group A */
    int32_t e = node(g, "aten::mm.default", a, -1, 2);  /* n1: reads a at once */
    int32_t b = node(g, "aten::exp.default", y, -1, 2); /* n2: y is an input: joins A at n0 */
    int32_t m = node(g, "aten::mm.default", e, -1, 2);  /* n3 */
    int32_t c = node(g, "aten::exp.default", m, -1, 2); /* n4: depends on A through n1, n3 */
    af_arg dims[1] = {{.kind = AF_ARG_INT, .u.i = 0}};
    int32_t s1, s2;
    af_arg sum1[2] = {{.kind = AF_ARG_VALUE, .u.value = z}, {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = dims}}};
    assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", sum1, 2, &m1, 1, &s1), AF_OK); /* n5 */
    af_arg sum2[2] = {{.kind = AF_ARG_VALUE, .u.value = w}, {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = dims}}};
    assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", sum2, 2, &m1, 1, &s2), AF_OK); /* n6 */
    int32_t outs[4] = {b, c, s1, s2};
    assert_int_equal(af_graph_set_outputs(g, outs, 4), AF_OK);
    af_fuse_options keep = {.no_merge = 1};
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, &keep, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 5);
    af_fuse_plan_free(plan);
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 2);
    int32_t ga = plan->group_of_node[0], gc = plan->group_of_node[4];
    assert_true(ga >= 0 && gc >= 0 && ga != gc);
    assert_int_equal(plan->group_of_node[2], ga);
    assert_int_equal(plan->group_of_node[1], -1);
    assert_int_equal(plan->group_of_node[3], -1);
    assert_int_equal(plan->group_of_node[5], gc);
    assert_int_equal(plan->group_of_node[6], gc);
    const af_fusion_group *A = &plan->groups[ga], *C = &plan->groups[gc];
    assert_int_equal(A->last_node, 0); /* before the extern reading a */
    assert_int_equal(A->n_nodes, 2);
    assert_int_equal(A->nodes[0], 0);
    assert_int_equal(A->nodes[1], 2);
    assert_int_equal(A->n_inputs, 2);
    assert_int_equal(A->n_outputs, 2); /* a (the extern's) and b (returned) */
    assert_int_equal(A->reduce_mask, 0);
    assert_int_equal(C->last_node, 6);
    assert_int_equal(C->n_nodes, 3);
    assert_int_equal(C->n_reductions, 2);
    assert_int_equal(C->reduce_mask, 1u);
    assert_int_equal(C->iter_value, z); /* the loop is the reductions' */
    assert_int_equal(C->n_inputs, 3);
    assert_int_equal(C->n_outputs, 3);
    (void)e;
    assert_source_has_then_free(g, plan, "af_kernel_count = 2");
}

/* A lone pointwise node gets a kernel (cheaper on the host than ATen's call, same bytes); so does a
 * lone column reduction of a CPU tensor (measured no slower than ATen's sum); a lone row reduction,
 * or a CUDA one, stays ATen's unless min_nodes is 1. */
static void test_lone_nodes_and_min_group(void **state) {
    (void)state;
    for (int cuda = 0; cuda < 2; cuda++) {
        af_graph *g;
        assert_int_equal(af_graph_new(&g), AF_OK);
        af_tensor_meta m2 = f32(2), m1 = f32(1);
        static int64_t rs[1] = {4}, rt[1] = {1};
        af_tensor_meta mr = f32(1);
        mr.sizes = rs, mr.strides = rt;
        if (cuda) m2.device.type = m1.device.type = mr.device.type = AF_DEVICE_CUDA, m2.device.index = m1.device.index = mr.device.index = 0;
        int32_t x, y, r, rr;
        assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
        assert_int_equal(af_graph_add_input(g, "y", &m2, &y), AF_OK);
        int32_t a = node(g, "aten::exp.default", x, -1, 2);
        af_arg dims[1] = {{.kind = AF_ARG_INT, .u.i = 0}}, row_dims[1] = {{.kind = AF_ARG_INT, .u.i = 1}};
        af_arg sum_args[2] = {{.kind = AF_ARG_VALUE, .u.value = y}, {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = dims}}};
        assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", sum_args, 2, &m1, 1, &r), AF_OK); /* [4, 8] -> [8] */
        af_arg row_args[2] = {{.kind = AF_ARG_VALUE, .u.value = y}, {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = row_dims}}};
        assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", row_args, 2, &mr, 1, &rr), AF_OK); /* -> [4] */
        int32_t outs[3] = {a, r, rr};
        assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
        af_fuse_options opts = {.device_types = cuda ? 1u << AF_DEVICE_CUDA : 0, .no_merge = 1};
        af_fusion_plan *plan;
        assert_int_equal(af_fuse_plan_new(g, &opts, &plan), AF_OK);
        if (!cuda) {
            assert_int_equal(plan->n_groups, 2); /* the exp, the column sum */
            assert_int_equal(plan->group_of_node[0], 0);
        }
        assert_int_equal(plan->group_of_node[1] >= 0, !cuda);
        assert_int_equal(plan->group_of_node[2], -1);
        af_fuse_plan_free(plan);
        if (!cuda) {
            af_fuse_options one = {.min_nodes = 1, .no_merge = 1};
            assert_int_equal(af_fuse_plan_new(g, &one, &plan), AF_OK);
            assert_int_equal(plan->n_groups, 3);
            af_fuse_plan_free(plan);
        }
        af_graph_free(g);
    }
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(NULL, NULL, &plan), AF_ERR_INVALID);
    af_fuse_plan_free(NULL);
}

/* The generator: rng_uniform(seed) alone gets a kernel; two random nodes reading one seed never
 * join as siblings (the seed's counter strides are its reader's shape); the source reads the seed
 * at [0] and passes the counter. */
static void test_random_nodes(void **state) {
    (void)state;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta seed_m = {.type = AF_VALUE_TENSOR, .dtype = AF_DTYPE_INT64, .device = {.index = -1}, .ndim = 0};
    af_tensor_meta m2 = f32(2);
    int32_t seed, x, u, u2, out;
    assert_int_equal(af_graph_add_input(g, "seed", &seed_m, &seed), AF_OK);
    assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
    af_arg items[2] = {{.kind = AF_ARG_INT, .u.i = 4}, {.kind = AF_ARG_INT, .u.i = 8}};
    af_arg args[2] = {{.kind = AF_ARG_VALUE, .u.value = seed}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = items}}};
    assert_int_equal(af_graph_add_node(g, "aotfuse::rng_uniform.default", args, 2, &m2, 1, &u), AF_OK); /* n0 */
    assert_int_equal(af_graph_add_node(g, "aotfuse::rng_uniform.default", args, 2, &m2, 1, &u2), AF_OK); /* n1 */
    int32_t e = node(g, "aten::mm.default", x, -1, 2); /* n2: an extern between */
    out = node(g, "aten::mul.Tensor", u2, e, 2);       /* n3: joins n1's group */
    int32_t outs[2] = {u, out};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    assert_int_equal(af_fuse_node_ok(g, 0), 1);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 1); /* one loop, independent: merged (same seed, same counters) */
    af_fuse_plan_free(plan);
    af_fuse_options keep = {.no_merge = 1};
    assert_int_equal(af_fuse_plan_new(g, &keep, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 2); /* n0 alone still gets a kernel */
    assert_true(plan->group_of_node[0] >= 0 && plan->group_of_node[1] >= 0);
    assert_true(plan->group_of_node[0] != plan->group_of_node[1]);
    assert_int_equal(plan->group_of_node[3], plan->group_of_node[1]);
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    assert_non_null(strstr(src, "AF_FN float af_rand(uint64_t seed, uint64_t idx)"));
    assert_non_null(strstr(src, "(uint64_t)q0[0]; const uint32_t iv")); /* 32 elements: 32-bit counters */
    assert_non_null(strstr(src, "= af_rand(sv"));
    free(src);
    af_fuse_plan_free(plan);
    af_graph_free(g);
}

/* A group wider than AF_MAX_DIMS operands (the code generator once kept per-operand strides in a
 * fixed array of AF_MAX_DIMS + 1). */
/* Windows: a pad of x (a member's value) never joins x's group, takes the consumer's add, guards
 * the padded dim through a coordinate operand and shifts the load; malformed pads are no windows;
 * a reduction never joins a window's group. */
/* A new graph with inputs x (float32 [4, 8]) and y (float32, the given sizes and strides; *ym its
 * metadata, which points at them). */
static af_graph *graph_x_y(const int64_t *sizes, const int64_t *strides, af_tensor_meta *ym, int32_t *x, int32_t *y) {
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = f32(2);
    *ym = m2;
    ym->sizes = sizes, ym->strides = strides;
    assert_int_equal(af_graph_add_input(g, "x", &m2, x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", ym, y), AF_OK);
    return g;
}

/* p = constant_pad_nd(src, [2, 1], -1.0) (metadata pm), then p + y; returns the sum, *p the pad. */
static int32_t pad_then_add(af_graph *g, int32_t src, int32_t y, const af_tensor_meta *pm, int32_t *p) {
    af_arg pads[2] = {{.kind = AF_ARG_INT, .u.i = 2}, {.kind = AF_ARG_INT, .u.i = 1}};
    af_arg pad_args[3] = {{.kind = AF_ARG_VALUE, .u.value = src}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = pads}},
                          {.kind = AF_ARG_FLOAT, .u.f = -1.0}};
    assert_int_equal(af_graph_add_node(g, "aten::constant_pad_nd.default", pad_args, 3, pm, 1, p), AF_OK);
    af_arg add_args[2] = {{.kind = AF_ARG_VALUE, .u.value = *p}, {.kind = AF_ARG_VALUE, .u.value = y}};
    int32_t q;
    assert_int_equal(af_graph_add_node(g, "aten::add.Tensor", add_args, 2, pm, 1, &q), AF_OK);
    return q;
}

static void test_windows(void **state) {
    (void)state;
    int64_t psz[2] = {4, 11}, pst[2] = {11, 1}, rsz[1] = {4}, rst[1] = {1};
    af_tensor_meta pm, rm = f32(2);
    int32_t x, y, h, p, q, bad, r;
    af_graph *g = graph_x_y(psz, pst, &pm, &x, &y); /* x [4, 8], y [4, 11] */
    rm.ndim = 1, rm.sizes = rsz, rm.strides = rst;
    h = node(g, "aten::exp.default", x, -1, 2); /* n0 */
    q = pad_then_add(g, h, y, &pm, &p);          /* n1 (the pad), n2 */
    af_arg odd[1] = {{.kind = AF_ARG_INT, .u.i = 3}}; /* an odd pad list: no window */
    af_arg bad_args[2] = {{.kind = AF_ARG_VALUE, .u.value = h}, {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = odd}}};
    assert_int_equal(af_graph_add_node(g, "aten::constant_pad_nd.default", bad_args, 2, &pm, 1, &bad), AF_OK); /* n3 */
    af_arg dims[1] = {{.kind = AF_ARG_INT, .u.i = 1}};
    af_arg sum_args[2] = {{.kind = AF_ARG_VALUE, .u.value = q}, {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = dims}}};
    assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", sum_args, 2, &rm, 1, &r), AF_OK); /* n4 */
    int32_t outs[3] = {q, bad, r};
    assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
    af_window w;
    assert_int_equal(af_fuse_window(g, 1, &w), 1);
    assert_int_equal(w.source, h);
    assert_int_equal(w.base, -1);
    assert_int_equal(w.left[1], 2);
    assert_int_equal(w.size[1], 8);
    assert_int_equal(w.guard_mask, 2u);
    assert_int_equal(af_fuse_window(g, 3, &w), 0);
    assert_int_equal(af_fuse_node_ok(g, 3), 0);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    int32_t gh = plan->group_of_node[0], gp = plan->group_of_node[1];
    assert_true(gh >= 0 && gp >= 0 && gh != gp);
    assert_int_equal(plan->group_of_node[2], gp);
    assert_int_equal(plan->group_of_node[3], -1);
    assert_int_not_equal(plan->group_of_node[4], gp);
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    /* the window: its row split where its guard on the coordinate operand changes (parts [0, 2),
     * [2, 10), [10, 11)), the source read inside shifted by 2 with no comparison left, the fill
     * alone outside */
    assert_non_null(strstr(src, "for (af_idx i = 2; i < 10; i++)"));
    assert_non_null(strstr(src, "(1) ? q0[o0 - (2)] : ((float)-1)"));
    assert_int_equal(count_of(src, "outside its source"), 2);
    /* no load left behind a branch, so no AF_GUARDED_LOADS (GCC 12 lost elements in if-converted
     * masked loads); the loop over rows is kept from the vectorizer (AF_ROW_END) */
    assert_null(strstr(src, "AF_GUARDED_LOADS AF_BODY void af_body_"));
    assert_int_equal(count_of(src, "AF_ROW_END;"), 1);
    free(src);
    af_fuse_plan_free(plan);
    af_graph_free(g);
}

/* A window's source that only the window reads, computed by a pointwise group of its own: those
 * nodes join the window's kernel as its shifted members (evaluated at the source's index inside the
 * guard, their inputs at shifted offsets); returned as well, the source stays a group's output. */
static void test_a_window_computes_a_source_only_it_reads(void **state) {
    (void)state;
    for (int returned = 0; returned < 2; returned++) {
        int64_t psz[2] = {4, 11}, pst[2] = {11, 1};
        af_tensor_meta pm;
        int32_t x, y, h, e, p, q;
        af_graph *g = graph_x_y(psz, pst, &pm, &x, &y); /* x [4, 8], y [4, 11] */
        h = node(g, "aten::exp.default", x, -1, 2);  /* n0 */
        e = node(g, "aten::mul.Tensor", h, x, 2);     /* n1: exp(x) * x */
        q = pad_then_add(g, e, y, &pm, &p);           /* n2 (the pad), n3 */
        int32_t outs[2] = {q, h};
        assert_int_equal(af_graph_set_outputs(g, outs, returned ? 2 : 1), AF_OK);
        af_fusion_plan *plan;
        assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
        if (returned) { /* exp(x) is stored anyway: the source stays its group's, an input of the window's */
            assert_int_not_equal(plan->group_of_node[0], plan->group_of_node[2]);
            assert_int_equal(plan->group_of_node[1], plan->group_of_node[0]);
            assert_null(plan->groups[plan->group_of_node[2]].window_of);
            af_fuse_plan_free(plan);
            af_graph_free(g);
            continue;
        }
        assert_int_equal(plan->n_groups, 1);
        const af_fusion_group *grp = &plan->groups[0];
        assert_int_equal(grp->n_nodes, 4);
        assert_non_null(grp->window_of);
        assert_int_equal(grp->window_of[0], 2); /* exp and mul: the pad's shifted members */
        assert_int_equal(grp->window_of[1], 2);
        assert_int_equal(grp->window_of[2], -1);
        assert_int_equal(grp->window_of[3], -1);
        assert_int_equal(grp->iter_value, p); /* the kernel iterates over the pad's shape */
        assert_int_equal(grp->n_inputs, 2);
        assert_int_equal(grp->n_outputs, 1);
        char *src = NULL;
        assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
        /* x only at the shifted offset (no plain load), exp and mul inside the guard */
        assert_non_null(strstr(src, "its source computed at its index"));
        assert_non_null(strstr(src, "const float v0 = q0[o0 - (2)];"));
        assert_null(strstr(src, "const float v0 = q0[o0];"));
        assert_true(strstr(src, "aten::exp") > strstr(src, "its source computed at its index"));
        free(src);
        af_fuse_plan_free(plan);
        af_graph_free(g);
    }
}

/* A pad read through a view that merges its dims, padded again (Longformer's chunked attention):
 * the inner pad, the view and exp(x) before them join the outer pad's kernel (a nested window and
 * remapped members), which computes exp(x) at the element of the inner pad's storage the view's
 * element is; where the view is also returned, the inner pad stays a kernel of its own. */
/* clone(t(p)), p = pad(exp(x)), read by mm: the copy is a window that pads nothing (af_fuse_window:
 * its source the transposed view, no guard), so its kernel computes the pad, and exp, at the
 * element the view's element is: one kernel storing only the copy. A copy of a view of what is no
 * window (exp's value) stays a plain member; a copy with no view in between too. */
static void test_a_copy_of_views_of_a_window_computes_the_window(void **state) {
    (void)state;
    for (int variant = 0; variant < 3; variant++) { /* 0: pad then t, 1: no pad (t of exp), 2: no view */
        int64_t psz[2] = {4, 10}, pst[2] = {10, 1}, tsz[2] = {10, 4}, tst[2] = {1, 10}, csz[2] = {10, 4}, cst[2] = {4, 1};
        af_tensor_meta pm = f32(2), tm = f32(2), cm = f32(2);
        pm.sizes = psz, pm.strides = pst, tm.sizes = tsz, tm.strides = tst, cm.sizes = csz, cm.strides = cst;
        if (variant == 1) tsz[1] = S2[0], tsz[0] = S2[1], csz[1] = S2[0], csz[0] = S2[1], tst[1] = S2[1];
        if (variant == 2) cm = pm;
        af_graph *g;
        int32_t x, h, p, t, c, m;
        assert_int_equal(af_graph_new(&g), AF_OK);
        af_tensor_meta xm = f32(2);
        assert_int_equal(af_graph_add_input(g, "x", &xm, &x), AF_OK);
        h = node(g, "aten::exp.default", x, -1, 2);
        p = h;
        if (variant != 1) {
            af_arg pad[2] = {{.kind = AF_ARG_INT, .u.i = 0}, {.kind = AF_ARG_INT, .u.i = 2}};
            af_arg pad_args[2] = {{.kind = AF_ARG_VALUE, .u.value = h}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = pad}}};
            assert_int_equal(af_graph_add_node(g, "aten::constant_pad_nd.default", pad_args, 2, &pm, 1, &p), AF_OK);
        }
        t = p;
        if (variant != 2) {
            af_arg t_args[1] = {{.kind = AF_ARG_VALUE, .u.value = p}};
            assert_int_equal(af_graph_add_node(g, "aten::t.default", t_args, 1, &tm, 1, &t), AF_OK);
        }
        af_arg clone_args[1] = {{.kind = AF_ARG_VALUE, .u.value = t}};
        assert_int_equal(af_graph_add_node(g, "aten::clone.default", clone_args, 1, &cm, 1, &c), AF_OK);
        int32_t ci = af_graph_value(g, c)->producer;
        af_arg mm_args[2] = {{.kind = AF_ARG_VALUE, .u.value = c}, {.kind = AF_ARG_VALUE, .u.value = x}};
        assert_int_equal(af_graph_add_node(g, "aten::mm.default", mm_args, 2, &cm, 1, &m), AF_OK);
        assert_int_equal(af_graph_set_outputs(g, &m, 1), AF_OK);
        af_window w;
        assert_int_equal(af_fuse_window(g, ci, &w), variant == 0);
        af_fusion_plan *plan;
        assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
        if (variant == 0) {
            assert_int_equal(w.source, t);
            assert_int_equal(w.source_arg, 0);
            assert_int_equal(w.guard_mask, 0);
            assert_int_equal(w.left[0], 0);
            assert_int_equal(w.size[0], 10);
            assert_int_equal(plan->n_groups, 1);
            const af_fusion_group *grp = &plan->groups[0];
            assert_int_equal(grp->n_outputs, 1);
            assert_int_equal(grp->outputs[0], c); /* the pad is never stored */
            assert_int_equal(plan->group_of_node[ci], plan->group_of_node[af_graph_value(g, p)->producer]);
            char *src = NULL;
            assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
            free(src);
        } else {
            assert_int_equal(plan->n_groups, variant == 1 ? 2 : 1); /* exp; the copy of its transpose */
        }
        af_fuse_plan_free(plan);
        af_graph_free(g);
    }
}

static void test_a_window_computes_a_source_read_through_views(void **state) {
    (void)state;
    for (int variant = 0; variant < 3; variant++) {
        int returned = variant == 1, wide = variant == 2; /* wide: x strided over 2^30 elements */
        int64_t p1sz[2] = {4, 10}, p1st[2] = {10, 1}, vsz[2] = {2, 20}, vst[2] = {20, 1}, p2sz[2] = {2, 21}, p2st[2] = {21, 1};
        af_tensor_meta p1m = f32(2), vm = f32(2), p2m = f32(2);
        p1m.sizes = p1sz, p1m.strides = p1st, vm.sizes = vsz, vm.strides = vst, p2m.sizes = p2sz, p2m.strides = p2st;
        af_graph *g;
        int32_t x, h, p1, v, p2, q;
        assert_int_equal(af_graph_new(&g), AF_OK);
        af_tensor_meta xm = f32(2);
        int64_t wide_strides[2] = {INT64_C(1) << 30, 1};
        if (wide) xm.strides = wide_strides;
        assert_int_equal(af_graph_add_input(g, "x", &xm, &x), AF_OK);
        h = node(g, "aten::exp.default", x, -1, 2); /* n0 */
        af_arg pad1[2] = {{.kind = AF_ARG_INT, .u.i = 0}, {.kind = AF_ARG_INT, .u.i = 2}};
        af_arg pad1_args[2] = {{.kind = AF_ARG_VALUE, .u.value = h}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = pad1}}};
        assert_int_equal(af_graph_add_node(g, "aten::constant_pad_nd.default", pad1_args, 2, &p1m, 1, &p1), AF_OK); /* n1 */
        af_arg shape[2] = {{.kind = AF_ARG_INT, .u.i = 2}, {.kind = AF_ARG_INT, .u.i = 20}};
        af_arg view_args[2] = {{.kind = AF_ARG_VALUE, .u.value = p1}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = shape}}};
        assert_int_equal(af_graph_add_node(g, "aten::view.default", view_args, 2, &vm, 1, &v), AF_OK); /* n2 */
        af_arg pad2[2] = {{.kind = AF_ARG_INT, .u.i = 1}, {.kind = AF_ARG_INT, .u.i = 0}};
        af_arg pad2_args[3] = {{.kind = AF_ARG_VALUE, .u.value = v}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = pad2}},
                               {.kind = AF_ARG_FLOAT, .u.f = -1.0}};
        assert_int_equal(af_graph_add_node(g, "aten::constant_pad_nd.default", pad2_args, 3, &p2m, 1, &p2), AF_OK); /* n3 */
        af_arg mul_args[2] = {{.kind = AF_ARG_VALUE, .u.value = p2}, {.kind = AF_ARG_FLOAT, .u.f = 0.5}};
        assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", mul_args, 2, &p2m, 1, &q), AF_OK); /* n4 */
        int32_t outs[2] = {q, v};
        assert_int_equal(af_graph_set_outputs(g, outs, returned ? 2 : 1), AF_OK);
        af_fusion_plan *plan;
        assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
        if (returned) { /* the view is stored: the inner pad (with exp) is a kernel, the view an ATen view */
            assert_int_equal(plan->group_of_node[2], -1);
            assert_int_equal(plan->group_of_node[0], plan->group_of_node[1]);
            assert_int_not_equal(plan->group_of_node[1], plan->group_of_node[3]);
            assert_null(plan->groups[plan->group_of_node[3]].window_of);
            af_fuse_plan_free(plan);
            af_graph_free(g);
            continue;
        }
        assert_int_equal(plan->n_groups, 1);
        const af_fusion_group *grp = &plan->groups[0];
        assert_int_equal(grp->n_nodes, 5);
        assert_non_null(grp->window_of);
        assert_int_equal(grp->window_of[0], 1); /* exp: the inner pad's shifted member */
        assert_int_equal(grp->window_of[1], 3); /* the inner pad and the view: the outer pad's */
        assert_int_equal(grp->window_of[2], 3);
        assert_int_equal(grp->window_of[3], -1);
        assert_int_equal(grp->window_of[4], -1);
        assert_int_equal(grp->iter_value, p2);
        assert_int_equal(grp->n_inputs, 1);
        assert_int_equal(grp->n_outputs, 1);
        assert_int_equal(grp->outputs[0], q);
        char *src = NULL;
        assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
        /* the view's element at storage offset f = 20 s0 + s1 of the inner pad: its coordinates
         * (f / 10, f % 10) = (2 s0 + s1 / 10, s1 % 10), in 32-bit math unless a tensor spans 2^30
         * elements */
        if (wide) {
            assert_non_null(strstr(src, "const int64_t u4_0 = (int64_t)0 + s4_0 * 2 + ((int64_t)0 + s4_1 * 1) / 10;"));
            assert_non_null(strstr(src, "q0[(int64_t)0 + s2_0 * 1073741824 + s2_1 * 1]"));
            free(src);
            af_fuse_plan_free(plan);
            af_graph_free(g);
            continue;
        }
        assert_non_null(strstr(src, "const int u4_0 = (int)0 + s4_0 * 2 + ((int)0 + s4_1 * 1) / 10;"));
        assert_non_null(strstr(src, "const int u4_1 = ((int)0 + s4_1 * 1) % 10;"));
        assert_non_null(strstr(src, "(1 && u4_1 >= 0 && u4_1 < 8)"));
        assert_non_null(strstr(src, "q0[(int)0 + s2_0 * 8 + s2_1 * 1]"));
        free(src);
        af_fuse_plan_free(plan);
        af_graph_free(g);
    }
}

/* Boxes: box_scatter(base, src, starts) reads src at the box's offset inside, base outside, on
 * every dim it does not cover whole; box_fill(base, starts, sizes, value) has no source. Both join
 * the group of the base that a member computes (base is read at the element's own index), the
 * source stays an input; a box out of bounds or of another rank is no window. */
static void test_boxes(void **state) {
    (void)state;
    af_tensor_meta m2 = f32(2); /* [4, 8] */
    int64_t ssz[2] = {2, 3}, sst[2] = {3, 1};
    af_tensor_meta sm;
    int32_t x, y, base, b1, b2, bad;
    af_graph *g = graph_x_y(ssz, sst, &sm, &x, &y); /* x [4, 8], y [2, 3] */
    base = node(g, "aten::exp.default", x, -1, 2); /* n0 */
    af_arg starts[2] = {{.kind = AF_ARG_INT, .u.i = 1}, {.kind = AF_ARG_INT, .u.i = 4}};
    af_arg box_args[3] = {{.kind = AF_ARG_VALUE, .u.value = base}, {.kind = AF_ARG_VALUE, .u.value = y},
                          {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = starts}}};
    assert_int_equal(af_graph_add_node(g, "aotfuse::box_scatter.default", box_args, 3, &m2, 1, &b1), AF_OK); /* n1 */
    af_arg fstarts[2] = {{.kind = AF_ARG_INT, .u.i = 0}, {.kind = AF_ARG_INT, .u.i = 2}};
    af_arg fsizes[2] = {{.kind = AF_ARG_INT, .u.i = 4}, {.kind = AF_ARG_INT, .u.i = 1}};
    af_arg fill_args[4] = {{.kind = AF_ARG_VALUE, .u.value = b1}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = fstarts}},
                           {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = fsizes}}, {.kind = AF_ARG_FLOAT, .u.f = -2.5}};
    assert_int_equal(af_graph_add_node(g, "aotfuse::box_fill.default", fill_args, 4, &m2, 1, &b2), AF_OK); /* n2 */
    af_arg far[2] = {{.kind = AF_ARG_INT, .u.i = 3}, {.kind = AF_ARG_INT, .u.i = 4}}; /* rows 3..4 of 4: outside */
    af_arg bad_args[3] = {{.kind = AF_ARG_VALUE, .u.value = b2}, {.kind = AF_ARG_VALUE, .u.value = y},
                          {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = far}}};
    assert_int_equal(af_graph_add_node(g, "aotfuse::box_scatter.default", bad_args, 3, &m2, 1, &bad), AF_OK); /* n3 */
    int32_t outs[2] = {b2, bad};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    af_window w;
    assert_int_equal(af_fuse_window(g, 1, &w), 1);
    assert_int_equal(w.source, y);
    assert_int_equal(w.source_arg, 1);
    assert_int_equal(w.base, base);
    assert_int_equal(w.left[0], 1);
    assert_int_equal(w.left[1], 4);
    assert_int_equal(w.size[0], 2);
    assert_int_equal(w.size[1], 3);
    assert_int_equal(w.guard_mask, 3u);
    assert_int_equal(af_fuse_window(g, 2, &w), 1);
    assert_int_equal(w.source, -1);
    assert_int_equal(w.base, b1);
    assert_int_equal(w.guard_mask, 2u); /* every row: only the column is tested */
    assert_true(w.value == -2.5);
    assert_int_equal(af_fuse_window(g, 3, &w), 0);
    assert_int_equal(af_fuse_node_ok(g, 3), 0);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    int32_t g0 = plan->group_of_node[0];
    assert_true(g0 >= 0);
    assert_int_equal(plan->group_of_node[1], g0);
    assert_int_equal(plan->group_of_node[2], g0);
    assert_int_equal(plan->group_of_node[3], -1);
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    assert_non_null(strstr(src, "aotfuse::box_scatter"));
    assert_non_null(strstr(src, "? ((float)-2.5) : v")); /* the fill inside, the base outside */
    free(src);
    af_fuse_plan_free(plan);
    af_graph_free(g);
}

static void test_wide_group(void **state) {
    (void)state;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = f32(2);
    int32_t inputs[40], acc;
    for (int i = 0; i < 40; i++) assert_int_equal(af_graph_add_input(g, NULL, &m2, &inputs[i]), AF_OK);
    acc = node(g, "aten::mul.Tensor", inputs[0], -1, 2);
    for (int i = 1; i < 40; i++) acc = node(g, "aten::add.Tensor", acc, inputs[i], 2);
    assert_int_equal(af_graph_set_outputs(g, &acc, 1), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 1);
    assert_int_equal(plan->groups[0].n_inputs, 40);
    assert_source_has_then_free(g, plan, "q40[");
}

/* A column sum of a row kernel's member recomputes it in its own kernel (recomputed members):
 * x [4, 8]; row kernel: e = exp(x - amax(x, 1)), c = x * 0.5 beside it; s = sum(c, 0) and
 * t = sum(x, 0) make one column kernel that reads x and recomputes c, which the row kernel then
 * does not store. */
/* A reduction `op`(v, [dim], keepdim) with output meta m; its value. */
static int32_t reduce(af_graph *g, const char *op, int32_t v, int64_t dim, int keepdim, const af_tensor_meta *m) {
    af_arg dims[1] = {{.kind = AF_ARG_INT, .u.i = dim}};
    af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = v}, {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = dims}},
                      {.kind = AF_ARG_BOOL, .u.i = keepdim}};
    int32_t out = -1;
    assert_int_equal(af_graph_add_node(g, op, args, keepdim ? 3 : 2, m, 1, &out), AF_OK);
    return out;
}

static int64_t RS[2] = {4, 1}, RT[2] = {1, 1};

/* A [4, 1] row statistic. */
static af_tensor_meta row_meta(void) {
    af_tensor_meta m = f32(2);
    m.sizes = RS;
    m.strides = RT;
    return m;
}

/* A graph with one [4, 8] input x. */
static af_graph *graph_x(int32_t *x) {
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = f32(2);
    assert_int_equal(af_graph_add_input(g, "x", &m2, x), AF_OK);
    return g;
}

/* Sets the graph's three outputs and plans it: two kernels, nodes 0-3 in the row kernel, the
 * column sums (nodes 4 and 5) in the other. */
static af_fusion_plan *plan_row_and_column(af_graph *g, const int32_t *outs) {
    assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 2);
    int32_t row = plan->group_of_node[0], col = plan->group_of_node[4];
    assert_true(row >= 0 && col >= 0 && row != col);
    for (int32_t i = 0; i < 4; i++) assert_int_equal(plan->group_of_node[i], row);
    assert_int_equal(plan->group_of_node[5], col);
    return plan;
}

static void test_recomputed_members(void **state) {
    (void)state;
    af_tensor_meta m1 = f32(1), mr = row_meta();
    int32_t x;
    af_graph *g = graph_x(&x);
    int32_t m = reduce(g, "aten::amax.default", x, 1, 1, &mr); /* n0 */
    int32_t d = node(g, "aten::sub.Tensor", x, m, 2);          /* n1 */
    int32_t e = node(g, "aten::exp.default", d, -1, 2);        /* n2 */
    int32_t c = node(g, "aten::mul.Tensor", x, -1, 2);         /* n3 */
    int32_t s = reduce(g, "aten::sum.dim_IntList", c, 0, 0, &m1); /* n4 */
    int32_t t = reduce(g, "aten::sum.dim_IntList", x, 0, 0, &m1); /* n5 */
    int32_t outs[3] = {e, s, t};
    af_fusion_plan *plan = plan_row_and_column(g, outs);
    int32_t row = plan->group_of_node[0], col = plan->group_of_node[4];
    /* the column kernel: its own sums and the recomputed c, in graph order; reads x only */
    const af_fusion_group *cg = &plan->groups[col], *rg = &plan->groups[row];
    assert_int_equal(cg->n_nodes, 3);
    assert_int_equal(cg->nodes[0], 3);
    assert_int_equal(cg->nodes[1], 4);
    assert_int_equal(cg->nodes[2], 5);
    assert_int_equal(cg->n_inputs, 1);
    assert_int_equal(cg->inputs[0], x);
    assert_int_equal(cg->n_outputs, 2);
    assert_int_equal(cg->last_node, 5);
    /* the row kernel stores e only: c is nobody's input now */
    assert_int_equal(rg->n_outputs, 1);
    assert_int_equal(rg->outputs[0], e);
    assert_source_has_then_free(g, plan, "(2 column reductions), 1 inputs, 2 outputs");
}

/* A column sum whose input's producers are too many to recompute (a gradient summed from three
 * tensors) reads that gradient materialized by the row kernel instead, and its kernel runs after
 * the row kernel even though the row kernel took a node after the sums. */
static void test_recompute_reads_a_materialized_member(void **state) {
    (void)state;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = f32(2), m1 = f32(1), mr = row_meta();
    int32_t in[4];
    const char *names[4] = {"a", "b", "c", "xh"};
    for (int k = 0; k < 4; k++) assert_int_equal(af_graph_add_input(g, names[k], &m2, &in[k]), AF_OK);
    int32_t xh = in[3];
    int32_t go1 = node(g, "aten::add.Tensor", in[0], in[1], 2);    /* n0 */
    int32_t go = node(g, "aten::add.Tensor", go1, in[2], 2);       /* n1 */
    int32_t r = reduce(g, "aten::sum.dim_IntList", go, 1, 1, &mr); /* n2 */
    int32_t pr = node(g, "aten::mul.Tensor", go, xh, 2);           /* n3 */
    int32_t s = reduce(g, "aten::sum.dim_IntList", pr, 0, 0, &m1); /* n4 */
    int32_t t = reduce(g, "aten::sum.dim_IntList", go, 0, 0, &m1); /* n5 */
    int32_t dx = node(g, "aten::sub.Tensor", go, r, 2);            /* n6: after the sums */
    int32_t outs[3] = {dx, s, t};
    af_fusion_plan *plan = plan_row_and_column(g, outs);
    int32_t row = plan->group_of_node[0], col = plan->group_of_node[4];
    assert_int_equal(plan->group_of_node[6], row); /* the row kernel still took dx */
    const af_fusion_group *cg = &plan->groups[col], *rg = &plan->groups[row];
    /* the column kernel recomputes the product only, reading go (materialized) and xh */
    assert_int_equal(cg->n_nodes, 3);
    assert_int_equal(cg->nodes[0], 3);
    assert_int_equal(cg->n_inputs, 2);
    assert_true((cg->inputs[0] == go && cg->inputs[1] == xh) || (cg->inputs[0] == xh && cg->inputs[1] == go));
    int stores_go = 0;
    for (int32_t k = 0; k < rg->n_outputs; k++) stores_go |= rg->outputs[k] == go;
    assert_true(stores_go);
    /* it runs after the row kernel, which runs at dx */
    assert_int_equal(rg->last_node, 6);
    assert_int_equal(cg->last_node, 6);
    assert_source_has_then_free(g, plan, "(2 column reductions), 2 inputs, 2 outputs");
}

/* Cross entropy's backward: dx = x - exp(x) * sum(x, 1) in a row kernel, its column sum (the bias
 * gradient) and a matmul reading dx after it. dx is stored for the matmul whatever the plan, so
 * the column sum reads it: the row kernel stores dx alone, not also exp(x) * sum for the column
 * sum to recompute dx from (which wrote and read one more tensor of x's size). */
static void test_recompute_reads_a_value_stored_anyway(void **state) {
    (void)state;
    af_tensor_meta m1 = f32(1), mr = row_meta();
    int32_t x;
    af_graph *g = graph_x(&x);
    int32_t r = reduce(g, "aten::sum.dim_IntList", x, 1, 1, &mr); /* n0 */
    int32_t e = node(g, "aten::exp.default", x, -1, 2);           /* n1 */
    int32_t p = node(g, "aten::mul.Tensor", e, r, 2);             /* n2 */
    int32_t dx = node(g, "aten::sub.Tensor", x, p, 2);            /* n3 */
    int32_t t = reduce(g, "aten::sum.dim_IntList", dx, 0, 0, &m1); /* n4: before the matmul */
    int32_t y = node(g, "aten::mm", dx, -1, 2);                    /* n5: an extern reading dx */
    int32_t outs[2] = {t, y};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    int32_t row = plan->group_of_node[0];
    assert_true(row >= 0);
    for (int32_t i = 1; i < 4; i++) assert_int_equal(plan->group_of_node[i], row);
    assert_int_equal(plan->group_of_node[5], -1);
    const af_fusion_group *rg = &plan->groups[row];
    assert_int_equal(rg->n_outputs, 1);
    assert_int_equal(rg->outputs[0], dx);
    /* the column sum recomputes nothing: it reads dx, in a group of its own or as an extern call */
    for (int32_t gi = 0; gi < plan->n_groups; gi++) {
        if (gi == row) continue;
        for (int32_t k = 0; k < plan->groups[gi].n_nodes; k++) assert_int_equal(plan->groups[gi].nodes[k], 4);
    }
    assert_source_has_then_free(g, plan, "1 outputs");
}

/* A row sum of another input beside a phased kernel over the same rows (cross entropy's max and
 * log-sum-exp, and a one-hot pick of the logits: picks.py) joins the phased kernel's first pass;
 * a second phased kernel over the same rows stays apart (its phases would interleave with the
 * first's), as does anything under no_merge. */
static void test_a_row_sum_joins_a_phased_kernel(void **state) {
    (void)state;
    af_tensor_meta m2 = f32(2), mr = row_meta();
    for (int second_phased = 0; second_phased < 2; second_phased++) {
        int32_t x, y;
        af_graph *g = graph_x(&x);
        assert_int_equal(af_graph_add_input(g, "y", &m2, &y), AF_OK);
        int32_t m = reduce(g, "aten::amax.default", x, 1, 1, &mr);     /* n0 */
        int32_t d = node(g, "aten::sub.Tensor", x, m, 2);              /* n1: an epilogue */
        int32_t e = node(g, "aten::exp.default", d, -1, 2);            /* n2 */
        int32_t s = reduce(g, "aten::sum.dim_IntList", e, 1, 1, &mr);  /* n3: phase 1 */
        int32_t outs[3] = {s, -1, -1};
        if (second_phased) {
            int32_t m2y = reduce(g, "aten::amax.default", y, 1, 1, &mr);  /* n4 */
            int32_t dy = node(g, "aten::sub.Tensor", y, m2y, 2);           /* n5 */
            outs[1] = reduce(g, "aten::sum.dim_IntList", dy, 1, 1, &mr);  /* n6 */
        } else {
            int32_t h = node(g, "aten::mul.Tensor", y, -1, 2);             /* n4: the pick */
            outs[1] = reduce(g, "aten::sum.dim_IntList", h, 1, 1, &mr);   /* n5 */
        }
        assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
        af_fuse_options keep = {.no_merge = 1};
        af_fusion_plan *plan;
        assert_int_equal(af_fuse_plan_new(g, &keep, &plan), AF_OK);
        assert_int_equal(plan->n_groups, 2);
        af_fuse_plan_free(plan);
        assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
        if (second_phased) {
            assert_int_equal(plan->n_groups, 2);
            af_fuse_plan_free(plan);
            af_graph_free(g);
            continue;
        }
        assert_int_equal(plan->n_groups, 1);
        for (int32_t i = 0; i < 6; i++) assert_int_equal(plan->group_of_node[i], 0);
        /* both row sums in the first pass (phase 0: the max and y's sum), the exp-sum in the second */
        char *src = NULL;
        assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
        assert_non_null(strstr(src, "3 reductions, 2 phases"));
        const char *ph0 = strstr(src, "/* phase 0 */"), *ph1 = strstr(src, "/* phase 1 */");
        assert_true(ph0 && ph1 && ph0 < ph1);
        char acc[32];
        snprintf(acc, sizeof acc, "accf%d += v", (int)outs[1]);
        const char *pick = strstr(src, acc);
        assert_true(pick && pick > ph0 && pick < ph1);
        free(src);
        af_fuse_plan_free(plan);
        af_graph_free(g);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_siblings_and_closing),
        cmocka_unit_test(test_lone_nodes_and_min_group),
        cmocka_unit_test(test_independent_groups_merge),
        cmocka_unit_test(test_a_row_sum_joins_a_phased_kernel),
        cmocka_unit_test(test_random_nodes),
        cmocka_unit_test(test_wide_group),
        cmocka_unit_test(test_windows),
        cmocka_unit_test(test_a_window_computes_a_source_only_it_reads),
        cmocka_unit_test(test_a_window_computes_a_source_read_through_views),
        cmocka_unit_test(test_a_copy_of_views_of_a_window_computes_the_window),
        cmocka_unit_test(test_boxes),
        cmocka_unit_test(test_identical_kernels_share_a_body),
        cmocka_unit_test(test_many_streams_stay_constants),
        cmocka_unit_test(test_recomputed_members),
        cmocka_unit_test(test_recompute_reads_a_materialized_member),
        cmocka_unit_test(test_recompute_reads_a_value_stored_anyway),
    };
    return cmocka_run_group_tests_name("fuse", tests, NULL, NULL);
}
