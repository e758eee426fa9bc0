/* CMocka tests of csrc/codegen_c.c's window kernels (the CPU backend): a pad's row is split into
 * parts where its guard changes (emit_parts), each part's guard written as a constant, so the
 * kernel drops AF_GUARDED_LOADS and ends each row with AF_ROW_END; a guard on one dim before the
 * row splits the rows in parts (emit_parts over rows), one comparison a row; a guard on a dim before the
 * row beside one along it is chosen after its loads (offset 0 where it fails); an empty input is
 * never loaded. The
 * values are checked against eager by tests/test_fusion.py; here the shape of the source, under
 * ASan+UBSan and valgrind like the other C tests. Also: a reduction over a strided dim runs
 * column-phased; one over N and the spatial dims nests its loops; a transposing pointwise kernel
 * walks its input's order. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <math.h>
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

/* g's C source (verified, fused, generated; g freed), its plan checked for n_groups groups where
 * n_groups > 0. */
static char *c_source(af_graph *g, int32_t n_groups) {
    assert_int_equal(af_graph_verify(g), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    if (n_groups > 0) assert_int_equal(plan->n_groups, n_groups);
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    af_fuse_plan_free(plan);
    af_graph_free(g);
    return src;
}

/* x[rows, cols] * 0.5, padded by pads (last dim first: left, right[, top, bottom]) with -1 */
static char *pad_source(int64_t rows, int64_t cols, const int64_t *pads, int n_pads) {
    int64_t in_sizes[2] = {rows, cols}, in_strides[2] = {cols, 1};
    int64_t out_sizes[2] = {rows + (n_pads > 2 ? pads[2] + pads[3] : 0), cols + pads[0] + pads[1]};
    int64_t out_strides[2] = {out_sizes[1], 1};
    af_tensor_meta mi = f32_cpu_meta(2, in_sizes, in_strides), mo = f32_cpu_meta(2, out_sizes, out_strides);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, h, p;
    assert_int_equal(af_graph_add_input(g, "x", &mi, &x), AF_OK);
    af_arg mul[2] = {{.kind = AF_ARG_VALUE, .u.value = x}, {.kind = AF_ARG_FLOAT, .u.f = 0.5}};
    assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", mul, 2, &mi, 1, &h), AF_OK);
    af_arg items[4];
    for (int i = 0; i < n_pads; i++) items[i] = (af_arg){.kind = AF_ARG_INT, .u.i = pads[i]};
    af_arg pad[3] = {{.kind = AF_ARG_VALUE, .u.value = h},
                     {.kind = AF_ARG_LIST, .u.list = {.n = n_pads, .items = items}},
                     {.kind = AF_ARG_FLOAT, .u.f = -1.0}};
    assert_int_equal(af_graph_add_node(g, "aten::constant_pad_nd.default", pad, 3, &mo, 1, &p), AF_OK);
    assert_int_equal(af_graph_set_outputs(g, &p, 1), AF_OK);
    return c_source(g, 1); /* the mul computed inside the pad's guard */
}

static void test_a_padded_row_is_split_where_its_guard_changes(void **state) {
    (void)state;
    int64_t pads[2] = {3, 5};
    char *src = pad_source(4, 37, pads, 2);
    assert_non_null(strstr(src, "for (af_idx i = 0; i < 3; i++)"));
    assert_non_null(strstr(src, "for (af_idx i = 3; i < 40; i++)"));
    assert_non_null(strstr(src, "for (af_idx i = 40; i < 45; i++)"));
    assert_int_equal(count_of(src, "outside its source"), 2); /* the pads: the fill alone */
    assert_null(strstr(src, "AF_GUARDED_LOADS void"));
    assert_null(strstr(src, "AF_GUARDED_LOADS AF_BODY"));
    assert_int_equal(count_of(src, "AF_ROW_END;"), 1);
    free(src);
}

static void test_a_guard_the_row_does_not_move_splits_the_rows(void **state) {
    (void)state;
    int64_t pads[4] = {0, 0, 2, 1}; /* rows only: the rows in three parts, one comparison a row */
    char *src = pad_source(6, 37, pads, 4);
    assert_int_equal(count_of(src, "for (af_idx i = 0; i < 37; i++)"), 3);
    assert_non_null(strstr(src, "if (b2 < 2) {")); /* b2: the coordinate operand, after x and the output */
    assert_non_null(strstr(src, "} else if (b2 < 8) {"));
    assert_int_equal(count_of(src, "outside its source"), 2); /* the padded rows: the fill alone */
    assert_int_equal(count_of(src, "aten::mul.Tensor"), 1);   /* the source in the inside's part only */
    assert_null(strstr(src, "chosen after its loads"));
    assert_null(strstr(src, "AF_GUARDED_LOADS void"));
    assert_null(strstr(src, "AF_GUARDED_LOADS AF_BODY"));
    assert_int_equal(count_of(src, "AF_ROW_END;"), 1);
    free(src);
}

static void test_both_dims_padded_split_the_row_and_choose_the_rows(void **state) {
    (void)state;
    int64_t pads[4] = {2, 2, 2, 1}; /* the shape GCC 12 miscompiled without AF_ROW_END */
    char *src = pad_source(6, 4, pads, 4);
    assert_non_null(strstr(src, "for (af_idx i = 0; i < 2; i++)"));
    assert_non_null(strstr(src, "for (af_idx i = 2; i < 6; i++)"));
    assert_non_null(strstr(src, "for (af_idx i = 6; i < 8; i++)"));
    assert_int_equal(count_of(src, "chosen after its loads"), 1);
    assert_int_equal(count_of(src, "AF_ROW_END;"), 1);
    free(src);
}

static void test_an_empty_input_keeps_its_guarded_loads_as_branches(void **state) {
    (void)state;
    int64_t pads[4] = {0, 0, 2, 1}; /* a pad of a [0, 37] value: offset 0 is no element */
    char *src = pad_source(0, 37, pads, 4);
    assert_null(strstr(src, "chosen after its loads"));
    assert_null(strstr(src, "q0[")); /* its rows in parts: every row the fill, the input never read */
    int64_t both[4] = {1, 0, 2, 1}; /* padded along the row too: the row split, the rows' guard a branch */
    char *src2 = pad_source(0, 37, both, 4);
    assert_null(strstr(src2, "chosen after its loads"));
    assert_non_null(strstr(src2, "AF_GUARDED_LOADS"));
    free(src);
    free(src2);
}

/* where(c, x, s) for each scalar s over a 16-bit x: the value needs no rounding where s is a value
 * of x's type (then it is x's element or s), and is rounded where it is not. */
static void check_where_rounding(af_dtype dtype, const double *scalars, const int *exact, int n) {
    static const int64_t sizes[2] = {4, 40}, strides[2] = {40, 1};
    af_tensor_meta mx = f32_cpu_meta(2, sizes, strides), mc = mx;
    mx.dtype = dtype;
    mc.dtype = AF_DTYPE_BOOL;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t c, x, outs[8];
    assert_int_equal(af_graph_add_input(g, "c", &mc, &c), AF_OK);
    assert_int_equal(af_graph_add_input(g, "x", &mx, &x), AF_OK);
    for (int k = 0; k < n; k++) {
        af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = c}, {.kind = AF_ARG_VALUE, .u.value = x},
                          {.kind = AF_ARG_FLOAT, .u.f = scalars[k]}};
        assert_int_equal(af_graph_add_node(g, "aten::where.self", args, 3, &mx, 1, &outs[k]), AF_OK);
    }
    assert_int_equal(af_graph_set_outputs(g, outs, n), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
    af_fusion_plan *plan;
    assert_int_equal(af_fuse_plan_new(g, NULL, &plan), AF_OK);
    char *src = NULL;
    assert_int_equal(af_codegen_c(g, plan, &src), AF_OK);
    for (int k = 0; k < n; k++) {
        char line[64];
        snprintf(line, sizeof line, "v%d = af_%s_round(v%d);", (int)outs[k], dtype == AF_DTYPE_BFLOAT16 ? "bf16" : "f16",
                 (int)outs[k]);
        if (exact[k]) assert_null(strstr(src, line));
        else assert_non_null(strstr(src, line));
    }
    free(src);
    af_fuse_plan_free(plan);
    af_graph_free(g);
}

