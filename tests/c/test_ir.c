/* CMocka unit tests for the IR stage: csrc/ir.c, csrc/ops.c, csrc/status.c.
 *
 * Build and run with tests/c/Makefile:
 *   make check       ASan + UBSan (+ LeakSanitizer where the sandbox allows it)
 *   make valgrind    plain build under valgrind --leak-check=full
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "aotfuse/ir.h"
#include "aotfuse/ops.h"
#include "aotfuse/status.h"

/* ------------------------------------------------------------------------------------------ */
/* helpers                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static const int64_t SIZES_4x8[2] = {4, 8};
static const int64_t STRIDES_4x8[2] = {8, 1};
static const int64_t SIZES_4[1] = {4};
static const int64_t STRIDES_4[1] = {1};

static af_tensor_meta meta_tensor(af_dtype dtype, int32_t ndim, const int64_t *sizes, const int64_t *strides) {
    af_tensor_meta m;
    memset(&m, 0, sizeof m);
    m.type = AF_VALUE_TENSOR;
    m.dtype = dtype;
    m.device.type = AF_DEVICE_CPU;
    m.device.index = -1;
    m.ndim = ndim;
    m.sizes = sizes;
    m.strides = strides;
    m.storage_offset = 0;
    return m;
}

static af_tensor_meta meta_f32_4x8(void) { return meta_tensor(AF_DTYPE_FLOAT32, 2, SIZES_4x8, STRIDES_4x8); }
static af_tensor_meta meta_f32_4(void) { return meta_tensor(AF_DTYPE_FLOAT32, 1, SIZES_4, STRIDES_4); }

static af_tensor_meta meta_other(void) {
    af_tensor_meta m;
    memset(&m, 0, sizeof m);
    m.type = AF_VALUE_OTHER;
    return m;
}

static af_arg arg_value(int32_t id) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = AF_ARG_VALUE;
    a.u.value = id;
    return a;
}
static af_arg arg_int(int64_t i) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = AF_ARG_INT;
    a.u.i = i;
    return a;
}
static af_arg arg_bool(int b) {
    af_arg a = arg_int(b);
    a.kind = AF_ARG_BOOL;
    return a;
}
static af_arg arg_float(double f) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = AF_ARG_FLOAT;
    a.u.f = f;
    return a;
}
static af_arg arg_none(void) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = AF_ARG_NONE;
    return a;
}
static af_arg arg_str_kind(af_arg_kind kind, const char *s) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = kind;
    a.u.s = s;
    return a;
}
static af_arg arg_dtype(af_dtype d) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = AF_ARG_DTYPE;
    a.u.dtype = d;
    return a;
}
static af_arg arg_device(af_device_type t, int32_t index) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = AF_ARG_DEVICE;
    a.u.device.type = t;
    a.u.device.index = index;
    return a;
}
static af_arg arg_list(int32_t n, af_arg *items) {
    af_arg a;
    memset(&a, 0, sizeof a);
    a.kind = AF_ARG_LIST;
    a.u.list.n = n;
    a.u.list.items = items;
    return a;
}
static af_arg kw(const char *name, af_arg a) {
    a.name = name;
    return a;
}

typedef struct {
    int32_t inputs, values, nodes, outputs;
} graph_counts;

static graph_counts counts_of(const af_graph *g) {
    graph_counts c = {af_graph_num_inputs(g), af_graph_num_values(g), af_graph_num_nodes(g),
                      af_graph_num_outputs(g)};
    return c;
}

static void check_counts(const af_graph *g, graph_counts want, const char *file, int line) {
    graph_counts got = counts_of(g);
    _assert_int_equal(got.inputs, want.inputs, file, line);
    _assert_int_equal(got.values, want.values, file, line);
    _assert_int_equal(got.nodes, want.nodes, file, line);
    _assert_int_equal(got.outputs, want.outputs, file, line);
}

static void check_error_message(const char *part, const char *file, int line) {
    const char *msg = af_error_message();
    _assert_true(msg != NULL, "af_error_message() != NULL", file, line);
    if (msg[0] == '\0') print_error("empty error message\n");
    _assert_true(msg[0] != '\0', "error message is non-empty", file, line);
    if (part && !strstr(msg, part)) print_error("error message '%s' lacks '%s'\n", msg, part);
    _assert_true(!part || strstr(msg, part) != NULL, "error message contains the expected text", file, line);
}

/* An add_node that must be rejected with AF_ERR_INVALID, a message (containing msg_part when
 * given), no output id written, the graph unchanged and still valid. */
static void check_node_rejected(af_graph *g, const char *op, const af_arg *args, int32_t n_args,
                                const af_tensor_meta *metas, int32_t n_outputs, const char *msg_part,
                                const char *file, int line) {
    graph_counts before = counts_of(g);
    int32_t first = -12345;
    af_error_clear();
    int st = af_graph_add_node(g, op, args, n_args, metas, n_outputs, &first);
    _assert_int_equal(st, AF_ERR_INVALID, file, line);
    _assert_int_equal(first, -12345, file, line);
    check_error_message(msg_part, file, line);
    check_counts(g, before, file, line);
    _assert_int_equal(af_graph_verify(g), AF_OK, file, line);
}
#define assert_node_rejected(g, op, args, n_args, metas, n_outputs, msg_part) \
    check_node_rejected((g), (op), (args), (n_args), (metas), (n_outputs), (msg_part), __FILE__, __LINE__)

static void check_input_rejected(af_graph *g, const char *name, const af_tensor_meta *meta, const char *msg_part,
                                 const char *file, int line) {
    graph_counts before = counts_of(g);
    int32_t id = -12345;
    af_error_clear();
    int st = af_graph_add_input(g, name, meta, &id);
    _assert_int_equal(st, AF_ERR_INVALID, file, line);
    _assert_int_equal(id, -12345, file, line);
    check_error_message(msg_part, file, line);
    check_counts(g, before, file, line);
    _assert_int_equal(af_graph_verify(g), AF_OK, file, line);
}
#define assert_input_rejected(g, name, meta, msg_part) \
    check_input_rejected((g), (name), (meta), (msg_part), __FILE__, __LINE__)

/* A status that must be AF_ERR_INVALID with a non-empty message. */
#define assert_invalid(expr)                                    \
    do {                                                        \
        af_error_clear();                                       \
        int st_ = (expr);                                       \
        assert_int_equal(st_, AF_ERR_INVALID);                  \
        check_error_message(NULL, __FILE__, __LINE__);          \
    } while (0)

#define assert_contains(haystack, needle)                                                         \
    do {                                                                                          \
        const char *h_ = (haystack), *n_ = (needle);                                              \
        if (!strstr(h_, n_)) print_error("text:\n%s\n---\ndoes not contain '%s'\n", h_, n_);      \
        assert_non_null(strstr(h_, n_));                                                          \
    } while (0)

static int count_char(const char *s, char c) {
    int n = 0;
    for (; *s; s++) n += (*s == c);
    return n;
}

/* Fixture: a fresh empty graph in *state, freed afterwards (also when an assertion fails). */
static int graph_setup(void **state) {
    af_graph *g = NULL;
    if (af_graph_new(&g) != AF_OK || !g) return -1;
    *state = g;
    return 0;
}
static int graph_teardown(void **state) {
    af_graph_free(*state);
    *state = NULL;
    return 0;
}

