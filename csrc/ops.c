/* The op table as a const array, built from ops.def. */
#include "aotfuse/ops.h"

#include <stdlib.h>
#include <string.h>

static const af_op_info af_op_table[AF_OP_COUNT] = {
    [AF_OP_UNKNOWN] = {"extern", AF_KIND_EXTERN, NULL, AF_SCALAR_OPMATH},
#define AF_OP(e, name, kind, expr, scalars) [AF_OP_##e] = {name, kind, expr, scalars},
#include "ops.def"
#undef AF_OP
};

af_op_id af_op_lookup(const char *qualified_name) {
    if (!qualified_name) return AF_OP_UNKNOWN;
    /* the key is the name without its overload: "aten::add.Tensor" -> "aten::add" */
    const char *dot = strchr(qualified_name, '.');
    size_t len = dot ? (size_t)(dot - qualified_name) : strlen(qualified_name);
    for (int i = 1; i < AF_OP_COUNT; i++) {
        const char *name = af_op_table[i].name;
        if (strlen(name) == len && memcmp(name, qualified_name, len) == 0) return (af_op_id)i;
    }
    return AF_OP_UNKNOWN;
}

const af_op_info *af_op_get(af_op_id id) {
    if ((int)id <= 0 || id >= AF_OP_COUNT) return &af_op_table[AF_OP_UNKNOWN];
    return &af_op_table[id];
}

const char *af_op_kind_name(af_op_kind kind) {
    static const char *const names[AF_KIND_COUNT] = {
        "extern", "pointwise", "reduction", "view", "random", "compute"};
    return (kind >= 0 && kind < AF_KIND_COUNT) ? names[kind] : "invalid";
}

/* Whether an op's C expression names one of n calls. */
static int expr_calls(const af_op_info *info, const char *const *calls, size_t n) {
    if (!info || !info->c_expr) return 0;
    for (size_t k = 0; k < n; k++)
        if (strstr(info->c_expr, calls[k])) return 1;
    return 0;
}

int af_op_expensive(const af_op_info *info) {
    static const char *const calls[] = {"af_exp", "af_erf", "af_tanh", "af_log", "af_pow", "exp2f", "af_sin", "af_cos",
                                        "tanf", "atanf", "erfcf", "af_rand"};
    return expr_calls(info, calls, sizeof calls / sizeof calls[0]);
}

int af_vector_libm(void) {
    const char *e = getenv("AOTFUSE_VECTOR_LIBM");
    return !(e && e[0] == '0' && e[1] == '\0');
}

int af_op_costly_call(const af_op_info *info) {
    /* libm's scalar calls, and the prelude's sin and cos (vectorized, 2 ns an element: 6x exp) */
    static const char *const calls[] = {"exp2f(", "tanf(", "atanf(", "erfcf(", "af_sin(", "af_cos("};
    /* the prelude's log, log1p, log2, log10 and expm1 are libm's calls again when switched off */
    static const char *const logs[] = {"af_log", "af_expm1("};
    return expr_calls(info, calls, sizeof calls / sizeof calls[0]) ||
           (!af_vector_libm() && expr_calls(info, logs, sizeof logs / sizeof logs[0]));
}
