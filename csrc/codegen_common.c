/* Code generation helpers shared by the C and CUDA backends (see codegen_common.h). */
#include "codegen_common.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An af_cg_operand of a kernel: its strides over the iteration dims (0 where broadcast). */

const char *af_cg_ctype(af_dtype d) {
    return d == AF_DTYPE_FLOAT32 ? "float" : d == AF_DTYPE_BOOL ? "uint8_t" : d == AF_DTYPE_INT64 ? "int64_t" : "uint16_t";
}

/* The helpers both preludes include after defining AF_FN (how a helper is declared on the target),
 * so that the member expressions mean the same on both: NaN-propagating max/min (as ATen's), pow
 * with ATen's special exponents, and the generator.
 *
 * af_rand is Threefry-2x32-20 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the
 * generator JAX uses): the counter is the element's row-major index in the random tensor, the
 * key the 64-bit seed plus the node's stream (rng.share_seeds gives each dropout of a graph its own). Only 32-bit adds, rotates and xors, so the loops calling it vectorize (16
 * lanes with AVX-512) where Philox's 32x32->64 multiplies do not. The first output word times
 * 2^-32, rounded to float, is the value: uniform on [0, 1], with full 2^-32 resolution near 0 (so
 * dropout with p = 1e-8 drops about 1e-8 of the elements). The numbers are the same bits on both
 * targets. */
const char af_cg_helpers_text[] =
    "AF_FN double af_maxd(double a, double b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }\n"
    "AF_FN double af_mind(double a, double b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }\n"
    "AF_FN float af_max(float a, float b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }\n"
    "AF_FN float af_min(float a, float b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }\n"
    "AF_FN float af_pow(float a, float b) {\n"
    "  if (b == 2.0f) return a * a;\n"
    "  if (b == 1.0f) return a;\n"
    "  if (b == 0.5f) return sqrtf(a);\n"
    "  if (b == -0.5f) return 1.0f / sqrtf(a);\n"
    "  if (b == 3.0f) return a * a * a;\n"
    "  if (b == -1.0f) return 1.0f / a;\n"
    "  if (b == -2.0f) return 1.0f / (a * a);\n"
    "  return powf(a, b);\n"
    "}\n"
    "#define AF_ROTL32(x, r) (((x) << (r)) | ((x) >> (32 - (r))))\n"
    "#define AF_TF_ROUND(r) x0 += x1; x1 = AF_ROTL32(x1, r); x1 ^= x0;\n"
    "#define AF_TF_INJECT(a, b, s) x0 += a; x1 += b + (s);\n"
    "AF_FN float af_rand(uint64_t seed, uint64_t idx) {\n"
    "  const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32), k2 = 0x1BD11BDAu ^ k0 ^ k1;\n"
    "  uint32_t x0 = (uint32_t)idx + k0, x1 = (uint32_t)(idx >> 32) + k1;\n"
    "  AF_TF_ROUND(13) AF_TF_ROUND(15) AF_TF_ROUND(26) AF_TF_ROUND(6) AF_TF_INJECT(k1, k2, 1u)\n"
    "  AF_TF_ROUND(17) AF_TF_ROUND(29) AF_TF_ROUND(16) AF_TF_ROUND(24) AF_TF_INJECT(k2, k0, 2u)\n"
    "  AF_TF_ROUND(13) AF_TF_ROUND(15) AF_TF_ROUND(26) AF_TF_ROUND(6) AF_TF_INJECT(k0, k1, 3u)\n"
    "  AF_TF_ROUND(17) AF_TF_ROUND(29) AF_TF_ROUND(16) AF_TF_ROUND(24) AF_TF_INJECT(k1, k2, 4u)\n"
    "  AF_TF_ROUND(13) AF_TF_ROUND(15) AF_TF_ROUND(26) AF_TF_ROUND(6) AF_TF_INJECT(k2, k0, 5u)\n"
    "  (void)x1;\n"
    "  return (float)x0 * 2.3283064365386963e-10f;\n"
    "}\n";

void af_cg_emit_load(af_strbuf *sb, af_dtype d, const char *ptr, const char *off) {
    switch (d) {
    case AF_DTYPE_BFLOAT16: af_strbuf_printf(sb, "af_bf16_load(%s[%s])", ptr, off); break;
    case AF_DTYPE_FLOAT16: af_strbuf_printf(sb, "af_f16_load(%s[%s])", ptr, off); break;
    case AF_DTYPE_BOOL: af_strbuf_printf(sb, "(float)%s[%s]", ptr, off); break;
    default: af_strbuf_printf(sb, "%s[%s]", ptr, off); break;
    }
}

void af_cg_emit_store_value(af_strbuf *sb, af_dtype d, const char *v) {
    switch (d) {
    case AF_DTYPE_BFLOAT16: af_strbuf_printf(sb, "af_bf16_store(%s)", v); break;
    case AF_DTYPE_FLOAT16: af_strbuf_printf(sb, "af_f16_store(%s)", v); break;
    case AF_DTYPE_BOOL: af_strbuf_printf(sb, "(uint8_t)(%s != 0.0f)", v); break;
    default: af_strbuf_printf(sb, "%s", v); break;
    }
}

/* A scalar argument as a float literal; rounded through `as` (bf16/f16) when the op's scalar rule
 * says ATen converts it to the tensor's dtype first. */
static void emit_scalar(af_strbuf *sb, const af_arg *a, af_dtype as) {
    double x = a->kind == AF_ARG_FLOAT ? a->u.f : (double)a->u.i;
    const char *wrap = as == AF_DTYPE_BFLOAT16 ? "af_bf16_round" : as == AF_DTYPE_FLOAT16 ? "af_f16_round" : NULL;
    if (wrap) af_strbuf_printf(sb, "%s(", wrap);
    if (isnan(x)) af_strbuf_printf(sb, "((float)NAN)");
    else if (isinf(x)) af_strbuf_printf(sb, "(%s(float)INFINITY)", x < 0 ? "-" : "");
    else if (x == 0.0 && signbit(x)) af_strbuf_printf(sb, "(-0.0f)"); /* "-0" would be the integer 0 */
    else af_strbuf_printf(sb, "((float)%.17g)", x);
    if (wrap) af_strbuf_printf(sb, ")");
}

/* The af_cg_operand's strides over the iteration shape: right-aligned, 0 on broadcast dims. */
static void operand_strides(const af_tensor_meta *m, const af_tensor_meta *iter, int64_t *out) {
    int32_t shift = iter->ndim - m->ndim;
    for (int32_t d = 0; d < iter->ndim; d++) {
        int32_t md = d - shift;
        out[d] = (md < 0 || m->sizes[md] == 1) ? 0 : m->strides[md];
    }
}

/* Whether member m of grp is a shifted member (computes a window's source, fuse.h). */
static int shifted(const af_fusion_group *grp, int32_t m) { return grp->window_of && grp->window_of[m] >= 0; }

static int is_view(const af_node *n) { return af_op_get(n->op_id)->kind == AF_KIND_VIEW; }

/* The dims any window member computed at the kernel's own index guards (bit d = iteration dim d). */
static uint32_t window_guards(const af_graph *g, const af_fusion_group *grp) {
    uint32_t mask = 0;
    af_window w;
    for (int32_t m = 0; m < grp->n_nodes; m++)
        if (!shifted(grp, m) && af_fuse_window(g, grp->nodes[m], &w)) mask |= w.guard_mask;
    return mask;
}

int af_cg_explicit(const af_graph *g, const af_fusion_group *grp) {
    for (int32_t m = 0; m < grp->n_nodes; m++)
        if (shifted(grp, m) && (is_view(af_graph_node(g, grp->nodes[m])) || af_fuse_window(g, grp->nodes[m], NULL))) return 1;
    return 0;
}

/* The iteration dims with a coordinate operand: the guarded ones, or in explicit frames every dim
 * longer than 1 (a window's source coordinates come from all of them). */
static uint32_t coord_dims(const af_graph *g, const af_fusion_group *grp) {
    if (!af_cg_explicit(g, grp)) return window_guards(g, grp);
    const af_tensor_meta *iter = &af_graph_value(g, grp->iter_value)->meta;
    uint32_t mask = 0;
    for (int32_t d = 0; d < iter->ndim; d++)
        if (iter->sizes[d] > 1) mask |= 1u << d;
    return mask;
}

int af_cg_has_guarded_load(const af_graph *g, const af_fusion_group *grp) {
    af_window w;
    for (int32_t m = 0; m < grp->n_nodes; m++)
        if (af_fuse_window(g, grp->nodes[m], &w) && w.source >= 0 && w.guard_mask) return 1; /* a crop guards nothing */
    return 0;
}

int af_cg_has_window(const af_graph *g, const af_fusion_group *grp) {
    for (int32_t m = 0; m < grp->n_nodes; m++)
        if (af_fuse_window(g, grp->nodes[m], NULL)) return 1;
    return 0;
}

static int popcount32(uint32_t x) {
    int c = 0;
    for (; x; x &= x - 1) c++;
    return c;
}

/* The row value (a reduction's result or a row member) that member m, an element of a later phase,
 * divides by, or -1. Softmax divides each element of a row by the row's sum: the member multiplies by
 * the value's reciprocal instead, rc<value>, computed once a row where the value is
 * (af_cg_emit_phase_end), as ATen's CPU softmax does. A vector division costs several multiplies:
 * the softmax kernel alone at 64 x 768 (in cache) ran 18% faster; the result moves by at most an ulp. */
static int32_t row_divisor(const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int32_t m) {
    const af_node *n = af_graph_node(g, grp->nodes[m]);
    if (!phases || (phases[m] & AF_CG_ROW) || n->op_id != AF_OP_DIV || n->n_args != 2 || n->args[0].kind != AF_ARG_VALUE ||
        n->args[1].kind != AF_ARG_VALUE)
        return -1;
    int32_t v = n->args[1].u.value, producer = af_graph_value(g, v)->producer;
    for (int32_t k = 0; k < m; k++)
        if (grp->nodes[k] == producer)
            return (phases[k] & AF_CG_ROW) || af_op_get(af_graph_node(g, producer)->op_id)->kind == AF_KIND_REDUCTION ? v : -1;
    return -1;
}

/* `const float rc<v> = 1.0f / v<v>;` after a row value v that some member divides by (row_divisor). */
static void emit_row_reciprocal(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int32_t v,
                                const char *indent) {
    for (int32_t m = 0; m < grp->n_nodes; m++)
        if (row_divisor(g, grp, phases, m) == v) {
            af_strbuf_printf(sb, "%sconst float rc%d = 1.0f / v%d;\n", indent, (int)v, (int)v);
            return;
        }
}

int af_cg_has_row_reciprocal(const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int32_t v) {
    for (int32_t m = 0; m < grp->n_nodes; m++)
        if (row_divisor(g, grp, phases, m) == v) return 1;
    return 0;
}

/* Whether scalar x is a value of 16-bit float type d (bf16: 8 significant bits and float's range;
 * f16: 11 significant bits, normal from 2^-14 to 65504, subnormal down to 2^-24). */
static int scalar_exact_16(double x, af_dtype d) {
    if (isnan(x) || isinf(x) || x == 0.0) return 1;
    if ((double)(float)x != x) return 0;
    int e;
    double m = frexp(fabs(x), &e); /* |x| = m * 2^e, m in [0.5, 1) */
    if (d == AF_DTYPE_BFLOAT16) return e >= -125 && e <= 128 && ldexp(m, 8) == floor(ldexp(m, 8));
    if (fabs(x) > 65504.0) return 0;
    int bits = e >= -13 ? 11 : 11 - (-13 - e); /* below 2^-14 the significand loses bits */
    return bits > 0 && ldexp(m, bits) == floor(ldexp(m, bits));
}

/* Whether argument a is a bool (a scalar, or a tensor of bools: 0 or 1 as the kernel holds it). */
static int arg_bool(const af_graph *g, const af_arg *a) {
    return a->kind == AF_ARG_BOOL || (a->kind == AF_ARG_VALUE && af_graph_value(g, a->u.value)->meta.dtype == AF_DTYPE_BOOL);
}

/* Whether argument a of a member, as the kernel holds it (a float), is a value of 16-bit type d:
 * a tensor of type d (loaded from d's storage, or a member's value rounded to d, or exact: below)
 * or bool, or a scalar d can hold. A window member's value is not assumed to be (its fill). */
static int arg_exact_16(const af_graph *g, const af_arg *a, af_dtype d) {
    if (arg_bool(g, a)) return 1;
    if (a->kind == AF_ARG_FLOAT || a->kind == AF_ARG_INT) return scalar_exact_16(a->kind == AF_ARG_FLOAT ? a->u.f : (double)a->u.i, d);
    if (a->kind != AF_ARG_VALUE) return 0;
    const af_value *v = af_graph_value(g, a->u.value);
    return v->meta.dtype == d && (v->producer < 0 || !af_fuse_window(g, v->producer, NULL));
}

/* Whether node n's value (16-bit type d) needs no rounding: its op gives one of its operands, or
 * an integer of one, or a sign, or a product by a bool, and those operands are values of d
 * (arg_exact_16): a selection between bf16 values (cross entropy's `where(target == i, logit,
 * -inf)`), a max, a copy, a one-hot mask's product. */
