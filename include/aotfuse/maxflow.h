/* Max-flow / min-cut (Dinic) on a compact edge list, with 64-bit capacities and an infinite one.
 *
 * Vertices are 0 .. n-1. Edges are added one by one (each also stores its residual twin).
 * After af_flow_solve, af_flow_source_side marks the vertices still reachable from the source
 * in the residual graph: the minimum cut is every edge from a marked to an unmarked vertex.
 * A flow owns all its memory; af_flow_free releases it.
 */
#ifndef AOTFUSE_MAXFLOW_H
#define AOTFUSE_MAXFLOW_H

#include <stdint.h>

#include "aotfuse/status.h"

/* An edge that can never be cut. Finite capacities must be below it; sums saturate at it. */
#define AF_FLOW_INF ((int64_t)1 << 62)

typedef struct af_flow af_flow;

/* A flow network with n vertices and no edges. */
int af_flow_new(int32_t n_vertices, af_flow **out);

void af_flow_free(af_flow *f); /* NULL allowed */

/* Adds a directed edge; capacity in [0, AF_FLOW_INF] (values above are taken as infinite). */
int af_flow_add_edge(af_flow *f, int32_t from, int32_t to, int64_t capacity);

/* Computes a maximum flow from s to t into *value: AF_FLOW_INF when an infinite path exists
 * (then no finite cut separates them). May be called once per network. */
int af_flow_solve(af_flow *f, int32_t s, int32_t t, int64_t *value);

/* After a solve: side[v] = 1 when v is on the source side of the minimum cut, else 0. */
int af_flow_source_side(const af_flow *f, uint8_t *side);

int32_t af_flow_num_vertices(const af_flow *f);
int32_t af_flow_num_edges(const af_flow *f); /* edges added (residual twins not counted) */

#endif
