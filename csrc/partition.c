/* Partitioning a joint graph: min-cut rematerialization and the default split
 * (see include/aotfuse/partition.h). */
#include "aotfuse/partition.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "aotfuse/maxflow.h"

#define DIST_INF ((int64_t)1000000000)

/* What the partitioner knows about a joint graph. */
typedef struct {
    const af_graph *g;
    const uint8_t *roles;
    int32_t nv, nn, ni, no, nfwd;
    int32_t *input_role;  /* per value: its role if a graph input, else -1 */
    int32_t *arg_start;   /* per node: its argument value ids in args_flat (CSR, duplicates kept) */
    int32_t *args_flat;
    int32_t *user_start;  /* per value: the nodes reading it (CSR, one entry per read) */
    int32_t *users;
    uint8_t *is_output;   /* per value: a graph output */
    uint8_t *fw_required; /* per value: needed to compute the forward outputs */
    uint8_t *tangent;     /* per value: depends on a tangent (must be computed in the backward) */
    uint8_t *bw_required; /* per value: tangent closure and backward outputs */
    int64_t *dist;        /* per value: distance from the backward along users */
    uint8_t *mat_bw;      /* per value: the backward writes it out anyway (materialized_backward) */
} joint_ctx;

static void ctx_free(joint_ctx *c) {
    free(c->input_role);
    free(c->arg_start);
    free(c->args_flat);
    free(c->user_start);
    free(c->users);
    free(c->is_output);
    free(c->fw_required);
    free(c->tangent);
    free(c->bw_required);
    free(c->dist);
    free(c->mat_bw);
}

static void count_arg_values(const af_arg *a, int32_t *n) {
    if (a->kind == AF_ARG_VALUE) (*n)++;
    else if (a->kind == AF_ARG_LIST)
        for (int32_t i = 0; i < a->u.list.n; i++) count_arg_values(&a->u.list.items[i], n);
}

static void collect_arg_values(const af_arg *a, int32_t *out, int32_t *n) {
    if (a->kind == AF_ARG_VALUE) out[(*n)++] = a->u.value;
    else if (a->kind == AF_ARG_LIST)
        for (int32_t i = 0; i < a->u.list.n; i++) collect_arg_values(&a->u.list.items[i], out, n);
}

static af_op_kind value_kind(const joint_ctx *c, int32_t v) {
    int32_t producer = af_graph_value(c->g, v)->producer;
    return producer < 0 ? AF_KIND_EXTERN : af_op_get(af_graph_node(c->g, producer)->op_id)->kind;
}

static af_op_kind node_kind(const joint_ctx *c, int32_t n) { return af_op_get(af_graph_node(c->g, n)->op_id)->kind; }

static int kind_fusible(af_op_kind k) { return k == AF_KIND_POINTWISE || k == AF_KIND_REDUCTION || k == AF_KIND_VIEW; }

/* Would value v fuse into node n (so v need not be written to memory for it)? */
static int fusible(const joint_ctx *c, int32_t v, int32_t n) {
    return af_graph_value(c->g, v)->producer >= 0 && kind_fusible(value_kind(c, v)) && kind_fusible(node_kind(c, n));
}

static int materialized_backward(const joint_ctx *c, int32_t v, int32_t *stack, uint8_t *mark);

static int ctx_build(joint_ctx *c, const af_graph *g, const uint8_t *roles, int32_t num_fwd_outputs) {
    memset(c, 0, sizeof *c);
    c->g = g;
    c->roles = roles;
    c->nv = af_graph_num_values(g);
    c->nn = af_graph_num_nodes(g);
    c->ni = af_graph_num_inputs(g);
    c->no = af_graph_num_outputs(g);
    c->nfwd = num_fwd_outputs;
    if (num_fwd_outputs < 0 || num_fwd_outputs > c->no)
        return af_error_set(AF_ERR_INVALID, "num_fwd_outputs %d outside 0..%d", (int)num_fwd_outputs, (int)c->no);
    for (int32_t i = 0; i < c->ni; i++)
        if (roles[i] >= AF_ROLE_COUNT) return af_error_set(AF_ERR_INVALID, "input %d: bad role %d", (int)i, (int)roles[i]);
    size_t nv = (size_t)c->nv + 1, nn = (size_t)c->nn + 1;
    c->input_role = malloc(nv * sizeof(int32_t));
    c->arg_start = calloc(nn + 1, sizeof(int32_t));
    c->user_start = calloc(nv + 1, sizeof(int32_t));
    c->is_output = calloc(nv, 1);
    c->fw_required = calloc(nv, 1);
    c->tangent = calloc(nv, 1);
    c->bw_required = calloc(nv, 1);
    c->dist = malloc(nv * sizeof(int64_t));
    if (!c->input_role || !c->arg_start || !c->user_start || !c->is_output || !c->fw_required || !c->tangent ||
        !c->bw_required || !c->dist)
        return af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
    for (int32_t v = 0; v < c->nv; v++) c->input_role[v] = -1;
    for (int32_t i = 0; i < c->ni; i++) c->input_role[af_graph_input(g, i)] = roles[i];

    /* arguments (CSR) and users (CSR) */
    int32_t total = 0;
    for (int32_t n = 0; n < c->nn; n++) {
        const af_node *node = af_graph_node(g, n);
        c->arg_start[n] = total;
        for (int32_t a = 0; a < node->n_args; a++) count_arg_values(&node->args[a], &total);
    }
    c->arg_start[c->nn] = total;
    c->args_flat = malloc(((size_t)total + 1) * sizeof(int32_t));
    c->users = malloc(((size_t)total + 1) * sizeof(int32_t));
    if (!c->args_flat || !c->users) return af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
    for (int32_t n = 0, k = 0; n < c->nn; n++) {
        const af_node *node = af_graph_node(g, n);
        for (int32_t a = 0; a < node->n_args; a++) collect_arg_values(&node->args[a], c->args_flat, &k);
    }
    for (int32_t k = 0; k < total; k++) c->user_start[c->args_flat[k] + 1]++;
    for (int32_t v = 0; v < c->nv; v++) c->user_start[v + 1] += c->user_start[v];
    int32_t *fill = malloc(nv * sizeof(int32_t));
    if (!fill) return af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
    memcpy(fill, c->user_start, (size_t)c->nv * sizeof(int32_t));
    for (int32_t n = 0; n < c->nn; n++)
        for (int32_t k = c->arg_start[n]; k < c->arg_start[n + 1]; k++) c->users[fill[c->args_flat[k]]++] = n;
    free(fill);

    /* forward slice: what the forward outputs need (value ids are topologically ordered) */
    for (int32_t o = 0; o < c->no; o++) c->is_output[af_graph_output(g, o)] = 1;
    for (int32_t o = 0; o < c->nfwd; o++) c->fw_required[af_graph_output(g, o)] = 1;
    for (int32_t v = c->nv - 1; v >= 0; v--) {
        int32_t p = af_graph_value(g, v)->producer;
        if (!c->fw_required[v] || p < 0) continue;
        for (int32_t k = c->arg_start[p]; k < c->arg_start[p + 1]; k++) c->fw_required[c->args_flat[k]] = 1;
    }
    /* tangent closure, forward over the nodes */
    for (int32_t v = 0; v < c->nv; v++)
        if (c->input_role[v] == AF_ROLE_TANGENT || c->input_role[v] == AF_ROLE_BWD_SEED) c->tangent[v] = 1;
    for (int32_t n = 0; n < c->nn; n++) {
        int hit = 0;
        for (int32_t k = c->arg_start[n]; k < c->arg_start[n + 1] && !hit; k++) hit = c->tangent[c->args_flat[k]];
        if (!hit) continue;
        const af_node *node = af_graph_node(g, n);
        for (int32_t o = 0; o < node->n_outputs; o++) c->tangent[node->first_output + o] = 1;
    }
    for (int32_t v = 0; v < c->nv; v++) c->bw_required[v] = c->tangent[v];
    for (int32_t o = c->nfwd; o < c->no; o++) c->bw_required[af_graph_output(g, o)] = 1;
    /* distance from the backward: 0 outside the forward, else 1 + the nearest user's */
    for (int32_t v = c->nv - 1; v >= 0; v--) {
        if (!c->fw_required[v]) {
            c->dist[v] = 0;
            continue;
        }
        int64_t d = DIST_INF;
        for (int32_t k = c->user_start[v]; k < c->user_start[v + 1]; k++) {
            const af_node *u = af_graph_node(g, c->users[k]);
            for (int32_t o = 0; o < u->n_outputs; o++)
                if (c->dist[u->first_output + o] + 1 < d) d = c->dist[u->first_output + o] + 1;
        }
        c->dist[v] = d;
    }
    c->mat_bw = calloc(nv, 1);
    int32_t *stack = malloc(2 * nv * sizeof(int32_t));
    uint8_t *mark = calloc(nv, 1);
    int ok = c->mat_bw && stack && mark;
    for (int32_t v = 0; ok && v < c->nv; v++) c->mat_bw[v] = (uint8_t)materialized_backward(c, v, stack, mark);
    free(stack);
    free(mark);
    return ok ? AF_OK : af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
}