static int exact_16(const af_graph *g, const af_node *n, af_dtype d) {
    int first = 0, last = -1; /* the arguments the value is taken from */
    switch (n->op_id) {
    case AF_OP_SIGN: return 1;
    case AF_OP_MUL: /* by a bool: the value or a zero (a one-hot mask's product) */
        for (int a = 0; a < 2 && n->n_args >= 2; a++)
            if (arg_bool(g, &n->args[a]) && arg_exact_16(g, &n->args[1 - a], d)) return 1;
        return 0;
    case AF_OP_WHERE: first = 1, last = 2; break;
    case AF_OP_MAXIMUM: case AF_OP_MINIMUM: case AF_OP_CLAMP_MIN: case AF_OP_CLAMP_MAX: last = 1; break;
    case AF_OP_ABS: case AF_OP_NEG: case AF_OP_RELU: case AF_OP_FLOOR: case AF_OP_CEIL: case AF_OP_TRUNC: case AF_OP_ROUND:
    case AF_OP_CONVERT_ELEMENT_TYPE: case AF_OP_TO_COPY: case AF_OP_CLONE: case AF_OP_THRESHOLD_BACKWARD: last = 0; break;
    default: return 0;
    }
    if (last >= n->n_args) return 0;
    for (int a = first; a <= last; a++)
        if (!arg_exact_16(g, &n->args[a], d)) return 0;
    return 1;
}

/* What is known of a value's sign wherever it is not NaN: AF_SIGN_NONNEG (>= 0), AF_SIGN_NONPOS
 * (<= 0), both for zeros, neither when unknown. Read from the value's producers, up to `depth` of
 * them: squares, negations, products, sums and differences of values of known sign, a float
 * conversion (rounding never crosses zero), exp, abs, sqrt, relu and sigmoid, maxima and minima,
 * and a softmax's `x - amax(x, dims, keepdim=True)`, never above 0 as every element of x is at
 * most its slice's max (NaN where x holds one: amax is NaN then). Division is not read (x / -0.0
 * flips a sign). A value is a member's whatever its group: the facts are the graph's. */
enum { AF_SIGN_NONNEG = 1, AF_SIGN_NONPOS = 2 };

static int value_sign(const af_graph *g, int32_t v, int depth);

static int arg_sign(const af_graph *g, const af_arg *a, int depth) {
    if (a->kind == AF_ARG_FLOAT) return (a->u.f >= 0.0 ? AF_SIGN_NONNEG : 0) | (a->u.f <= 0.0 ? AF_SIGN_NONPOS : 0);
    if (a->kind == AF_ARG_INT || a->kind == AF_ARG_BOOL)
        return (a->u.i >= 0 ? AF_SIGN_NONNEG : 0) | (a->u.i <= 0 ? AF_SIGN_NONPOS : 0);
    return a->kind == AF_ARG_VALUE ? value_sign(g, a->u.value, depth) : 0;
}

static int flip_sign(int s) { return ((s & AF_SIGN_NONNEG) ? AF_SIGN_NONPOS : 0) | ((s & AF_SIGN_NONPOS) ? AF_SIGN_NONNEG : 0); }

static int is_float_dtype(af_dtype d) {
    return d == AF_DTYPE_FLOAT32 || d == AF_DTYPE_FLOAT64 || d == AF_DTYPE_FLOAT16 || d == AF_DTYPE_BFLOAT16;
}

/* Whether value b is amax(a, dims, keepdim=True): a's rank, so it broadcasts back along the dims it
 * reduced (a view between them is a node of its own, and not read here). */
static int is_keepdim_amax_of(const af_graph *g, int32_t b, int32_t a) {
    const af_value *vb = af_graph_value(g, b);
    if (!vb || vb->producer < 0) return 0;
    const af_node *m = af_graph_node(g, vb->producer);
    return m->op_id == AF_OP_AMAX && m->n_args >= 1 && m->args[0].kind == AF_ARG_VALUE && m->args[0].u.value == a &&
           vb->meta.ndim == af_graph_value(g, a)->meta.ndim;
}

static int value_sign(const af_graph *g, int32_t v, int depth) {
    const af_value *val = af_graph_value(g, v);
    if (!val || val->producer < 0 || depth <= 0 || !is_float_dtype(val->meta.dtype)) return 0;
    const af_node *n = af_graph_node(g, val->producer);
    if (n->n_args < 1 || af_fuse_window(g, val->producer, NULL)) return 0; /* a window's fill is not its op's */
    const af_arg *a = &n->args[0], *b = n->n_args >= 2 ? &n->args[1] : NULL;
    int positional2 = n->n_args == 2 && !a->name && !b->name;
    depth--;
    switch (n->op_id) {
    case AF_OP_NEG: return flip_sign(arg_sign(g, a, depth));
    case AF_OP_ABS: case AF_OP_EXP: case AF_OP_SQRT: case AF_OP_RELU: case AF_OP_SIGMOID: return AF_SIGN_NONNEG;
    case AF_OP_TO_COPY: case AF_OP_CONVERT_ELEMENT_TYPE: case AF_OP_CLONE:
        return a->kind == AF_ARG_VALUE && is_float_dtype(af_graph_value(g, a->u.value)->meta.dtype) ? arg_sign(g, a, depth)
                                                                                                      : 0;
    case AF_OP_MUL: {
        if (!positional2) return 0;
        if (a->kind == AF_ARG_VALUE && b->kind == AF_ARG_VALUE && a->u.value == b->u.value) return AF_SIGN_NONNEG;
        int sa = arg_sign(g, a, depth), sb = sa ? arg_sign(g, b, depth) : 0;
        return ((((sa & AF_SIGN_NONNEG) && (sb & AF_SIGN_NONNEG)) || ((sa & AF_SIGN_NONPOS) && (sb & AF_SIGN_NONPOS))) ? AF_SIGN_NONNEG : 0) |
               ((((sa & AF_SIGN_NONNEG) && (sb & AF_SIGN_NONPOS)) || ((sa & AF_SIGN_NONPOS) && (sb & AF_SIGN_NONNEG))) ? AF_SIGN_NONPOS : 0);
    }
    case AF_OP_ADD:
        return positional2 ? arg_sign(g, a, depth) & arg_sign(g, b, depth) : 0;
    case AF_OP_SUB:
        if (!positional2) return 0;
        if (a->kind == AF_ARG_VALUE && b->kind == AF_ARG_VALUE && is_keepdim_amax_of(g, b->u.value, a->u.value))
            return AF_SIGN_NONPOS;
        return arg_sign(g, a, depth) & flip_sign(arg_sign(g, b, depth));
    case AF_OP_MAXIMUM: case AF_OP_CLAMP_MIN: case AF_OP_MINIMUM: case AF_OP_CLAMP_MAX: {
        /* NaN-propagating: a max is at least each argument, a min at most */
        if (!positional2) return 0;
        int sa = arg_sign(g, a, depth), sb = arg_sign(g, b, depth);
        int up = n->op_id == AF_OP_MAXIMUM || n->op_id == AF_OP_CLAMP_MIN ? AF_SIGN_NONNEG : AF_SIGN_NONPOS;
        return ((sa | sb) & up) | (sa & sb & ~up);
    }
    default: return 0;
    }
}

/* `float v<out> = <the op's C expression>;`, rounded as if stored for 16-bit and bool outputs;
 * recip >= 0: a division by the row value recip, as a product with its reciprocal (row_divisor). */
static void emit_pointwise(af_strbuf *sb, const af_graph *g, const af_node *n, const char *indent, int32_t recip) {
    const af_op_info *info = af_op_get(n->op_id);
    const af_value *out = af_graph_value(g, n->first_output);
    af_dtype scalar_as = AF_DTYPE_FLOAT32;
    /* the op table's scalar rule; AF_SCALAR_AS_TENSOR_CPU by the value's device
     * (tests/test_fusion.py, test_a_16_bit_sum_with_a_scalar_rounds_it_as_eager_on_the_cpu) */
    int round_scalars = info->scalars == AF_SCALAR_AS_TENSOR ||
                (info->scalars == AF_SCALAR_AS_TENSOR_CPU && out->meta.device.type == AF_DEVICE_CPU);
    for (int32_t a = 0; a < n->n_args && round_scalars; a++)
        if (n->args[a].kind == AF_ARG_VALUE) {
            scalar_as = af_graph_value(g, n->args[a].u.value)->meta.dtype;
            break;
        }
    af_strbuf_printf(sb, "%sfloat v%d = ", indent, (int)n->first_output);
    /* af_pow's special cases are ATen's for a scalar exponent (sqrt for 0.5: sqrt(-inf) is NaN);
     * a tensor's exponents go through pow itself, as ATen's (pow(-inf, 0.5) is inf) */
    const char *expr = n->op_id == AF_OP_POW && n->n_args >= 2 && n->args[1].kind == AF_ARG_VALUE ? "powf($0, $1)"
                                                                                                : info->c_expr;
    /* exp of an argument never above 0 (a softmax's shifted logits, GELU's -x^2 / 2): the prelude's
     * exp without the overflow side, the same value (CUDA: expf either way) */
    if (n->op_id == AF_OP_EXP && n->n_args >= 1 && n->args[0].kind == AF_ARG_VALUE &&
        (value_sign(g, n->args[0].u.value, 8) & AF_SIGN_NONPOS))
        expr = "af_exp_nonpos($0)";
    if (recip >= 0) af_strbuf_printf(sb, "(v%d * rc%d)", (int)n->args[0].u.value, (int)recip);
    else for (const char *e = expr; *e; e++) {
        if (e[0] == '$' && e[1] >= '0' && e[1] <= '9') {
            const af_arg *a = &n->args[e[1] - '0'];
            if (a->kind == AF_ARG_VALUE) af_strbuf_printf(sb, "v%d", (int)a->u.value);
            else emit_scalar(sb, a, scalar_as);
            e++;
        } else {
            af_strbuf_printf(sb, "%c", *e);
        }
    }
    af_strbuf_printf(sb, "; /* %s%s */\n", n->op, recip >= 0 ? ", by the reciprocal" : "");
    /* a 16-bit or bool value rounds as if stored, so the group matches op-by-op results (where
     * it is not one already) */
    if ((out->meta.dtype == AF_DTYPE_BFLOAT16 || out->meta.dtype == AF_DTYPE_FLOAT16) && recip < 0 &&
        exact_16(g, n, out->meta.dtype))
        return;
    if (out->meta.dtype == AF_DTYPE_BFLOAT16)
        af_strbuf_printf(sb, "%sv%d = af_bf16_round(v%d);\n", indent, (int)n->first_output, (int)n->first_output);
    else if (out->meta.dtype == AF_DTYPE_FLOAT16)
        af_strbuf_printf(sb, "%sv%d = af_f16_round(v%d);\n", indent, (int)n->first_output, (int)n->first_output);
    else if (out->meta.dtype == AF_DTYPE_BOOL)
        af_strbuf_printf(sb, "%sv%d = (float)(v%d != 0.0f);\n", indent, (int)n->first_output, (int)n->first_output);
}

/* A frame's coordinates (explicit frames, below; the kernel's own, as o<k>, in plain windows):
 * one integer C expression per dim. In a part of a split loop (af_cg_part) the dims in `known`
 * have a known range over it, [lo, hi); a `tracked` dim's coordinate is the part's loop dim's
 * minus shift. */
typedef struct {
    int32_t ndim;
    char c[AF_MAX_DIMS][32];
    uint32_t known, tracked, varies; /* varies: the coordinate moves with the loop index */
    int64_t lo[AF_MAX_DIMS], hi[AF_MAX_DIMS], shift[AF_MAX_DIMS];
    af_cg_part *part;
    int straight;  /* guards the loop does not move may choose after their loads (every input has an element) */
    char guard[16]; /* inside a window chosen after its loads: its guard's variable (loads clamp their offsets to it) */
} af_frame;

static void add_cut(af_cg_part *part, int64_t at) {
    if (at <= part->lo || at >= part->hi) return;
    for (int32_t j = 0; j < part->n_cuts; j++)
        if (part->cuts[j] == at) return;
    if (part->n_cuts == AF_CG_MAX_CUTS) part->overflow = 1;
    else part->cuts[part->n_cuts++] = at;
}

/* A guard's bound on dim d of frame f, whose coordinate is `coord`: ` && coord >= lo && coord <
 * hi`; nothing where f's range of the coordinate lies inside [lo, hi), ` && 0` where it lies outside.
 * A comparison left on a tracked dim gives the part its cuts. Returns 0 where it wrote none,
 * AF_BOUND_FIXED for a comparison the loop index does not move, AF_BOUND_MOVES for one it may. */
