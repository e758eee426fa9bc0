/* CMocka tests of csrc/partition.c: on hundreds of random joint graphs, both partitions are
 * valid splits (af_partition_check), min-cut never saves a tangent-dependent value, and on
 * hand-made graphs it recomputes cheap pointwise work and keeps what must not be recomputed. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_util.h"

#include "aotfuse/partition.h"

static uint64_t rng = 0x243F6A8885A308D3ull;
static uint32_t rnd(uint32_t n) {
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (uint32_t)((rng * 2685821657736338717ull) >> 33) % n;
}

static af_tensor_meta vec(int64_t *size, int64_t *stride) { return f32_cpu_meta(1, size, stride); }

static int32_t add(af_graph *g, const char *op, int32_t a, int32_t b, int64_t n) {
    int64_t size = n, stride = 1;
    af_tensor_meta m = vec(&size, &stride);
    af_arg args[2] = {{.kind = AF_ARG_VALUE, .u.value = a}, {.kind = AF_ARG_VALUE, .u.value = b}};
    int32_t out = -1;
    assert_int_equal(af_graph_add_node(g, op, args, b >= 0 ? 2 : 1, &m, 1, &out), AF_OK);
    return out;
}

static int32_t input(af_graph *g, const char *name, int64_t n) {
    int64_t size = n, stride = 1;
    af_tensor_meta m = vec(&size, &stride);
    int32_t id;
    assert_int_equal(af_graph_add_input(g, name, &m, &id), AF_OK);
    return id;
}

static const char *const ops[] = {"aten::mul.Tensor", "aten::add.Tensor", "aten::exp.default", "aten::view.default",
                                  "aten::sum.dim_IntList", "aten::mm.default", "aten::native_dropout.default",
                                  "aten::some_extern.default", "aten::tanh.default", "aten::amax.default",
                                  "aotfuse::rng_uniform.default"};
#define N_OPS ((uint32_t)(sizeof ops / sizeof ops[0]))

static void check_partition(const af_graph *g, const uint8_t *roles, int32_t nfwd, const af_partition *p) {
    int st = af_partition_check(g, roles, nfwd, p);
    if (st) fail_msg("invalid partition: %s", af_error_message());
    for (int32_t s = 0; s < p->n_saved; s++) {
        const af_value *v = af_graph_value(g, p->saved[s]);
        if (v->producer < 0) {
            /* a saved input must be a forward input */
            int32_t i = 0;
            while (af_graph_input(g, i) != p->saved[s]) i++;
            assert_true(roles[i] == AF_ROLE_PRIMAL || roles[i] == AF_ROLE_PARAM || roles[i] == AF_ROLE_FWD_SEED);
        }
    }
}

static void test_random_joint_graphs_are_split_validly(void **state) {
    (void)state;
    for (int trial = 0; trial < 400; trial++) {
        af_graph *g = NULL;
        assert_int_equal(af_graph_new(&g), AF_OK);
        int32_t vals[256], nvals = 0, fw_vals[256], n_fw = 0;
        uint8_t roles[16];
        int32_t n_primal = 1 + (int32_t)rnd(4), n_tangent = 1 + (int32_t)rnd(2);
        for (int32_t i = 0; i < n_primal; i++) {
            roles[i] = rnd(2) ? AF_ROLE_PRIMAL : AF_ROLE_PARAM;
            vals[nvals++] = fw_vals[n_fw++] = input(g, NULL, 1 + rnd(64));
        }
        int32_t tangents[4];
        for (int32_t i = 0; i < n_tangent; i++) {
            roles[n_primal + i] = AF_ROLE_TANGENT;
            tangents[i] = input(g, NULL, 1 + rnd(64));
        }
        /* forward: ops over forward values only */
        int32_t n_fw_nodes = 1 + (int32_t)rnd(25);
        for (int32_t k = 0; k < n_fw_nodes; k++) {
            int32_t a = fw_vals[rnd((uint32_t)n_fw)], b = rnd(2) ? fw_vals[rnd((uint32_t)n_fw)] : -1;
            fw_vals[n_fw++] = add(g, ops[rnd(N_OPS)], a, b, 1 + rnd(64));
        }
        /* backward: each node reads something tangent-dependent and maybe a forward value */
        int32_t bw_vals[128], n_bw = 0;
        for (int32_t i = 0; i < n_tangent; i++) bw_vals[n_bw++] = tangents[i];
        int32_t n_bw_nodes = 1 + (int32_t)rnd(25);
        for (int32_t k = 0; k < n_bw_nodes; k++) {
            int32_t a = bw_vals[rnd((uint32_t)n_bw)], b = rnd(3) ? fw_vals[rnd((uint32_t)n_fw)] : -1;
            bw_vals[n_bw++] = add(g, ops[rnd(N_OPS)], a, b, 1 + rnd(64));
        }
        /* outputs: some forward values, then gradients (tangent-dependent, sometimes a forward value) */
        int32_t outs[16], no = 0, nfwd = 1 + (int32_t)rnd(3);
        for (int32_t i = 0; i < nfwd; i++) outs[no++] = fw_vals[n_primal + rnd((uint32_t)(n_fw - n_primal))];
        int32_t ngrad = 1 + (int32_t)rnd(4);
        for (int32_t i = 0; i < ngrad; i++) outs[no++] = rnd(5) ? bw_vals[n_tangent + rnd((uint32_t)(n_bw - n_tangent))] : fw_vals[rnd((uint32_t)n_fw)];
        assert_int_equal(af_graph_set_outputs(g, outs, no), AF_OK);
        (void)vals;

        af_partition *mc = NULL, *def = NULL;
        if (af_partition_min_cut(g, roles, nfwd, NULL, &mc)) fail_msg("min cut failed: %s", af_error_message());
        check_partition(g, roles, nfwd, mc);
        if (af_partition_default(g, roles, nfwd, &def)) fail_msg("default failed: %s", af_error_message());
        check_partition(g, roles, nfwd, def);
        assert_int_equal(def->n_recomputed, 0);
        af_partition_free(mc);
        af_partition_free(def);
        af_graph_free(g);
    }
}