/* ---- min-cut heuristics ---- */

static int node_fw_required(const joint_ctx *c, int32_t n) {
    const af_node *node = af_graph_node(c->g, n);
    for (int32_t o = 0; o < node->n_outputs; o++)
        if (c->fw_required[node->first_output + o]) return 1;
    return 0;
}

static int is_materialized(const joint_ctx *c, int32_t v) {
    if (af_graph_value(c->g, v)->producer < 0 || c->is_output[v]) return 1;
    for (int32_t k = c->user_start[v]; k < c->user_start[v + 1]; k++)
        if (!fusible(c, v, c->users[k])) return 1;
    return 0;
}

/* Does the backward materialize v anyway (a backward user, through views, that cannot fuse it)?
 * Walks views with an explicit stack; `mark` is scratch (all zero on entry and exit). */
static int materialized_backward(const joint_ctx *c, int32_t v, int32_t *stack, uint8_t *mark) {
    if (value_kind(c, v) == AF_KIND_VIEW) return 0;
    int32_t top = 0, seen = 0, result = 0;
    stack[top++] = v;
    mark[v] = 1;
    int32_t *visited = stack + c->nv; /* second half of the scratch: what to unmark */
    visited[seen++] = v;
    while (top > 0 && !result) {
        int32_t cur = stack[--top];
        for (int32_t k = c->user_start[cur]; k < c->user_start[cur + 1] && !result; k++) {
            int32_t u = c->users[k];
            if (!node_fw_required(c, u) && !fusible(c, cur, u)) result = 1;
            else if (node_kind(c, u) == AF_KIND_VIEW) {
                const af_node *un = af_graph_node(c->g, u);
                for (int32_t o = 0; o < un->n_outputs; o++) {
                    int32_t w = un->first_output + o;
                    if (!mark[w]) {
                        mark[w] = 1;
                        visited[seen++] = w;
                        stack[top++] = w;
                    }
                }
            }
        }
    }
    for (int32_t i = 0; i < seen; i++) mark[visited[i]] = 0;
    return result;
}

/* Random numbers (aotfuse::rng_uniform, a pointwise op: a pure function of the saved seed) are
 * recomputed like other pointwise work: one dropout's mask in its own layer's backward. A value
 * that needs several of them recomputed with it is another matter: a pre-LN model's residual
 * stream, a chain of adds through every layer's dropout, would be rebuilt from the first layer on
 * (GPT2 with norms decomposed: 25 Threefry draws an element in one kernel). Per value, the first
 * two distinct random nodes a recompute of it could draw again (draws[2v], draws[2v+1]; -1 for
 * none): those of its recomputable producer's arguments, none past a value that is never
 * recomputed (an extern's, or a banned node's: saved wherever something after it is recomputed).
 * Such values are banned when ban_chained_random is set, and a value the backward materializes
 * anyway that draws any under AF_BAN_MATERIALIZED_RANDOM; node n's draws are set here, in node
 * order, before its ban is decided (which then clears them). */
static void node_draws(const joint_ctx *c, int32_t n, int32_t *draws) {
    const af_node *node = af_graph_node(c->g, n);
    int32_t set[2] = {node->op_id == AF_OP_RNG_UNIFORM ? n : -1, -1};
    if (kind_fusible(node_kind(c, n)))
        for (int32_t k = c->arg_start[n]; k < c->arg_start[n + 1] && set[1] < 0; k++)
            for (int32_t j = 0; j < 2; j++) {
                int32_t r = draws[2 * c->args_flat[k] + j];
                if (r < 0 || r == set[0]) continue;
                if (set[0] < 0) set[0] = r;
                else if (set[1] < 0) set[1] = r;
            }
    for (int32_t o = 0; o < node->n_outputs; o++) {
        draws[2 * (node->first_output + o)] = set[0];
        draws[2 * (node->first_output + o) + 1] = set[1];
    }
}

/* A value the backward writes out anyway (c->mat_bw), recomputed, is made where the backward first
 * needs it and held until its own use. A recompute that needs another such value made first holds
 * that one longer: a stack of residual blocks x' = x + gelu(norm(linear(x))), each x a linear
 * layer's input, recomputed its whole stream from the saved linear outputs at the backward's start,
 * every x' held from there until its own layer's weight gradient (24 layers of width 256 peaked at
 * 60 MB, eager's 38); so did a post-norm model's norm outputs without dropout (Bert). chain[v]: the
 * bytes of the largest such value a recompute of v makes, v itself included (0: none): the largest
 * its recomputable producer's arguments make, none past a never-recomputed value. node_chained
 * answers it for node n's arguments, in node order, before n's ban is decided. Under
 * AF_BAN_MATERIALIZED_RANDOM with ban_chained_materialized, a value the backward writes out whose
 * recompute would make another at least a quarter its size is saved: the stream is then saved every
 * other layer, and each recompute makes one such value. A small one held longer costs little: GPT2's
 * causal mask, which SDPA's backward reads, is still recomputed from the position ids the
 * embedding's backward reads. */
static int64_t node_chained(const joint_ctx *c, int32_t n, const int64_t *chain) {
    if (!kind_fusible(node_kind(c, n))) return 0;
    int64_t most = 0;
    for (int32_t k = c->arg_start[n]; k < c->arg_start[n + 1]; k++)
        if (chain[c->args_flat[k]] > most) most = chain[c->args_flat[k]];
    return most;
}

