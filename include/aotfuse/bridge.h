/* The torch bridge: the only part of the core that knows how torch is reached.
 *
 * Objects the runtime moves around (tensors, and whatever else an op returns) are opaque
 * af_obj references; the bridge retains and releases them. An extern is a node resolved
 * once, at program build time, into something the bridge can call many times.
 *
 * Routes to torch (see docs/ARCHITECTURE.md for the why):
 *   - tensor metadata (sizes, strides, dtype, device, data pointer): torch's stable C shim,
 *     aoti_torch_* functions looked up with dlsym in torch's own library after `import torch`;
 *   - extern ATen calls: the op's OpOverload called through the Python C API, which accepts
 *     every schema type (Scalar, optional lists, devices) on every supported torch version.
 *
 * All functions need the GIL. Errors: AF_ERR_* with af_error_message(); when an extern
 * raised a Python exception, that exception is left set for module.c to re-raise.
 */
#ifndef AOTFUSE_BRIDGE_H
#define AOTFUSE_BRIDGE_H

#include "aotfuse/codegen.h"
#include "aotfuse/ir.h"

typedef struct af_obj af_obj;       /* a torch object (a PyObject underneath) */
typedef struct af_extern af_extern; /* a node resolved into a callable */

/* Resolves torch's objects and shim symbols; idempotent. Needs torch imported. */
int af_bridge_init(void);

/* Which shim functions were found: a static list of names and a found flag each. */
int af_bridge_shim_count(void);
const char *af_bridge_shim_name(int i);
int af_bridge_shim_found(int i);

/* The ATen overloads extern calls reach through their torch.<name> Python binding instead of the
 * overload's boxed callable (bridge.c, fast_bindings): i-th entry's overload name, its binding's
 * name in *binding, and in *out whether out= calls use the binding too; NULL past the end. */
const char *af_bridge_fast_binding(int i, const char **binding, int *out);

void af_obj_retain(af_obj *o);
void af_obj_release(af_obj *o); /* NULL allowed */
/* Whether the caller's reference is the only one to o (no other holder of this object; views of
 * its storage are other objects, which this does not see). */
int af_obj_sole_ref(const af_obj *o);
/* Whether o's data is ours alone: the only reference to the object, its TensorImpl held by it
 * alone, its storage by that TensorImpl alone (no view, no autograd saved variable) and by no kept
 * storage object, and that storage torch's own (resizable: not from_numpy's); 0 on any doubt. A
 * program input that passes may be written into (a kernel's output in place). */
int af_obj_sole_owner(const af_obj *o);

/* Resolves node `node_index` of `g` into *out (owned by the caller, freed by af_extern_free). */
int af_extern_new(const af_graph *g, int32_t node_index, af_extern **out);
void af_extern_free(af_extern *e); /* NULL allowed */
/* Whether the extern's results may share storage with its arguments, or it writes an argument:
 * its schema annotates an alias (views, in-place ops; also 1 for an op without a schema). */
int af_extern_may_alias(const af_extern *e);

/* Calls the extern on `values` (indexed by value id; those it reads must be set) and writes
 * its node's n_outputs results into outs as new references. On error outs is untouched. */
int af_extern_call(af_extern *e, af_obj *const *values, af_obj **outs);

/* Whether the extern (one tensor result) has an out= overload: the same arguments and one
 * written tensor. af_extern_call_into calls it, writing into `into` (a tensor with the result's
 * exact layout, nothing else reading it): AF_OK with *out a new reference to `into`, or
 * AF_BRIDGE_NOT_INTO (> 0, not an error; no Python error left set) when the overload refused,
 * e.g. under autograd; the caller then makes the plain call. */
#define AF_BRIDGE_NOT_INTO 2
int af_extern_can_write_into(const af_extern *e);
int af_extern_call_into(af_extern *e, af_obj *const *values, af_obj *into, af_obj **out);

/* Checks that each objs[i] is a tensor matching metas[i] exactly (dtype, device, sizes,
 * strides), reading metadata through the C shim. `names` label the error. */
int af_bridge_check_tensors(af_obj *const *objs, const af_tensor_meta *const *metas,
                            const char *const *names, int32_t n);

/* Data pointers of n tensors (through the C shim), for a kernel compiled for metas: AF_OK with
 * ptrs filled, AF_BRIDGE_LAYOUT_MISMATCH (> 0, not an error) when some tensor's dtype, sizes or
 * strides differ from what the kernel was compiled for, or an AF_ERR_* status. */
#define AF_BRIDGE_LAYOUT_MISMATCH 1
int af_bridge_tensor_data(af_obj *const *objs, const af_tensor_meta *const *metas, int32_t n, void **ptrs);
/* Data pointers of n tensors without checking their layouts (Tensor.data_ptr()): for operands
 * whose layouts an earlier run checked and that cannot change (see runtime.c). */
int af_bridge_data_ptrs(af_obj *const *objs, int32_t n, void **ptrs);
/* t's storage offset, in elements (Tensor.storage_offset()). */
int af_bridge_storage_offset(af_obj *t, int64_t *out);

/* A new uninitialized tensor with meta's sizes, strides, dtype and device, from torch's
 * allocator (so torch's memory statistics see it). */
int af_bridge_empty(const af_tensor_meta *meta, af_obj **out);
/* The same, with the call's Python arguments kept in *args (built at the first call, NULL before;
 * the caller releases it with af_obj_release): later calls allocate without rebuilding them. */
int af_bridge_empty_cached(const af_tensor_meta *meta, af_obj **args, af_obj **out);

/* torch's current CUDA stream on `device` (the raw cudaStream_t; NULL is the default stream). */
int af_bridge_cuda_stream(int32_t device, void **stream);

/* dst.copy_(src): src's values into dst's layout. */
int af_bridge_copy_into(af_obj *dst, af_obj *src);

/* Views without the dispatcher (torch._C._dynamo.guards._reinterpret_tensor, as inductor's
 * generated code makes them): whether this torch has it; a new tensor on base's storage with m's
 * sizes and strides, its storage offset base's plus offset_delta elements. */
int af_bridge_can_reinterpret(void);
int af_bridge_reinterpret(af_obj *base, const af_tensor_meta *m, int64_t offset_delta, af_obj **out);
/* The same, its size, stride and offset arguments built once into *args (NULL the first time, and
 * built again where offset_delta changed; the caller owns and releases it): a view step made on
 * every run. */
int af_bridge_reinterpret_cached(af_obj *base, const af_tensor_meta *m, int64_t offset_delta, af_obj **args, af_obj **out);
/* Whether objs[1] is the view of objs[0] that metas describe (both layouts as given, and their
 * data pointers apart by the difference of the metas' storage offsets): AF_OK, or
 * AF_BRIDGE_LAYOUT_MISMATCH. */
int af_bridge_same_view(af_obj *const *objs, const af_tensor_meta *const *metas);

/* torch.get_num_threads(): how many threads generated CPU kernels use (as torch's own ops do). */
int af_bridge_num_threads(int *n);

/* Calls a compiled kernel body (codegen.h) with the GIL released. */
void af_bridge_run_kernel(af_body_fn fn, char *const *ptrs, const uint64_t *streams, const int64_t *sizes, int num_threads);

#endif