enum { AF_BOUND_FIXED = 1, AF_BOUND_MOVES = 3 };
static int emit_bound(af_strbuf *sb, const af_frame *f, int32_t d, const char *coord, int64_t lo, int64_t hi) {
    if (f && ((f->known >> d) & 1u)) {
        if (lo <= f->lo[d] && f->hi[d] <= hi) return 0;
        if (f->hi[d] <= lo || hi <= f->lo[d]) {
            af_strbuf_printf(sb, " && 0");
            return 0;
        }
        if (f->part && ((f->tracked >> d) & 1u)) {
            add_cut(f->part, lo + f->shift[d]);
            add_cut(f->part, hi + f->shift[d]);
        }
    }
    af_strbuf_printf(sb, " && %s >= %" PRId64 " && %s < %" PRId64, coord, lo, coord, hi);
    return f && f->part && !((f->varies >> d) & 1u) ? AF_BOUND_FIXED : AF_BOUND_MOVES;
}

/* A load of ptr at off; inside a window chosen after its loads (guard), at offset 0 where the
 * guard fails (every input has an element there): no load behind a branch. */
static void emit_clamped_load(af_strbuf *sb, af_dtype dtype, const char *ptr, const char *off, const char *guard) {
    if (!guard || !guard[0]) {
        af_cg_emit_load(sb, dtype, ptr, off);
        return;
    }
    af_strbuf o = {0};
    af_strbuf_printf(&o, "%s ? (%s) : 0", guard, off);
    if (o.failed) sb->failed = 1;
    else af_cg_emit_load(sb, dtype, ptr, o.buf);
    free(o.buf);
}

/* Whether frame f's ranges put the window's element outside its source throughout (some guarded
 * coordinate's range misses the window): then it is its fill or base, and nothing else is emitted. */
static int outside_throughout(const af_frame *f, const af_window *w) {
    for (int32_t d = 0; f && d < f->ndim; d++)
        if (((w->guard_mask >> d) & 1u) && ((f->known >> d) & 1u) &&
            (f->hi[d] <= w->left[d] || w->left[d] + w->size[d] <= f->lo[d]))
            return 1;
    return 0;
}

/* `float v<out> = <base or fill>;`: a window member outside its source. */
static void emit_outside(af_strbuf *sb, const af_graph *g, const af_node *n, const af_window *w, const char *indent) {
    af_strbuf_printf(sb, "%sfloat v%d = ", indent, (int)n->first_output);
    if (w->base >= 0) af_strbuf_printf(sb, "v%d", (int)w->base);
    else {
        af_arg fill = {.kind = AF_ARG_FLOAT, .u.f = w->value};
        emit_scalar(sb, &fill, af_graph_value(g, n->first_output)->meta.dtype); /* as its dtype holds it */
    }
    af_strbuf_printf(sb, "; /* %s, outside its source */\n", n->op);
}

/* Whether some shifted member reads input k. */
static int shifted_reads(const af_graph *g, const af_fusion_group *grp, int32_t window, int32_t k) {
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        if (!shifted(grp, m) || (window >= 0 && grp->window_of[m] != window)) continue;
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        af_window w; /* a nested window reads its source in its own frame, not this one */
        int32_t source_arg = af_fuse_window(g, grp->nodes[m], &w) ? w.source_arg : -1;
        for (int32_t a = 0; a < n->n_args; a++)
            if (a != source_arg && n->args[a].kind == AF_ARG_VALUE && n->args[a].u.value == grp->inputs[k]) return 1;
    }
    return 0;
}

/* How far an operand read at the window's source index lies behind its offset at the element's own
 * index: the window's left pads times the operand's strides. */
static int64_t window_shift(const af_window *w, const af_tensor_meta *iter, const af_cg_operand *op) {
    int64_t shift = 0;
    for (int32_t d = 0; d < iter->ndim; d++) shift += w->left[d] * op->strides[d];
    return shift;
}

/* `(1 && o<c> >= lo && o<c> < hi ...)`: every coordinate the window guards inside its source (the
 * bounds root, the kernel's frame, decides left out). Returns emit_bound's results or-ed. */
static int emit_guard_cond(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_window *w,
                           const af_tensor_meta *iter, const af_frame *root) {
    uint32_t all = coord_dims(g, grp);
    int left = 0;
    af_strbuf_printf(sb, "(1");
    for (int32_t d = 0; d < iter->ndim; d++) {
        if (!((w->guard_mask >> d) & 1u)) continue;
        char coord[16];
        snprintf(coord, sizeof coord, "o%d", (int)(grp->n_inputs + grp->n_outputs + popcount32(all & ((1u << d) - 1u))));
        left |= emit_bound(sb, root, d, coord, w->left[d], w->left[d] + w->size[d]);
    }
    af_strbuf_printf(sb, ")");
    return left;
}

/* A window member: its source (input k) at the shifted offset where every guarded coordinate (the
 * coordinate operands' offsets) lies inside the source, the fill value elsewhere. The load is only
 * evaluated inside (a conditional expression), so nothing outside the source is ever read. A
 * source its shifted members compute is computed there instead: their inputs loaded at their
 * shifted offsets, their expressions after, all inside the guard. */
static void emit_window(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops, int32_t member,
                        const af_window *w, const af_frame *root, const char *indent) {
    const af_node *n = af_graph_node(g, grp->nodes[member]);
    if (outside_throughout(root, w)) {
        emit_outside(sb, g, n, w, indent);
        return;
    }
    int vw = (int)n->first_output;
    int32_t k = 0;
    while (w->source >= 0 && k < grp->n_inputs && grp->inputs[k] != w->source) k++;
    const af_tensor_meta *iter = &af_graph_value(g, grp->iter_value)->meta;
    af_arg fill = {.kind = AF_ARG_FLOAT, .u.f = w->value};
    /* the fill as the window's dtype holds it (a bf16 pad with 0.1 is 0.10009765625, as in eager) */
    af_dtype fill_as = af_graph_value(g, n->first_output)->meta.dtype;
    char ptr[16], off[48], guard[16] = "";
    af_strbuf cond = {0};
    int how = emit_guard_cond(&cond, g, grp, w, iter, root);
    if (cond.failed) {
        sb->failed = 1;
        free(cond.buf);
        return;
    }
    /* a guard the loop index does not move: the loads at offset 0 where it fails, the value chosen after */
    int straight = w->source >= 0 && how == AF_BOUND_FIXED && root && root->straight;
    if (straight) {
        snprintf(guard, sizeof guard, "g%d", vw);
        af_strbuf_printf(sb, "%sconst int %s = %s; /* %s: chosen after its loads */\n", indent, guard, cond.buf, n->op);
    } else if (w->source >= 0 && how && root && root->part) {
        root->part->guarded_loads++;
    }
    if (w->source < 0) { /* box_fill: the value inside, base outside */
        af_strbuf_printf(sb, "%sfloat v%d = %s ? ", indent, vw, cond.buf);
        emit_scalar(sb, &fill, fill_as);
        af_strbuf_printf(sb, " : v%d; /* %s */\n", (int)w->base, n->op);
    } else if (k < grp->n_inputs) {
        snprintf(ptr, sizeof ptr, "q%d", (int)k);
        snprintf(off, sizeof off, "o%d - (%" PRId64 ")", (int)k, window_shift(w, iter, &ops[k]));
        af_strbuf_printf(sb, "%sfloat v%d = ", indent, vw);
        if (straight) {
            emit_clamped_load(sb, ops[k].dtype, ptr, off, guard);
            af_strbuf_printf(sb, ";\n%sv%d = %s ? v%d : ", indent, vw, guard, vw);
        } else {
            af_strbuf_printf(sb, "%s ? ", cond.buf);
            af_cg_emit_load(sb, ops[k].dtype, ptr, off);
            af_strbuf_printf(sb, " : ");
        }
        if (w->base >= 0) af_strbuf_printf(sb, "v%d", (int)w->base);
        else emit_scalar(sb, &fill, fill_as);
        af_strbuf_printf(sb, "; /* %s */\n", n->op);
    } else { /* the source computed here */
        char inner[64];
        snprintf(inner, sizeof inner, "%s  ", indent);
        af_strbuf_printf(sb, "%sfloat v%d;\n%s%s%s%s{ /* %s, its source computed at its index */\n", indent, vw, indent,
                         straight ? "" : "if ", straight ? "" : cond.buf, straight ? "" : " ", n->op);
        for (int32_t q = 0; q < grp->n_inputs; q++) {
            if (!shifted_reads(g, grp, grp->nodes[member], q)) continue;
            snprintf(ptr, sizeof ptr, "q%d", (int)q);
            snprintf(off, sizeof off, "o%d - (%" PRId64 ")", (int)q, window_shift(w, iter, &ops[q]));
            af_strbuf_printf(sb, "%sconst float v%d = ", inner, (int)grp->inputs[q]);
            emit_clamped_load(sb, ops[q].dtype, ptr, off, guard);
            af_strbuf_printf(sb, ";\n");
        }
        for (int32_t m = 0; m < grp->n_nodes; m++)
            if (shifted(grp, m) && grp->window_of[m] == grp->nodes[member]) emit_pointwise(sb, g, af_graph_node(g, grp->nodes[m]), inner, -1);
        if (straight) af_strbuf_printf(sb, "%sv%d = %s ? v%d : ", inner, vw, guard, (int)w->source);
        else af_strbuf_printf(sb, "%sv%d = v%d;\n%s} else {\n%sv%d = ", inner, vw, (int)w->source, indent, inner, vw);
        if (w->base >= 0) af_strbuf_printf(sb, "v%d", (int)w->base);
        else emit_scalar(sb, &fill, fill_as);
        af_strbuf_printf(sb, ";\n%s}\n", indent);
    }
    free(cond.buf);
}

/* Explicit frames (af_cg_explicit). A frame is where one window's source is computed: its
 * coordinates, one integer C expression per dim ("0" on dims of size 1; `int` where every tensor
 * the group touches spans fewer than 2^30 elements, else int64_t). The kernel's own frame
 * has its coordinate operands; inside a window's guard at frame P, the source's element is at
 * s = P - left; a source that views x (remapped members) is x's element at storage offset
 * f = (view's offset from x) + sum(s * view's strides), whose coordinates are (f / x's stride) %
 * x's size (x dense: fuse.c's view_chain). Inputs read in a frame are loaded at its coordinates
 * times their own strides (right-aligned: broadcast dims at 0). */