/* x -> mm(W) -> h -> exp -> e -> mul(e, e) -> y; backward reads e:
 * min cut saves h (or e) once, and recomputes exp in the backward rather than saving both. */
/* x -> mm(w) -> h -> op -> e -> e * e, the backward reading e (t * e * e) and w; roles: x and w
 * primal, t the tangent. */
static af_graph *unary_chain(const char *op, int32_t *w, int32_t *h, int32_t *e) {
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x = input(g, "x", 64), t;
    *w = input(g, "w", 64);
    t = input(g, "t", 64);
    *h = add(g, "aten::mm.default", x, *w, 64);
    *e = add(g, op, *h, -1, 64);
    int32_t y = add(g, "aten::mul.Tensor", *e, *e, 64);
    int32_t ge = add(g, "aten::mul.Tensor", t, *e, 64);     /* grad wrt e: t * e (uses e) */
    int32_t gh = add(g, "aten::mul.Tensor", ge, *e, 64);    /* grad wrt h: * exp(h) */
    int32_t gx = add(g, "aten::mm.default", gh, *w, 64);    /* grad wrt x: reads w */
    int32_t outs[2] = {y, gx};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    return g;
}

static void test_pointwise_chain_is_recomputed(void **state) {
    (void)state;
    int32_t w, h, e;
    af_graph *g = unary_chain("aten::exp.default", &w, &h, &e);
    uint8_t roles[3] = {AF_ROLE_PRIMAL, AF_ROLE_PRIMAL, AF_ROLE_TANGENT};
    af_partition *mc = NULL, *def = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &mc), AF_OK);
    assert_int_equal(af_partition_default(g, roles, 1, &def), AF_OK);
    check_partition(g, roles, 1, mc);
    check_partition(g, roles, 1, def);
    /* default saves e and w; min cut saves h and w and recomputes exp */
    assert_int_equal(def->n_saved, 2);
    assert_int_equal(mc->n_saved, 2);
    assert_true(mc->saved[0] == w || mc->saved[1] == w);
    assert_true(mc->saved[0] == h || mc->saved[1] == h);
    assert_int_equal(mc->n_recomputed, 1);
    /* exp runs in both programs: in the backward just before its first use */
    int32_t exp_node = af_graph_value(g, e)->producer;
    assert_true(mc->in_forward[exp_node] && mc->in_backward[exp_node]);
    assert_int_equal(mc->backward_order[0], exp_node);
    af_partition_free(mc);
    af_partition_free(def);
    af_graph_free(g);
}

/* The min cut of g with options o (one forward output), checked valid. */
static af_partition *cut_checked(const af_graph *g, const uint8_t *roles, const af_partition_options *o) {
    af_partition *p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, o, &p), AF_OK);
    check_partition(g, roles, 1, p);
    return p;
}

/* The chain above with atan for exp: atanf is a libm call GCC does not vectorize, so its CPU value
 * is saved, not recomputed (ban_scalar_calls); with the option off the cut recomputes it as exp.
 * cos, the C prelude's vectorized af_cos (2026-12-06), still costs 6x exp and is saved the same way;
 * log is af_log, about exp's cost, recomputed as exp, unless AOTFUSE_VECTOR_LIBM=0 makes it libm's
 * logf again. */
