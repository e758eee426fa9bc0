/* Dinic's max-flow: BFS levels, then blocking flows by iterative DFS over a forward-star
 * edge list (edge e's residual twin is e ^ 1). O(V^2 E) worst case, far less on the
 * layered DAG-like networks the partitioner builds. */
#include "aotfuse/maxflow.h"

#include <stdlib.h>
#include <string.h>

struct af_flow {
    int32_t n;
    int32_t n_edges, cap_edges; /* counts residual twins */
    int32_t *head;              /* n: first edge out of each vertex, -1 if none */
    int32_t *next;              /* per edge: next edge out of the same vertex */
    int32_t *to;
    int64_t *cap;               /* residual capacity */
    int32_t *level, *iter, *queue;
    int32_t *stack_v, *stack_e;
    int32_t source;             /* set by solve; -1 before */
};

int af_flow_new(int32_t n, af_flow **out) {
    if (!out || n < 2) return af_error_set(AF_ERR_INVALID, "af_flow_new: need at least 2 vertices, got %d", (int)n);
    af_flow *f = calloc(1, sizeof *f);
    if (!f) return af_error_set(AF_ERR_NOMEM, "out of memory allocating a flow network");
    f->n = n;
    f->source = -1;
    size_t vn = (size_t)n;
    f->head = malloc(vn * sizeof(int32_t));
    f->level = malloc(vn * sizeof(int32_t));
    f->iter = malloc(vn * sizeof(int32_t));
    f->queue = malloc(vn * sizeof(int32_t));
    f->stack_v = malloc(vn * sizeof(int32_t));
    f->stack_e = malloc(vn * sizeof(int32_t));
    if (!f->head || !f->level || !f->iter || !f->queue || !f->stack_v || !f->stack_e) {
        af_flow_free(f);
        return af_error_set(AF_ERR_NOMEM, "out of memory allocating a flow network of %d vertices", (int)n);
    }
    for (int32_t v = 0; v < n; v++) f->head[v] = -1;
    *out = f;
    return AF_OK;
}

void af_flow_free(af_flow *f) {
    if (!f) return;
    free(f->head);
    free(f->next);
    free(f->to);
    free(f->cap);
    free(f->level);
    free(f->iter);
    free(f->queue);
    free(f->stack_v);
    free(f->stack_e);
    free(f);
}

static int reserve_edges(af_flow *f, int32_t need) {
    if (need <= f->cap_edges) return AF_OK;
    if (need > INT32_MAX / 2) return af_error_set(AF_ERR_INVALID, "flow network too large");
    int32_t ncap = f->cap_edges ? f->cap_edges : 64;
    while (ncap < need) ncap *= 2;
    int32_t *next = realloc(f->next, (size_t)ncap * sizeof(int32_t));
    if (next) f->next = next;
    int32_t *to = realloc(f->to, (size_t)ncap * sizeof(int32_t));
    if (to) f->to = to;
    int64_t *cap = realloc(f->cap, (size_t)ncap * sizeof(int64_t));
    if (cap) f->cap = cap;
    if (!next || !to || !cap) return af_error_set(AF_ERR_NOMEM, "out of memory growing a flow network");
    f->cap_edges = ncap;
    return AF_OK;
}

int af_flow_add_edge(af_flow *f, int32_t from, int32_t to, int64_t capacity) {
    if (!f) return af_error_set(AF_ERR_INVALID, "af_flow_add_edge: network is NULL");
    if (from < 0 || from >= f->n || to < 0 || to >= f->n)
        return af_error_set(AF_ERR_INVALID, "edge %d -> %d outside vertices 0..%d", (int)from, (int)to, (int)f->n - 1);
    if (capacity < 0) return af_error_set(AF_ERR_INVALID, "edge %d -> %d: negative capacity", (int)from, (int)to);
    if (f->source >= 0) return af_error_set(AF_ERR_INVALID, "af_flow_add_edge after af_flow_solve");
    int st = reserve_edges(f, f->n_edges + 2);
    if (st) return st;
    if (capacity > AF_FLOW_INF) capacity = AF_FLOW_INF;
    int32_t e = f->n_edges;
    f->to[e] = to;
    f->cap[e] = capacity;
    f->next[e] = f->head[from];
    f->head[from] = e;
    f->to[e + 1] = from;
    f->cap[e + 1] = 0;
    f->next[e + 1] = f->head[to];
    f->head[to] = e + 1;
    f->n_edges += 2;
    return AF_OK;
}