static int should_ban(const joint_ctx *c, const af_partition_options *o, int32_t v, const int32_t *draws,
                      int64_t chained) {
    int32_t p = af_graph_value(c->g, v)->producer;
    if (p < 0) return 1;
    af_op_kind kind = node_kind(c, p);
    if (kind == AF_KIND_VIEW) return 0;
    if (!kind_fusible(kind)) return 1; /* compute-heavy, random, extern: never recomputed */
    /* a libm call GCC does not vectorize (tan, atan, ...) keeps the recomputing CPU kernel's loop
     * scalar whole: Llama's rotary cos as libm's cosf, recomputed in each layer's backward, took 10 ns
     * an element; the prelude's vectorized sin and cos still cost 6x exp, per element of the broadcast
     * that reads them (af_op_costly_call) */
    if (o->ban_scalar_calls && af_graph_value(c->g, v)->meta.device.type == AF_DEVICE_CPU &&
        af_op_costly_call(af_op_get(af_graph_node(c->g, p)->op_id)))
        return 1;
    if (o->ban_chained_random && draws[2 * v + 1] >= 0) return 1;
    /* A value the backward writes out anyway costs its bytes to save and one more write to recompute:
     * cheap pointwise work (a GELU's output, a norm's from its saved statistics) is recomputed, work
     * drawing random numbers again (a Threefry hash an element) saved, unless the option says always
     * or never. */
    int ban_bw = o->ban_materialized_bw == AF_BAN_MATERIALIZED_ALL ||
                 (o->ban_materialized_bw == AF_BAN_MATERIALIZED_RANDOM &&
                  (draws[2 * v] >= 0 || (o->ban_chained_materialized && chained > 0 &&
                                          chained * 4 >= af_tensor_meta_nbytes(&af_graph_value(c->g, v)->meta))));
    if (ban_bw && c->mat_bw[v]) return 1;
    if (o->max_dist_from_bw > 0 && c->dist[v] > o->max_dist_from_bw && c->dist[v] < DIST_INF) return 1;
    if (o->reduction_ratio > 0) {
        int64_t in_bytes = 0;
        for (int32_t k = c->arg_start[p]; k < c->arg_start[p + 1]; k++)
            in_bytes += af_tensor_meta_nbytes(&af_graph_value(c->g, c->args_flat[k])->meta);
        if (af_tensor_meta_nbytes(&af_graph_value(c->g, v)->meta) * o->reduction_ratio < in_bytes) return 1;
    }
    return 0;
}

/* mat_bw: whether the backward writes v out anyway (materialized_backward); then saving v costs no
 * recompute, and of two cuts of about the same bytes the one saving it wins (15/16 of its weight, and
 * never the doubling of a value no kernel would store: is_materialized does not follow views, and a
 * linear layer reads its input through one): a layer's input x and y = tanh(x), which the next
 * weight gradient reads, weigh about the same; saving x made the backward run tanh again into a
 * tensor of its own. */
/* Whether v is a 16-bit float tensor converted to float32 (`_to_copy`, `convert_element_type`) at
 * the same size, or a view of one: a float16 matmul's operand when it runs in float32
 * (decompositions._float32_table; a transposed operand is a view of the conversion,
 * partition._convert_before_permutes). */
static int widening_conversion(const joint_ctx *c, int32_t v) {
    int32_t p = af_graph_value(c->g, v)->producer;
    for (int32_t hops = 0; p >= 0 && node_kind(c, p) == AF_KIND_VIEW && hops < 16; hops++) {
        const af_node *view = af_graph_node(c->g, p);
        if (view->n_args < 1 || view->args[0].kind != AF_ARG_VALUE) return 0;
        v = view->args[0].u.value;
        p = af_graph_value(c->g, v)->producer;
    }
    if (p < 0) return 0;
    const af_node *n = af_graph_node(c->g, p);
    if ((n->op_id != AF_OP_TO_COPY && n->op_id != AF_OP_CONVERT_ELEMENT_TYPE) || n->n_args < 1 ||
        n->args[0].kind != AF_ARG_VALUE)
        return 0;
    const af_tensor_meta *in = &af_graph_value(c->g, n->args[0].u.value)->meta, *out = &af_graph_value(c->g, v)->meta;
    return in->type == AF_VALUE_TENSOR && out->dtype == AF_DTYPE_FLOAT32 &&
           (in->dtype == AF_DTYPE_FLOAT16 || in->dtype == AF_DTYPE_BFLOAT16) &&
           af_tensor_meta_numel(in) == af_tensor_meta_numel(out);
}

static int64_t save_weight(const joint_ctx *c, int32_t v, int mat_bw) {
    const af_value *val = af_graph_value(c->g, v);
    if (val->meta.type != AF_VALUE_TENSOR) return AF_FLOW_INF;
    if (c->input_role[v] == AF_ROLE_CONSTANT || c->input_role[v] == AF_ROLE_PARAM) return 0; /* held anyway */
    int64_t d = c->dist[v] < 1 ? 1 : c->dist[v] > 100 ? 100 : c->dist[v];
    double w = (double)af_tensor_meta_nbytes(&val->meta) * pow(1.1, (double)d);
    /* A float32 conversion of a 16-bit value holds twice its source's bytes: the source is saved (and
     * written by the forward's kernel) and converted again in the backward, however the rules below
     * would weigh them (the source unwritten counts double, the conversion written by the backward
     * anyway 15/16: a tie the conversion won, holding float32 copies of a float16 model's matmul
     * operands and attention probabilities) */
    if (widening_conversion(c, v)) w *= 1.5;
    else if (mat_bw) w *= 15.0 / 16.0;
    else if (!is_materialized(c, v)) w *= 2;
    return w >= (double)(AF_FLOW_INF / 2) ? AF_FLOW_INF / 2 : (int64_t)w;
}

/* ---- turning a stop set into programs ---- */

/* Whether node n reads a value made by a node marked in `mark`. */
static int reads_marked(const joint_ctx *c, int32_t n, const uint8_t *mark) {
    for (int32_t k = c->arg_start[n]; k < c->arg_start[n + 1]; k++) {
        int32_t prod = af_graph_value(c->g, c->args_flat[k])->producer;
        if (prod >= 0 && mark[prod]) return 1;
    }
    return 0;
}

/* Matmuls sink past the pointwise work after them that shares their operands' kernel. Autograd's
 * order puts a linear layer's weight gradient, mm(g^T, y), right after its input gradient, and the
 * work of the layer below after both; y recomputed here (a GELU's output) is made just before that
 * matmul. The fusion planner closes a kernel where an extern reads it, so the GELU's recompute and
 * its gradient, which reads the same erf, became two kernels with the erf stored between them. Here
 * the matmul moves down to just after the last node, before the next extern (one sibling matmul
 * reading the same operand work aside: below), that reads the
 * pointwise work making its operands (`cluster`: their producers through views and pointwise nodes
 * of the operand's size, and the nodes of that size reading them, in turn) or the saved values of
 * that size this work reads (`leaf`: GPT2's layer norm output, recomputed from its saved normalized
 * input for the weight gradient, and the norm's gradient, reading the same input), so it runs after
 * one kernel doing both. A value of another size (a per-row statistic, a scalar) relates nothing, so
 * unrelated work keeps its place. The nodes in that stretch reading the matmul (its views, the sum of
 * a shared weight's gradients: Albert's layers) move with it, after the others, and so do the views
 * it reads its operands through, right before it and read by nothing else. Only matmul-like nodes
 * (AF_KIND_COMPUTE: pure) move. Where autograd put the input gradient mm(g, W^T) after the weight
 * gradient (a linear layer without bias, or `x @ W^T + b`: Llama's MLP), the scan passes over that
 * one matmul, which reads g as the weight gradient does, and the weight gradient sinks below it
 * and the work after it (SiLU's recompute and gradient one kernel); a second extern ends the scan,
 * so the matmul never drifts into the layer below. */