static void test_a_16_bit_selection_of_16_bit_values_is_not_rounded_again(void **state) {
    (void)state;
    /* bf16: -inf, 0.5 and 3 * 2^100 are values; 0.1, 1 + 2^-8 (9 significant bits) are not */
    const double bf[5] = {-INFINITY, 0.5, 3.0 * 0x1p100, 0.1, 1.0 + 0x1p-8};
    const int bf_exact[5] = {1, 1, 1, 0, 0};
    check_where_rounding(AF_DTYPE_BFLOAT16, bf, bf_exact, 5);
    /* f16: 65504 and 2^-24 (its least subnormal) and 1 + 2^-10 are values; 65536, 2^-25, 3 * 2^-24 + 2^-25 are not */
    const double h[6] = {65504.0, 0x1p-24, 1.0 + 0x1p-10, 65536.0, 0x1p-25, 3.0 * 0x1p-24 + 0x1p-25};
    const int h_exact[6] = {1, 1, 1, 0, 0, 0};
    check_where_rounding(AF_DTYPE_FLOAT16, h, h_exact, 6);
}

/* exp(x) / sum(exp(x), -1, keepdim) over x[8, 64, 32] laid out with the given strides: a softmax over
 * the last dim, which fuse.c makes one phased kernel (the division an epilogue). Returns the C. */