static void test_unvectorized_libm_values_are_saved(void **state) {
    (void)state;
    const struct { const char *op, *vector_libm; int ban, saved; } cases[] = {
        {"aten::atan.default", NULL, 1, 1}, {"aten::atan.default", NULL, 0, 0}, {"aten::cos.default", NULL, 1, 1},
        {"aten::cos.default", NULL, 0, 0},  {"aten::log.default", NULL, 1, 0},  {"aten::log.default", "0", 1, 1},
        {"aten::log.default", "0", 0, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        if (cases[c].vector_libm) setenv("AOTFUSE_VECTOR_LIBM", cases[c].vector_libm, 1);
        else unsetenv("AOTFUSE_VECTOR_LIBM");
        int32_t w, h, e;
        af_graph *g = unary_chain(cases[c].op, &w, &h, &e);
        const uint8_t roles[3] = {AF_ROLE_PRIMAL, AF_ROLE_PRIMAL, AF_ROLE_TANGENT};
        af_partition_options o = af_partition_default_options();
        assert_int_equal(o.ban_scalar_calls, 1); /* the default */
        o.ban_scalar_calls = cases[c].ban;
        af_partition *mc = cut_checked(g, roles, &o);
        assert_int_equal(mc->n_saved, 2);
        assert_true(mc->saved[0] == w || mc->saved[1] == w);
        int32_t kept = cases[c].saved ? e : h; /* the op's output, or its input and the op again in the backward */
        assert_true(mc->saved[0] == kept || mc->saved[1] == kept);
        assert_int_equal(mc->n_recomputed, cases[c].saved ? 0 : 1);
        af_partition_free(mc);
        af_graph_free(g);
    }
    unsetenv("AOTFUSE_VECTOR_LIBM");
}

/* x -> mm(W) -> h -> exp -> e -> mm(W) -> y, the backward reading h and e (the gradient of e through
 * W, of h through exp, of W through e); x has x_size elements, the rest 64. Roles: x primal, W a
 * parameter, t the tangent. */
static af_graph *region_graph(int64_t x_size, int32_t *x, int32_t *w, int32_t *h, int32_t *e) {
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t t;
    *x = input(g, "x", x_size);
    *w = input(g, "w", 64);
    t = input(g, "t", 64);
    *h = add(g, "aten::mm.default", *x, *w, 64);
    *e = add(g, "aten::exp.default", *h, -1, 64);
    int32_t y = add(g, "aten::mm.default", *e, *w, 64);
    int32_t ge = add(g, "aten::mm.default", t, *w, 64);  /* grad wrt e */
    int32_t gh = add(g, "aten::mul.Tensor", ge, *e, 64); /* grad wrt h: * exp(h) */
    int32_t gw = add(g, "aten::mm.default", *e, t, 64);  /* grad wrt W (second mm): reads e */
    int32_t gx = add(g, "aten::mm.default", gh, *w, 64);
    int32_t outs[3] = {y, gx, gw};
    assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
    return g;
}

/* Activation checkpointing on region_graph.
 * Without a policy the cut saves h (the mm is never recomputed); with both nodes to recompute
 * nothing of the region is saved (x and W are), and the backward runs the mm and exp again; a node
 * to save is saved, even where recomputing it is cheap. The default partition recomputes the same. */
static void test_node_policy_checkpointed_region(void **state) {
    (void)state;
    int32_t x, w, h, e;
    af_graph *g = region_graph(64, &x, &w, &h, &e);
    uint8_t roles[3] = {AF_ROLE_PRIMAL, AF_ROLE_PARAM, AF_ROLE_TANGENT};
    int32_t mm_node = af_graph_value(g, h)->producer, exp_node = af_graph_value(g, e)->producer;
    int32_t nn = af_graph_num_nodes(g);
    uint8_t *policy = calloc((size_t)nn, 1);
    assert_non_null(policy);
    af_partition_options o = af_partition_default_options();
    af_partition *p = NULL;
    /* no policy: the mm is not recomputed */
    assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
    check_partition(g, roles, 1, p);
    assert_false(p->in_backward[mm_node]);
    af_partition_free(p);
    /* the region (mm, exp) to recompute: only x and W saved, both nodes rerun in the backward */
    policy[mm_node] = policy[exp_node] = AF_POLICY_RECOMPUTE;
    o.node_policy = policy;
    for (int min_cut = 0; min_cut < 2; min_cut++) {
        p = NULL;
        if (min_cut) assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
        else assert_int_equal(af_partition_default_policy(g, roles, 1, policy, &p), AF_OK);
        check_partition(g, roles, 1, p);
        for (int32_t s = 0; s < p->n_saved; s++) assert_true(p->saved[s] == x || p->saved[s] == w);
        assert_true(p->in_forward[mm_node] && p->in_backward[mm_node]);
        assert_true(p->in_forward[exp_node] && p->in_backward[exp_node]);
        af_partition_free(p);
    }
    /* exp to save, the mm to recompute: e is saved and the mm is not rerun (nothing reads h but exp) */
    policy[exp_node] = AF_POLICY_SAVE;
    p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
    check_partition(g, roles, 1, p);
    int saved_e = 0;
    for (int32_t s = 0; s < p->n_saved; s++) saved_e |= p->saved[s] == e;
    assert_true(saved_e);
    assert_false(p->in_backward[exp_node]);
    af_partition_free(p);
    free(policy);
    af_graph_free(g);
}

/* The memory budget on region_graph, x a quarter of h's bytes. Budget 1 keeps the cut (h or e saved,
 * the mm not rerun); budget 0 lets the mm be recomputed from x, so nothing but x and W is saved; a
 * budget outside [0, 1] is an error. A node marked to save is never freed (the budget's candidates
 * are compute nodes not marked to save). */
static void test_memory_budget_recomputes_matmuls(void **state) {
    (void)state;
    int32_t x, w, h, e;
    af_graph *g = region_graph(16, &x, &w, &h, &e);
    uint8_t roles[3] = {AF_ROLE_PRIMAL, AF_ROLE_PARAM, AF_ROLE_TANGENT};
    int32_t mm_node = af_graph_value(g, h)->producer;
    af_partition_options o = af_partition_default_options();
    assert_true(o.memory_budget == 1.0);
    af_partition *p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
    check_partition(g, roles, 1, p);
    assert_false(p->in_backward[mm_node]);
    af_partition_free(p);
    o.memory_budget = 0.0;
    p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
    check_partition(g, roles, 1, p);
    for (int32_t s = 0; s < p->n_saved; s++) assert_true(p->saved[s] == x || p->saved[s] == w);
    assert_true(p->in_forward[mm_node] && p->in_backward[mm_node]);
    af_partition_free(p);
    /* the mm marked to save: the budget may not free it */
    uint8_t *policy = calloc((size_t)af_graph_num_nodes(g), 1);
    assert_non_null(policy);
    policy[mm_node] = AF_POLICY_SAVE;
    o.node_policy = policy;
    p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
    check_partition(g, roles, 1, p);
    assert_false(p->in_backward[mm_node]);
    af_partition_free(p);
    free(policy);
    o.node_policy = NULL;
    o.memory_budget = 1.5;
    p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_ERR_INVALID);
    assert_null(p);
    af_graph_free(g);
}