/* `(<it>)<base> + c * stride ...`: the offset of m's element at f's coordinates. */
static void frame_offset(char *out, size_t cap, const af_frame *f, const af_tensor_meta *m, int64_t base, const char *it) {
    size_t n = (size_t)snprintf(out, cap, "(%s)%" PRId64, it, base);
    int32_t shift = f->ndim - m->ndim;
    for (int32_t md = 0; md < m->ndim && n < cap; md++) {
        int32_t d = md + shift;
        if (d < 0 || m->sizes[md] == 1 || m->strides[md] == 0 || strcmp(f->c[d], "0") == 0) continue;
        n += (size_t)snprintf(out + n, cap - n, " + %s * %" PRId64, f->c[d], m->strides[md]);
    }
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Coordinate (f / X) % N of x's element at storage offset f = c0 + sum(s[d] * m's strides[d]) from
 * x's start, each s[d] in [0, size[d]) (every coordinate of a source lies inside it), x dense
 * (f / X < N always holds for its outermost dim). Simplified where the terms allow, so that a view
 * that only splits or merges dims costs no division: a term whose stride is a multiple of X * N adds
 * nothing (nor does c0's multiple of it); one whose stride is a multiple of X adds s * (stride / X)
 * (a whole term); the others, with what is left of c0 (the rest), are divided by X only where
 * they can reach X; the % N is dropped where the quotient stays below N. Two identities keep the
 * quotients and remainders off a row's coordinate where its terms allow:
 * - the rest is divided in units of M, the largest divisor of X that the rest's other terms, with
 *   c0 % M, stay below: (M * a + r) / X = a / (X / M) for 0 <= r < M;
 * - the % N is taken in units of K, the largest divisor of N that the other whole terms and the
 *   divided rest stay below: (K * a + r) % N = (a % (N / K)) * K + r for 0 <= r < K.
 * (Longformer's [8, 8, 32, 65] view of its [2, 4, 256, 65] scores read s0 / 4, invariant along a
 * row, where it read (s0 * 16640 + s1 * 2080 + s2 * 65 + s3) / 66560; its chunks' (s0 * 64 + s2) %
 * 256 is (s0 % 4) * 64 + s2.) Into out: a C expression of type it. */
static uint32_t emit_unravel(char *out, size_t cap, const af_frame *S, const int64_t *size, const af_tensor_meta *m, int64_t c0,
                             int64_t X, int64_t N, const char *it) {
    uint32_t used = 0; /* the dims of S whose coordinates the expression reads */
    int64_t XN = X * N, rem_max, q_max = 0, M = 1, K = 1;
    c0 %= XN;
    rem_max = c0;
    int negative = c0 < 0;
    for (int32_t d = 0; d < m->ndim; d++) {
        if (size[d] <= 1 || m->strides[d] % XN == 0) continue; /* (stride 0 included) */
        negative |= m->strides[d] < 0;
        if (m->strides[d] % X) rem_max += (size[d] - 1) * m->strides[d];
        else q_max += (size[d] - 1) * (m->strides[d] / X);
    }
    int64_t rest_q = rem_max >= X ? rem_max / X : 0; /* the divided rest's largest value */
    q_max += rest_q;
#define AF_WHOLE(d) (size[d] > 1 && m->strides[d] % XN && m->strides[d] % X == 0)
#define AF_REST(d) (size[d] > 1 && m->strides[d] % XN && m->strides[d] % X)
    for (int32_t e = 0; e < m->ndim && rest_q && !negative; e++) { /* the unit M */
        if (!AF_REST(e)) continue;
        int64_t cand = gcd64(m->strides[e], X), below = c0 % cand;
        if (cand <= M) continue;
        for (int32_t d = 0; d < m->ndim; d++)
            if (AF_REST(d) && m->strides[d] % cand) below += (size[d] - 1) * m->strides[d];
        if (below < cand) M = cand;
    }
    for (int32_t e = 0; e < m->ndim && q_max >= N && !negative; e++) { /* the unit K */
        if (!AF_WHOLE(e)) continue;
        int64_t cand = gcd64(m->strides[e] / X, N), below = rest_q;
        if (cand <= K) continue;
        for (int32_t d = 0; d < m->ndim; d++)
            if (AF_WHOLE(d) && (m->strides[d] / X) % cand) below += (size[d] - 1) * (m->strides[d] / X);
        if (below < cand) K = cand;
    }
    size_t n = 0;
    if (K > 1) { /* (high % (N / K)) * K, high's terms those whose multiples of N / K it drops */
        int64_t high_max = 0, NK = N / K;
        for (int32_t d = 0; d < m->ndim; d++)
            if (AF_WHOLE(d) && (m->strides[d] / X) % K == 0 && (m->strides[d] / X / K) % NK)
                high_max += (size[d] - 1) * (m->strides[d] / X / K);
        n = (size_t)snprintf(out, cap, "%s(%s)0", high_max >= NK ? "((" : "(", it);
        for (int32_t d = 0; d < m->ndim && n < cap; d++)
            if (AF_WHOLE(d) && (m->strides[d] / X) % K == 0 && (m->strides[d] / X / K) % NK)
                n += (size_t)snprintf(out + n, cap - n, " + %s * %" PRId64, S->c[d], m->strides[d] / X / K);
        if (high_max >= NK && n < cap) n += (size_t)snprintf(out + n, cap - n, ") %% %" PRId64, NK);
        if (n < cap) n += (size_t)snprintf(out + n, cap - n, ") * %" PRId64, K);
        for (int32_t d = 0; d < m->ndim; d++)
            if (AF_WHOLE(d) && (m->strides[d] / X) % K == 0 && (m->strides[d] / X / K) % NK) used |= 1u << d;
    } else {
        n = (size_t)snprintf(out, cap, "%s(%s)0", q_max >= N ? "(" : "", it);
    }
    for (int32_t d = 0; d < m->ndim && n < cap; d++) /* the strides that step x's coordinate by whole units */
        if (AF_WHOLE(d) && (K == 1 || (m->strides[d] / X) % K)) {
            n += (size_t)snprintf(out + n, cap - n, " + %s * %" PRId64, S->c[d], m->strides[d] / X);
            used |= 1u << d;
        }
    if (rest_q && n < cap) { /* the rest, divided */
        n += (size_t)snprintf(out + n, cap - n, " + ((%s)%" PRId64, it, c0 / M);
        for (int32_t d = 0; d < m->ndim && n < cap; d++)
            if (AF_REST(d) && m->strides[d] % M == 0) {
                n += (size_t)snprintf(out + n, cap - n, " + %s * %" PRId64, S->c[d], m->strides[d] / M);
                used |= 1u << d;
            }
        if (n < cap) n += (size_t)snprintf(out + n, cap - n, ") / %" PRId64, X / M);
    }
    if (K == 1 && q_max >= N && n < cap) snprintf(out + n, cap - n, ") %% %" PRId64, N);
#undef AF_WHOLE
#undef AF_REST
    return used;
}

/* The frames' integer type: `int` where every tensor a member touches spans fewer than 2^30
 * elements (every coordinate and offset then fits), else int64_t. */
static const char *frame_index_type(const af_graph *g, const af_fusion_group *grp) {
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        for (int32_t a = -1; a < n->n_args; a++) {
            int32_t v = a < 0 ? n->first_output : n->args[a].kind == AF_ARG_VALUE ? n->args[a].u.value : -1;
            if (v < 0) continue;
            const af_tensor_meta *t = &af_graph_value(g, v)->meta;
            if (t->type != AF_VALUE_TENSOR) continue;
            int64_t span = t->storage_offset + 1;
            for (int32_t d = 0; d < t->ndim; d++) {
                if (t->sizes[d] > (INT64_C(1) << 30) || t->strides[d] > (INT64_C(1) << 30) || t->strides[d] < 0) return "int64_t";
                span += (t->sizes[d] - 1) * t->strides[d];
                if (span >= (INT64_C(1) << 30)) return "int64_t";
            }
            if (af_tensor_meta_numel(t) >= (INT64_C(1) << 30)) return "int64_t";
        }
    }
    return "int";
}

/* The member computing value v among window W's shifted members, or -1. */
static int32_t frame_member(const af_graph *g, const af_fusion_group *grp, int32_t window, int32_t v) {
    int32_t p = af_graph_value(g, v)->producer;
    for (int32_t m = 0; m < grp->n_nodes && p >= 0; m++)
        if (grp->nodes[m] == p && shifted(grp, m) && grp->window_of[m] == window) return m;
    return -1;
}

static void emit_frame(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops, int32_t window,
                       const af_frame *f, const char *it, const char *indent);

/* A window member at frame P: inside its guard, its source at its element (loaded, or computed by
 * its shifted members in the source's frame), the fill value or base elsewhere. */
static void emit_explicit_window(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                                 int32_t member, const af_frame *P, const char *it, const char *indent) {
    const af_node *n = af_graph_node(g, grp->nodes[member]);
    af_window w;
    af_fuse_window(g, grp->nodes[member], &w);
    if (outside_throughout(P, &w)) {
        emit_outside(sb, g, n, &w, indent);
        return;
    }
    int vw = (int)n->first_output;
    af_arg fill = {.kind = AF_ARG_FLOAT, .u.f = w.value};
    af_dtype fill_as = af_graph_value(g, n->first_output)->meta.dtype; /* rounded as stored */
    char inner[72], off[4096]; /* 16 dims of 31-character coordinates and 20-digit strides fit twice over */
    snprintf(inner, sizeof inner, "%s  ", indent);
    /* the guard (and, inside a window chosen after its loads, that window's guard) */
    af_strbuf cond = {0};
    int how = 0;
    af_strbuf_printf(&cond, "%s%s(1", P->guard, P->guard[0] ? " && " : "");
    for (int32_t d = 0; d < P->ndim; d++)
        if ((w.guard_mask >> d) & 1u) how |= emit_bound(&cond, P, d, P->c[d], w.left[d], w.left[d] + w.size[d]);
    af_strbuf_printf(&cond, ")");
    if (cond.failed) {
        sb->failed = 1;
        free(cond.buf);
        return;
    }
    /* chosen after its loads (no load behind a branch): a guard the loop index does not move, or
     * any guard but a moving one inside such a window */
    int straight = w.source >= 0 && P->straight && how != AF_BOUND_MOVES && (how || P->guard[0]);
    char guard[16];
    snprintf(guard, sizeof guard, "%s", P->guard);
    if (straight) {
        snprintf(guard, sizeof guard, "g%d", vw);
        af_strbuf_printf(sb, "%sfloat v%d;\n%s{ /* %s: chosen after its loads */\n%sconst int %s = %s;\n", indent, vw, indent, n->op,
                         inner, guard, cond.buf);
    } else {
        if (how && w.source >= 0 && P->part) P->part->guarded_loads++;
        af_strbuf_printf(sb, "%sfloat v%d;\n%sif (%s) { /* %s */\n", indent, vw, indent, cond.buf, n->op);
    }
    free(cond.buf);
    if (w.source < 0) { /* box_fill: the value inside */
        af_strbuf_printf(sb, "%sv%d = ", inner, vw);
        emit_scalar(sb, &fill, fill_as);
        af_strbuf_printf(sb, ";\n");
    } else {
        af_frame S = {.ndim = P->ndim, .part = P->part, .straight = P->straight, .varies = P->varies},
                 F = {.part = P->part, .straight = P->straight};
        snprintf(S.guard, sizeof S.guard, "%s", guard);
        snprintf(F.guard, sizeof F.guard, "%s", guard);
        for (int32_t d = 0; d < S.ndim; d++) {
            uint32_t bit = 1u << d;
            if (w.size[d] == 1) {
                snprintf(S.c[d], sizeof S.c[d], "0");
                S.known |= P->part ? bit : 0u; /* lo = hi - 1 = 0 */
                S.hi[d] = 1;
                S.varies &= ~bit;
                continue;
            }
            snprintf(S.c[d], sizeof S.c[d], "s%d_%d", vw, (int)d);
            af_strbuf_printf(sb, "%sconst %s s%d_%d = %s - (%" PRId64 ");\n", inner, it, vw, (int)d, P->c[d], w.left[d]);
            /* in a part: P's range, shifted (and inside the guard, inside the source) */
            int guarded = (int)((w.guard_mask >> d) & 1u);
            if (!P->part || !((P->known & bit) || guarded)) continue;
            S.known |= bit;
            S.lo[d] = (P->known & bit) ? P->lo[d] - w.left[d] : 0;
            S.hi[d] = (P->known & bit) ? P->hi[d] - w.left[d] : w.size[d];
            if (guarded && S.lo[d] < 0) S.lo[d] = 0;
            if (guarded && S.hi[d] > w.size[d]) S.hi[d] = w.size[d];
            S.tracked |= P->tracked & bit;
            S.shift[d] = P->shift[d] + w.left[d];
        }
        const af_value *src = af_graph_value(g, w.source);
        int32_t value = w.source, sm = frame_member(g, grp, grp->nodes[member], w.source);
        if (sm >= 0 && is_view(af_graph_node(g, grp->nodes[sm]))) { /* remapped: x's element at the view's storage offset */
            while ((sm = frame_member(g, grp, grp->nodes[member], value)) >= 0 && is_view(af_graph_node(g, grp->nodes[sm])))
                value = af_graph_node(g, grp->nodes[sm])->args[0].u.value;
            const af_tensor_meta *xm = &af_graph_value(g, value)->meta;
            F.ndim = xm->ndim;
            for (int32_t d = 0; d < F.ndim; d++) {
                if (xm->sizes[d] == 1) {
                    snprintf(F.c[d], sizeof F.c[d], "0");
                    continue;
                }
                snprintf(F.c[d], sizeof F.c[d], "u%d_%d", vw, (int)d);
                uint32_t used = emit_unravel(off, sizeof off, &S, w.size, &src->meta, src->meta.storage_offset - xm->storage_offset,
                                             xm->strides[d], xm->sizes[d], it);
                F.varies |= (used & S.varies) ? 1u << d : 0u; /* it reads a moving coordinate */
                af_strbuf_printf(sb, "%sconst %s u%d_%d = %s;\n", inner, it, vw, (int)d, off);
            }
        } else {
            F = S;
        }
        if (frame_member(g, grp, grp->nodes[member], value) >= 0) {
            emit_frame(sb, g, grp, ops, grp->nodes[member], &F, it, inner);
            af_strbuf_printf(sb, "%sv%d = v%d;\n", inner, vw, (int)value);
        } else { /* an input */
            int32_t k = 0;
            while (k < grp->n_inputs && grp->inputs[k] != w.source) k++;
            char ptr[16];
            snprintf(ptr, sizeof ptr, "q%d", (int)k);
            frame_offset(off, sizeof off, &F, &src->meta, 0, it);
            af_strbuf_printf(sb, "%sv%d = ", inner, vw);
            emit_clamped_load(sb, ops[k].dtype, ptr, off, guard);
            af_strbuf_printf(sb, ";\n");
        }
    }
    if (straight) af_strbuf_printf(sb, "%sv%d = %s ? v%d : ", inner, vw, guard, vw);
    else af_strbuf_printf(sb, "%s} else {\n%sv%d = ", indent, inner, vw);
    if (w.base >= 0) af_strbuf_printf(sb, "v%d", (int)w.base);
    else emit_scalar(sb, &fill, fill_as);
    af_strbuf_printf(sb, ";\n%s}\n", indent);
}

/* Window W's shifted members at frame f: the inputs they read (a window's base, not its source)
 * loaded at f's coordinates, then the members in order (views are only index arithmetic). */
static void emit_frame(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops, int32_t window,
                       const af_frame *f, const char *it, const char *indent) {
    char ptr[16], off[4096];
    for (int32_t k = 0; k < grp->n_inputs; k++) {
        if (!shifted_reads(g, grp, window, k)) continue;
        snprintf(ptr, sizeof ptr, "q%d", (int)k);
        frame_offset(off, sizeof off, f, &af_graph_value(g, grp->inputs[k])->meta, 0, it);
        af_strbuf_printf(sb, "%sconst float v%d = ", indent, (int)grp->inputs[k]);
        emit_clamped_load(sb, ops[k].dtype, ptr, off, f->guard);
        af_strbuf_printf(sb, ";\n");
    }
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        if (!shifted(grp, m) || grp->window_of[m] != window) continue;
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        if (is_view(n)) continue;
        if (af_fuse_window(g, grp->nodes[m], NULL)) emit_explicit_window(sb, g, grp, ops, m, f, it, indent);
        else emit_pointwise(sb, g, n, indent, -1);
    }
}