static char *softmax_source(const int64_t *strides) {
    static const int64_t sizes[3] = {8, 64, 32}, rsizes[3] = {8, 64, 1}, rstrides[3] = {64, 1, 1};
    af_tensor_meta mx = f32_cpu_meta(3, sizes, strides), mr = f32_cpu_meta(3, rsizes, rstrides);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, e, sum, out;
    assert_int_equal(af_graph_add_input(g, "x", &mx, &x), AF_OK);
    af_arg one = {.kind = AF_ARG_VALUE, .u.value = x};
    assert_int_equal(af_graph_add_node(g, "aten::exp.default", &one, 1, &mx, 1, &e), AF_OK);
    af_arg d = {.kind = AF_ARG_INT, .u.i = -1};
    af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = e},
                      {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = &d}},
                      {.kind = AF_ARG_BOOL, .u.i = 1}};
    assert_int_equal(af_graph_add_node(g, "aten::sum.dim_IntList", args, 3, &mr, 1, &sum), AF_OK);
    af_arg div[2] = {{.kind = AF_ARG_VALUE, .u.value = e}, {.kind = AF_ARG_VALUE, .u.value = sum}};
    assert_int_equal(af_graph_add_node(g, "aten::div.Tensor", div, 2, &mx, 1, &out), AF_OK);
    assert_int_equal(af_graph_set_outputs(g, &out, 1), AF_OK);
    return c_source(g, 1); /* one phased kernel: the sum, then the division */
}

/* exp(x - amax(m, -1, keepdim)) over x[8, 32] and m (x itself, or another input y), then
 * exp(-(x * x)) or exp(x * -0.5): the C. */