/* Whether node v is a view that only nodes marked in `mark` read in the backward (the views a
 * matmul reads its operands through move with it: a view of a value runs after the kernel making
 * the value, and the planner closes the kernel at it). */
static int view_read_only_by(const joint_ctx *c, const af_partition *p, int32_t v, const uint8_t *mark) {
    if (node_kind(c, v) != AF_KIND_VIEW) return 0;
    const af_node *node = af_graph_node(c->g, v);
    for (int32_t o = 0; o < node->n_outputs; o++) {
        int32_t val = node->first_output + o;
        if (c->is_output[val]) return 0;
        for (int32_t k = c->user_start[val]; k < c->user_start[val + 1]; k++)
            if (p->in_backward[c->users[k]] && !mark[c->users[k]]) return 0;
    }
    return 1;
}

/* Whether node m reads one of the values e's operands are made from: a saved value or input of
 * the cone (leaf), or the output of a node of the cone itself (cluster 1; not one of the nodes the
 * scan after e joined to it, cluster 2). */
static int reads_operand_work(const joint_ctx *c, int32_t m, const uint8_t *cluster, const uint8_t *leaf) {
    for (int32_t k = c->arg_start[m]; k < c->arg_start[m + 1]; k++) {
        int32_t v = c->args_flat[k], prod = af_graph_value(c->g, v)->producer;
        if (leaf[v] || (prod >= 0 && cluster[prod] == 1)) return 1;
    }
    return 0;
}

#define SINK_CONE_MAX 64
static int sink_matmuls(const joint_ctx *c, af_partition *p) {
    int32_t n = p->n_backward_order, *order = p->backward_order;
    uint8_t *after = calloc((size_t)c->nn + 1, 1);   /* the moving matmul and its readers */
    uint8_t *cluster = calloc((size_t)c->nn + 1, 1); /* the work its operands' kernel does */
    int32_t *moved = malloc(((size_t)n + 1) * sizeof(int32_t));
    int32_t *marked = malloc(((size_t)c->nn + 1) * sizeof(int32_t)); /* a node is marked once */
    uint8_t *leaf = calloc((size_t)c->nv + 1, 1); /* values its operands' work reads: saved, inputs */
    int32_t *leaves = malloc(((size_t)c->nv + 1) * sizeof(int32_t));
    int st = AF_OK;
    const af_graph *g = c->g;
    if (!after || !cluster || !moved || !marked || !leaf || !leaves) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
        n = 0; /* nothing to move: straight to the frees */
    }
    for (int32_t j = n - 1; j >= 0; j--) {
        int32_t e = order[j], n_marked = 0, n_leaves = 0;
        if (node_kind(c, e) != AF_KIND_COMPUTE) continue;
        /* the operands' producers: through views and pointwise nodes of the operand's size */
        for (int32_t a = c->arg_start[e]; a < c->arg_start[e + 1]; a++) {
            int64_t size = af_tensor_meta_numel(&af_graph_value(g, c->args_flat[a])->meta);
            int32_t top = 0, *stack = moved, first = n_marked; /* scratch until the move below */
            stack[top++] = c->args_flat[a];
            while (top > 0 && n_marked - first < SINK_CONE_MAX) { /* each operand its own budget */
                int32_t v = stack[--top], prod = af_graph_value(g, v)->producer;
                if (prod < 0 || !p->in_backward[prod]) { /* a saved value or an input: its readers share it */
                    if (!leaf[v] && af_tensor_meta_numel(&af_graph_value(g, v)->meta) == size) {
                        leaf[v] = 1;
                        leaves[n_leaves++] = v;
                    }
                    continue;
                }
                if (cluster[prod]) continue;
                af_op_kind kind = node_kind(c, prod);
                const af_value *out = af_graph_value(g, af_graph_node(g, prod)->first_output);
                if (!(kind == AF_KIND_VIEW || kind == AF_KIND_POINTWISE) || af_tensor_meta_numel(&out->meta) != size) continue;
                cluster[prod] = 1;
                marked[n_marked++] = prod;
                for (int32_t k = c->arg_start[prod]; k < c->arg_start[prod + 1] && top < n; k++) stack[top++] = c->args_flat[k];
            }
        }
        after[e] = 1;
        int32_t b = j, last = j, end = j + 1, siblings = 0;
        for (; end < n; end++) {
            int32_t m = order[end], i = end;
            if (!kind_fusible(node_kind(c, m))) {
                /* one sibling matmul is passed over: mm(g, W^T) reading what e's operands' work
                 * reads (g), the input gradient autograd put after the weight gradient (an mm
                 * without bias, or x @ W^T + b: its order is not addmm's). It stays before e. */
                if (siblings++ || node_kind(c, m) != AF_KIND_COMPUTE || reads_marked(c, m, after) ||
                    !reads_operand_work(c, m, cluster, leaf))
                    break;
                continue;
            }
            if (reads_marked(c, m, after)) after[m] = 1;
            int64_t size = af_tensor_meta_numel(&af_graph_value(g, af_graph_node(g, m)->first_output)->meta);
            for (int32_t k = c->arg_start[m]; k < c->arg_start[m + 1]; k++) {
                const af_value *v = af_graph_value(g, c->args_flat[k]);
                if (!leaf[c->args_flat[k]] && (v->producer < 0 || !cluster[v->producer])) continue;
                last = i; /* reads the operands' work: runs before the matmul */
                if (!cluster[m] && af_tensor_meta_numel(&v->meta) == size) {
                    cluster[m] = 2; /* joined while scanning: a sibling does not read these */
                    marked[n_marked++] = m;
                }
            }
        }
        if (last > j) {
            while (b > 0 && view_read_only_by(c, p, order[b - 1], after)) after[order[--b]] = 1;
            int32_t t = 0;
            for (int32_t i = b; i <= last; i++)
                if (!after[order[i]]) moved[t++] = order[i];
            for (int32_t i = b; i <= last; i++)
                if (after[order[i]]) moved[t++] = order[i];
            memcpy(order + b, moved, (size_t)t * sizeof(int32_t));
        }
        for (int32_t i = b; i < end; i++) after[order[i]] = 0; /* the same nodes, [b, last] reordered */
        for (int32_t i = 0; i < n_marked; i++) cluster[marked[i]] = 0;
        for (int32_t i = 0; i < n_leaves; i++) leaf[leaves[i]] = 0;
    }
    free(after);
    free(cluster);
    free(moved);
    free(marked);
    free(leaf);
    free(leaves);
    return st;
}