/* A parameter costs nothing to save (it lives anyway): the backward reads the weight itself, not
 * the transposed view of it the forward made (which, closer to the backward, would cost less to
 * save than a plain primal of the same bytes). */
static void test_parameters_are_free_to_save(void **state) {
    (void)state;
    for (int as_param = 0; as_param < 2; as_param++) {
        af_graph *g = NULL;
        assert_int_equal(af_graph_new(&g), AF_OK);
        int32_t x = input(g, "x", 64), w = input(g, "w", 64), t = input(g, "t", 64);
        int32_t wt = add(g, "aten::view.default", w, -1, 64);  /* t(w) */
        int32_t h = add(g, "aten::mm.default", x, wt, 64);
        int32_t wtt = add(g, "aten::view.default", wt, -1, 64); /* t(t(w)) in the backward */
        int32_t gx = add(g, "aten::mm.default", t, wtt, 64);
        int32_t outs[2] = {h, gx};
        assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
        uint8_t roles[3] = {AF_ROLE_PRIMAL, as_param ? AF_ROLE_PARAM : AF_ROLE_PRIMAL, AF_ROLE_TANGENT};
        af_partition *mc = NULL;
        assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &mc), AF_OK);
        check_partition(g, roles, 1, mc);
        assert_int_equal(mc->n_saved, 1);
        assert_int_equal(mc->saved[0], as_param ? w : wt);
        af_partition_free(mc);
        af_graph_free(g);
    }
}

/* Random ops and compute-heavy ops are never recomputed. */
static void test_banned_ops_are_saved(void **state) {
    (void)state;
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x = input(g, "x", 32), t = input(g, "t", 32);
    int32_t d = add(g, "aten::native_dropout.default", x, -1, 32);
    int32_t y = add(g, "aten::mul.Tensor", d, x, 32);
    int32_t gx = add(g, "aten::mul.Tensor", t, d, 32);
    int32_t outs[2] = {y, gx};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    uint8_t roles[2] = {AF_ROLE_PRIMAL, AF_ROLE_TANGENT};
    af_partition *mc = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &mc), AF_OK);
    check_partition(g, roles, 1, mc);
    assert_int_equal(mc->n_saved, 1);
    assert_int_equal(mc->saved[0], d); /* the dropout result itself, never a re-run of dropout */
    assert_int_equal(mc->n_recomputed, 0);
    af_partition_free(mc);
    af_graph_free(g);
}

/* A compute node with two outputs, the second read only by the backward (attention's logsumexp):
 * the node is banned as a whole, so the second output is saved, never recomputed. */
static void test_multi_output_compute_node_is_not_rerun(void **state) {
    (void)state;
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x = input(g, "x", 32), t = input(g, "t", 32);
    int64_t size = 32, stride = 1;
    af_tensor_meta metas[2] = {vec(&size, &stride), vec(&size, &stride)};
    af_arg args[1] = {{.kind = AF_ARG_VALUE, .u.value = x}};
    int32_t first = -1;
    assert_int_equal(af_graph_add_node(g, "aten::_scaled_dot_product_flash_attention_for_cpu.default", args, 1, metas, 2, &first), AF_OK);
    int32_t out = first, lse = first + 1;
    int32_t y = add(g, "aten::exp.default", out, -1, 32);
    int32_t gx = add(g, "aten::mul.Tensor", t, lse, 32);
    int32_t outs[2] = {y, gx};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    uint8_t roles[2] = {AF_ROLE_PRIMAL, AF_ROLE_TANGENT};
    af_partition *mc = NULL, *def = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &mc), AF_OK);
    check_partition(g, roles, 1, mc);
    assert_int_equal(mc->n_recomputed, 0);
    assert_int_equal(mc->n_saved, 1);
    assert_int_equal(mc->saved[0], lse);
    /* the default partition too: the forward made lse, the backward reads it, nothing reruns */
    assert_int_equal(af_partition_default(g, roles, 1, &def), AF_OK);
    check_partition(g, roles, 1, def);
    assert_int_equal(def->n_recomputed, 0);
    assert_int_equal(def->n_saved, 1);
    assert_int_equal(def->saved[0], lse);
    af_partition_free(def);
    af_partition_free(mc);
    af_graph_free(g);
}

/* A value whose recompute would draw two random nodes again (a residual stream through two
 * dropouts) is saved; one drawing a single random node (a dropout's mask) is still recomputed.
 * Without ban_chained_random the min cut rebuilds the stream from the first dropout on. */
