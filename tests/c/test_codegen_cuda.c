/* CMocka tests of csrc/codegen_cuda.c (and the device rules of csrc/fuse.c): which kernel shape
 * each CUDA group gets (pointwise with its vectorized variant, warp or block row reductions,
 * two-pass column reductions, phased row kernels for epilogues, split rows), that each backend emits only its own device's groups, and that a
 * missing NVRTC is a clear error. Runs under ASan+UBSan and valgrind like the others; NVRTC
 * itself is exercised by tests/test_cuda_codegen.py. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_util.h"

#include "aotfuse/codegen.h"
#include "aotfuse/fuse.h"
#include "aotfuse/jit_cuda.h"


static af_tensor_meta meta(const int64_t *sizes, const int64_t *strides, int nd, af_device_type dev) {
    af_tensor_meta m = {0};
    m.type = AF_VALUE_TENSOR;
    m.dtype = AF_DTYPE_FLOAT32;
    m.device.type = dev;
    m.device.index = dev == AF_DEVICE_CUDA ? 0 : -1;
    m.ndim = nd;
    m.sizes = sizes;
    m.strides = strides;
    return m;
}

static int32_t binary(af_graph *g, const char *op, int32_t a, int32_t b, const af_tensor_meta *out) {
    af_arg args[2] = {{.kind = AF_ARG_VALUE, .u.value = a}, {.kind = AF_ARG_VALUE, .u.value = b}};
    if (b < 0) args[1] = (af_arg){.kind = AF_ARG_FLOAT, .u.f = 0.5};
    int32_t v;
    assert_int_equal(af_graph_add_node(g, op, args, 2, out, 1, &v), AF_OK);
    return v;
}

static int32_t unary(af_graph *g, const char *op, int32_t a, const af_tensor_meta *out) {
    af_arg args[1] = {{.kind = AF_ARG_VALUE, .u.value = a}};
    int32_t v;
    assert_int_equal(af_graph_add_node(g, op, args, 1, out, 1, &v), AF_OK);
    return v;
}

static int32_t sum_dim(af_graph *g, int32_t a, int64_t dim, const af_tensor_meta *out) {
    af_arg d = {.kind = AF_ARG_INT, .u.i = dim};
    af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = a},
                      {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = &d}},
                      {.kind = AF_ARG_BOOL, .u.i = 0}};
    int32_t v;
    assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", args, 3, out, 1, &v), AF_OK);
    return v;
}

/* x[rows, cols] (and a bias[cols]) -> exp(x * 0.5 + bias), then `reduce`: -1 none, 0 or 1 a dim */
static af_graph *build(int64_t rows, int64_t cols, af_device_type dev, int reduce, int64_t *store) {
    int64_t *s2 = store, *t2 = store + 2, *s1 = store + 4, *t1 = store + 5, *r1 = store + 6, *rt = store + 7;
    s2[0] = rows, s2[1] = cols, t2[0] = cols, t2[1] = 1, s1[0] = cols, t1[0] = 1;
    *r1 = reduce == 0 ? cols : rows;
    *rt = 1;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m2 = meta(s2, t2, 2, dev), m1 = meta(s1, t1, 1, dev), mr = meta(r1, rt, 1, dev);
    int32_t x, bias;
    assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "bias", &m1, &bias), AF_OK);
    int32_t a = binary(g, "aten::mul.Tensor", x, -1, &m2);
    int32_t b = binary(g, "aten::add.Tensor", a, bias, &m2);
    int32_t c = unary(g, "aten::exp.default", b, &m2);
    int32_t out = reduce < 0 ? c : sum_dim(g, c, reduce, &mr);
    assert_int_equal(af_graph_set_outputs(g, &out, 1), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
    return g;
}

static char *generate(af_graph *g, af_cuda_launch *launch, int32_t *n_groups) {
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 1);
    *n_groups = plan->n_groups;
    char *src = NULL;
    assert_int_equal(af_codegen_cuda(g, plan, 132, &src, launch), AF_OK);
    af_fuse_plan_free(plan);
    return src;
}