static char *shifted_exp_source(int amax_of_x, int square) {
    static const int64_t sizes[2] = {8, 32}, strides[2] = {32, 1}, rsizes[2] = {8, 1}, rstrides[2] = {1, 1};
    af_tensor_meta mx = f32_cpu_meta(2, sizes, strides), mr = f32_cpu_meta(2, rsizes, rstrides);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, y, mxv, sh, e, sq, ng, e2;
    assert_int_equal(af_graph_add_input(g, "x", &mx, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", &mx, &y), AF_OK);
    af_arg d = {.kind = AF_ARG_INT, .u.i = -1};
    af_arg am[3] = {{.kind = AF_ARG_VALUE, .u.value = amax_of_x ? x : y},
                    {.kind = AF_ARG_LIST, .u.list = {.n = 1, .items = &d}},
                    {.kind = AF_ARG_BOOL, .u.i = 1}};
    assert_int_equal(af_graph_add_node(g, "aten::amax.default", am, 3, &mr, 1, &mxv), AF_OK);
    af_arg sub[2] = {{.kind = AF_ARG_VALUE, .u.value = x}, {.kind = AF_ARG_VALUE, .u.value = mxv}};
    assert_int_equal(af_graph_add_node(g, "aten::sub.Tensor", sub, 2, &mx, 1, &sh), AF_OK);
    af_arg one = {.kind = AF_ARG_VALUE, .u.value = sh};
    assert_int_equal(af_graph_add_node(g, "aten::exp.default", &one, 1, &mx, 1, &e), AF_OK);
    af_arg mul[2] = {{.kind = AF_ARG_VALUE, .u.value = x}, {.kind = AF_ARG_VALUE, .u.value = x}};
    if (!square) mul[1] = (af_arg){.kind = AF_ARG_FLOAT, .u.f = -0.5};
    assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", mul, 2, &mx, 1, &sq), AF_OK);
    af_arg neg = {.kind = AF_ARG_VALUE, .u.value = sq};
    if (square) assert_int_equal(af_graph_add_node(g, "aten::neg.default", &neg, 1, &mx, 1, &ng), AF_OK);
    af_arg two = {.kind = AF_ARG_VALUE, .u.value = square ? ng : sq};
    assert_int_equal(af_graph_add_node(g, "aten::exp.default", &two, 1, &mx, 1, &e2), AF_OK);
    int32_t outs[2] = {e, e2};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    return c_source(g, 0);
}

/* exp of an argument never above 0 calls af_exp_nonpos (a softmax's x - amax(x), keepdim; a negated
 * square), any other af_exp: x - amax(y) may be positive, and so may x * -0.5. */
static void test_an_exp_of_a_nonpositive_argument_takes_the_cheaper_exp(void **state) {
    (void)state;
    char *src = shifted_exp_source(1, 1);
    assert_true(count_of(src, "= af_exp_nonpos(v") >= 2); /* each exp, in each phase that computes it */
    assert_null(strstr(src, "= af_exp(v"));
    free(src);
    src = shifted_exp_source(0, 0);
    assert_null(strstr(src, "= af_exp_nonpos(v"));
    assert_true(count_of(src, "= af_exp(v") >= 2);
    free(src);
}

/* A phased kernel whose operands are contiguous along a kept dim (dim 1) and strided along the
 * reduced one (a transposed input: Swin's patch-embedding layer norm) runs column-phased: the block's
 * columns in the inner loop at stride 1, each column's row sum in an array its phase end fills and
 * the division's phase reads (cv<id>); with the reduced dim contiguous it stays a row kernel, and so it
 * does under AOTFUSE_COLUMN_PHASED=0. */
static void test_a_softmax_over_a_strided_dim_runs_column_phased(void **state) {
    (void)state;
    static const int64_t transposed[3] = {2048, 1, 64}, contiguous[3] = {2048, 32, 1};
    char *src = softmax_source(transposed);
    assert_non_null(strstr(src, "column-phased"));
    assert_non_null(strstr(src, "af_idx o0 = r0 + c * 1;"));
    assert_non_null(strstr(src, "/* phase 1 */"));
    assert_non_null(strstr(src, "float cv"));
    free(src);
    src = softmax_source(contiguous);
    assert_null(strstr(src, "column-phased"));
    assert_non_null(strstr(src, "/* phase 1 */"));
    free(src);
    setenv("AOTFUSE_COLUMN_PHASED", "0", 1);
    src = softmax_source(transposed);
    unsetenv("AOTFUSE_COLUMN_PHASED");
    assert_null(strstr(src, "column-phased"));
    free(src);
}

/* x[n, c, hw] (NCHW flattened) - its mean over dims 0 and 2 (a batch norm's centring): one phased
 * kernel per channel whose reduced loops are nested where the run (hw) is at least 16, each chunk
 * inside one run with its offsets unflattened once (`i0 = i1`, `ob0`) and stepped along it; a run
 * shorter than that keeps the flat loop (a division and remainder per element). */
static char *centring_source(int64_t n, int64_t c, int64_t hw) {
    int64_t sizes[3] = {n, c, hw}, strides[3] = {c * hw, hw, 1}, msizes[3] = {1, c, 1}, mstrides[3] = {c, 1, 1};
    af_tensor_meta mx = f32_cpu_meta(3, sizes, strides), mm = f32_cpu_meta(3, msizes, mstrides);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, mean, out;
    assert_int_equal(af_graph_add_input(g, "x", &mx, &x), AF_OK);
    af_arg dims[2] = {{.kind = AF_ARG_INT, .u.i = 0}, {.kind = AF_ARG_INT, .u.i = 2}};
    af_arg args[3] = {{.kind = AF_ARG_VALUE, .u.value = x},
                      {.kind = AF_ARG_LIST, .u.list = {.n = 2, .items = dims}},
                      {.kind = AF_ARG_BOOL, .u.i = 1}};
    assert_int_equal(af_graph_add_node(g, "aten::mean.dim", args, 3, &mm, 1, &mean), AF_OK);
    af_arg sub[2] = {{.kind = AF_ARG_VALUE, .u.value = x}, {.kind = AF_ARG_VALUE, .u.value = mean}};
    assert_int_equal(af_graph_add_node(g, "aten::sub.Tensor", sub, 2, &mx, 1, &out), AF_OK);
    assert_int_equal(af_graph_set_outputs(g, &out, 1), AF_OK);
    return c_source(g, 1);
}

static void test_a_reduction_over_n_and_the_spatial_dims_nests_its_loops(void **state) {
    (void)state;
    char *src = centring_source(16, 8, 1024);
    assert_non_null(strstr(src, "for (af_idx i0 = 0, i1 = 0; i0 < 16384; i0 = i1) {"));
    assert_non_null(strstr(src, "i1 = i0 + 1024 - i0 % 1024;"));
    assert_non_null(strstr(src, "af_idx o0 = ob0 + (i - i0) * 1;"));
    assert_null(strstr(src, "af_idx s = i;"));
    free(src);
    src = centring_source(16, 8, 9); /* a 3 x 3 map: flat */
    assert_null(strstr(src, "i0 = i1"));
    assert_non_null(strstr(src, "af_idx s = i;"));
    free(src);
}

/* relu(x * w) with x [N, C, HW] contiguous, w [1, C, 1] and the output channels-last (strides
 * [HW C, 1, C]): at HW = 1024 the loops walk x's order (the inner loop reads x at stride 1 and
 * stores at a stride of C), not the output's (which read x at a far stride, 1024: ResNet's stem);
 * at HW = 64 (a near stride) they keep the output's. */
static char *transposing_source(int64_t hw) {
    int64_t sizes[3] = {4, 32, hw}, xs[3] = {32 * hw, hw, 1}, os[3] = {32 * hw, 1, 32}, ws[3] = {32, 1, 1}, wsz[3] = {1, 32, 1};
    af_tensor_meta mx = f32_cpu_meta(3, sizes, xs), mo = f32_cpu_meta(3, sizes, os), mw = f32_cpu_meta(3, wsz, ws);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, w, y, r;
    assert_int_equal(af_graph_add_input(g, "x", &mx, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "w", &mw, &w), AF_OK);
    af_arg mul[2] = {{.kind = AF_ARG_VALUE, .u.value = x}, {.kind = AF_ARG_VALUE, .u.value = w}};
    assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", mul, 2, &mx, 1, &y), AF_OK);
    af_arg one = {.kind = AF_ARG_VALUE, .u.value = y};
    assert_int_equal(af_graph_add_node(g, "aten::relu.default", &one, 1, &mo, 1, &r), AF_OK);
    assert_int_equal(af_graph_set_outputs(g, &r, 1), AF_OK);
    return c_source(g, 1);
}

static void test_a_transposing_pointwise_kernel_walks_its_input_where_it_is_far(void **state) {
    (void)state;
    char *src = transposing_source(1024);
    assert_non_null(strstr(src, "af_idx o0 = b0 + i * 1;"));  /* x */
    assert_non_null(strstr(src, "af_idx o2 = b2 + i * 32;")); /* the channels-last output */
    free(src);
    src = transposing_source(64);
    /* x read at a stride of 64 floats (256 bytes, a power of two): from a variable GCC cannot see
     * through, so that the loop vectorizes with gathers (AF_OPAQUE) */
    assert_non_null(strstr(src, "af_idx af_st0 = 64; AF_OPAQUE(af_st0);"));
    assert_non_null(strstr(src, "af_idx o0 = b0 + i * af_st0;"));
    assert_non_null(strstr(src, "af_idx o2 = b2 + i * 1;"));
    free(src);
}

/* x * w (x [N, C, HW] contiguous, HW = 256) both as a channels-last relu and as an NCHW product:
 * the first output's order (channels-last) reads x and stores the product at a stride of 256, a
 * gather and a scatter an element; x's order stores the channels-last copy at a stride of 32
 * alone, and is taken (ConvNeXt's channels-first layer norm: 0.44 -> 0.09 ms in bf16). Before, a
 * near load cost nothing and the two orders tied. */
static void test_a_gather_and_a_scatter_cost_more_than_one_scatter(void **state) {
    (void)state;
    int64_t sizes[3] = {4, 32, 256}, xs[3] = {32 * 256, 256, 1}, os[3] = {32 * 256, 1, 32}, ws[3] = {32, 1, 1}, wsz[3] = {1, 32, 1};
    af_tensor_meta mx = f32_cpu_meta(3, sizes, xs), mo = f32_cpu_meta(3, sizes, os), mw = f32_cpu_meta(3, wsz, ws);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, w, y, out[2];
    assert_int_equal(af_graph_add_input(g, "x", &mx, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "w", &mw, &w), AF_OK);
    af_arg mul[2] = {{.kind = AF_ARG_VALUE, .u.value = x}, {.kind = AF_ARG_VALUE, .u.value = w}};
    assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", mul, 2, &mx, 1, &y), AF_OK);
    af_arg one = {.kind = AF_ARG_VALUE, .u.value = y};
    assert_int_equal(af_graph_add_node(g, "aten::relu.default", &one, 1, &mo, 1, &out[0]), AF_OK);
    af_arg twice[2] = {{.kind = AF_ARG_VALUE, .u.value = y}, {.kind = AF_ARG_FLOAT, .u.f = 2.0}};
    assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", twice, 2, &mx, 1, &out[1]), AF_OK);
    assert_int_equal(af_graph_set_outputs(g, out, 2), AF_OK);
    char *src = c_source(g, 1);
    assert_non_null(strstr(src, "af_idx o0 = b0 + i * 1;"));  /* x */
    assert_non_null(strstr(src, "af_idx o2 = b2 + i * 32;")); /* the channels-last relu */
    assert_non_null(strstr(src, "af_idx o3 = b3 + i * 1;"));  /* the NCHW product */
    free(src);
}

/* relu(x) of x [8, 512, 768] into its transpose's layout (strides [512 768, 1, 512]): far both
 * ways (a load at 768 or a store at 512), a tie, so the output's order stays (the seed models'
 * hidden-state transposes: 3.9 ms that way, 8.9 ms in the input's). */
static void test_a_transpose_far_both_ways_keeps_its_outputs_order(void **state) {
    (void)state;
    int64_t sizes[3] = {8, 512, 768}, xs[3] = {512 * 768, 768, 1}, os[3] = {512 * 768, 1, 512};
    af_tensor_meta mx = f32_cpu_meta(3, sizes, xs), mo = f32_cpu_meta(3, sizes, os);
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    int32_t x, r;
    assert_int_equal(af_graph_add_input(g, "x", &mx, &x), AF_OK);
    af_arg one = {.kind = AF_ARG_VALUE, .u.value = x};
    assert_int_equal(af_graph_add_node(g, "aten::relu.default", &one, 1, &mo, 1, &r), AF_OK);
    assert_int_equal(af_graph_set_outputs(g, &r, 1), AF_OK);
    char *src = c_source(g, 0);
    assert_non_null(strstr(src, "af_idx o0 = b0 + i * 768;"));
    assert_non_null(strstr(src, "af_idx o1 = b1 + i * 1;"));
    free(src);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_softmax_over_a_strided_dim_runs_column_phased),
        cmocka_unit_test(test_an_exp_of_a_nonpositive_argument_takes_the_cheaper_exp),
        cmocka_unit_test(test_a_reduction_over_n_and_the_spatial_dims_nests_its_loops),
        cmocka_unit_test(test_a_transposing_pointwise_kernel_walks_its_input_where_it_is_far),
        cmocka_unit_test(test_a_transpose_far_both_ways_keeps_its_outputs_order),
        cmocka_unit_test(test_a_gather_and_a_scatter_cost_more_than_one_scatter),
        cmocka_unit_test(test_a_padded_row_is_split_where_its_guard_changes),
        cmocka_unit_test(test_a_guard_the_row_does_not_move_splits_the_rows),
        cmocka_unit_test(test_both_dims_padded_split_the_row_and_choose_the_rows),
        cmocka_unit_test(test_an_empty_input_keeps_its_guarded_loads_as_branches),
        cmocka_unit_test(test_a_16_bit_selection_of_16_bit_values_is_not_rounded_again),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