/* Views run just before their first reader. A view makes no data, but the fusion planner closes
 * a kernel at any node outside it that reads one of its values, a view included (fuse.c,
 * mark_reads), so a view that autograd's order put between two stretches of pointwise work on one
 * value split them into two kernels, the value stored between them. Llama's MLP backward: the
 * [4, 128, 688] product's gradient viewed as [512, 688] for the up projection's weight gradient,
 * right after it is made and before SiLU's gradient that reads the same sigmoid; the first kernel
 * then wrote the sigmoid and the gate in float32 for the second (now one kernel: Llama's fused
 * kernels 4-7% less time a step). Only views that matmul-like nodes read (directly or through
 * other such views) move: a view that kernels read (GPT2's q, k and v gradients viewed for the
 * cat that joins them) keeps its place, since moving it let the kernel merger join three
 * transposing copies, each read hot just after its matmul, into one slower kernel. A view no
 * backward node reads (an output) keeps its place too; one a deferred view reads goes just before
 * that one. */
static void emit_deferred(const joint_ctx *c, int32_t v, uint8_t *deferred, int32_t *out, int32_t *n_out) {
    deferred[v] = 0; /* emitted: its own deferred arguments first */
    for (int32_t k = c->arg_start[v]; k < c->arg_start[v + 1]; k++) {
        int32_t prod = af_graph_value(c->g, c->args_flat[k])->producer;
        if (prod >= 0 && deferred[prod]) emit_deferred(c, prod, deferred, out, n_out);
    }
    out[(*n_out)++] = v;
}

static int defer_views(const joint_ctx *c, af_partition *p) {
    int32_t n = p->n_backward_order, *order = p->backward_order, n_out = 0;
    uint8_t *deferred = calloc((size_t)c->nn + 1, 1);
    int32_t *out = malloc(((size_t)n + 1) * sizeof(int32_t));
    if (!deferred || !out) {
        free(deferred);
        free(out);
        return af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
    }
    /* which views to defer: readers first (later in the order) */
    for (int32_t j = n - 1; j >= 0; j--) {
        int32_t m = order[j];
        if (node_kind(c, m) != AF_KIND_VIEW) continue;
        const af_node *node = af_graph_node(c->g, m);
        int defer = 1;
        for (int32_t o = 0; o < node->n_outputs && defer; o++) {
            int32_t val = node->first_output + o, read = 0;
            if (c->is_output[val]) defer = 0;
            for (int32_t k = c->user_start[val]; k < c->user_start[val + 1] && defer; k++) {
                int32_t r = c->users[k];
                if (!p->in_backward[r]) continue;
                read = 1;
                defer = node_kind(c, r) == AF_KIND_COMPUTE || deferred[r];
            }
            if (!read) defer = 0;
        }
        deferred[m] = (uint8_t)defer;
    }
    for (int32_t j = 0; j < n; j++) {
        int32_t m = order[j];
        int defer = deferred[m];
        if (defer) continue; /* and so are the deferred views it reads */
        for (int32_t k = c->arg_start[m]; k < c->arg_start[m + 1]; k++) {
            int32_t prod = af_graph_value(c->g, c->args_flat[k])->producer;
            if (prod >= 0 && deferred[prod]) emit_deferred(c, prod, deferred, out, &n_out);
        }
        out[n_out++] = m;
    }
    for (int32_t j = 0; j < n; j++) /* none left: each deferred view has a reader in the backward */
        if (deferred[order[j]]) emit_deferred(c, order[j], deferred, out, &n_out);
    memcpy(order, out, (size_t)n * sizeof(int32_t));
    free(deferred);
    free(out);
    return AF_OK;
}

static int finish(const joint_ctx *c, const uint8_t *stop, af_partition *p) {
    const af_graph *g = c->g;
    int st = AF_OK;
    size_t nv = c->nv > 0 ? (size_t)c->nv : 0; /* gcc 12's fortified memset wants the sign settled */
    uint8_t *need = calloc(nv + 1, 1);
    uint8_t *saved = calloc(nv + 1, 1);
    uint8_t *emitted = calloc((size_t)c->nn + 1, 1);
    int32_t *stack_n = malloc(((size_t)c->nn + 1) * sizeof(int32_t));
    int32_t *stack_k = malloc(((size_t)c->nn + 1) * sizeof(int32_t));
    p->in_forward = calloc((size_t)c->nn + 1, 1);
    p->in_backward = calloc((size_t)c->nn + 1, 1);
    p->backward_order = malloc(((size_t)c->nn + 1) * sizeof(int32_t));
    if (!need || !saved || !emitted || !stack_n || !stack_k || !p->in_forward || !p->in_backward || !p->backward_order) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
        goto done;
    }
    /* backward slice: from the gradients down to saved values and backward inputs */
    for (int32_t o = c->nfwd; o < c->no; o++) need[af_graph_output(g, o)] = 1;
    for (int32_t v = c->nv - 1; v >= 0; v--) {
        if (!need[v]) continue;
        int32_t role = c->input_role[v];
        if (role == AF_ROLE_TANGENT || role == AF_ROLE_BWD_SEED || role == AF_ROLE_CONSTANT) continue;
        if (stop[v]) {
            saved[v] = 1;
            continue;
        }
        int32_t prod = af_graph_value(g, v)->producer;
        if (prod < 0) {
            st = af_error_set(AF_ERR_INVALID, "the backward needs input %s, which is not saved", af_graph_value(g, v)->name);
            goto done;
        }
        p->in_backward[prod] = 1;
        for (int32_t k = c->arg_start[prod]; k < c->arg_start[prod + 1]; k++) need[c->args_flat[k]] = 1;
    }
    /* forward slice: the forward outputs and the saved values */
    memset(need, 0, nv);
    for (int32_t o = 0; o < c->nfwd; o++) need[af_graph_output(g, o)] = 1;
    for (int32_t v = 0; v < c->nv; v++)
        if (saved[v]) need[v] = 1;
    for (int32_t v = c->nv - 1; v >= 0; v--) {
        if (!need[v]) continue;
        int32_t prod = af_graph_value(g, v)->producer;
        if (prod < 0) {
            int32_t role = c->input_role[v];
            if (role == AF_ROLE_TANGENT || role == AF_ROLE_BWD_SEED) {
                st = af_error_set(AF_ERR_INVALID, "the forward needs backward input %s", af_graph_value(g, v)->name);
                goto done;
            }
            continue;
        }
        p->in_forward[prod] = 1;
        for (int32_t k = c->arg_start[prod]; k < c->arg_start[prod + 1]; k++) need[c->args_flat[k]] = 1;
    }
    /* the saved list, and its bytes */
    p->saved = malloc(((size_t)c->nv + 1) * sizeof(int32_t));
    if (!p->saved) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
        goto done;
    }
    for (int32_t v = 0; v < c->nv; v++)
        if (saved[v]) {
            p->saved[p->n_saved++] = v;
            p->saved_bytes += af_tensor_meta_nbytes(&af_graph_value(g, v)->meta);
        }
    /* backward order: each node that depends on a tangent, in graph order, preceded by the
     * recomputation it needs that has not run yet (depth first, so recomputed work runs just
     * before its first use); then whatever feeds the gradients directly. */
    for (int32_t pass = 0; pass < 2; pass++) {
        for (int32_t root = 0; root < c->nn; root++) {
            if (!p->in_backward[root] || emitted[root]) continue;
            const af_node *rn = af_graph_node(g, root);
            if (pass == 0 && !c->tangent[rn->first_output]) continue;
            int32_t top = 0;
            stack_n[top] = root;
            stack_k[top++] = c->arg_start[root];
            emitted[root] = 2; /* on the stack */
            while (top > 0) {
                int32_t n = stack_n[top - 1];
                if (stack_k[top - 1] < c->arg_start[n + 1]) {
                    int32_t v = c->args_flat[stack_k[top - 1]++];
                    int32_t prod = af_graph_value(g, v)->producer;
                    if (prod >= 0 && p->in_backward[prod] && !emitted[prod] && !saved[v]) {
                        emitted[prod] = 2;
                        stack_n[top] = prod;
                        stack_k[top++] = c->arg_start[prod];
                    }
                    continue;
                }
                emitted[n] = 1;
                p->backward_order[p->n_backward_order++] = n;
                top--;
            }
        }
    }
    if ((st = sink_matmuls(c, p))) goto done;
    if ((st = defer_views(c, p))) goto done;
    for (int32_t n = 0; n < c->nn; n++)
        if (p->in_forward[n] && p->in_backward[n]) p->n_recomputed++;
