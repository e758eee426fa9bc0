/* CMocka tests of kernel templates (csrc/templates.c, af_cg_share's literals, af_c_render): which
 * literals a body may take from af_n, and that a body compiled for one shape, found for another,
 * computes that shape's values. The kernels are compiled with the system C compiler into a
 * temporary cache folder; under valgrind (AOTFUSE_TEST_NO_RUN=1, set by `make valgrind`: the
 * kernels use the CPU's widest vectors, which valgrind cannot run) they are compiled and looked
 * up but not called. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "aotfuse/codegen.h"
#include "aotfuse/fuse.h"
#include "aotfuse/jit.h"
#include "aotfuse/templates.h"

/* Plain decimal literals in code are lifted; those in comments, preprocessor lines, array
 * lengths and indices, case labels, and floats, hex, octal and exponents are not. */
static void test_which_literals_are_lifted(void **state) {
    (void)state;
    const char *text = "\n/* group 3: 12 elements */\n"
                       "void af_kernel_3(char *const *p) {\n"
                       "  float c7[16];\n"
                       "  #pragma omp simd simdlen(8)\n"
                       "  for (af_idx i = 0; i < 12; i++) { q0[o0 + 5] = 1e-05f * 0x10 + 010 + 2.5 + c7[3] + c7[ 2 ]; }\n"
                       "  switch (x) { case 4: break; }\n"
                       "}\n";
    af_cg_shared sh;
    assert_int_equal(af_cg_share(text, 3, 0, &sh), AF_OK);
    assert_int_equal(sh.n_lits, 3);
    assert_int_equal(sh.lits[0], 0);
    assert_int_equal(sh.lits[1], 12);
    assert_int_equal(sh.lits[2], 5);
    assert_non_null(strstr(sh.key, "i = #; i < #; i++) { q0[o0 + #]"));
    assert_null(strstr(sh.key, "group")); /* comments are not part of the key */
    assert_non_null(strstr(sh.key, "simdlen(8)"));
    assert_non_null(strstr(sh.key, "[16]"));
    assert_non_null(strstr(sh.key, "1e-05f * 0x10 + 010 + 2.5"));
    assert_non_null(strstr(sh.key, "case 4:"));
    for (int32_t j = 0; j < sh.n_lits; j++) { /* each offset points at its literal in the text */
        char buf[24];
        snprintf(buf, sizeof buf, "%lld", (long long)sh.lits[j]);
        assert_memory_equal(sh.text + sh.lit_at[j], buf, strlen(buf));
    }
    /* the same kernel at another size has the same key and other values */
    af_cg_shared other;
    char *text2 = malloc(strlen(text) + 8);
    assert_non_null(text2);
    strcpy(text2, text);
    memcpy(strstr(text2, "i < 12"), "i < 99", 6);
    assert_int_equal(af_cg_share(text2, 3, 0, &other), AF_OK);
    assert_true(af_cg_same_skeleton(&sh, &other));
    assert_false(af_cg_same_key(&sh, &other));
    assert_int_equal(other.lits[1], 99);
    free(text2);
    af_cg_shared_free(&other);
    af_cg_shared_free(&sh);
}

/* A lifted literal keeps the C type it had: int, or int64_t past INT_MAX; the others stay text. */
static void test_lifted_literals_keep_their_type(void **state) {
    (void)state;
    const char *text = "void af_kernel_0(char *const *p) {\n  int64_t o = 3000000000 + 7 * i + 40;\n}\n";
    af_cg_shared sh;
    assert_int_equal(af_cg_share(text, 0, 0, &sh), AF_OK);
    assert_int_equal(sh.n_lits, 3);
    int32_t body_group = 0, body_of = 0, n_streams = 0;
    uint64_t streams[1][AF_MAX_KERNEL_STREAMS] = {{0}};
    af_c_kernels k = {.n_groups = 1, .n_bodies = 1, .bodies = &sh, .body_group = &body_group, .body_of = &body_of,
                      .n_streams = &n_streams, .streams = streams};
    uint8_t lift[3] = {1, 1, 0};
    const uint8_t *lifts[1] = {lift};
    char *src = NULL;
    assert_int_equal(af_c_render(&k, NULL, lifts, &src), AF_OK);
    assert_non_null(strstr(src, "int64_t o = ((int64_t)af_n[0]) + ((int)af_n[1]) * i + 40;"));
    /* the wrapper passes the values */
    assert_non_null(strstr(src, "static const int64_t n[3] = {3000000000, 7, 40}; af_body_0(p, NULL, n, af_num_threads);"));
    free(src);
    af_cg_shared_free(&sh);
}