static void emit_members_impl(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                              const char *indent, const char *acc_at, const int32_t *phases, int32_t phase, int modes,
                              const uint8_t *cached, const char *at, af_cg_part *part);

/* Emits the members' element computation (pointwise values as floats; reductions combined into
 * their accumulators acc<value>). */
void af_cg_emit_members(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *indent,
                         const char *acc_at, const int32_t *phases, int32_t phase, int modes) {
    emit_members_impl(sb, g, grp, NULL, indent, acc_at, phases, phase, modes, NULL, "i", NULL);
}

void af_cg_emit_members_cached(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *indent,
                               const char *acc_at, const int32_t *phases, int32_t phase, int modes, const uint8_t *cached,
                               const char *at) {
    emit_members_impl(sb, g, grp, NULL, indent, acc_at, phases, phase, modes, cached, at, NULL);
}

/* ops: the kernel's operands, needed by window members (only af_cg_emit_body's pointwise kernels
 * have them: fuse.c keeps windows out of reduction groups). part: the loop part emitted, or NULL. */
static void emit_members_impl(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                              const char *indent, const char *acc_at, const int32_t *phases, int32_t phase, int modes,
                              const uint8_t *cached, const char *at, af_cg_part *part) {
    af_frame root = {.ndim = 0, .part = part};
    const char *it = "int64_t";
    int explicit = ops && af_cg_explicit(g, grp);
    if (ops && (explicit || part)) { /* the kernel's frame: its coordinate operands (o<c> in plain windows) */
        it = explicit ? frame_index_type(g, grp) : it;
        const af_tensor_meta *iter = &af_graph_value(g, grp->iter_value)->meta;
        uint32_t coords = coord_dims(g, grp);
        root.ndim = iter->ndim;
        for (int32_t d = 0; d < iter->ndim; d++) {
            int32_t c = grp->n_inputs + grp->n_outputs + popcount32(coords & ((1u << d) - 1u));
            if ((coords >> d) & 1u) snprintf(root.c[d], sizeof root.c[d], "((%s)o%d)", it, (int)c);
            else snprintf(root.c[d], sizeof root.c[d], "0");
            if (!part) continue;
            root.known |= 1u << d; /* every coordinate in [0, size), the part's dim in [lo, hi) */
            root.lo[d] = d == part->dim ? part->lo : 0;
            root.hi[d] = d == part->dim ? part->hi : iter->sizes[d];
            root.tracked |= d == part->dim ? 1u << d : 0u;
        }
        root.varies = part && part->dim >= 0 && !part->row ? 1u << part->dim : 0u;
        root.straight = part != NULL; /* offset 0 of every input is an element */
        for (int32_t k = 0; k < grp->n_inputs && root.straight; k++) {
            const af_tensor_meta *in = &af_graph_value(g, grp->inputs[k])->meta;
            root.straight = in->type != AF_VALUE_TENSOR || af_tensor_meta_numel(in) > 0;
        }
    }
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        const af_op_info *info = af_op_get(n->op_id);
        af_window win;
        if (shifted(grp, m)) continue; /* computed inside its window's guard */
        if (af_fuse_window(g, grp->nodes[m], &win)) {
            if (explicit) emit_explicit_window(sb, g, grp, ops, m, &root, it, indent);
            else if (ops) emit_window(sb, g, grp, ops, m, &win, part ? &root : NULL, indent);
            else af_strbuf_printf(sb, "%s#error \"aotfuse: a window member outside a pointwise kernel\"\n", indent);
            continue;
        }
        if (phases && ((phases[m] & AF_CG_ROW) || (info->kind == AF_KIND_REDUCTION ? phases[m] != phase : phases[m] > phase)))
            continue;
        if (cached && cached[m] && phases[m] < phase) { /* computed in its own phase's pass, read back */
            af_strbuf_printf(sb, "%sconst float v%d = c%d[%s]; /* %s, cached */\n", indent, (int)n->first_output,
                             (int)n->first_output, at, n->op);
            continue;
        }
        if (info->kind == AF_KIND_REDUCTION) {
            int32_t x = n->args[0].u.value, v = n->first_output;
            if ((modes & AF_CG_FLOAT_SUMS) && (n->op_id == AF_OP_SUM || n->op_id == AF_OP_MEAN)) {
                af_strbuf_printf(sb, "%saccf%d%s += v%d;\n", indent, (int)v, acc_at, (int)x);
                continue;
            }
            if ((modes & AF_CG_NAN_FLAGS) && (n->op_id == AF_OP_AMAX || n->op_id == AF_OP_AMIN)) {
                /* a plain max/min in float, exact (an OpenMP max/min reduction, vectorized at full
                 * width) and a NaN flag (an or-reduction) */
                af_strbuf_printf(sb, "%sacc%d = v%d %s acc%d ? v%d : acc%d; nan%d |= v%d != v%d;\n", indent, (int)v,
                                 (int)x, n->op_id == AF_OP_AMAX ? ">" : "<", (int)v, (int)x, (int)v, (int)v, (int)x, (int)x);
                continue;
            }
            if (modes & AF_CG_FLOAT_ACC) {
                const char *f = n->op_id == AF_OP_AMAX ? "af_max" : n->op_id == AF_OP_AMIN ? "af_min" : NULL;
                if (f) af_strbuf_printf(sb, "%sacc%d%s = %s(acc%d%s, v%d);\n", indent, (int)v, acc_at, f, (int)v, acc_at, (int)x);
                else af_strbuf_printf(sb, "%sacc%d%s += v%d;\n", indent, (int)v, acc_at, (int)x);
                continue;
            }
            if (n->op_id == AF_OP_AMAX)
                af_strbuf_printf(sb, "%sacc%d%s = af_maxd(acc%d%s, (double)v%d);\n", indent, (int)v, acc_at, (int)v, acc_at, (int)x);
            else if (n->op_id == AF_OP_AMIN)
                af_strbuf_printf(sb, "%sacc%d%s = af_mind(acc%d%s, (double)v%d);\n", indent, (int)v, acc_at, (int)v, acc_at, (int)x);
            else af_strbuf_printf(sb, "%sacc%d%s += (double)v%d;\n", indent, (int)v, acc_at, (int)x);
            continue;
        }
        if (n->op_id == AF_OP_RNG_UNIFORM) { /* key = seed + stream (fuse.c admits 0 <= stream < 2^31) */
            int64_t stream = n->n_args > 2 && n->args[2].kind == AF_ARG_INT ? n->args[2].u.i : 0;
            int seed = (int)n->args[0].u.value;
            af_strbuf_printf(sb, "%sfloat v%d = af_rand(sv%d + %" PRId64 "ull, iv%d); /* %s */\n", indent, (int)n->first_output,
                             seed, stream, seed, n->op);
            if (cached && cached[m]) af_strbuf_printf(sb, "%sc%d[%s] = v%d;\n", indent, (int)n->first_output, at, (int)n->first_output);
            continue;
        }
        emit_pointwise(sb, g, n, indent, row_divisor(g, grp, phases, m));
        if (cached && cached[m]) af_strbuf_printf(sb, "%sc%d[%s] = v%d;\n", indent, (int)n->first_output, at, (int)n->first_output);
    }
}

static int reads_value(const af_node *n, int32_t v) {
    for (int32_t a = 0; a < n->n_args; a++)
        if (n->args[a].kind == AF_ARG_VALUE && n->args[a].u.value == v) return 1;
    return 0;
}

uint8_t *af_cg_phase_cache(const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int64_t inner,
                           int64_t max_bytes, int random_only) {
    uint8_t *cached = calloc((size_t)grp->n_nodes + 1, 1), *later = calloc((size_t)grp->n_nodes + 1, 1);
    if (!cached || !later) {
        free(cached);
        free(later);
        return NULL;
    }
    int64_t bytes = 0;
    for (int32_t m = grp->n_nodes - 1; m >= 0; m--) { /* readers come after their producers */
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        if ((phases[m] & AF_CG_ROW) || af_op_get(n->op_id)->kind == AF_KIND_REDUCTION) continue;
        /* needed in its own phase (a reader there, or stored as an output), and in which later ones */
        int now = 0, phases_later = 0;
        int32_t seen = -1;
        for (int32_t o = 0; o < grp->n_outputs && !now; o++) now = grp->outputs[o] == n->first_output;
        for (int32_t k = m + 1; k < grp->n_nodes; k++) {
            if ((phases[k] & AF_CG_ROW) || !reads_value(af_graph_node(g, grp->nodes[k]), n->first_output)) continue;
            /* a reader in a later phase, or one of this phase that a later phase evaluates again */
            later[m] |= phases[k] > phases[m] || (later[k] && !cached[k]);
            if (phases[k] == phases[m]) now = 1;
            else if (phases[k] > phases[m] && phases[k] != seen) phases_later++, seen = phases[k];
        }
        /* a value no member of its own phase reads, read in one later phase only, is computed there
         * (its own phase's copy is dead code), not stored and loaded back: the log-softmax backward's
         * exp(out) at [512, 8192] fp32 3.78 -> 3.01 ms (ATen's 3.07), the cross entropy's forward and
         * backward 7.91 -> 6.58 (benchmarks/results/phase-cache-cpu-2026-12-06.md) */
        int one_later = !now && phases_later == 1;
        int wanted = random_only ? n->op_id == AF_OP_RNG_UNIFORM : af_op_expensive(af_op_get(n->op_id));
        if (later[m] && !one_later && wanted && bytes + inner * 4 <= max_bytes) {
            cached[m] = 1;
            bytes += inner * 4;
        }
    }
    free(later);
    return cached;
}

int af_cg_is_reduction_value(const af_graph *g, int32_t v) {
    int32_t p = af_graph_value(g, v)->producer;
    return p >= 0 && af_op_get(af_graph_node(g, p)->op_id)->kind == AF_KIND_REDUCTION;
}

/* The kernel's typed data pointers q<k>: inputs first (const), then outputs. */
int32_t af_cg_in_place_input(const af_graph *g, const af_fusion_group *grp, int32_t k) {
    if (k < 0 || k >= grp->n_outputs || grp->iter_value < 0 || af_cg_has_window(g, grp)) return -1;
    int32_t o = grp->outputs[k];
    const af_tensor_meta *om = &af_graph_value(g, o)->meta, *im = &af_graph_value(g, grp->iter_value)->meta;
    if (om->type != AF_VALUE_TENSOR || om->storage_offset != 0 || !af_tensor_meta_dense(om) || om->ndim != im->ndim)
        return -1;
    for (int32_t d = 0; d < om->ndim; d++)
        if (om->sizes[d] != im->sizes[d]) return -1;
    int32_t mo = 0;
    while (mo < grp->n_nodes && af_graph_node(g, grp->nodes[mo])->first_output != o) mo++;
    if (mo == grp->n_nodes) return -1;
    if (grp->n_reductions > 0) { /* stored in the last pass over the row, after which nothing reads */
        int32_t last = 0, *phases = af_cg_phases(g, grp, &last);
        if (!phases) return -1;
        int ok = (phases[mo] & AF_CG_ROW) == 0 && phases[mo] == last;
        free(phases);
        if (!ok) return -1;
    }
    for (int32_t j = 0; j < grp->n_inputs; j++) {
        const af_tensor_meta *dm = &af_graph_value(g, grp->inputs[j])->meta;
        if (dm->type == AF_VALUE_TENSOR && af_tensor_meta_same_layout(dm, om, 1)) return j;
    }
    return -1;
}

int af_cg_may_alias(const af_graph *g, const af_fusion_group *grp, int32_t k) {
    if (!g) return 0;
    if (k >= grp->n_inputs) return af_cg_in_place_input(g, grp, k - grp->n_inputs) >= 0;
    for (int32_t o = 0; o < grp->n_outputs; o++)
        if (af_cg_in_place_input(g, grp, o) == k) return 1;
    return 0;
}

void af_cg_emit_pointers(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops) {
    for (int32_t k = 0; k < grp->n_inputs + grp->n_outputs; k++)
        af_strbuf_printf(sb, "  %s%s *%sq%d = (%s%s *)p[%d];\n", k < grp->n_inputs ? "const " : "",
                         af_cg_ctype(ops[k].dtype), af_cg_may_alias(g, grp, k) ? "" : "restrict ", (int)k,
                         k < grp->n_inputs ? "const " : "", af_cg_ctype(ops[k].dtype), (int)k);
}