done:
    free(need);
    free(saved);
    free(emitted);
    free(stack_n);
    free(stack_k);
    return st;
}

af_partition_options af_partition_default_options(void) {
    af_partition_options o = {.max_dist_from_bw = 1000, .reduction_ratio = 4,
                              .ban_materialized_bw = AF_BAN_MATERIALIZED_RANDOM, .ban_chained_random = 1,
                              .ban_chained_materialized = 1, .ban_scalar_calls = 1,
                              .memory_budget = 1.0};
    return o;
}

void af_partition_free(af_partition *p) {
    if (!p) return;
    free(p->saved);
    free(p->in_forward);
    free(p->in_backward);
    free(p->backward_order);
    free(p);
}

static int start(const af_graph *g, const uint8_t *roles, af_partition **out) {
    if (!g || !out || (af_graph_num_inputs(g) > 0 && !roles))
        return af_error_set(AF_ERR_INVALID, "partition: NULL argument");
    int st = af_graph_verify(g);
    if (st) return st;
    *out = calloc(1, sizeof **out);
    return *out ? AF_OK : af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
}

static int fresh(af_partition **p) {
    *p = calloc(1, sizeof **p);
    return *p ? AF_OK : af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
}

int af_partition_default(const af_graph *g, const uint8_t *roles, int32_t num_fwd_outputs, af_partition **out) {
    return af_partition_default_policy(g, roles, num_fwd_outputs, NULL, out);
}

int af_partition_default_policy(const af_graph *g, const uint8_t *roles, int32_t num_fwd_outputs,
                                const uint8_t *node_policy, af_partition **out) {
    af_partition *p = NULL;
    int st = start(g, roles, &p);
    if (st) return st;
    joint_ctx c;
    uint8_t *stop = NULL;
    if ((st = ctx_build(&c, g, roles, num_fwd_outputs))) goto done;
    /* everything the forward computes, and every forward input, can be handed over */
    stop = calloc((size_t)c.nv + 1, 1);
    if (!stop) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
        goto done;
    }
    /* a node the forward runs makes all of its outputs (native_layer_norm's mean and rstd too) */
    for (int32_t v = 0; v < c.nv; v++) {
        int32_t role = c.input_role[v], prod = af_graph_value(g, v)->producer;
        stop[v] = (prod >= 0 ? node_fw_required(&c, prod) && !(node_policy && node_policy[prod] == AF_POLICY_RECOMPUTE)
                             : 0) ||
                  role == AF_ROLE_PRIMAL || role == AF_ROLE_PARAM || role == AF_ROLE_FWD_SEED;
    }
    st = finish(&c, stop, p);
done:
    free(stop);
    ctx_free(&c);
    if (st) af_partition_free(p);
    else *out = p;
    return st;
}

/* One min cut: the values to save (stop) for these bans. lift: NULL, or per node 1 where a node
 * banned for its kind (compute, extern) may be recomputed after all (the memory budget's choice).
 * node_ban, draws and chain are the caller's scratch (nn + 1, 2 nv + 2 and nv + 1 entries). */
static int solve_cut(const joint_ctx *c, const af_partition_options *o, const uint8_t *lift, uint8_t *node_ban,
                     int32_t *draws, int64_t *chain, uint8_t *side, uint8_t *stop,
                     int64_t *cut_value) {
    const af_graph *g = c->g;
    int32_t nv = c->nv, source = 2 * nv, sink = 2 * nv + 1;
    af_flow *f = NULL;
    int st = AF_OK;
    memset(node_ban, 0, (size_t)c->nn + 1);
    /* Bans are per node: a node runs whole, so if one output must not be recomputed (or the
     * node is compute-heavy, random, extern), none of its outputs is recomputed either. */
    for (int32_t v = 0; v < 2 * nv; v++) draws[v] = -1;
    for (int32_t n = 0; n < c->nn; n++) {
        const af_node *node = af_graph_node(g, n);
        uint8_t policy = o->node_policy ? o->node_policy[n] : AF_POLICY_NONE;
        node_draws(c, n, draws);
        int64_t chained = node_chained(c, n, chain);
        if (node_fw_required(c, n) && policy != AF_POLICY_RECOMPUTE && !(lift && lift[n])) {
            if (policy == AF_POLICY_SAVE) node_ban[n] = 1;
            for (int32_t k = 0; k < node->n_outputs && !node_ban[n]; k++)
                node_ban[n] = (uint8_t)should_ban(c, o, node->first_output + k, draws, chained);
        }
        for (int32_t k = 0; k < node->n_outputs; k++) {
            int32_t v = node->first_output + k;
            int64_t own = c->mat_bw[v] ? af_tensor_meta_nbytes(&af_graph_value(g, v)->meta) : 0;
            chain[v] = node_ban[n] ? 0 : chained > own ? chained : own;
            if (node_ban[n]) draws[2 * v] = draws[2 * v + 1] = -1; /* never drawn again through it */
        }
    }
    if ((st = af_flow_new(2 * nv + 2, &f))) return st;
#define EDGE(a, b, w)                                        \
    do {                                                     \
        if ((st = af_flow_add_edge(f, (a), (b), (w)))) goto done; \
    } while (0)
    for (int32_t v = 0; v < nv; v++) {
        int32_t vin = 2 * v, vout = 2 * v + 1, role = c->input_role[v];
        if (c->tangent[v]) { /* must be computed in the backward */
            EDGE(vin, sink, AF_FLOW_INF);
            continue;
        }
        int32_t prod = af_graph_value(g, v)->producer;
        if (prod >= 0 && o->node_policy && o->node_policy[prod] == AF_POLICY_RECOMPUTE) {
            /* checkpointed: never saved, so on the sink's side; what it reads is saved or recomputed in turn */
            EDGE(vin, sink, AF_FLOW_INF);
            continue;
        }
        if (c->bw_required[v]) EDGE(vout, sink, AF_FLOW_INF); /* must be available to the backward */
        if (role == AF_ROLE_PRIMAL || role == AF_ROLE_PARAM || role == AF_ROLE_FWD_SEED || role == AF_ROLE_CONSTANT)
            EDGE(source, vin, AF_FLOW_INF);
        else if (role < 0 && node_ban[prod])
            EDGE(source, vin, AF_FLOW_INF);
        int mat_bw = prod >= 0 && node_fw_required(c, prod) && c->mat_bw[v];
        EDGE(vin, vout, save_weight(c, v, mat_bw));
        for (int32_t k = c->user_start[v]; k < c->user_start[v + 1]; k++) {
            const af_node *u = af_graph_node(g, c->users[k]);
            for (int32_t out_i = 0; out_i < u->n_outputs; out_i++) EDGE(vout, 2 * (u->first_output + out_i), AF_FLOW_INF);
        }
    }
#undef EDGE
    if ((st = af_flow_solve(f, source, sink, cut_value))) goto done;
    if (*cut_value >= AF_FLOW_INF) {
        st = af_error_set(AF_ERR_INVALID, "partition: no finite cut (the backward needs a value that cannot be saved)");
        goto done;
    }
    if ((st = af_flow_source_side(f, side))) goto done;
    for (int32_t v = 0; v < nv; v++) stop[v] = side[2 * v] && !side[2 * v + 1];
done:
    af_flow_free(f);
    return st;
}