/* x * rng_uniform(seed, stream), exp'd, then an mm: one CUDA group a layer */
static int32_t random_layer(af_graph *g, int32_t seed, int32_t in, int64_t stream, const char *op, const af_tensor_meta *m) {
    af_arg items[2] = {{.kind = AF_ARG_INT, .u.i = m->sizes[0]}, {.kind = AF_ARG_INT, .u.i = m->sizes[1]}};
    af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = seed}, {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = items}},
                      {.kind = AF_ARG_INT, .u.i = stream}};
    int32_t r, mm;
    assert_int_equal(af_graph_add_node(g, "aotfuse::rng_uniform.default", args, 3, m, 1, &r), AF_OK);
    int32_t e = unary(g, "aten::exp.default", binary(g, op, in, r, m), m);
    af_arg mm_args[2] = {{.kind = AF_ARG_VALUE, .u.value = e}, {.kind = AF_ARG_VALUE, .u.value = e}};
    assert_int_equal(af_graph_add_node(g, "aten::mm.default", mm_args, 2, m, 1, &mm), AF_OK);
    return mm;
}

/* Groups whose kernels differ only in node ids and dropout streams (a model's layers) launch the
 * first one's kernels, each with its own streams as by-value parameters; a group computing
 * something else keeps kernels of its own. */
static void test_repeated_groups_share_kernels_with_their_streams(void **state) {
    (void)state;
    int64_t s2[2] = {64, 64}, t2[2] = {64, 1};
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m = meta(s2, t2, 2, AF_DEVICE_CUDA);
    af_tensor_meta seed_m = {.type = AF_VALUE_TENSOR, .dtype = AF_DTYPE_INT64, .device = {.type = AF_DEVICE_CUDA, .index = 0}, .ndim = 0};
    int32_t seed, x;
    assert_int_equal(af_graph_add_input(g, "seed", &seed_m, &seed), AF_OK);
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);
    int32_t h = random_layer(g, seed, x, 1, "aten::mul.Tensor", &m);
    h = random_layer(g, seed, h, 2, "aten::mul.Tensor", &m);
    h = random_layer(g, seed, h, 3, "aten::add.Tensor", &m);
    assert_int_equal(af_graph_set_outputs(g, &h, 1), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 3);
    af_cuda_launch l[3];
    char *src = NULL;
    assert_int_equal(af_codegen_cuda(g, plan, 132, &src, l), AF_OK);
    assert_int_equal(l[0].body, 0);
    assert_int_equal(l[1].body, 0);
    assert_int_equal(l[2].body, 2);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(l[i].kind, AF_CUDA_POINTWISE);
        assert_int_equal(l[i].n_streams, 1);
        assert_int_equal(l[i].streams[0], (uint64_t)(i + 1));
    }
    assert_int_equal(count_of(src, "__global__"), 2); /* groups 0 and 2 (no vectorized variant: the seed is 0-dim) */
    assert_null(strstr(src, "af_kernel_1("));
    assert_non_null(strstr(src, "/* group 1: the kernels of group 0 */"));
    /* q1 (x) and q2 (its layout, written after it is read) may be one tensor: not restrict */
    assert_non_null(strstr(src, "af_kernel_0(const int64_t *__restrict__ q0, const float *q1, float *q2, "
                                "const unsigned long long af_s0) {"));
    assert_non_null(strstr(src, " + af_s0, iv"));
    assert_null(strstr(src, "ull, iv"));
    free(src);
    af_fuse_plan_free(plan);
    af_graph_free(g);
}

static void test_pointwise_gets_a_vectorized_variant(void **state) {
    (void)state;
    int64_t store[8];
    af_graph *g = build(64, 96, AF_DEVICE_CUDA, -1, store);
    af_cuda_launch l[1];
    int32_t n;
    char *src = generate(g, l, &n);
    assert_int_equal(l[0].kind, AF_CUDA_POINTWISE);
    assert_int_equal(l[0].threads, 256);
    assert_true(l[0].blocks == (64 * 96 + 255) / 256);
    assert_true(l[0].vec_blocks == (64 * 96 / 4 + 255) / 256);
    assert_non_null(strstr(src, "extern \"C\" __global__ void __launch_bounds__(256, 4) af_kernel_0("));
    assert_non_null(strstr(src, "af_kernel_0_v("));
    assert_non_null(strstr(src, "af_vec<float, 4>"));
    assert_non_null(strstr(src, "af_exp("));
    free(src);
    af_graph_free(g);
}