void af_cg_emit_loads(af_strbuf *sb, const af_fusion_group *grp, const af_cg_operand *ops) {
    for (int32_t k = 0; k < grp->n_inputs; k++) {
        if (ops[k].window_only) continue; /* read by window members at their own offsets */
        if (ops[k].dtype == AF_DTYPE_INT64) { /* a random node's seed and the element's counter */
            /* counters below 2^32 as 32-bit values (af_rand's high word is then 0): loops stay 32-bit wide */
            const char *it = ops[k].narrow_counter ? "uint32_t" : "uint64_t";
            af_strbuf_printf(sb, "      const uint64_t sv%d = (uint64_t)q%d[0]; const %s iv%d = (%s)o%d;\n", (int)ops[k].value, (int)k,
                             it, (int)ops[k].value, it, (int)k);
            continue;
        }
        char ptr[16], off[16];
        snprintf(ptr, sizeof ptr, "q%d", (int)k);
        snprintf(off, sizeof off, "o%d", (int)k);
        af_strbuf_printf(sb, "      const float v%d = ", (int)ops[k].value);
        af_cg_emit_load(sb, ops[k].dtype, ptr, off);
        af_strbuf_printf(sb, "; (void)v%d;\n", (int)ops[k].value);
    }
}

/* Whether v is a bf16 value that emit_pointwise computed for a member of grp (or a phase's
 * reduction, rounded at its phase's end), so it holds af_bf16_round's result and its store needs
 * only its upper half (af_bf16_bits: cross entropy's bf16 gradient kernel 3.3 -> 2.95 ms at 512 x
 * 8192). Windows' values (a float fill, a base, a load) and random numbers are not rounded. */
static int rounded_bf16(const af_graph *g, const af_fusion_group *grp, int32_t v) {
    const af_value *val = af_graph_value(g, v);
    if (val->meta.dtype != AF_DTYPE_BFLOAT16 || val->producer < 0) return 0;
    int32_t m = 0;
    while (m < grp->n_nodes && grp->nodes[m] != val->producer) m++;
    af_window w;
    return m < grp->n_nodes && af_graph_node(g, val->producer)->op_id != AF_OP_RNG_UNIFORM && !af_fuse_window(g, val->producer, &w);
}

/* Whether bf16 value v holds a bf16 number exactly: a rounded member (rounded_bf16), an input
 * (loaded from bf16 storage), or a window's value whose source and base are (its fill is rounded
 * as its dtype holds it: emit_scalar). A cat's windows copying bf16 inputs then store the bits
 * (GPT2's q, k, v gradients joined in bf16: 0.097 -> 0.049 ms at [4, 128, 768]). */
static int exact_bf16(const af_graph *g, const af_fusion_group *grp, int32_t v, int depth) {
    if (rounded_bf16(g, grp, v)) return 1;
    const af_value *val = af_graph_value(g, v);
    if (val->meta.dtype != AF_DTYPE_BFLOAT16 || depth > AF_MAX_DIMS * 4) return 0;
    for (int32_t k = 0; k < grp->n_inputs; k++)
        if (grp->inputs[k] == v) return 1;
    int32_t m = 0;
    while (m < grp->n_nodes && grp->nodes[m] != val->producer) m++;
    af_window w;
    if (val->producer < 0 || m == grp->n_nodes || !af_fuse_window(g, val->producer, &w)) return 0;
    return (w.source < 0 || exact_bf16(g, grp, w.source, depth + 1)) && (w.base < 0 || exact_bf16(g, grp, w.base, depth + 1));
}

void af_cg_emit_store_at(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *indent, int32_t k,
                         af_dtype dtype, const char *off_prefix, int32_t v) {
    char val[16];
    snprintf(val, sizeof val, "v%d", (int)v);
    af_strbuf_printf(sb, "%sq%d[%s%d] = ", indent, (int)k, off_prefix, (int)k);
    if (dtype == AF_DTYPE_BFLOAT16 && exact_bf16(g, grp, v, 0)) af_strbuf_printf(sb, "af_bf16_bits(%s)", val);
    else af_cg_emit_store_value(sb, dtype, val);
    af_strbuf_printf(sb, ";\n");
}

/* One element, at offsets o<k>: load the inputs, compute the members, store the elementwise
 * outputs (reductions are stored after their loop). */
static void emit_body(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                      const char *acc_at, int modes, af_cg_part *part) {
    af_cg_emit_loads(sb, grp, ops);
    emit_members_impl(sb, g, grp, ops, "      ", acc_at, NULL, 0, modes, NULL, "i", part);
    for (int32_t k = grp->n_inputs; k < grp->n_inputs + grp->n_outputs; k++) {
        if (!af_cg_is_reduction_value(g, ops[k].value)) af_cg_emit_store_at(sb, g, grp, "      ", k, ops[k].dtype, "o", ops[k].value);
    }
}

void af_cg_emit_body(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                     const char *acc_at, int modes) {
    emit_body(sb, g, grp, ops, acc_at, modes, NULL);
}

void af_cg_emit_body_part(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops, af_cg_part *part) {
    emit_body(sb, g, grp, ops, "", 0, part);
}

/* A reduction output's strides over the iteration dims: 0 on reduced dims, the output's own
 * stride on the others (skipping removed dims when keepdim is false). */
static void reduction_strides(const af_tensor_meta *out, const af_tensor_meta *iter, uint32_t mask, int64_t *strides) {
    int keep = out->ndim == iter->ndim;
    int32_t od = 0;
    for (int32_t d = 0; d < iter->ndim; d++) {
        int reduced = (mask >> d) & 1u;
        if (reduced) {
            strides[d] = 0;
            if (keep) od++;
        } else {
            strides[d] = out->sizes[od] == 1 ? 0 : out->strides[od];
            od++;
        }
    }
}

/* A random node's seed (the only int64 operand the fuser admits): its "offset" o<k> is the
 * element's row-major index in the random node's output (the generator's counter), so its strides
 * are that output's contiguous strides; the seed itself is always read at q<k>[0]. */
static int random_index_strides(const af_graph *g, const af_fusion_group *grp, int32_t seed, const af_tensor_meta *iter,
                                int64_t *strides) {
    memset(strides, 0, sizeof(int64_t) * AF_MAX_DIMS);
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        if (n->op_id != AF_OP_RNG_UNIFORM || n->args[0].kind != AF_ARG_VALUE || n->args[0].u.value != seed) continue;
        const af_tensor_meta *out = &af_graph_value(g, n->first_output)->meta;
        int64_t s = 1;
        int32_t shift = iter->ndim - out->ndim;
        for (int32_t d = out->ndim - 1; d >= 0; d--) {
            if (d + shift >= 0 && out->sizes[d] != 1) strides[d + shift] = s;
            s *= out->sizes[d];
        }
        return s <= (INT64_C(1) << 32); /* every counter fits in 32 bits: the same numbers, cheaper */
    }
    return 0;
}

/* The kernel's operands (inputs, then outputs) with their strides over the iteration dims;
 * NULL when out of memory. */
static af_cg_operand *make_operands(const af_graph *g, const af_fusion_group *grp, const af_tensor_meta *iter) {
    int32_t nops = grp->n_inputs + grp->n_outputs;
    af_cg_operand *ops = calloc((size_t)nops + AF_MAX_DIMS + 1, sizeof *ops); /* room for coordinate operands */
    for (int32_t k = 0; ops && k < nops; k++) {
        int32_t v = k < grp->n_inputs ? grp->inputs[k] : grp->outputs[k - grp->n_inputs];
        const af_tensor_meta *m = &af_graph_value(g, v)->meta;
        ops[k].value = v;
        ops[k].dtype = m->dtype;
        if (k >= grp->n_inputs && af_cg_is_reduction_value(g, v)) reduction_strides(m, iter, grp->reduce_mask, ops[k].strides);
        else if (m->dtype == AF_DTYPE_INT64) ops[k].narrow_counter = random_index_strides(g, grp, v, iter, ops[k].strides);
        else operand_strides(m, iter, ops[k].strides);
    }
    return ops;
}

/* Splits the flat index `var` over dims hi..lo (innermost first) and adds each coordinate times the
 * af_cg_operand's stride to the offsets <prefix><k>. */
void af_cg_emit_unflatten(af_strbuf *sb, const char *indent, const char *itype, const char *var, const char *prefix, int32_t lo,
                          int32_t hi, const int64_t *sizes, int64_t (*strides)[AF_MAX_DIMS], int32_t nops) {
    for (int32_t d = hi; d >= lo; d--) {
        af_strbuf_printf(sb, "%s{ %s x = %s %% %" PRId64 "; %s /= %" PRId64 ";", indent, itype, var, sizes[d], var, sizes[d]);
        for (int32_t k = 0; k < nops; k++)
            if (strides[k][d]) af_strbuf_printf(sb, " %s%d += x * %" PRId64 ";", prefix, (int)k, strides[k][d]);
        af_strbuf_printf(sb, " }\n");
    }
}

/* Stores each finished reduction: row mode at the kept-dims base offset b<k>; column mode (strides
 * given) at column c of the block, accumulator acc<v>[c - c0]. */
void af_cg_emit_reduction_stores(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                                  int64_t count, int64_t (*column_strides)[AF_MAX_DIMS], const char *indent) {
    for (int32_t k = grp->n_inputs; k < grp->n_inputs + grp->n_outputs; k++) {
        if (!af_cg_is_reduction_value(g, ops[k].value)) continue;
        int32_t v = ops[k].value;
        const af_node *n = af_graph_node(g, af_graph_value(g, v)->producer);
        const char *at = column_strides ? "[c - c0]" : "";
        char val[96], off[64];
        if (n->op_id == AF_OP_MEAN) snprintf(val, sizeof val, "(float)(acc%d%s / (double)%" PRId64 ")", (int)v, at, count); /* a liftable count */
        else snprintf(val, sizeof val, "(float)acc%d%s", (int)v, at);
        if (column_strides) snprintf(off, sizeof off, "c * %" PRId64, column_strides[k][0]);
        else snprintf(off, sizeof off, "b%d", (int)k);
        af_strbuf_printf(sb, "%sq%d[%s] = ", indent, (int)k, off);
        af_cg_emit_store_value(sb, ops[k].dtype, val);
        af_strbuf_printf(sb, ";\n");
    }
}


int32_t *af_cg_phases(const af_graph *g, const af_fusion_group *grp, int32_t *max_phase) {
    int32_t *phase = calloc((size_t)grp->n_nodes + 1, sizeof *phase);
    if (!phase) return NULL;
    const af_tensor_meta *iter = &af_graph_value(g, grp->iter_value)->meta;
    *max_phase = 0;
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        int reduction = af_op_get(n->op_id)->kind == AF_KIND_REDUCTION;
        const af_tensor_meta *om = &af_graph_value(g, n->first_output)->meta;
        int row = 0;
        if (!reduction) { /* a row member: its shape is not the iteration shape */
            row = om->ndim != iter->ndim;
            for (int32_t d = 0; !row && d < om->ndim; d++) row = om->sizes[d] != iter->sizes[d];
        }
        int32_t ph = 0;
        for (int32_t a = 0; a < n->n_args; a++) {
            if (n->args[a].kind != AF_ARG_VALUE) continue;
            int32_t producer = af_graph_value(g, n->args[a].u.value)->producer;
            for (int32_t k = 0; k < m; k++) { /* members come in graph order: producers first */
                if (grp->nodes[k] != producer) continue;
                int from_row = (phase[k] & AF_CG_ROW) || af_op_get(af_graph_node(g, producer)->op_id)->kind == AF_KIND_REDUCTION;
                int32_t p = (phase[k] & ~AF_CG_ROW) + (from_row && !reduction && !row ? 1 : 0);
                if (p > ph) ph = p;
            }
        }
        phase[m] = ph | (row ? AF_CG_ROW : 0);
        if (ph > *max_phase) *max_phase = ph;
    }
    return phase;
}

const char *af_cg_acc_init(const af_node *n) {
    return n->op_id == AF_OP_AMAX ? "-INFINITY" : n->op_id == AF_OP_AMIN ? "INFINITY" : "0.0";
}

void af_cg_emit_acc_decls(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const char *ctype, const char *indent) {
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        if (af_op_get(n->op_id)->kind == AF_KIND_REDUCTION)
            af_strbuf_printf(sb, "%s%s acc%d = %s;\n", indent, ctype, (int)n->first_output, af_cg_acc_init(n));
    }
}

int af_cg_narrow_index(const af_cg_space *sp) {
    int64_t hi = sp->numel;
    for (int32_t k = 0; k < sp->nops; k++) {
        int64_t reach = 0;
        for (int32_t d = 0; d < sp->nd; d++) reach += (sp->sizes[d] - 1) * (sp->strides[k][d] < 0 ? -sp->strides[k][d] : sp->strides[k][d]);
        if (reach > hi) hi = reach;
    }
    return hi < (INT64_C(1) << 30);
}

void af_cg_space_free(af_cg_space *sp) {
    free(sp->ops);
    free(sp->strides);
    sp->ops = NULL;
    sp->strides = NULL;
}

/* Operand k's memory order of the iteration dims (largest stride outermost; dims of equal stride,
 * the size-1 ones, in their own order) into order. */
static void memory_order(const af_cg_operand *op, const af_tensor_meta *iter, int32_t *order) {
    const int64_t *s = op->strides;
    for (int32_t d = 0; d < iter->ndim; d++) order[d] = d;
    for (int32_t j = 1; j < iter->ndim; j++) /* insertion sort: stable */
        for (int32_t i = j; i > 0 && s[order[i]] > s[order[i - 1]]; i--) {
            int32_t t = order[i];
            order[i] = order[i - 1];
            order[i - 1] = t;
        }
}