/* Fixture: x, y: f32[4, 8]; v2 = aten::add.Tensor(x, y, alpha=1); outputs (v2). */
static int small_graph_setup(void **state) {
    if (graph_setup(state)) return -1;
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    int32_t x, y, out;
    if (af_graph_add_input(g, "x", &m, &x) || af_graph_add_input(g, "y", &m, &y)) return -1;
    af_arg args[3] = {arg_value(x), arg_value(y), kw("alpha", arg_int(1))};
    if (af_graph_add_node(g, "aten::add.Tensor", args, 3, &m, 1, &out)) return -1;
    if (af_graph_set_outputs(g, &out, 1)) return -1;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* building, verifying and printing a valid graph                                               */
/* ------------------------------------------------------------------------------------------ */

static void test_small_graph_print_exact(void **state) {
    af_graph *g = *state;
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text = NULL;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_non_null(text);
    assert_string_equal(text,
                        "graph(%x: f32[4, 8], %y: f32[4, 8]):\n"
                        "  %v2: f32[4, 8] = aten::add.Tensor(%x, %y, alpha=1)  # pointwise\n"
                        "  return (%v2)\n");
    free(text);
}

static void test_valid_graph_full(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    int32_t x = -1, y = -1;
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", &m, &y), AF_OK);
    assert_int_equal(x, 0);
    assert_int_equal(y, 1);

    /* add.Tensor(x, y, *, alpha=1) */
    af_arg add_args[3] = {arg_value(x), arg_value(y), kw("alpha", arg_int(1))};
    int32_t sum = -1;
    assert_int_equal(af_graph_add_node(g, "aten::add.Tensor", add_args, 3, &m, 1, &sum), AF_OK);
    assert_int_equal(sum, 2);

    /* var_mean.correction(sum, [1], *, correction=0, keepdim=False) -> (var, mean) */
    af_arg dims[1] = {arg_int(1)};
    af_arg vm_args[4] = {arg_value(sum), arg_list(1, dims), kw("correction", arg_int(0)), kw("keepdim", arg_bool(0))};
    af_tensor_meta vm_metas[2] = {meta_f32_4(), meta_f32_4()};
    int32_t var = -1;
    assert_int_equal(af_graph_add_node(g, "aten::var_mean.correction", vm_args, 4, vm_metas, 2, &var), AF_OK);
    assert_int_equal(var, 3);
    int32_t mean = var + 1;

    /* view(sum, [32, -1]) and index.Tensor(sum, [[%x, None]]) style list arguments */
    af_arg shape[2] = {arg_int(32), arg_int(-1)};
    af_arg view_args[2] = {arg_value(sum), arg_list(2, shape)};
    static const int64_t sizes_32x1[2] = {32, 1}, strides_32x1[2] = {1, 1};
    af_tensor_meta view_meta = meta_tensor(AF_DTYPE_FLOAT32, 2, sizes_32x1, strides_32x1);
    int32_t viewed = -1;
    assert_int_equal(af_graph_add_node(g, "aten::view.default", view_args, 2, &view_meta, 1, &viewed), AF_OK);

    af_arg inner[2] = {arg_value(x), arg_none()};
    af_arg outer[2] = {arg_list(2, inner), arg_int(7)};
    af_arg idx_args[2] = {arg_value(y), arg_list(2, outer)};
    int32_t indexed = -1;
    assert_int_equal(af_graph_add_node(g, "aten::index.Tensor", idx_args, 2, &m, 1, &indexed), AF_OK);

    /* every scalar kind, on an op the table does not know (an extern) */
    af_arg mixed[9] = {
        arg_value(mean),
        arg_float(0.5),
        arg_bool(1),
        arg_str_kind(AF_ARG_STR, "tanh"),
        kw("dtype", arg_dtype(AF_DTYPE_FLOAT16)),
        kw("device", arg_device(AF_DEVICE_CUDA, 0)),
        kw("layout", arg_str_kind(AF_ARG_LAYOUT, "strided")),
        kw("memory_format", arg_str_kind(AF_ARG_MEMORY_FORMAT, "contiguous_format")),
        kw("empty", arg_list(0, NULL)),
    };
    af_tensor_meta half_cuda = meta_tensor(AF_DTYPE_FLOAT16, 1, SIZES_4, STRIDES_4);
    half_cuda.device.type = AF_DEVICE_CUDA;
    half_cuda.device.index = 0;
    int32_t ext = -1;
    assert_int_equal(af_graph_add_node(g, "mylib::fancy.default", mixed, 9, &half_cuda, 1, &ext), AF_OK);

    int32_t outs[4] = {sum, var, ext, indexed};
    assert_int_equal(af_graph_set_outputs(g, outs, 4), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);

    char *text = NULL;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_non_null(text);
    assert_contains(text, "graph(%x: f32[4, 8], %y: f32[4, 8]):\n");
    assert_contains(text, "aten::add.Tensor");
    assert_contains(text, "f32[4, 8]");
    assert_contains(text, "aten::add.Tensor(%x, %y, alpha=1)  # pointwise");
    assert_contains(text, "%v3: f32[4], %v4: f32[4] = aten::var_mean.correction(%v2, [1], correction=0, keepdim=False)"
                          "  # reduction");
    assert_contains(text, "= aten::view.default(%v2, [32, -1])  # view");
    assert_contains(text, "aten::index.Tensor(%y, [[%x, None], 7])");
    assert_contains(text, "%v7: f16[4]@cuda:0 = mylib::fancy.default(%v4, 0.5, True, 'tanh', dtype=torch.float16, "
                          "device=device(cuda:0), layout=torch.strided, memory_format=torch.contiguous_format, "
                          "empty=[])\n");
    assert_contains(text, "return (%v2, %v3, %v7, %v6)");
    assert_contains(text, "return (");
    /* the extern has no kind comment */
    assert_null(strstr(text, "empty=[])  #"));
    /* one line per node plus header and return */
    assert_int_equal(count_char(text, '\n'), af_graph_num_nodes(g) + 2);
    free(text);

    /* accessors on this graph */
    assert_int_equal(af_graph_num_inputs(g), 2);
    assert_int_equal(af_graph_num_values(g), 8);
    assert_int_equal(af_graph_num_nodes(g), 5);
    assert_int_equal(af_graph_num_outputs(g), 4);
    assert_int_equal(af_graph_input(g, 0), x);
    assert_int_equal(af_graph_input(g, 1), y);
    assert_int_equal(af_graph_output(g, 2), ext);

    const af_node *vm = af_graph_node(g, 1);
    assert_non_null(vm);
    assert_string_equal(vm->op, "aten::var_mean.correction");
    assert_int_equal(vm->op_id, AF_OP_VAR_MEAN);
    assert_int_equal(af_op_get(vm->op_id)->kind, AF_KIND_REDUCTION);
    assert_int_equal(vm->n_outputs, 2);
    assert_int_equal(vm->first_output, var);
    assert_int_equal(vm->n_args, 4);
    assert_int_equal(vm->args[1].kind, AF_ARG_LIST);
    assert_int_equal(vm->args[1].u.list.n, 1);
    assert_int_equal(vm->args[1].u.list.items[0].u.i, 1);
    assert_string_equal(vm->args[2].name, "correction");
    for (int32_t o = 0; o < 2; o++) {
        const af_value *v = af_graph_value(g, var + o);
        assert_non_null(v);
        assert_int_equal(v->producer, 1);
        assert_int_equal(v->out_index, o);
        assert_int_equal(v->meta.ndim, 1);
        assert_int_equal(v->meta.sizes[0], 4);
    }

    const af_node *fancy = af_graph_node(g, 4);
    assert_int_equal(fancy->op_id, AF_OP_UNKNOWN);
    assert_int_equal(fancy->args[1].kind, AF_ARG_FLOAT);
    assert_true(fancy->args[1].u.f == 0.5);
    assert_string_equal(fancy->args[3].u.s, "tanh");
    assert_null(fancy->args[3].name);
    assert_int_equal(fancy->args[4].u.dtype, AF_DTYPE_FLOAT16);
    assert_int_equal(fancy->args[5].u.device.type, AF_DEVICE_CUDA);
    assert_int_equal(fancy->args[5].u.device.index, 0);
    assert_int_equal(fancy->args[8].u.list.n, 0);

    const af_node *idx = af_graph_node(g, 3);
    const af_arg *l = &idx->args[1];
    assert_int_equal(l->u.list.n, 2);
    assert_int_equal(l->u.list.items[0].kind, AF_ARG_LIST);
    assert_int_equal(l->u.list.items[0].u.list.items[0].u.value, x);
    assert_int_equal(l->u.list.items[0].u.list.items[1].kind, AF_ARG_NONE);
}

static void test_empty_graph(void **state) {
    af_graph *g = *state;
    assert_int_equal(af_graph_num_inputs(g), 0);
    assert_int_equal(af_graph_num_values(g), 0);
    assert_int_equal(af_graph_num_nodes(g), 0);
    assert_int_equal(af_graph_num_outputs(g), 0);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text = NULL;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_string_equal(text, "graph():\n  return ()\n");
    free(text);
    assert_int_equal(af_graph_set_outputs(g, NULL, 0), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
}

static void test_builders_deep_copy(void **state) {
    af_graph *g = *state;
    int64_t sizes[2] = {4, 8}, strides[2] = {8, 1};
    af_tensor_meta m = meta_tensor(AF_DTYPE_FLOAT32, 2, sizes, strides);
    char name[8] = "inp";
    int32_t x;
    assert_int_equal(af_graph_add_input(g, name, &m, &x), AF_OK);

    char op[32] = "aten::gelu.default";
    char approx[8] = "tanh";
    char kwname[16] = "approximate";
    char item_str[8] = "abc";
    af_arg items[2] = {arg_int(3), arg_str_kind(AF_ARG_STR, item_str)};
    af_arg args[3] = {arg_value(x), kw(kwname, arg_str_kind(AF_ARG_STR, approx)), kw("extra", arg_list(2, items))};
    int32_t out;
    assert_int_equal(af_graph_add_node(g, op, args, 3, &m, 1, &out), AF_OK);

    /* scribble over everything the caller handed in */
    memset(name, 'Z', sizeof name - 1);
    memset(op, 'Z', sizeof op - 1);
    memset(approx, 'Z', sizeof approx - 1);
    memset(kwname, 'Z', sizeof kwname - 1);
    memset(item_str, 'Z', sizeof item_str - 1);
    sizes[0] = sizes[1] = 99;
    strides[0] = strides[1] = 99;
    items[0].u.i = 99;
    args[0].u.value = 99;

    assert_string_equal(af_graph_value(g, x)->name, "inp");
    assert_int_equal(af_graph_value(g, x)->meta.sizes[0], 4);
    assert_int_equal(af_graph_value(g, x)->meta.strides[0], 8);
    assert_int_equal(af_graph_value(g, out)->meta.sizes[1], 8);
    const af_node *n = af_graph_node(g, 0);
    assert_string_equal(n->op, "aten::gelu.default");
    assert_int_equal(n->op_id, AF_OP_GELU);
    assert_int_equal(n->args[0].u.value, x);
    assert_string_equal(n->args[1].name, "approximate");
    assert_string_equal(n->args[1].u.s, "tanh");
    assert_true(n->args[2].u.list.items != items);
    assert_int_equal(n->args[2].u.list.items[0].u.i, 3);
    assert_string_equal(n->args[2].u.list.items[1].u.s, "abc");
    assert_true(n->args[1].u.s != approx);
    assert_int_equal(af_graph_verify(g), AF_OK);

    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_contains(text, "%v1: f32[4, 8] = aten::gelu.default(%inp, approximate='tanh', extra=[3, 'abc'])  # pointwise");
    free(text);
}

static void test_print_meta_variants(void **state) {
    af_graph *g = *state;
    static const int64_t sz[2] = {4, 8}, st_t[2] = {1, 4};
    static const int64_t sz1[3] = {1, 4, 1}, st1[3] = {99, 1, 77}; /* size-1 dims: strides do not matter */
    static const int64_t sz0[1] = {0}, st0[1] = {1};
    af_tensor_meta transposed = meta_tensor(AF_DTYPE_FLOAT64, 2, sz, st_t);
    af_tensor_meta ones = meta_tensor(AF_DTYPE_BFLOAT16, 3, sz1, st1);
    af_tensor_meta scalar = meta_tensor(AF_DTYPE_INT64, 0, NULL, NULL);
    af_tensor_meta empty = meta_tensor(AF_DTYPE_BOOL, 1, sz0, st0);
    af_tensor_meta meta_dev = meta_tensor(AF_DTYPE_COMPLEX128, 0, NULL, NULL);
    meta_dev.device.type = AF_DEVICE_META;
    meta_dev.device.index = -1;
    af_tensor_meta cuda = meta_tensor(AF_DTYPE_UINT8, 1, sz0, st0);
    cuda.device.type = AF_DEVICE_CUDA;
    cuda.device.index = 3;
    af_tensor_meta offset = meta_tensor(AF_DTYPE_INT8, 2, SIZES_4x8, STRIDES_4x8);
    offset.storage_offset = 5;
    int32_t id;
    assert_int_equal(af_graph_add_input(g, "t", &transposed, &id), AF_OK);
    assert_int_equal(af_graph_add_input(g, "o", &ones, &id), AF_OK);
    assert_int_equal(af_graph_add_input(g, "s", &scalar, &id), AF_OK);
    assert_int_equal(af_graph_add_input(g, "e", &empty, &id), AF_OK);
    assert_int_equal(af_graph_add_input(g, "m", &meta_dev, &id), AF_OK);
    assert_int_equal(af_graph_add_input(g, "c", &cuda, &id), AF_OK);
    assert_int_equal(af_graph_add_input(g, "off", &offset, &id), AF_OK);
    assert_int_equal(af_graph_value(g, id)->meta.storage_offset, 5);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_string_equal(text,
                        "graph(%t: f64[4, 8]{1, 4}, %o: bf16[1, 4, 1], %s: i64[], %e: b8[0], %m: c128[]@meta, "
                        "%c: u8[0]@cuda:3, %off: i8[4, 8]):\n"
                        "  return ()\n");
    free(text);
}

static void test_auto_names_and_unique_inputs(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    int32_t a, b;
    assert_int_equal(af_graph_add_input(g, NULL, &m, &a), AF_OK);
    assert_int_equal(af_graph_add_input(g, "", &m, &b), AF_OK);
    assert_string_equal(af_graph_value(g, a)->name, "v0");
    assert_string_equal(af_graph_value(g, b)->name, "v1");
    assert_int_equal(af_graph_value(g, a)->producer, -1);
    assert_int_equal(af_graph_value(g, a)->out_index, 0);
}

static void test_inputs_after_nodes(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    int32_t x, r, y, s;
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);
    af_arg a1[1] = {arg_value(x)};
    assert_int_equal(af_graph_add_node(g, "aten::relu.default", a1, 1, &m, 1, &r), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", &m, &y), AF_OK);
    assert_int_equal(y, 2);
    af_arg a2[2] = {arg_value(r), arg_value(y)};
    assert_int_equal(af_graph_add_node(g, "aten::mul.Tensor", a2, 2, &m, 1, &s), AF_OK);
    assert_int_equal(af_graph_num_inputs(g), 2);
    assert_int_equal(af_graph_input(g, 1), y);
    assert_int_equal(af_graph_value(g, s)->producer, 1);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_contains(text, "graph(%x: f32[4, 8], %y: f32[4, 8]):\n");
    assert_contains(text, "%v3: f32[4, 8] = aten::mul.Tensor(%v1, %y)  # pointwise");
    free(text);
}

static void test_many_outputs_one_node(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4();
    int32_t x;
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);
    enum { N = 100 }; /* more than the initial table capacity in one add_node */
    af_tensor_meta metas[N];
    for (int i = 0; i < N; i++) metas[i] = (i % 3 == 2) ? meta_other() : m;
    af_arg args[2] = {arg_value(x), arg_int(N)};
    int32_t first;
    assert_int_equal(af_graph_add_node(g, "aten::split.Tensor", args, 2, metas, N, &first), AF_OK);
    assert_int_equal(first, 1);
    assert_int_equal(af_graph_num_values(g), N + 1);
    for (int i = 0; i < N; i++) {
        const af_value *v = af_graph_value(g, first + i);
        assert_int_equal(v->producer, 0);
        assert_int_equal(v->out_index, i);
        assert_int_equal(v->meta.type, (i % 3 == 2) ? AF_VALUE_OTHER : AF_VALUE_TENSOR);
    }
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_contains(text, "%v1: f32[4], %v2: f32[4], %v3: other, %v4: f32[4]");
    free(text);
}

/* ------------------------------------------------------------------------------------------ */
/* non-tensor values and outputs that are inputs                                                */
/* ------------------------------------------------------------------------------------------ */

static void test_other_value_output(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    int32_t x;
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);

    /* an "other" carries nothing: junk in its tensor fields is ignored and dropped */
    af_tensor_meta junk = meta_other();
    junk.dtype = (af_dtype)77;
    junk.device.type = (af_device_type)9;
    junk.ndim = 99;
    junk.sizes = NULL;
    junk.strides = NULL;
    af_tensor_meta metas[2] = {m, junk};
    af_arg args[1] = {arg_value(x)};
    int32_t first;
    assert_int_equal(af_graph_add_node(g, "aten::native_layer_norm_backward.default", args, 1, metas, 2, &first),
                     AF_OK);
    const af_value *other = af_graph_value(g, first + 1);
    assert_int_equal(other->meta.type, AF_VALUE_OTHER);
    assert_int_equal(other->meta.ndim, 0);
    assert_null(other->meta.sizes);
    assert_null(other->meta.strides);
    assert_int_equal(af_tensor_meta_nbytes(&other->meta), 0);

    int32_t outs[2] = {first + 1, first};
    assert_int_equal(af_graph_set_outputs(g, outs, 2), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_contains(text, "%v1: f32[4, 8], %v2: other = aten::native_layer_norm_backward.default(%x)\n");
    assert_contains(text, "return (%v2, %v1)");
    free(text);

    /* an "other" input */
    int32_t o;
    assert_int_equal(af_graph_add_input(g, "opaque", &junk, &o), AF_OK);
    af_arg uses_other[2] = {arg_value(x), arg_value(o)};
    int32_t r;
    assert_int_equal(af_graph_add_node(g, "aten::relu.default", uses_other, 2, &m, 1, &r), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
}

static void test_output_is_input(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    int32_t x, y;
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", &m, &y), AF_OK);
    int32_t outs[3] = {y, x, y};
    assert_int_equal(af_graph_set_outputs(g, outs, 3), AF_OK);
    outs[0] = 12345; /* copied, not kept */
    assert_int_equal(af_graph_num_outputs(g), 3);
    assert_int_equal(af_graph_output(g, 0), y);
    assert_int_equal(af_graph_output(g, 1), x);
    assert_int_equal(af_graph_output(g, 2), y);
    assert_int_equal(af_graph_output(g, 3), -1);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_string_equal(text, "graph(%x: f32[4, 8], %y: f32[4, 8]):\n  return (%y, %x, %y)\n");
    free(text);

    /* outputs can be replaced, and cleared */
    assert_int_equal(af_graph_set_outputs(g, &x, 1), AF_OK);
    assert_int_equal(af_graph_num_outputs(g), 1);
    assert_int_equal(af_graph_set_outputs(g, NULL, 0), AF_OK);
    assert_int_equal(af_graph_num_outputs(g), 0);
    assert_int_equal(af_graph_output(g, 0), -1);
    assert_int_equal(af_graph_verify(g), AF_OK);
}

/* ------------------------------------------------------------------------------------------ */
/* accessors, op table, names                                                                   */
/* ------------------------------------------------------------------------------------------ */

static void test_accessors(void **state) {
    af_graph *g = *state; /* the small graph */
    assert_int_equal(af_graph_num_inputs(g), 2);
    assert_int_equal(af_graph_num_values(g), 3);
    assert_int_equal(af_graph_num_nodes(g), 1);
    assert_int_equal(af_graph_num_outputs(g), 1);

    const af_value *x = af_graph_value(g, 0);
    assert_non_null(x);
    assert_string_equal(x->name, "x");
    assert_int_equal(x->producer, -1);
    assert_int_equal(x->meta.type, AF_VALUE_TENSOR);
    assert_int_equal(x->meta.dtype, AF_DTYPE_FLOAT32);
    assert_int_equal(x->meta.device.type, AF_DEVICE_CPU);
    assert_int_equal(x->meta.ndim, 2);
    assert_int_equal(x->meta.sizes[0], 4);
    assert_int_equal(x->meta.sizes[1], 8);
    assert_int_equal(x->meta.strides[0], 8);
    assert_int_equal(x->meta.strides[1], 1);
    assert_true(x->meta.sizes != SIZES_4x8);

    const af_value *v = af_graph_value(g, 2);
    assert_non_null(v);
    assert_string_equal(v->name, "v2");
    assert_int_equal(v->producer, 0);
    assert_int_equal(v->out_index, 0);

    const af_node *n = af_graph_node(g, 0);
    assert_non_null(n);
    assert_string_equal(n->op, "aten::add.Tensor");
    assert_int_equal(n->op_id, AF_OP_ADD);
    assert_int_equal(n->op_id, af_op_lookup("aten::add.Tensor"));
    assert_string_equal(af_op_get(n->op_id)->name, "aten::add");
    assert_int_equal(af_op_get(n->op_id)->kind, AF_KIND_POINTWISE);
    assert_string_equal(af_op_kind_name(af_op_get(n->op_id)->kind), "pointwise");
    assert_int_equal(n->n_args, 3);
    assert_int_equal(n->args[0].kind, AF_ARG_VALUE);
    assert_int_equal(n->args[0].u.value, 0);
    assert_null(n->args[0].name);
    assert_int_equal(n->args[1].u.value, 1);
    assert_int_equal(n->args[2].kind, AF_ARG_INT);
    assert_string_equal(n->args[2].name, "alpha");
    assert_int_equal(n->args[2].u.i, 1);
    assert_int_equal(n->n_outputs, 1);
    assert_int_equal(n->first_output, 2);

    assert_int_equal(af_graph_input(g, 0), 0);
    assert_int_equal(af_graph_input(g, 1), 1);
    assert_int_equal(af_graph_output(g, 0), 2);

    /* out of range */
    assert_null(af_graph_value(g, -1));
    assert_null(af_graph_value(g, 3));
    assert_null(af_graph_value(g, INT32_MAX));
    assert_null(af_graph_value(g, INT32_MIN));
    assert_null(af_graph_node(g, -1));
    assert_null(af_graph_node(g, 1));
    assert_int_equal(af_graph_input(g, -1), -1);
    assert_int_equal(af_graph_input(g, 2), -1);
    assert_int_equal(af_graph_output(g, -1), -1);
    assert_int_equal(af_graph_output(g, 1), -1);
}

static void test_op_table(void **state) {
    (void)state;
    assert_int_equal(af_op_lookup("aten::add.Tensor"), AF_OP_ADD);
    assert_int_equal(af_op_lookup("aten::add"), AF_OP_ADD);
    assert_int_equal(af_op_lookup("aten::add.Scalar"), AF_OP_ADD);
    assert_int_equal(af_op_lookup("aten::addmm.default"), AF_OP_ADDMM);
    assert_int_equal(af_op_lookup("aten::var_mean.correction"), AF_OP_VAR_MEAN);
    assert_int_equal(af_op_lookup("aten::var.correction"), AF_OP_VAR);
    assert_int_equal(af_op_lookup("prims::convert_element_type.default"), AF_OP_CONVERT_ELEMENT_TYPE);
    assert_int_equal(af_op_lookup("aten::view.default"), AF_OP_VIEW);
    assert_int_equal(af_op_lookup("aten::native_dropout.default"), AF_OP_NATIVE_DROPOUT);
    assert_int_equal(af_op_lookup("aten::mm.default"), AF_OP_MM);

    /* unknown names, prefixes and near misses */
    assert_int_equal(af_op_lookup("aten::frobnicate.default"), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup("aten::ad"), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup("aten::add_"), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup("aten::addx.Tensor"), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup("add"), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup("aten::"), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup(""), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup("."), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup(NULL), AF_OP_UNKNOWN);
    assert_int_equal(af_op_lookup("extern"), AF_OP_UNKNOWN);

    /* every entry: a unique name that looks itself up, with and without an overload */
    for (int i = 1; i < AF_OP_COUNT; i++) {
        const af_op_info *info = af_op_get((af_op_id)i);
        assert_non_null(info);
        assert_non_null(info->name);
        assert_non_null(strstr(info->name, "::"));
        assert_null(strchr(info->name, '.'));
        assert_int_equal(af_op_lookup(info->name), i);
        char buf[128];
        snprintf(buf, sizeof buf, "%s.default", info->name);
        assert_int_equal(af_op_lookup(buf), i);
        assert_true((int)info->kind >= 0 && (int)info->kind < (int)AF_KIND_COUNT);
        assert_string_not_equal(af_op_kind_name(info->kind), "invalid");
    }

    /* the extern entry, and out-of-range ids */
    const af_op_info *ext = af_op_get(AF_OP_UNKNOWN);
    assert_non_null(ext);
    assert_int_equal(ext->kind, AF_KIND_EXTERN);
    assert_ptr_equal(af_op_get((af_op_id)-1), ext);
    assert_ptr_equal(af_op_get(AF_OP_COUNT), ext);
    assert_ptr_equal(af_op_get((af_op_id)100000), ext);

    /* kinds */
    assert_int_equal(af_op_get(AF_OP_SUM)->kind, AF_KIND_REDUCTION);
    assert_int_equal(af_op_get(AF_OP_PERMUTE)->kind, AF_KIND_VIEW);
    assert_int_equal(af_op_get(AF_OP_BERNOULLI)->kind, AF_KIND_RANDOM);
    assert_int_equal(af_op_get(AF_OP_BMM)->kind, AF_KIND_COMPUTE);
    assert_string_equal(af_op_kind_name(AF_KIND_EXTERN), "extern");
    assert_string_equal(af_op_kind_name(AF_KIND_POINTWISE), "pointwise");
    assert_string_equal(af_op_kind_name(AF_KIND_REDUCTION), "reduction");
    assert_string_equal(af_op_kind_name(AF_KIND_VIEW), "view");
    assert_string_equal(af_op_kind_name(AF_KIND_RANDOM), "random");
    assert_string_equal(af_op_kind_name(AF_KIND_COMPUTE), "compute");
    assert_string_equal(af_op_kind_name(AF_KIND_COUNT), "invalid");
    assert_string_equal(af_op_kind_name((af_op_kind)-1), "invalid");
    assert_string_equal(af_op_kind_name((af_op_kind)12345), "invalid");
}

/* Same layout: dtype, sizes, offset and strides; a size-1 dim's stride matters only when exact. */
static void test_tensor_meta_same_layout(void **state) {
    (void)state;
    static const int64_t sz[3] = {4, 1, 8}, st[3] = {8, 8, 1}, st1[3] = {8, 3, 1}, stt[3] = {1, 8, 4};
    af_tensor_meta a = meta_tensor(AF_DTYPE_FLOAT32, 3, sz, st), b = meta_tensor(AF_DTYPE_FLOAT32, 3, sz, st1);
    assert_true(af_tensor_meta_same_layout(&a, &a, 1));
    assert_true(af_tensor_meta_same_layout(&a, &b, 0)); /* only the size-1 dim's stride differs */
    assert_false(af_tensor_meta_same_layout(&a, &b, 1));
    af_tensor_meta c = meta_tensor(AF_DTYPE_FLOAT32, 3, sz, stt);
    assert_false(af_tensor_meta_same_layout(&a, &c, 0));
    af_tensor_meta d = a;
    d.storage_offset = 2;
    assert_false(af_tensor_meta_same_layout(&a, &d, 0));
    d = a;
    d.dtype = AF_DTYPE_BFLOAT16;
    assert_false(af_tensor_meta_same_layout(&a, &d, 0));
    d = a;
    d.ndim = 2;
    assert_false(af_tensor_meta_same_layout(&a, &d, 0));
}

static void test_tensor_meta_nbytes(void **state) {
    (void)state;
    af_tensor_meta m = meta_f32_4x8();
    assert_int_equal(af_tensor_meta_nbytes(&m), 4 * 8 * 4);
    m.dtype = AF_DTYPE_COMPLEX128;
    assert_int_equal(af_tensor_meta_nbytes(&m), 4 * 8 * 16);
    m.dtype = AF_DTYPE_BOOL;
    assert_int_equal(af_tensor_meta_nbytes(&m), 4 * 8);

    af_tensor_meta scalar = meta_tensor(AF_DTYPE_FLOAT64, 0, NULL, NULL);
    assert_int_equal(af_tensor_meta_nbytes(&scalar), 8);

    static const int64_t sz0[3] = {5, 0, 7}, st0[3] = {0, 7, 1};
    af_tensor_meta empty = meta_tensor(AF_DTYPE_INT32, 3, sz0, st0);
    assert_int_equal(af_tensor_meta_nbytes(&empty), 0);

    /* strides do not matter: an expanded view still has numel * itemsize */
    static const int64_t sz_e[2] = {1000, 3}, st_e[2] = {0, 1};
    af_tensor_meta expanded = meta_tensor(AF_DTYPE_BFLOAT16, 2, sz_e, st_e);
    assert_int_equal(af_tensor_meta_nbytes(&expanded), 1000 * 3 * 2);

    af_tensor_meta other = meta_other();
    assert_int_equal(af_tensor_meta_nbytes(&other), 0);
    assert_int_equal(af_tensor_meta_nbytes(NULL), 0);

    assert_int_equal(af_tensor_meta_numel(&m), 32);
    assert_int_equal(af_tensor_meta_numel(&scalar), 1);
    assert_int_equal(af_tensor_meta_numel(&empty), 0);
    assert_int_equal(af_tensor_meta_numel(&expanded), 3000);
}

/* af_graph_view_root: up a chain of views to the value they view; a value no view made is its own. */
static void test_view_root(void **state) {
    (void)state;
    af_graph *g;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_tensor_meta m = meta_f32_4x8(), t = meta_f32_4x8();
    static const int64_t sz_t[2] = {8, 4}, st_t[2] = {1, 8};
    t.sizes = sz_t, t.strides = st_t;
    int32_t x, e, v1, v2;
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);
    af_arg arg = {.kind = AF_ARG_VALUE, .u.value = x};
    assert_int_equal(af_graph_add_node(g, "aten::exp.default", &arg, 1, &m, 1, &e), AF_OK);
    arg.u.value = e;
    assert_int_equal(af_graph_add_node(g, "aten::t.default", &arg, 1, &t, 1, &v1), AF_OK);
    arg.u.value = v1;
    assert_int_equal(af_graph_add_node(g, "aten::alias.default", &arg, 1, &t, 1, &v2), AF_OK);
    assert_int_equal(af_graph_view_root(g, v2), e);
    assert_int_equal(af_graph_view_root(g, v1), e);
    assert_int_equal(af_graph_view_root(g, e), e); /* exp is no view */
    assert_int_equal(af_graph_view_root(g, x), x); /* an input */
    af_graph_free(g);
}

static void test_dtype_names(void **state) {
    (void)state;
    static const int sizes[AF_DTYPE_COUNT] = {4, 8, 2, 2, 8, 4, 2, 1, 1, 1, 8, 16, 8};
    for (int i = 0; i < AF_DTYPE_COUNT; i++) {
        const char *name = af_dtype_name((af_dtype)i);
        assert_non_null(name);
        assert_string_not_equal(name, "invalid");
        af_dtype d = (af_dtype)-1;
        assert_int_equal(af_dtype_parse(name, &d), AF_OK);
        assert_int_equal(d, i);
        assert_int_equal(af_dtype_itemsize((af_dtype)i), sizes[i]);
        for (int j = 0; j < i; j++) assert_string_not_equal(name, af_dtype_name((af_dtype)j));
    }
    assert_string_equal(af_dtype_name(AF_DTYPE_FLOAT32), "float32");
    assert_string_equal(af_dtype_name(AF_DTYPE_BFLOAT16), "bfloat16");
    assert_string_equal(af_dtype_name(AF_DTYPE_COMPLEX128), "complex128");
    assert_string_equal(af_dtype_name(AF_DTYPE_COUNT), "invalid");
    assert_string_equal(af_dtype_name((af_dtype)-1), "invalid");
    assert_int_equal(af_dtype_itemsize(AF_DTYPE_COUNT), 0);
    assert_int_equal(af_dtype_itemsize((af_dtype)-1), 0);

    /* unknown names are rejected and leave *out alone. (ir.h says AF_ERR_INVALID, status.h
     * lists a dtype as AF_ERR_UNSUPPORTED and ir.c returns that; accept either, see report.) */
    const char *bad[] = {"float", "Float32", "torch.float32", "float32 ", "f32", "", "invalid"};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        af_dtype d = AF_DTYPE_INT8;
        af_error_clear();
        int st = af_dtype_parse(bad[k], &d);
        assert_true(st == AF_ERR_INVALID || st == AF_ERR_UNSUPPORTED);
        assert_int_equal(d, AF_DTYPE_INT8);
        check_error_message(NULL, __FILE__, __LINE__);
    }
    af_dtype d = AF_DTYPE_INT8;
    af_error_clear();
    int st = af_dtype_parse(NULL, &d);
    assert_true(st == AF_ERR_INVALID || st == AF_ERR_UNSUPPORTED);
    assert_int_equal(d, AF_DTYPE_INT8);
    check_error_message("(null)", __FILE__, __LINE__);
}