/* y = x * 0.5 + bias, x [rows, cols], bias [cols] broadcast: one kernel. */
static af_graph *bias_graph(int64_t rows, int64_t cols) {
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int64_t s2[2] = {rows, cols}, t2[2] = {cols, 1}, s1[1] = {cols}, t1[1] = {1};
    af_tensor_meta m2 = {.type = AF_VALUE_TENSOR, .dtype = AF_DTYPE_FLOAT32, .device.index = -1, .ndim = 2, .sizes = s2, .strides = t2};
    af_tensor_meta m1 = {.type = AF_VALUE_TENSOR, .dtype = AF_DTYPE_FLOAT32, .device.index = -1, .ndim = 1, .sizes = s1, .strides = t1};
    int32_t x, bias, a, y;
    assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "bias", &m1, &bias), AF_OK);
    af_arg mul[2] = {{.kind = AF_ARG_VALUE, .u.value = x}, {.kind = AF_ARG_FLOAT, .u.f = 0.5}};
    assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", mul, 2, &m2, 1, &a), AF_OK);
    af_arg add[2] = {{.kind = AF_ARG_VALUE, .u.value = a}, {.kind = AF_ARG_VALUE, .u.value = bias}};
    assert_int_equal(af_graph_add_node(g, "aten::add.Tensor", add, 2, &m2, 1, &y), AF_OK);
    assert_int_equal(af_graph_set_outputs(g, &y, 1), AF_OK);
    return g;
}

typedef struct {
    af_graph *g;
    af_fusion_plan *plan;
    af_c_kernels *k;
    int64_t rows, cols;
} shape_kernels;

static void kernels_for(shape_kernels *s, int64_t rows, int64_t cols) {
    s->rows = rows;
    s->cols = cols;
    s->g = bias_graph(rows, cols);
    assert_int_equal(af_fuse_plan_new(s->g, NULL, &s->plan), AF_OK);
    assert_int_equal(s->plan->n_groups, 1);
    assert_int_equal(af_c_kernels_new(s->g, s->plan, &s->k), AF_OK);
    assert_int_equal(s->k->n_bodies, 1);
    assert_true(s->k->bodies[0].n_lits > 0);
}

static void kernels_free(shape_kernels *s) {
    af_c_kernels_free(s->k);
    af_fuse_plan_free(s->plan);
    af_graph_free(s->g);
}

/* Calls body fn with s's values and checks y = x * 0.5 + bias. */
static void check_runs(const shape_kernels *s, af_body_fn fn) {
    if (getenv("AOTFUSE_TEST_NO_RUN")) return;
    int64_t n = s->rows * s->cols;
    float *x = malloc((size_t)n * sizeof *x), *bias = malloc((size_t)s->cols * sizeof *bias), *y = calloc((size_t)n, sizeof *y);
    assert_true(x && bias && y);
    for (int64_t i = 0; i < n; i++) x[i] = (float)(i % 13) - 6.0f;
    for (int64_t c = 0; c < s->cols; c++) bias[c] = (float)c * 0.25f;
    const af_fusion_group *grp = &s->plan->groups[0];
    char *ptrs[3];
    for (int32_t k = 0; k < grp->n_inputs; k++) ptrs[k] = grp->inputs[k] == 0 ? (char *)x : (char *)bias;
    ptrs[grp->n_inputs] = (char *)y;
    fn(ptrs, NULL, s->k->bodies[0].lits, 1);
    for (int64_t i = 0; i < n; i++) assert_true(y[i] == x[i] * 0.5f + bias[i % s->cols]);
    free(x);
    free(bias);
    free(y);
}

/* Compiles s's body with the literals flagged in lift read from af_n; registers it. */
static af_jit_module *compile_and_add(const shape_kernels *s, const uint8_t *lift, af_body_fn *fn) {
    const uint8_t *lifts[1] = {lift};
    char *src = NULL, name[32];
    assert_int_equal(af_c_render(s->k, NULL, lifts, &src), AF_OK);
    af_jit_module *m = NULL;
    assert_int_equal(af_jit_cpu_load(src, &m, NULL), AF_OK);
    snprintf(name, sizeof name, "af_body_%d", (int)s->k->body_group[0]);
    *(void **)fn = af_jit_symbol(m, name);
    assert_non_null(*fn);
    assert_int_equal(af_tmpl_add(&s->k->bodies[0], lift, m, *fn), AF_OK);
    free(src);
    return m;
}