/* What walking the iteration dims in `order` costs a pointwise kernel, counting its full-size
 * operands (no broadcast dim) not contiguous along the inner loop: 4 for one at a far stride (at
 * least AF_FAR_STRIDE elements: each access a new line, past what the cache keeps for the next outer
 * step), load or store; 2 for an output at a nearer stride (a scatter); 1 for an input at one (a
 * gather). Transposing copies alone, one thread: a ReLU of [16, 32, 32, 32] into channels-last read
 * at a stride of 1024 in the output's order (1.38 ms fp32), stored at one of 32 in the input's
 * (0.38 ms); the last two dims of [96, 64, 512] 6.6 -> 3.7-4.6 ms the same way; but [96, 512, 64]
 * (a near load against a far store) ran 2.5 ms in the output's order against 3.8 in the input's
 * (bf16), and [8, 512, 768] (far both ways, a tie: the output's order) 3.9-4.5 against 8.9-9.0
 * (fp32). A gather and a scatter cost more than one scatter: ConvNeXt's channels-first layer norm
 * (an NCHW bf16 input, its normalized channels-last copy and an NCHW float32 product, strides of
 * 256 over 32 channels) walked in the copy's order read and wrote at a stride of 256, in the input's
 * it stores the copy at a stride of 32 alone. */
#define AF_FAR_STRIDE 512
static int order_cost(const af_fusion_group *grp, const af_cg_operand *ops, const af_tensor_meta *iter, const int32_t *order) {
    int32_t inner = -1;
    for (int32_t j = iter->ndim - 1; j >= 0 && inner < 0; j--)
        if (iter->sizes[order[j]] > 1) inner = order[j];
    if (inner < 0) return 0;
    int cost = 0;
    for (int32_t k = 0; k < grp->n_inputs + grp->n_outputs; k++) {
        int full = 1;
        for (int32_t d = 0; d < iter->ndim; d++) full &= iter->sizes[d] == 1 || ops[k].strides[d] != 0;
        int64_t st = ops[k].strides[inner] < 0 ? -ops[k].strides[inner] : ops[k].strides[inner];
        if (!full || st == 1) continue;
        cost += st >= AF_FAR_STRIDE ? 4 : k >= grp->n_inputs ? 2 : 1;
    }
    return cost;
}

/* The order a kernel's loops take the iteration dims in, outermost first: the dims' own order, but
 * for a pointwise kernel the memory order of one of its operands, so that the inner loop walks
 * memory: its first output's, unless (on the CPU) another full-size operand's order costs less
 * (order_cost: fewer loads and stores off the inner loop). Windows (pads, crops, slice assignments)
 * too on the CPU since 2026-12-05: their guards are coordinate operands, right in any order, and a
 * guard the inner loop does not move is chosen after its loads (emit_window). MobileNetV2's TF pads
 * of channels-last activations, and their backward's crops, were walked along W at a stride of C:
 * the pad of [16, 96, 32, 32] 2.93 -> 1.09 ms, the model's fused kernels 70.8 -> 41.4 ms a step in
 * fp32 (27.1 with af_cg_has_guarded_load's crops), its step 0.605 of the dims' order in fp32 and 0.444
 * in bf16 (benchmarks/results/mobilenet-cpu-2026-12-05.md). AOTFUSE_WINDOW_ORDER=0 keeps windows in
 * the dims' order (an A/B). A channels-last activation (strides [HWC, 1, WC, C] over [N, C, H, W]) was walked
 * along W with a stride of C, a gather and a scatter an element: a ReLU and its mask at [16, 64,
 * 16, 16] took 1.46 ms, now one flat loop. ResNet's stem writes its normalized, ReLU'd activation
 * only as the channels-last copy its max pool reads: walked in that copy's order it read the NCHW
 * input at a stride of 1024 (1.74 ms at [16, 32, 32, 32]), in the input's order it stores at a
 * stride of 32 instead (0.5 ms). Random numbers are unaffected: their counters are each element's
 * own index (random_index_strides), in whatever order the loop reaches it. */
static void loop_order(const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                       const af_tensor_meta *iter, uint32_t guards, int32_t *order) {
    for (int32_t d = 0; d < iter->ndim; d++) order[d] = d;
    if (grp->n_reductions > 0 || grp->n_outputs < 1) return;
    int cpu = iter->device.type == AF_DEVICE_CPU;
    /* windows on CUDA (unmeasured), and with AOTFUSE_WINDOW_ORDER=0 (an A/B): the dims' order */
    const char *e = getenv("AOTFUSE_WINDOW_ORDER");
    int windows_too = cpu && !(e && e[0] == '0' && e[1] == '\0');
    if (!windows_too && (guards || af_cg_has_window(g, grp))) return;
    memory_order(&ops[grp->n_inputs], iter, order);
    if (!cpu) return; /* CUDA: coalesced stores, as before (unmeasured otherwise) */
    int best = order_cost(grp, ops, iter, order);
    for (int32_t k = 0; k < grp->n_inputs + grp->n_outputs && best > 0; k++) {
        int32_t cand[AF_MAX_DIMS];
        memory_order(&ops[k], iter, cand);
        int cost = order_cost(grp, ops, iter, cand);
        if (cost < best) {
            best = cost;
            memcpy(order, cand, sizeof cand);
        }
    }
}

int af_cg_space_new(const af_graph *g, const af_fusion_group *grp, af_cg_space *sp) {
    memset(sp, 0, sizeof *sp);
    const af_tensor_meta *iter = &af_graph_value(g, grp->iter_value)->meta;
    uint32_t guards = coord_dims(g, grp);
    sp->nops = grp->n_inputs + grp->n_outputs + popcount32(guards);
    sp->ops = make_operands(g, grp, iter);
    sp->strides = calloc((size_t)sp->nops + 1, sizeof *sp->strides);
    if (!sp->ops || !sp->strides) {
        af_cg_space_free(sp);
        return af_error_set(AF_ERR_NOMEM, "out of memory generating code");
    }
    if (guards) { /* coordinate operands, and the inputs only windows read */
        int32_t c = grp->n_inputs + grp->n_outputs;
        for (int32_t d = 0; d < iter->ndim; d++)
            if ((guards >> d) & 1u) {
                sp->ops[c].value = -1;
                sp->ops[c].dtype = AF_DTYPE_INT64;
                sp->ops[c++].strides[d] = 1;
            }
    }
    if (af_cg_has_window(g, grp)) { /* inputs read only as a window's source: no plain load */
        uint8_t *plain = calloc((size_t)grp->n_inputs + 1, 1);
        if (!plain) {
            af_cg_space_free(sp);
            return af_error_set(AF_ERR_NOMEM, "out of memory generating code");
        }
        for (int32_t m = 0; m < grp->n_nodes; m++) { /* one parse per member */
            const af_node *n = af_graph_node(g, grp->nodes[m]);
            af_window w;
            int32_t source_arg = af_fuse_window(g, grp->nodes[m], &w) ? w.source_arg : -1;
            for (int32_t a = 0; a < n->n_args; a++)
                for (int32_t k = 0; k < grp->n_inputs && n->args[a].kind == AF_ARG_VALUE; k++)
                    if (n->args[a].u.value == grp->inputs[k]) {
                        if (a == source_arg || shifted(grp, m)) sp->ops[k].window_only = 1; /* read at shifted offsets */
                        else plain[k] = 1;
                    }
        }
        int explicit = af_cg_explicit(g, grp);
        for (int32_t k = 0; k < grp->n_inputs; k++) {
            sp->ops[k].window_only &= !plain[k];
            /* in explicit frames loaded at their own strides: no offset to keep */
            if (explicit && sp->ops[k].window_only) memset(sp->ops[k].strides, 0, sizeof sp->ops[k].strides);
        }
        free(plain);
    }
    int32_t nops = sp->nops, nd = 0;
    int reducing = grp->n_reductions > 0;
    int32_t order[AF_MAX_DIMS];
    loop_order(g, grp, sp->ops, iter, guards, order);
    for (int pass = 0; pass < (reducing ? 2 : 1); pass++)
        for (int32_t j = 0; j < iter->ndim; j++) {
            int32_t d = order[j];
            int reduced = reducing ? (int)((grp->reduce_mask >> d) & 1u) : 0;
            if (reduced != pass || iter->sizes[d] == 1) continue;
            int merge = nd > 0 && sp->cls[nd - 1] == reduced;
            for (int32_t k = 0; k < nops && merge; k++)
                merge = sp->strides[k][nd - 1] == sp->ops[k].strides[d] * iter->sizes[d];
            if (merge) {
                sp->sizes[nd - 1] *= iter->sizes[d];
                for (int32_t k = 0; k < nops; k++) sp->strides[k][nd - 1] = sp->ops[k].strides[d];
            } else {
                sp->sizes[nd] = iter->sizes[d];
                sp->cls[nd] = reduced;
                for (int32_t k = 0; k < nops; k++) sp->strides[k][nd] = sp->ops[k].strides[d];
                sp->n_kept += !reduced;
                nd++;
            }
        }
    sp->numel = 1;
    for (int32_t d = 0; d < iter->ndim; d++) sp->numel *= iter->sizes[d];
    sp->outer = sp->inner = 1;
    for (int32_t d = 0; d < nd; d++) {
        if (sp->cls[d]) sp->inner *= sp->sizes[d];
        else sp->outer *= sp->sizes[d];
    }
    if (nd == 0 && !reducing) { /* one element */
        sp->sizes[0] = 1;
        for (int32_t k = 0; k < nops; k++) sp->strides[k][0] = 0;
        nd = 1;
    }
    sp->nd = nd;
    /* a column reduction when the innermost dim that is not 1 is kept ([32, 9, 1] reduced over its
     * 9 is rows, as fuse.c's epilogue_ok has it) */
    int32_t innermost = iter->ndim - 1;
    while (innermost > 0 && iter->sizes[innermost] == 1) innermost--;
    sp->column = reducing && sp->n_kept == 1 && nd > 1 && innermost >= 0 && !((grp->reduce_mask >> innermost) & 1u);
    return AF_OK;
}

void af_cg_emit_phase_stores(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                             const int32_t *phases, int32_t ph, const char *indent) {
    for (int32_t k = grp->n_inputs; k < grp->n_inputs + grp->n_outputs; k++) {
        int32_t v = ops[k].value, m = 0;
        while (m < grp->n_nodes && af_graph_node(g, grp->nodes[m])->first_output != v) m++;
        if (af_cg_is_reduction_value(g, v) || m == grp->n_nodes || phases[m] != ph) continue; /* rows flagged: != ph */
        af_cg_emit_store_at(sb, g, grp, indent, k, ops[k].dtype, "o", v);
    }
}

/* `if (<guard>) ` before a store, or nothing. */
static void emit_guard(af_strbuf *sb, const char *indent, const char *guard) {
    if (guard) af_strbuf_printf(sb, "%sif (%s)\n  ", indent, guard);
}

void af_cg_emit_phase_end(af_strbuf *sb, const af_graph *g, const af_fusion_group *grp, const af_cg_operand *ops,
                          const int32_t *phases, int32_t ph, int64_t inner, int nan_flags, const char *indent, const char *guard) {
    int32_t nops = grp->n_inputs + grp->n_outputs;
    for (int32_t m = 0; m < grp->n_nodes; m++) {
        const af_node *n = af_graph_node(g, grp->nodes[m]);
        if (af_op_get(n->op_id)->kind != AF_KIND_REDUCTION || phases[m] != ph) continue;
        int v = (int)n->first_output;
        af_dtype dt = af_graph_value(g, v)->meta.dtype;
        if (nan_flags && (n->op_id == AF_OP_AMAX || n->op_id == AF_OP_AMIN))
            af_strbuf_printf(sb, "%sfloat v%d = nan%d ? (float)NAN : (float)acc%d;\n", indent, v, v, v);
        else if (n->op_id == AF_OP_MEAN)
            af_strbuf_printf(sb, "%sfloat v%d = (float)(acc%d / (double)%" PRId64 ");\n", indent, v, v, inner);
        else af_strbuf_printf(sb, "%sfloat v%d = (float)acc%d;\n", indent, v, v);
        if (dt == AF_DTYPE_BFLOAT16) af_strbuf_printf(sb, "%sv%d = af_bf16_round(v%d);\n", indent, v, v);
        else if (dt == AF_DTYPE_FLOAT16) af_strbuf_printf(sb, "%sv%d = af_f16_round(v%d);\n", indent, v, v);
        emit_row_reciprocal(sb, g, grp, phases, v, indent);
        for (int32_t k = grp->n_inputs; k < nops; k++)
            if (ops[k].value == v) {
                emit_guard(sb, indent, guard);
                af_cg_emit_store_at(sb, g, grp, indent, k, ops[k].dtype, "b", v);
            }
    }
    for (int32_t m = 0; m < grp->n_nodes; m++) { /* the phase's row members, once per row, in member order */
        if (phases[m] != (ph | AF_CG_ROW)) continue;
        af_fusion_group one = *grp; /* emit this member alone */
        one.nodes = &one.nodes[m];
        one.n_nodes = 1;
        af_cg_emit_members(sb, g, &one, indent, "", NULL, 0, 0);
        int32_t v = af_graph_node(g, grp->nodes[m])->first_output;
        emit_row_reciprocal(sb, g, grp, phases, v, indent);
        for (int32_t k = grp->n_inputs; k < nops; k++)
            if (ops[k].value == v) {
                emit_guard(sb, indent, guard);
                af_cg_emit_store_at(sb, g, grp, indent, k, ops[k].dtype, "b", v);
            }
    }
}