/* Levels from s over edges with residual capacity; returns whether t is reachable. */
static int bfs_levels(af_flow *f, int32_t s, int32_t t) {
    for (int32_t v = 0; v < f->n; v++) f->level[v] = -1;
    int32_t qh = 0, qt = 0;
    f->level[s] = 0;
    f->queue[qt++] = s;
    while (qh < qt) {
        int32_t v = f->queue[qh++];
        for (int32_t e = f->head[v]; e >= 0; e = f->next[e])
            if (f->cap[e] > 0 && f->level[f->to[e]] < 0) {
                f->level[f->to[e]] = f->level[v] + 1;
                f->queue[qt++] = f->to[e];
            }
    }
    return f->level[t] >= 0;
}

/* One augmenting path along increasing levels, found by iterative DFS with per-vertex edge
 * cursors (iter) so dead ends are never revisited within a phase. Returns the amount pushed. */
static int64_t augment(af_flow *f, int32_t s, int32_t t) {
    int32_t depth = 0;
    f->stack_v[0] = s;
    for (;;) {
        int32_t v = f->stack_v[depth];
        if (v == t) {
            int64_t push = AF_FLOW_INF;
            for (int32_t d = 0; d < depth; d++)
                if (f->cap[f->stack_e[d]] < push) push = f->cap[f->stack_e[d]];
            for (int32_t d = 0; d < depth; d++) {
                int32_t e = f->stack_e[d];
                if (f->cap[e] < AF_FLOW_INF) f->cap[e] -= push; /* infinite edges stay infinite */
                if (f->cap[e ^ 1] < AF_FLOW_INF) {
                    int64_t r = f->cap[e ^ 1] + push;
                    f->cap[e ^ 1] = r > AF_FLOW_INF ? AF_FLOW_INF : r;
                }
            }
            return push;
        }
        int32_t e = f->iter[v];
        while (e >= 0 && !(f->cap[e] > 0 && f->level[f->to[e]] == f->level[v] + 1)) e = f->next[e];
        f->iter[v] = e;
        if (e >= 0) {
            f->stack_e[depth] = e;
            f->stack_v[++depth] = f->to[e];
            continue;
        }
        /* dead end: retreat and skip the edge that led here */
        f->level[v] = -1;
        if (depth == 0) return 0;
        depth--;
        int32_t u = f->stack_v[depth];
        f->iter[u] = f->next[f->iter[u]];
    }
}

int af_flow_solve(af_flow *f, int32_t s, int32_t t, int64_t *value) {
    if (!f || !value) return af_error_set(AF_ERR_INVALID, "af_flow_solve: NULL argument");
    if (s < 0 || s >= f->n || t < 0 || t >= f->n || s == t)
        return af_error_set(AF_ERR_INVALID, "af_flow_solve: bad source %d / sink %d", (int)s, (int)t);
    if (f->source >= 0) return af_error_set(AF_ERR_INVALID, "af_flow_solve: already solved");
    f->source = s;
    int64_t total = 0;
    while (total < AF_FLOW_INF && bfs_levels(f, s, t)) {
        memcpy(f->iter, f->head, (size_t)f->n * sizeof(int32_t));
        int64_t pushed;
        while (total < AF_FLOW_INF && (pushed = augment(f, s, t)) > 0) {
            total = (pushed >= AF_FLOW_INF - total) ? AF_FLOW_INF : total + pushed;
        }
    }
    *value = total;
    return AF_OK;
}

int af_flow_source_side(const af_flow *f, uint8_t *side) {
    if (!f || !side) return af_error_set(AF_ERR_INVALID, "af_flow_source_side: NULL argument");
    if (f->source < 0) return af_error_set(AF_ERR_INVALID, "af_flow_source_side before af_flow_solve");
    memset(side, 0, (size_t)f->n);
    int32_t qh = 0, qt = 0;
    side[f->source] = 1;
    f->queue[qt++] = f->source;
    while (qh < qt) {
        int32_t v = f->queue[qh++];
        for (int32_t e = f->head[v]; e >= 0; e = f->next[e])
            if (f->cap[e] > 0 && !side[f->to[e]]) {
                side[f->to[e]] = 1;
                f->queue[qt++] = f->to[e];
            }
    }
    return AF_OK;
}

int32_t af_flow_num_vertices(const af_flow *f) { return f ? f->n : 0; }
int32_t af_flow_num_edges(const af_flow *f) { return f ? f->n_edges / 2 : 0; }