static void test_device_names(void **state) {
    (void)state;
    for (int i = 0; i < AF_DEVICE_COUNT; i++) {
        const char *name = af_device_type_name((af_device_type)i);
        assert_string_not_equal(name, "invalid");
        af_device_type t = (af_device_type)-1;
        assert_int_equal(af_device_type_parse(name, &t), AF_OK);
        assert_int_equal(t, i);
    }
    assert_string_equal(af_device_type_name(AF_DEVICE_CPU), "cpu");
    assert_string_equal(af_device_type_name(AF_DEVICE_CUDA), "cuda");
    assert_string_equal(af_device_type_name(AF_DEVICE_META), "meta");
    assert_string_equal(af_device_type_name(AF_DEVICE_COUNT), "invalid");
    assert_string_equal(af_device_type_name((af_device_type)-1), "invalid");

    const char *bad[] = {"CPU", "cuda:0", "gpu", "", " cpu", "invalid"};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        af_device_type t = AF_DEVICE_META;
        af_error_clear();
        int st = af_device_type_parse(bad[k], &t);
        assert_true(st == AF_ERR_INVALID || st == AF_ERR_UNSUPPORTED);
        assert_int_equal(t, AF_DEVICE_META);
        check_error_message(NULL, __FILE__, __LINE__);
    }
    af_device_type t = AF_DEVICE_META;
    assert_int_not_equal(af_device_type_parse(NULL, &t), AF_OK);
    assert_int_equal(t, AF_DEVICE_META);
}