/* Inputs seed, x, y1, y2, t (roles as below) and a residual stream through two dropouts:
 * h1 = x + y1 * u1, h2 = h1 + y2 * u2, u1 and u2 random numbers from the seed (ids in c[0..3]:
 * u1, h1, u2, h2; c[4] is t). */
static const uint8_t chain_roles[5] = {AF_ROLE_FWD_SEED, AF_ROLE_PRIMAL, AF_ROLE_PARAM, AF_ROLE_PARAM, AF_ROLE_TANGENT};

static af_graph *two_dropout_chain(int32_t *c) {
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t seed = input(g, "seed", 1), x = input(g, "x", 64), y1 = input(g, "y1", 64), y2 = input(g, "y2", 64);
    c[4] = input(g, "t", 64);
    c[0] = add(g, "aotfuse::rng_uniform.default", seed, -1, 64);
    c[1] = add(g, "aten::add.Tensor", x, add(g, "aten::mul.Tensor", y1, c[0], 64), 64);
    c[2] = add(g, "aotfuse::rng_uniform.default", seed, -1, 64);
    c[3] = add(g, "aten::add.Tensor", c[1], add(g, "aten::mul.Tensor", y2, c[2], 64), 64);
    return g;
}

static void test_chained_random_values_are_saved(void **state) {
    (void)state;
    for (int ban = 0; ban < 2; ban++) {
        int32_t c[5];
        af_graph *g = two_dropout_chain(c);
        int32_t u1 = c[0], h1 = c[1], u2 = c[2], h2 = c[3], t = c[4];
        int32_t out = add(g, "aten::mul.Tensor", h2, h2, 64);
        int32_t g1 = add(g, "aten::mul.Tensor", t, h1, 64); /* the backward reads h1, h2 and the masks */
        int32_t g2 = add(g, "aten::mul.Tensor", add(g, "aten::mul.Tensor", t, h2, 64), u2, 64);
        int32_t g3 = add(g, "aten::mul.Tensor", g1, u1, 64);
        int32_t outs[3] = {out, g2, g3};
        assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
        af_partition_options o = af_partition_default_options();
        assert_int_equal(o.ban_chained_random, 1);
        o.ban_chained_random = ban;
        af_partition *p = NULL;
        assert_int_equal(af_partition_min_cut(g, chain_roles, 1, &o, &p), AF_OK);
        check_partition(g, chain_roles, 1, p);
        int32_t h2_node = af_graph_value(g, h2)->producer, u1_node = af_graph_value(g, u1)->producer;
        assert_true(p->in_backward[u1_node]); /* a mask: drawn again from the seed, never saved */
        assert_int_equal(p->in_backward[h2_node], !ban);
        int saved_h2 = 0;
        for (int32_t i = 0; i < p->n_saved; i++) saved_h2 |= p->saved[i] == h2;
        assert_int_equal(saved_h2, ban);
        af_partition_free(p);
        af_graph_free(g);
    }
}

/* Draws stop at a value that is never recomputed: exp(h2) and tanh(h2), read from a saved h2 (an
 * mm in the backward materializes it), redraw nothing and are recomputed, not saved, ban or no ban. */
static void test_values_after_a_saved_chain_are_still_recomputed(void **state) {
    (void)state;
    for (int ban = 0; ban < 2; ban++) {
        int32_t c[5];
        af_graph *g = two_dropout_chain(c);
        int32_t h2 = c[3], t = c[4];
        int32_t w = add(g, "aten::exp.default", h2, -1, 64), w2 = add(g, "aten::tanh.default", h2, -1, 64);
        int32_t out = add(g, "aten::mul.Tensor", w, w2, 64);
        int32_t gh = add(g, "aten::mm.default", t, h2, 64);
        int32_t gw = add(g, "aten::mul.Tensor", add(g, "aten::mul.Tensor", t, w, 64), w2, 64);
        int32_t outs[3] = {out, gh, gw};
        assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
        af_partition_options o = af_partition_default_options();
        o.ban_chained_random = ban;
        af_partition *p = NULL;
        assert_int_equal(af_partition_min_cut(g, chain_roles, 1, &o, &p), AF_OK);
        check_partition(g, chain_roles, 1, p);
        assert_int_equal(p->n_saved, 1);
        assert_int_equal(p->saved[0], h2);
        assert_true(p->in_backward[af_graph_value(g, w)->producer] && p->in_backward[af_graph_value(g, w2)->producer]);
        af_partition_free(p);
        af_graph_free(g);
    }
}

/* A value the backward writes out anyway (y = exp(h) * m, read by the weight gradient's mm): saved
 * under AF_BAN_MATERIALIZED_ALL (functorch's rule), recomputed from h under the default
 * AF_BAN_MATERIALIZED_RANDOM where m is a plain input, saved there where m is random numbers (its
 * recompute would draw them again), recomputed under AF_BAN_MATERIALIZED_NONE either way. */