static void test_odd_inner_size_has_no_vector_variant(void **state) {
    (void)state;
    int64_t store[8];
    af_graph *g = build(5, 7, AF_DEVICE_CUDA, -1, store); /* 7 columns: a vector would cross rows */
    af_cuda_launch l[1];
    int32_t n;
    char *src = generate(g, l, &n);
    assert_int_equal(l[0].kind, AF_CUDA_POINTWISE);
    assert_true(l[0].vec_blocks == 0);
    assert_null(strstr(src, "_v("));
    free(src);
    af_graph_free(g);
}

static void test_row_reductions_use_a_warp_or_a_block(void **state) {
    (void)state;
    int64_t store[8];
    af_graph *g = build(64, 96, AF_DEVICE_CUDA, 1, store);
    af_cuda_launch l[1];
    int32_t n;
    char *src = generate(g, l, &n);
    assert_int_equal(l[0].kind, AF_CUDA_ROWS);
    assert_int_equal(l[0].threads, 256); /* 8 rows of one warp each */
    assert_true(l[0].blocks == 8);
    assert_non_null(strstr(src, "__shfl_xor_sync"));
    assert_null(strstr(src, "__syncthreads"));
    free(src);
    af_graph_free(g);

    g = build(3, 5000, AF_DEVICE_CUDA, 1, store); /* long rows: a block of 512 per row */
    src = generate(g, l, &n);
    assert_int_equal(l[0].kind, AF_CUDA_ROWS);
    assert_int_equal(l[0].threads, 512);
    assert_true(l[0].blocks == 3);
    assert_non_null(strstr(src, "__syncthreads"));
    free(src);
    af_graph_free(g);

    g = build(2, 100000, AF_DEVICE_CUDA, 1, store); /* too few rows to fill 132 SMs: each split into chunks */
    src = generate(g, l, &n);
    assert_int_equal(l[0].kind, AF_CUDA_SPLIT_ROWS);
    assert_int_equal(l[0].threads, 512);
    assert_true(l[0].blocks == 2);
    assert_true(l[0].split > 1 && l[0].split <= 100000 / 4096 + 1);
    assert_true(l[0].workspace == (int64_t)sizeof(double) * l[0].split * 2);
    assert_non_null(strstr(src, "split rows"));
    assert_non_null(strstr(src, "af_kernel_0_f(double *__restrict__ ws"));
    assert_null(strstr(src, "atomic"));
    free(src);
    af_graph_free(g);
}

static void test_column_reductions_are_two_deterministic_passes(void **state) {
    (void)state;
    int64_t store[8];
    af_graph *g = build(4096, 96, AF_DEVICE_CUDA, 0, store);
    af_cuda_launch l[1];
    int32_t n;
    char *src = generate(g, l, &n);
    assert_int_equal(l[0].kind, AF_CUDA_COLUMNS);
    assert_true(l[0].blocks == 3); /* 96 columns / 32 */
    assert_true(l[0].split > 1 && l[0].split <= 4096 / 64);
    assert_true(l[0].workspace == (int64_t)sizeof(double) * l[0].split * 96);
    assert_true(l[0].finish_blocks == 1);
    assert_non_null(strstr(src, "af_kernel_0(double *__restrict__ ws"));
    assert_non_null(strstr(src, "af_kernel_0_f(double *__restrict__ ws"));
    assert_null(strstr(src, "atomic"));
    free(src);
    af_graph_free(g);
}

static void test_each_backend_emits_only_its_device(void **state) {
    (void)state;
    int64_t store[8];
    af_graph *cpu = build(64, 96, AF_DEVICE_CPU, -1, store);
    af_cuda_launch l[1];
    int32_t n;
    char *src = generate(cpu, l, &n);
    assert_int_equal(l[0].kind, AF_CUDA_NONE);
    assert_null(strstr(src, "__global__ void"));
    free(src);
    af_graph_free(cpu);

    int64_t store2[8];
    af_graph *gpu = build(64, 96, AF_DEVICE_CUDA, -1, store2);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(gpu, NULL, &plan), AF_OK);
    assert_int_equal(plan->groups[0].device.type, AF_DEVICE_CUDA);
    char *c = NULL;
    assert_int_equal(af_codegen_c(gpu, plan, &c), AF_OK);
    assert_null(strstr(c, "void af_kernel_0("));
    free(c);
    af_fuse_plan_free(plan);
    /* a plan restricted to CPU kernels leaves the CUDA nodes to extern calls */
    af_fuse_options cpu_only = {.min_nodes = 2, .device_types = 1u << AF_DEVICE_CPU};
    assert_int_equal(af_fuse_plan_new(gpu, &cpu_only, &plan), AF_OK);
    assert_int_equal(plan->n_groups, 0);
    af_fuse_plan_free(plan);
    af_graph_free(gpu);
}

