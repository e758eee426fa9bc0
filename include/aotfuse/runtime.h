/* The runtime: runs a graph as a flat list of steps.
 *
 * A program owns its graph and one step per node (today every step is an extern call through
 * the bridge; fused kernels will be another kind of step). Each intermediate is released right
 * after its last use, so peak memory is what the program needs, not what the graph holds.
 * Needs the GIL (the bridge does).
 */
#ifndef AOTFUSE_RUNTIME_H
#define AOTFUSE_RUNTIME_H

#include "aotfuse/bridge.h"
#include "aotfuse/ir.h"

typedef struct af_program af_program;

/* Verifies g, plans it and resolves its steps. On success the program owns g (freed with it);
 * on failure g is still the caller's. */
int af_program_new(af_graph *g, af_program **out);

void af_program_free(af_program *p); /* NULL allowed */

const af_graph *af_program_graph(const af_program *p);

/* Whether af_program_run checks each input against the graph's input metadata (default on). */
void af_program_set_check_inputs(af_program *p, int enabled);

/* Runs the program: `inputs` (borrowed, one per graph input), results into `outputs` (new
 * references, one per graph output). On error every reference taken is released. */
int af_program_run(af_program *p, af_obj *const *inputs, int32_t n_inputs, af_obj **outputs);

#endif
