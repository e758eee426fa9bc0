/* The runtime: a flat list of steps, intermediates released at their last use. */
#include "aotfuse/runtime.h"

#include <stdlib.h>
#include <string.h>

struct af_program {
    af_graph *graph;
    af_extern **steps;      /* one per node */
    int32_t *release;       /* value ids released after each step, concatenated */
    int32_t *release_start; /* n_nodes + 1 offsets into release */
    int32_t *input_ids;     /* graph input value ids, cached */
    const af_tensor_meta **input_metas;
    const char **input_names;
    af_obj **values;        /* scratch: one slot per value, NULL between runs */
    int check_inputs;
    int running;            /* a run is in progress (re-entry guard) */
};

static void mark_uses(const af_arg *a, int32_t node, int32_t *last_use) {
    if (a->kind == AF_ARG_VALUE) {
        if (last_use[a->u.value] < node) last_use[a->u.value] = node;
    } else if (a->kind == AF_ARG_LIST) {
        for (int32_t i = 0; i < a->u.list.n; i++) mark_uses(&a->u.list.items[i], node, last_use);
    }
}

/* For each value: the last node that reads it; -1 if none; n_nodes if the graph returns it. */
static int plan_releases(af_program *p) {
    const af_graph *g = p->graph;
    int32_t nv = af_graph_num_values(g), nn = af_graph_num_nodes(g);
    int32_t *last_use = malloc(((size_t)nv + 1) * sizeof(int32_t));
    p->release_start = calloc((size_t)nn + 1, sizeof(int32_t));
    p->release = malloc(((size_t)nv + 1) * sizeof(int32_t));
    if (!last_use || !p->release_start || !p->release) {
        free(last_use);
        return af_error_set(AF_ERR_NOMEM, "out of memory planning a program");
    }
    for (int32_t v = 0; v < nv; v++) last_use[v] = -1;
    for (int32_t i = 0; i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        for (int32_t a = 0; a < n->n_args; a++) mark_uses(&n->args[a], i, last_use);
    }
    for (int32_t o = 0; o < af_graph_num_outputs(g); o++) last_use[af_graph_output(g, o)] = nn;
    /* A value nobody reads is released right after the step that made it; an unread input
     * is released after the first step (or never taken, when there are no steps). */
    for (int32_t v = 0; v < nv; v++) {
        if (last_use[v] != -1) continue;
        int32_t producer = af_graph_value(g, v)->producer;
        last_use[v] = producer >= 0 ? producer : (nn > 0 ? 0 : nn);
    }
    /* counting sort of values by release step */
    int32_t *count = p->release_start;
    for (int32_t v = 0; v < nv; v++)
        if (last_use[v] < nn) count[last_use[v] + 1]++;
    for (int32_t i = 0; i < nn; i++) count[i + 1] += count[i];
    int32_t *fill = malloc(((size_t)nn + 1) * sizeof(int32_t));
    if (!fill) {
        free(last_use);
        return af_error_set(AF_ERR_NOMEM, "out of memory planning a program");
    }
    memcpy(fill, count, ((size_t)nn + 1) * sizeof(int32_t));
    for (int32_t v = 0; v < nv; v++)
        if (last_use[v] < nn) p->release[fill[last_use[v]]++] = v;
    free(fill);
    free(last_use);
    return AF_OK;
}

void af_program_free(af_program *p) {
    if (!p) return;
    if (p->steps)
        for (int32_t i = 0; i < af_graph_num_nodes(p->graph); i++) af_extern_free(p->steps[i]);
    free(p->steps);
    free(p->release);
    free(p->release_start);
    free(p->input_ids);
    free(p->input_metas);
    free(p->input_names);
    free(p->values);
    af_graph_free(p->graph);
    free(p);
}

int af_program_new(af_graph *g, af_program **out) {
    if (!g || !out) return af_error_set(AF_ERR_INVALID, "af_program_new: NULL argument");
    int st = af_graph_verify(g);
    if (st) return st;
    if ((st = af_bridge_init())) return st;
    af_program *p = calloc(1, sizeof *p);
    if (!p) return af_error_set(AF_ERR_NOMEM, "out of memory allocating a program");
    p->graph = g;
    p->check_inputs = 1;
    int32_t nn = af_graph_num_nodes(g), nv = af_graph_num_values(g), ni = af_graph_num_inputs(g);
    p->steps = calloc((size_t)nn + 1, sizeof *p->steps);
    p->values = calloc((size_t)nv + 1, sizeof *p->values);
    p->input_ids = malloc(((size_t)ni + 1) * sizeof *p->input_ids);
    p->input_metas = malloc(((size_t)ni + 1) * sizeof *p->input_metas);
    p->input_names = malloc(((size_t)ni + 1) * sizeof *p->input_names);
    if (!p->steps || !p->values || !p->input_ids || !p->input_metas || !p->input_names) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory allocating a program");
        goto error;
    }
    for (int32_t i = 0; i < ni; i++) {
        const af_value *v = af_graph_value(g, af_graph_input(g, i));
        p->input_ids[i] = af_graph_input(g, i);
        p->input_metas[i] = &v->meta;
        p->input_names[i] = v->name;
    }
    if ((st = plan_releases(p))) goto error;
    for (int32_t i = 0; i < nn; i++)
        if ((st = af_extern_new(g, i, &p->steps[i]))) goto error;
    *out = p;
    return AF_OK;
error:
    p->graph = NULL; /* still the caller's */
    af_program_free(p);
    return st;
}

const af_graph *af_program_graph(const af_program *p) { return p ? p->graph : NULL; }

void af_program_set_check_inputs(af_program *p, int enabled) {
    if (p) p->check_inputs = enabled != 0;
}

static void release_all(af_program *p) {
    int32_t nv = af_graph_num_values(p->graph);
    for (int32_t v = 0; v < nv; v++) {
        af_obj_release(p->values[v]);
        p->values[v] = NULL;
    }
}

int af_program_run(af_program *p, af_obj *const *inputs, int32_t n_inputs, af_obj **outputs) {
    if (!p || (n_inputs > 0 && !inputs) || !outputs) return af_error_set(AF_ERR_INVALID, "af_program_run: NULL argument");
    const af_graph *g = p->graph;
    int32_t ni = af_graph_num_inputs(g), nn = af_graph_num_nodes(g), no = af_graph_num_outputs(g);
    if (n_inputs != ni)
        return af_error_set(AF_ERR_INVALID, "program takes %d inputs, got %d", (int)ni, (int)n_inputs);
    if (p->running)
        return af_error_set(AF_ERR_RUNTIME, "program is already running (re-entered from an extern call)");
    int st;
    if (p->check_inputs &&
        (st = af_bridge_check_tensors(inputs, p->input_metas, p->input_names, ni)))
        return st;
    p->running = 1;
    for (int32_t i = 0; i < ni; i++) {
        af_obj_retain(inputs[i]);
        p->values[p->input_ids[i]] = inputs[i];
    }
    for (int32_t i = 0; i < nn; i++) {
        const af_node *n = af_graph_node(g, i);
        if ((st = af_extern_call(p->steps[i], p->values, &p->values[n->first_output]))) {
            release_all(p);
            p->running = 0;
            return st;
        }
        for (int32_t r = p->release_start[i]; r < p->release_start[i + 1]; r++) {
            af_obj_release(p->values[p->release[r]]);
            p->values[p->release[r]] = NULL;
        }
    }
    for (int32_t o = 0; o < no; o++) {
        outputs[o] = p->values[af_graph_output(g, o)];
        af_obj_retain(outputs[o]);
    }
    release_all(p);
    p->running = 0;
    return AF_OK;
}