static void test_a_body_serves_other_shapes(void **state) {
    (void)state;
    char dir[] = "/tmp/aotfuse-ctest-XXXXXX";
    assert_non_null(mkdtemp(dir));
    setenv("AOTFUSE_CACHE_DIR", dir, 1);
    int32_t before = af_tmpl_count();
    shape_kernels a, b, c, d;
    af_body_fn fa, fb, found_fn = NULL;
    af_jit_module *found_m = NULL;
    int found = 0;
    /* first shape: nothing registered, nothing lifted */
    kernels_for(&a, 4, 40);
    uint8_t *lift_a = calloc((size_t)a.k->bodies[0].n_lits, 1);
    assert_non_null(lift_a);
    assert_int_equal(af_tmpl_find(&a.k->bodies[0], &found_fn, &found_m, lift_a, &found), AF_OK);
    assert_false(found);
    for (int32_t j = 0; j < a.k->bodies[0].n_lits; j++) assert_int_equal(lift_a[j], 0);
    af_jit_module *ma = compile_and_add(&a, lift_a, &fa);
    assert_int_equal(af_tmpl_count(), before + 1);
    check_runs(&a, fa);
    /* the same shape again: found as it is */
    kernels_for(&d, 4, 40);
    uint8_t *lift_d = calloc((size_t)d.k->bodies[0].n_lits, 1);
    assert_non_null(lift_d);
    assert_int_equal(af_tmpl_find(&d.k->bodies[0], &found_fn, &found_m, lift_d, &found), AF_OK);
    assert_true(found);
    assert_ptr_equal(found_fn, fa);
    assert_ptr_equal(found_m, ma);
    af_jit_module_free(found_m);
    kernels_free(&d);
    free(lift_d);
    /* more rows: a template, the literals that changed read from af_n, none of the columns' */
    kernels_for(&b, 6, 40);
    const af_cg_shared *bb = &b.k->bodies[0];
    assert_true(af_cg_same_skeleton(&a.k->bodies[0], bb));
    uint8_t *lift_b = calloc((size_t)bb->n_lits, 1);
    assert_non_null(lift_b);
    assert_int_equal(af_tmpl_find(bb, &found_fn, &found_m, lift_b, &found), AF_OK);
    assert_false(found);
    int lifted = 0;
    for (int32_t j = 0; j < bb->n_lits; j++) {
        assert_int_equal(lift_b[j], bb->lits[j] != a.k->bodies[0].lits[j]);
        lifted += lift_b[j];
        if (lift_b[j]) assert_true(bb->lits[j] != 40);
    }
    assert_true(lifted > 0);
    af_jit_module *mb = compile_and_add(&b, lift_b, &fb);
    check_runs(&b, fb);
    /* another row count: the template, called with its values */
    kernels_for(&c, 10, 40);
    uint8_t *lift_c = calloc((size_t)c.k->bodies[0].n_lits, 1);
    assert_non_null(lift_c);
    assert_int_equal(af_tmpl_find(&c.k->bodies[0], &found_fn, &found_m, lift_c, &found), AF_OK);
    assert_true(found);
    assert_ptr_equal(found_fn, fb);
    assert_ptr_equal(found_m, mb);
    check_runs(&c, found_fn);
    /* the template outlives its program's reference while another holds the module */
    af_jit_module_free(mb);
    assert_int_equal(af_tmpl_count(), before + 2);
    af_jit_module_free(found_m); /* the last reference: its entry goes */
    assert_int_equal(af_tmpl_count(), before + 1);
    assert_int_equal(af_tmpl_find(&c.k->bodies[0], &found_fn, &found_m, lift_c, &found), AF_OK);
    assert_false(found);
    af_jit_module_free(ma);
    assert_int_equal(af_tmpl_count(), before);
    free(lift_a);
    free(lift_b);
    free(lift_c);
    kernels_free(&a);
    kernels_free(&b);
    kernels_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_which_literals_are_lifted),
        cmocka_unit_test(test_lifted_literals_keep_their_type),
        cmocka_unit_test(test_a_body_serves_other_shapes),
    };
    return cmocka_run_group_tests_name("templates", tests, NULL, NULL);
}