static void test_status(void **state) {
    (void)state;
    assert_string_equal(af_status_name(AF_OK), "AF_OK");
    assert_string_equal(af_status_name(AF_ERR_NOMEM), "AF_ERR_NOMEM");
    assert_string_equal(af_status_name(AF_ERR_INVALID), "AF_ERR_INVALID");
    assert_string_equal(af_status_name(AF_ERR_UNSUPPORTED), "AF_ERR_UNSUPPORTED");
    assert_string_equal(af_status_name(AF_ERR_RUNTIME), "AF_ERR_RUNTIME");
    assert_string_equal(af_status_name(AF_ERR_BRIDGE), "AF_ERR_BRIDGE");
    assert_string_equal(af_status_name(1), "AF_ERR_UNKNOWN");
    assert_string_equal(af_status_name(-99), "AF_ERR_UNKNOWN");

    af_error_clear();
    assert_string_equal(af_error_message(), "");
    assert_int_equal(af_error_set(AF_ERR_RUNTIME, "step %d of %s", 3, "run"), AF_ERR_RUNTIME);
    assert_string_equal(af_error_message(), "step 3 of run");
    af_error_clear();
    assert_string_equal(af_error_message(), "");

    /* a message longer than the buffer is truncated, not overflowed */
    char big[5000];
    memset(big, 'q', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    assert_int_equal(af_error_set(AF_ERR_INVALID, "%s", big), AF_ERR_INVALID);
    size_t len = strlen(af_error_message());
    assert_true(len > 0 && len < sizeof big - 1);
    assert_int_equal(af_error_message()[0], 'q');
    af_error_clear();
}

/* ------------------------------------------------------------------------------------------ */
/* malformed input                                                                              */
/* ------------------------------------------------------------------------------------------ */

static void test_reject_bad_value_refs(void **state) {
    af_graph *g = *state; /* small graph: values 0..2 */
    af_tensor_meta m = meta_f32_4x8();
    const int32_t nv = af_graph_num_values(g);
    int32_t bad_ids[] = {-1, -2, INT32_MIN, nv, nv + 1, INT32_MAX};
    for (size_t k = 0; k < sizeof bad_ids / sizeof *bad_ids; k++) {
        af_arg args[2] = {arg_value(0), arg_value(bad_ids[k])};
        assert_node_rejected(g, "aten::mul.Tensor", args, 2, &m, 1, "aten::mul.Tensor");
        /* the same id inside a list, and inside a nested list */
        af_arg inner[2] = {arg_none(), arg_value(bad_ids[k])};
        af_arg outer[2] = {arg_value(0), arg_list(2, inner)};
        af_arg largs[2] = {arg_value(1), arg_list(2, outer)};
        assert_node_rejected(g, "aten::index.Tensor", largs, 2, &m, 1, "aten::index.Tensor");
    }
    /* a node using its own output (the id it would get) */
    af_arg self_ref[1] = {arg_value(nv)};
    assert_node_rejected(g, "aten::relu.default", self_ref, 1, &m, 1, NULL);
    /* ... or its own second output */
    af_tensor_meta two[2] = {m, m};
    af_arg self_ref2[1] = {arg_value(nv + 1)};
    assert_node_rejected(g, "aten::var_mean.correction", self_ref2, 1, two, 2, NULL);
    /* ... and the last existing value is fine */
    af_arg ok[1] = {arg_value(nv - 1)};
    int32_t out;
    assert_int_equal(af_graph_add_node(g, "aten::relu.default", ok, 1, &m, 1, &out), AF_OK);
    assert_int_equal(out, nv);
    assert_int_equal(af_graph_verify(g), AF_OK);
}

static void test_reject_bad_metadata(void **state) {
    af_graph *g = *state; /* small graph */
    af_arg args[1] = {arg_value(0)};
    int64_t sizes[AF_MAX_DIMS + 1], strides[AF_MAX_DIMS + 1];
    for (int i = 0; i <= AF_MAX_DIMS; i++) sizes[i] = 1, strides[i] = 1;

    af_tensor_meta cases[12];
    const char *parts[12];
    int n = 0;
    cases[n] = meta_f32_4x8();
    static const int64_t neg_sizes[2] = {4, -1};
    cases[n].sizes = neg_sizes;
    parts[n++] = "negative";
    cases[n] = meta_tensor(AF_DTYPE_FLOAT32, AF_MAX_DIMS + 1, sizes, strides);
    parts[n++] = "rank";
    cases[n] = meta_tensor(AF_DTYPE_FLOAT32, -1, sizes, strides);
    parts[n++] = "rank";
    cases[n] = meta_tensor(AF_DTYPE_FLOAT32, 2, NULL, STRIDES_4x8);
    parts[n++] = "without sizes";
    cases[n] = meta_tensor(AF_DTYPE_FLOAT32, 2, SIZES_4x8, NULL);
    parts[n++] = "without sizes";
    cases[n] = meta_f32_4x8();
    cases[n].dtype = AF_DTYPE_COUNT;
    parts[n++] = "bad dtype";
    cases[n] = meta_f32_4x8();
    cases[n].dtype = (af_dtype)-1;
    parts[n++] = "bad dtype";
    cases[n] = meta_f32_4x8();
    cases[n].device.type = AF_DEVICE_COUNT;
    parts[n++] = "bad device";
    cases[n] = meta_f32_4x8();
    cases[n].device.type = (af_device_type)-3;
    parts[n++] = "bad device";
    cases[n] = meta_f32_4x8();
    cases[n].type = (af_value_type)7;
    parts[n++] = "bad value type";
    cases[n] = meta_f32_4x8();
    cases[n].storage_offset = -1;
    parts[n++] = "storage offset";
    assert_true(n <= 12);

    for (int k = 0; k < n; k++) {
        /* as the only output, as the second of two outputs, and as an input */
        assert_node_rejected(g, "aten::relu.default", args, 1, &cases[k], 1, "aten::relu.default");
        af_tensor_meta two[2] = {meta_f32_4x8(), cases[k]};
        assert_node_rejected(g, "aten::var_mean.correction", args, 1, two, 2, "output 1");
        assert_input_rejected(g, "bad", &cases[k], parts[k]);
    }
    /* the largest rank is fine */
    af_tensor_meta max_rank = meta_tensor(AF_DTYPE_FLOAT32, AF_MAX_DIMS, sizes, strides);
    int32_t id;
    assert_int_equal(af_graph_add_input(g, "r16", &max_rank, &id), AF_OK);
    assert_int_equal(af_graph_value(g, id)->meta.ndim, AF_MAX_DIMS);
    assert_int_equal(af_graph_verify(g), AF_OK);
}

static void test_reject_bad_args(void **state) {
    af_graph *g = *state; /* small graph */
    af_tensor_meta m = meta_f32_4x8();
    const char *op = "aten::weird.default";

    af_arg bad_kind[2] = {arg_value(0), arg_int(1)};
    bad_kind[1].kind = AF_ARG_COUNT;
    assert_node_rejected(g, op, bad_kind, 2, &m, 1, op);
    bad_kind[1].kind = (af_arg_kind)-1;
    assert_node_rejected(g, op, bad_kind, 2, &m, 1, op);
    bad_kind[1].kind = (af_arg_kind)1000;
    assert_node_rejected(g, op, bad_kind, 2, &m, 1, op);

    af_arg bad_dtype[1] = {arg_dtype(AF_DTYPE_COUNT)};
    assert_node_rejected(g, op, bad_dtype, 1, &m, 1, op);
    bad_dtype[0].u.dtype = (af_dtype)-1;
    assert_node_rejected(g, op, bad_dtype, 1, &m, 1, op);

    af_arg bad_device[1] = {arg_device(AF_DEVICE_COUNT, 0)};
    assert_node_rejected(g, op, bad_device, 1, &m, 1, op);
    bad_device[0].u.device.type = (af_device_type)-1;
    assert_node_rejected(g, op, bad_device, 1, &m, 1, op);

    af_arg_kind string_kinds[3] = {AF_ARG_STR, AF_ARG_LAYOUT, AF_ARG_MEMORY_FORMAT};
    for (int k = 0; k < 3; k++) {
        af_arg null_str[1] = {arg_str_kind(string_kinds[k], NULL)};
        assert_node_rejected(g, op, null_str, 1, &m, 1, op);
    }

    af_arg null_items[1] = {arg_list(2, NULL)};
    assert_node_rejected(g, op, null_items, 1, &m, 1, op);
    af_arg items[2] = {arg_int(1), arg_int(2)};
    af_arg neg_len[1] = {arg_list(-1, items)};
    assert_node_rejected(g, op, neg_len, 1, &m, 1, op);

    af_arg named_items[2] = {arg_int(1), kw("dim", arg_int(2))};
    af_arg named[1] = {arg_list(2, named_items)};
    assert_node_rejected(g, op, named, 1, &m, 1, op);
    /* ... also nested */
    af_arg nested_named_outer[1] = {arg_list(2, named_items)};
    af_arg nested_named[1] = {kw("indices", arg_list(1, nested_named_outer))};
    assert_node_rejected(g, op, nested_named, 1, &m, 1, op);

    /* a bad item after good ones in a list, and a bad argument after good ones */
    af_arg mixed_items[3] = {arg_int(1), arg_value(2), arg_dtype((af_dtype)55)};
    af_arg mixed[2] = {arg_value(0), arg_list(3, mixed_items)};
    assert_node_rejected(g, op, mixed, 2, &m, 1, op);

    /* argument arrays, op names and output counts */
    assert_node_rejected(g, op, NULL, 1, &m, 1, op);
    af_arg one[1] = {arg_value(0)};
    assert_node_rejected(g, op, one, -1, &m, 1, op);
    assert_node_rejected(g, NULL, one, 1, &m, 1, NULL);
    assert_node_rejected(g, "", one, 1, &m, 1, NULL);
    assert_node_rejected(g, op, one, 1, &m, 0, op);
    assert_node_rejected(g, op, one, 1, &m, -1, op);
    assert_node_rejected(g, op, one, 1, &m, INT32_MIN, op);
    assert_node_rejected(g, op, one, 1, NULL, 1, op);

    /* zero arguments with a NULL array is fine; so is an empty list with NULL items */
    int32_t out;
    assert_int_equal(af_graph_add_node(g, "aten::rand.default", NULL, 0, &m, 1, &out), AF_OK);
    assert_int_equal(af_graph_node(g, 1)->n_args, 0);
    af_arg empty[1] = {arg_list(0, NULL)};
    assert_int_equal(af_graph_add_node(g, "aten::zeros.default", empty, 1, &m, 1, &out), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_contains(text, "= aten::rand.default()  # random\n");
    assert_contains(text, "= aten::zeros.default([])\n");
    free(text);
}

/* levels lists around an int: [[...[7]...]] ; the int sits at depth `levels`. */
static af_arg make_nested(af_arg *buf, int levels) {
    buf[levels] = arg_int(7);
    for (int k = levels - 1; k >= 0; k--) buf[k] = arg_list(1, &buf[k + 1]);
    return buf[0];
}

static void test_nesting_depth(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    af_arg buf[32];
    af_arg args[1];

    /* eight levels of lists: accepted, verified and printed */
    args[0] = make_nested(buf, 8);
    int32_t out;
    assert_int_equal(af_graph_add_node(g, "aten::deep.default", args, 1, &m, 1, &out), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_contains(text, "aten::deep.default([[[[[[[[7]]]]]]]])");
    free(text);

    /* nine or more: rejected, with the graph unchanged */
    args[0] = make_nested(buf, 9);
    assert_node_rejected(g, "aten::deeper.default", args, 1, &m, 1, "aten::deeper.default");
    args[0] = make_nested(buf, 30);
    assert_node_rejected(g, "aten::deeper.default", args, 1, &m, 1, "aten::deeper.default");

    /* an empty list at depth nine is still too deep */
    make_nested(buf, 9);
    buf[8] = arg_list(1, &buf[9]);
    buf[9] = arg_list(0, NULL);
    args[0] = buf[0];
    assert_node_rejected(g, "aten::deeper.default", args, 1, &m, 1, NULL);
}

static void test_reject_bad_outputs(void **state) {
    af_graph *g = *state; /* small graph: outputs (v2) */
    int32_t bad[] = {-1, 3, INT32_MAX, INT32_MIN};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        int32_t ids[3] = {0, 2, bad[k]};
        assert_invalid(af_graph_set_outputs(g, ids, 3));
        /* unchanged */
        assert_int_equal(af_graph_num_outputs(g), 1);
        assert_int_equal(af_graph_output(g, 0), 2);
        assert_int_equal(af_graph_verify(g), AF_OK);
    }
    assert_invalid(af_graph_set_outputs(g, NULL, 2));
    int32_t ids[1] = {0};
    assert_invalid(af_graph_set_outputs(g, ids, -1));
    assert_int_equal(af_graph_num_outputs(g), 1);
    assert_int_equal(af_graph_output(g, 0), 2);
}

static void test_null_arguments(void **state) {
    (void)state;
    af_tensor_meta m = meta_f32_4x8();
    af_arg args[1] = {arg_int(1)};
    int32_t id = -7;
    char *text = (char *)"untouched";
    af_graph *g = NULL;

    assert_invalid(af_graph_new(NULL));
    assert_invalid(af_graph_add_input(NULL, "x", &m, &id));
    assert_invalid(af_graph_add_node(NULL, "aten::relu", args, 1, &m, 1, &id));
    assert_invalid(af_graph_set_outputs(NULL, NULL, 0));
    assert_invalid(af_graph_set_outputs(NULL, &id, 1));
    assert_invalid(af_graph_verify(NULL));
    assert_invalid(af_graph_print(NULL, &text));
    assert_string_equal(text, "untouched");
    assert_invalid(af_graph_print(NULL, NULL));
    assert_int_equal(id, -7);

    assert_int_equal(af_graph_num_inputs(NULL), 0);
    assert_int_equal(af_graph_num_values(NULL), 0);
    assert_int_equal(af_graph_num_nodes(NULL), 0);
    assert_int_equal(af_graph_num_outputs(NULL), 0);
    assert_null(af_graph_value(NULL, 0));
    assert_null(af_graph_node(NULL, 0));
    assert_int_equal(af_graph_input(NULL, 0), -1);
    assert_int_equal(af_graph_output(NULL, 0), -1);
    af_graph_free(NULL);

    /* NULL out-pointers and metadata with a real graph */
    assert_int_equal(af_graph_new(&g), AF_OK);
    assert_non_null(g);
    assert_invalid(af_graph_add_input(g, "x", &m, NULL));
    assert_invalid(af_graph_add_input(g, "x", NULL, &id));
    assert_invalid(af_graph_add_node(g, "aten::relu", args, 1, &m, 1, NULL));
    assert_invalid(af_graph_print(g, NULL));
    assert_int_equal(af_graph_num_values(g), 0);
    assert_int_equal(af_graph_num_inputs(g), 0);
    assert_int_equal(af_graph_num_nodes(g), 0);
    assert_int_equal(af_graph_verify(g), AF_OK);
    af_graph_free(g);
}

static void test_free_null(void **state) {
    (void)state;
    af_graph_free(NULL);
    af_graph *g = NULL;
    assert_int_equal(af_graph_new(&g), AF_OK);
    af_graph_free(g);
}

/* White box: verify must catch a corrupted graph, not only what the builders already refuse.
 * The graph's memory is not const, so writing through the read accessors is well defined; each
 * corruption is undone before the next. */
static void test_verify_detects_corruption(void **state) {
    af_graph *g = *state; /* small graph: x, y, v2 = add(x, y, alpha=1) */
    af_value *v2 = (af_value *)af_graph_value(g, 2);
    af_value *x = (af_value *)af_graph_value(g, 0);
    af_node *n = (af_node *)af_graph_node(g, 0);
    assert_int_equal(af_graph_verify(g), AF_OK);

    n->args[1].u.value = 2; /* the node's own output */
    assert_invalid(af_graph_verify(g));
    n->args[1].u.value = 1;

    n->args[1].kind = (af_arg_kind)99;
    assert_invalid(af_graph_verify(g));
    n->args[1].kind = AF_ARG_VALUE;

    n->args[1].name = "other"; /* keyword before ... */
    n->args[2].name = NULL;    /* ... a positional */
    assert_invalid(af_graph_verify(g));
    n->args[1].name = NULL;
    n->args[2].name = "alpha";

    v2->producer = 5;
    assert_invalid(af_graph_verify(g));
    v2->producer = -1; /* no producer but not an input */
    assert_invalid(af_graph_verify(g));
    v2->producer = 0;

    v2->out_index = 1;
    assert_invalid(af_graph_verify(g));
    v2->out_index = 0;

    x->meta.dtype = AF_DTYPE_COUNT;
    assert_invalid(af_graph_verify(g));
    x->meta.dtype = AF_DTYPE_FLOAT32;

    n->n_outputs = 0;
    assert_invalid(af_graph_verify(g));
    n->n_outputs = 1;

    const char *op = n->op;
    n->op = "";
    assert_invalid(af_graph_verify(g));
    n->op = op;

    assert_int_equal(af_graph_verify(g), AF_OK);
}

/* ------------------------------------------------------------------------------------------ */
/* size: table growth and arena chunks                                                          */
/* ------------------------------------------------------------------------------------------ */

static void test_large_chain(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    int32_t x, y;
    assert_int_equal(af_graph_add_input(g, "x", &m, &x), AF_OK);
    assert_int_equal(af_graph_add_input(g, "y", &m, &y), AF_OK);

    enum { N = 2000, BIG = 3000 };
    /* a list argument bigger than one arena chunk (BIG * sizeof(af_arg) > 16 KiB) */
    af_arg *big = malloc(BIG * sizeof *big);
    assert_non_null(big);
    for (int i = 0; i < BIG; i++) big[i] = arg_int(i);

    int32_t prev = x;
    for (int i = 0; i < N; i++) {
        af_arg args[4] = {arg_value(prev), arg_value(i % 2 ? y : x), kw("alpha", arg_int(i)),
                          kw("big", arg_list(i % 500 == 0 ? BIG : 1, big))};
        int32_t out = -1;
        const char *op = (i % 3 == 0) ? "aten::add.Tensor" : (i % 3 == 1) ? "aten::mul.Tensor" : "mylib::op.default";
        assert_int_equal(af_graph_add_node(g, op, args, 4, &m, 1, &out), AF_OK);
        assert_int_equal(out, i + 2);
        prev = out;
    }
    free(big);
    assert_int_equal(af_graph_set_outputs(g, &prev, 1), AF_OK);

    assert_int_equal(af_graph_num_inputs(g), 2);
    assert_int_equal(af_graph_num_values(g), N + 2);
    assert_int_equal(af_graph_num_nodes(g), N);
    for (int32_t i = 0; i < N; i++) {
        const af_node *n = af_graph_node(g, i);
        assert_int_equal(n->first_output, i + 2);
        assert_int_equal(n->args[0].u.value, i == 0 ? x : i + 1);
        assert_int_equal(n->args[2].u.i, i);
        const af_arg *bl = &n->args[3];
        assert_int_equal(bl->u.list.n, i % 500 == 0 ? BIG : 1);
        assert_int_equal(bl->u.list.items[bl->u.list.n - 1].u.i, bl->u.list.n - 1);
        assert_int_equal(af_graph_value(g, i + 2)->producer, i);
        assert_int_equal(n->op_id, (i % 3 == 0) ? AF_OP_ADD : (i % 3 == 1) ? AF_OP_MUL : AF_OP_UNKNOWN);
    }
    assert_int_equal(af_graph_verify(g), AF_OK);

    char *text = NULL;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_int_equal(count_char(text, '\n'), N + 2);
    assert_contains(text, "  %v2001: f32[4, 8] = aten::mul.Tensor(%v2000, %y, alpha=1999, big=[0])  # pointwise\n");
    assert_contains(text, "alpha=1500, big=[0, 1, 2, 3, ");
    assert_contains(text, "2998, 2999])");
    assert_contains(text, "return (%v2001)\n");
    free(text);
}

static void test_long_names(void **state) {
    af_graph *g = *state;
    enum { L = 40000 };
    char *name = malloc(L + 1);
    assert_non_null(name);
    memset(name, 'n', L);
    name[L] = '\0';
    af_tensor_meta m = meta_f32_4x8();
    int32_t x;
    assert_int_equal(af_graph_add_input(g, name, &m, &x), AF_OK); /* larger than an arena chunk */
    char *op = malloc(L + 16);
    assert_non_null(op);
    memcpy(op, "aten::", 6);
    memset(op + 6, 'o', L);
    op[L + 6] = '\0';
    af_arg args[1] = {arg_value(x)};
    int32_t out;
    assert_int_equal(af_graph_add_node(g, op, args, 1, &m, 1, &out), AF_OK);
    assert_int_equal(af_graph_node(g, 0)->op_id, AF_OP_UNKNOWN);
    assert_int_equal(strlen(af_graph_node(g, 0)->op), (size_t)L + 6);
    assert_int_equal(af_graph_set_outputs(g, &out, 1), AF_OK);
    assert_int_equal(af_graph_verify(g), AF_OK);
    char *text;
    assert_int_equal(af_graph_print(g, &text), AF_OK);
    assert_true(strlen(text) > 3 * (size_t)L);
    free(text);

    /* an error message that would not fit the buffer is truncated safely */
    af_arg bad[1] = {arg_value(1000)};
    assert_node_rejected(g, op, bad, 1, &m, 1, NULL);
    assert_true(strlen(af_error_message()) < 1024);
    free(op);
    free(name);
}

/* ------------------------------------------------------------------------------------------ */
/* regression tests of bugs found in csrc/ (fixed)                                            */
/* ------------------------------------------------------------------------------------------ */


/* af_graph_add_node and af_graph_verify pass af_error_message() (the thread's error buffer) as
 * a %s argument to af_error_set, which vsnprintf's into that same buffer: the detail is lost. */
static void test_regression_nested_error_message(void **state) {
    af_graph *g = *state; /* small graph: 3 values */
    af_tensor_meta m = meta_f32_4x8();
    af_arg args[1] = {arg_value(5)};
    assert_node_rejected(g, "aten::relu.default", args, 1, &m, 1,
                         "node aten::relu.default, argument 0: argument refers to value 5");
    af_tensor_meta bad = m;
    bad.dtype = (af_dtype)42;
    af_arg ok[1] = {arg_value(0)};
    assert_node_rejected(g, "aten::relu.default", ok, 1, &bad, 1, "output 0: node output: bad dtype 42");

    /* verify: same pattern */
    af_node *n = (af_node *)af_graph_node(g, 0);
    n->args[1].u.value = 2;
    af_error_clear();
    assert_int_equal(af_graph_verify(g), AF_ERR_INVALID);
    n->args[1].u.value = 1;
    check_error_message("node 0 (aten::add.Tensor), argument 1: argument refers to value 2", __FILE__, __LINE__);
}

/* af_node says "positional first, then keyword" and af_graph_verify enforces it, but
 * af_graph_add_node accepts a positional argument after a keyword one: the builder makes a
 * graph that verify then rejects. */
static void test_regression_keyword_order(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    af_arg args[3] = {arg_value(0), kw("alpha", arg_int(1)), arg_value(1)};
    assert_node_rejected(g, "aten::add.Tensor", args, 3, &m, 1, "keyword");
}

/* Builders copy what they are given and no pointer in a graph refers to caller memory; an
 * empty list keeps the caller's items pointer. */
static void test_regression_empty_list_keeps_caller_pointer(void **state) {
    af_graph *g = *state;
    af_tensor_meta m = meta_f32_4x8();
    af_arg caller_items[1] = {arg_int(1)};
    af_arg args[1] = {arg_list(0, caller_items)};
    int32_t out;
    assert_int_equal(af_graph_add_node(g, "aten::zeros.default", args, 1, &m, 1, &out), AF_OK);
    const af_node *n = af_graph_node(g, af_graph_num_nodes(g) - 1);
    assert_int_equal(n->args[0].u.list.n, 0);
    assert_true(n->args[0].u.list.items != caller_items);
}

/* ------------------------------------------------------------------------------------------ */

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_small_graph_print_exact, small_graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_valid_graph_full, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_empty_graph, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_builders_deep_copy, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_print_meta_variants, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_auto_names_and_unique_inputs, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_inputs_after_nodes, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_many_outputs_one_node, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_other_value_output, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_output_is_input, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_accessors, small_graph_setup, graph_teardown),
        cmocka_unit_test(test_op_table),
        cmocka_unit_test(test_tensor_meta_nbytes),
        cmocka_unit_test(test_tensor_meta_same_layout),
        cmocka_unit_test(test_view_root),
        cmocka_unit_test(test_dtype_names),
        cmocka_unit_test(test_device_names),
        cmocka_unit_test(test_status),
        cmocka_unit_test_setup_teardown(test_reject_bad_value_refs, small_graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_reject_bad_metadata, small_graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_reject_bad_args, small_graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_nesting_depth, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_reject_bad_outputs, small_graph_setup, graph_teardown),
        cmocka_unit_test(test_null_arguments),
        cmocka_unit_test(test_free_null),
        cmocka_unit_test_setup_teardown(test_verify_detects_corruption, small_graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_large_chain, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_long_names, graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_regression_nested_error_message, small_graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_regression_keyword_order, small_graph_setup, graph_teardown),
        cmocka_unit_test_setup_teardown(test_regression_empty_list_keeps_caller_pointer, graph_setup, graph_teardown),
    };
    return cmocka_run_group_tests_name("aotfuse IR", tests, NULL, NULL);
}