static void test_a_node_mixing_devices_is_not_fused(void **state) {
    (void)state;
    int64_t s[1] = {8}, t[1] = {1};
    af_tensor_meta gpu = meta(s, t, 1, AF_DEVICE_CUDA), cpu = meta(s, t, 1, AF_DEVICE_CPU);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, y;
    assert_int_equal(af_graph_add_input(g, "x", &gpu, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", &cpu, &y), AF_OK);
    binary(g, "aten::add.Tensor", x, y, &gpu);
    binary(g, "aten::mul.Tensor", x, -1, &gpu);
    assert_false(af_fuse_node_ok(g, 0)); /* reads a CPU tensor into a CUDA result */
    assert_true(af_fuse_node_ok(g, 1));
    af_graph_free(g);
}

/* exp(x) / sum(exp(x), -1, keepdim): the division reads its own group's row sum (an epilogue) */
static void test_epilogues_get_a_phased_row_kernel(void **state) {
    (void)state;
    for (int64_t cols = 96; cols <= 5000; cols += 4904) {
        int64_t s2[2] = {64, cols}, t2[2] = {cols, 1}, sr[2] = {64, 1}, tr[2] = {1, 1};
        af_tensor_meta m2 = meta(s2, t2, 2, AF_DEVICE_CUDA), mr = meta(sr, tr, 2, AF_DEVICE_CUDA);
        af_graph *g;
        assert_int_equal(af_graph_new(&g), AF_OK);
        int32_t x;
        assert_int_equal(af_graph_add_input(g, "x", &m2, &x), AF_OK);
        int32_t e = unary(g, "aten::exp.default", x, &m2);
        af_arg d = {.kind = AF_ARG_INT, .u.i = -1};
        af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = e},
                          {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = &d}},
                          {.kind = AF_ARG_BOOL, .u.i = 1}};
        int32_t sum;
        assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", args, 3, &mr, 1, &sum), AF_OK);
        int32_t out = binary(g, "aten::div.Tensor", e, sum, &m2);
        assert_int_equal(af_graph_set_outputs(g, &out, 1), AF_OK);
        assert_int_equal(af_graph_verify(g), AF_OK);
        af_cuda_launch l[1];
        int32_t n;
        char *src = generate(g, l, &n);
        assert_int_equal(l[0].kind, AF_CUDA_ROWS);
        assert_int_equal(l[0].threads, cols <= 2048 ? 256 : 512);
        assert_non_null(strstr(src, "2 phases)"));
        assert_non_null(strstr(src, "/* phase 1 */"));
        assert_non_null(strstr(src, "__shfl_xor_sync"));
        assert_true((strstr(src, "__syncthreads") != NULL) == (cols > 2048));
        free(src);
        af_graph_free(g);
    }
}

static void test_missing_nvrtc_is_a_clear_error(void **state) {
    (void)state;
    setenv("AOTFUSE_NVRTC", "/nonexistent/libnvrtc.so", 1);
    assert_int_equal(af_cuda_load(0), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_error_message(), "AOTFUSE_NVRTC"));
    char *image = NULL, *log = NULL;
    size_t size = 0;
    assert_int_equal(af_nvrtc_compile("extern \"C\" __global__ void k() {}", 90, 0, 0, &image, &size, &log), AF_ERR_UNSUPPORTED);
    assert_null(image);
    assert_null(log);
    unsetenv("AOTFUSE_NVRTC");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pointwise_gets_a_vectorized_variant),
        cmocka_unit_test(test_repeated_groups_share_kernels_with_their_streams),
        cmocka_unit_test(test_odd_inner_size_has_no_vector_variant),
        cmocka_unit_test(test_row_reductions_use_a_warp_or_a_block),
        cmocka_unit_test(test_column_reductions_are_two_deterministic_passes),
        cmocka_unit_test(test_each_backend_emits_only_its_device),
        cmocka_unit_test(test_a_node_mixing_devices_is_not_fused),
        cmocka_unit_test(test_epilogues_get_a_phased_row_kernel),
        cmocka_unit_test(test_missing_nvrtc_is_a_clear_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