static void test_materialized_values_are_recomputed_unless_they_draw(void **state) {
    (void)state;
    assert_int_equal(af_partition_default_options().ban_materialized_bw, AF_BAN_MATERIALIZED_RANDOM);
    for (int random = 0; random < 2; random++)
        for (int mode = AF_BAN_MATERIALIZED_NONE; mode <= AF_BAN_MATERIALIZED_RANDOM; mode++) {
            af_graph *g = NULL;
            assert_int_equal(af_graph_new(&g), AF_OK);
            int32_t seed = input(g, "seed", 1), x = input(g, "x", 64), w = input(g, "w", 64), t = input(g, "t", 64);
            int32_t m = random ? add(g, "aotfuse::rng_uniform.default", seed, -1, 64) : w;
            int32_t h = add(g, "aten::mm.default", x, w, 64);
            int32_t y = add(g, "aten::mul.Tensor", add(g, "aten::exp.default", h, -1, 64), m, 64);
            int32_t out = add(g, "aten::mm.default", y, w, 64);
            int32_t gw = add(g, "aten::mm.default", t, y, 64);                            /* materializes y */
            int32_t gh = add(g, "aten::mul.Tensor", add(g, "aten::mul.Tensor", t, h, 64), m, 64); /* reads h */
            int32_t outs[3] = {out, gw, gh};
            assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
            uint8_t roles[4] = {AF_ROLE_FWD_SEED, AF_ROLE_PRIMAL, AF_ROLE_PARAM, AF_ROLE_TANGENT};
            af_partition_options o = af_partition_default_options();
            o.ban_materialized_bw = mode;
            af_partition *p = NULL;
            assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
            check_partition(g, roles, 1, p);
            int saved_y = 0, saved_h = 0;
            for (int32_t i = 0; i < p->n_saved; i++) {
                saved_y |= p->saved[i] == y;
                saved_h |= p->saved[i] == h;
            }
            int want_saved = mode == AF_BAN_MATERIALIZED_ALL || (mode == AF_BAN_MATERIALIZED_RANDOM && random);
            assert_int_equal(saved_y, want_saved);
            assert_true(saved_h); /* gh reads it: saved either way */
            assert_int_equal(p->in_backward[af_graph_value(g, y)->producer], !want_saved);
            af_partition_free(p);
            af_graph_free(g);
        }
    af_partition_options o = af_partition_default_options();
    o.ban_materialized_bw = 3;
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x = input(g, "x", 4), y = add(g, "aten::exp.default", x, -1, 4);
    assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);
    uint8_t roles[1] = {AF_ROLE_PRIMAL};
    af_partition *p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_ERR_INVALID);
    assert_null(p);
    af_graph_free(g);
}

/* A residual stream of pointwise adds, x_i = x_{i-1} + exp(mm(x_{i-1}, w_i)), each x_i read by the
 * next layer's weight gradient mm(t, x_i): the backward writes every x out anyway. Recomputing x_3
 * needs x_2, and x_2 needs x_1: without ban_chained_materialized the min cut saves the mm outputs
 * only and the backward rebuilds the whole stream before the last layer's gradient, holding x_1 from
 * there on. With it (the default) a recompute makes no x but its own: x_2 is saved, x_1 and x_3 are
 * recomputed, each from a saved or input value. With x_0 a sixteenth of the others' size (s0 = 4),
 * x_1 made first for x_2 costs little: only x_3 is saved. */
static void test_chained_materialized_values_are_saved(void **state) {
    (void)state;
    assert_int_equal(af_partition_default_options().ban_chained_materialized, 1);
    enum { L = 4 };
    for (int variant = 0; variant < 3; variant++) {
        int ban = variant > 0, s0 = variant == 2 ? 4 : 64; /* x_1 and the rest: s0 elements, then 64 */
        af_graph *g = NULL;
        assert_int_equal(af_graph_new(&g), AF_OK);
        int32_t x[L + 1], h[L + 1], w[L + 1];
        x[0] = input(g, "x", s0);
        for (int i = 1; i <= L; i++) w[i] = input(g, "w", i == 1 ? s0 : 64);
        int32_t t = input(g, "t", 64);
        for (int i = 1; i <= L; i++) {
            int64_t n = i == 1 ? s0 : 64;
            h[i] = add(g, "aten::mm.default", x[i - 1], w[i], n);
            x[i] = add(g, "aten::add.Tensor", x[i - 1], add(g, "aten::exp.default", h[i], -1, n), n);
        }
        int32_t outs[2 * L + 1], n_out = 0;
        outs[n_out++] = x[L];
        for (int i = L; i >= 1; i--) {
            int64_t n = i == 1 ? s0 : 64;
            outs[n_out++] = add(g, "aten::mm.default", t, x[i - 1], n); /* w_i's gradient */
            outs[n_out++] = add(g, "aten::mul.Tensor", t, add(g, "aten::exp.default", h[i], -1, n), n);
        }
        assert_int_equal(af_graph_set_outputs(g, outs, n_out), AF_OK);
        uint8_t roles[L + 2];
        roles[0] = AF_ROLE_PRIMAL;
        for (int i = 1; i <= L; i++) roles[i] = AF_ROLE_PARAM;
        roles[L + 1] = AF_ROLE_TANGENT;
        af_partition_options o = af_partition_default_options();
        o.ban_chained_materialized = ban;
        af_partition *p = NULL;
        assert_int_equal(af_partition_min_cut(g, roles, 1, &o, &p), AF_OK);
        check_partition(g, roles, 1, p);
        int saved[L + 1] = {0}, run = 0, longest = 0; /* the most x's one recompute makes */
        for (int32_t k = 0; k < p->n_saved; k++)
            for (int i = 1; i < L; i++) saved[i] |= p->saved[k] == x[i];
        for (int i = 1; i < L; i++) {
            run = p->in_backward[af_graph_value(g, x[i])->producer] ? run + 1 : 0;
            if (run > longest) longest = run;
        }
        if (variant == 1) {
            assert_int_equal(longest, 1); /* its own x only */
            for (int i = 1; i < L; i++) assert_int_equal(saved[i], i == 2);
        } else if (variant == 2) {
            assert_int_equal(longest, 2); /* x_2's recompute makes the small x_1 */
            for (int i = 1; i < L; i++) assert_int_equal(saved[i], i == 3);
        } else {
            assert_int_equal(longest, L - 1); /* the failure the ban prevents: the whole stream */
            assert_true(!saved[1] && !saved[2] && !saved[3]);
        }
        af_partition_free(p);
        af_graph_free(g);
    }
}