int af_cg_phase_has_reductions(const af_graph *g, const af_fusion_group *grp, const int32_t *phases, int32_t ph) {
    for (int32_t m = 0; m < grp->n_nodes; m++)
        if (phases[m] == ph && af_op_get(af_graph_node(g, grp->nodes[m])->op_id)->kind == AF_KIND_REDUCTION) return 1;
    return 0;
}

int af_cg_is_phased(const int32_t *phases, int32_t n_nodes, int32_t last_phase) {
    int rows = 0;
    for (int32_t m = 0; m < n_nodes; m++) rows |= (phases[m] & AF_CG_ROW) != 0;
    return last_phase > 0 || rows;
}

/* ------------------------------------------------------------------ kernels shared between groups */

static int ident_char(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

/* Locals named by node ids: v<id> values, c<id> phase caches, acc<id>/accf<id>/nan<id> and CUDA's
 * sacc<id>/saccf<id>/sh<id> accumulators, sv<id>/iv<id> random seeds and indices, s<id>_<dim> and
 * u<id>_<dim> a window's coordinates, g<id> a guard chosen after its loads, rc<id> a row value's
 * reciprocal; a column-phased kernel's ca<id> (a column's accumulator), cv<id> and cr<id> (its
 * block's row values and reciprocals). (A prefix missing here keeps a model's layers from sharing a body: the guards' g<id>
 * did, Longformer at host size 60 -> 170 bodies, its C compile 1.6 -> 3.3 s, until listed.) */
static int local_prefix(const char *t, size_t letters) {
    static const char *const prefixes[] = {"v",  "c",     "acc", "accf", "nan", "sv", "iv", "s",  "u",
                                           "g",  "sacc",  "saccf", "sh", "rc",  "ca", "cv", "cr"};
    for (size_t k = 0; k < sizeof prefixes / sizeof *prefixes; k++)
        if (strlen(prefixes[k]) == letters && !strncmp(t, prefixes[k], letters)) return 1;
    return 0;
}

/* At s: " + <digits>ull" after a random seed's name: the stream's value and the text's end. */
static int stream_at(const char *s, uint64_t *value, const char **end) {
    if (strncmp(s, " + ", 3) || s[3] < '0' || s[3] > '9') return 0;
    char *e;
    unsigned long long v = strtoull(s + 3, &e, 10);
    if (strncmp(e, "ull", 3)) return 0;
    *value = (uint64_t)v;
    *end = e + 3;
    return 1;
}

static int grow_ids(int64_t **ids, size_t *cap, size_t n) {
    if (n < *cap) return AF_OK;
    size_t nc = *cap ? 2 * *cap : 64;
    int64_t *grown = realloc(*ids, nc * sizeof *grown);
    if (!grown) return af_error_set(AF_ERR_NOMEM, "out of memory generating code");
    *ids = grown;
    *cap = nc;
    return AF_OK;
}

/* At s (a digit): the end of the preprocessing number starting there (C's pp-number: digits,
 * letters, '_', '.', and a sign after an exponent's e/E/p/P), so "1e-05f" is one token. */
static const char *number_end(const char *s) {
    const char *e = s + 1;
    for (;;) {
        if ((*e == '+' || *e == '-') && strchr("eEpP", e[-1])) e++;
        else if (ident_char(*e) || *e == '.') e++;
        else return e;
    }
}

/* Whether the number token [s, e) may become an argument (af_cg_shared): plain decimal digits
 * without a suffix or a leading zero, outside preprocessor lines, not an array's length or index
 * (`[N]`) nor a case label. */
static int liftable(const char *text, const char *s, const char *e, int in_directive) {
    if (in_directive || (*s == '0' && e - s > 1) || e - s > 18) return 0;
    for (const char *t = s; t < e; t++)
        if (*t < '0' || *t > '9') return 0;
    const char *b = s;
    while (b > text && (b[-1] == ' ' || b[-1] == '\t')) b--;
    if (b > text && b[-1] == '[') return 0;
    return !(b - text >= 4 && !strncmp(b - 4, "case", 4) && (b - text == 4 || !ident_char(b[-5])));
}

static int push_literal(af_cg_shared *out, size_t *cap, int64_t value, size_t at) {
    if ((size_t)out->n_lits == *cap) {
        size_t nc = *cap ? 2 * *cap : 32;
        int64_t *lits = realloc(out->lits, nc * sizeof *lits);
        if (!lits) return af_error_set(AF_ERR_NOMEM, "out of memory generating code");
        out->lits = lits;
        size_t *at_ = realloc(out->lit_at, nc * sizeof *at_);
        if (!at_) return af_error_set(AF_ERR_NOMEM, "out of memory generating code");
        out->lit_at = at_;
        *cap = nc;
    }
    out->lits[out->n_lits] = value;
    out->lit_at[out->n_lits++] = at;
    return AF_OK;
}

int af_cg_share(const char *text, int32_t index, int cuda, af_cg_shared *out) {
    memset(out, 0, sizeof *out);
    /* the kernel's streams, distinct, in order of first appearance (too many: left as constants) */
    int inline_streams = 0;
    for (const char *at = strstr(text, "af_rand(sv"); at && !inline_streams; at = strstr(at + 1, "af_rand(sv")) {
        const char *t = at + 10, *end;
        while (*t >= '0' && *t <= '9') t++;
        uint64_t v;
        if (!stream_at(t, &v, &end)) continue;
        int32_t j = 0;
        while (j < out->n_streams && out->streams[j] != v) j++;
        if (j < out->n_streams) continue;
        if (out->n_streams == AF_MAX_KERNEL_STREAMS) inline_streams = 1;
        else out->streams[out->n_streams++] = v;
    }
    if (inline_streams) out->n_streams = 0;
    char idx[16], sig[80];
    snprintf(idx, sizeof idx, "%d", (int)index);
    snprintf(sig, sizeof sig, "void af_kernel_%d(char *const *p) {", (int)index);
    size_t nidx = strlen(idx);
    const char *c_sig = cuda ? NULL : strstr(text, sig); /* C: the kernel becomes af_body_<index>(p, af_s, af_n, af_num_threads) */
    if (!cuda && !c_sig) return af_error_set(AF_ERR_INVALID, "codegen: kernel %d has no signature", (int)index);
    af_strbuf key = {0}, body = {0};
    int64_t *ids = NULL;
    size_t n_ids = 0, cap_ids = 0, cap_lits = 0;
    const char *s = text, *sig_close = NULL; /* CUDA: the ") {" closing the signature being copied */
    int st = AF_OK, in_directive = 0, line_start = 1;
    while (*s && st == AF_OK) {
        if (s == c_sig) {
            af_strbuf_printf(&body, "AF_BODY void af_body_%d(char *const *p, const uint64_t *af_s, const int64_t *af_n, int af_num_threads) {\n"
                             "  (void)af_s; (void)af_n; (void)af_num_threads;", (int)index);
            af_strbuf_printf(&key, "signature|");
            s += strlen(sig);
            line_start = 0;
            continue;
        }
        if (cuda && !strncmp(s, "extern \"C\" __global__", 21)) sig_close = strstr(s, ") {\n");
        if (s == sig_close) { /* the streams' parameters */
            for (int32_t j = 0; j < out->n_streams; j++) af_strbuf_printf(&body, ", const unsigned long long af_s%d", (int)j);
            af_strbuf_printf(&key, ", %d streams", (int)out->n_streams);
            sig_close = NULL;
        }
        if (s[0] == '/' && (s[1] == '*' || s[1] == '/')) { /* a comment: in the text only */
            const char *e = s[1] == '*' ? strstr(s + 2, "*/") : strchr(s, '\n');
            e = e ? e + (s[1] == '*' ? 2 : 0) : s + strlen(s);
            af_strbuf_printf(&body, "%.*s", (int)(e - s), s);
            s = e;
            continue;
        }
        if (*s == '\n') in_directive = 0, line_start = 1;
        else if (*s == '#' && line_start) in_directive = 1;
        else if (*s != ' ' && *s != '\t') line_start = 0;
        const char *e = s + 1;
        if (!ident_char(*s) || (*s >= '0' && *s <= '9')) { /* punctuation, or a number with its suffix */
            if (*s >= '0' && *s <= '9') {
                e = number_end(s);
                if (liftable(text, s, e, in_directive)) { /* '#' in the key, its value apart */
                    if ((st = push_literal(out, &cap_lits, strtoll(s, NULL, 10), body.len))) break;
                    af_strbuf_printf(&key, "#");
                    af_strbuf_printf(&body, "%.*s", (int)(e - s), s);
                    s = e;
                    continue;
                }
            }
            af_strbuf_printf(&body, "%.*s", (int)(e - s), s);
            af_strbuf_printf(&key, "%.*s", (int)(e - s), s);
            s = e;
            continue;
        }
        while (ident_char(*e)) e++;
        af_strbuf_printf(&body, "%.*s", (int)(e - s), s);
        if (e - s >= 10 + (long)nidx && !strncmp(s, "af_kernel_", 10) && !strncmp(s + 10, idx, nidx) &&
            (s + 10 + nidx == e || s[10 + nidx] == '_')) {
            af_strbuf_printf(&key, "af_kernel_@%.*s", (int)(e - s - 10 - (long)nidx), s + 10 + nidx); /* af_kernel_<index>[_v|_f] */
            s = e;
            continue;
        }
        /* <letters><id>(_<digits>)*, letters a local's prefix: named in the key by first appearance */
        size_t letters = 0;
        while (s + letters < e && s[letters] >= 'a' && s[letters] <= 'z') letters++;
        const char *d = s + letters, *id_end = d;
        while (id_end < e && *id_end >= '0' && *id_end <= '9') id_end++;
        int local = letters && id_end > d && local_prefix(s, letters);
        for (const char *t = id_end; t < e && local; t++) local = *t == '_' ? t + 1 < e && t[1] >= '0' && t[1] <= '9' : *t >= '0' && *t <= '9';
        if (!local) {
            af_strbuf_printf(&key, "%.*s", (int)(e - s), s);
            s = e;
            continue;
        }
        int64_t id = strtoll(d, NULL, 10);
        size_t o = 0;
        while (o < n_ids && ids[o] != id) o++;
        if (o == n_ids) {
            if ((st = grow_ids(&ids, &cap_ids, n_ids))) break;
            ids[n_ids++] = id;
        }
        af_strbuf_printf(&key, "%.*s%zu%.*s", (int)letters, s, o, (int)(e - id_end), id_end);
        int seed = letters == 2 && !strncmp(s, "sv", 2);
        s = e;
        uint64_t v;
        const char *end;
        int32_t j = 0;
        if (seed && out->n_streams && stream_at(s, &v, &end)) { /* af_rand(sv<id> + <stream>ull, ...) */
            while (j < out->n_streams && out->streams[j] != v) j++; /* collected above */
            if (j == out->n_streams) continue; /* not an af_rand's: stays a constant, in the key too */
            af_strbuf_printf(&key, " + S%d", (int)j);
            af_strbuf_printf(&body, cuda ? " + af_s%d" : " + af_s[%d]", (int)j);
            s = end;
        }
    }
    free(ids);
    if (st == AF_OK && body.failed) st = af_error_set(AF_ERR_NOMEM, "out of memory generating code");
    if (st) {
        free(key.buf);
        free(body.buf);
        af_cg_shared_free(out);
        return st;
    }
    if ((st = af_strbuf_finish(&key, &out->key))) {
        free(body.buf);
        af_cg_shared_free(out);
        return st;
    }
    if ((st = af_strbuf_finish(&body, &out->text))) {
        af_cg_shared_free(out);
        return st;
    }
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const char *c = out->key; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
    out->hash = h;
    return AF_OK;
}

int af_cg_same_skeleton(const af_cg_shared *a, const af_cg_shared *b) {
    return a->key && b->key && a->hash == b->hash && a->n_lits == b->n_lits && !strcmp(a->key, b->key);
}

int af_cg_same_key(const af_cg_shared *a, const af_cg_shared *b) {
    return af_cg_same_skeleton(a, b) && (!a->n_lits || !memcmp(a->lits, b->lits, (size_t)a->n_lits * sizeof *a->lits));
}

void af_cg_shared_free(af_cg_shared *s) {
    free(s->key);
    free(s->text);
    free(s->lits);
    free(s->lit_at);
    s->key = s->text = NULL;
    s->lits = NULL;
    s->lit_at = NULL;
    s->n_lits = 0;
}