/* Bytes the forward saves for the backward that do not live anyway (parameters and buffers do). */
static int64_t activation_bytes(const joint_ctx *c, const af_partition *p) {
    int64_t total = 0;
    for (int32_t s = 0; s < p->n_saved; s++)
        if (c->input_role[p->saved[s]] != AF_ROLE_PARAM)
            total += af_tensor_meta_nbytes(&af_graph_value(c->g, p->saved[s])->meta);
    return total;
}

/* A node the memory budget may have recomputed: banned for its kind alone (AF_KIND_COMPUTE: a matmul,
 * a convolution, an attention; not other extern calls, which may read a buffer the step updates
 * after the forward, a batch norm its running statistics), not marked to save. Its cost: the
 * multiply-adds per output element (a matmul's inner dim, an attention's key length times its head
 * size over the value's, a convolution's weight elements per output channel) per output byte. */
static const af_tensor_meta *value_arg(const joint_ctx *c, const af_node *node, int32_t i) {
    if (i >= node->n_args || node->args[i].kind != AF_ARG_VALUE) return NULL;
    return &af_graph_value(c->g, node->args[i].u.value)->meta;
}

static double lift_cost(const joint_ctx *c, int32_t n) {
    const af_node *node = af_graph_node(c->g, n);
    const af_tensor_meta *out = &af_graph_value(c->g, node->first_output)->meta, *a = NULL, *b = NULL;
    double per_element = 1;
    switch (node->op_id) {
    case AF_OP_MM:
    case AF_OP_BMM:
        a = value_arg(c, node, 0);
        if (a && a->ndim > 0) per_element = (double)a->sizes[a->ndim - 1];
        break;
    case AF_OP_ADDMM:
    case AF_OP_BADDBMM:
        a = value_arg(c, node, 1);
        if (a && a->ndim > 0) per_element = (double)a->sizes[a->ndim - 1];
        break;
    case AF_OP_SDPA_FLASH:
    case AF_OP_SDPA_EFFICIENT:
    case AF_OP_SDPA_CPU:
        a = value_arg(c, node, 1); /* key [.., S, E] */
        b = value_arg(c, node, 2); /* value [.., S, Ev] */
        if (a && b && a->ndim >= 2 && b->ndim >= 1 && b->sizes[b->ndim - 1] > 0)
            per_element = 2.0 * (double)a->sizes[a->ndim - 2] * (double)a->sizes[a->ndim - 1] /
                          (double)b->sizes[b->ndim - 1];
        break;
    case AF_OP_CONVOLUTION:
        a = value_arg(c, node, 1); /* weight [Cout, Cin / groups, k...] */
        if (a && a->ndim > 0 && a->sizes[0] > 0) {
            double numel = 1;
            for (int32_t d = 0; d < a->ndim; d++) numel *= (double)a->sizes[d];
            per_element = numel / (double)a->sizes[0];
        }
        break;
    default:
        break;
    }
    int64_t bytes = af_tensor_meta_nbytes(out);
    double out_numel = 1;
    for (int32_t d = 0; d < out->ndim; d++) out_numel *= (double)out->sizes[d];
    return out_numel * per_element / (double)(bytes > 0 ? bytes : 1);
}

typedef struct {
    double cost;   /* lift_cost */
    int64_t bytes; /* its output's bytes */
    int32_t node;
} lift_entry;

/* Cheapest work per byte first; of equal costs the biggest output first (one node freeing the most:
 * a language-model head's logits before a layer's projections), then graph order. */
static int by_cost(const void *a, const void *b) {
    const lift_entry *x = a, *y = b;
    if (x->cost != y->cost) return x->cost < y->cost ? -1 : 1;
    if (x->bytes != y->bytes) return x->bytes > y->bytes ? -1 : 1;
    return (x->node > y->node) - (x->node < y->node);
}

/* The scratch one cut needs (solve_cut's arrays), allocated once for all the cuts of a call. */
typedef struct {
    uint8_t *node_ban, *side, *stop;
    int32_t *draws;
    int64_t *chain;
} cut_space;

/* A whole partition for these lifted nodes (NULL: none): the cut, then the programs' split. */
static int cut_with(const joint_ctx *c, const af_partition_options *o, const uint8_t *lift, cut_space *ws,
                    af_partition **out) {
    af_partition *p = NULL;
    int st = fresh(&p);
    if (!st) st = solve_cut(c, o, lift, ws->node_ban, ws->draws, ws->chain, ws->side, ws->stop, &p->cut_value);
    if (!st) st = finish(c, ws->stop, p);
    if (st) af_partition_free(p);
    else *out = p;
    return st;
}

/* lift = the first k candidates (in cost order). */
static void lift_first(uint8_t *lift, int32_t nn, const lift_entry *cand, int32_t k) {
    memset(lift, 0, (size_t)nn + 1);
    for (int32_t i = 0; i < k; i++) lift[cand[i].node] = 1;
}