static int32_t position(const af_partition *p, const af_graph *g, int32_t value) {
    int32_t node = af_graph_value(g, value)->producer;
    for (int32_t i = 0; i < p->n_backward_order; i++)
        if (p->backward_order[i] == node) return i;
    fail_msg("value %d: its node is not in the backward order", (int)value);
    return -1;
}

/* In graph order the weight gradient mm(t, view(e)) comes before the pointwise work below it; in
 * the backward order it runs after that work (g1), with the view it reads through right before it,
 * and before the next matmul (m2), which it may not pass. A pointwise node reading it (g3, a shared
 * weight's gradients summed) moves with it, right after it. */
static void test_matmuls_sink_past_pointwise_work(void **state) {
    (void)state;
    for (int reader = 0; reader < 2; reader++) {
        af_graph *g = NULL;
        assert_int_equal(af_graph_new(&g), AF_OK);
        int32_t x = input(g, "x", 64), w = input(g, "w", 64), t = input(g, "t", 64);
        int32_t h = add(g, "aten::mm.default", x, w, 64);
        int32_t e = add(g, "aten::exp.default", h, -1, 64);
        int32_t out = add(g, "aten::mm.default", e, w, 64);
        int32_t tv = add(g, "aten::view.default", e, -1, 64);
        int32_t gw = add(g, "aten::mm.default", t, tv, 64);
        int32_t g1 = add(g, "aten::mul.Tensor", t, e, 64);
        int32_t g3 = reader ? add(g, "aten::add.Tensor", gw, g1, 64) : gw;
        int32_t m2 = add(g, "aten::mm.default", g1, w, 64);
        int32_t g2 = add(g, "aten::mul.Tensor", m2, h, 64);
        int32_t outs[3] = {out, g3, g2};
        assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
        uint8_t roles[3] = {AF_ROLE_PRIMAL, AF_ROLE_PARAM, AF_ROLE_TANGENT};
        af_partition *p = NULL;
        assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &p), AF_OK);
        check_partition(g, roles, 1, p);
        int32_t at_gw = position(p, g, gw);
        assert_int_equal(position(p, g, tv), at_gw - 1);
        assert_true(position(p, g, g1) < at_gw && at_gw < position(p, g, m2));
        if (reader) assert_int_equal(position(p, g, g3), at_gw + 1);
        af_partition_free(p);
        af_graph_free(g);
    }
}

/* The weight gradient mm(t, y), y = h * h recomputed from the saved h, also sinks below work that
 * reads h itself (g2 = g1 * h, a norm's gradient reading its saved input beside the norm's
 * recomputed output): one kernel may do both. In autograd's other order (sibling_after: the weight
 * gradient before the input gradient g1 = mm(t, w), its sibling reading the same t, as for a linear
 * layer without bias) it passes over that one matmul, which stays before it. Either way a second
 * matmul (m3) ends the scan: it stays before m3 and the work reading h after m3 (g4). */
static void test_matmuls_sink_past_work_sharing_a_saved_value(void **state) {
    (void)state;
    for (int sibling_after = 0; sibling_after < 2; sibling_after++) {
        af_graph *g = NULL;
        assert_int_equal(af_graph_new(&g), AF_OK);
        int32_t x = input(g, "x", 64), w = input(g, "w", 64), t = input(g, "t", 64);
        int32_t h = add(g, "aten::mm.default", x, w, 64);
        int32_t y = add(g, "aten::mul.Tensor", h, h, 64);
        int32_t out = add(g, "aten::mm.default", y, w, 64);
        int32_t g1 = sibling_after ? -1 : add(g, "aten::mm.default", t, w, 64);
        int32_t gw = add(g, "aten::mm.default", t, y, 64);
        if (sibling_after) g1 = add(g, "aten::mm.default", t, w, 64);
        int32_t g2 = add(g, "aten::mul.Tensor", g1, h, 64);
        int32_t m3 = add(g, "aten::mm.default", g2, w, 64);
        int32_t g4 = add(g, "aten::mul.Tensor", m3, h, 64);
        int32_t outs[3] = {out, gw, g4};
        assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
        uint8_t roles[3] = {AF_ROLE_PRIMAL, AF_ROLE_PARAM, AF_ROLE_TANGENT};
        af_partition *p = NULL;
        assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &p), AF_OK);
        check_partition(g, roles, 1, p);
        int saved_h = 0, saved_y = 0;
        for (int32_t i = 0; i < p->n_saved; i++) {
            saved_h |= p->saved[i] == h;
            saved_y |= p->saved[i] == y;
        }
        assert_true(saved_h && !saved_y); /* y recomputed from h */
        int32_t at_gw = position(p, g, gw);
        assert_true(position(p, g, y) < position(p, g, g2) && position(p, g, g1) < position(p, g, g2));
        assert_true(position(p, g, g2) < at_gw && at_gw < position(p, g, m3) && position(p, g, m3) < position(p, g, g4));
        af_partition_free(p);
        af_graph_free(g);
    }
}

/* A view that only matmuls read runs just before the first of them: here between a pointwise
 * value (a) and more pointwise work on it (b) in autograd's order, it would split that work into two
 * kernels. A view another pointwise node reads (v2, read by c) keeps its place, and so does a view
 * that is an output (v3). A view of such a view (vv) goes with it, after it. */
static void test_views_matmuls_read_run_just_before_them(void **state) {
    (void)state;
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x = input(g, "x", 64), w = input(g, "w", 64), t = input(g, "t", 64);
    int32_t h = add(g, "aten::mm.default", x, w, 64);
    int32_t out = add(g, "aten::exp.default", h, -1, 64);
    int32_t a = add(g, "aten::mul.Tensor", t, out, 64);
    int32_t v = add(g, "aten::view.default", a, -1, 64);
    int32_t vv = add(g, "aten::view.default", v, -1, 64);
    int32_t v2 = add(g, "aten::view.default", a, -1, 64);
    int32_t v3 = add(g, "aten::view.default", a, -1, 64);
    int32_t b = add(g, "aten::mul.Tensor", a, out, 64);
    int32_t c = add(g, "aten::add.Tensor", v2, b, 64);
    int32_t m = add(g, "aten::mm.default", vv, w, 64);
    int32_t gx = add(g, "aten::add.Tensor", m, c, 64);
    int32_t outs[3] = {out, gx, v3};
    assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
    uint8_t roles[3] = {AF_ROLE_PRIMAL, AF_ROLE_PARAM, AF_ROLE_TANGENT};
    af_partition *p = NULL;
    assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &p), AF_OK);
    check_partition(g, roles, 1, p);
    int32_t at_m = position(p, g, m);
    assert_int_equal(position(p, g, vv), at_m - 1);
    assert_int_equal(position(p, g, v), at_m - 2);
    assert_true(position(p, g, c) < position(p, g, v));
    assert_int_equal(position(p, g, v2), position(p, g, a) + 1);
    assert_int_equal(position(p, g, v3), position(p, g, a) + 2);
    assert_int_equal(position(p, g, b), position(p, g, v3) + 1);
    af_partition_free(p);
    af_graph_free(g);
}

static void test_bad_arguments(void **state) {
    (void)state;
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x = input(g, "x", 4);
    int32_t y = add(g, "aten::exp.default", x, -1, 4);
    assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);
    uint8_t roles[1] = {AF_ROLE_PRIMAL}, bad[1] = {99};
    af_partition *p = NULL;
    assert_int_equal(af_partition_min_cut(NULL, roles, 1, NULL, &p), AF_ERR_INVALID);
    assert_int_equal(af_partition_min_cut(g, roles, 2, NULL, &p), AF_ERR_INVALID);
    assert_int_equal(af_partition_min_cut(g, bad, 1, NULL, &p), AF_ERR_INVALID);
    assert_int_equal(af_partition_default(g, roles, -1, &p), AF_ERR_INVALID);
    assert_int_equal(af_partition_check(g, roles, 1, NULL), AF_ERR_INVALID);
    /* a forward-only graph: nothing to save */
    assert_int_equal(af_partition_min_cut(g, roles, 1, NULL, &p), AF_OK);
    assert_int_equal(p->n_saved, 0);
    assert_int_equal(p->n_backward_order, 0);
    af_partition_free(p);
    af_partition_free(NULL);
    af_graph_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_joint_graphs_are_split_validly),
        cmocka_unit_test(test_pointwise_chain_is_recomputed),
        cmocka_unit_test(test_unvectorized_libm_values_are_saved),
        cmocka_unit_test(test_parameters_are_free_to_save),
        cmocka_unit_test(test_banned_ops_are_saved),
        cmocka_unit_test(test_chained_random_values_are_saved),
        cmocka_unit_test(test_values_after_a_saved_chain_are_still_recomputed),
        cmocka_unit_test(test_multi_output_compute_node_is_not_rerun),
        cmocka_unit_test(test_materialized_values_are_recomputed_unless_they_draw),
        cmocka_unit_test(test_chained_materialized_values_are_saved),
        cmocka_unit_test(test_matmuls_sink_past_pointwise_work),
        cmocka_unit_test(test_matmuls_sink_past_work_sharing_a_saved_value),
        cmocka_unit_test(test_views_matmuls_read_run_just_before_them),
        cmocka_unit_test(test_node_policy_checkpointed_region),
        cmocka_unit_test(test_memory_budget_recomputes_matmuls),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests_name("partition", tests, NULL, NULL);
}