int af_partition_min_cut(const af_graph *g, const uint8_t *roles, int32_t num_fwd_outputs,
                         const af_partition_options *opts, af_partition **out) {
    af_partition_options o = opts ? *opts : af_partition_default_options();
    if (o.ban_materialized_bw < AF_BAN_MATERIALIZED_NONE || o.ban_materialized_bw > AF_BAN_MATERIALIZED_RANDOM)
        return af_error_set(AF_ERR_INVALID, "partition: ban_materialized_bw must be 0 (none), 1 (all) or 2 (random), not %d",
                            (int)o.ban_materialized_bw);
    if (!(o.memory_budget >= 0.0 && o.memory_budget <= 1.0))
        return af_error_set(AF_ERR_INVALID, "partition: memory_budget must be in [0, 1], not %g", o.memory_budget);
    af_partition *p = NULL, *trial = NULL;
    int st = start(g, roles, &p);
    if (st) return st;
    af_partition_free(p); /* start() verified the graph; cut_with makes the partitions */
    p = NULL;
    joint_ctx c;
    cut_space ws = {0};
    uint8_t *lift = NULL;
    lift_entry *cand = NULL;
    if ((st = ctx_build(&c, g, roles, num_fwd_outputs))) goto done;
    int32_t nv = c.nv;
    ws.side = calloc((size_t)2 * nv + 2, 1);
    ws.stop = calloc((size_t)nv + 1, 1);
    ws.chain = calloc((size_t)nv + 1, sizeof(int64_t));
    ws.node_ban = calloc((size_t)c.nn + 1, 1);
    ws.draws = malloc(((size_t)2 * nv + 2) * sizeof(int32_t));
    if (!ws.side || !ws.stop || !ws.chain || !ws.node_ban || !ws.draws) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
        goto done;
    }
    if ((st = cut_with(&c, &o, NULL, &ws, &p))) goto done;
    if (o.memory_budget < 1.0) {
        /* The budget: save at most S_min + budget x (S_max - S_min) bytes of activations, S_max being
         * the cut above, S_min the cut with every candidate free to be recomputed; the fewest,
         * cheapest candidates (by lift_cost) reach it: a binary search over how many of them, in
         * that order, are freed (more freedom never raises the cut). */
        int32_t nc = 0;
        cand = malloc(((size_t)c.nn + 1) * sizeof *cand);
        lift = calloc((size_t)c.nn + 1, 1);
        if (!cand || !lift) {
            st = af_error_set(AF_ERR_NOMEM, "out of memory partitioning");
            goto done;
        }
        for (int32_t n = 0; n < c.nn; n++) {
            uint8_t policy = o.node_policy ? o.node_policy[n] : AF_POLICY_NONE;
            const af_node *node = af_graph_node(g, n);
            if (node_kind(&c, n) == AF_KIND_COMPUTE && node_fw_required(&c, n) && policy == AF_POLICY_NONE &&
                node->n_outputs > 0)
                cand[nc++] = (lift_entry){lift_cost(&c, n),
                                          af_tensor_meta_nbytes(&af_graph_value(g, node->first_output)->meta), n};
        }
        qsort(cand, (size_t)nc, sizeof *cand, by_cost);
        int64_t s_max = activation_bytes(&c, p);
        lift_first(lift, c.nn, cand, nc);
        if ((st = cut_with(&c, &o, lift, &ws, &trial))) goto done;
        int64_t s_min = activation_bytes(&c, trial);
        int64_t target = s_min + (int64_t)(o.memory_budget * (double)(s_max - s_min));
        af_partition_free(trial);
        trial = NULL;
        if (s_max > target) { /* else the cut above meets it already */
            int32_t lo = 1, hi = nc; /* the smallest count of freed candidates that meets the target */
            while (lo < hi) {
                int32_t mid = lo + (hi - lo) / 2;
                lift_first(lift, c.nn, cand, mid);
                if ((st = cut_with(&c, &o, lift, &ws, &trial))) goto done;
                if (activation_bytes(&c, trial) <= target) hi = mid;
                else lo = mid + 1;
                af_partition_free(trial);
                trial = NULL;
            }
            lift_first(lift, c.nn, cand, lo);
            af_partition_free(p);
            p = NULL;
            if ((st = cut_with(&c, &o, lift, &ws, &p))) goto done;
        }
    }
done:
    free(ws.side);
    free(ws.stop);
    free(ws.chain);
    free(ws.node_ban);
    free(ws.draws);
    free(lift);
    free(cand);
    af_partition_free(trial);
    ctx_free(&c);
    if (st) af_partition_free(p);
    else *out = p;
    return st;
}

int af_partition_check(const af_graph *g, const uint8_t *roles, int32_t nfwd, const af_partition *p) {
    if (!g || !p || (af_graph_num_inputs(g) > 0 && !roles)) return af_error_set(AF_ERR_INVALID, "partition check: NULL argument");
    int32_t nv = af_graph_num_values(g), nn = af_graph_num_nodes(g), no = af_graph_num_outputs(g);
    if (nfwd < 0 || nfwd > no) return af_error_set(AF_ERR_INVALID, "partition check: bad num_fwd_outputs");
    uint8_t *avail = calloc((size_t)nv + 1, 1);
    int32_t *vals = malloc(((size_t)nv + 1) * sizeof(int32_t));
    int st = AF_OK;
    if (!avail || !vals) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory checking a partition");
        goto done;
    }
    /* forward: forward inputs, then nodes in graph order */
    for (int32_t i = 0; i < af_graph_num_inputs(g); i++)
        avail[af_graph_input(g, i)] = roles[i] == AF_ROLE_PRIMAL || roles[i] == AF_ROLE_PARAM || roles[i] == AF_ROLE_FWD_SEED ||
                                      roles[i] == AF_ROLE_CONSTANT;
    for (int32_t n = 0; n < nn; n++) {
        if (!p->in_forward[n]) continue;
        const af_node *node = af_graph_node(g, n);
        int32_t k = 0;
        for (int32_t a = 0; a < node->n_args; a++) collect_arg_values(&node->args[a], vals, &k);
        for (int32_t i = 0; i < k; i++)
            if (!avail[vals[i]]) {
                st = af_error_set(AF_ERR_INVALID, "forward node %d (%s) reads %s, not available in the forward", (int)n,
                                  node->op, af_graph_value(g, vals[i])->name);
                goto done;
            }
        for (int32_t o = 0; o < node->n_outputs; o++) avail[node->first_output + o] = 1;
    }
    for (int32_t o = 0; o < nfwd; o++)
        if (!avail[af_graph_output(g, o)]) {
            st = af_error_set(AF_ERR_INVALID, "forward output %d is not computed by the forward", (int)o);
            goto done;
        }
    for (int32_t s = 0; s < p->n_saved; s++)
        if (p->saved[s] < 0 || p->saved[s] >= nv || !avail[p->saved[s]]) {
            st = af_error_set(AF_ERR_INVALID, "saved value %d is not computed by the forward", (int)p->saved[s]);
            goto done;
        }
    /* backward: saved values and backward inputs, then nodes in backward order */
    memset(avail, 0, (size_t)nv);
    for (int32_t i = 0; i < af_graph_num_inputs(g); i++)
        avail[af_graph_input(g, i)] = roles[i] == AF_ROLE_TANGENT || roles[i] == AF_ROLE_BWD_SEED || roles[i] == AF_ROLE_CONSTANT;
    for (int32_t s = 0; s < p->n_saved; s++) avail[p->saved[s]] = 1;
    for (int32_t i = 0; i < p->n_backward_order; i++) {
        int32_t n = p->backward_order[i];
        if (n < 0 || n >= nn || !p->in_backward[n]) {
            st = af_error_set(AF_ERR_INVALID, "backward order lists node %d outside the backward", (int)n);
            goto done;
        }
        const af_node *node = af_graph_node(g, n);
        int32_t k = 0;
        for (int32_t a = 0; a < node->n_args; a++) collect_arg_values(&node->args[a], vals, &k);
        for (int32_t j = 0; j < k; j++)
            if (!avail[vals[j]]) {
                st = af_error_set(AF_ERR_INVALID, "backward node %d (%s) reads %s before it is available", (int)n, node->op,
                                  af_graph_value(g, vals[j])->name);
                goto done;
            }
        for (int32_t o = 0; o < node->n_outputs; o++) avail[node->first_output + o] = 1;
    }
    for (int32_t o = nfwd; o < no; o++)
        if (!avail[af_graph_output(g, o)]) {
            st = af_error_set(AF_ERR_INVALID, "backward output %d is not computed by the backward", (int)o);
            goto done;
        }
done:
    free(avail);
    free(vals);
    return st;
}
